"""AffineGrid against onnxruntime; the window functions, SwiGLU and TensorScatter against numpy and
ONNX's reference (onnxruntime has no kernels for the newest of them)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from util import assert_matches_ort, graph_model, rand

import luisaml

I64 = np.int64


def _opset(model, version):
    """Return the model importing a newer opset than onnx's helper knows an IR version for."""
    model.opset_import[0].version = version
    model.ir_version = onnx.IR_VERSION
    return model


def _reference(model, feeds):
    from onnx.reference import ReferenceEvaluator

    ref = ReferenceEvaluator(model)
    return dict(zip(ref.output_names, ref.run(None, feeds)))


@pytest.mark.parametrize("align", [0, 1])
def test_affine_grid(align):
    t2, t3 = rand((2, 2, 3), seed=1), rand((2, 3, 4), seed=2)
    inits = {"s2": np.array([2, 3, 4, 5], I64), "s3": np.array([2, 1, 3, 2, 4], I64), "s1": np.array([2, 3, 1, 6], I64)}
    nodes = [helper.make_node("AffineGrid", ["t2", "s2"], ["g2"], align_corners=align),
             helper.make_node("AffineGrid", ["t3", "s3"], ["g3"], align_corners=align),
             helper.make_node("AffineGrid", ["t2", "s1"], ["g1"], align_corners=align)]
    if align:  # one pixel with align_corners: 0 here and in PyTorch, +1 in onnxruntime, -1 in ONNX's reference
        nodes.pop()
    feeds = {"t2": t2, "t3": t3}
    assert_matches_ort(graph_model(nodes, feeds, inits, opset=20), feeds, batch_axis=None, rtol=1e-5, atol=1e-6)


def test_windows(monkeypatch):
    """A window's only input is its constant size, so the folder computes it on the host; with
    folding turned off for it, the kernel's values match numpy's windows and onnxruntime's."""
    import luisaml.passes.fold as fold

    ops = ("HannWindow", "HammingWindow", "BlackmanWindow")
    monkeypatch.setattr(fold, "NOT_FOLDED", fold.NOT_FOLDED | set(ops))
    nodes, inits = [], {"n": np.array(10, I64), "one": np.array(1, I64)}
    for op in ops:
        for periodic in (0, 1):
            nodes.append(helper.make_node(op, ["n"], [f"{op}{periodic}"], periodic=periodic))
    nodes.append(helper.make_node("HannWindow", ["n"], ["int_out"], output_datatype=TensorProto.INT32))
    nodes.append(helper.make_node("Neg", ["x"], ["nx"]))
    model = graph_model(nodes, {"x": np.ones(1, np.float32)}, inits, opset=17)
    got = luisaml.compile(model, batch_axis=None).run({"x": np.ones(1, np.float32)})
    n = np.arange(10)
    for periodic in (0, 1):
        big = 10 if periodic else 9
        want = {"HannWindow": 0.5 - 0.5 * np.cos(2 * np.pi * n / big),
                "HammingWindow": 25 / 46 - 21 / 46 * np.cos(2 * np.pi * n / big),
                "BlackmanWindow": 0.42 - 0.5 * np.cos(2 * np.pi * n / big) + 0.08 * np.cos(4 * np.pi * n / big)}
        for op in ops:
            np.testing.assert_allclose(got[f"{op}{periodic}"], want[op], rtol=1e-5, atol=1e-6, err_msg=f"{op} {periodic}")
    assert_matches_ort(model, {"x": np.ones(1, np.float32)}, batch_axis=None, rtol=1e-5, atol=1e-6)


def test_swiglu():
    a, b = rand((3, 8), seed=3, low=-20, high=20), rand((3, 8), seed=4)
    model = _opset(graph_model([helper.make_node("SwiGLU", ["a", "b"], ["y"], alpha=1.702),
                                helper.make_node("SwiGLU", ["a", "b"], ["d"])], {"a": a, "b": b}, opset=13), 28)
    got = luisaml.compile(model, batch_axis=None).run({"a": a, "b": b})
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_allclose(got["y"], a64 / (1 + np.exp(-1.702 * a64)) * b64, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(got["d"], a64 / (1 + np.exp(-a64)) * b64, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter(mode):
    past = rand((2, 3, 6, 4), seed=5)
    upd = rand((2, 3, 3, 4), seed=6)
    w = np.array([1, 3] if mode == "linear" else [4, 5], I64)  # circular ones wrap around
    feeds = {"past": past, "upd": upd, "w": w, "u1": rand((2, 3, 1, 4), seed=7)}
    nodes = [helper.make_node("TensorScatter", ["past", "upd", "w"], ["y"], mode=mode),
             helper.make_node("TensorScatter", ["past", "u1"], ["z"], mode=mode, axis=2)]
    model = _opset(graph_model(nodes, feeds, opset=13), 24)
    got = luisaml.compile(model, batch_axis=None).run(feeds)
    for name, want in _reference(model, feeds).items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
