"""ONNX function ops luisaml has no operator for are expanded into their schema's function body
(luisaml/passes/functions.py); checked against onnx's reference evaluator."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import luisaml
from luisaml.passes.functions import expand_functions

F = TensorProto.FLOAT


def _gelu_model():
    g = helper.make_graph([helper.make_node("Gelu", ["x"], ["y"], approximate="tanh")], "g",
                          [helper.make_tensor_value_info("x", F, [2, 5])], [helper.make_tensor_value_info("y", F, [2, 5])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def test_expansion_keeps_the_semantics_and_the_attributes():
    """Gelu (a function op, approximate='tanh' read through ref_attr_name) expanded by hand equals
    the reference evaluator's Gelu; an implemented op is left alone."""
    x = np.linspace(-3, 3, 10, dtype=np.float32).reshape(2, 5)
    want = ReferenceEvaluator(_gelu_model()).run(None, {"x": x})[0]
    kept = _gelu_model()
    assert expand_functions(kept, lambda *a: True) == 0 and [n.op_type for n in kept.graph.node] == ["Gelu"]
    expanded = _gelu_model()
    assert expand_functions(expanded, lambda op, domain, opset: op != "Gelu") == 1
    ops = {n.op_type for n in expanded.graph.node}
    assert "Gelu" not in ops and "Tanh" in ops  # the tanh approximation's body, not the erf one
    onnx.checker.check_model(expanded)
    np.testing.assert_allclose(ReferenceEvaluator(expanded).run(None, {"x": x})[0], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_compiles_through_its_function_body(interleaved):
    """RotaryEmbedding has no luisaml operator: it compiles as its function body (a context-
    dependent one) and matches the reference evaluator."""
    b, s, h, d = 2, 3, 2, 8
    rng = np.random.default_rng(interleaved)
    x = rng.standard_normal((b, s, h * d)).astype(np.float32)
    cos = rng.standard_normal((b, s, d // 2)).astype(np.float32)
    sin = rng.standard_normal((b, s, d // 2)).astype(np.float32)
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], interleaved=interleaved, num_heads=h)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, F, list(v.shape)) for n, v in
                                        (("x", x), ("cos", cos), ("sin", sin))],
                          [helper.make_tensor_value_info("y", F, list(x.shape))])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    feeds = {"x": x, "cos": cos, "sin": sin}
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    got = luisaml.compile(model, batch_axis=None).run(feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
