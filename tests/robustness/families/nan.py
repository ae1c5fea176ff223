"""NaN and infinity: every supported op that can meet them must propagate them as onnxruntime does.

A max() or a comparison written the obvious way drops NaN (Relu, Max, Min, HardSigmoid, Clip and
ReduceMax did, per the outside probe). Each case is one op over rows that hold NaN first, last,
in the middle, nowhere (but infinities), and everywhere, with -0.0 and ordinary values, compared
with onnxruntime and with onnx.reference under one rule: where either has NaN, luisaml must have
NaN; elsewhere it must equal one of them. (onnxruntime's MaxPool and ReduceMax skip a NaN in some
positions; NaN propagation, as in the ONNX reference and IEEE max, is what the issue asks for.)
The ops are valid and supported: an error is a failure.
"""
from __future__ import annotations

import numpy as np
from onnx import helper

from .. import actions
from ..harness import FAIL_HARNESS, FAIL_WRONG, Case, Fail, attempt, judge, recipe
from ..models import F, make_model, ort_outputs, save, vi
from .common import ORT, Expect, run_and_judge

NAN, INF = np.nan, np.inf
ROWS = np.array([
    [NAN, 1.5, -2.5, 0.0, -0.0, INF, -INF, 3.0],
    [1.5, -2.5, 0.0, 3.0, -INF, INF, -0.0, NAN],
    [0.25, -1.0, 2.0, NAN, -3.0, 0.5, 4.0, -0.5],
    [INF, -INF, 0.0, -0.0, 2.0, -2.0, 0.75, -7.0],
    [NAN] * 8,
], np.float32)

C = {"zero": np.array(0.0, np.float32), "one": np.array(1.0, np.float32), "mone": np.array(-1.0, np.float32),
     "two": np.array(2.0, np.float32), "slope": np.full(8, 0.25, np.float32),
     "w": np.random.default_rng(3).uniform(-1, 1, (8, 3)).astype(np.float32), "axes": np.array([1], np.int64),
     "scale": np.ones(8, np.float32), "bias": np.zeros(8, np.float32)}

