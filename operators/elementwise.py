"""Elementwise operators: Map (the base of every elementwise map), unary math, binary arithmetic,
comparison, logic and bitwise ops with numpy broadcasting, variadic Min/Max/Sum/Mean, Where, Clip,
Cast, CastLike, BitCast, Identity and inference Dropout (the activation functions, Maps too, are
in activations.py).

Half inputs are computed in float and rounded to half once at the end (what onnxruntime does for
float16 kernels); ops that only select or negate values are exact in half and stay there."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml.dtypes import DType
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import abs_expr, bload, compute_dtype, convert, emit_map

FLOAT = ("float",)
NUM = ("float", "int")
ANY = ("float", "int", "bool")


class Map(Operator):
    """out = expr(inputs...) per element, inputs broadcast to the output (numpy rules).

    Subclasses set `kinds` (allowed dtypes of the typed inputs) and write expr() over input
    element names already converted to the compute dtype; lit() gives literals of that dtype;
    helpers() names the DSL functions expr() calls. A map is inline: a stage computes it where
    its output is read, or as the epilogue of the node before it (schedule.py)."""

    inplace = (0, 1, 2)
    inline = True
    elementwise = True
    kinds: tuple[str, ...] = FLOAT
    exact_in_half = False  # selection/negation only: no need to compute half in float
    same_type = True  # the typed inputs must all have the same dtype (ONNX type constraint T)
    result_bool = False  # the element expression is a bool (comparisons)

    def check(self) -> None:
        typed = self.typed()
        for k, t in typed:
            self.expect_dtype(t, self.kinds, f"input {k}")
        if self.same_type and typed:
            k0, t0 = typed[0]
            for k, t in typed[1:]:
                self.expect(
                    t.dtype == t0.dtype,
                    f"input {k} '{t.name}' has type {t.dtype.name.lower()}, but input {k0} '{t0.name}' "
                    f"has {t0.dtype.name.lower()}; they must match",
                )

    def typed_inputs(self) -> range:
        """Return the input indices whose dtype `kinds` constrains."""
        return range(len(self.inputs))

    def typed(self) -> list:
        return [(k, self.inputs[k]) for k in self.typed_inputs() if k < len(self.inputs) and self.inputs[k] is not None]

    @property
    def dtype(self) -> DType:
        """The dtype the element expression computes in."""
        dt = self.typed()[0][1].dtype
        return dt if self.exact_in_half else compute_dtype(dt)

    def lit(self, v) -> str:
        """Return a literal of the compute dtype."""
        return literal(v, self.dtype)

    def up(self, v: str, t, k: int) -> str:
        """Return element v of operand k (tensor t) in the compute dtype (half goes to float)."""
        return convert(v, t.dtype, self.dtype) if t.dtype.dsl == "half" and not self.exact_in_half else v

    def expr(self, *v: str) -> str:
        raise NotImplementedError

    def helpers(self) -> list[tuple[str, str]]:
        """Return the (DSL function, shaders module) pairs expr() calls."""
        return []

    def operands(self) -> list:
        """Return the tensors the map reads, in the order expr() takes them."""
        return [t for t in self.inputs if t is not None]

    def value(self, names: list[str]) -> str:
        """Return the output element from its operands' elements (names or expressions)."""
        out, ins = self.output(), self.operands()
        res = dtypes.BOOL if self.result_bool else self.dtype
        return convert(self.expr(*(self.up(n, t, k) for k, (n, t) in enumerate(zip(names, ins)))), res, out.dtype)

    def forward(self, ctx) -> None:
        for name, module in self.helpers():
            ctx.use_helper(name, module)
        emit_map(ctx, self.output(), self.operands(), lambda *names: self.value(list(names)))

    def element(self, ctx, i: str, k: int = 0) -> str:
        for name, module in self.helpers():
            ctx.use_helper(name, module)
        out = self.output()
        return self.value([ctx.let(bload(t, out, i), "v") for t in self.operands()])

    @property
    def inline_cost(self) -> int:  # type: ignore[override]
        """1 for arithmetic and selects, 4 when the expression calls a transcendental function."""
        text = self.value([f"v{k}" for k in range(len(self.operands()))])
        slow = ("exp(", "log(", "softplus(", "tanh(", "sin(", "cos(", "pow(", "pow_f32(", "sqrt(", "erf", "tan(", "asin", "acos", "atan")
        return 4 if any(f in text for f in slow) else 1


