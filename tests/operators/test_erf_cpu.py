"""The CPU backend's erf: math_lib.erf_vec_f32 (branch-free, so that a GELU epilogue vectorises),
which the Erf and Gelu operators take there (operators/elementwise.py, erf_helper), against the C
library's float64 erf (math.erf) and onnxruntime, specials included; dsl_lib.erf_f32 stays CUDA's."""
import math
import re

import numpy as np
import pytest
from onnx import helper
from util import graph_model, ort_run, single_node_model, switched

import luisaml
from luisaml.planning import CompileOptions, plan_for

SPECIALS = np.float32([0.0, -0.0, 1e-20, -1e-30, 1e-37, 0.84375, -0.84375, 1.25, -1.25, 4.0, -4.0, 3.9999998,
                       10.0, -10.0, 1e30, -3.4e38, np.inf, -np.inf, np.nan, -np.nan])


def ulp_errors(got: np.ndarray, x: np.ndarray) -> np.ndarray:
    want = np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64))
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want.astype(np.float32)))


def test_erf_vec_accuracy():
    """Within 1 float32 ulp of math.erf on a dense grid of [-6, 6], a logarithmic one of (0, 10] and the
    pieces' edges (0.92 measured, as dsl_lib.erf_f32's); the sign of zero and NaN kept, +-1 at +-inf."""
    edges = np.float32([0.84375, 1.25, 4.0])
    near = np.concatenate([np.nextafter(edges, np.float32(0)), edges, np.nextafter(edges, np.float32(9))])
    x = np.concatenate([np.linspace(-6, 6, 300_001, dtype=np.float32), np.float32(10) ** np.linspace(-30, 1, 20_001,
                        dtype=np.float32), near, -near, SPECIALS])
    net = luisaml.compile(single_node_model("Erf", {"x": x}), batch_axis=None)
    assert "erf_vec_f32(" in net.plan.source and "erf_f32(" not in net.plan.source
    got = net.run({"x": x})["y"]
    finite = ~np.isnan(x)
    ulp = ulp_errors(got[finite], x[finite])
    assert ulp.max() <= 1.0, f"max error {ulp.max():.2f} ulp at x={x[finite][ulp.argmax()]}"
    assert np.isnan(got[~finite]).all()
    assert np.signbit(got[x == 0]).tolist() == np.signbit(x[x == 0]).tolist()
    assert got[x == np.inf].tolist() == [1.0] and got[x == -np.inf].tolist() == [-1.0]


def wide(n: int, seed: int = 0) -> np.ndarray:
    """n values over a wide range (|x| up to 1e4, logarithmically), then SPECIALS."""
    rng = np.random.default_rng(seed)
    v = rng.choice([-1, 1], n) * 10.0 ** rng.uniform(-8, 4, n)
    return np.concatenate([v.astype(np.float32), rng.uniform(-5, 5, n).astype(np.float32), SPECIALS])


def assert_close(got, want, rtol, atol):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


