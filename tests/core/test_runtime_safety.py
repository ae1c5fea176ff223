"""Run-time safety: out-of-range indices fail the run naming the node, runs from several threads
stay correct, literals and sizes the kernel's 32-bit integers cannot hold are refused before they
reach luisa-python (whose literal conversion and allocations abort the process)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

import luisaml
from tests.util import ort_run, single_node_model


def _gather(op: str, data: np.ndarray, idx: np.ndarray, **attrs):
    return single_node_model(op, {"data": data, "indices": idx}, **attrs)


@pytest.mark.parametrize("op, shape_idx, attrs", [
    ("Gather", (2, 3), {"axis": 1}),
    ("GatherElements", (2, 4, 3), {"axis": 1}),
    ("GatherND", (2, 2, 1), {"batch_dims": 1}),
])
def test_out_of_range_index_fails_the_run(op, shape_idx, attrs):
    data = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
    rng = np.random.default_rng(0)
    good = rng.integers(-5, 5, shape_idx).astype(np.int64)
    model = _gather(op, data, good, **attrs)
    net = luisaml.compile(model, batch_axis=None)
    feeds = {"data": data, "indices": good}
    np.testing.assert_array_equal(net.run(feeds)["y"], ort_run(model, feeds)["y"])
    bad = good.copy()
    bad.flat[-1] = 5
    with pytest.raises(luisaml.RunError, match=rf"node '.*' \({op}\): input 1 'indices' holds an index outside \[-5, 5\)"):
        net.run({"data": data, "indices": bad})
    bad.flat[-1] = -6
    with pytest.raises(luisaml.RunError):
        net.run({"data": data, "indices": bad})
    np.testing.assert_array_equal(net.run(feeds)["y"], ort_run(model, feeds)["y"])  # the flag resets
    quiet = luisaml.compile(model, batch_axis=None, check_indices=False)
    bad.flat[-1] = 5
    quiet.run({"data": data, "indices": bad})  # clamped, no error


@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
def test_out_of_range_scatter_index_fails_the_run(op):
    data = np.zeros((2, 5), np.float32)
    if op == "ScatterElements":
        idx, upd, attrs = np.array([[1, 4], [0, 2]], np.int64), np.ones((2, 2), np.float32), {"axis": 1}
    else:
        idx, upd, attrs = np.array([[1], [4]], np.int64), np.ones((2, 2), np.float32), {}
        data = np.zeros((5, 2), np.float32)
    model = single_node_model(op, {"data": data, "indices": idx, "updates": upd}, **attrs)
    net = luisaml.compile(model, batch_axis=None)
    feeds = {"data": data, "indices": idx, "updates": upd}
    np.testing.assert_array_equal(net.run(feeds)["y"], ort_run(model, feeds)["y"])
    bad = idx.copy()
    bad.flat[-1] = 7
    with pytest.raises(luisaml.RunError, match=op):
        net.run({**feeds, "indices": bad})


def test_threads_share_one_network():
    """Four threads, 40 runs each, different inputs: every result equals numpy's."""
    model = single_node_model("Softmax", {"x": np.zeros((4, 7), np.float32)}, batch="N", axis=-1)
    net = luisaml.compile(model)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for k in range(40):
            x = rng.standard_normal((int(rng.integers(1, 9)), 7)).astype(np.float32)
            y = net.run({"x": x})["y"]
            e = np.exp(x - x.max(-1, keepdims=True))
            if y.shape != x.shape or not np.allclose(y, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6):
                errors.append(f"thread {seed} run {k}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_int64_literal_beyond_int32_is_refused():
    model = single_node_model("Add", {"x": np.zeros((2, 3), np.int64)}, initializers={"c": np.array([2**40])},
                              batch="N")
    with pytest.raises(luisaml.CompileError, match=r"node '.*' \(Add\).*1099511627776 does not fit"):
        luisaml.compile(model)


def test_loop_trip_count_beyond_int32_is_refused():
    body = helper.make_graph(
        [helper.make_node("Add", ["v_in", "one"], ["v_out"]), helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )
    g = helper.make_graph(
        [helper.make_node("Loop", ["M", "cond", "v0"], ["v"], name="loop_big", body=body)], "g",
        [helper.make_tensor_value_info("v0", TensorProto.FLOAT, [1])], [helper.make_tensor_value_info("v", TensorProto.FLOAT, [1])],
        [helper.make_tensor("M", TensorProto.INT64, [], [2**32 + 3]), helper.make_tensor("cond", TensorProto.BOOL, [], [True])],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(luisaml.LuisamlError, match="loop_big"):
        luisaml.compile(model, batch_axis=None)


def test_batch_beyond_32_bit_indexing_is_refused_before_allocating():
    """A bool output of 2**21 per sample at batch 1025 has more than 2**31 elements."""
    model = single_node_model("Not", {"x": np.zeros((1, 2**21), np.bool_)}, batch="N")
    net = luisaml.compile(model)
    with pytest.raises(luisaml.LimitError, match=r"'x' at batch 1025 has 2,149,580,800 elements"):
        net.run({"x": np.broadcast_to(np.zeros((1, 2**21), np.bool_), (1025, 2**21))})
