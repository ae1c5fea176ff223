"""Loaders: LuisaML JSON with its blob, safetensors, protobuf with external weights, and errors."""
import base64
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import luisaml
from luisaml.loaders import load_proto, to_json_model
from luisaml.model import ModelError

# The worked example of ../shared/reference/luisaml-cpp.md §1: W from blob bytes 0-24, b in base64.
WORKED = {
    "ir_version": "10", "producer_name": "demo", "producer_version": "0",
    "graph": {"name": "g",
        "input": [{"name": "x", "type": {"tensor_type": {"elem_type": "FLOAT", "shape": {"dim": [{"dim_value": "1"}, {"dim_value": "2"}]}}}}],
        "output": [{"name": "y", "type": {"tensor_type": {"elem_type": "FLOAT", "shape": {"dim": [{"dim_value": "1"}, {"dim_value": "3"}]}}}}],
        "value_info": [{"name": "h", "type": {"tensor_type": {"elem_type": "FLOAT", "shape": {"dim": [{"dim_value": "1"}, {"dim_value": "3"}]}}}}],
        "initializer": [{"name": "W", "data_type": "FLOAT", "dims": ["3", "2"], "data_offsets": [0, 24]},
                        {"name": "b", "data_type": "FLOAT", "dims": ["3"], "raw_data": "AAAAPwAAgL8AAABA"}],
        "node": [{"name": "n0", "op_type": "Gemm", "input": ["x", "W", "b"], "output": ["h"],
                  "attribute": [{"name": "transB", "type": "INT", "i": "1"}, {"name": "alpha", "type": "FLOAT", "f": 1.0}]},
                 {"name": "n1", "op_type": "Relu", "input": ["h"], "output": ["y"]}]}}


def _write(tmp_path, doc, blob: bytes, blob_name="w.bin"):
    mp, wp = tmp_path / "model.json", tmp_path / blob_name
    mp.write_text(json.dumps(doc))
    wp.write_bytes(blob)
    return mp, wp


def test_worked_example_matches_numpy(tmp_path):
    W = np.array([[1.0, -2.0], [0.5, 0.25], [-1.0, 3.0]], np.float32)
    b = np.frombuffer(base64.b64decode(WORKED["graph"]["initializer"][1]["raw_data"]), np.float32)
    assert b.tolist() == [0.5, -1.0, 2.0]
    mp, wp = _write(tmp_path, WORKED, W.tobytes())
    net = luisaml.compile(mp, wp, batch_axis=None)
    x = np.array([[0.75, -1.5]], np.float32)
    y = net.run({"x": x})["y"]
    np.testing.assert_allclose(y, np.maximum(x @ W.T + b, 0), rtol=1e-6)


def _mlp_proto(seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w1, b1 = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    w2, b2 = rng.standard_normal((3, 16)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1),
    ]
    g = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(a, n) for n, a in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2))],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _reference(proto, x):
    from util import ort_run

    return ort_run(proto, {"x": x})["y"]


@pytest.mark.parametrize("fmt", ["blob", "safetensors"])
def test_json_with_weights_matches_onnxruntime(tmp_path, fmt):
    proto = _mlp_proto()
    doc, raw = to_json_model(proto, fmt)
    assert all("raw_data" not in i for i in doc["graph"]["initializer"])
    assert doc["graph"]["input"][0]["type"]["tensor_type"]["elem_type"] == "FLOAT"
    mp, wp = _write(tmp_path, doc, raw, f"w.{fmt}")
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    y = luisaml.compile(mp, wp).run({"x": x})["y"]
    np.testing.assert_allclose(y, _reference(proto, x), rtol=1e-5, atol=1e-6)


def test_onnx_with_weights_as_inputs_and_safetensors(tmp_path):
    """Weights exported as graph inputs (export_params=False) are bound from safetensors by name."""
    from safetensors.numpy import save_file

    proto = _mlp_proto()
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    del bare.graph.initializer[:]
    for k, v in weights.items():
        bare.graph.input.append(helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)))
    onnx.save(bare, tmp_path / "bare.onnx")
    save_file(weights, tmp_path / "w.safetensors")
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    net = luisaml.compile(tmp_path / "bare.onnx", tmp_path / "w.safetensors")
    assert [s.name for s in net.inputs] == ["x"]
    np.testing.assert_allclose(net.run({"x": x})["y"], _reference(proto, x), rtol=1e-5, atol=1e-6)


def test_onnx_external_data(tmp_path):
    proto = _mlp_proto()
    onnx.save(_mlp_proto(), tmp_path / "ext.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.data", size_threshold=0)
    assert (tmp_path / "ext.data").exists()
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    y = luisaml.compile(tmp_path / "ext.onnx").run({"x": x})["y"]
    np.testing.assert_allclose(y, _reference(proto, x), rtol=1e-5, atol=1e-6)


def test_constant_node_tensor_attribute():
    """TENSOR attributes load, so Constant works (here feeding an Add at run time)."""
    c = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c)),
             helper.make_node("Add", ["x", "c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(luisaml.compile(m, batch_axis=None).run({"x": x})["y"], x + c, rtol=1e-6)


# ---- malformed input -------------------------------------------------------------------------


def test_bad_json_names_position(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"graph": {"node": [}')
    with pytest.raises(ModelError, match=r"invalid JSON at line 1 column \d+"):
        load_proto(p)


def test_raw_data_of_wrong_length(tmp_path):
    doc = json.loads(json.dumps(WORKED))
    doc["graph"]["initializer"][1]["raw_data"] = base64.b64encode(b"\0" * 8).decode()  # 2 floats, dims say 3
    mp, wp = _write(tmp_path, doc, b"\0" * 24)
    with pytest.raises(ModelError, match=r"'b': raw_data has 8 bytes, expected 12"):
        luisaml.compile(mp, wp)


@pytest.mark.parametrize("offsets,blob_len,message", [
    ([0, 20], 24, r"'W': data_offsets \[0, 20\] span 20 bytes, expected 24"),
    ([8, 32], 24, r"'W': data_offsets \[8, 32\] reach past the end of .* \(24 bytes\)"),
])
def test_blob_range_errors(tmp_path, offsets, blob_len, message):
    doc = json.loads(json.dumps(WORKED))
    doc["graph"]["initializer"][0]["data_offsets"] = offsets
    mp, wp = _write(tmp_path, doc, b"\0" * blob_len)
    with pytest.raises(ModelError, match=message):
        load_proto(mp, wp)


def test_missing_weights_for_offsets(tmp_path):
    mp = tmp_path / "m.json"
    mp.write_text(json.dumps(WORKED))
    with pytest.raises(ModelError, match=r"'W': has data_offsets \[0, 24\] but no weights were given"):
        load_proto(mp)


def test_missing_initializer_names_node_and_input():
    proto = _mlp_proto()
    del proto.graph.initializer[0]  # w1
    with pytest.raises(ModelError, match=r"node '.*' \(Gemm\) input 'w1': no graph input, initializer"):
        luisaml.compile(proto)


def test_headerless_blob_must_fill_exactly(tmp_path):
    proto = _mlp_proto()
    for t in proto.graph.initializer:
        t.ClearField("raw_data")
        t.ClearField("float_data")
    onnx.save(proto, tmp_path / "m.onnx")
    with pytest.raises(ModelError, match=r"needs bytes \[.*\) but .* has 10"):
        load_proto(tmp_path / "m.onnx", b"\0" * 10)
