"""Reductions (ReduceSum/Mean/Max/Min/Prod/L1/L2/SumSquare/LogSum/LogSumExp) and ArgMax/ArgMin,
over coalesced kept and reduced loop nests (shaders/reduce.py.j2), and the line-by-line
operators CumSum, CumProd and Hardmax (`Lines`, which TopK shares). Float and half accumulate in
float (half is rounded once at the end); integers accumulate in int.

In a stage a reduction runs one thread per output element (element()), a line operator one work
item per line (emit_item()); forward() runs the same code inside loops over all of them. A fold
over a long contiguous run (PointNet's max over 1,024 points) keeps LANES accumulators over
consecutive elements and merges them at the end (Fold.lanes): one accumulator is a chain of
dependent steps, LANES of them are what clang's SLP vectoriser turns into vector steps. On CUDA a
float fold over one contiguous run of rows.MIN_LENGTH or more (a squeeze-and-excitation's ReduceMean
over H, W) takes the global pools' form instead: a warp per output, a block of warps from
rows.BLOCK_LENGTH (Fold.block_tiling, rows.fold_row)."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import (
    abs_expr,
    affine,
    compute_dtype,
    coalesce,
    convert,
    max_fn,
    min_fn,
    reduction_loops,
    upcast,
)


def kept_base(ctx, i: str, kept, kx) -> str:
    """Return the flat index in x of the first element reduced into output element i (a row of
    a Softmax): i enumerates the kept coordinates in order (common.reduction_loops)."""
    return ctx.let(ix.ravel(ix.unravel(i, tuple(n for _, n in kept)), tuple(kx)), "base")


class Reduce(Operator):
    """Reduce over `axes` (an attribute, or from `axes_input` on, an optional constant input
    with noop_with_empty_axes); no axes reduces everything; keepdims keeps size-1 dims."""

    kinds: tuple[str, ...] = ("float", "int")
    axes_input = False  # opset 13 (ReduceSum) / 18 (the others): axes is input 1

    def given_axes(self) -> list[int]:
        if self.axes_input:
            if not self.has_input(1):
                return []
            return [int(a) for a in np.asarray(self.const(1, "axes")).reshape(-1)]
        return [int(a) for a in self.attr("axes", [])]

    def check(self):
        x, y = self.input(0), self.output()
        self.expect_dtype(x, self.kinds, "input 0 (data)")
        axes = self.given_axes()
        noop = self.axes_input and int(self.attr("noop_with_empty_axes", 0))
        if not axes:
            axes = [] if noop else list(range(x.rank))
        norm = [self.axis(a, x.rank, batched=x.batched, what="reduced axis") for a in axes]
        self.expect(len(set(norm)) == len(norm), f"axes {axes} name an axis twice")
        self.axes = sorted(norm)
        self.count = int(np.prod([x.shape[a] for a in self.axes], dtype=np.int64))
        self.expect(self.count > 0 or x.numel == 0, f"reducing over an empty axis of '{x.name}' {list(x.shape)} is not supported")
        want = int(np.prod([d for k, d in enumerate(x.shape) if k not in self.axes], dtype=np.int64))
        self.expect(y.numel == want, f"output '{y.name}' has shape {list(y.shape)}, expected {want} elements")

    # ---- what each reduction does, in the accumulator dtype ------------------------------------
    def passes(self, ctx, first: str, load: str) -> tuple[list[dict], str]:
        """Return (passes for shaders/reduce.py.j2, the result expression)."""
        raise NotImplementedError

    def emit(self, ctx, kept, base: str, red, rx, store=None) -> str:
        """Render the reduction of the elements at base + red.rx for each coordinate of the kept
        loops (none: one output element); store(result) stores it. Return the result."""
        x, y = self.input(0), self.output()
        self.acc = compute_dtype(x.dtype)
        self.red, self.rx, self.base = red, rx, base
        first = upcast(x.load(base), x.dtype)
        passes, result = self.passes(ctx, first, upcast(x.load(affine(base, red, rx)), x.dtype))
        result = convert(result, self.result_dtype(), y.dtype)
        ctx.render("reduce.py.j2", kept=kept, red=red, passes=passes, result=result, store=store)
        return result

    def forward(self, ctx):
        x, y = self.input(0), self.output()
        if y.numel == 0:
            return
        kept, kx, ky, red, rx = reduction_loops(ctx, x, self.axes)
        self.emit(ctx, kept, affine(0, kept, kx), red, rx, lambda v: y.store(affine(0, kept, ky), v))

    def element(self, ctx, i, k=0):
        kept, kx, _, red, rx = reduction_loops(ctx, self.input(0), self.axes)
        return self.emit(ctx, [], kept_base(ctx, i, kept, kx), red, rx)

    def result_dtype(self):
        return self.acc

    def lit(self, v) -> str:
        return literal(v, self.acc)


BLOCKED_SUM = 1 << 14  # a float sum of this many elements or more is added up in blocks (Fold.blocks)
# accumulators of a fold over a contiguous run (Fold.lanes): two AVX vectors of floats, two
# independent chains (PointNet's max over 1,024 points, the stage alone: 1 lane 8.5 ms, 4 lanes 0.75,
# 8 lanes 0.51, 16 lanes 0.35; benchmarks/NOTES.md)
LANES = 16
# the shortest contiguous run that takes them (a shorter one leaves most of its elements to the tail)
LANES_MIN = 32


def fold_lanes(ctx, load, start: str, n: int, acc: str, init: str, step, merge, outer=()) -> dict:
    """Return the "lanes" of a pass of shaders/reduce.py.j2 folding the n consecutive elements from
    `start` (load(index) reads one in the accumulator's dtype; under the loops `outer`, whose
    variables start may use): LANES accumulators (the first is `acc`, the others set to `init`),
    lane l folding elements l, l + LANES, ... (step(acc, x)), the last n % LANES elements into the
    first lanes, then merged into `acc` (merge(acc, lane)). The global pools take it too."""
    accs = [acc] + [ctx.fresh("lane") for _ in range(LANES - 1)]
    q, xs = ctx.fresh("q"), [ctx.fresh("x") for _ in range(LANES)]
    body = []
    for lane in range(LANES):
        body += [f"{xs[lane]} = {load(ix.add(start, ix.mul(q, LANES), str(lane)))}",
                 f"{accs[lane]} = {step(accs[lane], xs[lane])}"]
    tail = []
    for t in range(n - n % LANES, n):
        tail += [f"{xs[t % LANES]} = {load(ix.add(start, str(t)))}", f"{accs[t % LANES]} = {step(accs[t % LANES], xs[t % LANES])}"]
    return {"init": [f"{a} = {init}" for a in accs[1:]], "outer": list(outer), "q": q, "chunks": n // LANES,
            "body": body, "tail": tail, "merge": [f"{acc} = {merge(acc, a)}" for a in accs[1:]]}


# the value a lane's partial starts from in the GPU's row form, by how partials combine (Fold.warp)
WARP_IDENTITY = {"sum": 0.0, "max": -np.inf, "min": np.inf}


class Fold(Reduce):
    """One pass: acc = init; acc = step(acc, x) for each element; result = finish(acc)."""

    init = "0"
    step = "{acc} + {x}"
    bool_step = ""  # the step for bool data (ReduceMax/Min from opset 20), where kinds allows it
    # how two accumulators merge (Fold.lanes): the step where it folds an accumulator as an element
    # (max, min, product, or, and), a plain sum where the step adds a function of the element
    merge = "{acc} + {x}"
    finish = "{acc}"
    helpers: tuple[tuple[str, str], ...] = ()  # (DSL function, shaders module) pairs finish calls

    def init_expr(self, first: str) -> str:
        return self.lit(0) if self.init == "0" else self.lit(1) if self.init == "1" else first

    def passes(self, ctx, first, load):
        for name, module in self.helpers:
            ctx.use_helper(name, module)
        acc, x = ctx.fresh("acc"), ctx.fresh("x")
        step = self.bool_step if self.acc.is_bool else self.step
        # {max} / {min}: NaN-propagating for floats (numpy's maximum.reduce), the builtins otherwise
        fns = {k: f(ctx, self.acc) for k, f in (("max", max_fn), ("min", min_fn)) if f"{{{k}}}" in step}
        p = {"init": [f"{acc} = {self.init_expr(first)}"], "x": x, "load": load}
        into = acc  # what each element is added into: the accumulator, or a long sum's block partial
        if self.acc.is_float and step.startswith("{acc} + ") and self.count >= BLOCKED_SUM:
            into = ctx.fresh("part")
            p["block"] = self.blocks(ctx, acc, into)
        elif LANES > 1 and self.red and self.rx[-1] == 1 and self.red[-1][1] >= LANES_MIN:
            merge = self.bool_step if self.acc.is_bool else self.merge
            p["lanes"] = self.lanes(ctx, acc, self.init_expr(first), lambda a, v: step.format(
                acc=a, x=v, abs_x=abs_expr(v, self.acc), **fns), lambda a, v: merge.format(acc=a, x=v, **fns))
        p["update"] = [f"{into} = {step.format(acc=into, x=x, abs_x=abs_expr(x, self.acc), **fns)}"]
        return [p], self.finish_expr(acc)

    def lanes(self, ctx, acc: str, init: str, step, merge) -> dict:
        """Return the lanes of this fold over its contiguous innermost run (fold_lanes), under the
        loops over the other reduced dimensions."""
        x = self.input(0)
        outer = self.red[:-1]
        return fold_lanes(ctx, lambda i: upcast(x.load(i), x.dtype), affine(self.base, outer, self.rx[:-1]),
                          self.red[-1][1], acc, init, step, merge, outer)

    def blocks(self, ctx, acc: str, part: str) -> dict:
        """Return the blocked loop of a long float sum (shaders/reduce.py.j2): a partial sum per
        block of about sqrt(count) elements, added into the accumulator after each block. One
        float32 accumulator over 2^28 values of 0.5 stops growing at 2^25 (each addend is under
        half its ulp); blocked, the error is that of sqrt(count) terms twice."""
        size = 1 << max(8, (self.count.bit_length() + 1) // 2)
        r = ctx.fresh("r")
        sizes = tuple(n for _, n in self.red)
        coords = ix.unravel(r, sizes) if len(sizes) > 1 else [r]
        return {"blk": ctx.fresh("blk"), "n": -(-self.count // size), "size": size, "q": ctx.fresh("q"), "r": r,
                "guard": self.count % size != 0, "count": self.count, "acc": acc, "part": part, "zero": self.lit(0),
                "coords": [f"{v} = {c}" for (v, _), c in zip(self.red, coords)]}

    def finish_expr(self, acc: str) -> str:
        return self.finish.format(acc=acc)

    # how two lanes' partials combine across a warp (rows.combine): "sum", "max", "min", or None
    # (ReduceProd, rare in exports: rows.combine has no product, so it keeps its thread per output)
    warp: str | None = "sum"

    def block_tiling(self):
        """The GPU's row form (operators/rows.py, as the global pools'): a warp per output, or a
        block of warps for a long run, where the reduced elements of each output are one contiguous
        float run. The element form gave a whole run to one thread: timm's squeeze-and-excitation
        exports its squeeze as ReduceMean over H, W, one thread summing a 112 x 112 plane. A lane
        summing BLOCKED_SUM or more elements keeps the element form, whose sum is blocked (precision)."""
        from . import rows

        x, y = self.input(0), self.output()
        if self.warp is None or y.numel == 0 or x.dtype.dsl != "float" or y.dtype.dsl != "float" or not self.axes:
            return None
        sizes, (strides,) = coalesce([x.shape[d] for d in self.axes], [x.strides[d] for d in self.axes])
        if strides != [1]:
            return None
        tiling = rows.choose_reduction(y.numel, sizes[0])
        return None if tiling is None or (self.warp == "sum" and tiling.steps >= BLOCKED_SUM) else tiling

    def emit_block(self, ctx, item: str, thread: str) -> None:
        """Emit the fold of output element `item`'s run (a row of block_tiling(): rows.fold_row),
        each lane from the fold's identity (WARP_IDENTITY), merged as Fold.lanes merges."""
        from . import rows

        x, y = self.input(0), self.output()
        self.acc = compute_dtype(x.dtype)
        for name, module in self.helpers:
            ctx.use_helper(name, module)
        fns = {k: f(ctx, self.acc) for k, f in (("max", max_fn), ("min", min_fn)) if f"{{{k}}}" in self.step}
        kept, kx, ky, _, _ = reduction_loops(ctx, x, self.axes)
        sizes = tuple(n for _, n in kept)

        def place(row):
            out = ix.ravel(ix.unravel(row, sizes), tuple(ky))
            return kept_base(ctx, row, kept, kx), lambda v: y.store(out, convert(v, self.acc, y.dtype))

        rows.fold_row(ctx, self.block_tiling(), item, thread, place, lambda i: upcast(x.load(i), x.dtype),
                      literal(WARP_IDENTITY[self.warp], self.acc),
                      lambda a, v: self.step.format(acc=a, x=v, abs_x=abs_expr(v, self.acc), **fns),
                      lambda a, v: self.merge.format(acc=a, x=v, **fns), self.warp, self.finish_expr, bind=True)


