"""Range, EyeLike and OneHot against onnxruntime."""
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from util import assert_matches_ort, graph_model, rand  # noqa: E402

import luisaml  # noqa: E402

I64 = np.int64


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_range(dtype):
    """Constant limits give the length; start and delta come from the graph's inputs at run time
    in the second node (an Add keeps the node from being folded)."""
    cases = [(0, 10, 3), (5, -7, -2), (1.5, 4.25, 0.25), (3, 3, 1), (-2, 9, 4)]
    nodes, inits, feeds = [], {}, {"z": np.zeros((), dtype)}
    for k, (s, l, d) in enumerate(cases):
        if np.dtype(dtype).kind == "i" and any(float(v) != int(v) for v in (s, l, d)):
            continue
        for name, v in (("s", s), ("l", l), ("d", d)):
            inits[f"{name}{k}"] = np.array(v, dtype)
        nodes.append(helper.make_node("Add", [f"s{k}", "z"], [f"sz{k}"]))
        nodes.append(helper.make_node("Range", [f"sz{k}", f"l{k}", f"d{k}"], [f"y{k}"]))
    model = graph_model(nodes, feeds, inits, opset=11)
    # the folder needs the start to be constant for the length: give the Range its length from the
    # constant inputs, as the node would have after folding, and keep the runtime start
    for out in model.graph.output:
        k = int(out.name[1:])
        s, l, d = cases[k]
        n = max(int(np.ceil((l - s) / d)), 0)
        del out.type.tensor_type.shape.dim[:]
        out.type.tensor_type.shape.dim.add().dim_value = n
    assert_matches_ort(model, feeds, batch_axis=None, rtol=1e-6, atol=1e-6)


def test_range_half_against_numpy():
    """float16 Range is opset 27 (no onnxruntime kernel): numpy's arange in float64, rounded."""
    import onnx

    inits = {"s": np.array(-1.5, np.float16), "l": np.array(6.0, np.float16), "d": np.array(0.375, np.float16)}
    feeds = {"z": np.zeros((), np.float16)}
    nodes = [helper.make_node("Add", ["s", "z"], ["sz"]), helper.make_node("Range", ["sz", "l", "d"], ["y"])]
    model = graph_model(nodes, feeds, inits, opset=13)
    model.opset_import[0].version = 27
    model.ir_version = onnx.IR_VERSION
    want = np.arange(-1.5, 6.0, 0.375).astype(np.float16)
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = want.size
    got = luisaml.compile(model, batch_axis=None).run(feeds)["y"]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [None, TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL])
def test_eyelike(dtype):
    x, x2 = rand((4, 6), np.int32, seed=1), rand((5, 3), np.float32, seed=2)
    attrs = {} if dtype is None else {"dtype": dtype}
    nodes = [helper.make_node("EyeLike", ["x"], [f"k{k}".replace("-", "m")], k=k, **attrs) for k in (-5, -1, 0, 2, 9)]
    nodes.append(helper.make_node("EyeLike", ["x2"], ["t"], k=-2, **attrs))
    feeds = {"x": x, "x2": x2}
    if dtype == TensorProto.BOOL:  # onnxruntime has no bool EyeLike: numpy
        got = luisaml.compile(graph_model(nodes, feeds, opset=9), batch_axis=None).run(feeds)
        for k in (-5, -1, 0, 2, 9):
            np.testing.assert_array_equal(got[f"k{k}".replace("-", "m")], np.eye(4, 6, k, dtype=bool))
        return
    assert_matches_ort(graph_model(nodes, feeds, opset=9), feeds, batch_axis=None)


def test_onehot():
    idx = np.array([[0, 3, -1], [9, -10, 2]], I64)  # 9 and -10 are out of range: rows of `off`
    fidx = np.array([1.7, -2.2, 4.0], np.float32)
    feeds = {"i": idx, "f": fidx, "v": np.array([-1.5, 2.5], np.float32)}
    inits = {"depth": np.array(5, I64), "vi": np.array([0, 7], np.int32)}
    nodes = [helper.make_node("OneHot", ["i", "depth", "v"], [f"a{a}".replace("-", "m")], axis=a) for a in (-1, 0, 1, 2, -3)]
    assert_matches_ort(graph_model(nodes, {"i": idx, "v": feeds["v"]}, inits, opset=11), {"i": idx, "v": feeds["v"]},
                       batch_axis=None)
    # float indices (truncated) with int32 values: no onnxruntime kernel for the combination
    model = graph_model([helper.make_node("OneHot", ["f", "depth", "vi"], ["fi"])], {"f": fidx}, inits, opset=11)
    got = luisaml.compile(model, batch_axis=None).run({"f": fidx})["fi"]
    want = np.zeros((3, 5), np.int32)
    want[np.arange(3), fidx.astype(np.int64) % 5] = 7
    np.testing.assert_array_equal(got, want)


def test_onehot_batch_mode():
    idx = np.array([[0, 3, 1], [2, 4, 4]], I64)
    feeds = {"i": idx}
    inits = {"depth": np.array(5, I64), "v": np.array([0, 1], np.float32)}
    model = graph_model([helper.make_node("OneHot", ["i", "depth", "v"], ["y"], axis=1)], feeds, inits, opset=11, batch="N")
    assert_matches_ort(model, feeds, batch_axis=0)
