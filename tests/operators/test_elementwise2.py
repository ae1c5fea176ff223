"""The second round of elementwise operators against onnxruntime (and numpy where onnxruntime has
no kernel): trigonometry, activations, float Mod, Round, Sign, PRelu, IsNaN/IsInf, bitwise ops."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, ort_run, per_shape_model, rand

import luisaml

SHAPES = [(7,), (3, 4), (2, 3, 5)]


def _in(low, high):
    return lambda s, seed=0: rand(s, seed=seed, low=low, high=high)


# (op, attrs, input maker, opset)
UNARY = [
    ("Tan", {}, _in(-1.4, 1.4), 18),
    ("Asin", {}, _in(-0.99, 0.99), 18),
    ("Acos", {}, _in(-0.99, 0.99), 18),
    ("Atan", {}, _in(-5, 5), 18),
    ("Sinh", {}, _in(-4, 4), 18),
    ("Cosh", {}, _in(-4, 4), 18),
    ("Asinh", {}, _in(-5, 5), 18),
    ("Acosh", {}, _in(1.01, 6), 18),
    ("Atanh", {}, _in(-0.95, 0.95), 18),
    ("Softsign", {}, _in(-5, 5), 18),
    ("Mish", {}, _in(-30, 30), 18),
    ("HardSwish", {}, _in(-5, 5), 18),
    ("Celu", {"alpha": 0.7}, _in(-3, 3), 18),
    ("ThresholdedRelu", {"alpha": 0.4}, _in(-2, 2), 18),
    ("Shrink", {"lambd": 0.6, "bias": 0.25}, _in(-2, 2), 18),
    ("Shrink", {}, _in(-2, 2), 18),
    ("Sign", {}, _in(-2, 2), 18),
]


@pytest.mark.parametrize("op,attrs,make,opset", UNARY, ids=[f"{o}{len(a)}" for o, a, _, _ in UNARY])
def test_unary_float(op, attrs, make, opset):
    arrays = [{"x": make(s, seed=k)} for k, s in enumerate(SHAPES)]
    model, feeds = per_shape_model(op, arrays, opset=opset, **attrs)
    assert_matches_ort(model, feeds, batch_axis=None)


@pytest.mark.parametrize("op", ["HardSwish", "Sign", "Softsign", "Round"])
def test_unary_half(op):
    arrays = [{"x": rand(s, np.float16, seed=k, low=-4, high=4)} for k, s in enumerate(SHAPES[1:])]
    if op == "Round":
        arrays[0]["x"].reshape(-1)[:4] = [0.5, 1.5, -2.5, 2.5]
    model, feeds = per_shape_model(op, arrays)
    assert_matches_ort(model, feeds, batch_axis=None, rtol=1e-3, atol=1e-4)


def test_round_half_to_even():
    x = rand((4, 10), seed=3, low=-6, high=6)
    x[0] = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49999, 4.500001, -0.0, 0.0]
    x[1, :6] = [np.inf, -np.inf, np.nan, 2.0**23 + 1, 8388607.5, -8388607.5]
    x[2] = np.round(x[2]) + 0.5  # every one a half
    model, feeds = per_shape_model("Round", [{"x": x}])
    assert_matches_ort(model, feeds, batch_axis=None, rtol=0, atol=0)


def test_round_keeps_the_sign_of_a_zero():
    """-0.45 and -0.5 round to -0.0 (numpy's rint, onnxruntime): 1 / Round(x) is -inf, not inf (fuzz
    graph 20:89); allclose alone cannot tell the zeros apart."""
    x = np.array([[-0.45, -0.5, -0.0, 0.45, 0.5, 0.0, -1.5, -2.5]], np.float32)
    model, feeds = per_shape_model("Round", [{"x": x}])
    got = luisaml.compile(model, batch_axis=None).run(feeds)
    want = ort_run(model, feeds)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w)
        np.testing.assert_array_equal(np.signbit(got[name]), np.signbit(np.rint(feeds[next(iter(feeds))])))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sign_int(dtype):
    arrays = [{"x": rand(s, dtype, seed=k, low=-3, high=3)} for k, s in enumerate(SHAPES)]
    model, feeds = per_shape_model("Sign", arrays)
    assert_matches_ort(model, feeds, batch_axis=None)


def test_swish_against_numpy():
    """Swish (opset 24) has no onnxruntime kernel: x * sigmoid(alpha x) in float64."""
    x = rand((3, 7), seed=2, low=-30, high=30)
    model, feeds = per_shape_model("Swish", [{"x": x}], opset=24, alpha=0.75)
    got = luisaml.compile(model, batch_axis=None).run(feeds)["out0"]
    want = x.astype(np.float64) / (1 + np.exp(-0.75 * x.astype(np.float64)))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


PAIRS = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 5)), ((1,), (2, 3))]


def _nonzero(shape, dtype, seed):
    v = rand(shape, dtype, seed=seed, low=0.5, high=9)
    sign = np.where(rand(shape, np.float32, seed=seed + 100) > 0, 1, -1)
    return (np.abs(v) * sign).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_mod_float_fmod(dtype):
    arrays = [{"a": rand(sa, dtype, seed=k, low=-40, high=40), "b": _nonzero(sb, dtype, 10 + k)}
              for k, (sa, sb) in enumerate(PAIRS)]
    # exactness where a naive a - trunc(a / b) * b is not: large quotients, tiny divisors (normal
    # numbers: the CPU backend flushes subnormals to zero)
    if dtype == np.float32:
        a, b = [1e30, -3e25, 7.0, 1e-30, 123456.7], [3.3, 1.1e-3, 3.7e-36, 3e-31, -0.1]
    else:
        a, b = [60000, -3000, 7, 1e-3, 1234.5], [3.3, 1.1e-3, 1e-4, 3e-4, -0.1]
    arrays.append({"a": np.array(a, dtype), "b": np.array(b, dtype)})
    model, feeds = per_shape_model("Mod", arrays, fmod=1)
    assert_matches_ort(model, feeds, batch_axis=None, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_mod_float_python_style(dtype):
    """fmod=0 on floats (opset 28 allows it; onnxruntime does not run it): numpy's np.mod."""
    a = np.concatenate([rand((40,), dtype, seed=1, low=-40, high=40), np.array([0.0, -0.0, 0.0, -0.0, -3, 3, -1, 1, np.inf, -np.inf, 1, 1, np.nan, 1], dtype)])
    b = np.concatenate([_nonzero((40,), dtype, 2), np.array([-2.0, 2, 2, -2, np.inf, np.inf, -np.inf, -np.inf, 2, 2, 0, -0.0, 2, np.nan], dtype)])
    model, feeds = per_shape_model("Mod", [{"a": a, "b": b}], opset=13, fmod=0)
    got = luisaml.compile(model, batch_axis=None).run(feeds)["out0"]
    with np.errstate(all="ignore"):
        want = np.mod(a, b)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got[40:44]), np.signbit(want[40:44]))


