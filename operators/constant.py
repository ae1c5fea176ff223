"""Constant and ConstantOfShape. Constants that feed other nodes become initializers before
codegen; these operators write the values of the ones that are graph outputs (or whose shape
depends on the batch): element i is a literal, a pattern of i, or a select over a few literals."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import constant_storage, literal


_VALUE_ATTRS = ("value", "value_float", "value_floats", "value_int", "value_ints", "value_string", "value_strings", "sparse_value")


def constant_values(op: Operator, value: np.ndarray) -> np.ndarray:
    """Return `value` flattened to the kernel type of output 0 (an error naming the node when it
    does not fit it or the output's size)."""
    y = op.output()
    flat = np.asarray(value).reshape(-1)
    if flat.size != y.numel:
        raise op.error(f"value has {flat.size} elements, output '{y.name}' {list(y.shape)} has {y.numel}")
    try:
        return dtypes.to_kernel(flat, y.dtype, f"{op.node.describe()} value")
    except OverflowError as e:
        raise op.error(str(e)) from None


def constant_element(op: Operator, value: np.ndarray, i: str) -> str:
    """Return the DSL of element i of the constant: computed for an all-equal or arithmetic
    pattern, else a chain of selects over the literals (a Constant that reaches a kernel is a small
    graph output)."""
    y = op.output()
    flat = constant_values(op, value)
    pattern = constant_storage(flat, y.dtype)
    if pattern is not None:
        return pattern.load(i)
    if i.isdigit():
        return literal(flat[int(i)], y.dtype)
    v = literal(flat[-1], y.dtype)
    for k in range(flat.size - 2, -1, -1):
        v = f"({literal(flat[k], y.dtype)} if {i} == {k} else {v})"
    return v


def emit_constant(ctx, op: Operator, value: np.ndarray) -> None:
    """Write `value` into output 0: a loop for an all-equal or arithmetic pattern, else one store
    per element."""
    y = op.output()
    if constant_storage(constant_values(op, value), y.dtype) is not None:
        with ctx.loop(y.numel) as i:
            ctx.line(y.store(i, constant_element(op, value, i)))
        return
    for k in range(y.numel):
        ctx.line(y.store(str(k), constant_element(op, value, str(k))))


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
        # a pattern is computed from the index; any other value is a select over its literals
        self.inline = constant_storage(constant_values(self, self.value), self.output().dtype) is not None

    def forward(self, ctx):
        emit_constant(ctx, self, self.value)

    def element(self, ctx, i, k=0):
        return constant_element(self, self.value, i)


@register("ConstantOfShape", since=9)
class ConstantOfShape(Operator):
    """A tensor of the output's shape filled with `value` (a one-element tensor; default float 0).
    The shape input may depend on the batch size: only the inferred per-sample shape is used."""

    shape_inputs_ok = True
    inline = True  # all equal: a literal

    def check(self):
        v = self.attr("value", None)
        self.value = np.zeros(1, np.float32) if v is None else np.asarray(v)
        self.expect(self.value.size == 1, f"attribute value must have one element, got {self.value.size}")
        y = self.output()
        self.expect(
            y.dtype.numpy == self.value.dtype,
            f"output '{y.name}' has type {y.dtype.name.lower()}, the value {self.value.dtype}",
        )

    def filled(self) -> np.ndarray:
        return np.full(self.output().numel, self.value.reshape(-1)[0], dtype=self.value.dtype)

    def forward(self, ctx):
        emit_constant(ctx, self, self.filled())

    def element(self, ctx, i, k=0):
        return constant_element(self, self.filled(), i)
