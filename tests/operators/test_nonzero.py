"""NonZero (count, prefix sum, read-back, fill: operators/detection.py) against onnxruntime: ranks 1-4,
float/int/bool inputs, none and all nonzero, more elements than one work item covers, and the
per-batch compile of a batched input (the batch coordinate is part of the output)."""

import numpy as np
import pytest
from onnx import helper

import luisaml

from util import graph_model, ort_run

SHAPES = [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 5), (9, 31)]  # (9, 31): 279 elements, five work items of 64


def _model(dtype, opset):
    """One model, a NonZero per shape: one compile checks every rank."""
    inputs = {f"x{k}": np.zeros(s, dtype) for k, s in enumerate(SHAPES)}
    nodes = [helper.make_node("NonZero", [f"x{k}"], [f"y{k}"], name=f"NonZero_{k}") for k in range(len(SHAPES))]
    return graph_model(nodes, inputs, opset=opset)


def _feeds(dtype, rng, density):
    out = {}
    for k, s in enumerate(SHAPES):
        mask = rng.random(s) < density
        if np.dtype(dtype) == np.bool_:
            out[f"x{k}"] = mask
        else:
            vals = rng.integers(1, 5, s) * rng.choice([-1, 1], s)
            out[f"x{k}"] = np.where(mask, vals, 0).astype(dtype)
    return out


def _assert_equal(got, want):
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype == np.int64, f"{name}: dtype {g.dtype}, onnxruntime {w.dtype}"
        assert g.shape == w.shape, f"{name}: shape {g.shape} != onnxruntime {w.shape}"
        np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("dtype,opset", [(np.float32, 13), (np.int32, 13), (np.bool_, 9), (np.int64, 9)],
                         ids=["f32", "i32", "bool", "i64-opset9"])
def test_nonzero_matches_onnxruntime(dtype, opset):
    model = _model(dtype, opset)
    net = luisaml.compile(model, batch_axis=None)
    rng = np.random.default_rng(7)
    for density in (0.0, 0.3, 0.7, 1.0):  # none, some, most, all nonzero
        feeds = _feeds(dtype, rng, density)
        _assert_equal(net.run(feeds), ort_run(model, feeds))
    # -0.0 is zero, NaN is nonzero (IEEE comparison with 0)
    if dtype == np.float32:
        feeds = _feeds(dtype, rng, 0.5)
        feeds["x0"] = np.array([-0.0, np.nan, 0.0, 1e-30, -2, 0, np.inf], np.float32)
        _assert_equal(net.run(feeds), ort_run(model, feeds))


def test_nonzero_of_a_batched_input_compiles_per_batch():
    """The output names the batch coordinate: a batched input makes the network compile per batch
    size; no per-sample `forward` exists."""
    model = graph_model([helper.make_node("NonZero", ["x"], ["y"], name="NonZero_0")],
                        {"x": np.zeros((2, 3, 4), np.float32)}, opset=13, batch="N")
    net = luisaml.compile(model, batch_axis=0)
    rng = np.random.default_rng(3)
    for n in (2, 3):
        feeds = {"x": np.where(rng.random((n, 3, 4)) < 0.4, 1.5, 0.0).astype(np.float32)}
        _assert_equal(net.run(feeds), ort_run(model, feeds))
    with pytest.raises(luisaml.UsageError, match="'NonZero_0'"):
        net.forward  # noqa: B018


def test_nonzero_output_cannot_be_read_by_another_node():
    """Its size is known only at run time: a node reading it is refused, naming both."""
    nodes = [helper.make_node("NonZero", ["x"], ["y"], name="NonZero_0"),
             helper.make_node("Transpose", ["y"], ["z"], name="reader")]
    model = graph_model(nodes, {"x": np.zeros((3, 4), np.float32)}, opset=13)
    with pytest.raises(luisaml.LuisamlError, match="reader.*'y'"):
        luisaml.compile(model, batch_axis=None)


def test_nonzero_through_the_shared_torch_path(monkeypatch):
    """The DLPack path (luisaml/zero_copy.py, on CUDA with CUDA tensors; mapped to torch CPU
    tensors here, as tests/fvdb/test_ray_outputs_device.py does): the output is a fresh torch tensor
    [rank, N], N read back, equal to onnxruntime's."""
    torch = pytest.importorskip("torch")
    from luisaml import zero_copy

    monkeypatch.setattr(zero_copy, "SHARED_DEVICES", {"cuda": "cuda", "cpu": "cpu"})
    model = graph_model([helper.make_node("NonZero", ["x"], ["y"], name="NonZero_0")],
                        {"x": np.zeros((5, 70), np.float32)}, opset=13)
    net = luisaml.compile(model, batch_axis=None)
    rng = np.random.default_rng(2)
    outs = []
    for density in (0.2, 0.0, 0.9):
        x = np.where(rng.random((5, 70)) < density, -1.0, 0.0).astype(np.float32)
        y = net.run({"x": torch.from_numpy(x)})["y"]
        assert isinstance(y, torch.Tensor) and tuple(y.shape) == ort_run(model, {"x": x})["y"].shape
        np.testing.assert_array_equal(y.numpy(), ort_run(model, {"x": x})["y"])
        outs.append(y)
    assert outs[0].data_ptr() != outs[2].data_ptr()
