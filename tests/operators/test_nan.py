"""NaN and ±Inf through the operators, against onnxruntime: inputs hold NaN, +inf, -inf, 0 and -0
among normal values (and a line of all NaN), in float32 and float16; NaN and inf positions must
be onnxruntime's, integer outputs equal. Each test compiles one model of several nodes (the
unary test one per opset).

Where onnxruntime's answer depends on where a NaN falls among its vector lanes (ReduceMax/Min,
Hardmax, MaxPool: its vectorised max keeps or drops a NaN by position), luisaml follows numpy
(a NaN in the window or line gives NaN), and the tests compare with onnxruntime on inputs where
its answer is consistent (±inf anywhere, lines all NaN) and with numpy on the others."""

import numpy as np
import pytest
from onnx import helper

from util import graph_model, ort_run

import luisaml

NAN, INF = np.nan, np.inf
F16 = np.float16
TOL = {np.float32: {"rtol": 1e-5, "atol": 1e-6}, F16: {"rtol": 2e-3, "atol": 2e-3}}


def sprinkled(shape, dtype=np.float32, seed=0, lo=-4.0, hi=4.0, nan=True, nan_line=True):
    """Return values in [lo, hi) with NaN (if nan), +inf, -inf, 0 and -0 among them, about one in
    ten each; with nan_line the last line along the last axis is all NaN."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(lo, hi, size=shape)
    u = rng.random(shape)
    x[(u >= 0.1) & (u < 0.2)] = INF
    x[(u >= 0.2) & (u < 0.3)] = -INF
    x[(u >= 0.3) & (u < 0.35)] = 0.0
    x[(u >= 0.35) & (u < 0.4)] = -0.0
    if nan:
        x[u < 0.1] = NAN
        if nan_line:
            x.reshape(-1, shape[-1])[-1] = NAN
    return x.astype(dtype)


def nan_lines(shape, axis, dtype=np.float32, seed=0):
    """Return sprinkled data whose only NaNs fill lines along `axis` (one in three), +inf and -inf
    anywhere: where onnxruntime's vectorised max and min are consistent."""
    x = np.moveaxis(sprinkled(shape, np.float64, seed, nan=False), axis, -1).copy()
    x.reshape(-1, x.shape[-1])[::3] = NAN
    return np.moveaxis(x, -1, axis).astype(dtype)


def compare(got: dict, want: dict, tol: dict) -> None:
    """Assert every output in `want` equals `got`'s (dtype, shape, NaN and inf positions; floats
    within tol), naming every one that does not."""
    errors = []
    for name, w in want.items():
        g = got[name]
        try:
            assert g.dtype == w.dtype, f"dtype {g.dtype} != {w.dtype}"
            assert g.shape == w.shape, f"shape {g.shape} != {w.shape}"
            if w.dtype.kind == "f":
                np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), equal_nan=True, **tol)
            else:
                np.testing.assert_array_equal(g, w)
        except AssertionError as e:
            errors.append(f"{name}: {e}")
    assert not errors, "\n".join(errors)


def run_both(model, feeds):
    """Return (luisaml's outputs, onnxruntime's outputs)."""
    return luisaml.compile(model, batch_axis=None).run(feeds), ort_run(model, feeds)


def assert_all_match_ort(model, feeds, tol) -> dict:
    """Compile and run model, assert its outputs are onnxruntime's (compare), return them."""
    got, want = run_both(model, feeds)
    compare(got, want, tol)
    return got


def node(op, ins, outs, **attrs):
    """Return an op node named after its first output (outs: one name or a list)."""
    outs = [outs] if isinstance(outs, str) else list(outs)
    return helper.make_node(op, ins, outs, name=outs[0], **attrs)


DTYPES = pytest.mark.parametrize("dtype", [np.float32, F16], ids=["f32", "f16"])

# ---- elementwise -----------------------------------------------------------------------------------