class Mean(Fold):
    def finish_expr(self, acc):
        # integer means truncate, as onnxruntime's integer ReduceMean does
        return f"{acc} / {self.lit(self.count)}" if self.acc.is_float else f"{acc} // {self.count}"


class LogSumExp(Reduce):
    """log(sum(exp(x))) as m + log(sum(exp(x - m))), m the maximum: no overflow. m only shifts:
    the builtin max may drop a NaN, which reaches the result through the sum anyway; an infinite
    m shifts by 0 instead (x - m would be inf - inf), so +inf gives +inf and all -inf gives -inf,
    as onnxruntime does."""

    kinds = ("float",)

    def passes(self, ctx, first, load):
        m, s, x1, x2 = ctx.fresh("m"), ctx.fresh("s"), ctx.fresh("x"), ctx.fresh("x")
        zero = self.lit(0)
        return [
            {"init": [f"{m} = {first}"], "x": x1, "load": load, "update": [f"{m} = max({m}, {x1})"]},
            {"init": [f"{m} = ({zero} if isinf({m}) else {m})", f"{s} = {zero}"], "x": x2, "load": load,
             "update": [f"{s} = {s} + exp({x2} - {m})"]},
        ], f"{m} + log({s})"


def _fold(name: str, init: str, step: str, finish: str = "{acc}", kinds=("float", "int"), base=Fold, bool_step="",
          helpers=(), merge="{acc} + {x}", warp="sum") -> type:
    kinds = kinds + ("bool",) if bool_step else kinds
    return type(name, (base,), {"init": init, "step": step, "finish": finish, "kinds": kinds, "bool_step": bool_step,
                                "helpers": helpers, "merge": merge, "warp": warp})


