"""The recurrent operators RNN, GRU and LSTM (opsets 7, 14 and 22): forward, reverse and
bidirectional, layouts 0 ([seq, batch, ...]) and 1 ([batch, seq, ...], opset 14 on),
sequence_lens, initial states, LSTM peepholes and input_forget, GRU linear_before_reset, clip,
and the activations attribute with its alpha/beta values.

One batch row at a time, each direction walks the steps with its state in local arrays
(shaders/rnn.py.j2), in float for float and half. As onnxruntime does, a step past a row's
sequence length writes zeros to Y and leaves the state alone; reverse runs from the row's last
valid step. Per-sample execution (one thread per batch row) needs layout 1, where the batch is
axis 0 of X; in layout 0 it is axis 1, so such models compile with batch_axis=None."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.model import shape_str
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import Tensor, literal

from .common import convert, upcast

F32 = dtypes.FLOAT


def _f(v: float) -> str:
    return literal(v, F32)


# name -> (alpha?, beta?, f(x, alpha, beta) -> DSL). alpha? / beta?: False when the activation takes
# none, else its default: ONNX's operator's (LeakyRelu 0.01, ThresholdedRelu 1.0, HardSigmoid 0.2
# and 0.5, Elu 1.0, the old Affine 1.0 and 0.0), as the specification says; onnxruntime defaults
# ThresholdedRelu and Affine to 0 instead. The old ScaledTanh had no defaults: None, a value must
# be given. Relu and HardSigmoid use the max/min builtins, which turn NaN into a bound: onnxruntime's
# recurrent activations (std::max(0, x), ...) do the same, unlike its Relu and HardSigmoid operators.
ACTIVATIONS: dict[str, tuple] = {
    "relu": (False, False, lambda x, a, b: f"max({x}, 0.0)"),
    "tanh": (False, False, lambda x, a, b: f"tanh({x})"),
    "sigmoid": (False, False, lambda x, a, b: f"(1.0 / (1.0 + exp(-{x})))"),
    "affine": (1.0, 0.0, lambda x, a, b: f"({a} * {x} + {b})"),
    "leakyrelu": (0.01, False, lambda x, a, b: f"({x} if {x} >= 0.0 else {a} * {x})"),
    "thresholdedrelu": (1.0, False, lambda x, a, b: f"({x} if {x} > {a} else 0.0)"),
    "scaledtanh": (None, None, lambda x, a, b: f"({a} * tanh({b} * {x}))"),
    "hardsigmoid": (0.2, 0.5, lambda x, a, b: f"min(max({a} * {x} + {b}, 0.0), 1.0)"),
    "elu": (1.0, False, lambda x, a, b: f"({x} if {x} >= 0.0 else {a} * (exp({x}) - 1.0))"),
    "softsign": (False, False, lambda x, a, b: f"({x} / (1.0 + abs({x})))"),
    # log(1 + e^x) without overflow or underflow (shaders/dsl_lib.py, as the Softplus operator)
    "softplus": (False, False, lambda x, a, b: f"softplus({x})"),
}


def _apply(fn, alpha: str, beta: str, x: str) -> str:
    """Return the DSL of activation fn at x."""
    return fn(x, alpha, beta)


@dataclass
class Direction:
    """What the template needs of one direction: loads, stores, state names, activations."""

    reverse: bool
    h: str
    c: str
    act: list
    w: Callable
    r: Callable
    wb: Callable | None
    rb: Callable | None
    p: Callable | None
    h0: Callable | None
    c0: Callable | None
    y: Callable | None
    yh: Callable | None
    yc: Callable | None


class Recurrent(Operator):
    """Shared by RNN, GRU and LSTM; subclasses set the cell, its gates and default activations."""

    cell = ""
    gates = 1
    default_activations: tuple[str, ...] = ()
    state_outputs = 2  # Y, Y_h (LSTM: and Y_c)

    # input indices: X, W, R, B, sequence_lens, initial_h (, initial_c, P for LSTM)
    def check(self) -> None:
        x, w, r = self.input(0), self.input(1), self.input(2)
        self.expect_dtype(x, ("float",), "input X")
        for k, role in ((1, "W"), (2, "R"), (3, "B"), (5, "initial_h"), (6, "initial_c"), (7, "P")):
            if k < self.n_inputs() and self.has_input(k):
                t = self.input(k)
                self.expect(t.dtype == x.dtype, f"{role} '{t.name}' has type {t.dtype.name.lower()}, X '{x.name}' {x.dtype.name.lower()}; they must match")
        self.layout = int(self.attr("layout", 0))
        self.expect(self.layout in (0, 1), f"layout {self.layout} is not 0 or 1")
        self.expect(self.opset >= 14 or self.layout == 0, "layout needs opset 14")
        self.direction = self.attr("direction", "forward")
        if isinstance(self.direction, bytes):
            self.direction = self.direction.decode()
        self.expect(self.direction in ("forward", "reverse", "bidirectional"), f"direction '{self.direction}' is not forward, reverse or bidirectional")
        self.D = 2 if self.direction == "bidirectional" else 1
        self.expect(x.rank == 3, f"X '{x.name}' must be 3-D, got {shape_str(x.shape)}")
        if self.layout == 0:
            self.S, self.B, self.I = x.shape
            self.expect(
                not x.batched,
                f"X '{x.name}': with layout 0 its axis 0 is the sequence, not the batch; per-sample execution "
                "would split the sequence (compile with batch_axis=None, or export with layout=1)",
            )
        else:
            self.B, self.S, self.I = x.shape
        self.H = int(self.attr("hidden_size", r.shape[-1] if r.rank == 3 else 0))
        G, H, D = self.gates, self.H, self.D
        self.expect_shape(w, (D, G * H, self.I), "W")
        self.expect_shape(r, (D, G * H, H), "R")
        if self.has_input(3):
            self.expect_shape(self.input(3), (D, 2 * G * H), "B")
        if self.has_input(4):
            n = self.input(4)
            self.expect(n.dtype.name in ("INT32", "INT64"), f"sequence_lens '{n.name}' has type {n.dtype.name.lower()}, expected int32")
            self.expect_shape(n, (self.B,), "sequence_lens")
        state = (D, self.B, H) if self.layout == 0 else (self.B, D, H)
        for k, role in ((5, "initial_h"), (6, "initial_c")):
            if k < self.n_inputs() and self.has_input(k):
                t = self.input(k)
                self.expect_shape(t, state, role)
                self.expect(self.layout == 1 or not t.batched, f"{role} '{t.name}': with layout 0 its axis 0 is the direction; compile with batch_axis=None")
        if self.cell == "lstm" and self.has_input(7):
            self.expect_shape(self.input(7), (D, 3 * H), "P")
        self.clip = self.attr("clip", None)
        self.expect(self.clip is None or float(self.clip) > 0, f"clip {self.clip} must be positive")
        self._check_outputs(state)
        self.acts = self._activations()

    def n_inputs(self) -> int:
        return 8 if self.cell == "lstm" else 6

    def _check_outputs(self, state) -> None:
        y_shape = (self.S, self.D, self.B, self.H) if self.layout == 0 else (self.B, self.S, self.D, self.H)
        for k, want in ((0, y_shape), (1, state), (2, state)):
            t = self.outputs[k] if k < len(self.outputs) else None
            if t is not None:
                self.expect_shape(t, want, ("output Y", "output Y_h", "output Y_c")[k])

    def _activations(self) -> list[list[Callable[[str], str]]]:
        """Return, per direction, the activation functions (f, g, h order) as DSL builders."""
        per_dir = len(self.default_activations)
        names = self.attr("activations", None)
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in names] if names else list(self.default_activations) * self.D
        self.expect(
            len(names) == per_dir * self.D,
            f"activations {names}: expected {per_dir * self.D} ({per_dir} per direction, {self.D} direction(s))",
        )
        alphas = list(self.attr("activation_alpha", []) or [])
        betas = list(self.attr("activation_beta", []) or [])
        out = []
        for name in names:
            key = name.lower()
            self.expect(key in ACTIVATIONS, f"activation '{name}' is not one of {', '.join(sorted(ACTIVATIONS))}")
            da, db, fn = ACTIVATIONS[key]
            # the values are consumed in order by the activations that take them
            a = alphas.pop(0) if da is not False and alphas else da
            b = betas.pop(0) if db is not False and betas else db
            self.expect(
                a is not None and b is not None,
                f"activation '{name}' needs values in activation_alpha and activation_beta (it has no default)",
            )
            act = partial(_apply, fn, _f(a or 0.0), _f(b or 0.0))
            act.name = key  # (what the stage forms ask: by name, not by the lambda's identity)
            out.append(act)
        return [out[d * per_dir:(d + 1) * per_dir] for d in range(self.D)]

    # ---- code ------------------------------------------------------------------------------
    def y_strides(self) -> tuple[int, int, int, int]:
        """Return the strides of Y's (step, direction, batch row, unit) in Y's own layout."""
        S, B, H, D = self.S, self.B, self.H, self.D
        return (D * B * H, B * H, H, 1) if self.layout == 0 else (D * H, H, S * D * H, 1)

    def forward(self, ctx, y_to: tuple[Tensor, tuple[int, int, int, int]] | None = None) -> None:
        """y_to: (tensor, strides of step, direction, batch row, unit) where Y's elements go instead
        of Y (luisaml/rewrites/rnn.py: the layout nodes after it folded into its stores)."""
        x = self.input(0)
        S, B, I, H, D, G = self.S, self.B, self.I, self.H, self.D, self.gates
        if any(fn.name == "softplus" for acts in self.acts for fn in acts):
            ctx.use_helper("softplus")
        b = ctx.fresh("b") if B > 1 else "0"
        outer = [(b, B)] if B > 1 else []

        def xload(t, k):
            i = ix.add(ix.mul(t, B * I), ix.mul(b, I), k) if self.layout == 0 else ix.add(ix.mul(b, S * I), ix.mul(t, I), k)
            return upcast(x.load(i), x.dtype)

        def opt(k: int) -> Tensor | None:
            if k >= len(self.inputs) or k >= self.n_inputs():
                return None
            return self.inputs[k]

        def out(k: int) -> Tensor | None:
            return self.outputs[k] if k < len(self.outputs) else None

        def load(t: Tensor, base: int):
            return lambda *coords: upcast(t.load(ix.add(str(base), *(ix.mul(c, s) for c, s in zip(coords, t.strides[1:])))), t.dtype)

        def state_index(d: int, u: str) -> str:
            return ix.add(ix.mul(str(d), B * H), ix.mul(b, H), u) if self.layout == 0 else ix.add(ix.mul(b, D * H), ix.mul(str(d), H), u)

        def state_store(t: Tensor | None, d: int):
            return None if t is None else (lambda u, v: t.store(state_index(d, u), convert(v, F32, t.dtype)))

        def state_load(t: Tensor | None, d: int):
            return None if t is None else (lambda u: upcast(t.load(state_index(d, u)), t.dtype))

        def y_store(y: Tensor | None, d: int):
            if y is None:
                return None
            y, (st, sd, sb, su) = y_to or (y, self.y_strides())
            return lambda t, u, v: y.store(ix.add(ix.mul(t, st), str(d * sd), ix.mul(b, sb), ix.mul(u, su)), convert(v, F32, y.dtype))

        w, r, bias, p = self.input(1), self.input(2), opt(3), opt(7) if self.cell == "lstm" else None
        dirs = []
        for d in range(D):
            reverse = self.direction == "reverse" or d == 1
            dirs.append(Direction(
                reverse=reverse,
                h=ctx.fresh("h"),
                c=ctx.fresh("c"),
                act=self.acts[d],
                w=load(w, d * G * H * I),
                r=load(r, d * G * H * H),
                wb=(lambda row, base=d * 2 * G * H: upcast(bias.load(ix.add(str(base), row)), bias.dtype)) if bias is not None else None,
                rb=(lambda row, base=d * 2 * G * H + G * H: upcast(bias.load(ix.add(str(base), row)), bias.dtype)) if bias is not None else None,
                p=(lambda row, base=d * 3 * H: upcast(p.load(ix.add(str(base), row)), p.dtype)) if p is not None else None,
                h0=state_load(opt(5), d),
                c0=state_load(opt(6), d),
                y=y_store(out(0), d),
                yh=state_store(out(1), d),
                yc=state_store(out(2), d) if self.cell == "lstm" else None,
            ))
        seq = opt(4)
        ctx.render(
            "rnn.py.j2",
            cell=self.cell,
            outer=outer,
            dirs=dirs,
            S=S, I=I, H=H,
            x=xload,
            seq_len=f"min({seq.load(b)}, {S})" if seq is not None else None,
            gates=ctx.fresh("gates"),
            gates_type=ctx.module.array_type("float", G * H),
            hnew=ctx.fresh("hr") if self.cell == "gru" and self.linear_before_reset else None,
            h_type=ctx.module.array_type("float", H),
            clip=_f(float(self.clip)) if self.clip is not None else None,
            # onnxruntime's clip keeps NaN (std::min(std::max(x, -c), c)); the clamp builtin drops it
            clamp=ctx.use_helper("clamp_nan") if self.clip is not None else None,
            clip_neg=_f(-float(self.clip)) if self.clip is not None else None,
            linear_before_reset=getattr(self, "linear_before_reset", False),
            input_forget=getattr(self, "input_forget", False),
        )

    def describe(self) -> str:
        note = getattr(self, "whole_note", None)  # (operators/rnn_stages.py: why it is not stages)
        return (f"{self.direction}, seq={self.S} batch={self.B} input={self.I} hidden={self.H}, layout {self.layout}"
                + (f"; the whole form (a thread walks the sequence): {note}" if note else ""))


class RNN(Recurrent):
    """Ht = f(Xt W^T + Ht-1 R^T + Wb + Rb); default f = Tanh."""

    cell = "rnn"
    gates = 1
    default_activations = ("Tanh",)


class GRU(Recurrent):
    """Gates z, r, h (rows of W/R in that order); default f = Sigmoid, g = Tanh."""

    cell = "gru"
    gates = 3
    default_activations = ("Sigmoid", "Tanh")

    def check(self) -> None:
        super().check()
        self.linear_before_reset = bool(self.attr("linear_before_reset", 0))


class LSTM(Recurrent):
    """Gates i, o, f, c (rows of W/R in that order), peepholes P[i, o, f]; default f = Sigmoid,
    g = Tanh, h = Tanh."""

    cell = "lstm"
    gates = 4
    default_activations = ("Sigmoid", "Tanh", "Tanh")

    def check(self) -> None:
        super().check()
        self.input_forget = bool(self.attr("input_forget", 0))


for _cls in (RNN, GRU, LSTM):
    for _since in (7, 14, 22):
        register(_cls.__name__, since=_since)(type(_cls.__name__, (_cls,), {}))