def register_map(op_type: str, since: int, fn, kinds=FLOAT, base=None, **attrs) -> type:
    """Register a Map op whose element expression is fn(self, *inputs)."""
    cls = type(op_type, (base or Map,), {"kinds": kinds, "expr": lambda self, *v: fn(self, *v), **attrs})
    register(op_type, since=since)(cls)
    return cls


# ---- unary ---------------------------------------------------------------------------------
# `since` is the first version with these semantics (earlier ones differ only in the legacy
# consumed_inputs attribute or in the types they allow).
register_map("Neg", 6, lambda s, x: f"(-{x})", NUM, exact_in_half=True)
register_map("Abs", 6, lambda s, x: abs_expr(x, s.dtype), NUM, exact_in_half=True)
register_map("Exp", 6, lambda s, x: f"exp({x})")
register_map("Log", 6, lambda s, x: f"log({x})")
register_map("Sqrt", 6, lambda s, x: f"sqrt_f32({x})", helpers=lambda self: [("sqrt_f32", "math_lib")])
register_map("Reciprocal", 6, lambda s, x: f"({s.lit(1)} / {x})")
register_map("Sin", 7, lambda s, x: f"sin({x})")
register_map("Cos", 7, lambda s, x: f"cos({x})")
register_map("Tanh", 6, lambda s, x: f"tanh({x})")
register_map("Floor", 6, lambda s, x: f"floor({x})")
register_map("Ceil", 6, lambda s, x: f"ceil({x})")
register_map("Not", 1, lambda s, x: f"(not {x})", ("bool",))


def erf_helper(op) -> tuple[str, str]:
    """The (DSL function, shaders module) of op's erf: shaders/dsl_lib.py::erf_f32, or on the CPU
    backend (op.no_blocks, set by luisaml/compiler.py) math_lib.erf_vec_f32, the same pieces without
    a branch or a call, which the loops around it vectorise (a GELU epilogue's 180 ns an element;
    benchmarks/NOTES.md, "A branch-free erf")."""
    return ("erf_vec_f32", "math_lib") if op.no_blocks and op.fast_erf else ("erf_f32", "dsl_lib")


@register("Erf", since=9)
class Erf(Map):
    """erf through erf_helper's function (float; half goes through float)."""

    no_blocks = False  # set on the CPU backend's plans (luisaml/compiler.py)
    fast_erf = True  # there, erf_vec_f32 (False: erf_f32 as on CUDA; benchmarks' A/B)

    def helpers(self):
        return [erf_helper(self)]

    def expr(self, x):
        return f"{erf_helper(self)[0]}({x})"


# ---- binary ------------------------------------------------------------------------------------
# Since opset 7 these broadcast the numpy way (opsets 1-6 had `broadcast`/`axis` attributes).
register_map("Add", 7, lambda s, a, b: f"{a} + {b}", NUM)
register_map("Sub", 7, lambda s, a, b: f"{a} - {b}", NUM)
register_map("Mul", 7, lambda s, a, b: f"{a} * {b}", NUM)


@register("Div", since=7)
class Div(Map):
    kinds = NUM

    def expr(self, a, b):
        # integer division truncates toward zero, like onnxruntime (C division); DSL // does that
        return f"{a} / {b}" if self.dtype.is_float else f"{a} // {b}"


