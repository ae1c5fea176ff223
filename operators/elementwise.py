"""Elementwise operators: unary math and activations, binary arithmetic and comparison with
numpy broadcasting, variadic Min/Max/Sum/Mean, Where, Clip and Cast."""
from __future__ import annotations

import math

import numpy as np

from luisaml import dtypes
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import convert, emit_map


class Map(Operator):
    """out = f(inputs...) per element, inputs broadcast to the output."""

    inplace = (0, 1, 2)
    kinds: tuple[str, ...] = ("float",)  # allowed input dtypes

    def check(self) -> None:
        for k, t in enumerate(self.inputs):
            if t is not None and k < self.typed_inputs():
                self.expect_dtype(t, self.kinds, f"input {k}")

    def typed_inputs(self) -> int:
        return len(self.inputs)

    def lit(self, v) -> str:
        """Return a literal of the first input's dtype."""
        return literal(v, self.input(0).dtype)

    def expr(self, *v: str) -> str:
        raise NotImplementedError

    def forward(self, ctx) -> None:
        emit_map(ctx, self.output(), [t for t in self.inputs if t is not None], self.expr)


def _unary(op_type: str, since: int, fn, kinds=("float",)):
    """Register a unary op whose element expression is fn(self, x)."""
    cls = type(op_type, (Map,), {"kinds": kinds, "expr": lambda self, x: fn(self, x)})
    register(op_type, since=since)(cls)
    return cls


NUM = ("float", "int")
_unary("Relu", 6, lambda s, x: f"max({x}, {s.lit(0)})", NUM)
_unary("Neg", 6, lambda s, x: f"-{x}", NUM)
_unary("Abs", 6, lambda s, x: f"abs({x})", NUM)
_unary("Exp", 6, lambda s, x: f"exp({x})")
_unary("Log", 6, lambda s, x: f"log({x})")
_unary("Sqrt", 6, lambda s, x: f"sqrt({x})")
_unary("Reciprocal", 6, lambda s, x: f"{s.lit(1)} / {x}")
_unary("Sin", 7, lambda s, x: f"sin({x})")
_unary("Cos", 7, lambda s, x: f"cos({x})")
_unary("Tanh", 6, lambda s, x: f"tanh({x})")
# 1 / (1 + e^-x) overflows gracefully: e^-x = inf gives 0
_unary("Sigmoid", 6, lambda s, x: f"{s.lit(1)} / ({s.lit(1)} + exp(-{x}))")
# log(1 + e^x) without overflow: max(x, 0) + log(1 + e^-|x|)
_unary("Softplus", 1, lambda s, x: f"max({x}, {s.lit(0)}) + log({s.lit(1)} + exp(-abs({x})))")


@register("LeakyRelu", since=6)
class LeakyRelu(Map):
    def expr(self, x):
        return f"({x} if {x} >= {self.lit(0)} else {x} * {self.lit(self.attr('alpha', 0.01))})"


@register("Elu", since=6)
class Elu(Map):
    def expr(self, x):
        alpha = self.lit(self.attr("alpha", 1.0))
        return f"({x} if {x} > {self.lit(0)} else {alpha} * (exp({x}) - {self.lit(1)}))"


@register("Selu", since=6)
class Selu(Map):
    def expr(self, x):
        alpha = self.lit(self.attr("alpha", 1.67326319217681884765625))
        gamma = self.lit(self.attr("gamma", 1.05070102214813232421875))
        return f"{gamma} * ({x} if {x} > {self.lit(0)} else {alpha} * exp({x}) - {alpha})"


@register("Gelu", since=20)
class Gelu(Map):
    def check(self):
        super().check()
        self.approximate = self.attr("approximate", "none")
        self.expect(self.approximate in ("none", "tanh"), f"approximate must be 'none' or 'tanh', not {self.approximate!r}")

    def forward(self, ctx):
        if self.approximate == "none":
            self.erf = ctx.use_helper("erf_f32")
        super().forward(ctx)

    def expr(self, x):
        c = self.lit
        if self.approximate == "tanh":
            inner = f"{c(math.sqrt(2 / math.pi))} * ({x} + {c(0.044715)} * {x} * {x} * {x})"
            return f"{c(0.5)} * {x} * ({c(1)} + tanh({inner}))"
        xf = x if self.input(0).dtype.dsl == "float" else f"float({x})"
        e = f"{self.erf}({xf} * {literal(1 / math.sqrt(2), dtypes.FLOAT)})"
        if self.input(0).dtype.dsl != "float":
            e = f"half({e})"
        return f"{c(0.5)} * {x} * ({c(1)} + {e})"


