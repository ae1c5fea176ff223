"""Pieces several operator families share: the elementwise map, Cast conversion, strided copies
over coalesced loop nests, the dtype arithmetic is done in, and the CPU tiles' epilogue as a loop
over a tile's columns (Gemm, MatMul, Conv)."""
from __future__ import annotations

from luisaml import dtypes
from luisaml.codegen import KernelContext
from luisaml.dtypes import DType
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


_ZERO = {"float": "0.0", "half": "half(0.0)", "int": "0", "uint": "uint(0)"}
_ONE = {"float": "1.0", "half": "half(1.0)", "int": "1", "uint": "uint(1)"}


def convert(expr: str, src: DType, dst: DType) -> str:
    """Return the DSL converting a value of DType src to DType dst (ONNX Cast semantics)."""
    if src.dsl == dst.dsl:
        return expr
    if dst.is_bool:
        return f"({expr} != {_ZERO[src.dsl]})"
    if src.is_bool:
        return f"({_ONE[dst.dsl]} if {expr} else {_ZERO[dst.dsl]})"
    return f"{dst.dsl}({expr})"


def compute_dtype(dt: DType) -> DType:
    """Return the dtype arithmetic on dt is done in: float for half (rounded once at the end,
    as onnxruntime does), the type itself otherwise."""
    return dtypes.FLOAT if dt.dsl == "half" else dt


def abs_expr(x: str, dt: DType) -> str:
    """Return |x|; for ints a select, since luisa-python's integer abs aborts the CUDA backend's
    compile (0.3.7)."""
    return f"abs({x})" if dt.is_float else f"({x} if {x} >= 0 else -{x})"


def max_fn(ctx: KernelContext, dt: DType) -> str:
    """Return the name of the DSL function for max in dtype dt: numpy's maximum, NaN when either
    operand is (shaders/dsl_lib.py::max_nan), for floats; the builtin for the others."""
    return ctx.use_helper("max_nan") if dt.dsl in ("float", "half") else "max"


def min_fn(ctx: KernelContext, dt: DType) -> str:
    """Return the name of the DSL function for min in dtype dt (NaN-propagating for floats)."""
    return ctx.use_helper("min_nan") if dt.dsl in ("float", "half") else "min"


def upcast(expr: str, dt: DType) -> str:
    """Return expr (of dtype dt) converted to compute_dtype(dt)."""
    return convert(expr, dt, compute_dtype(dt))


def load_f(t: Tensor, i: str) -> str:
    """Return the load of element i of t in its compute dtype (half widened to float)."""
    return upcast(t.load(i), t.dtype)


def coalesce(sizes, *strides) -> tuple[list[int], list[list[int]]]:
    """Return (sizes, strides per set) with size-1 dims dropped and neighbouring dims merged where
    every stride set walks them as one: fewer loops for the same element order."""
    out_sizes: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for d, n in enumerate(sizes):
        if n == 1:
            continue
        if out_sizes and all(s[-1] == st[d] * n for s, st in zip(out_strides, strides)):
            out_sizes[-1] *= n
            for s, st in zip(out_strides, strides):
                s[-1] = st[d]
            continue
        out_sizes.append(int(n))
        for s, st in zip(out_strides, strides):
            s.append(int(st[d]))
    return out_sizes, out_strides


def loop_vars(ctx: KernelContext, sizes, prefix: str = "i", *, unit_zero: bool = False) -> list[tuple[str, int]]:
    """Return fresh (variable, size) pairs for a loop nest over sizes; unit_zero: "0" instead of a
    variable for a dimension of one (the window loops of convolutions and pools)."""
    return [("0" if unit_zero and n <= 1 else ctx.fresh(prefix), int(n)) for n in sizes]


def affine(base, loops: list[tuple[str, int]], strides: list[int]) -> str:
    """Return the DSL of base + sum(var * stride) over a loop nest."""
    from luisaml import indexing as ix

    return ix.add(str(base), *(ix.mul(v, s) for (v, _), s in zip(loops, strides)))


def emit_copy(ctx: KernelContext, sizes, dst_strides, dst_base, src_strides, src_base, load, store) -> None:
    """Emit store(dst_base + c.dst_strides, load(src_base + c.src_strides)) for every coordinate c
    of `sizes` (shaders/copy.py.j2): the body of transposes, slices, concats and splits."""
    sizes, (dst_s, src_s) = coalesce(sizes, dst_strides, src_strides)
    loops = loop_vars(ctx, sizes)
    ctx.render(
        "copy.py.j2",
        loops=loops,
        dst=affine(dst_base, loops, dst_s),
        src=affine(src_base, loops, src_s),
        load=load,
        store=store,
    )


def reduction_loops(ctx: KernelContext, x: Tensor, axes: list[int]):
    """Return (kept loops, their x strides, their out strides, reduced loops, their x strides) for
    reducing x over `axes`: the output is x's kept dims in order, row-major (with or without
    size-1 dims for the reduced ones: they do not change flat indices)."""
    from luisaml.storage import row_major_strides

    kept = [d for d in range(x.rank) if d not in axes]
    kept_sizes = [x.shape[d] for d in kept]
    ksizes, (kx, ky) = coalesce(kept_sizes, [x.strides[d] for d in kept], row_major_strides(tuple(kept_sizes)))
    rsizes, (rx,) = coalesce([x.shape[d] for d in sorted(axes)], [x.strides[d] for d in sorted(axes)])
    return loop_vars(ctx, ksizes, "o"), kx, ky, loop_vars(ctx, rsizes, "r"), rx


def loops_epilogue(setting: bool | str, y: Tensor) -> bool:
    """Whether a CPU tile stores through y's epilogue in a loop over its columns (emit_epilogue_loop):
    setting True (every epilogue), False (none) or "gelu" (an epilogue of several nodes with an Erf
    or a Gelu). clang's SLP vectoriser, seeded by a tile's consecutive stores, gives up on torch's
    GELU chain and leaves the whole tile scalar, but the loop costs simpler epilogues 5-10% and an
    Erf alone 30% (benchmarks/NOTES.md, "A branch-free erf")."""
    chain = getattr(y.storage, "chain", None) or []
    return setting is True or (setting == "gelu" and len(chain) > 1 and any(
        node.op_type in ("Erf", "Gelu") for node, _ in chain))


def emit_epilogue_loop(ctx: KernelContext, acc: list[list[str]], dsl: str, count: str, store) -> None:
    """Emit a CPU tile's accumulators (rows of columns) into a local array per row, then per row a
    loop over `count` of its columns (a ragged last block: fewer) calling store(row, the column's
    variable, its value) to emit that column's epilogue and store: clang's loop vectoriser takes
    the loop where its SLP vectoriser gave up on the straight-line form (Gemm, MatMul, Conv)."""
    t = [ctx.local_array(dsl, len(row), "t") for row in acc]
    for r, row in enumerate(acc):
        for j, a in enumerate(row):
            ctx.line(f"{t[r]}[{j}] = {a}")
    for r in range(len(acc)):
        jv = ctx.fresh("j")
        ctx.line(f"for {jv} in range({count}):")
        with ctx.indent():
            store(r, jv, f"{t[r]}[{jv}]")