def test_prelu():
    arrays = [
        {"x": rand((3, 4), seed=1), "s": rand((3, 4), seed=2)},
        {"x": rand((2, 3, 4), seed=3), "s": rand((4,), seed=4)},
        {"x": rand((2, 3, 2, 2), seed=5), "s": rand((3, 1, 1), seed=6)},
    ]
    model, feeds = per_shape_model("PRelu", arrays)
    assert_matches_ort(model, feeds, batch_axis=None)
    arrays = [{"x": rand((2, 5), np.int32, seed=7, low=-9, high=9), "s": rand((5,), np.int32, seed=8, low=-3, high=3)}]
    model, feeds = per_shape_model("PRelu", arrays)
    assert_matches_ort(model, feeds, batch_axis=None)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_isnan_isinf(dtype):
    x = rand((4, 5), dtype, seed=1)
    x.reshape(-1)[[0, 3, 7, 11, 12]] = [np.nan, np.inf, -np.inf, np.nan, -np.inf]
    nodes = [
        helper.make_node("IsNaN", ["x"], ["nan"]),
        helper.make_node("IsInf", ["x"], ["inf"]),
        helper.make_node("IsInf", ["x"], ["neg"], detect_positive=0),
        helper.make_node("IsInf", ["x"], ["pos"], detect_negative=0),
    ]
    assert_matches_ort(graph_model(nodes, {"x": x}, opset=20), {"x": x}, batch_axis=None)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32])