@register("Mod", since=10)
class Mod(Map):
    """Mod. Integers: fmod=0 gives the divisor's sign (Python %), fmod=1 the dividend's (C %).
    Floats (half through float): fmod=1 is C fmod, exact (shaders/math_lib.py::fmod_f32); fmod=0
    is numpy's mod, the Python-style remainder that later opsets allow for floats."""

    kinds = NUM

    def check(self):
        super().check()
        self.fmod = int(self.attr("fmod", 0))
        self.expect(self.fmod in (0, 1), f"attribute fmod must be 0 or 1, not {self.attr('fmod', 0)}")
        self.fn = "fmod_f32" if self.fmod else "pymod_f32"

    def helpers(self):
        return [(self.fn, "math_lib")] if self.dtype.is_float else []

    def expr(self, a, b):
        if self.dtype.is_float:
            return f"{self.fn}({a}, {b})"
        r = f"({a} % {b})"
        if self.fmod:
            return r
        return f"({r} + {b} if ({r} < 0 and {b} > 0) or ({r} > 0 and {b} < 0) else {r})"


@register("Pow", since=7)
class Pow(Map):
    """X ** Y with the type of X. A constant exponent of 2 is a multiplication (exact, as
    onnxruntime does); integer X with integer Y uses exact repeated squaring; integer X with a
    float Y truncates pow(X, Y) (C conversion, as onnxruntime does). Float pow is
    shaders/dsl_lib.pow_f32: C's pow also for an infinite exponent."""

    kinds = NUM
    same_type = False  # Y may have another numeric type than X (opset 12)

    def check(self):
        super().check()
        y = self.input(1)
        self.expect_dtype(y, NUM, "input 1 (Y)")
        self.square = y.value is not None and y.value.size == 1 and float(y.value.reshape(-1)[0]) == 2.0
        self.ipow = self.input(0).dtype.is_int and y.dtype.is_int

    def typed_inputs(self) -> range:
        return range(1)

    def helpers(self):
        if self.square:
            return []
        return [("pow_i32", "dsl_lib")] if self.ipow else [("pow_f32", "dsl_lib")]

    def up(self, v, t, k):
        if k == 0:
            return super().up(v, t, k)
        return v if self.ipow else convert(v, t.dtype, dtypes.FLOAT)

    def expr(self, a, b):
        if self.square:
            return f"{a} * {a}"
        if self.ipow:
            return f"pow_i32({a}, {b})"
        if self.dtype.is_int:
            return convert(f"pow_f32({convert(a, self.dtype, dtypes.FLOAT)}, {b})", dtypes.FLOAT, self.dtype)
        return f"pow_f32({a}, {b})"


class Compare(Map):
    """A comparison: bool out, inputs of one numeric (or bool) type."""

    kinds = ANY
    inplace = ()
    exact_in_half = True
    result_bool = True
    sym = "=="

    def expr(self, a, b):
        if self.dtype.is_bool:  # the DSL compares numbers only
            a, b = convert(a, dtypes.BOOL, dtypes.INT32), convert(b, dtypes.BOOL, dtypes.INT32)
        return f"({a} {self.sym} {b})"


for _name, _since, _sym in (
    ("Equal", 7, "=="),
    ("Less", 7, "<"),
    ("Greater", 7, ">"),
    ("LessOrEqual", 12, "<="),
    ("GreaterOrEqual", 12, ">="),
):
    register(_name, since=_since)(type(_name, (Compare,), {"sym": _sym}))


def _logic(op_type: str, sym: str) -> None:
    register_map(op_type, 7, lambda s, a, b: f"({a} {sym} {b})", ("bool",), result_bool=True)


_logic("And", "and")
_logic("Or", "or")
register_map("Xor", 7, lambda s, a, b: f"(({a} or {b}) and not ({a} and {b}))", ("bool",), result_bool=True)


class Variadic(Map):
    """Min/Max/Sum/Mean over any number of broadcast inputs (numpy broadcasting since opset 8)."""

    kinds = NUM

    def combine(self, a: str, b: str) -> str:
        raise NotImplementedError

    def expr(self, *v):
        acc = v[0]
        for x in v[1:]:
            acc = self.combine(acc, x)
        return acc