# key: (op type, inputs after x, attributes, opset)
OPS = {
    "relu": ("Relu", [], {}, 18), "leaky_relu": ("LeakyRelu", [], {"alpha": 0.1}, 18), "elu": ("Elu", [], {}, 18),
    "selu": ("Selu", [], {}, 18), "celu": ("Celu", [], {}, 18), "hard_sigmoid": ("HardSigmoid", [], {}, 18),
    "hard_swish": ("HardSwish", [], {}, 18), "sigmoid": ("Sigmoid", [], {}, 18), "tanh": ("Tanh", [], {}, 18),
    "softplus": ("Softplus", [], {}, 18), "softsign": ("Softsign", [], {}, 18),
    "thresholded_relu": ("ThresholdedRelu", [], {"alpha": 0.5}, 18), "shrink": ("Shrink", [], {"lambd": 0.5}, 18),
    "abs": ("Abs", [], {}, 18), "neg": ("Neg", [], {}, 18), "sign": ("Sign", [], {}, 18), "floor": ("Floor", [], {}, 18),
    "ceil": ("Ceil", [], {}, 18), "round": ("Round", [], {}, 18), "sqrt": ("Sqrt", [], {}, 18), "exp": ("Exp", [], {}, 18),
    "log": ("Log", [], {}, 18), "reciprocal": ("Reciprocal", [], {}, 18), "erf": ("Erf", [], {}, 18),
    "mish": ("Mish", [], {}, 18), "gelu": ("Gelu", [], {}, 20), "gelu_tanh": ("Gelu", [], {"approximate": "tanh"}, 20),
    "clip": ("Clip", ["mone", "one"], {}, 18), "clip_min": ("Clip", ["zero"], {}, 18), "clip_none": ("Clip", [], {}, 18),
    "isnan": ("IsNaN", [], {}, 18), "isinf": ("IsInf", [], {}, 18),
    "max_c": ("Max", ["zero"], {}, 18), "max_c_first": ("Max", ["zero", "x"], {}, 18), "min_c": ("Min", ["zero"], {}, 18),
    "min_c_first": ("Min", ["zero", "x"], {}, 18), "max3": ("Max", ["zero", "mone"], {}, 18),
    "prelu": ("PRelu", ["slope"], {}, 18), "pow2": ("Pow", ["two"], {}, 18), "pow_base": ("Pow", ["two", "x"], {}, 18),
    "fmod": ("Mod", ["two"], {"fmod": 1}, 18), "div0": ("Div", ["zero"], {}, 18), "mean": ("Mean", ["zero"], {}, 18),
    "sum": ("Sum", ["one"], {}, 18), "greater": ("Greater", ["zero"], {}, 18), "equal_self": ("Equal", ["x", "x"], {}, 18),
    "less_equal": ("LessOrEqual", ["zero"], {}, 18),
    "reduce_max": ("ReduceMax", ["axes"], {"keepdims": 0}, 18), "reduce_min": ("ReduceMin", ["axes"], {"keepdims": 0}, 18),
    "reduce_sum": ("ReduceSum", ["axes"], {"keepdims": 0}, 18), "reduce_mean": ("ReduceMean", ["axes"], {"keepdims": 0}, 18),
    "reduce_prod": ("ReduceProd", ["axes"], {"keepdims": 0}, 18), "reduce_l1": ("ReduceL1", ["axes"], {"keepdims": 0}, 18),
    "reduce_l2": ("ReduceL2", ["axes"], {"keepdims": 0}, 18),
    "reduce_log_sum_exp": ("ReduceLogSumExp", ["axes"], {"keepdims": 0}, 18),
    "reduce_sum_square": ("ReduceSumSquare", ["axes"], {"keepdims": 0}, 18),
    "softmax": ("Softmax", [], {"axis": 1}, 18), "log_softmax": ("LogSoftmax", [], {"axis": 1}, 18),
    "hardmax": ("Hardmax", [], {"axis": 1}, 18), "cumsum": ("CumSum", ["axes"], {}, 18),
    "matmul": ("MatMul", ["w"], {}, 18), "lp_norm": ("LpNormalization", [], {"axis": 1, "p": 2}, 18),
    "layer_norm": ("LayerNormalization", ["scale", "bias"], {"axis": 1}, 18),
}
# ops over a [N, 1, 8] image (pooling)
POOLS = {
    "max_pool": ("MaxPool", {"kernel_shape": [3], "strides": [1]}), "global_max_pool": ("GlobalMaxPool", {}),
    "average_pool": ("AveragePool", {"kernel_shape": [3]}), "global_average_pool": ("GlobalAveragePool", {}),
}


def op_model(key: str):
    if key in POOLS:
        op, attrs = POOLS[key]
        nodes = [helper.make_node(op, ["x"], ["y"], name=key, **attrs)]
        return make_model(nodes, [vi("x", F, ["N", 1, 8])], ["y"]), {"x": ROWS[:, None, :].copy()}
    op, extra, attrs, opset = OPS[key]
    ins = ["x"] + [e for e in extra] if "x" not in extra else extra
    inits = {e: C[e] for e in extra if e != "x"}
    nodes = [helper.make_node(op, ins, ["y"], name=key, **attrs)]
    return make_model(nodes, [vi("x", F, ["N", 8])], ["y"], inits, opset=opset), {"x": ROWS}


def reference_evaluator(model, feeds) -> dict[str, np.ndarray]:
    """Return onnx.reference's outputs (the ONNX spec's executable semantics, numpy underneath)."""
    from onnx.reference import ReferenceEvaluator

    with np.errstate(all="ignore"):
        outs = ReferenceEvaluator(model).run(None, feeds)
    return {o.name: np.asarray(v) for o, v in zip(model.graph.output, outs)}


# Pooling: onnxruntime and onnx.reference both skip NaN inside a window (the reference filters it
# out on purpose); luisaml may do the same or propagate NaN as IEEE maximum does.
NAN_MAY_PROPAGATE = {"max_pool", "global_max_pool"}