def test_bitwise(dtype):
    if dtype == np.uint32:
        a = np.random.default_rng(1).integers(0, 2**32, (3, 4), dtype=np.uint32)
        b = np.random.default_rng(2).integers(0, 2**32, (4,), dtype=np.uint32)
    else:
        a = rand((3, 4), dtype, seed=1, low=-2**30, high=2**30)
        b = rand((4,), dtype, seed=2, low=-2**30, high=2**30)
    nodes = [helper.make_node(op, ["a", "b"], [op]) for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor")]
    nodes.append(helper.make_node("BitwiseNot", ["a"], ["not"]))
    feeds = {"a": a, "b": b}
    if dtype == np.uint32:
        from onnx import TensorProto

        model = graph_model(nodes, {}, opset=18)
        model.graph.input.extend([helper.make_tensor_value_info("a", TensorProto.UINT32, [3, 4]),
                                  helper.make_tensor_value_info("b", TensorProto.UINT32, [4])])
        model = __import__("onnx").shape_inference.infer_shapes(model)
    else:
        model = graph_model(nodes, feeds, opset=18)
    assert_matches_ort(model, feeds, batch_axis=None)


def test_bitshift_unsigned():
    from onnx import TensorProto

    x = np.random.default_rng(3).integers(0, 2**32, (3, 5), dtype=np.uint32)
    y = np.random.default_rng(4).integers(0, 32, (5,), dtype=np.uint32)
    nodes = [helper.make_node("BitShift", ["x", "y"], [d.lower()], direction=d) for d in ("LEFT", "RIGHT")]
    model = graph_model(nodes, {}, opset=18)
    model.graph.input.extend([helper.make_tensor_value_info("x", TensorProto.UINT32, [3, 5]),
                              helper.make_tensor_value_info("y", TensorProto.UINT32, [5])])
    model = __import__("onnx").shape_inference.infer_shapes(model)
    assert_matches_ort(model, {"x": x, "y": y}, batch_axis=None)


def test_bitshift_signed_against_numpy():
    """Signed BitShift is opset 28 (no onnxruntime kernel): numpy's shifts, with shifts outside
    [0, width) leaving the sign fill as the spec says."""
    x = np.array([[16, -8, 1, -1, 1 << 30, -(1 << 30), 5, -2147483648]], np.int32)
    y = np.array([[1, 1, 31, 3, 1, 1, 32, 1]], np.int32)
    y2 = np.array([[0, 40, -1, 100, 2, 31, -5, 31]], np.int32)
    nodes = [helper.make_node("BitShift", ["x", yy], [f"{d.lower()}{k}"], direction=d)
             for d in ("LEFT", "RIGHT") for k, yy in enumerate(("y", "y2"))]
    feeds = {"x": x, "y": y, "y2": y2}
    net = luisaml.compile(graph_model(nodes, feeds, opset=28), batch_axis=None)
    got = net.run(feeds)

    def shift(x, y, left):
        out = np.zeros_like(x)
        for i, (a, b) in enumerate(zip(x.reshape(-1), y.reshape(-1))):
            if 0 <= b < 32:
                out.reshape(-1)[i] = np.left_shift(a, b) if left else np.right_shift(a, b)
            else:
                out.reshape(-1)[i] = -1 if (not left and a < 0) else 0
        return out

    for k, yy in enumerate((y, y2)):
        np.testing.assert_array_equal(got[f"left{k}"], shift(x, yy, True))
        np.testing.assert_array_equal(got[f"right{k}"], shift(x, yy, False))


def test_bitcast_against_numpy():
    """BitCast (opset 26, no onnxruntime kernel): numpy's view of the same bits."""
    import onnx
    from onnx import TensorProto

    f = np.array([[1.5, -0.0, np.inf, -3.25e-20], [7.0, np.nan, 1e30, -1.0]], np.float32)
    i = np.array([1, -1, 0x7F800000, -2147483648, 123456789], np.int32)
    u = np.array([0, 1, 0x80000000, 0xFFFFFFFF], np.uint32)
    nodes = [helper.make_node("BitCast", ["f"], ["f2i"], to=TensorProto.INT32),
             helper.make_node("BitCast", ["f"], ["f2u"], to=TensorProto.UINT32),
             helper.make_node("BitCast", ["i"], ["i2f"], to=TensorProto.FLOAT),
             helper.make_node("BitCast", ["u"], ["u2i"], to=TensorProto.INT32),
             helper.make_node("BitCast", ["i"], ["i2i"], to=TensorProto.INT32)]
    model = graph_model(nodes, {"f": f, "i": i}, opset=13)
    model.graph.input.append(helper.make_tensor_value_info("u", TensorProto.UINT32, [4]))
    model.opset_import[0].version = 26
    model.ir_version = onnx.IR_VERSION
    model = onnx.shape_inference.infer_shapes(model)
    got = luisaml.compile(model, batch_axis=None).run({"f": f, "i": i, "u": u})
    np.testing.assert_array_equal(got["f2i"], f.view(np.int32))
    np.testing.assert_array_equal(got["f2u"], f.view(np.uint32))
    np.testing.assert_array_equal(got["i2f"].view(np.int32), i)
    np.testing.assert_array_equal(got["u2i"], u.view(np.int32))
    np.testing.assert_array_equal(got["i2i"], i)
