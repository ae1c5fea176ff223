"""RowsKeptConv: a 1 x 1 Conv evaluated only at the positions a Gather picks at run time, the gather and the
products in one node (luisaml/rewrites/rows_kept.py makes it; it has no ONNX op type of its own, so it is not
registered): out[m, j] = B[m] + sum over c of X[c, idx[j]] * W[m, c], X read as [C, positions].

Each output is summed as the Conv it stands for sums it (`order`, operators/conv.py and tiled.py): "items"
starts at B[m] and does fma(x[c], W[m, c], acc) for c in order (the items form: the CPU's tiles, CUDA's direct
form and products under tiled.MIN_SIDE), "fp32" does the same fmas from 0 and adds B[m] last (tiled.py's FP32
tile), so the kept rows are bit for bit every row's. The index is the Gather's: wrapped where negative, flagged
where outside [-P, P) (the flag names that Gather node, as the graph without the rewrite does), clamped."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator

from .common import load_f
from .indexing import index_flag

ORDERS = ("items", "fp32")


class RowsKeptConv(Operator):
    """Inputs X [1, C, *S], indices (run time), W [M, C, 1..], optional B [M]; output [M, *indices.shape]."""

    def __init__(self, node, inputs, outputs, gather: Operator, order: str, opset: int = 1):
        self.gather, self.order = gather, order  # (the Gather node a bad index names; how the Conv sums)
        super().__init__(node, inputs, outputs, opset)

    def check(self) -> None:
        x, idx, w, y = self.input(0), self.input(1), self.input(2), self.output()
        self.expect(self.order in ORDERS, f"order must be one of {ORDERS}, not {self.order!r}")
        self.C, self.M = x.shape[1], w.shape[0]
        self.P = int(np.prod(x.shape[2:], dtype=np.int64))
        self.K = idx.numel
        self.expect(w.numel == self.M * self.C, f"W '{w.name}' {list(w.shape)} is not [{self.M}, {self.C}, 1..]")
        self.expect(y.numel == self.M * self.K, f"output '{y.name}' {list(y.shape)} is not [{self.M}, {self.K}]")

    def describe(self) -> str:
        return (f"a 1 x 1 Conv of {self.M} channels at {self.K} gathered of {self.P:,} positions, "
                f"{'B first' if self.order == 'items' else 'B last'} as the Conv's {self.order} form")

    def _value(self, ctx, m: str, j: str) -> str:
        """Emit output (m, j)'s sum; return the variable (or expression) holding it."""
        x, idx, w = self.input(0), self.input(1), self.input(2)
        b = self.input(3) if self.has_input(3) else None
        P = self.P
        g = ctx.let(idx.load(j), "g")
        g = ctx.let(f"({g} + {P} if {g} < 0 else {g})", "g")
        flag = index_flag(ctx, self.gather, 1, P)
        if flag:
            ctx.line(f"if {g} < 0 or {g} >= {P}: {flag}")
        g = ctx.let(f"clamp({g}, 0, {P - 1})", "g")
        acc = ctx.fresh("acc")
        ctx.line(f"{acc} = {load_f(b, m) if b is not None and self.order == 'items' else '0.0'}")
        wm = ctx.let(ix.mul(m, self.C), "wm")
        with ctx.loop(self.C, "c") as c:
            ctx.line(f"{acc} = fma({load_f(x, ix.add(ix.mul(c, P), g))}, {load_f(w, ix.add(wm, c))}, {acc})")
        if b is not None and self.order == "fp32":
            return f"({acc} + {load_f(b, m)})"
        return acc

    def element(self, ctx, i, k=0):
        i = ctx.let(i, "i")
        m, j = (ctx.let(v, "r") for v in (ix.div(i, self.K), ix.mod(i, self.K)))
        return self._value(ctx, m, j)

    def forward(self, ctx) -> None:
        y = self.output()
        with ctx.loop(self.M, "m") as m, ctx.loop(self.K, "j") as j:
            ctx.line(y.store(ix.add(ix.mul(m, self.K), j), self._value(ctx, m, j)))
