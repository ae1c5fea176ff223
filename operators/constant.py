"""Constant and ConstantOfShape. Constants that feed other nodes become initializers before
codegen; these operators write the values of the ones that are graph outputs (or whose shape
depends on the batch)."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import constant_storage, literal


_VALUE_ATTRS = ("value", "value_float", "value_floats", "value_int", "value_ints", "value_string", "value_strings", "sparse_value")


def emit_constant(ctx, op: Operator, value: np.ndarray) -> None:
    """Write `value` into output 0: a loop for an all-equal or arithmetic pattern, else one store
    per element."""
    y = op.output()
    flat = np.asarray(value).reshape(-1)
    if flat.size != y.numel:
        raise op.error(f"value has {flat.size} elements, output '{y.name}' {list(y.shape)} has {y.numel}")
    try:
        flat = dtypes.to_kernel(flat, y.dtype, f"{op.node.describe()} value")
    except OverflowError as e:
        raise op.error(str(e)) from None
    pattern = constant_storage(flat, y.dtype)
    if pattern is not None:
        with ctx.loop(y.numel) as i:
            ctx.line(y.store(i, pattern.load(i)))
        return
    for k, v in enumerate(flat):
        ctx.line(y.store(str(k), literal(v, y.dtype)))


@register("Constant", since=1)
class Constant(Operator):
    """The value of exactly one value* attribute (value_float(s)/value_int(s) from opset 12)."""

    def check(self):
        given = [a for a in _VALUE_ATTRS if a in self.node.attrs]
        self.expect(len(given) == 1, f"exactly one of the value attributes must be given, got {given or 'none'}")
        name = given[0]
        if name in ("value_string", "value_strings"):
            raise self.error("string constants are not supported")
        if name == "sparse_value":
            raise self.error("sparse_value is not supported (give a dense 'value')")
        v = self.node.attrs[name]
        if name == "value":
            self.value = np.asarray(v)
        else:
            self.value = np.asarray(v, dtype=np.float32 if "float" in name else np.int64)
        if getattr(self.output(), "batch_dependent", False):
            raise self.error("its value depends on the batch size; per-sample execution cannot produce it")

    def forward(self, ctx):
        emit_constant(ctx, self, self.value)


@register("ConstantOfShape", since=9)
class ConstantOfShape(Operator):
    """A tensor of the output's shape filled with `value` (a one-element tensor; default float 0).
    The shape input may depend on the batch size: only the inferred per-sample shape is used."""

    shape_inputs_ok = True

    def check(self):
        v = self.attr("value", None)
        self.value = np.zeros(1, np.float32) if v is None else np.asarray(v)
        self.expect(self.value.size == 1, f"attribute value must have one element, got {self.value.size}")
        y = self.output()
        self.expect(
            y.dtype.numpy == self.value.dtype,
            f"output '{y.name}' has type {y.dtype.name.lower()}, the value {self.value.dtype}",
        )

    def forward(self, ctx):
        y = self.output()
        emit_constant(ctx, self, np.full(y.numel, self.value.reshape(-1)[0], dtype=self.value.dtype))
