"""luisaml.onnx_backend on its own (fast): the onnx backend API, input order, models compiled per
input shape, and inputs compiled in as constants when an operator needs their values."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from util import rand, single_node_model, value_info

from luisaml import onnx_backend
from luisaml.onnx_backend import LuisaBackend


def test_supports_cpu_only():
    assert LuisaBackend.supports_device("CPU")
    assert not LuisaBackend.supports_device("CUDA")
    with pytest.raises(RuntimeError, match="CPU only"):
        LuisaBackend.prepare(single_node_model("Relu", {"x": rand((2,))}), "CUDA")


def test_inputs_in_order_initializers_skipped_outputs_in_order():
    """Initializers listed among the graph inputs (old exporters) are not fed; outputs come back
    in graph order."""
    x, y, b = rand((2, 3), seed=1), rand((2, 3), seed=2), rand((3,), seed=3)
    nodes = [helper.make_node("Sub", ["x", "y"], ["d"]), helper.make_node("Add", ["x", "b"], ["s"])]
    graph = helper.make_graph(
        nodes, "g",
        [value_info("b", b.dtype, b.shape), value_info("x", x.dtype, x.shape), value_info("y", y.dtype, y.shape)],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 3]), helper.make_tensor_value_info("d", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    s, d = LuisaBackend.run_model(model, [x, y])
    np.testing.assert_allclose(s, x + b, rtol=1e-6)
    np.testing.assert_allclose(d, x - y, rtol=1e-6)
    with pytest.raises(ValueError, match="1 inputs given, the model has 2"):
        LuisaBackend.prepare(model).run([x])


def test_dynamic_shapes_compile_per_shape():
    x = rand((2, 3), seed=1)
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])
    rep = LuisaBackend.prepare(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    for shape in ((2, 3), (4, 1), (2, 3)):
        x = rand(shape, seed=len(shape))
        np.testing.assert_array_equal(rep.run([x])[0], np.maximum(x, 0))
    assert len(rep._nets) == 2


def test_an_input_the_operator_needs_as_a_constant_is_compiled_in():
    """ReduceSum's axes fed as a graph input: compiled in per value; the data stays an input."""
    x = rand((2, 3, 4), seed=1)
    model = single_node_model("ReduceSum", {"x": x, "axes": np.array([1], np.int64)}, opset=13, keepdims=0)
    rep = LuisaBackend.prepare(model)
    for axes in ([1], [2], [1]):
        a = np.array(axes, np.int64)
        np.testing.assert_allclose(rep.run([x, a])[0], x.sum(axis=tuple(axes)), rtol=1e-5)
    assert rep.bound == ["axes"]
    assert len(rep._nets) == 2
    assert all(s.name == "x" for net in rep._nets.values() for s in net.inputs)


def test_needed_constants_reads_the_compile_errors():
    x = rand((2, 3), seed=1)
    model = single_node_model("Reshape", {"x": x, "shape": np.array([3, 2], np.int64)})
    err = onnx_backend.CompileError("node 'r' (Reshape): input 1 ('shape', shape) must be a constant known at compile time (...)")
    assert onnx_backend.needed_constants(err, model) == ["shape"]
    err = onnx_backend.ModelError("tensor 'y' (output of node 'r' (Reshape)): dimension 0 of [unk__0, 2] could not be inferred")
    assert onnx_backend.needed_constants(err, model) == ["shape"]
    assert onnx_backend.needed_constants(ValueError("something else"), model) == []
    # an input an operator demands is bound whatever its type (Resize's float scales); a guess
    # from an unknown shape binds integer inputs only, never data
    scales = np.array([1.0, 2.0], np.float32)
    model = single_node_model("Resize", {"x": x, "roi": np.zeros(0, np.float32), "scales": scales})
    err = onnx_backend.CompileError("node 'r' (Resize): input 2 ('scales', scales) must be a constant known at compile time")
    assert onnx_backend.needed_constants(err, model) == ["scales"]
    err = onnx_backend.ModelError("tensor 'y' (output of node 'r' (Resize)): dimension 1 of [2, unk__0] could not be inferred")
    assert onnx_backend.needed_constants(err, model) == []