_FOLDS = {
    "ReduceSum": _fold("ReduceSum", "0", "{acc} + {x}"),
    "ReduceMean": _fold("ReduceMean", "0", "{acc} + {x}", base=Mean),
    "ReduceMax": _fold("ReduceMax", "first", "{max}({acc}, {x})", bool_step="({acc} or {x})", merge="{max}({acc}, {x})",
                       warp="max"),
    "ReduceMin": _fold("ReduceMin", "first", "{min}({acc}, {x})", bool_step="({acc} and {x})", merge="{min}({acc}, {x})",
                       warp="min"),
    "ReduceProd": _fold("ReduceProd", "1", "{acc} * {x}", merge="{acc} * {x}", warp=None),
    "ReduceL1": _fold("ReduceL1", "0", "{acc} + {abs_x}"),
    # (sqrt_f32: a Div reading it inline must not make a reciprocal square root of it)
    "ReduceL2": _fold("ReduceL2", "0", "{acc} + {x} * {x}", "sqrt_f32({acc})", ("float",),
                      helpers=(("sqrt_f32", "math_lib"),)),
    "ReduceSumSquare": _fold("ReduceSumSquare", "0", "{acc} + {x} * {x}"),
    "ReduceLogSum": _fold("ReduceLogSum", "0", "{acc} + {x}", "log({acc})", ("float",)),
    "ReduceLogSumExp": type("ReduceLogSumExp", (LogSumExp,), {}),
}