UNARY = [
    ("Relu", {}), ("LeakyRelu", {"alpha": 0.1}), ("ThresholdedRelu", {"alpha": 0.5}), ("Elu", {"alpha": 0.7}),
    ("Selu", {}), ("Celu", {"alpha": 0.8}), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}), ("HardSwish", {}),
    ("Shrink", {"lambd": 0.6, "bias": 0.2}), ("Softplus", {}), ("Softsign", {}), ("Mish", {}), ("Sign", {}),
    ("Abs", {}), ("Neg", {}), ("Sigmoid", {}), ("Tanh", {}), ("Exp", {}), ("Log", {}), ("Sqrt", {}),
    ("Reciprocal", {}), ("Erf", {}), ("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("Floor", {}), ("Ceil", {}),
    ("Round", {}), ("Sin", {}), ("Cos", {}), ("Atan", {}), ("Sinh", {}), ("Cosh", {}), ("Asinh", {}), ("IsNaN", {}),
    ("IsInf", {}), ("IsInf", {"detect_negative": 0}), ("Identity", {}), ("Clip", {"min": -1.5, "max": 2.0}),
    ("Swish", {"alpha": 0.8}),
]
OPSET = {"Clip": 6, "Swish": 24}  # Clip-6 takes its bounds as attributes
# Celu is float only in ONNX; Clip-6 in float16 does not compile: the opset upgrade (onnx's
# version converter) gives the Clip-11 it makes float32 bounds
NO_HALF = {"Celu", "Clip"}
# onnxruntime's float16 Sign gives 0 for NaN (float32 and numpy give NaN): checked against numpy below
HALF_NOT_ORT = {"Sign"}


@DTYPES
def test_unary(dtype):
    """The activations and unary math: Relu, HardSigmoid, Celu and Clip-6 keep NaN (max, min and
    clamp would drop it); Softplus(+inf) is +inf, Sigmoid(-inf) 0, Mish/HardSwish/Gelu(-inf) NaN."""
    x = sprinkled((6, 8), dtype, seed=1)
    nodes = []
    for op, attrs in UNARY:
        if dtype == F16 and (op in NO_HALF or op in HALF_NOT_ORT):
            continue
        name = "_".join([op] + [f"{k}{v}" for k, v in attrs.items()])
        nodes.append((OPSET.get(op, 22), node(op, ["x"], name, **attrs)))
    for opset in sorted({o for o, _ in nodes}):
        m = graph_model([n for o, n in nodes if o == opset], {"x": x}, opset=opset)
        assert_all_match_ort(m, {"x": x}, TOL[dtype])


def test_sign_half_keeps_nan():
    """float16 Sign of NaN is NaN (numpy, and onnxruntime's float32 kernel; its float16 one gives 0)."""
    x = sprinkled((6, 8), F16, seed=2)
    got = luisaml.compile(graph_model([node("Sign", ["x"], "y")], {"x": x}), batch_axis=None).run({"x": x})["y"]
    np.testing.assert_array_equal(got, np.sign(x))


@DTYPES
def test_binary(dtype):
    """Max and Min (variadic, broadcast) propagate NaN like np.maximum; comparisons of NaN are false;
    Where and PRelu select NaN like any value; arithmetic."""
    a = sprinkled((6, 8), dtype, seed=3)
    b = sprinkled((6, 8), dtype, seed=4, nan_line=False)
    row = sprinkled((8,), dtype, seed=5, nan_line=False)
    col = sprinkled((6, 1), dtype, seed=6, nan_line=False)
    cond = np.random.default_rng(7).random((6, 8)) > 0.5
    feeds = {"a": a, "b": b, "row": row, "col": col, "cond": cond}
    nodes = [node(op, ins, f"{op}_{'_'.join(ins)}") for op in ("Max", "Min")
             for ins in (["a", "b"], ["b", "a"], ["a", "row"], ["col", "a", "row"], ["a"])]
    nodes += [node(op, ["a", "b"], op) for op in ("Add", "Sub", "Mul", "Div", "Equal", "Less", "Greater",
                                                  "LessOrEqual", "GreaterOrEqual")]
    nodes += [node(op, ["a", "b", "row"], op) for op in ("Sum", "Mean")]
    nodes += [node("Where", ["cond", "a", "b"], "Where"), node("PRelu", ["a", "row"], "PRelu"),
              node("PRelu", ["b", "a"], "PRelu_nan_slope")]
    if dtype == np.float32:
        nodes.append(node("Equal", ["a", "a"], "Equal_self"))
    assert_all_match_ort(graph_model(nodes, feeds, opset=18), feeds, TOL[dtype])