# ---- binary -------------------------------------------------------------------------------


def _binary(op_type: str, since: int, fn, kinds=NUM):
    cls = type(op_type, (Map,), {"kinds": kinds, "expr": lambda self, a, b: fn(self, a, b)})
    register(op_type, since=since)(cls)
    return cls


_binary("Add", 7, lambda s, a, b: f"{a} + {b}")
_binary("Sub", 7, lambda s, a, b: f"{a} - {b}")
_binary("Mul", 7, lambda s, a, b: f"{a} * {b}")


@register("Div", since=7)
class Div(Map):
    kinds = NUM

    def expr(self, a, b):
        # integer division truncates toward zero (ONNX reference: numpy divide cast back)
        return f"{a} / {b}" if self.input(0).dtype.is_float else f"{a} // {b}"


@register("Pow", since=7)
class Pow(Map):
    kinds = NUM

    def typed_inputs(self) -> int:
        return 1

    def forward(self, ctx):
        y = self.input(1)
        self.square = y.value is not None and y.value.size == 1 and float(y.value.reshape(-1)[0]) == 2.0
        super().forward(ctx)

    def expr(self, a, b):
        x, y, out = self.input(0), self.input(1), self.output()
        if self.square:
            return f"{a} * {a}"  # exact, like pow(x, 2)
        af = a if x.dtype.dsl == "float" else f"float({a})"
        bf = b if y.dtype.dsl == "float" else f"float({b})"
        return convert(f"pow({af}, {bf})", dtypes.FLOAT, out.dtype)


def _compare(op_type: str, since: int, sym: str):
    cls = type(op_type, (Map,), {"kinds": NUM + ("bool",), "inplace": (), "expr": lambda self, a, b: f"{a} {sym} {b}"})
    register(op_type, since=since)(cls)


_compare("Equal", 11, "==")
_compare("Less", 9, "<")
_compare("Greater", 9, ">")
_compare("LessOrEqual", 12, "<=")
_compare("GreaterOrEqual", 12, ">=")


class Variadic(Map):
    """Min/Max/Sum/Mean over any number of broadcast inputs."""

    kinds = NUM

    def combine(self, a: str, b: str) -> str:
        raise NotImplementedError

    def expr(self, *v):
        acc = v[0]
        for x in v[1:]:
            acc = self.combine(acc, x)
        return acc


@register("Max", since=8)
class Max(Variadic):
    def combine(self, a, b):
        return f"max({a}, {b})"


@register("Min", since=8)
class Min(Variadic):
    def combine(self, a, b):
        return f"min({a}, {b})"


@register("Sum", since=8)
class Sum(Variadic):
    def combine(self, a, b):
        return f"{a} + {b}"


@register("Mean", since=8)
class Mean(Variadic):
    kinds = ("float",)

    def combine(self, a, b):
        return f"{a} + {b}"

    def expr(self, *v):
        return f"({super().expr(*v)}) / {self.lit(len(v))}"


@register("Where", since=9)
class Where(Map):
    inplace = (1, 2)

    def check(self):
        self.expect_dtype(self.input(0), ("bool",), "condition")
        self.expect(self.input(1).dtype == self.input(2).dtype, "X and Y must have the same type")

    def expr(self, c, a, b):
        return f"({a} if {c} else {b})"


@register("Clip", since=11)
class Clip(Map):
    """Clip with optional min and max inputs (absent or empty: unbounded)."""

    inplace = (0,)
    kinds = NUM

    def typed_inputs(self) -> int:
        return 1

    def forward(self, ctx):
        x = self.input(0)
        self.bounds = [k for k in (1, 2) if self.has_input(k)]
        emit_map(ctx, self.output(), [x] + [self.input(k) for k in self.bounds], self.expr)

    def expr(self, x, *b):
        bound = dict(zip(self.bounds, b))
        e = x
        if 1 in bound:
            e = f"max({e}, {bound[1]})"
        if 2 in bound:
            e = f"min({e}, {bound[2]})"
        return e


@register("Cast", since=6)
class Cast(Map):
    inplace = ()
    kinds = NUM + ("bool",)

    def check(self):
        super().check()
        to = self.attr("to")
        self.expect(to in dtypes.SUPPORTED, f"cannot cast to {dtypes.onnx_name(to)}: unsupported type")

    def expr(self, x):
        return convert(x, self.input(0).dtype, self.output().dtype)


@register("Identity", since=1)
class Identity(Map):
    """A copy; Identity nodes that are not graph outputs are removed before compiling."""

    view = True
    kinds = NUM + ("bool",)

    def expr(self, x):
        return x