# axes moved from an attribute to an input: ReduceSum in opset 13, the others in opset 18
for _name, _cls in _FOLDS.items():
    register(_name, since=1)(_cls)
    register(_name, since=13 if _name == "ReduceSum" else 18)(type(_name, (_cls,), {"axes_input": True}))


class ArgReduce(Reduce):
    """ArgMax/ArgMin along one axis: int64 indices, the first extreme unless select_last_index.
    As onnxruntime: the first element is the start and a later one must compare better, which a
    NaN never does (nor beats one): a leading NaN is the answer, a later NaN is skipped."""

    better = ">"

    def given_axes(self):
        return [int(self.attr("axis", 0))]

    def check(self):
        super().check()
        self.expect(self.output().dtype is dtypes.INT64, f"output '{self.output().name}' must be int64")
        self.last = int(self.attr("select_last_index", 0))

    def result_dtype(self):
        return dtypes.INT64

    def passes(self, ctx, first, load):
        best, at, x = ctx.fresh("best"), ctx.fresh("at"), ctx.fresh("x")
        r = self.red[0][0] if self.red else "0"
        cmp = self.better + ("=" if self.last else "")
        update = [f"if {x} {cmp} {best}:", f"    {best} = {x}", f"    {at} = {r}"]
        return [{"init": [f"{best} = {first}", f"{at} = 0"], "x": x, "load": load, "update": update}], at