@DTYPES
def test_division_by_a_square_root(dtype):
    """x / Sqrt(y), x / ReduceL2(y) and x / LpPool(y), each read inline by the Div: a backend's
    fast math would make x * rsqrt(y) with a Newton step of the pair, NaN for y = 0 or inf (fuzz
    graph 11:130) and an ulp off elsewhere (3 / sqrt(4)); numpy's division of the square root."""
    x = sprinkled((6, 8), dtype, seed=13, nan_line=False)
    y = np.abs(sprinkled((6, 8), dtype, seed=14, nan_line=False))
    y[0, :4] = [0.0, INF, 4.0, -1.0]
    x[0, :4] = [1.0, 1.0, 3.0, 1.0]
    y4 = y.reshape(1, 6, 8, 1)
    feeds = {"x": x, "y": y, "y4": y4}
    nodes = [node("Sqrt", ["y"], "s"), node("Div", ["x", "s"], "by_sqrt"),
             node("ReduceL2", ["y"], "l2", axes=[1], keepdims=1), node("Div", ["x", "l2"], "by_l2"),
             node("LpPool", ["y4"], "lp", kernel_shape=[1, 1], p=2), node("Reshape", ["lp", "shape"], "lp2"),
             node("Div", ["x", "lp2"], "by_lp")]
    m = graph_model(nodes, feeds, {"shape": np.array([6, 8], np.int64)}, opset=13, outputs=["by_sqrt", "by_l2", "by_lp"])
    got = luisaml.compile(m, batch_axis=None).run(feeds)
    y32, x32 = y.astype(np.float32), x.astype(np.float32)
    with np.errstate(all="ignore"):
        want = {"by_sqrt": x32 / np.sqrt(y32), "by_l2": x32 / np.sqrt((y32 * y32).sum(1, keepdims=True)),
                "by_lp": x32 / np.sqrt(y32 * y32)}
    for name, w in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), w.astype(dtype).astype(np.float32), err_msg=name,
                                   **TOL[dtype])
    if dtype == np.float32:
        assert got["by_sqrt"][0, 2] == np.float32(1.5)  # correctly rounded, not 1.4999999


@DTYPES
def test_clip(dtype):
    """Clip as onnxruntime (std::min(std::max(x, lo), hi)): NaN x stays NaN, a NaN bound bounds
    nothing, min > max gives max; infinite bounds."""
    x = sprinkled((6, 8), dtype, seed=8)
    bounds = {"lo": -1.5, "hi": 2.0, "nan": NAN, "big": 3.0, "ninf": -INF, "pinf": INF}
    feeds = {"x": x}
    inits = {k: np.array(v, dtype) for k, v in bounds.items()}
    cases = [("lo", "hi"), ("lo", ""), ("", "hi"), ("", ""), ("nan", "hi"), ("lo", "nan"), ("nan", "nan"),
             ("big", "lo"), ("ninf", "pinf"), ("pinf", "")]
    nodes = [node("Clip", ["x", lo, hi], f"clip_{lo}_{hi}") for lo, hi in cases]
    assert_all_match_ort(graph_model(nodes, feeds, inits, opset=13), feeds, TOL[dtype])


# ---- reductions ------------------------------------------------------------------------------------


def reduce_node(op, x, axes, out, keepdims=1):
    return node(op, [x, f"axes_{'_'.join(map(str, axes))}"] if axes else [x], out, keepdims=keepdims)


def axes_inits(*axes_sets):
    return {f"axes_{'_'.join(map(str, a))}": np.array(a, np.int64) for a in axes_sets}


@DTYPES
def test_reduce_max_min_ort(dtype):
    """ReduceMax/Min against onnxruntime where its answer does not depend on vector lanes: lines
    all NaN, ±inf anywhere."""
    x1 = nan_lines((5, 9), 1, dtype, seed=9)
    x0 = nan_lines((7, 6), 0, dtype, seed=10)
    feeds = {"x1": x1, "x0": x0}
    nodes = [reduce_node(op, x, [ax], f"{op}_{x}") for op in ("ReduceMax", "ReduceMin") for x, ax in (("x1", 1), ("x0", 0))]
    assert_all_match_ort(graph_model(nodes, feeds, axes_inits([1], [0]), opset=18), feeds, TOL[dtype])


