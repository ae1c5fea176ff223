"""Softmax and LogSoftmax, numerically stable (the maximum is subtracted first), computed in
float for float and half (shaders/softmax.py.j2). A stage runs one work item per row."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import affine, compute_dtype, convert, reduction_loops, upcast
from .reduce import LANES_MIN, fold_lanes, kept_base


class Softmax(Operator):
    """Opset 13 on: normalise along one axis (default -1)."""

    inplace = (0,)  # every element is read before the same element is written, after the sums
    stores_once = True  # each element of a row is stored once, in the last pass; y is never read
    log = False

    def axes(self, rank: int, batched: bool) -> list[int]:
        """Return the axes normalised over."""
        return [self.axis(self.attr("axis", -1), rank, batched=batched)]

    def check(self):
        x, y = self.input(0), self.output()
        self.expect_dtype(x, ("float",), "input 0")
        self.expect(tuple(x.shape) == tuple(y.shape), f"output '{y.name}' {list(y.shape)} differs from input {list(x.shape)}")
        self.red_axes = self.axes(x.rank, x.batched)

    def emit(self, ctx, kept, base: str, red, rx, warp: dict | None = None) -> None:
        """Render the rows at base (+ the kept loops' offsets) over the reduced loops (warp: the lanes
        of a warp share one row, shaders/softmax.py.j2)."""
        x, y = self.input(0), self.output()
        acc = compute_dtype(x.dtype)
        src = affine(base, red, rx)
        ctx.render(
            "softmax.py.j2",
            kept=kept,
            red=red,
            m=ctx.fresh("m"),
            s=ctx.fresh("s"),
            first=upcast(x.load(base), x.dtype),
            zero=literal(0, acc),
            log=self.log,
            warp=warp,
            src=src,
            dst=src,
            load=lambda i: upcast(x.load(i), x.dtype),
            store=lambda i, v: y.store(i, convert(v, acc, y.dtype)),
        )

    def forward(self, ctx):
        if self.input(0).numel == 0:
            return
        kept, kx, _, red, rx = reduction_loops(ctx, self.input(0), self.red_axes)
        self.emit(ctx, kept, affine(0, kept, kx), red, rx)

    def work_items(self) -> int | None:
        x = self.input(0)
        rows = x.numel // int(np.prod([x.shape[a] for a in self.red_axes], dtype=np.int64)) if x.numel else 0
        return rows or None

    # set on a plan without blocks stages (the CPU backend; luisaml/compiler.py): a float row of
    # LANES_MIN or more contiguous elements takes the lanes form (emit_lanes)
    no_blocks = False
    # the exp of the lanes form: exp_f32 (shaders/math_lib.py), which the loops vectorise around,
    # or the backend's exp (a libm call an element)
    fast_exp = True

    def emit_item(self, ctx, item):
        kept, kx, _, red, rx = reduction_loops(ctx, self.input(0), self.red_axes)
        base = kept_base(ctx, item, kept, kx)
        x, y = self.input(0), self.output()
        if (self.no_blocks and len(red) == 1 and rx == [1] and red[0][1] >= LANES_MIN
                and x.dtype.dsl == "float" and y.dtype.dsl == "float"):
            self.emit_lanes(ctx, base, red[0][1])
            return
        self.emit(ctx, [], base, red, rx)

    def emit_lanes(self, ctx, base: str, n: int) -> None:
        """One contiguous row of n floats at base, its max and its sum of exponentials folded in
        LANES accumulators over consecutive elements (reduce.fold_lanes: each pass a loop of
        independent steps, which the CPU backend's compiler turns into vector steps, where one
        accumulator made a chain of dependent ones), then y = e^(x - m) / s (or x - m - log s);
        the exponentials through exp_f32, which vectorises (ViT-Ti's 591 rows of 197: 2.2 ms a
        stage as a chain with the backend's exp; benchmarks/NOTES.md, "Softmax rows in lanes")."""
        x, y = self.input(0), self.output()
        exp = "exp"
        if self.fast_exp:
            exp = ctx.use_helper("exp_f32", "math_lib")
        load = lambda i: x.load(i)  # noqa: E731
        m, s = ctx.fresh("m"), ctx.fresh("s")
        lanes = fold_lanes(ctx, load, base, n, m, load(base), lambda a, v: f"max({a}, {v})",
                           lambda a, v: f"max({a}, {v})")
        ctx.line(f"{m} = {load(base)}")
        self._lanes(ctx, lanes)
        lanes = fold_lanes(ctx, load, base, n, s, "0.0", lambda a, v: f"{a} + {exp}({v} - {m})",
                           lambda a, v: f"{a} + {v}")
        ctx.line(f"{s} = 0.0")
        self._lanes(ctx, lanes)
        if self.log:
            ctx.line(f"{s} = log({s})")
        r = ctx.fresh("r")
        i = ix.add(base, r)
        ctx.line(f"for {r} in range({n}):")
        with ctx.indent():
            ctx.line(y.store(i, f"{load(i)} - {m} - {s}" if self.log else f"{exp}({load(i)} - {m}) / {s}"))

    @staticmethod
    def _lanes(ctx, lanes: dict) -> None:
        for line in lanes["init"]:
            ctx.line(line)
        if lanes["chunks"]:
            ctx.line(f"for {lanes['q']} in range({lanes['chunks']}):")
            with ctx.indent():
                for line in lanes["body"]:
                    ctx.line(line)
        for line in lanes["tail"] + lanes["merge"]:
            ctx.line(line)

    def block_tiling(self):
        """A warp per row on GPUs (operators/rows.py), for float rows whose reduced axes are one
        loop (the last axis, or trailing axes that merge)."""
        from . import rows

        x = self.input(0)
        if x.numel == 0 or x.dtype.dsl != "float" or self.output().dtype.dsl != "float":
            return None
        if not self._one_loop():
            return None
        length = int(np.prod([x.shape[a] for a in self.red_axes], dtype=np.int64))
        return rows.choose(x.numel // length, length)

    def _one_loop(self) -> bool:
        """Whether the reduced axes walk x as one strided loop (common.reduction_loops merges them)."""
        from .common import coalesce

        x = self.input(0)
        sizes, _ = coalesce([x.shape[a] for a in sorted(self.red_axes)], [x.strides[a] for a in sorted(self.red_axes)])
        return len(sizes) == 1

    def emit_block(self, ctx, item, thread):
        from . import rows

        tiling = self.block_tiling()
        row, lane = rows.begin(ctx, tiling, item, thread)
        kept, kx, _, red, rx = reduction_loops(ctx, self.input(0), self.red_axes)
        warp = rows.warp_loop(ctx, tiling, lane)
        with rows.row_guard(ctx, tiling, row):
            self.emit(ctx, [], kept_base(ctx, row, kept, kx), red, rx, warp)


class SoftmaxV1(Softmax):
    """Opsets 1-12: the input is seen as 2-D [prod(dims before axis), prod(dims from axis)]
    (axis default 1) and normalised along the second."""

    def axes(self, rank, batched):
        a = self.axis(self.attr("axis", 1), rank, batched=batched)
        return list(range(a, rank))


register("Softmax", since=1)(type("Softmax", (SoftmaxV1,), {}))
register("Softmax", since=13)(type("Softmax", (Softmax,), {}))
register("LogSoftmax", since=1)(type("LogSoftmax", (SoftmaxV1,), {"log": True}))
register("LogSoftmax", since=13)(type("LogSoftmax", (Softmax,), {"log": True}))
