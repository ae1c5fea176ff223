"""GatherElements, GatherND, Compress and ReverseSequence against onnxruntime: constant and
runtime indices (negative ones wrap), several shapes and dtypes, batch mode."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand

import luisaml

I64 = np.int64


def _indices(shape, dim, seed, negative=True):
    """Random indices into an axis of `dim` elements, negative ones included."""
    v = np.random.default_rng(seed).integers(-dim if negative else 0, dim, size=shape)
    return v.astype(I64)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16, np.bool_])
def test_gather_elements(dtype):
    x = rand((3, 4, 5), dtype, seed=1, low=-9, high=9)
    feeds = {"x": x}
    nodes, inits = [], {}
    for k, (axis, shape) in enumerate([(0, (2, 4, 5)), (1, (3, 6, 2)), (-1, (3, 4, 7)), (2, (1, 1, 1))]):
        feeds[f"i{k}"] = _indices(shape, x.shape[axis], seed=k)  # runtime indices
        nodes.append(helper.make_node("GatherElements", ["x", f"i{k}"], [f"y{k}"], axis=axis))
    inits["c"] = _indices((3, 2, 5), 4, seed=9)  # constant indices
    nodes.append(helper.make_node("GatherElements", ["x", "c"], ["yc"], axis=1))
    assert_matches_ort(graph_model(nodes, feeds, inits, opset=13), feeds, batch_axis=None)


def test_gather_nd():
    x = rand((3, 4, 5), seed=2)
    xi = rand((2, 3, 4), np.int32, seed=3, low=-50, high=50)
    feeds = {"x": x, "xi": xi}
    specs = [  # (data, indices shape, batch_dims)
        ("x", (2, 1), 0), ("x", (2, 2), 0), ("x", (4, 3), 0), ("x", (2, 3, 2), 0),
        ("x", (3, 2), 1), ("x", (3, 2, 1), 1), ("xi", (2, 3, 1), 2), ("xi", (2, 1), 1),
    ]
    nodes = []
    for k, (data, shape, b) in enumerate(specs):
        dims = feeds[data].shape[b: b + shape[-1]]
        feeds[f"i{k}"] = np.stack([_indices(shape[:-1], d, seed=10 * k + j) for j, d in enumerate(dims)], axis=-1)
        nodes.append(helper.make_node("GatherND", [data, f"i{k}"], [f"y{k}"], batch_dims=b))
    assert_matches_ort(graph_model(nodes, feeds, opset=13), feeds, batch_axis=None)


def test_out_of_range_indices():
    """Constant indices out of range are a compile error naming the node; runtime ones fail the
    run naming the node, or with check_indices=False are clamped into the axis."""
    x = rand((3, 4), seed=4)
    bad = np.array([[0, 4, 1, 2]], I64)
    model = graph_model([helper.make_node("GatherElements", ["x", "c"], ["y"], axis=1, name="ge")], {"x": x}, {"c": bad}, opset=13)
    with pytest.raises(luisaml.CompileError, match=r"'ge'.*index 4 at \[0, 1\] is out of range"):
        luisaml.compile(model, batch_axis=None)
    model = graph_model([helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1, name="gr")], {"x": x, "i": bad},
                        opset=13)
    with pytest.raises(luisaml.RunError, match=r"'gr'.*holds an index outside \[-4, 4\)"):
        luisaml.compile(model, batch_axis=None).run({"x": x, "i": bad})
    got = luisaml.compile(model, batch_axis=None, check_indices=False).run({"x": x, "i": bad})["y"]
    np.testing.assert_array_equal(got, np.take_along_axis(x[:1], np.clip(bad, 0, 3), axis=1))


def test_gather_batch_mode():
    x = rand((4, 3, 5), seed=5)
    i = _indices((4, 3, 2), 5, seed=6)
    nodes = [helper.make_node("GatherElements", ["x", "i"], ["y"], axis=2),
             helper.make_node("GatherND", ["x", "j"], ["z"], batch_dims=1)]
    feeds = {"x": x, "i": i, "j": np.stack([_indices((4, 2), 3, 7), _indices((4, 2), 5, 8)], axis=-1)}
    net, _ = assert_matches_ort(graph_model(nodes, feeds, opset=13, batch="N"), feeds, batch_axis=0)
    assert net.batch_symbol == "N"
    # along the batch axis: samples mix, so the network compiles per batch size; no forward
    model = graph_model([helper.make_node("GatherElements", ["x", "i"], ["y"], axis=0, name="across")], {"x": x, "i": i},
                        opset=13, batch="N")
    i0 = _indices((4, 3, 2), 4, seed=9)
    net, _ = assert_matches_ort(model, {"x": x, "i": i0}, batch_axis=0)
    with pytest.raises(luisaml.UsageError, match="'across'.*batch axis"):
        net.forward


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_compress(dtype):
    x = rand((4, 5, 3), dtype, seed=7, low=-9, high=9)
    inits = {"c0": np.array([1, 0, 1, 1], bool), "c1": np.array([0, 1, 1, 0, 1], bool),
             "c2": np.array([0, 0, 1], bool), "cf": np.array([1, 0, 0, 1, 1, 1, 0, 1], bool), "cn": np.zeros(3, bool)}
    nodes = [helper.make_node("Compress", ["x", "c0"], ["a"], axis=0),
             helper.make_node("Compress", ["x", "c1"], ["b"], axis=1),
             helper.make_node("Compress", ["x", "c2"], ["c"], axis=-1),
             helper.make_node("Compress", ["x", "c1"], ["d"], axis=-2),
             helper.make_node("Compress", ["x", "cf"], ["flat"]),
             helper.make_node("Compress", ["x", "cn"], ["none"], axis=2)]
    assert_matches_ort(graph_model(nodes, {"x": x}, inits, opset=11), {"x": x}, batch_axis=None)


def test_reverse_sequence():
    x = rand((5, 3, 2), seed=8)  # time-major
    xb = rand((3, 6), np.int64, seed=9, low=-9, high=9)  # batch-major
    feeds = {"x": x, "xb": xb, "lens": np.array([5, 1, 3], I64)}
    nodes = [helper.make_node("ReverseSequence", ["x", "lens"], ["t"], time_axis=0, batch_axis=1),
             helper.make_node("ReverseSequence", ["xb", "cl"], ["b"], time_axis=1, batch_axis=0)]
    inits = {"cl": np.array([6, 0, 4], I64)}
    assert_matches_ort(graph_model(nodes, feeds, inits, opset=10), feeds, batch_axis=None)