@DTYPES
def test_reduce_max_min_numpy(dtype):
    """ReduceMax/Min with NaN anywhere: numpy's max/min (NaN wins), over one axis, several, all."""
    x = sprinkled((4, 5, 6), dtype, seed=11)
    feeds = {"x": x}
    axes = [[2], [0], [0, 2], []]
    nodes = [reduce_node(op, "x", a, f"{op}_{'_'.join(map(str, a))}") for op in ("ReduceMax", "ReduceMin") for a in axes]
    got = luisaml.compile(graph_model(nodes, feeds, axes_inits(*[a for a in axes if a]), opset=18), batch_axis=None).run(feeds)
    want = {f"{op}_{'_'.join(map(str, a))}": fn(x, axis=tuple(a) if a else None, keepdims=True)
            for op, fn in (("ReduceMax", np.max), ("ReduceMin", np.min)) for a in axes}
    compare(got, want, TOL[dtype])


@DTYPES
def test_reductions(dtype):
    """The arithmetic reductions: NaN anywhere gives NaN, inf - inf gives NaN; LogSumExp of a line
    with +inf is +inf, of a line of -inf is -inf."""
    x = sprinkled((5, 7), dtype, seed=12, lo=-3, hi=3)
    lse = np.array([[1, 2, INF, -1], [-INF] * 4, [INF, -INF, 0, 1], [INF, INF, 2, 3], [-INF, 1, -INF, 2],
                    [NAN, INF, 1, 2], [INF, NAN, -INF, 1], [0.5, 1, 2, 3]], dtype)
    feeds = {"x": x, "lse": lse}
    ops = ["ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum",
           "ReduceLogSumExp"]
    nodes = [reduce_node(op, "x", [a], f"{op}_{a}") for op in ops for a in (0, 1)]
    nodes += [reduce_node("ReduceLogSumExp", "lse", [a], f"lse_{a}") for a in (0, 1)]
    assert_all_match_ort(graph_model(nodes, feeds, axes_inits([0], [1]), opset=18), feeds, TOL[dtype])


@DTYPES
def test_arg_max_min(dtype):
    """ArgMax/ArgMin as onnxruntime: the first element starts, a later one must compare better (a
    leading NaN is the answer, a later one never is); select_last_index takes ties."""
    x = sprinkled((7, 9), dtype, seed=13, lo=-2, hi=2).round()  # ties
    feeds = {"x": x}
    nodes = [node(op, ["x"], f"{op}_{ax}_{last}", axis=ax, select_last_index=last, keepdims=ax)
             for op in ("ArgMax", "ArgMin") for ax in (0, 1) for last in (0, 1)]
    assert_all_match_ort(graph_model(nodes, feeds, opset=13), feeds, TOL[dtype])


@DTYPES
def test_softmax(dtype):
    """Softmax and LogSoftmax: a line with NaN or +inf is all NaN, as is a line of -inf; -inf
    elsewhere gives 0 (or -inf)."""
    x = sprinkled((6, 7), dtype, seed=14, lo=-3, hi=3)
    x[1] = -INF
    x[2, 3] = -INF
    x3 = sprinkled((2, 3, 4), dtype, seed=15, lo=-3, hi=3)
    feeds = {"x": x, "x3": x3}
    nodes = [node(op, ["x"], f"{op}_{ax}", axis=ax) for op in ("Softmax", "LogSoftmax") for ax in (0, 1)]
    nodes += [node(op, ["x3"], f"{op}_3d", axis=1) for op in ("Softmax", "LogSoftmax")]
    assert_all_match_ort(graph_model(nodes, feeds, opset=13), feeds, TOL[dtype])


@DTYPES
def test_hardmax(dtype):
    """Hardmax: a line holding NaN has no maximum (all 0; onnxruntime agrees on lines all NaN),
    +inf is a maximum like any other value."""
    x = nan_lines((6, 7), 1, dtype, seed=16)
    x0 = nan_lines((6, 5), 0, dtype, seed=17)
    feeds = {"x": x, "x0": x0}
    nodes = [node("Hardmax", ["x"], "last", axis=-1), node("Hardmax", ["x0"], "first", axis=0)]
    assert_all_match_ort(graph_model(nodes, feeds, opset=13), feeds, TOL[dtype])
    y = sprinkled((6, 7), dtype, seed=18)
    got = luisaml.compile(graph_model([node("Hardmax", ["y"], "h")], {"y": y}, opset=13), batch_axis=None).run({"y": y})["h"]
    want = (np.arange(7) == np.argmax(np.nan_to_num(y, nan=-INF), axis=1)[:, None]).astype(dtype)
    want[np.isnan(y).any(axis=1)] = 0
    np.testing.assert_array_equal(got, want)


