"""The tensor-core mark: Gemm, MatMul and Conv nodes of the main graph, the products of Winograd
convolutions and fVDB's SparseConv3d (its gather-GEMM over a kernel map), take the tensor-core tile (operators/tiled_mma.py) on CUDA's blocks stages, where
compile(tensor_cores="auto") found the route live (luisaml/tensor_cores.py). A node whose product is
too small for the tile (a side under a warp's, as a grouped Conv's few channels a group) keeps
tiled.py's. SparseConv3d only where LUISAML_SPARSE_MMA=on: its mma tile measured slower than its FP32
tile (below)."""
from __future__ import annotations

import os

KINDS = ("Gemm", "MatMul", "Conv")
# the rewrites' nodes of luisaml's domain that are products (operators/winograd.py: the input and
# output transforms are not)
OWN_KINDS = ("WinogradProduct",)
# fVDB's sparse convolution: rows the output voxels, k the taps x input channels (operators/fvdb/conv.py)
FVDB_KINDS = ("SparseConv3d",)
# ... marked only where this environment variable is "on" (read at each mark): on an H100 (2026-12-07,
# bench_fvdb.py --tensor-cores --only-layers) the 3 x 3 x 3 64 -> 64 layer over 198k voxels took 1.76 ms on
# the mma tile against 0.93 on the FP32 tile (0.53x; benchmarks/NOTES.md, "The first GPU run in three
# sessions"), so tensor_cores="auto" leaves it on the FP32 tile; bench_fvdb.py and the tests set it to
# measure and check the mma form
SPARSE_MMA_ENV = "LUISAML_SPARSE_MMA"


def sparse_mma() -> bool:
    """Whether SparseConv3d takes the tensor-core tile (LUISAML_SPARSE_MMA=on)."""
    return os.environ.get(SPARSE_MMA_ENV, "off") == "on"


def mark(plan, kind: str = "tf32") -> list[str]:
    """Give every float Gemm, MatMul, Conv, Winograd product (and SparseConv3d where sparse_mma()) of the
    plan's main graph the tensor-core tile of `kind`; return the names of the nodes marked."""
    done, sparse = [], sparse_mma()
    for node, op in plan.main.ops:
        ours = node.op_type in KINDS and node.domain in ("", "ai.onnx") or \
            node.op_type in OWN_KINDS and node.domain == "luisaml" or \
        sparse and node.op_type in FVDB_KINDS and node.domain == "fvdb"
        if ours and hasattr(op, "tensor_cores"):
            op.tensor_cores = kind
            done.append(node.name)
    return done