register("ArgMax", since=1)(type("ArgMax", (ArgReduce,), {"better": ">"}))
register("ArgMin", since=1)(type("ArgMin", (ArgReduce,), {"better": "<"}))


# ---- the second round: running sums and products, Hardmax ------------------------------------------


def line_loops(ctx, shape: tuple[int, ...], axis: int) -> tuple[list[tuple[str, int]], str, str, int, int]:
    """Return (the loops over every line along `axis`, the outer and inner coordinates (names, or
    "0" without a loop), the line's length, the inner extent = the line's stride)."""
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    loops = [(ctx.fresh("o"), outer), (ctx.fresh("r"), inner)]
    o, r = (v if k > 1 else "0" for v, k in loops)
    return [(v, k) for v, k in loops if k > 1], o, r, int(shape[axis]), inner


def line_start(o: str, r: str, n: int, inner: int) -> str:
    """Return the flat index of the first element of line (o, r) of lines of n elements."""
    return ix.add(ix.mul(o, n * inner), r)


class Lines(Operator):
    """An operator that treats each line along one axis on its own (CumSum, Hardmax, TopK): line()
    emits one line's code; forward loops over the lines, a stage runs one work item per line."""

    stores_once = True  # every output element is stored once and never read back

    def lines(self) -> tuple[tuple[int, ...], int]:
        """Return (the shape the lines are taken over, the axis of the lines)."""
        return tuple(self.input(0).shape), self.ax

    def empty(self) -> bool:
        """Return whether there is nothing to compute."""
        return self.output().numel == 0

    def line(self, ctx, o: str, r: str, n: int, stride: int) -> list[str]:
        """Return the lines of code of line (o, r) (line_start), n elements `stride` apart."""
        raise NotImplementedError

    def forward(self, ctx):
        if self.empty():
            return
        loops, o, r, n, stride = line_loops(ctx, *self.lines())
        ctx.render("nest.py.j2", loops=loops, body=self.line(ctx, o, r, n, stride))

    def work_items(self) -> int | None:
        shape, axis = self.lines()
        return None if self.empty() else int(np.prod(shape, dtype=np.int64)) // shape[axis]

    def emit_item(self, ctx, item: str) -> None:
        shape, axis = self.lines()
        outer, n, stride = (int(np.prod(s, dtype=np.int64)) for s in (shape[:axis], shape[axis], shape[axis + 1:]))
        # item = o * stride + r, as line_loops nests them
        o = ctx.let(ix.div(item, stride), "o") if outer > 1 else "0"
        r = ctx.let(ix.mod(item, stride), "r") if stride > 1 else "0"
        ctx.render("nest.py.j2", loops=[], body=self.line(ctx, o, r, n, stride))