@DTYPES
def test_topk(dtype):
    """TopK as onnxruntime: NaN above every number (+inf included), equal values (NaNs too) in
    index order; largest and smallest, along either axis."""
    x = sprinkled((5, 9), dtype, seed=19, lo=-2, hi=2).round()
    x[1, :4] = NAN
    feeds = {"x": x}
    inits = {f"k{k}": np.array([k], np.int64) for k in (1, 4, 5, 9)}
    nodes = [node("TopK", ["x", f"k{k}"], [f"v_{ax}_{k}_{lg}", f"i_{ax}_{k}_{lg}"], axis=ax, largest=lg)
             for ax, ks in ((1, (1, 4, 9)), (0, (1, 5))) for k in ks for lg in (0, 1)]
    assert_all_match_ort(graph_model(nodes, feeds, inits, opset=11), feeds, TOL[dtype])


@DTYPES
def test_cumsum(dtype):
    x = sprinkled((5, 6), dtype, seed=20)
    feeds = {"x": x}
    inits = {"a0": np.array(0, np.int64), "a1": np.array(1, np.int64)}
    nodes = [node("CumSum", ["x", f"a{ax}"], f"c_{ax}_{ex}_{rv}", exclusive=ex, reverse=rv)
             for ax in (0, 1) for ex in (0, 1) for rv in (0, 1)]
    assert_all_match_ort(graph_model(nodes, feeds, inits, opset=14), feeds, TOL[dtype])


# ---- pools -----------------------------------------------------------------------------------------


def max_pool_reference(x, k, s, p):
    """Return (Y, Indices) of a 2-D MaxPool (kernel k, strides s, pads p at both ends) with numpy's
    semantics: NaN wins, Indices is the first NaN's (else the first maximum's) flat index."""
    n, c, h, w = x.shape
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    y, ind = np.zeros((n, c, oh, ow), x.dtype), np.zeros((n, c, oh, ow), np.int64)
    for b in range(n):
        for ch in range(c):
            for i in range(oh):
                for j in range(ow):
                    rows = range(max(i * s - p, 0), min(i * s - p + k, h))
                    cols = range(max(j * s - p, 0), min(j * s - p + k, w))
                    flat = [(r * w + q, x[b, ch, r, q]) for r in rows for q in cols]
                    nans = [f for f, v in flat if np.isnan(v)]
                    best = max(v for _, v in flat) if not nans else NAN
                    y[b, ch, i, j] = best
                    at = nans[0] if nans else next(f for f, v in flat if v == best)
                    ind[b, ch, i, j] = (b * c + ch) * h * w + at
    return y, ind


