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


def _relu_model(outputs=("y",)):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["N", 4]) for o in outputs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("shapes, found", [
    ({"x": 3}, r"got input_shapes\['x'\] = 3 \(int\)"),
    ([3, 4], r"got list \[3, 4\]"),
    ({"x": "3x4"}, r"got input_shapes\['x'\] = '3x4' \(str\)"),
    ({"x": [3, 4.5]}, r"got input_shapes\['x'\] = \[3, 4.5\], whose dim 4.5 is a float"),
    ({0: [3, 4]}, r"got the key 0 \(int\)"),
])
def test_input_shapes_of_the_wrong_form_is_a_usage_error(shapes, found):
    """issue 25: input_shapes={"x": 3} or [3, 4] raised a raw TypeError/AttributeError; a UsageError now says
    what input_shapes must be and what it got. The right form still fixes the shape (onnxruntime's answer)."""
    from luisaml.errors import UsageError

    with pytest.raises(UsageError, match=r"input_shapes must be \{input name: \[dim, \.\.\.\]\} with each dim an int, "
                                         r"a name or None.*; " + found):
        luisaml.compile(_relu_model(), input_shapes=shapes)
    x = np.array([[-1, 2, -3, 4]] * 3, np.float32)
    net = luisaml.compile(_relu_model(), input_shapes={"x": (3, np.int64(4))}, batch_axis=None)
    np.testing.assert_array_equal(net.run({"x": x})["y"], ort_run(_relu_model(), {"x": x})["y"])


def test_feeds_numpy_cannot_read_are_input_errors_naming_the_input():
    """issue 25: a ragged list feed surfaced numpy's ValueError without the input's name, a bfloat16 torch
    tensor torch's TypeError; an object array is refused by dtype. Each is an InputError naming the input."""
    import torch

    from luisaml.errors import InputError, InputTypeError

    net = luisaml.compile(_relu_model())
    with pytest.raises(InputError, match=r"input 'x': a nested list whose rows differ in length \(ragged\)"):
        net.run({"x": [[1, 2, 3, 4], [1, 2]]})
    with pytest.raises(InputTypeError, match=r"input 'x': expected dtype float32, got object"):
        net.run({"x": np.array([[1, 2, 3, 4]], dtype=object)})
    with pytest.raises(InputTypeError, match=r"input 'x': torch dtype bfloat16 has no numpy type"):
        net.run({"x": torch.ones(2, 4, dtype=torch.bfloat16)})
    x = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    np.testing.assert_array_equal(net.run({"x": x})["y"], ort_run(_relu_model(), {"x": x})["y"])


def test_a_graph_output_listed_twice_runs_as_onnxruntime():
    """issue 25 (older cases): an output listed twice gave "dimension 0 of [?0, 4] could not be inferred";
    listed twice with one type it is kept once (outputs are by name) and equals onnxruntime's answer; listed
    with two types it is a ModelError naming it."""
    from luisaml.errors import ModelError

    m = _relu_model(("y", "y"))
    x = np.array([[-1, 2, -3, 4], [5, -6, 7, -8]], np.float32)
    got = luisaml.compile(m).run({"x": x})
    want = ort_run(m, {"x": x})
    assert list(got) == ["y"]
    np.testing.assert_array_equal(got["y"], want["y"])
    m.graph.output[1].type.tensor_type.elem_type = TensorProto.DOUBLE
    with pytest.raises(ModelError, match=r"output 'y' is listed twice with different types \(FLOAT \['N', 4\] and "
                                         r"DOUBLE \['N', 4\]\)"):
        luisaml.compile(m)


@pytest.mark.parametrize("b2", [np.array([1, -2, 3.5, 4], np.float32), np.full(4, 0.5, np.float32)])
def test_an_initializer_that_is_an_output_and_read_by_a_node_runs_as_onnxruntime(b2):
    """issue 25: a valid model whose output is an initializer another node also reads failed with "internal
    error: tensor 'b2' has no storage"; the constant keeps its storage for its readers (in the blob, or a
    literal when all its values are one) and is returned as it is."""
    from onnx import numpy_helper

    g = helper.make_graph([helper.make_node("Add", ["x", "b2"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
                           helper.make_tensor_value_info("b2", TensorProto.FLOAT, [4])],
                          [numpy_helper.from_array(b2, "b2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    x = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    got = luisaml.compile(m).run({"x": x})
    want = ort_run(m, {"x": x})
    for name in ("y", "b2"):
        np.testing.assert_array_equal(got[name], want[name])
