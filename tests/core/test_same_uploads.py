"""A run leaves out the upload of a small input whose bytes its buffer got from the last upload
(CompiledNetwork._upload_input): the results are those of the inputs given, whatever changed between
runs: other bytes, a batch that made the pool replace the buffer, a large input (always uploaded)."""
import numpy as np
from onnx import TensorProto, helper

import luisaml
from luisaml import counts, network


def _model():
    """y = x * s + b over x [N, 4] (batched), s [4] and b [3000] (small and large inputs, not batched)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [4])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [3000])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [3000])
    nodes = [helper.make_node("Mul", ["x", "s"], ["y"]), helper.make_node("Neg", ["b"], ["z"])]
    return helper.make_model(helper.make_graph(nodes, "g", [x, s, b], [y, z]),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_unchanged_small_inputs_are_not_uploaded_and_every_result_is_its_inputs():
    net = luisaml.compile(_model())
    rng = np.random.default_rng(0)
    big = rng.standard_normal(3000).astype(np.float32)  # (12 KB: past SAME_UPLOAD_BYTES, uploaded every run)
    assert big.nbytes > network.SAME_UPLOAD_BYTES
    s1, s2 = np.array([1, 2, 3, 4], np.float32), np.array([5, 6, 7, 8], np.float32)
    x1, x64 = rng.standard_normal((1, 4)).astype(np.float32), rng.standard_normal((64, 4)).astype(np.float32)
    uploads = []
    for x, s in [(x1, s1), (x1, s1), (x1, s2), (x1, s1), (x64, s1), (x1, s1), (x1, s1.copy()), (x64, s2), (x1, s2)]:
        with counts.measure() as c:
            got = net.run({"x": x, "s": s, "b": big})
        np.testing.assert_array_equal(got["y"], x * s)
        np.testing.assert_array_equal(got["z"], -big)
        uploads.append(c.uploads)
    # a run of the same x and s as the run before uploads neither (b every time); a changed s or a
    # buffer the pool replaced (x of 64 rows, then of 1: a smaller one) is uploaded
    assert uploads[1] < uploads[0] and uploads[6] == uploads[1], uploads
    assert uploads[2] > uploads[1], uploads


def test_a_buffer_the_pool_replaced_gets_the_same_bytes_again():
    """The same s after its buffer was dropped from the pool (as exact() replaces one): the new buffer
    is uploaded (a check of the bytes alone would leave it empty)."""
    net = luisaml.compile(_model())
    x, s, b = np.ones((2, 4), np.float32), np.array([1, 2, 3, 4], np.float32), np.zeros(3000, np.float32)
    np.testing.assert_array_equal(net.run({"x": x, "s": s, "b": b})["y"], x * s)
    ident = next(spec.ident for spec in net.plan.inputs if spec.name == "s")
    net.pool.held = {k: v for k, v in net.pool.held.items() if k[0] != ident}
    net.pool.generation += 1
    net.pool._regions = {}
    np.testing.assert_array_equal(net.run({"x": x, "s": s, "b": b})["y"], x * s)