@DTYPES
def test_max_pool(dtype):
    """MaxPool with and without Indices and GlobalMaxPool: a window holding NaN gives NaN (numpy;
    onnxruntime agrees on those whose NaN comes first, checked too), a window of -inf gives -inf."""
    x = sprinkled((1, 2, 6, 7), dtype, seed=21, nan_line=False)
    x[0, 1, 4:] = -INF
    feeds = {"x": x}
    nodes = [node("MaxPool", ["x"], "y2", kernel_shape=[2, 2]),
             node("MaxPool", ["x"], ["y3", "i3"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             node("MaxPool", ["x"], ["y2i", "i2"], kernel_shape=[2, 2]),
             node("GlobalMaxPool", ["x"], "g")]
    got, ort = run_both(graph_model(nodes, feeds, opset=12), feeds)
    y2, i2 = max_pool_reference(x, 2, 1, 0)
    y3, i3 = max_pool_reference(x, 3, 2, 1)
    g = np.max(x, axis=(2, 3), keepdims=True)
    compare(got, {"y2": y2, "y2i": y2, "i2": i2, "y3": y3, "i3": i3, "g": g}, TOL[dtype])
    # onnxruntime's Indices path keeps a NaN that comes first in its window: where it gives NaN, so
    # do we, at the same index
    for y, i in (("y2i", "i2"), ("y3", "i3")):
        at = np.isnan(ort[y])
        assert np.isnan(got[y][at]).all() and (got[i][at] == ort[i][at]).all(), y


@DTYPES
def test_average_and_lp_pools(dtype):
    x = sprinkled((1, 2, 6, 7), dtype, seed=22, lo=-2, hi=2)
    feeds = {"x": x}
    nodes = [node("AveragePool", ["x"], "avg", kernel_shape=[2, 2]),
             node("AveragePool", ["x"], "avg_pad", kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
             node("LpPool", ["x"], "lp2", kernel_shape=[2, 2], p=2), node("LpPool", ["x"], "lp1", kernel_shape=[2, 3], p=1),
             node("LpPool", ["x"], "lp3", kernel_shape=[2, 2], p=3),
             node("GlobalAveragePool", ["x"], "gavg"), node("GlobalLpPool", ["x"], "glp", p=2)]
    assert_all_match_ort(graph_model(nodes, feeds, opset=18), feeds, TOL[dtype])


# ---- normalizations, recurrent and the rest ----------------------------------------------------------


@DTYPES
def test_normalizations(dtype):
    """A NaN or inf in a normalised group makes the group NaN, as in onnxruntime."""
    x = sprinkled((2, 4, 6), dtype, seed=23, lo=-2, hi=2)
    x[1, 2] = np.linspace(-1, 1, 6)  # one clean group
    rng = np.random.default_rng(24)
    inits = {"s6": rng.uniform(0.5, 1.5, 6).astype(dtype), "b6": rng.uniform(-1, 1, 6).astype(dtype),
             "s4": rng.uniform(0.5, 1.5, 4).astype(dtype), "b4": rng.uniform(-1, 1, 4).astype(dtype),
             "m4": rng.uniform(-1, 1, 4).astype(dtype), "v4": rng.uniform(0.5, 2, 4).astype(dtype)}
    feeds = {"x": x}
    nodes = [node("LayerNormalization", ["x", "s6", "b6"], "ln", axis=-1),
             node("InstanceNormalization", ["x", "s4", "b4"], "inorm"),
             node("BatchNormalization", ["x", "s4", "b4", "m4", "v4"], "bn"),
             node("LpNormalization", ["x"], "lp2", axis=-1, p=2), node("LpNormalization", ["x"], "lp1", axis=1, p=1)]
    # onnxruntime cannot load GroupNormalization's function body, nor MeanVarianceNormalization's in float16
    if dtype == np.float32:
        nodes.append(node("MeanVarianceNormalization", ["x"], "mvn", axes=[0, 2]))
    assert_all_match_ort(graph_model(nodes, feeds, inits, opset=18), feeds, TOL[dtype])


@DTYPES
def test_lrn(dtype):
    """LRN sums each window of channels directly (ONNX's reference), so NaN and inf reach exactly
    the windows that hold them. onnxruntime keeps a running sum, adding the channel that enters
    and subtracting the one that leaves: an inf or NaN that has left makes NaN of every later
    channel, so it is compared with numpy here."""
    x = sprinkled((2, 5, 3, 2), dtype, seed=31, lo=-2, hi=2, nan_line=False)
    size, alpha, beta, bias = 3, 2e-4, 0.75, 1.0
    got = luisaml.compile(graph_model([node("LRN", ["x"], "y", size=size, alpha=alpha)], {"x": x}), batch_axis=None).run({"x": x})["y"]
    xf = x.astype(np.float64)
    sq = np.pad(xf * xf, ((0, 0), (1, 1), (0, 0), (0, 0)))
    window = sum(sq[:, k:k + x.shape[1]] for k in range(size))
    with np.errstate(invalid="ignore"):  # inf / inf
        want = xf / (bias + alpha / size * window) ** beta
    np.testing.assert_allclose(got, want, equal_nan=True, **TOL[dtype])


def test_recurrent():
    """RNN/GRU/LSTM on X with NaN and inf: clip keeps NaN (onnxruntime's std::min(std::max(..))),
    the Relu and HardSigmoid activations turn it into a bound (onnxruntime's std::max(0, x))."""
    S, B, I, H = 4, 3, 3, 2
    rng = np.random.default_rng(25)
    x = rng.uniform(-1, 1, (S, B, I)).astype(np.float32)
    x[1, 0, 0], x[0, 1, 1], x[2, 2, 2] = NAN, INF, -INF
    feeds = {"x": x}
    inits = {}
    nodes = []
    for k, (op, g, attrs) in enumerate([
        ("RNN", 1, {"activations": ["Relu"]}), ("RNN", 1, {"activations": ["Tanh"], "clip": 0.8}),
        ("RNN", 1, {"activations": ["HardSigmoid"]}), ("RNN", 1, {"activations": ["Softplus"]}),
        ("GRU", 3, {"clip": 1.5}), ("LSTM", 4, {"clip": 0.5}), ("LSTM", 4, {}),
    ]):
        inits[f"w{k}"] = rng.uniform(-1, 1, (1, g * H, I)).astype(np.float32)
        inits[f"r{k}"] = rng.uniform(-0.7, 0.7, (1, g * H, H)).astype(np.float32)
        outs = [f"y{k}", f"h{k}"] + ([f"c{k}"] if op == "LSTM" else [])
        nodes.append(node(op, ["x", f"w{k}", f"r{k}"], outs, hidden_size=H, **attrs))
    assert_all_match_ort(graph_model(nodes, feeds, inits, opset=22), feeds, TOL[np.float32])


def test_roi_align_max():
    """RoiAlign's max mode with NaN and inf in X, as onnxruntime (std::max over the weighted corners)."""
    x = sprinkled((1, 2, 8, 9), np.float32, seed=26, lo=-2, hi=2, nan_line=False)
    x[0, 1, 0, 0] = NAN  # what onnxruntime reads (with weight 0) for samples outside the image
    rois = np.array([[0.5, 1.0, 7.5, 6.0], [1.0, 0.0, 6.0, 8.5], [2.0, 2.0, 5.0, 5.0], [-3.0, -2.2, 4.0, 11.7]],
                    np.float32)
    idx = np.zeros(4, np.int64)
    feeds = {"x": x, "rois": rois, "idx": idx}
    nodes = [node("RoiAlign", ["x", "rois", "idx"], f"y_{mode}", mode=mode, output_height=3, output_width=2,
                  sampling_ratio=2) for mode in ("max", "avg")]
    assert_all_match_ort(graph_model(nodes, feeds, opset=16), feeds, TOL[np.float32])


@DTYPES
def test_resize_and_grid_sample(dtype):
    x = sprinkled((1, 2, 4, 5), dtype, seed=27, lo=-2, hi=2, nan_line=False)
    grid = np.random.default_rng(28).uniform(-1.1, 1.1, (1, 3, 4, 2)).astype(dtype)
    feeds = {"x": x, "grid": grid}
    inits = {"scales": np.array([1, 1, 1.5, 1.75], np.float32)}
    nodes = [node("Resize", ["x", "", "scales"], f"resize_{mode}", mode=mode) for mode in ("nearest", "linear", "cubic")]
    nodes += [node("GridSample", ["x", "grid"], f"gs_{mode}", mode=mode) for mode in ("nearest", "linear")]
    assert_all_match_ort(graph_model(nodes, feeds, inits, opset=20), feeds, TOL[dtype])


def test_det_and_losses():
    mats = np.array([[[NAN, 1], [2, 3]], [[1, 2], [NAN, 3]], [[INF, 1], [1, 1]], [[1, 2], [3, NAN]],
                     [[1, 2], [3, 4]], [[INF, 1], [INF, 1]]], np.float32)
    scores = sprinkled((4, 5), np.float32, seed=29, lo=-2, hi=2, nan_line=False)
    scores[3] = [0.5, -1, INF, 0, 1]
    labels = np.array([0, 3, 4, 2], np.int64)
    feeds = {"mats": mats, "scores": scores, "labels": labels}
    nodes = [node("Det", ["mats"], "det"),
             node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["sce", "logp"], reduction="none"),
             node("NegativeLogLikelihoodLoss", ["scores", "labels"], "nll", reduction="none")]
    assert_all_match_ort(graph_model(nodes, feeds, opset=13), feeds, TOL[np.float32])


def test_attention():
    """Attention with a NaN in Q and an inf in K: the rows they reach are NaN, as in onnxruntime."""
    rng = np.random.default_rng(30)
    q, k, v = (rng.uniform(-1, 1, (1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    q[0, 0, 1, 2] = NAN
    k[0, 1, 2, 0] = INF
    feeds = {"Q": q, "K": k, "V": v}
    assert_all_match_ort(graph_model([node("Attention", ["Q", "K", "V"], "y")], feeds, opset=23), feeds, TOL[np.float32])
