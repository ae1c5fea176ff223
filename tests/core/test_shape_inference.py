"""passes/infer.py _onnx_infer hides large initializers' data from onnx's shape inference (typed
stand-in inputs): the model it returns must type every tensor as the full model does, and keep the
weights, in their order, and the graph's inputs as they were."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from luisaml.passes import infer


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    big = rng.standard_normal((64, 128)).astype(np.float32)  # 8192 elements: over the limit
    also_input = rng.standard_normal((80, 80)).astype(np.float32)  # an initializer listed as an input too
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Shape", ["w"], ["ws"]),  # shapes of a hidden initializer still propagate
             helper.make_node("Gather", ["ws", "one"], ["cols"], axis=0),
             helper.make_node("Concat", ["minus1", "cols"], ["new_shape"], axis=0),
             helper.make_node("Reshape", ["h", "new_shape"], ["y"]),
             helper.make_node("Add", ["z", "v"], ["u"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64]),
                                       helper.make_tensor_value_info("z", TensorProto.FLOAT, [80, 80]),
                                       helper.make_tensor_value_info("v", TensorProto.FLOAT, [80, 80])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("u", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(big, "w"), numpy_helper.from_array(np.array([1], np.int64), "one"),
                           numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
                           numpy_helper.from_array(also_input, "v")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _types(m):
    return {vi.name: vi.type.SerializeToString() for vi in list(m.graph.value_info) + list(m.graph.output)}


def test_large_initializers_hidden_from_onnx_give_the_same_types(monkeypatch):
    proto = _model()
    light = infer._onnx_infer(proto)
    monkeypatch.setattr(infer, "INFER_DATA_LIMIT", 10**12)  # nothing hidden: onnx sees every weight
    full = infer._onnx_infer(proto)
    assert _types(light) == _types(full) and "new_shape" in _types(light)
    assert [t.name for t in light.graph.initializer] == [t.name for t in proto.graph.initializer]
    assert [t.SerializeToString() for t in light.graph.initializer] == [t.SerializeToString() for t in proto.graph.initializer]
    assert [vi.name for vi in light.graph.input] == ["x", "z", "v"]
    assert len(proto.graph.initializer) == 4 and len(proto.graph.input) == 3  # the caller's model untouched
