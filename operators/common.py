"""Pieces several operator families share."""
from __future__ import annotations

from luisaml.codegen import KernelContext
from luisaml.indexing import broadcast_index
from luisaml.storage import Tensor


def emit_map(ctx: KernelContext, out: Tensor, inputs: list[Tensor], combine, broadcast: bool = True) -> None:
    """Emit out[i] = combine(element of each input at i) over out (shaders/map.py.j2); inputs are
    broadcast to the output's shape, or read at the same flat index when broadcast=False."""
    names = [ctx.fresh("v") for _ in inputs]
    if broadcast:
        loads = [(n, (lambda t: lambda i: bload(t, out, i))(t)) for n, t in zip(names, inputs)]
    else:
        loads = [(n, t.load) for n, t in zip(names, inputs)]
    ctx.render("map.py.j2", n=out.numel, i=ctx.fresh("i"), loads=loads, store=out.store, value=combine(*names))


def bload(t: Tensor, out: Tensor, i: str) -> str:
    """Return the load of t's element broadcast to out's element i."""
    return t.load(broadcast_index(i, out.shape, t.shape))


def convert(expr: str, src, dst) -> str:
    """Return the DSL converting a value of DType src to DType dst (ONNX Cast semantics)."""
    if src.dsl == dst.dsl:
        return expr
    if dst.is_bool:
        zero = "0.0" if src.dsl == "float" else ("half(0.0)" if src.dsl == "half" else "0")
        return f"({expr} != {zero})"
    if src.is_bool:
        one = {"float": "1.0", "half": "half(1.0)", "int": "1", "uint": "uint(1)"}[dst.dsl]
        zero = {"float": "0.0", "half": "half(0.0)", "int": "0", "uint": "uint(0)"}[dst.dsl]
        return f"({one} if {expr} else {zero})"
    return f"{dst.dsl}({expr})"