def _variadic(op_type: str, combine, **attrs) -> type:
    """Register a Variadic op that folds its inputs with combine(a, b)."""
    cls = type(op_type, (Variadic,), {"combine": lambda self, a, b: combine(a, b), **attrs})
    return register(op_type, since=8)(cls)


class Extreme(Variadic):
    """Max/Min as numpy's maximum/minimum: NaN when any input is NaN (the builtins drop it)."""

    exact_in_half = True
    nan_fn, plain_fn = "max_nan", "max"  # floats: shaders/dsl_lib.py's NaN-keeping one; ints: the builtin

    def helpers(self):
        return [(self.fn, "dsl_lib")] if self.dtype.dsl in ("float", "half") else []

    @property
    def fn(self) -> str:
        return self.nan_fn if self.dtype.dsl in ("float", "half") else self.plain_fn

    def combine(self, a, b):
        return f"{self.fn}({a}, {b})"


register("Max", since=8)(type("Max", (Extreme,), {}))
register("Min", since=8)(type("Min", (Extreme,), {"nan_fn": "min_nan", "plain_fn": "min"}))
Sum = _variadic("Sum", lambda a, b: f"{a} + {b}")


@register("Mean", since=8)
class Mean(Sum):
    kinds = FLOAT

    def expr(self, *v):
        return f"({super().expr(*v)}) / {self.lit(len(v))}"


@register("Where", since=9)
class Where(Map):
    """cond ? X : Y with the three broadcast together."""

    inplace = (1, 2)
    kinds = ANY
    exact_in_half = True

    def check(self):
        self.expect_dtype(self.input(0), ("bool",), "input 0 (condition)")
        super().check()

    def typed_inputs(self) -> range:
        return range(1, 3)

    def expr(self, c, a, b):
        return f"({a} if {c} else {b})"


def clip_expr(x: str, lo: str | None, hi: str | None) -> str:
    """Return min(max(x, lo), hi) as onnxruntime computes it (std::max, then std::min): NaN x stays
    NaN, a NaN bound bounds nothing, and min > max gives max. No bound: None. x, lo and hi are
    names or literals (each appears more than once)."""
    if lo is not None and hi is not None:
        return f"(({hi} if {hi} < {lo} else {lo}) if {x} < {lo} else ({hi} if {hi} < {x} else {x}))"
    if lo is not None:
        return f"({lo} if {x} < {lo} else {x})"
    if hi is not None:
        return f"({hi} if {hi} < {x} else {x})"
    return x


@register("Clip", since=11)
class Clip(Map):
    """Clip with optional min and max inputs (absent: the type's lowest / largest value, as
    onnxruntime); min > max gives max, as ONNX says."""

    inplace = (0,)
    kinds = NUM
    exact_in_half = True

    def check(self):
        super().check()
        for k, what in ((1, "min"), (2, "max")):
            if self.has_input(k):
                self.expect(self.input(k).numel == 1, f"input {k} ({what}) must be a scalar, got shape {list(self.input(k).shape)}")

    @property
    def bounds(self) -> list[int]:
        return [k for k in (1, 2) if self.has_input(k)]

    def operands(self):
        return [self.input(0)] + [self.input(k) for k in self.bounds]

    def expr(self, x, *b):
        bound = dict(zip(self.bounds, b))
        lo, hi = bound.get(1), bound.get(2)
        if self.dtype.is_float:
            # onnxruntime's absent bound is the type's lowest / largest finite value (Clip-6's
            # defaults): an infinity is clamped to it
            fin = np.finfo(self.dtype.kernel_numpy)
            lo, hi = lo or self.lit(fin.min), hi or self.lit(fin.max)
        return clip_expr(x, lo, hi)


@register("Clip", since=6)
class ClipAttr(Map):
    """Clip-6: min and max as float attributes."""

    inplace = (0,)
    exact_in_half = True

    def expr(self, x):
        lo, hi = self.attr("min", -3.4028234663852886e38), self.attr("max", 3.4028234663852886e38)
        return clip_expr(x, self.lit(lo), self.lit(hi))


