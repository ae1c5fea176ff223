"""Folds over a long contiguous run (operators/reduce.py, Fold.lanes: several accumulators over
consecutive elements, merged at the end) against onnxruntime and numpy: every fold, runs with and
without a tail (70 = 4 x 16 + 6, 350, 1,024), runs under outer reduced loops, float, half, int and
bool, NaN in every lane position, in stages at two batch sizes and in `forward`."""
import numpy as np
import pytest
from onnx import helper

from stage_forms import assert_stage_forms
from test_reduce import FLOAT_OPS, _data
from util import assert_matches_ort, graph_model, rand, single_node_model, stage_of

import luisaml
from luisaml.operators import reduce

FOLDS = [op for op in FLOAT_OPS if op != "ReduceLogSumExp"]
# (axes, per-sample shape): the innermost run is 70, 350 (two axes coalesced) or 70 under a loop over axis 1
AXES = [([3], (3, 5, 70)), ([2, 3], (3, 5, 70)), ([1, 3], (3, 5, 70))]


def _model(op, shape, batch="N"):
    nodes, inits = [], {}
    for k, (axes, _) in enumerate(AXES):
        inits[f"axes{k}"] = np.array(axes, np.int64)
        nodes.append(helper.make_node(op, ["x", f"axes{k}"], [f"y{k}"], name=f"{op}_{k}", keepdims=k % 2))
    return graph_model(nodes, {"x": np.zeros((2, *shape), np.float32)}, inits, opset=18, batch=batch)


def test_the_runs_here_take_lanes():
    """The shapes below are long enough for lanes, and the 70-long run has a tail."""
    assert reduce.LANES > 1 and 70 >= reduce.LANES_MIN and 70 % reduce.LANES


@pytest.mark.parametrize("op", FOLDS)
def test_folds_with_lanes_in_stages(op):
    shape = AXES[0][1]
    m = _model(op, shape)
    net = assert_stage_forms(m, lambda n: {"x": _data(op, np.float32, shape=(n, *shape), seed=n)},
                             [f"{op}_{k}" for k in range(len(AXES))], rtol=2e-5, atol=1e-5)
    assert "lane" in net.source


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceSumSquare"])
def test_int_folds_with_lanes(op):
    x = np.random.default_rng(3).integers(-3, 4, (2, 3, 5, 70)).astype(np.int32)
    if op == "ReduceProd":
        x = np.where(x == 0, 1, np.sign(x)).astype(np.int32)
    m = graph_model([helper.make_node(op, ["x", "a"], ["y"], keepdims=0)], {"x": x}, {"a": np.array([2, 3], np.int64)},
                    opset=18)
    assert_matches_ort(m, {"x": x}, batch_axis=None)


def test_half_sum_with_lanes_accumulates_in_float():
    x = rand((2, 4, 1024), np.float16, seed=4)
    m = single_node_model("ReduceSum", {"x": x}, initializers={"a": np.array([2], np.int64)}, keepdims=0, batch="N")
    net = luisaml.compile(m)
    got = net.run({"x": x})["y"]
    assert got.dtype == np.float16 and stage_of(net, "ReduceSum_0").domain == "element"
    np.testing.assert_allclose(got.astype(np.float32), x.astype(np.float64).sum(2).astype(np.float16).astype(np.float32),
                               rtol=2e-3, atol=2e-3)


def test_bool_max_min_with_lanes():
    x = np.zeros((3, 4, 70), np.bool_)
    x[0, 1, 67] = True  # in the tail
    x[1, 2, 5] = True
    x[2] = True
    x[2, 3, 33] = False
    nodes = [helper.make_node("ReduceMax", ["x", "a"], ["any"], keepdims=0),
             helper.make_node("ReduceMin", ["x", "a"], ["all"], keepdims=0)]
    m = graph_model(nodes, {"x": x}, {"a": np.array([2], np.int64)}, opset=20)
    _, got = assert_matches_ort(m, {"x": x}, batch_axis=None)
    np.testing.assert_array_equal(got["any"], x.any(2))
    np.testing.assert_array_equal(got["all"], x.all(2))


@pytest.mark.parametrize("op,ref", [("ReduceMax", np.max), ("ReduceMin", np.min)])
def test_nan_in_any_lane_or_the_tail_gives_nan(op, ref):
    """One NaN per row, at every position of a 16-lane chunk and in the tail: numpy's max/min."""
    x = rand((1, 40, 70), seed=6)
    for r in range(20):
        x[0, r, [r, 16 + r, 64 + r % 6][r % 3]] = np.nan
    m = single_node_model(op, {"x": x}, initializers={"a": np.array([2], np.int64)}, keepdims=0)
    got = luisaml.compile(m, batch_axis=None).run({"x": x})["y"]
    np.testing.assert_array_equal(got, ref(x, axis=2))


def test_pointnet_max_over_points():
    """PointNet's amax(2) over 1,024 points of 64 channels, torch's export, against torch."""
    torch = pytest.importorskip("torch")
    import io

    import onnx

    class Max(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x).amax(2)

    buf = io.BytesIO()
    torch.onnx.export(Max(), (torch.randn(2, 64, 1024),), buf, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}}, dynamo=False)
    net = luisaml.compile(onnx.load_from_string(buf.getvalue()))
    for n in (1, 3):
        x = torch.randn(n, 64, 1024)
        np.testing.assert_array_equal(net.run({"x": x.numpy()})["y"], torch.relu(x).amax(2).numpy())