class Cumulative(Lines):
    """CumSum / CumProd along one axis (a constant input): exclusive leaves each element out of its
    own total, reverse runs from the end. Float and half accumulate in float, integers in int."""

    inplace = (0,)  # each element is read before its position is written
    init = 0
    step = "{acc} + {x}"

    def check(self):
        x, y = self.input(0), self.output()
        self.expect_dtype(x, ("float", "int"), "input 0 (x)")
        self.expect(tuple(y.shape) == tuple(x.shape), f"output shape {list(y.shape)} is not the input's {list(x.shape)}")
        axis = np.asarray(self.const(1, "axis")).reshape(-1)
        self.expect(axis.size == 1, f"axis must hold one value, it has {axis.size}")
        self.ax = self.axis(int(axis[0]), x.rank, batched=x.batched)

    def line(self, ctx, o, r, n, stride):
        x, y = self.input(0), self.output()
        acc_dt = compute_dtype(x.dtype)
        acc, v, t, i = ctx.fresh("acc"), ctx.fresh("x"), ctx.fresh("t"), ctx.fresh("i")
        pos = f"{n - 1} - {t}" if int(self.attr("reverse", 0)) else t
        store = y.store(i, convert(acc, acc_dt, y.dtype))
        update = f"{acc} = {self.step.format(acc=acc, x=v)}"
        body = [f"{acc} = {literal(self.init, acc_dt)}", f"for {t} in range({n}):",
                f"    {i} = {ix.add(line_start(o, r, n, stride), ix.mul(f'({pos})', stride))}",
                f"    {v} = {upcast(x.load(i), x.dtype)}"]
        return body + ([f"    {store}", f"    {update}"] if int(self.attr("exclusive", 0)) else [f"    {update}", f"    {store}"])


register("CumSum", since=11)(type("CumSum", (Cumulative,), {}))
register("CumProd", since=26)(type("CumProd", (Cumulative,), {"init": 1, "step": "{acc} * {x}"}))


@register("Hardmax", since=13)
class Hardmax(Lines):
    """1 at the first maximum along `axis`, 0 elsewhere. A line holding NaN has a NaN maximum,
    which no element equals: all 0, as onnxruntime gives for a line of NaN (for a line that mixes
    NaN and numbers, its vectorised max keeps or drops the NaN by where it lies)."""

    def line_axis(self, x) -> tuple[tuple[int, ...], int]:
        """Return (the shape the lines are taken over, the axis of the lines)."""
        return tuple(x.shape), self.axis(self.attr("axis", -1), x.rank, batched=x.batched)

    def check(self):
        x = self.input(0)
        self.expect_dtype(x, ("float",), "input 0")
        self.shape, self.ax = self.line_axis(x)

    def lines(self):
        return self.shape, self.ax

    def line(self, ctx, o, r, n, stride):
        x, y = self.input(0), self.output()
        base = line_start(o, r, n, stride)
        best, at, v, t = ctx.fresh("best"), ctx.fresh("at"), ctx.fresh("x"), ctx.fresh("t")
        one, zero = literal(1, y.dtype), literal(0, y.dtype)
        at_t = ix.add(base, ix.mul(t, stride))
        return [f"{best} = {x.load(base)}", f"{at} = 0", f"for {t} in range({n}):", f"    {v} = {x.load(at_t)}",
                f"    if {v} > {best} or isnan({v}):", f"        {best} = {v}", f"        {at} = {t}",
                f"if isnan({best}):", f"    {at} = -1",
                f"for {t} in range({n}):", f"    {y.store(at_t, f'({one} if {t} == {at} else {zero})')}"]


@register("Hardmax", since=1)
class Hardmax1(Hardmax):
    """Hardmax-1/11: over the input coerced to 2-d at `axis` (default 1): one line per row."""

    def line_axis(self, x):
        a = self.axis(self.attr("axis", 1), x.rank, batched=x.batched)
        rows = int(np.prod(x.shape[:a], dtype=np.int64))
        return (rows, int(np.prod(x.shape[a:], dtype=np.int64))), 1
