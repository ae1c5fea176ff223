"""Pools: MaxPool (with its Indices output), AveragePool, LpPool and the global pools. Each output
element reduces its window (shaders/conv.py.j2, the loop nest the convolutions use) in float. In a
stage a work item is ROW_TILE consecutive outputs of a row (every output of the node: Y and
MaxPool's Indices): a thread a window cost more in the CPU backend's per-thread call (~7 ns,
benchmarks/NOTES.md) than a 2 x 2 window's work. A MaxPool without Indices takes the max over the
window's rows first, for each column of the strip's contiguous input span (consecutive loads, one
max per element: what clang vectorises), then over each output's columns (MaxPool.rows_first). A
global pool over a contiguous block of 32 or more folds it in the reductions' lanes
(operators/reduce.py, fold_lanes); on CUDA a global pool over a contiguous float block of
rows.MIN_LENGTH or more takes a warp per channel instead, or a block per channel for long blocks
(operators/rows.py, Pool.emit_block)."""
from __future__ import annotations

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import row_major_strides

from . import reduce
from .common import coalesce, load_f, loop_vars, max_fn
from .conv import (
    Geometry,
    bounds,
    check_output,
    expect_float,
    lin,
    store_f,
    window_geometry,
)


# outputs of a row a stage's work item computes, one window after the other (a last strip past
# the row's end stores only its outputs inside): the CIFAR CNN's 2 x 2 pools, the stage alone,
# measured in benchmarks/NOTES.md ("ConvTranspose tiles, long reductions and pools on the CPU")
ROW_TILE = 8
# MaxPool.rows_first on (the switch benchmarks/experiments/zoo_elem.py turns off for its A/B)
ROWS_FIRST = True


