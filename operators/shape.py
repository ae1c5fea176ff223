"""Operators that move elements without computing: views (Reshape, Flatten, Squeeze, Unsqueeze)."""
from __future__ import annotations

from luisaml.operator import Operator
from luisaml.registry import register

from .common import emit_map


class View(Operator):
    """Output 0 is input 0 with another shape; it shares storage unless it is a graph output."""

    view = True
    shape_inputs_ok = True  # the shape input may depend on the batch size: only the output shape is used

    def check(self):
        x, y = self.input(0), self.output()
        self.expect(x.numel == y.numel, f"input has {x.numel} elements, output {y.numel}")

    def forward(self, ctx):
        emit_map(ctx, self.output(), [self.input(0)], lambda v: v, broadcast=False)


register("Reshape", since=5)(type("Reshape", (View,), {}))
register("Flatten", since=1)(type("Flatten", (View,), {}))
register("Squeeze", since=1)(type("Squeeze", (View,), {}))
register("Unsqueeze", since=1)(type("Unsqueeze", (View,), {}))