# GELU's absolute tolerance: below zero 1 + erf(x / sqrt 2) cancels, its error an ulp of 1 (6e-8)
# times x / 2, |x| up to about 5.6 before the result is 0
@pytest.mark.parametrize("op,opset,atol", [("Erf", 18, 1e-7), ("Gelu", 20, 4e-7)])
def test_erf_gelu_against_ort(op, opset, atol):
    x = wide(20_000)
    model = single_node_model(op, {"x": x}, opset=opset)
    net = luisaml.compile(model, batch_axis=None)
    assert "erf_vec_f32(" in net.plan.source
    assert_close(net.run({"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-6, atol=atol)


def gelu_mlp(x: np.ndarray, n: int = 48, seed: int = 1):
    """MatMul + bias, then GELU as torch exports nn.GELU: Div, Erf, Add, Mul, Mul (the zoo's MLPs)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((x.shape[-1], n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["h"]),
             helper.make_node("Div", ["h", "r2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["p"]),
             helper.make_node("Mul", ["p", "half"], ["y"])]
    return graph_model(nodes, {"x": x}, {"w": w, "b": b, "r2": np.float32(math.sqrt(2)), "one": np.float32(1),
                                         "half": np.float32(0.5)})


def test_gelu_epilogue_against_ort():
    """The GELU after a MatMul (its epilogue on the CPU): inputs scaled so the pre-activations span
    about +-60, plus rows of infinities and NaN."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((37, 64)) * 2).astype(np.float32)
    x[5, 3], x[9, :] = np.nan, np.inf
    model = gelu_mlp(x)
    net = luisaml.compile(model, batch_axis=None)
    assert "erf_vec_f32(" in net.plan.source
    got, want = net.run({"x": x})["y"], ort_run(model, {"x": x})["y"]
    scale = np.abs(want[np.isfinite(want)]).max()
    assert_close(got, want, rtol=2e-6, atol=1e-6 * scale)


def test_cuda_source_keeps_erf_f32():
    """CUDA's plan keeps dsl_lib.erf_f32 (its generated source is byte-identical to before erf_vec_f32)."""
    x = np.zeros((4, 64), np.float32)
    for model in (single_node_model("Erf", {"x": x}), single_node_model("Gelu", {"x": x}, opset=20), gelu_mlp(x)):
        source = plan_for(model, "erf", CompileOptions().resolve("cuda"))[0].source
        assert "erf_f32(" in source and "erf_vec_f32" not in source


@pytest.mark.parametrize("n", [48, 45])
def test_gelu_epilogue_loop(n):
    """Dense.epilogue_loop: the GELU epilogue as a loop over the tile's columns, against onnxruntime
    and bit-equal to the straight-line form; n = 45: a ragged last column block (the loop's count
    min(O, N - n0)), a batch of 3 ([3, 37, 64] x [64, n]). A Relu epilogue stays straight-line."""
    from luisaml.operators.gemm import Dense

    x = (np.random.default_rng(4).standard_normal((3, 37, 64)) * 2).astype(np.float32)
    model = gelu_mlp(x, n)
    with switched(Dense, epilogue_loop=False):
        straight = luisaml.compile(model, batch_axis=None)
    assert "for j" not in straight.plan.source
    straight = straight.run({"x": x})["y"]
    net = luisaml.compile(model, batch_axis=None)
    assert "for j" in net.plan.source
    relu = gelu_mlp(x, n)
    relu.graph.node[3].op_type = "Relu"
    assert "for j" not in luisaml.compile(relu, batch_axis=None).plan.source
    # past N a write would land in the next row (rewritten after it, or not) or past the output
    assert bool(re.search(rf"range\(min\(\d+, {n} - n", net.plan.source)) == (n == 45)
    got = net.run({"x": x})["y"]
    np.testing.assert_array_equal(got, straight)
    want = ort_run(model, {"x": x})["y"]
    assert_close(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("x_shape,w_shape,strides", [((2, 24, 41), (17, 24, 3), [2]), ((1, 8, 9, 7), (32, 8, 3, 3), [1, 1])])
def test_conv_gelu_epilogue_loop(x_shape, w_shape, strides):
    """Conv.epilogue_loop: a Conv's GELU epilogue as a loop over each position's channels on the CPU
    (common.emit_epilogue_loop, Gemm's and MatMul's loop), against onnxruntime and bit-equal to the
    straight-line form: a 1-D Conv of 17 channels (blocks of 9: the last one ragged, the loop's count
    min(9, 17 - m)) over an odd row (overlapping strips of 2), and a 2-D 3 x 3 over 9 x 7 (an outer
    dimension, strips of 2 overlapping at the row's end)."""
    from luisaml.operators.conv import Conv

    rng = np.random.default_rng(5)
    x = (rng.standard_normal(x_shape) * 2).astype(np.float32)
    w = (rng.standard_normal(w_shape) * 0.3).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    pads = [1] * (2 * len(strides)) if len(strides) == 2 else [0, 0]
    model = gelu_mlp(x, w_shape[0])
    model.graph.node[0].CopyFrom(helper.make_node("Conv", ["x", "w", "b"], ["h"], strides=strides, pads=pads))
    del model.graph.node[1]
    model = graph_model(list(model.graph.node), {"x": x}, {"w": w, "b": b, "r2": np.float32(math.sqrt(2)),
                                                           "one": np.float32(1), "half": np.float32(0.5)})
    with switched(Conv, epilogue_loop=False):
        straight = luisaml.compile(model, batch_axis=None)
    assert "for j" not in straight.plan.source
    net = luisaml.compile(model, batch_axis=None)
    assert "for j" in net.plan.source
    assert bool(re.search(r"range\(min\(9, 17 - m", net.plan.source)) == (w_shape[0] == 17)
    got = net.run({"x": x})["y"]
    np.testing.assert_array_equal(got, straight.run({"x": x})["y"])
    want = ort_run(model, {"x": x})["y"]
    assert_close(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


def test_element_run_with_erf_stores_last():
    """An element stage's run with an Erf (emission._stores_last: its values into a local array, then
    its stores): a per-channel affine (a gathered scale and shift) and torch's GELU over 518 elements
    (a guarded last run), against onnxruntime and bit-equal to the run storing as it goes."""
    from luisaml import emission

    rng = np.random.default_rng(6)
    x = (rng.standard_normal((2, 7, 37)) * 2).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "s"], ["h0"]), helper.make_node("Add", ["h0", "b"], ["h"]),
             helper.make_node("Div", ["h", "r2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["p"]),
             helper.make_node("Mul", ["p", "half"], ["y"])]
    model = graph_model(nodes, {"x": x}, {"s": rng.standard_normal((7, 1)).astype(np.float32),
                                          "b": rng.standard_normal((7, 1)).astype(np.float32),
                                          "r2": np.float32(math.sqrt(2)), "one": np.float32(1), "half": np.float32(0.5)})
    with switched(emission, ELEMENT_STORES_LAST=False):
        plain = luisaml.compile(model, batch_axis=None)
    net = luisaml.compile(model, batch_axis=None)
    run_array = re.compile(r"\br\d+ = Arr_float_16\(\)")
    assert run_array.search(net.plan.source) and not run_array.search(plain.plan.source)
    got = net.run({"x": x})["y"]
    np.testing.assert_array_equal(got, plain.run({"x": x})["y"])
    want = ort_run(model, {"x": x})["y"]
    assert_close(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())
