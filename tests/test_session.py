"""luisaml.InferenceSession: code written for onnxruntime runs unchanged. The same calls on an
onnxruntime session and a luisaml one give the same inputs, outputs and results."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper
from util import graph_model, rand

import luisaml
from luisaml.session import backend_for


def _model() -> onnx.ModelProto:
    """ids int64[N, 4] and x float[N, 6]: an embedding summed over the ids, plus a dense layer of x;
    two outputs."""
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
             helper.make_node("ReduceSum", ["e", "axes"], ["s"], name="sum", keepdims=0),
             helper.make_node("Gemm", ["x", "w", "b"], ["d"], name="dense"),
             helper.make_node("Add", ["s", "d"], ["y"], name="add"),
             helper.make_node("ArgMax", ["y"], ["best"], name="argmax", axis=1, keepdims=0)]
    inits = {"emb": rand((10, 3), seed=1), "axes": np.array([1], np.int64), "w": rand((6, 3), seed=2),
             "b": rand((3,), seed=3)}
    feeds = {"ids": np.zeros((2, 4), np.int64), "x": rand((2, 6))}
    return graph_model(nodes, feeds, inits, opset=17, batch="N", outputs=["y", "best"])


def _onnxruntime_style(sess, feeds):
    """What code written for onnxruntime does with a session."""
    ins = [(i.name, i.shape, i.type) for i in sess.get_inputs()]
    outs = [(o.name, o.shape, o.type) for o in sess.get_outputs()]
    every = sess.run(None, feeds)
    names = [o.name for o in sess.get_outputs()]
    last = sess.run([names[-1]], feeds)
    both = sess.run(names[::-1], feeds)
    return ins, outs, every, last, both


@pytest.mark.parametrize("form", ["path", "bytes", "proto"])
def test_same_calls_same_results(tmp_path, form):
    model = _model()
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    arg = {"path": path, "bytes": model.SerializeToString(), "proto": model}[form]
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    sess = luisaml.InferenceSession(arg, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 10, (5, 4)).astype(np.int64), "x": rng.standard_normal((5, 6)).astype(np.float32)}
    want, got = _onnxruntime_style(ref, feeds), _onnxruntime_style(sess, feeds)
    assert got[:2] == want[:2]  # names, shapes ('N' as a string), types ('tensor(int64)')
    assert got[1] == [("y", ["N", 3], "tensor(float)"), ("best", ["N"], "tensor(int64)")]
    for w, g in zip(want[2:], got[2:]):
        assert isinstance(g, list) and len(g) == len(w)
        for a, b in zip(w, g):
            assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_session_options_and_providers_as_onnxruntime_takes_them(tmp_path):
    path = str(tmp_path / "m.onnx")
    onnx.save(_model(), path)
    so = ort.SessionOptions()
    for args, kw in (((so,), {"providers": ["CPUExecutionProvider"]}), ((so, ["CPUExecutionProvider"]), {}),
                     ((None, ["CPUExecutionProvider"], None), {}), ((), {"sess_options": so, "backend": "cpu"})):
        sess = luisaml.InferenceSession(path, *args, **kw)  # onnxruntime's order and keywords
        assert sess.network.backend == "cpu" and [i.name for i in sess.get_inputs()] == ["ids", "x"]
    with pytest.raises(luisaml.UsageError, match="not weights and providers"):
        luisaml.InferenceSession(path, {"w": np.zeros(3, np.float32)}, ["CPUExecutionProvider"])
    assert isinstance(sess.network, luisaml.CompiledNetwork) and "InferenceSession" in repr(sess)
    assert backend_for(["CUDAExecutionProvider", "CPUExecutionProvider"]) == "auto"
    assert backend_for([("CUDAExecutionProvider", {"device_id": 0})]) == "cuda"
    assert backend_for(["CPUExecutionProvider"]) == "cpu" and backend_for(None) == "auto"


def test_errors_name_the_input(tmp_path):
    sess = luisaml.InferenceSession(_model())
    with pytest.raises(luisaml.InputError, match="'x'"):
        sess.run(None, {"ids": np.zeros((2, 4), np.int64), "x": np.zeros((2, 5), np.float32)})
    with pytest.raises(luisaml.InputError, match="nope"):
        sess.run(["nope"], {"ids": np.zeros((2, 4), np.int64), "x": np.zeros((2, 6), np.float32)})
    with pytest.raises(luisaml.ModelError, match="not a serialised ONNX"):
        luisaml.InferenceSession(b"\x00not a model")
