"""ScatterElements, ScatterND and Scatter against onnxruntime: every reduction, duplicate and
negative indices, constant and runtime indices, several dtypes, batch mode."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand

import luisaml

I64 = np.int64


def _unique_along(shape, dim, axis, seed):
    """Indices without duplicates along `axis` (so that 'none' is order-independent), negatives
    included: a permutation of the axis, cut to the index shape."""
    rng = np.random.default_rng(seed)
    full = np.argsort(rng.random(shape[:axis] + (dim,) + shape[axis + 1:]), axis=axis)
    idx = np.take(full, range(shape[axis]), axis=axis)
    return np.where(rng.random(idx.shape) > 0.5, idx - dim, idx).astype(I64)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements(reduction):
    x = rand((4, 5, 3), seed=1)
    feeds, nodes = {"x": x}, []
    for k, (axis, shape) in enumerate([(0, (2, 5, 3)), (1, (4, 3, 2)), (-1, (3, 2, 3))]):
        if reduction == "none":
            feeds[f"i{k}"] = _unique_along(shape, x.shape[axis], axis % 3, seed=k)
        else:  # duplicates accumulate
            feeds[f"i{k}"] = np.random.default_rng(k).integers(-x.shape[axis], x.shape[axis], shape).astype(I64)
        feeds[f"u{k}"] = rand(shape, seed=10 + k)
        nodes.append(helper.make_node("ScatterElements", ["x", f"i{k}", f"u{k}"], [f"y{k}"], axis=axis, reduction=reduction))
    assert_matches_ort(graph_model(nodes, feeds, opset=18), feeds, batch_axis=None, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_nd(reduction):
    x = rand((4, 5, 3), seed=2)
    feeds, nodes = {"x": x}, []
    for k, tuples in enumerate([[[1], [3]], [[0, 2], [3, -1], [1, 4]], [[2, 1, 0], [-1, -1, -1]], [[3, 1], [0, 0]]]):
        idx = np.array(tuples, I64)
        if reduction != "none" and k == 1:
            idx = np.array([[0, 2], [0, 2], [1, 4]], I64)  # a duplicate tuple accumulates
        feeds[f"i{k}"] = idx
        feeds[f"u{k}"] = rand(idx.shape[:-1] + x.shape[idx.shape[-1]:], seed=20 + k)
        nodes.append(helper.make_node("ScatterND", ["x", f"i{k}", f"u{k}"], [f"y{k}"], reduction=reduction))
    assert_matches_ort(graph_model(nodes, feeds, opset=18), feeds, batch_axis=None, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float16, np.bool_])
def test_scatter_dtypes_and_constant_indices(dtype):
    x = rand((3, 4), dtype, seed=3, low=-9, high=9)
    u = rand((2, 4), dtype, seed=4, low=-9, high=9)
    inits = {"ci": _unique_along((2, 4), 3, 0, seed=5), "nd": np.array([[2], [0]], I64)}
    red = "none" if dtype in (np.bool_, np.float16) else "add"  # onnxruntime: no float16 reductions
    nodes = [helper.make_node("ScatterElements", ["x", "ci", "u"], ["e"], axis=0),
             helper.make_node("ScatterElements", ["x", "ci", "u"], ["r"], axis=0, reduction=red),
             helper.make_node("ScatterND", ["x", "nd", "u"], ["n"])]
    feeds = {"x": x, "u": u}
    assert_matches_ort(graph_model(nodes, feeds, inits, opset=18), feeds, batch_axis=None, rtol=1e-3, atol=1e-2)


def test_scatter_opset_9_and_11():
    x, u = rand((3, 4), seed=6), rand((1, 4), seed=7)
    i = np.array([[2, 0, 1, -1]], I64)
    feeds = {"x": x, "i": i, "u": u}
    for opset, op in ((9, "Scatter"), (11, "ScatterElements")):
        assert_matches_ort(graph_model([helper.make_node(op, ["x", "i", "u"], ["y"], axis=0)], feeds, opset=opset), feeds,
                           batch_axis=None)


def test_scatter_batch_mode():
    x, u = rand((3, 4, 5), seed=8), rand((3, 4, 2), seed=9)
    i = _unique_along((3, 4, 2), 5, 2, seed=10)
    feeds = {"x": x, "i": i, "u": u}
    model = graph_model([helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=2)], feeds, opset=18, batch="N")
    net, _ = assert_matches_ort(model, feeds, batch_axis=0)
    assert net.batch_symbol == "N"
    # scattered along the batch axis: samples mix, so the network compiles per batch size
    model = graph_model([helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=0, name="across")], feeds,
                        opset=18, batch="N")
    i0 = _unique_along((3, 4, 2), 3, 0, seed=11)
    net, _ = assert_matches_ort(model, {"x": x, "i": i0, "u": u}, batch_axis=0)
    with pytest.raises(luisaml.UsageError, match="'across'.*batch axis"):
        net.forward
