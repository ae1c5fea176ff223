"""TopK: the k largest (or smallest) elements along an axis and their int64 indices, sorted, equal
values in index order (the lower index first, as ONNX says).

Each line is selected in k passes without scratch memory: pass j takes the best element that
comes after pick j-1 in the order (value descending, index ascending) — or value ascending for
the smallest. O(k n) per line, which suits the small k of real models. A stage runs one work
item per line (reduce.Lines).

NaN sorts above every number, +inf included, and NaNs among themselves by index (numpy's sort,
and what onnxruntime returns): the first picks of largest=1, the last of largest=0."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.registry import register

from .common import convert
from .reduce import Lines, line_start


@register("TopK", since=10)
class TopK(Lines):
    """TopK with K as a constant input (opset 10), largest and sorted attributes (opset 11)."""

    def k(self) -> int:
        k = np.asarray(self.const(1, "K")).reshape(-1)
        self.expect(k.size == 1, f"K must hold one value, it has {k.size}")
        return int(k[0])

    def check(self):
        x, vals, idx = self.input(0), self.output(0), self.output(1)
        self.expect_dtype(x, ("float", "int"), "input 0 (X)")
        self.ax = self.axis(self.attr("axis", -1), x.rank, batched=x.batched)
        self.kk = self.k()
        n = x.shape[self.ax]
        self.expect(0 <= self.kk <= n, f"K = {self.kk} is not in [0, {n}], the length of axis {self.ax}")
        want = list(x.shape)
        want[self.ax] = self.kk
        for t in (vals, idx):
            if t is not None:
                self.expect(tuple(t.shape) == tuple(want), f"output '{t.name}' has shape {list(t.shape)}, expected {want}")
        self.expect(idx is None or idx.dtype is dtypes.INT64, "output 1 (indices) must be int64")
        self.largest = bool(int(self.attr("largest", 1)))

    def empty(self) -> bool:
        return self.kk == 0 or self.input(0).numel == 0

    def line(self, ctx, o, r, n, stride):
        x, vals, idx = self.input(0), self.output(0), self.output(1)
        base, out_base = line_start(o, r, n, stride), line_start(o, r, self.kk, stride)
        pv, pi, bv, bi, v, j, t = (ctx.fresh(p) for p in ("pv", "pi", "bv", "bi", "x", "j", "t"))
        nan = x.dtype.is_float

        def above(a, b):
            """a comes after b in ascending order, NaN last (comparisons with NaN are all false)."""
            return f"((isnan({a}) and not isnan({b})) or {a} > {b})" if nan else f"{a} > {b}"

        same = f"({v} == {pv} or (isnan({v}) and isnan({pv})))" if nan else f"{v} == {pv}"
        # after the previous pick in the (value, index) order, and better than the best so far
        after, better = (above(pv, v), above(v, bv)) if self.largest else (above(v, pv), above(bv, v))
        body = [f"{pv} = {x.load(base)}", f"{pi} = -1", f"for {j} in range({self.kk}):",
                f"    {bv} = {x.load(base)}", f"    {bi} = -1",
                f"    for {t} in range({n}):",
                f"        {v} = {x.load(ix.add(base, ix.mul(t, stride)))}",
                f"        if {pi} < 0 or {after} or ({same} and {t} > {pi}):",
                f"            if {bi} < 0 or {better}:",
                f"                {bv} = {v}",
                f"                {bi} = {t}",
                f"    {pv} = {bv}", f"    {pi} = {bi}"]
        at = ix.add(out_base, ix.mul(j, stride))
        if vals is not None:
            body.append(f"    {vals.store(at, bv)}")
        if idx is not None:
            body.append(f"    {idx.store(at, convert(bi, dtypes.INT32, idx.dtype))}")
        return body


@register("TopK", since=1)
class TopK1(TopK):
    """TopK-1: k as an attribute."""

    def k(self):
        return int(self.attr("k"))