class Pool(Operator):
    """A sliding-window pool over X [N, C, D...]; subclasses say how a window reduces. Each output
    element is one window: a stage runs one thread per ROW_TILE outputs along the row (every
    output: MaxPool's Indices with Y)."""

    global_pool = False
    stores_once = True

    def check(self) -> None:
        x = self.input(0)
        expect_float(self, x, "X")
        self.expect(x.rank >= 3, f"X '{x.name}' has rank {x.rank}; pools need [N, C, spatial...]")
        k = x.rank - 2
        if self.global_pool:
            self.geo = Geometry(list(x.shape[2:]), [1] * k, [1] * k, [0] * k, [0] * k, [1] * k)
        else:
            kernel = self.attr("kernel_shape", None)
            self.expect(kernel is not None, "attribute 'kernel_shape' is required")
            kernel = [int(v) for v in kernel]
            self.expect(len(kernel) == k, f"kernel_shape {kernel} needs {k} values for a {k}-D pool")
            self.geo = window_geometry(self, x.shape[2:], kernel, bool(self.attr("ceil_mode", 0)))
        check_output(self, self.output(), list(x.shape[:2]) + self.geo.out)
        self.check_more()

    def check_more(self) -> None:
        """Checks of one kind of pool (attributes, extra outputs)."""

    def describe(self) -> str:
        g = self.geo
        return f"{type(self).__name__}: kernel {g.kernel}, strides {g.strides}, pads {g.pads_begin + g.pads_end}"

    def window(self, ctx, ospat, inside_only: bool):
        """Return (window loop levels, input spatial coordinate names, in-bounds condition parts).

        inside_only: each level skips positions outside the input; otherwise every position of
        the window runs and the returned conditions say which are inside."""
        g, x = self.geo, self.input(0)
        levels, coords, inside = [], [], []
        for d, (kv, kn) in enumerate(loop_vars(ctx, g.kernel, "k", unit_zero=True)):
            iv = ctx.fresh("ix")
            pre = [f"{iv} = {lin([(ospat[d], g.strides[d]), (kv, g.dilations[d])], -g.pads_begin[d])}"]
            size = x.shape[2 + d]
            last = (g.out[d] - 1) * g.strides[d] + (g.kernel[d] - 1) * g.dilations[d] - g.pads_begin[d]
            cond = bounds(iv, g.pads_begin[d] > 0, size if last >= size else None)
            levels.append({"var": kv, "n": kn, "pre": pre, "cond": (" and ".join(cond) or None) if inside_only else None})
            coords.append(iv)
            inside += cond
        return levels, coords, inside

    # ---- forward, element and emit_item share emit(): the reduction of one output element ----
    def emit(self, ctx, outer, ov: list[str], store: bool) -> list[str]:
        """Render the window reduction of the output element at coordinates `ov` inside the loops
        `outer` (none: one element); with `store`, store every output. Return each output's value."""
        y = self.output()
        head, levels, body, value = self.reduce(ctx, ov)
        tail = [store_f(y, ix.ravel(ov, y.strides), value)] + self.extra_stores(ov) if store else []
        ctx.render("conv.py.j2", outer=outer, head=head, window=levels, body=body, tail=tail)
        return [f"half({value})" if y.dtype.dsl == "half" else value] + self.extra_values()

    def forward(self, ctx) -> None:
        outer = loop_vars(ctx, self.output().shape, "o", unit_zero=True)
        self.emit(ctx, outer, [v for v, _ in outer], store=True)

    def row_tile(self) -> tuple[int, int]:
        """Return (outputs a work item computes along the last dimension, work items a row)."""
        row = self.output().shape[-1]
        P = self.rows_first() or max(1, min(ROW_TILE, row))
        return P, -(-row // P)

    def rows_first(self) -> int | None:
        """Return the outputs a work item computes when it reduces its windows' rows first
        (MaxPool.rows_first), None when it does not."""
        return None

    def work_items(self) -> int:
        P, strips = self.row_tile()
        y = self.output()
        return y.numel // y.shape[-1] * strips

    def emit_item(self, ctx, item: str) -> None:
        y = self.output()
        P, strips = self.row_tile()
        dims = tuple(y.shape[:-1]) + (strips,)
        *lead, strip = [ctx.let(c, "o") if n > 1 else "0" for c, n in zip(ix.unravel(item, dims), dims)]
        o0 = ctx.let(ix.mul(strip, P), "o")
        if self.global_lanes():
            self.emit_global(ctx, lead)
            return
        if self.rows_first() is not None:
            self.emit_rows_first(ctx, lead, o0, P)
            return
        row = y.shape[-1]
        outs = [y] + [t for t in self.outputs[1:] if t is not None]
        done = []  # the finished values of every strip position inside the row, then their stores
        for pp in range(P):
            o = ctx.let(ix.add(o0, str(pp)), "o") if pp else o0
            if (strips - 1) * P + pp >= row:  # the last strip's outputs past the row: guarded
                ctx.line(f"if {o} < {row}:")
                with ctx.indent():
                    self.emit(ctx, [], lead + [o], store=True)
            else:
                done.append((lead + [o], [ctx.let(v, "f") for v in self.emit(ctx, [], lead + [o], store=False)]))
        for ov, values in done:
            for t, v in zip(outs, values):
                ctx.line(t.store(ix.ravel(ov, t.strides), v))

    def global_lanes(self) -> bool:
        """Return whether this is a global pool over a contiguous window long enough for the
        reductions' lanes (operators/reduce.py, fold_lanes)."""
        x = self.input(0)
        sizes, (strides,) = coalesce(x.shape[2:], x.strides[2:])
        return (self.global_pool and reduce.LANES > 1 and strides == [1]
                and sizes[0] >= reduce.LANES_MIN)

    def global_fold(self, ctx, count: int):
        """Return (init, step(acc, x), merge(acc, lane), finish(acc)) of the global pool's fold."""
        raise NotImplementedError

    # how the global fold's partials combine across a warp (rows.combine): "sum", or "max" (MaxPool)
    warp_kind = "sum"

    def block_tiling(self):
        """A global pool's GPU form (operators/rows.py): a warp per channel, or a block of warps for
        a long spatial block, over a float block laid out contiguously (a warp's loads are then one
        run). The items form gave a channel's whole block to one thread: EfficientNet-B0's first
        squeeze (32 channels of 112 x 112 a sample) took 1.71 ms of 13.6 on an H200 at batch 32."""
        from . import rows

        x, y = self.input(0), self.output()
        if not self.global_pool or y.numel == 0 or x.dtype.dsl != "float" or y.dtype.dsl != "float":
            return None
        sizes, (strides,) = coalesce(x.shape[2:], x.strides[2:])
        if strides != [1]:
            return None
        return rows.choose_reduction(y.numel, sizes[0])

    def emit_block(self, ctx, item: str, thread: str) -> None:
        """Emit the global pool of one channel (a row of block_tiling(): rows.fold_row)."""
        from . import rows

        x, y = self.input(0), self.output()
        tiling = self.block_tiling()
        init, step, merge, finish = self.global_fold(ctx, tiling.length)

        def place(row):
            lead = [ctx.let(c, "o") if n > 1 else "0" for c, n in zip(ix.unravel(row, tuple(x.shape[:2])), x.shape[:2])]
            start = ctx.let(ix.add(ix.mul(lead[0], x.strides[0]), ix.mul(lead[1], x.strides[1])), "base")
            return start, lambda v: store_f(y, ix.ravel(lead + ["0"] * (y.rank - 2), y.strides), v)

        rows.fold_row(ctx, tiling, item, thread, place, lambda i: load_f(x, i), init, step, merge, self.warp_kind, finish)

    def emit_global(self, ctx, lead: list[str]) -> None:
        """Emit the global pool of channel (lead[0], lead[1]): its spatial block folded in lanes,
        as the reductions fold a contiguous run (shaders/reduce.py.j2)."""
        x, y = self.input(0), self.output()
        count = int(_prod(x.shape[2:]))
        init, step, merge, finish = self.global_fold(ctx, count)
        acc = ctx.fresh("acc")
        start = ix.add(ix.mul(lead[0], x.strides[0]), ix.mul(lead[1], x.strides[1]))
        lanes = reduce.fold_lanes(ctx, lambda i: load_f(x, i), start, count, acc, init, step, merge)
        ctx.render("reduce.py.j2", kept=[], red=[], passes=[{"init": [f"{acc} = {init}"], "lanes": lanes}],
                   result=finish(acc), store=lambda v: store_f(y, ix.ravel(lead + ["0"], y.strides), v))

    def x_index(self, ov, coords) -> str:
        return ix.ravel(ov[:2] + coords, self.input(0).strides)

    def extra_stores(self, ov) -> list[str]:
        return []

    def extra_values(self) -> list[str]:
        """The values of the outputs after Y (MaxPool's Indices), after reduce()."""
        return []


@register("MaxPool", since=1)
class MaxPool(Pool):
    """Y = the largest element of each window (pads never win); Indices = its flat index in X.
    A window holding NaN gives NaN (numpy's maximum) and the index of its first NaN.
    onnxruntime is not consistent there: its vectorised pool keeps or drops a NaN by where it lies,
    its Indices path keeps only a NaN that comes first in the window; and its vectorised pool
    gives -FLT_MAX for a window of -inf, where this gives -inf."""

    def check_more(self) -> None:
        self.storage_order = int(self.attr("storage_order", 0))
        self.expect(self.storage_order in (0, 1), f"storage_order must be 0 or 1, not {self.storage_order}")
        self.indices = len(self.outputs) > 1 and self.outputs[1] is not None
        if self.indices:
            ind = self.output(1)
            check_output(self, ind, list(self.input(0).shape[:2]) + self.geo.out, "Indices")
            # the flat index counts the samples before this one, which a per-sample thread does not
            # know: the graph then compiles per batch size
            self.expect_per_sample(not ind.batched, f"output Indices '{ind.name}' holds flat indices across the batch")

    def reduce(self, ctx, ov):
        x = self.input(0)
        best = ctx.fresh("best")
        levels, coords, _ = self.window(ctx, ov[2:], inside_only=True)
        v = ctx.fresh("v")
        head = [f"{best} = -INF"]
        body = [f"{v} = {load_f(x, self.x_index(ov, coords))}"]
        if not self.indices:
            body.append(f"{best} = {max_fn(ctx, dtypes.FLOAT)}({best}, {v})")
            return head, levels, body, best
        self.arg = ctx.fresh("arg")
        head.append(f"{self.arg} = -1")
        spatial = list(x.shape[2:])
        # storage_order 1: the spatial part of the index is column-major
        strides = row_major_strides(tuple(spatial)) if self.storage_order == 0 else _col_major(spatial)
        flat = ix.add(ix.mul(ix.add(ix.mul(ov[0], x.shape[1]), ov[1]), int(_prod(spatial))), ix.ravel(coords, strides))
        body += [f"if {v} > {best} or {self.arg} < 0 or (isnan({v}) and not isnan({best})):",
                 f"    {best} = {v}", f"    {self.arg} = {flat}"]
        return head, levels, body, best

    warp_kind = "max"

    def global_fold(self, ctx, count):
        mx = max_fn(ctx, dtypes.FLOAT)
        return "-INF", (lambda a, v: f"{mx}({a}, {v})"), (lambda a, b: f"{mx}({a}, {b})"), (lambda a: a)

    def rows_first(self) -> int | None:
        """Without Indices, over windows undilated along the row: return the tile (ROW_TILE, or
        the row when shorter); None otherwise (MaxPool with Indices, the global pool)."""
        g = self.geo
        if not (ROWS_FIRST and not self.indices and not self.global_pool and g.dilations[-1] == 1):
            return None
        return max(1, min(ROW_TILE, g.out[-1]))

    def emit_rows_first(self, ctx, lead: list[str], o0: str, P: int) -> None:
        """Emit the P outputs of a row from o0: the max over the window's rows of each column of
        the strip's input span ((P - 1) x stride + kernel consecutive columns), then the max of
        each output's kernel columns. A row outside the input (pads of the outer dimensions) is
        skipped, as in reduce(); so is a column outside it, in the masked copy of the loops that a
        strip whose span leaves the row runs (pads along the row, ceil_mode, a ragged last strip)."""
        g, x, y = self.geo, self.input(0), self.output()
        s, kl, pad, size, row = g.strides[-1], g.kernel[-1], g.pads_begin[-1], x.shape[-1], g.out[-1]
        k = len(g.kernel)
        strips = -(-row // P)
        mx = max_fn(ctx, dtypes.FLOAT)
        cols = [ctx.fresh("col") for _ in range((P - 1) * s + kl)]
        for c in cols:
            ctx.line(f"{c} = -INF")
        i0 = ctx.let(lin([(o0, s)], -pad), "i")  # the span's first column
        lo_fails = pad > 0
        hi_fails = (strips - 1) * P * s - pad + len(cols) > size

        def rows(d: int, base: str, masked: bool) -> None:
            if d == k - 1:
                for j, c in enumerate(cols):
                    at = ix.add(i0, str(j))
                    if masked:
                        cond = bounds(f"({at})", lo_fails, size if hi_fails else None)
                        clamped = f"min(max({at}, 0), {size - 1})"
                        xv = ctx.let(f"({load_f(x, ix.add(base, clamped))} if {' and '.join(cond)} else -INF)", "xv")
                    else:
                        xv = ctx.let(load_f(x, ix.add(base, at)), "xv")
                    ctx.line(f"{c} = {mx}({c}, {xv})")
                return
            with ctx.loop(g.kernel[d], "k") as kv:
                iv = ctx.let(lin([(lead[2 + d], g.strides[d]), (kv, g.dilations[d])], -g.pads_begin[d]), "ix")
                last = (g.out[d] - 1) * g.strides[d] + (g.kernel[d] - 1) * g.dilations[d] - g.pads_begin[d]
                cond = bounds(iv, g.pads_begin[d] > 0, x.shape[2 + d] if last >= x.shape[2 + d] else None)
                inner = ix.add(base, ix.mul(iv, x.strides[2 + d]))
                if cond:
                    ctx.line(f"if {' and '.join(cond)}:")
                    with ctx.indent():
                        rows(d + 1, inner, masked)
                else:
                    rows(d + 1, inner, masked)

        base = ix.add(ix.mul(lead[0], x.strides[0]), ix.mul(lead[1], x.strides[1]))
        if lo_fails or hi_fails:
            inside = ([f"{i0} >= 0"] if lo_fails else []) + ([f"{ix.add(i0, str(len(cols)))} <= {size}"] if hi_fails else [])
            ctx.line(f"if {' and '.join(inside)}:")
            with ctx.indent():
                rows(0, base, False)
            ctx.line("else:")
            with ctx.indent():
                rows(0, base, True)
        else:
            rows(0, base, False)
        done = []  # the finished values first, then the stores (benchmarks/NOTES.md)
        for pp in range(P):
            v = cols[pp * s]
            for j in range(1, kl):
                v = f"{mx}({v}, {cols[pp * s + j]})"
            done.append(ctx.let(f"half({v})" if y.dtype.dsl == "half" else v, "f"))
        out = ix.ravel(lead + [o0], y.strides)
        in_row = row % P or P  # a ragged last strip: its positions past the row store nothing
        for pp in range(P):
            ctx.line_if(None if pp < in_row else f"{ix.add(o0, str(pp))} < {row}", y.store(ix.add(out, str(pp)), done[pp]))

    def extra_stores(self, ov) -> list[str]:
        if not self.indices:
            return []
        ind = self.output(1)
        return [ind.store(ix.ravel(ov, ind.strides), self.arg)]

    def extra_values(self) -> list[str]:
        return [self.arg] if self.indices else []


def _prod(xs) -> int:
    p = 1
    for v in xs:
        p *= int(v)
    return p


def _col_major(shape: list[int]) -> tuple[int, ...]:
    return tuple(reversed(row_major_strides(tuple(reversed(shape)))))


@register("AveragePool", since=1)
class AveragePool(Pool):
    """Y = the mean of each window; count_include_pad counts the pads (not what ceil_mode adds)."""

    def check_more(self) -> None:
        self.include_pad = bool(self.attr("count_include_pad", 0))

    def global_fold(self, ctx, count):
        return "0.0", (lambda a, v: f"{a} + {v}"), (lambda a, b: f"{a} + {b}"), (lambda a: f"{a} / {float(count)!r}")

    def reduce(self, ctx, ov):
        x, g = self.input(0), self.geo
        acc, cnt = ctx.fresh("acc"), ctx.fresh("cnt")
        head = [f"{acc} = 0.0", f"{cnt} = 0.0"]
        if not self.include_pad:
            levels, coords, _ = self.window(ctx, ov[2:], inside_only=True)
            body = [f"{acc} += {load_f(x, self.x_index(ov, coords))}", f"{cnt} += 1.0"]
            return head, levels, body, f"{acc} / {cnt}"
        levels, coords, inside = self.window(ctx, ov[2:], inside_only=False)
        # a position counts when it lies inside the input or its explicit pads
        padded = [f"{c} < {x.shape[2 + d] + g.pads_end[d]}" for d, c in enumerate(coords)]
        body = [f"if {' and '.join(padded)}:", f"    {cnt} += 1.0"]
        add = f"{acc} += {load_f(x, self.x_index(ov, coords))}"
        body += [f"if {' and '.join(inside)}:", f"    {add}"] if inside else [add]
        return head, levels, body, f"{acc} / {cnt}"


@register("LpPool", since=1)
class LpPool(Pool):
    """Y = (sum of |x|^p over each window) ^ (1/p); pads add nothing."""

    def check_more(self) -> None:
        self.p = int(self.attr("p", 2))
        self.expect(self.p >= 1, f"p must be >= 1, not {self.p}")

    def reduce(self, ctx, ov):
        acc, v = ctx.fresh("acc"), ctx.fresh("v")
        levels, coords, _ = self.window(ctx, ov[2:], inside_only=True)
        body = [f"{v} = {load_f(self.input(0), self.x_index(ov, coords))}"]
        return [f"{acc} = 0.0"], levels, body + [f"{acc} += {_pow_abs(v, self.p)}"], _root(ctx, acc, self.p)

    def global_fold(self, ctx, count):
        return ("0.0", (lambda a, v: f"{a} + {_pow_abs(v, self.p)}"), (lambda a, b: f"{a} + {b}"),
                (lambda a: _root(ctx, a, self.p)))


def _pow_abs(v: str, p: int) -> str:
    if p == 1:
        return f"abs({v})"
    if p == 2:
        return f"{v} * {v}"
    return f"pow(abs({v}), {float(p)})"


def _root(ctx, acc: str, p: int) -> str:
    if p == 1:
        return acc
    if p == 2:  # (a later division must not make it a reciprocal square root: math_lib.sqrt_f32)
        return f"{ctx.use_helper('sqrt_f32', 'math_lib')}({acc})"
    return f"pow({acc}, {1.0 / p!r})"


@register("GlobalMaxPool", since=1)
class GlobalMaxPool(MaxPool):
    global_pool = True

    def check_more(self) -> None:
        self.indices = False


@register("GlobalAveragePool", since=1)
class GlobalAveragePool(AveragePool):
    global_pool = True

    def check_more(self) -> None:
        self.include_pad = False


@register("GlobalLpPool", since=2)
class GlobalLpPool(LpPool):
    global_pool = True
