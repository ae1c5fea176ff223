"""The tensor-core mark: Gemm, MatMul and Conv nodes of the main graph, the products of Winograd
convolutions and fVDB's SparseConv3d (its gather-GEMM over a kernel map), take the tensor-core tile (operators/tiled_mma.py) on CUDA's blocks stages, where
compile(tensor_cores="auto") found the route live (luisaml/tensor_cores.py). A node whose product is
too small for the tile (a side under a warp's, as a grouped Conv's few channels a group) keeps
tiled.py's."""
from __future__ import annotations

KINDS = ("Gemm", "MatMul", "Conv")
# the rewrites' nodes of luisaml's domain that are products (operators/winograd.py: the input and
# output transforms are not)
OWN_KINDS = ("WinogradProduct",)
# fVDB's sparse convolution: rows the output voxels, k the taps x input channels (operators/fvdb/conv.py)
FVDB_KINDS = ("SparseConv3d",)


def mark(plan, kind: str = "tf32") -> list[str]:
    """Give every float Gemm, MatMul, Conv, Winograd product and SparseConv3d of the plan's main graph the
    tensor-core tile of `kind`; return the names of the nodes marked."""
    done = []
    for node, op in plan.main.ops:
        ours = node.op_type in KINDS and node.domain in ("", "ai.onnx") or \
            node.op_type in OWN_KINDS and node.domain == "luisaml" or \
        node.op_type in FVDB_KINDS and node.domain == "fvdb"
        if ours and hasattr(op, "tensor_cores"):
            op.tensor_cores = kind
            done.append(node.name)
    return done