@register("Cast", since=6)
class Cast(Map):
    """Cast between float, half, int32, int64 (held as int32), uint32 and bool."""

    inplace = ()
    kinds = ANY
    exact_in_half = True

    def check(self):
        super().check()
        to = self.attr("to")
        self.expect(to in dtypes.SUPPORTED, f"cannot cast to {dtypes.onnx_name(to)}: unsupported type")

    def operands(self):
        return [self.input(0)]

    def value(self, names):
        return convert(names[0], self.input(0).dtype, self.output().dtype)


@register("Identity", since=1)
class Identity(Map):
    """A copy; Identity nodes that are not graph outputs are removed before compiling."""

    view = True
    kinds = ANY
    exact_in_half = True

    def expr(self, x):
        return x


@register("Dropout", since=1)
class Dropout(Operator):
    """Inference-mode Dropout kept as a node (its output or mask is a graph output; the cleanup pass
    removes the others): the output is the input, the mask all true. Training mode draws random
    numbers, which luisaml does not do: is_test=0 before opset 7, or a training_mode input that is
    not a constant false, is an error."""

    inplace = (0,)

    def check(self):
        self.expect_dtype(self.input(0), FLOAT, "input 0")
        if self.opset < 7 and not self.attr("is_test", 0):
            raise self.error("is_test=0 (training mode before opset 7) draws random numbers, which luisaml does not do")
        if self.has_input(2):
            t = self.input(2)
            self.expect(
                t.value is not None and not np.asarray(t.value).reshape(-1)[0],
                f"input 2 (training_mode, '{t.name}') must be a constant false: training mode draws random "
                "numbers, which luisaml does not do",
            )

    inline = True
    elementwise = True

    def forward(self, ctx):
        emit_map(ctx, self.output(), [self.input(0)], lambda v: v)
        if len(self.outputs) > 1 and self.outputs[1] is not None:
            mask = self.outputs[1]
            emit_map(ctx, mask, [], lambda: literal(1, mask.dtype))

    def element(self, ctx, i, k=0):
        return self.input(0).load(i) if k == 0 else literal(1, self.outputs[1].dtype)


@register("CastLike", since=15)
class CastLike(Cast):
    """Cast to the type of input 1."""

    def check(self):
        Map.check(self)

    def typed_inputs(self) -> range:
        return range(1)


# ---- the second round: more math ------------------------------------------------
register_map("Tan", 7, lambda s, x: f"tan({x})")
register_map("Asin", 7, lambda s, x: f"asin({x})")
register_map("Acos", 7, lambda s, x: f"acos({x})")
register_map("Atan", 7, lambda s, x: f"atan({x})")
register_map("Sinh", 9, lambda s, x: f"sinh({x})")
register_map("Cosh", 9, lambda s, x: f"cosh({x})")
register_map("Asinh", 9, lambda s, x: f"asinh({x})")
# NaN below 1: the backends' acosh is log(x + sqrt(x^2 - 1)), and for x << -1 the sum rounds to a
# small positive number (acosh(-45.8) was -5.65)
register_map("Acosh", 9, lambda s, x: f"(acosh({x}) if {x} >= {s.lit(1)} else quiet_nan())")
register_map("Atanh", 9, lambda s, x: f"atanh({x})")
register_map("IsNaN", 9, lambda s, x: f"isnan({x})", result_bool=True)
register_map("BitwiseNot", 18, lambda s, x: f"(~{x})", ("int",), exact_in_half=True)


@register("Sign", since=9)
class Sign(Map):
    """-1, 0 or 1 in the input's type; NaN stays NaN (it fails both comparisons)."""

    kinds = NUM
    exact_in_half = True

    def expr(self, x):
        return f"({self.lit(1)} if {x} > {self.lit(0)} else ({self.lit(-1)} if {x} < {self.lit(0)} else {x}))"


