"""The tensor-core mark: Gemm and MatMul nodes of the main graph take the tensor-core tile
(operators/tiled_mma.py) on CUDA's blocks stages, where compile(tensor_cores="auto") found the route
live (luisaml/tensor_cores.py). A node whose product is too small for the tile keeps tiled.py's."""
from __future__ import annotations

KINDS = ("Gemm", "MatMul")


def mark(plan, kind: str = "tf32") -> list[str]:
    """Give every float Gemm and MatMul of the plan's main graph the tensor-core tile of `kind`;
    return the names of the nodes marked."""
    done = []
    for node, op in plan.main.ops:
        if node.op_type in KINDS and node.domain in ("", "ai.onnx") and hasattr(op, "tensor_cores"):
            op.tensor_cores = kind
            done.append(node.name)
    return done
