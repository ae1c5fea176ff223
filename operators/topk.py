"""TopK: the k largest (or smallest) elements along an axis and their int64 indices, sorted, equal
values in index order (the lower index first, as ONNX says).

Each line is selected in k passes without scratch memory: pass j takes the best element that
comes after pick j-1 in the order (value descending, index ascending) — or value ascending for
the smallest. O(k n) per line, which suits the small k of real models."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register

from .common import convert
from .reduce import line_loops, line_start


@register("TopK", since=10)
class TopK(Operator):
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

    def forward(self, ctx):
        x, vals, idx = self.input(0), self.output(0), self.output(1)
        if self.kk == 0 or x.numel == 0:
            return
        loops, o, r, n, stride = line_loops(ctx, x.shape, self.ax)
        base, out_base = line_start(o, r, n, stride), line_start(o, r, self.kk, stride)
        gt, lt = (">", "<") if self.largest else ("<", ">")
        pv, pi, bv, bi, v, j, t = (ctx.fresh(p) for p in ("pv", "pi", "bv", "bi", "x", "j", "t"))
        body = [f"{pv} = {x.load(base)}", f"{pi} = -1", f"for {j} in range({self.kk}):",
                f"    {bv} = {x.load(base)}", f"    {bi} = -1",
                f"    for {t} in range({n}):",
                f"        {v} = {x.load(ix.add(base, ix.mul(t, stride)))}",
                # after the previous pick in (value, index) order, and better than the best so far
                f"        if {pi} < 0 or {v} {lt} {pv} or ({v} == {pv} and {t} > {pi}):",
                f"            if {bi} < 0 or {v} {gt} {bv}:",
                f"                {bv} = {v}",
                f"                {bi} = {t}",
                f"    {pv} = {bv}", f"    {pi} = {bi}"]
        at = ix.add(out_base, ix.mul(j, stride))
        if vals is not None:
            body.append(f"    {vals.store(at, bv)}")
        if idx is not None:
            body.append(f"    {idx.store(at, convert(bi, dtypes.INT32, idx.dtype))}")
        ctx.render("nest.py.j2", loops=loops, body=body)


@register("TopK", since=1)
class TopK1(TopK):
    """TopK-1: k as an attribute."""

    def k(self):
        return int(self.attr("k"))
