"""Activation functions: Relu and its variants (LeakyRelu, PRelu, Elu, Selu, Celu, ThresholdedRelu),
the sigmoid family (Sigmoid, HardSigmoid, HardSwish, Swish, SwiGLU), the smooth ones (Softplus,
Softsign, Mish, Gelu) and Shrink: elementwise maps (elementwise.Map) whose expressions carry the
attributes' constants and guard NaN and the sign of zero as onnxruntime does."""
from __future__ import annotations

import math

from luisaml import dtypes
from luisaml.registry import register
from luisaml.storage import literal

from .common import convert
from .elementwise import NUM, Map, erf_helper, register_map

# 0 where x < 0, else x: NaN fails the comparison and stays NaN (the max builtin is C's fmax,
# which drops it), and -0.0 stays -0.0, both as in onnxruntime
register_map("Relu", 6, lambda s, x: f"({s.lit(0)} if {x} < {s.lit(0)} else {x})", NUM, exact_in_half=True)

# 1 / (1 + e^-x): e^-x = inf for very negative x gives 0, as it should
register_map("Sigmoid", 6, lambda s, x: f"({s.lit(1)} / ({s.lit(1)} + exp(-{x})))")
# log(1 + e^x) without overflow or underflow (shaders/dsl_lib.py)
_SOFTPLUS = {"helpers": lambda self: [("softplus", "dsl_lib")]}
register_map("Softplus", 1, lambda s, x: f"softplus({x})", **_SOFTPLUS)
register_map("Softsign", 1, lambda s, x: f"({x} / ({s.lit(1)} + abs({x})))")
# x tanh(softplus(x)), softplus as in Softplus
register_map("Mish", 18, lambda s, x: f"({x} * tanh(softplus({x})))", **_SOFTPLUS)


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
        return f"({gamma} * ({x} if {x} > {self.lit(0)} else {alpha} * exp({x}) - {alpha}))"


@register("HardSigmoid", since=6)
class HardSigmoid(Map):
    """clamp(alpha x + beta, 0, 1); NaN stays NaN."""

    def helpers(self):
        return [("clamp_nan", "dsl_lib")]

    def expr(self, x):
        a, b = self.lit(self.attr("alpha", 0.2)), self.lit(self.attr("beta", 0.5))
        return f"clamp_nan({a} * {x} + {b}, {self.lit(0)}, {self.lit(1)})"


@register("Gelu", since=20)
class Gelu(Map):
    """0.5 x (1 + erf(x / sqrt 2)), or the tanh approximation; erf as the Erf operator's."""

    no_blocks = False  # set on the CPU backend's plans (luisaml/compiler.py)
    fast_erf = True

    def check(self):
        super().check()
        self.approximate = self.attr("approximate", "none")
        self.expect(
            self.approximate in ("none", "tanh"), f"attribute approximate must be 'none' or 'tanh', not {self.approximate!r}"
        )

    def helpers(self):
        return [erf_helper(self)] if self.approximate == "none" else []

    def expr(self, x):
        c = self.lit
        if self.approximate == "tanh":
            inner = f"{c(math.sqrt(2 / math.pi))} * ({x} + {c(0.044715)} * {x} * {x} * {x})"
            return f"({c(0.5)} * {x} * ({c(1)} + tanh({inner})))"
        return f"({c(0.5)} * {x} * ({c(1)} + {erf_helper(self)[0]}({x} * {c(1 / math.sqrt(2))})))"


@register("HardSwish", since=14)
class HardSwish(Map):
    """x * clamp(x / 6 + 1 / 2, 0, 1)."""

    def expr(self, x):
        c = self.lit
        return f"({x} * clamp({c(1 / 6)} * {x} + {c(0.5)}, {c(0)}, {c(1)}))"


@register("PRelu", since=7)
class PRelu(Map):
    """x < 0 ? slope * x : x, slope broadcast to x (opset 7 on: numpy rules)."""

    kinds = NUM

    def expr(self, x, slope):
        return f"({x} * {slope} if {x} < {self.lit(0)} else {x})"


@register("Celu", since=12)
class Celu(Map):
    """max(0, x) + min(0, alpha (exp(x / alpha) - 1)), as a select: one term is 0 on each side
    of 0 (for either sign of alpha), and NaN, which max/min would drop, takes the exp branch."""

    def expr(self, x):
        c = self.lit
        alpha = float(self.attr("alpha", 1.0))
        return f"({x} if {x} > {c(0)} else {c(alpha)} * (exp({x} / {c(alpha)}) - {c(1)}))"


@register("ThresholdedRelu", since=10)
class ThresholdedRelu(Map):
    def expr(self, x):
        return f"({x} if {x} > {self.lit(self.attr('alpha', 1.0))} else {self.lit(0)})"


@register("Shrink", since=9)
class Shrink(Map):
    """x + bias below -lambd, x - bias above lambd, 0 between (any numeric type)."""

    kinds = NUM

    def expr(self, x):
        dt = self.dtype
        lambd, bias = float(self.attr("lambd", 0.5)), float(self.attr("bias", 0.0))
        if dt.is_int:  # the float attributes compare and add in float, then convert (as onnxruntime)
            xf = convert(x, dt, dtypes.FLOAT)
            lo = f"{xf} < {literal(-lambd, dtypes.FLOAT)}"
            hi = f"{xf} > {literal(lambd, dtypes.FLOAT)}"
            plus = convert(f"{xf} + {literal(bias, dtypes.FLOAT)}", dtypes.FLOAT, dt)
            minus = convert(f"{xf} - {literal(bias, dtypes.FLOAT)}", dtypes.FLOAT, dt)
            return f"({plus} if {lo} else ({minus} if {hi} else 0))"
        c = self.lit
        return f"({x} + {c(bias)} if {x} < {c(-lambd)} else ({x} - {c(bias)} if {x} > {c(lambd)} else {c(0)}))"


@register("Swish", since=24)
class Swish(Map):
    """x * sigmoid(alpha x)."""

    def expr(self, x):
        c = self.lit
        return f"({x} / ({c(1)} + exp(-{c(self.attr('alpha', 1.0))} * {x})))"


@register("SwiGLU", since=28)
class SwiGLU(Map):
    """Swish_alpha(A) * B = A * sigmoid(alpha A) * B (A and B of one shape)."""

    def check(self):
        super().check()
        a, b = self.input(0), self.input(1)
        self.expect(tuple(a.shape) == tuple(b.shape), f"A '{a.name}' {list(a.shape)} and B '{b.name}' {list(b.shape)} differ")

    def expr(self, a, b):
        c = self.lit
        return f"({a} / ({c(1)} + exp(-{c(self.attr('alpha', 1.0))} * {a})) * {b})"
