"""Operators that change a shape without moving elements: views (Reshape, Flatten, Squeeze,
Unsqueeze), Expand (a broadcast copy) and Shape."""
from __future__ import annotations

import numpy as np

from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import emit_map


class View(Operator):
    """Output 0 is input 0 with another shape (ONNX shape inference gives it, for every version);
    it shares storage unless it is a graph output, which gets a copy."""

    view = True
    shape_inputs_ok = True  # the shape input may depend on the batch size: only the output shape is used

    def check(self):
        x, y = self.input(0), self.output()
        self.expect(x.numel == y.numel, f"input '{x.name}' has {x.numel} elements, output '{y.name}' {y.numel}")

    def forward(self, ctx):
        emit_map(ctx, self.output(), [self.input(0)], lambda v: v, broadcast=False)


register("Reshape", since=1)(type("Reshape", (View,), {}))
register("Flatten", since=1)(type("Flatten", (View,), {}))
register("Squeeze", since=1)(type("Squeeze", (View,), {}))
register("Unsqueeze", since=1)(type("Unsqueeze", (View,), {}))


@register("Expand", since=8)
class Expand(Operator):
    """Input 0 broadcast to the output shape (numpy rules; the shape input is only checked)."""

    shape_inputs_ok = True

    def check(self):
        x, y = self.input(0), self.output()
        try:
            ok = tuple(np.broadcast_shapes(x.shape, y.shape)) == tuple(y.shape)
        except ValueError:
            ok = False
        self.expect(ok, f"input '{x.name}' {list(x.shape)} does not broadcast to the output shape {list(y.shape)}")

    def forward(self, ctx):
        emit_map(ctx, self.output(), [self.input(0)], lambda v: v)


@register("Shape", since=1)
class Shape(Operator):
    """The input's shape (start/end from opset 15) as int64 literals. Shapes are static, so the
    constant folder normally replaces this node; the batch dimension is not known per sample."""

    def check(self):
        x = self.input(0)
        start, end = int(self.attr("start", 0)), self.attr("end", None)
        r = x.rank
        start = min(max(start + r if start < 0 else start, 0), r)
        end = r if end is None else min(max(int(end) + r if int(end) < 0 else int(end), 0), r)
        self.dims = list(range(start, end))
        if x.batched and 0 in self.dims:
            raise self.error(
                f"the shape of '{x.name}' includes the batch dimension, which a per-sample kernel does not "
                "know (compile with batch_axis=None)"
            )

    def forward(self, ctx):
        y, x = self.output(), self.input(0)
        for k, d in enumerate(self.dims):
            ctx.line(y.store(str(k), literal(x.shape[d], y.dtype)))