def nan_rule_difference(got: np.ndarray, refs: list[np.ndarray], rtol=1e-5, atol=1e-6,
                        may_propagate: bool = False) -> str | None:
    """Return how got breaks the NaN rule, or None. The rule: where any reference is NaN, got
    must be NaN (NaN propagates: onnxruntime's MaxPool and ReduceMax skip NaN in some positions,
    the ONNX reference does not); elsewhere got must equal one of the references (an inf*0 edge
    may legitimately differ between them)."""
    g = np.asarray(got)
    if any(g.shape != r.shape or g.dtype != r.dtype for r in refs):
        r = refs[0]
        return f"{g.dtype}{list(g.shape)}, expected {r.dtype}{list(r.shape)}"
    if g.dtype.kind != "f":
        ok = np.zeros(g.shape, bool)
        for r in refs:
            ok |= g == r
        bad = np.argwhere(~ok)
        return None if not len(bad) else f"{len(bad)} elements differ; at {tuple(bad[0])}: {g[tuple(bad[0])]!r}"
    any_nan = np.zeros(g.shape, bool)
    for r in refs:
        any_nan |= np.isnan(r)
    dropped = any_nan & ~np.isnan(g)
    if dropped.any():
        i = tuple(int(v) for v in np.argwhere(dropped)[0])
        return f"NaN dropped in {int(dropped.sum())} elements; at {i}: {g[i].item()!r}"
    ok = any_nan | (np.isnan(g) if may_propagate else False)
    for r in refs:
        with np.errstate(all="ignore"):
            close = (g == r) | (np.abs(g.astype(np.float64) - r) <= atol + rtol * np.abs(r.astype(np.float64)))
        ok |= close & ~np.isnan(r)
    bad = ~ok
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        return (f"{int(bad.sum())} elements differ; at {i}: {g[i].item()!r}, expected "
                + " or ".join(repr(r[i].item()) for r in refs))
    return None


@recipe("nan.op")
def nan_op(ctx, key: str) -> None:
    model, feeds = op_model(key)
    path = save(model, ctx.path("model.onnx"))
    a = attempt(actions.compile_run, path, feeds)
    judge(a, error_ok=False, what=key)
    refs = []
    for name, fn in (("onnxruntime", ort_outputs), ("onnx.reference", reference_evaluator)):
        try:
            refs.append(fn(model, feeds))
        except Exception:  # noqa: BLE001 - a reference that cannot run the op leaves the other
            pass
    if not refs:
        raise Fail(FAIL_HARNESS, f"neither onnxruntime nor onnx.reference runs {key}")
    for out, first in refs[0].items():
        # a reference whose shape or type differs from onnxruntime's is broken for this op
        # (onnx.reference's GlobalMaxPool drops an axis): leave it out
        alts = [r[out] for r in refs if out in r and r[out].shape == first.shape and r[out].dtype == first.dtype]
        diff = nan_rule_difference(a.value[out], alts, may_propagate=key in NAN_MAY_PROPAGATE)
        if diff:
            raise Fail(FAIL_WRONG, f"{key}: output {out!r}: {diff}")


@recipe("nan.initializer")
def nan_initializer(ctx, key: str) -> None:
    """NaN and infinities in the weights rather than the inputs (a constant is folded or becomes a
    literal: the literal must still be NaN)."""
    w = {"nan_bias": np.array([NAN, 1, INF, -INF, 0, -0.0, 2, 3], np.float32)}
    op = {"add": "Add", "max": "Max", "min": "Min", "mul": "Mul"}[key]
    nodes = [helper.make_node(op, ["x", "nan_bias"], ["y"], name=f"{key}_nan_bias")]
    model = make_model(nodes, [vi("x", F, ["N", 8])], ["y"], w)
    run_and_judge(ctx, model, {"x": np.nan_to_num(ROWS, nan=0.5, posinf=9, neginf=-9)},
                  Expect(f"{key}_nan_bias", ORT, error_ok=False), what=key)


_CI = {"relu", "max_c", "min_c", "hard_sigmoid", "clip", "reduce_max", "max_pool", "softmax"}


def cases() -> list[Case]:
    out = [Case(f"nan/{key}", "nan", "nan.op", dict(key=key), ci=key in _CI) for key in list(OPS) + list(POOLS)]
    out += [Case(f"nan/initializer/{key}", "nan", "nan.initializer", dict(key=key)) for key in ("add", "max", "min", "mul")]
    return out
