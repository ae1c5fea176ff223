"""The normalizations' statistics in lanes on the CPU backend (operators/normalization.py,
`lanes_pass`: a contiguous group of LANES_MIN_NORM or more elements summed in reduce.LANES partial
sums, merged at the end) against onnxruntime and numpy: LayerNormalization over rows with and
without a tail (192 = 12 x 16, 100 = 6 x 16 + 4) and with its Mean and InvStdDev outputs,
GroupNormalization and InstanceNormalization over channels' planes, a group too short for lanes,
rows of equal values (exactly the bias), half; the CUDA plan keeps one sum."""
import re

import numpy as np
import pytest
from onnx import TensorProto, helper

from util import assert_matches_ort, graph_model, rand

import luisaml
from luisaml.operators import normalization, reduce
from luisaml.runtime import analyze

F32 = {"rtol": 2e-5, "atol": 2e-5}


def _lanes(source: str) -> int:
    """The loops over chunks of LANES elements (reduce.fold_lanes) in a generated module."""
    return len(re.findall(r"for q\d+ in range", source))


def _ln(name, ins, outs=None, **attrs):
    return helper.make_node("LayerNormalization", ins, outs or [name], name=name, **attrs)


def test_the_groups_here_take_lanes():
    """192 and 100 are long enough for lanes (100 with a tail), 20 is not."""
    assert 100 >= normalization.LANES_MIN_NORM and 100 % reduce.LANES and 20 < normalization.LANES_MIN_NORM


@pytest.mark.parametrize("d", [192, 100, 20])
def test_layer_normalization_rows(d):
    """[batch, 7, d] over the last axis (ViT's and BERT's), Mean and InvStdDev too; a mean far
    from 0 (the x0 shift keeps its digits)."""
    x = rand((3, 7, d), seed=1) + 40.0
    inits = {"s": rand((d,), seed=2), "b": rand((d,), seed=3)}
    nodes = [_ln("ln", ["x", "s", "b"], ["ln", "mean", "inv"], axis=-1, epsilon=1e-5)]
    model = graph_model(nodes, {"x": x}, inits, opset=17, batch="N")
    net, _ = assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4)
    assert (_lanes(net.source) > 0) == (d >= normalization.LANES_MIN_NORM)


def test_layer_normalization_over_two_axes():
    """axis = 1 of [batch, 6, 35]: one contiguous group of 210 (merged axes), Scale [6, 35]."""
    x = rand((2, 6, 35), seed=4)
    inits = {"s": rand((6, 35), seed=5), "b": rand((35,), seed=6)}
    model = graph_model([_ln("ln", ["x", "s", "b"], axis=1)], {"x": x}, inits, opset=17, batch="N")
    net, _ = assert_matches_ort(model, {"x": x}, **F32)
    assert _lanes(net.source) > 0


def test_group_and_instance_normalization():
    """GroupNormalization (4 groups of 2 channels of 5 x 7: groups of 70) and InstanceNormalization
    (planes of 35), opset 18 as the exporter writes them."""
    x = rand((2, 8, 5, 7), seed=7)
    inits = {"gs": rand((4,), seed=8), "gb": rand((4,), seed=9), "is": rand((8,), seed=10), "ib": rand((8,), seed=11)}
    nodes = [helper.make_node("GroupNormalization", ["x", "gs", "gb"], ["g"], name="gn", num_groups=4, epsilon=1e-5),
             helper.make_node("InstanceNormalization", ["x", "is", "ib"], ["i"], name="in", epsilon=1e-5)]
    model = graph_model(nodes, {"x": x}, inits, opset=18, batch="N")
    for out in model.graph.output:  # (onnx leaves GroupNormalization's output untyped)
        out.type.tensor_type.elem_type = TensorProto.FLOAT
    net, _ = assert_matches_ort(model, {"x": x}, **F32)
    assert _lanes(net.source) >= 4


def test_equal_rows_are_the_bias_and_against_float64():
    """Rows of 48 equal values (a different value each row) give exactly the bias; random rows of
    100 against numpy in float64."""
    rng = np.random.default_rng(3)
    x = np.repeat(rng.uniform(-300, 300, (5, 1)), 48, axis=1).astype(np.float32)
    x[0] = 245.24873
    s, b = rand((48,), seed=8), rand((48,), seed=9)
    model = graph_model([_ln("ln", ["x", "s", "b"])], {"x": x}, {"s": s, "b": b}, opset=17)
    got = luisaml.compile(model, batch_axis=None).run({"x": x})["ln"]
    np.testing.assert_array_equal(got, np.broadcast_to(b, (5, 48)))
    x = rng.normal(3.0, 2.0, (4, 100)).astype(np.float32)
    s, b = rand((100,), seed=10), rand((100,), seed=11)
    model = graph_model([_ln("ln", ["x", "s", "b"])], {"x": x}, {"s": s, "b": b}, opset=17)
    got = luisaml.compile(model, batch_axis=None).run({"x": x})["ln"]
    x64 = x.astype(np.float64)
    mean, var = x64.mean(axis=1, keepdims=True), x64.var(axis=1, keepdims=True)
    np.testing.assert_allclose(got, (x64 - mean) / np.sqrt(var + 1e-5) * s + b, rtol=1e-5, atol=1e-5)


def test_half_rows():
    """float16 rows of 64 (statistics in float) against numpy in float64 (this onnxruntime has no
    float16 LayerNormalization)."""
    x = rand((3, 64), seed=12).astype(np.float16)
    s, b = rand((64,), seed=13).astype(np.float16), rand((64,), seed=14).astype(np.float16)
    model = graph_model([_ln("ln", ["x", "s", "b"])], {"x": x}, {"s": s, "b": b}, opset=17)
    got = luisaml.compile(model, batch_axis=None).run({"x": x})["ln"]
    x64 = x.astype(np.float64)
    mean, var = x64.mean(axis=1, keepdims=True), x64.var(axis=1, keepdims=True)
    want = (x64 - mean) / np.sqrt(var + 1e-5) * s.astype(np.float64) + b.astype(np.float64)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=4e-3, atol=4e-3)


def test_cuda_plan_keeps_one_sum():
    """Planned for CUDA (no device), a short LayerNormalization (items form: rows of 8 are under a
    warp's minimum) and a long one (a warp per row) have no lanes."""
    for d in (8, 192):
        x = rand((2, 4, d), seed=15)
        model = graph_model([_ln("ln", ["x", "s", "b"])], {"x": x}, {"s": rand((d,)), "b": rand((d,))}, opset=17, batch="N")
        assert _lanes(analyze(model, target="cuda").source) == 0
        assert (_lanes(analyze(model, target="cpu").source) > 0) == (d >= normalization.LANES_MIN_NORM)
