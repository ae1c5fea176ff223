"""Operators that generate values from coordinates: Range, EyeLike and OneHot."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import compute_dtype, convert


@register("Range", since=11)
class Range(Operator):
    """start + i * delta for i below the output's length (its shape is static: from constant
    inputs, or inferred); start and delta may be runtime scalars. Floats (half through float) are
    computed as start + i * delta, not by accumulating delta."""

    def check(self):
        y = self.output()
        for k, what in ((0, "start"), (1, "limit"), (2, "delta")):
            t = self.input(k)
            self.expect(t.numel == 1, f"input {k} ({what}) '{t.name}' must hold one value, it has shape {list(t.shape)}")
            self.expect(t.dtype == y.dtype, f"input {k} ({what}) '{t.name}' has type {t.dtype.name.lower()}, output {y.dtype.name.lower()}")
        self.expect_dtype(y, ("float", "int"), "output")
        vals = [self.input(k).value for k in range(3)]
        if all(v is not None for v in vals):
            start, limit, delta = (np.asarray(v).reshape(-1)[0].item() for v in vals)
            self.expect(delta != 0, "delta is 0")
            n = max(int(np.ceil((limit - start) / delta)), 0)
            self.expect(y.numel == n, f"output '{y.name}' has {y.numel} elements, the range {n}")

    def forward(self, ctx):
        y = self.output()
        if y.numel == 0:
            return
        dt = compute_dtype(y.dtype)
        start = ctx.let(convert(self.input(0).load("0"), y.dtype, dt), "start")
        delta = ctx.let(convert(self.input(2).load("0"), y.dtype, dt), "delta")
        with ctx.loop(y.numel) as i:
            k = convert(i, dtypes.INT32, dt)
            ctx.line(y.store(i, convert(f"{start} + {k} * {delta}", dt, y.dtype)))


@register("EyeLike", since=9)
class EyeLike(Operator):
    """Ones on diagonal k of a 2-d tensor shaped like the input, zeros elsewhere (dtype: the
    attribute, or the input's)."""

    def check(self):
        x, y = self.input(0), self.output()
        self.expect(x.rank == 2, f"input '{x.name}' has rank {x.rank}, expected 2")
        if x.batched:
            raise self.error(f"the rows of '{x.name}' are the batch axis: the diagonal mixes samples "
                             "(compile with batch_axis=None)")
        self.expect(tuple(y.shape) == tuple(x.shape), f"output shape {list(y.shape)} is not the input's {list(x.shape)}")

    def forward(self, ctx):
        y = self.output()
        if y.numel == 0:
            return
        rows, cols = y.shape
        k = int(self.attr("k", 0))
        loops = [(ctx.fresh("r"), rows), (ctx.fresh("c"), cols)]
        r, c = (v if n > 1 else "0" for v, n in loops)
        one, zero = literal(1, y.dtype), literal(0, y.dtype)
        body = [y.store(ix.add(ix.mul(r, cols), c), f"({one} if {c} - {r} == {k} else {zero})")]
        ctx.render("nest.py.j2", loops=[(v, n) for v, n in loops if n > 1], body=body)


@register("OneHot", since=9)
class OneHot(Operator):
    """out[..., d, ...] = values[1] where d == indices[...] (negative indices count from the end),
    values[0] elsewhere; the new axis of length depth (a constant) goes at `axis`. Indices out of
    [-depth, depth) give a row of values[0]."""

    @classmethod
    def infer(cls, node, inputs):
        """Return the output's type and shape when depth is a constant (onnx may leave it unknown)."""
        idx, depth, values = (inputs + [None] * 3)[:3]
        if idx is None or depth is None or depth.value is None or values is None or idx.shape is None:
            return None
        d = int(np.asarray(depth.value).reshape(-1)[0])
        shape = list(idx.shape)
        axis = int(node.attrs.get("axis", -1))
        shape.insert(axis % (len(shape) + 1), d)
        return [(values.elem_type, tuple(shape))]

    def check(self):
        idx, values, y = self.input(0), self.input(2), self.output()
        self.expect_dtype(idx, ("float", "int"), "input 0 (indices)")
        self.expect(values.numel == 2, f"values '{values.name}' must hold 2 values (off, on), it has {values.numel}")
        self.depth = int(np.asarray(self.const(1, "depth")).reshape(-1)[0])
        self.expect(self.depth > 0, f"depth {self.depth} is not positive")
        self.ax = self.axis(self.attr("axis", -1), idx.rank + 1, batched=idx.batched)
        want = list(idx.shape)
        want.insert(self.ax, self.depth)
        self.expect(tuple(y.shape) == tuple(want), f"output shape {list(y.shape)} is not {want}")

    def forward(self, ctx):
        idx, values, y = self.input(0), self.input(2), self.output()
        if y.numel == 0:
            return
        outer = int(np.prod(idx.shape[: self.ax], dtype=np.int64))
        inner = int(np.prod(idx.shape[self.ax:], dtype=np.int64))
        loops = [(ctx.fresh("o"), outer), (ctx.fresh("d"), self.depth), (ctx.fresh("r"), inner)]
        o, d, r = (v if n > 1 else "0" for v, n in loops)
        off, on = ctx.let(values.load("0"), "off"), ctx.let(values.load("1"), "on")
        g = ctx.fresh("g")
        body = [f"{g} = {convert(idx.load(ix.add(ix.mul(o, inner), r)), idx.dtype, dtypes.INT32)}",
                f"{g} = ({g} + {self.depth} if {g} < 0 else {g})",
                y.store(ix.add(ix.mul(o, self.depth * inner), ix.mul(d, inner), r), f"({on} if {g} == {d} else {off})")]
        ctx.render("nest.py.j2", loops=[(v, n) for v, n in loops if n > 1], body=body)