@register("Round", since=11)
class Round(Map):
    """Round half to even (shaders/math_lib.py::round_even_f32; the DSL's round goes away from 0)."""

    def helpers(self):
        return [("round_even_f32", "math_lib")]

    def expr(self, x):
        return f"round_even_f32({x})"


@register("IsInf", since=10)
class IsInf(Map):
    """isinf, limited to one sign by detect_negative / detect_positive."""

    result_bool = True

    def expr(self, x):
        neg, pos = int(self.attr("detect_negative", 1)), int(self.attr("detect_positive", 1))
        if neg and pos:
            return f"isinf({x})"
        if not neg and not pos:
            return "False"
        return f"(isinf({x}) and {x} {'<' if neg else '>'} {self.lit(0)})"


class Bitwise(Map):
    """A bitwise op on integers (int32, int64 held as int32, uint32): sign extension commutes
    with and/or/xor/not, so int64 results are exact."""

    kinds = ("int",)
    exact_in_half = True
    sym = "&"

    def expr(self, a, b):
        return f"({a} {self.sym} {b})"


for _name, _sym in (("BitwiseAnd", "&"), ("BitwiseOr", "|"), ("BitwiseXor", "^")):
    register(_name, since=18)(type(_name, (Bitwise,), {"sym": _sym}))


@register("BitShift", since=11)
class BitShift(Map):
    """X << Y or X >> Y (direction). Unsigned (uint32) from opset 11; signed ints from opset 28:
    arithmetic right shifts; a shift below 0 or at least the width leaves only the sign fill.
    int64 is held in 32 bits: a left shift whose result leaves the int32 range wraps."""

    kinds = ("int",)
    exact_in_half = True

    def check(self):
        super().check()
        self.direction = self.attr("direction")
        self.expect(self.direction in ("LEFT", "RIGHT"), f"attribute direction must be LEFT or RIGHT, not {self.direction!r}")
        unsigned = self.dtype.dsl == "uint"
        self.fn = f"shift_{self.direction.lower()}_{'u32' if unsigned else 'i32'}"
        self.width = None if unsigned else 8 * self.typed()[0][1].dtype.numpy.itemsize

    def helpers(self):
        return [(self.fn, "math_lib")]

    def expr(self, a, b):
        return f"{self.fn}({a}, {b})" if self.width is None else f"{self.fn}({a}, {b}, {self.width})"


@register("BitCast", since=26)
class BitCast(Operator):
    """Reinterpret the bits as type `to` of the same width: float32, int32 and uint32 among
    themselves (the kernel holds int64 in 32 bits, so 64-bit types cannot keep their bits)."""

    WIDE32 = ("FLOAT", "INT32", "UINT32")

    def check(self):
        x, y = self.input(0), self.output()
        to = self.attr("to")
        self.expect(tuple(y.shape) == tuple(x.shape), f"output shape {list(y.shape)} is not the input's {list(x.shape)}")
        same = x.dtype.name == y.dtype.name
        self.expect(same or (x.dtype.name in self.WIDE32 and y.dtype.name in self.WIDE32),
                    f"BitCast from {x.dtype.name.lower()} to {dtypes.onnx_name(to).lower()}: only float32, int32 and "
                    "uint32 among themselves keep their bits in a kernel")

    inline = True
    elementwise = True

    def cast(self, ctx, v: str) -> str:
        x, y = self.input(0), self.output()
        if x.dtype.dsl == y.dtype.dsl:
            return v
        fn = ctx.use_helper({"int": "bits_to_int", "uint": "bits_to_uint", "float": "bits_to_float"}[y.dtype.dsl], "math_lib")
        return f"{fn}({v})"

    def forward(self, ctx):
        emit_map(ctx, self.output(), [self.input(0)], lambda v: self.cast(ctx, v), broadcast=False)

    def element(self, ctx, i, k=0):
        return self.cast(ctx, self.input(0).load(i))
