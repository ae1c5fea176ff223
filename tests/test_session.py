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


# ---- onnxruntime's other session methods, options, providers and feeds -------------------------
def _with_metadata(path: str) -> onnx.ModelProto:
    model = _model()
    model.producer_name, model.producer_version, model.domain = "tests", "1.0", "org.luisaml.tests"
    model.doc_string, model.graph.doc_string, model.model_version = "a model", "its graph", 7
    model.graph.name = "embed_and_dense"
    helper.set_model_props(model, {"author": "eco", "licence": "BSD-3-Clause"})
    onnx.save(model, path)
    return model


def test_providers_metadata_and_options_as_onnxruntime_reports_them(tmp_path):
    path = str(tmp_path / "m.onnx")
    _with_metadata(path)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    sess = luisaml.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert sess.get_providers() == ref.get_providers() == ["CPUExecutionProvider"]
    assert sess.get_provider_options() == ref.get_provider_options()
    want, got = ref.get_modelmeta(), sess.get_modelmeta()
    for key in ("producer_name", "graph_name", "domain", "description", "graph_description", "version",
                "custom_metadata_map"):
        assert getattr(got, key) == getattr(want, key), key
    want, got = ref.get_session_options(), sess.get_session_options()
    for key in ("intra_op_num_threads", "inter_op_num_threads", "enable_profiling", "profile_file_prefix",
                "optimized_model_filepath", "log_severity_level", "enable_cpu_mem_arena", "enable_mem_pattern"):
        assert getattr(got, key) == getattr(want, key), key
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    assert luisaml.InferenceSession(path, so, ["CPUExecutionProvider"]).get_session_options().intra_op_num_threads == 2


def test_end_profiling_writes_a_trace_like_onnxruntimes(tmp_path):
    import json

    path = str(tmp_path / "m.onnx")
    onnx.save(_model(), path)
    feeds = {"ids": np.zeros((2, 4), np.int64), "x": rand((2, 6))}
    files = {}
    for name, cls, opts in (("ort", ort.InferenceSession, ort.SessionOptions()),
                            ("lml", luisaml.InferenceSession, luisaml.SessionOptions())):
        plain = cls(path, providers=["CPUExecutionProvider"])
        assert plain.end_profiling() == ""  # profiling off: no file, as onnxruntime
        opts.enable_profiling, opts.profile_file_prefix = True, str(tmp_path / name)
        sess = cls(path, opts, providers=["CPUExecutionProvider"])
        for _ in range(3):
            sess.run(None, feeds)
        files[name] = sess.end_profiling()
        assert sess.end_profiling() == ""  # ended
    for name, f in files.items():
        assert f.startswith(str(tmp_path / name) + "_") and f.endswith(".json")
    want, got = (json.loads(open(files[k]).read()) for k in ("ort", "lml"))
    session_events = [e for e in want if e["cat"] == "Session"]
    assert {tuple(sorted(e)) for e in got} == {tuple(sorted(e)) for e in session_events}  # the same keys
    assert [e["name"] for e in got if e["name"] == "model_run"] == [e["name"] for e in want if e["name"] == "model_run"]
    assert "session_initialization" in {e["name"] for e in got} & {e["name"] for e in want}
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 for e in got)


def test_unknown_providers_are_named_and_unhonourable_options_refused(tmp_path):
    path = str(tmp_path / "m.onnx")
    onnx.save(_model(), path)
    with pytest.warns(UserWarning, match=r"ignores the execution providers \['TensorrtExecutionProvider'\]"):
        sess = luisaml.InferenceSession(path, providers=["TensorrtExecutionProvider", "CPUExecutionProvider"])
    with pytest.warns(UserWarning, match="TensorrtExecutionProvider"):  # onnxruntime warns too, and falls back
        ref = ort.InferenceSession(path, providers=["TensorrtExecutionProvider", "CPUExecutionProvider"])
    assert sess.get_providers() == ref.get_providers()
    so = luisaml.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    with pytest.raises(luisaml.UsageError, match="optimized_model_filepath=.*luisaml build"):
        luisaml.InferenceSession(path, so)
    with pytest.raises(luisaml.UsageError, match=r"provider options \{'arena_extend_strategy'"):
        luisaml.InferenceSession(path, providers=[("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})])


def test_list_feeds_as_onnxruntime_takes_them(tmp_path):
    path = str(tmp_path / "m.onnx")
    onnx.save(_model(), path)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    sess = luisaml.InferenceSession(path, providers=["CPUExecutionProvider"])
    for feeds in ({"ids": [[1, 2, 3, 4], [0, 9, 9, 0]], "x": [[1, 2, 3, 4, 5, 6], [0.5] * 6]},  # ints into a float
                  {"ids": np.array([[1, 2, 3, 4]]), "x": [[True, False] * 3]}):
        for w, g in zip(ref.run(None, feeds), sess.run(None, feeds)):
            assert w.dtype == g.dtype and w.shape == g.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    ragged = {"ids": [[1, 2, 3, 4], [0]], "x": [[0.0] * 6] * 2}
    with pytest.raises(Exception):
        ref.run(None, ragged)
    with pytest.raises(luisaml.InputError, match="input 'ids': a list that is not a rectangular array of int64"):
        sess.run(None, ragged)


def test_intra_op_num_threads_sets_the_cpu_backends_threads(tmp_path):
    """In a fresh process (the CPU backend's thread pool is the process's): 1 thread and 3 threads
    differ by 2 threads of the process, as the kernel's workers."""
    import subprocess
    import sys

    path = str(tmp_path / "m.onnx")
    onnx.save(_model(), path)
    code = ("import os, sys, numpy as np, luisaml\n"
            "so = luisaml.SessionOptions(); so.intra_op_num_threads = int(sys.argv[2])\n"
            "s = luisaml.InferenceSession(sys.argv[1], so, ['CPUExecutionProvider'])\n"
            "s.run(None, {'ids': np.zeros((64, 4), np.int64), 'x': np.zeros((64, 6), np.float32)})\n"
            "print(os.environ['LUISA_NUM_THREADS'], len(os.listdir('/proc/self/task')))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "LUISA_NUM_THREADS"}
    counts = {}
    for n in (1, 3):
        r = subprocess.run([sys.executable, "-c", code, path, str(n)], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        said, tasks = r.stdout.split()
        assert said == str(n)
        counts[n] = int(tasks)
    assert counts[3] - counts[1] == 2
