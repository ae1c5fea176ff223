"""What the fuzz's random graphs are made of: the Builder that grows one graph, and one generator
per op family (unary and binary elementwise, comparisons, casts, reductions, shape ops, MatMul and
Gemm, normalisations, Conv and pooling, Split, Trilu, TopK), each keeping the batch axis first.

A generator picks operands from the graph's tensors (the newest likelier), adds constants with
random shapes that broadcast, and returns its output tensor, or None when it does not apply. To
fuzz another op, add a generator and give it a weight in GENERATORS.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

F32, I32, I64, BOOL = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_)
ONNX_OF = {F32: TensorProto.FLOAT, I32: TensorProto.INT32, I64: TensorProto.INT64, BOOL: TensorProto.BOOL,
           np.dtype(np.float16): TensorProto.FLOAT16}
INTS = (I32, I64)


@dataclass
class T:
    """A tensor of the graph being built: its per-sample shape (the batch dimension N is implied)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)


class Builder:
    """Grows one random graph; every method that adds a node returns its output tensor or None
    when it does not apply to the tensors at hand."""

    def __init__(self, rng: np.random.Generator, prefix: str):
        self.rng, self.prefix = rng, prefix
        self.g_nodes: list = []
        self.inits: dict[str, np.ndarray] = {}
        self.inputs: list[T] = []
        self.pool: list[T] = []
        self.count = 0

    # ---- names and constants -----------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{self.prefix}{stem}{self.count}"

    def const(self, value, stem: str = "c") -> str:
        name = self.fresh(stem)
        self.inits[name] = np.asarray(value)
        return name

    def node(self, op: str, ins: list[str], dtype, shape, n_out: int = 1, **attrs):
        outs = [self.fresh(op.lower()[:6]) for _ in range(n_out)]
        self.g_nodes.append(helper.make_node(op, ins, outs, name=self.fresh(f"{op}_"), **attrs))
        ts = [T(o, np.dtype(dtype), tuple(shape)) for o in outs]
        self.pool.extend(ts)
        return ts[0] if n_out == 1 else ts

    # ---- random choices -------------------------------------------------------------------------
    def choice(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def pick(self, dtypes=(F32,), min_rank: int = 0, max_rank: int = 9) -> T | None:
        cands = [t for t in self.pool if t.dtype in dtypes and min_rank <= t.rank <= max_rank]
        # the newest tensors are likelier: graphs become chains more often than fans
        if not cands:
            return None
        w = np.arange(1, len(cands) + 1, dtype=float)
        return cands[int(self.rng.choice(len(cands), p=w / w.sum()))]

    def shape(self, rank: int | None = None) -> tuple[int, ...]:
        rank = int(self.rng.integers(1, 4)) if rank is None else rank
        return tuple(int(d) for d in self.rng.integers(1, 6, rank))

    def uniform(self, shape, lo=-2.0, hi=2.0) -> np.ndarray:
        return self.rng.uniform(lo, hi, shape).astype(np.float32)

    def add_input(self, dtype, shape) -> T:
        t = T(self.fresh("in"), np.dtype(dtype), tuple(shape))
        self.inputs.append(t)
        self.pool.append(t)
        return t

    def axis(self, t: T) -> int:
        """A non-batch axis of t's full tensor, sometimes written negative."""
        a = int(self.rng.integers(1, t.rank + 1))
        return a - (t.rank + 1) if self.rng.random() < 0.3 else a

    def broadcast_partner(self, t: T) -> tuple[str, tuple[int, ...]]:
        """Return (name, full result shape without N) of a tensor that broadcasts with t: another
        per-sample tensor of t's rank, or a constant over its trailing dimensions."""
        same = [u for u in self.pool if u.dtype == t.dtype and u.rank == t.rank and u is not t
                and all(a == b or a == 1 or b == 1 for a, b in zip(u.shape, t.shape))]
        if same and self.rng.random() < 0.5:
            u = self.choice(same)
            return u.name, tuple(max(a, b) for a, b in zip(u.shape, t.shape))
        k = int(self.rng.integers(0, t.rank + 1))
        tail = t.shape[t.rank - k:]
        cshape = tuple(1 if self.rng.random() < 0.3 else d for d in tail)
        if self.rng.random() < 0.2 and t.rank:  # a constant that widens a size-1 dimension of t
            cshape = tuple(int(self.rng.integers(2, 4)) if d == 1 and t.shape[t.rank - k + i] == 1 else d
                           for i, d in enumerate(cshape))
        value = self.values(t.dtype, cshape)
        out = list(t.shape)
        for i, d in enumerate(cshape):
            j = t.rank - k + i
            out[j] = max(out[j], d)
        return self.const(value), tuple(out)

    def values(self, dtype, shape) -> np.ndarray:
        if dtype == F32:
            v = self.uniform(shape)
            if self.rng.random() < 0.1 and v.size:
                v.reshape(-1)[0] = self.choice([np.nan, np.inf, -np.inf])
            return v
        if dtype == BOOL:
            return self.rng.random(shape) > 0.5
        return self.rng.integers(-5, 6, shape).astype(dtype)


# ---- op generators ------------------------------------------------------------------------------

def _f(lo, hi):
    return lambda b: float(np.float32(b.rng.uniform(lo, hi)))


UNARY = {
    "Abs": {}, "Neg": {}, "Exp": {}, "Log": {}, "Sqrt": {}, "Sin": {}, "Cos": {}, "Tan": {}, "Tanh": {}, "Sigmoid": {},
    "Relu": {}, "Elu": {"alpha": _f(0.1, 2)}, "Selu": {"alpha": _f(1, 2), "gamma": _f(1, 1.5)},
    "LeakyRelu": {"alpha": _f(0.01, 0.5)}, "HardSigmoid": {"alpha": _f(0.1, 0.5), "beta": _f(0.2, 0.8)},
    "HardSwish": {}, "Softplus": {}, "Softsign": {}, "Erf": {}, "Ceil": {}, "Floor": {}, "Round": {},
    "Reciprocal": {}, "Sign": {}, "Atan": {}, "Asin": {}, "Acos": {}, "Sinh": {}, "Cosh": {}, "Asinh": {},
    "Acosh": {}, "Atanh": {}, "Mish": {}, "Celu": {"alpha": _f(0.5, 2)}, "ThresholdedRelu": {"alpha": _f(0, 1)},
    "Shrink": {"bias": _f(0, 1), "lambd": _f(0, 1)}, "Gelu": {"approximate": lambda b: b.choice(["none", "tanh"])},
    "Identity": {},
}
BINARY = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mean", "Sum")
COMPARE = ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")
REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceSumSquare", "ReduceLogSumExp", "ReduceLogSum")


def g_unary(b: Builder):
    t = b.pick((F32,))
    if t is None:
        return None
    op = b.choice(list(UNARY))
    attrs = {k: f(b) for k, f in UNARY[op].items()}
    return b.node(op, [t.name], F32, t.shape, **attrs)


def g_isnan(b: Builder):
    t = b.pick((F32,))
    if t is None:
        return None
    if b.rng.random() < 0.5:
        return b.node("IsNaN", [t.name], BOOL, t.shape)
    return b.node("IsInf", [t.name], BOOL, t.shape, detect_negative=int(b.rng.integers(2)),
                  detect_positive=int(b.rng.integers(2)))


def g_binary(b: Builder):
    t = b.pick((F32,) if b.rng.random() < 0.8 else INTS)
    if t is None:
        return None
    ops = BINARY if t.dtype == F32 else ("Add", "Sub", "Mul", "Max", "Min", "Sum")
    op = b.choice(ops)
    other, shape = b.broadcast_partner(t)
    ins = [t.name, other] if b.rng.random() < 0.7 else [other, t.name]
    if op in ("Sum", "Max", "Min", "Mean") and b.rng.random() < 0.3:
        ins.append(t.name)
    return b.node(op, ins, t.dtype, shape)


def g_int_divmod(b: Builder):
    """Integer Div and Mod by a positive constant: a division by zero is undefined, and so is the
    most negative value by -1 (a Cast of NaN makes one; onnxruntime died of SIGFPE on it)."""
    t = b.pick(INTS)
    if t is None:
        return None
    k = t.shape[-1:] if t.rank and b.rng.random() < 0.5 else ()
    d = b.rng.integers(1, 5, k)
    c = b.const(np.asarray(d, t.dtype))
    if b.rng.random() < 0.5:
        return b.node("Div", [t.name, c], t.dtype, t.shape)
    return b.node("Mod", [t.name, c], t.dtype, t.shape, fmod=0)


def g_fmod(b: Builder):
    t = b.pick((F32,))
    if t is None:
        return None
    c = b.const(np.asarray(b.rng.uniform(0.5, 3) * b.choice([1, -1]), np.float32))
    return b.node("Mod", [t.name, c], F32, t.shape, fmod=1)


def g_bitwise(b: Builder):
    t = b.pick(INTS)
    if t is None:
        return None
    if b.rng.random() < 0.25:
        return b.node("BitwiseNot", [t.name], t.dtype, t.shape)
    other, shape = b.broadcast_partner(t)
    return b.node(b.choice(["BitwiseAnd", "BitwiseOr", "BitwiseXor"]), [t.name, other], t.dtype, shape)


def g_prelu(b: Builder):
    t = b.pick((F32,), min_rank=1)
    if t is None:
        return None
    k = int(b.rng.integers(1, t.rank + 1))
    slope = b.const(b.uniform(t.shape[t.rank - k:], -0.5, 0.5))
    return b.node("PRelu", [t.name, slope], F32, t.shape)


def g_compare(b: Builder):
    t = b.pick((F32,) + INTS)
    if t is None:
        return None
    other, shape = b.broadcast_partner(t)
    return b.node(b.choice(COMPARE), [t.name, other], BOOL, shape)


def g_logic(b: Builder):
    t = b.pick((BOOL,))
    if t is None:
        return None
    if b.rng.random() < 0.3:
        return b.node("Not", [t.name], BOOL, t.shape)
    other, shape = b.broadcast_partner(t)
    return b.node(b.choice(["And", "Or", "Xor"]), [t.name, other], BOOL, shape)


def g_where(b: Builder):
    c = b.pick((BOOL,))
    if c is None:
        return None
    same = [u for u in b.pool if u.dtype != BOOL and u.shape == c.shape]
    if not same:
        return None
    x = b.choice(same)
    y, shape = b.broadcast_partner(x)
    return b.node("Where", [c.name, x.name, y], x.dtype, shape)


def g_cast(b: Builder):
    t = b.pick((F32, BOOL) + INTS)
    if t is None:
        return None
    to = b.choice([d for d in (F32, I32, I64, BOOL, np.dtype(np.float16)) if d != t.dtype])
    if to == np.dtype(np.float16):  # through half and back: luisaml holds half, ORT too
        h = b.node("Cast", [t.name], to, t.shape, to=ONNX_OF[to])
        b.pool.remove(h)
        return b.node("Cast", [h.name], F32, t.shape, to=TensorProto.FLOAT)
    return b.node("Cast", [t.name], to, t.shape, to=ONNX_OF[to])


def g_clip(b: Builder):
    t = b.pick((F32,) + INTS)
    if t is None:
        return None
    lo, hi = sorted(b.rng.uniform(-2, 2, 2))
    mk = (lambda v: np.asarray(v, np.float32)) if t.dtype == F32 else (lambda v: np.asarray(round(v), t.dtype))
    ins = [t.name, b.const(mk(lo)) if b.rng.random() < 0.8 else "", b.const(mk(hi)) if b.rng.random() < 0.8 else ""]
    while ins[-1] == "":
        ins.pop()
    return b.node("Clip", ins, t.dtype, t.shape)


def g_reduce(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=1)
    if t is None:
        return None
    op = b.choice(REDUCE if t.dtype == F32 else ("ReduceSum", "ReduceMax", "ReduceMin"))
    axes = sorted({b.axis(t) % (t.rank + 1) for _ in range(int(b.rng.integers(1, t.rank + 1)))})
    keep = int(b.rng.integers(2))
    shape = tuple(1 if i + 1 in axes else d for i, d in enumerate(t.shape) if keep or i + 1 not in axes)
    ax = [a - (t.rank + 1) if b.rng.random() < 0.3 else a for a in axes]
    return b.node(op, [t.name, b.const(np.array(ax, np.int64))], t.dtype, shape, keepdims=keep)


def g_argmax(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=1)
    if t is None:
        return None
    a = b.axis(t)
    keep = int(b.rng.integers(2))
    i = a % (t.rank + 1) - 1
    shape = tuple(1 if j == i else d for j, d in enumerate(t.shape) if keep or j != i)
    return b.node(b.choice(["ArgMax", "ArgMin"]), [t.name], I64, shape, axis=a, keepdims=keep,
                  select_last_index=int(b.rng.integers(2)))


def g_softmax(b: Builder):
    t = b.pick((F32,), min_rank=1)
    if t is None:
        return None
    return b.node(b.choice(["Softmax", "LogSoftmax", "Hardmax"]), [t.name], F32, t.shape, axis=b.axis(t))


def g_cumsum(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=1)
    if t is None:
        return None
    return b.node("CumSum", [t.name, b.const(np.array(b.axis(t), np.int64))], t.dtype, t.shape,
                  exclusive=int(b.rng.integers(2)), reverse=int(b.rng.integers(2)))


def g_transpose(b: Builder):
    t = b.pick((F32, BOOL) + INTS, min_rank=2)
    if t is None:
        return None
    perm = [int(p) for p in b.rng.permutation(t.rank)]
    return b.node("Transpose", [t.name], t.dtype, tuple(t.shape[p] for p in perm), perm=[0] + [p + 1 for p in perm])


def g_reshape(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=1)
    if t is None:
        return None
    n = int(np.prod(t.shape))
    dims = []
    rest = n
    for _ in range(int(b.rng.integers(0, 3))):
        divs = [d for d in range(1, rest + 1) if rest % d == 0]
        d = b.choice(divs)
        dims.append(d)
        rest //= d
    dims.append(rest)
    # 0 copies the batch dimension; -1 is not used (it cannot be inferred at batch size 0)
    shape = [0] + [int(d) for d in b.rng.permutation(dims)]
    out = tuple(shape[1:])
    return b.node("Reshape", [t.name, b.const(np.array(shape, np.int64))], t.dtype, out)


def g_flatten(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=2)
    if t is None:
        return None
    return b.node("Flatten", [t.name], t.dtype, (int(np.prod(t.shape)),), axis=1)


def g_unsqueeze(b: Builder):
    t = b.pick((F32, BOOL) + INTS, max_rank=3)
    if t is None:
        return None
    a = int(b.rng.integers(1, t.rank + 2))
    shape = list(t.shape)
    shape.insert(a - 1, 1)
    return b.node("Unsqueeze", [t.name, b.const(np.array([a], np.int64))], t.dtype, tuple(shape))


def g_squeeze(b: Builder):
    cands = [t for t in b.pool if 1 in t.shape]
    if not cands:
        return None
    t = b.choice(cands)
    axes = [i + 1 for i, d in enumerate(t.shape) if d == 1]
    axes = [int(a) for a in b.rng.choice(axes, int(b.rng.integers(1, len(axes) + 1)), replace=False)]
    shape = tuple(d for i, d in enumerate(t.shape) if i + 1 not in axes)
    return b.node("Squeeze", [t.name, b.const(np.array(sorted(axes), np.int64))], t.dtype, shape)


def g_concat(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=1)
    if t is None:
        return None
    a = b.axis(t)
    i = a % (t.rank + 1) - 1
    same = [u for u in b.pool if u.dtype == t.dtype and u.rank == t.rank
            and all(x == y for j, (x, y) in enumerate(zip(u.shape, t.shape)) if j != i)]
    parts = [t] + [b.choice(same) for _ in range(int(b.rng.integers(1, 3)))]
    shape = list(t.shape)
    shape[i] = sum(p.shape[i] for p in parts)
    return b.node("Concat", [p.name for p in parts], t.dtype, tuple(shape), axis=a)


def g_slice(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=1)
    if t is None:
        return None
    a = b.axis(t)
    i = a % (t.rank + 1) - 1
    d = t.shape[i]
    step = int(b.choice([1, 1, 2, -1, -2]))
    idx = np.arange(d)
    start, end = (int(v) for v in b.rng.integers(-d - 1, d + 2, 2))
    n = len(idx[slice(start, end, step)])
    if n == 0:
        start, end, step = 0, d, 1
        n = d
    shape = list(t.shape)
    shape[i] = n
    ins = [t.name, b.const(np.array([start], np.int64)), b.const(np.array([end], np.int64)),
           b.const(np.array([a], np.int64)), b.const(np.array([step], np.int64))]
    return b.node("Slice", ins, t.dtype, tuple(shape))


def g_gather(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=1)
    if t is None:
        return None
    a = b.axis(t)
    i = a % (t.rank + 1) - 1
    d = t.shape[i]
    ishape = b.shape(int(b.rng.integers(0, 3)))
    idx = b.rng.integers(-d, d, ishape).astype(np.int64)
    shape = t.shape[:i] + tuple(ishape) + t.shape[i + 1:]
    return b.node("Gather", [t.name, b.const(idx)], t.dtype, shape, axis=a)


def g_tile(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=1, max_rank=3)
    if t is None:
        return None
    reps = [int(r) for r in b.rng.integers(1, 3, t.rank)]
    return b.node("Tile", [t.name, b.const(np.array([1] + reps, np.int64))], t.dtype,
                  tuple(d * r for d, r in zip(t.shape, reps)))


def g_expand(b: Builder):
    t = b.pick((F32,) + INTS)
    if t is None or 1 not in t.shape:
        return None
    target = tuple(int(b.rng.integers(2, 4)) if d == 1 else d for d in t.shape)
    return b.node("Expand", [t.name, b.const(np.array((1,) + target, np.int64))], t.dtype, target)


def g_pad(b: Builder):
    t = b.pick((F32,), min_rank=1)
    if t is None:
        return None
    mode = b.choice(["constant", "reflect", "edge"])
    pads = [[0, 0]]
    for d in t.shape:
        hi = d - 1 if mode == "reflect" else 2
        pads.append([int(b.rng.integers(0, hi + 1)), int(b.rng.integers(0, hi + 1))])
    p = np.array(pads, np.int64).T.reshape(-1)
    shape = tuple(d + lo + hi for d, (lo, hi) in zip(t.shape, pads[1:]))
    ins = [t.name, b.const(p)]
    if mode == "constant" and b.rng.random() < 0.5:
        ins.append(b.const(np.asarray(b.rng.uniform(-1, 1), np.float32)))
    return b.node("Pad", ins, F32, shape, mode=mode)


def g_matmul(b: Builder):
    t = b.pick((F32,), min_rank=1)
    if t is None:
        return None
    n = int(b.rng.integers(1, 6))
    w = b.const(b.uniform((t.shape[-1], n), -1, 1))
    return b.node("MatMul", [t.name, w], F32, t.shape[:-1] + (n,))


def g_gemm(b: Builder):
    t = b.pick((F32,), min_rank=1, max_rank=1)
    if t is None:
        return None
    k, n = t.shape[0], int(b.rng.integers(1, 6))
    trans_b = int(b.rng.integers(2))
    w = b.const(b.uniform((n, k) if trans_b else (k, n), -1, 1))
    ins = [t.name, w] + ([b.const(b.uniform((n,) if b.rng.random() < 0.7 else (1,)))] if b.rng.random() < 0.7 else [])
    return b.node("Gemm", ins, F32, (n,), transB=trans_b, alpha=float(np.float32(b.rng.uniform(0.5, 2))),
                  beta=float(np.float32(b.rng.uniform(0.5, 2))))


def g_layernorm(b: Builder):
    t = b.pick((F32,), min_rank=1)
    if t is None:
        return None
    d = t.shape[-1]
    return b.node("LayerNormalization", [t.name, b.const(b.uniform(d)), b.const(b.uniform(d))], F32, t.shape,
                  axis=-1, epsilon=1e-5)


def g_batchnorm(b: Builder):
    t = b.pick((F32,), min_rank=2, max_rank=3)
    if t is None:
        return None
    c = t.shape[0]
    ins = [t.name, b.const(b.uniform(c)), b.const(b.uniform(c)), b.const(b.uniform(c)), b.const(b.uniform(c, 0.5, 2))]
    return b.node("BatchNormalization", ins, F32, t.shape, epsilon=1e-5)


def g_conv(b: Builder):
    t = b.pick((F32,), min_rank=2, max_rank=3)
    if t is None:
        return None
    c, spatial = t.shape[0], t.shape[1:]
    m = int(b.rng.integers(1, 4))
    ks = [int(b.rng.integers(1, min(3, s) + 1)) for s in spatial]
    pads = [int(b.rng.integers(0, k)) for k in ks] * 2
    strides = [int(b.rng.integers(1, 3)) for _ in spatial]
    out = tuple((s + pads[i] + pads[i + len(spatial)] - ks[i]) // strides[i] + 1 for i, s in enumerate(spatial))
    if min(out) < 1:
        return None
    w = b.const(b.uniform((m, c, *ks), -1, 1))
    ins = [t.name, w] + ([b.const(b.uniform(m))] if b.rng.random() < 0.6 else [])
    return b.node("Conv", ins, F32, (m,) + out, kernel_shape=ks, pads=pads, strides=strides)


def g_pool(b: Builder):
    t = b.pick((F32,), min_rank=2, max_rank=3)
    if t is None:
        return None
    spatial = t.shape[1:]
    op = b.choice(["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"])
    if op.startswith("Global"):
        return b.node(op, [t.name], F32, (t.shape[0],) + (1,) * len(spatial))
    ks = [int(b.rng.integers(1, min(3, s) + 1)) for s in spatial]
    pads = [int(b.rng.integers(0, k)) for k in ks] * 2
    out = tuple(s + pads[i] + pads[i + len(spatial)] - ks[i] + 1 for i, s in enumerate(spatial))
    attrs = {"kernel_shape": ks, "pads": pads}
    if op == "AveragePool":
        attrs["count_include_pad"] = int(b.rng.integers(2))
    return b.node(op, [t.name], F32, (t.shape[0],) + out, **attrs)


def g_split(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=1)
    if t is None:
        return None
    a = b.axis(t)
    i = a % (t.rank + 1) - 1
    d = t.shape[i]
    if d < 2:
        return None
    cut = int(b.rng.integers(1, d))
    sizes = [cut, d - cut]
    outs = b.node("Split", [t.name, b.const(np.array(sizes, np.int64))], t.dtype, t.shape, n_out=2, axis=a)
    for o, s in zip(outs, sizes):
        o.shape = t.shape[:i] + (s,) + t.shape[i + 1:]
    return outs[int(b.rng.integers(2))]


def g_trilu(b: Builder):
    t = b.pick((F32,) + INTS, min_rank=2)
    if t is None:
        return None
    ins = [t.name] + ([b.const(np.array(int(b.rng.integers(-2, 3)), np.int64))] if b.rng.random() < 0.5 else [])
    return b.node("Trilu", ins, t.dtype, t.shape, upper=int(b.rng.integers(2)))


def g_topk(b: Builder):
    t = b.pick((F32,), min_rank=1)
    if t is None:
        return None
    a = b.axis(t)
    i = a % (t.rank + 1) - 1
    k = int(b.rng.integers(1, t.shape[i] + 1))
    vals, idx = b.node("TopK", [t.name, b.const(np.array([k], np.int64))], F32, t.shape, n_out=2, axis=a,
                       largest=int(b.rng.integers(2)), sorted=1)
    shape = t.shape[:i] + (k,) + t.shape[i + 1:]
    vals.shape, idx.shape, idx.dtype = shape, shape, I64
    return vals


GENERATORS = {
    g_unary: 10, g_binary: 10, g_isnan: 1, g_int_divmod: 1, g_fmod: 1, g_bitwise: 1, g_prelu: 1, g_compare: 2,
    g_logic: 1, g_where: 2, g_cast: 2, g_clip: 2, g_reduce: 4, g_argmax: 1, g_softmax: 2, g_cumsum: 1,
    g_transpose: 2, g_reshape: 2, g_flatten: 1, g_unsqueeze: 1, g_squeeze: 1, g_concat: 2, g_slice: 2, g_gather: 2,
    g_tile: 1, g_expand: 1, g_pad: 1, g_matmul: 2, g_gemm: 1, g_layernorm: 1, g_batchnorm: 1, g_conv: 1,
    g_pool: 1, g_split: 1, g_trilu: 1, g_topk: 1,
}
