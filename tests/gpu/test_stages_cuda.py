"""Every kind of stage on the CUDA backend against onnxruntime (the CPU suite holds the CPU
backend to the same references, so the two backends agree within float tolerance): element stages
with epilogues (Conv+BN+Relu, Gemm), items stages (Softmax rows, LayerNorm, TopK, CumSum), inline
remaps (Transpose, Concat, Slice, Pad, Resize), whole groups (Loop), the fused MLP with any
activation, and a graph compiled per batch size (a batch-first TransformerEncoder).

    LUISAML_BACKEND=cuda python -m pytest tests/gpu -q"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from util import cuda_only, export_batched, ort_run, torch_mlp

import luisaml

pytestmark = cuda_only()

RTOL = 1e-4


def _check(model: onnx.ModelProto, feeds: dict, rtol=RTOL, **kw):
    net = luisaml.compile(model, **kw)
    assert net.backend == "cuda"
    got, want = net.run(feeds), ort_run(model, feeds)
    for name, w in want.items():
        scale = max(1.0, float(np.abs(w).max())) if w.dtype.kind == "f" else 1.0
        if w.dtype.kind == "f":
            np.testing.assert_allclose(got[name], w, rtol=rtol, atol=rtol * scale, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], w, err_msg=name)
    return net


def _torch_model(module, shape, path, dynamic=True):
    module.eval()
    torch.onnx.export(module, (torch.randn(*shape),), str(path), dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}} if dynamic else None)
    return onnx.load(str(path))


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 8, 3, stride=2, padding=1, groups=2)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
        x = torch.nn.functional.avg_pool2d(torch.relu(self.c2(x)), 2)
        return torch.softmax(self.fc(x.flatten(1)), -1)


def test_conv_bn_pool_gemm_softmax(tmp_path):
    torch.manual_seed(0)
    model = _torch_model(ConvNet(), (2, 3, 32, 32), tmp_path / "cnn.onnx")
    x = np.random.default_rng(0).standard_normal((33, 3, 32, 32)).astype(np.float32)
    net = _check(model, {"x": x})
    assert {st.domain for st in net.plan.schedule.stages} <= {"element", "items", "blocks"}


def test_rows_and_remaps(tmp_path):
    """LayerNorm, TopK, CumSum rows; Transpose, Concat, Slice, Pad, Resize computed inline."""
    rng = np.random.default_rng(1)
    F = TensorProto.FLOAT
    inits = [numpy_helper.from_array(rng.standard_normal(12).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(12).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([3], np.int64), "k"),
             numpy_helper.from_array(np.array([1], np.int64), "ax1"),
             numpy_helper.from_array(np.array([0, 0, 1, 0, 0, 2], np.int64), "pads"),
             numpy_helper.from_array(np.array([1, 1, 2], np.float32), "scales"),
             numpy_helper.from_array(np.array([1], np.int64), "s0"), numpy_helper.from_array(np.array([7], np.int64), "s1")]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1),
        helper.make_node("Transpose", ["ln"], ["t"], perm=[0, 2, 1]),
        helper.make_node("TopK", ["x", "k"], ["tv", "ti"], axis=-1),
        helper.make_node("CumSum", ["x", "ax1"], ["cs"]),
        helper.make_node("Concat", ["x", "cs"], ["cat"], axis=1),
        helper.make_node("Slice", ["cat", "s0", "s1", "ax1"], ["sl"]),
        helper.make_node("Pad", ["sl", "pads"], ["pd"], mode="reflect"),
        helper.make_node("Resize", ["pd", "", "scales"], ["rs"], mode="linear"),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 5, 12])],
                          [helper.make_tensor_value_info(o, F if o != "ti" else TensorProto.INT64, None)
                           for o in ("t", "tv", "ti", "rs")], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    model = onnx.shape_inference.infer_shapes(model)
    _check(model, {"x": rng.standard_normal((7, 5, 12)).astype(np.float32)})


def test_loop_runs_whole(tmp_path):
    F = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Mul", ["v_in", "two"], ["v_out"]), helper.make_node("Identity", ["c_in"], ["c_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", F, [1, 4])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), helper.make_tensor_value_info("v_out", F, [1, 4])],
        [numpy_helper.from_array(np.float32(0.5), "two")])
    g = helper.make_graph([helper.make_node("Loop", ["M", "", "x"], ["y"], body=body)], "g",
                          [helper.make_tensor_value_info("x", F, [1, 4])], [helper.make_tensor_value_info("y", F, [1, 4])],
                          [numpy_helper.from_array(np.int64(5), "M")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    _check(model, {"x": np.arange(4, dtype=np.float32).reshape(1, 4)}, batch_axis=None)


class _Sine(torch.nn.Module):
    def forward(self, x):
        return torch.sin(30.0 * x)


@pytest.mark.parametrize("act", [torch.nn.Softplus, torch.nn.SiLU, _Sine, torch.nn.GELU], ids=["softplus", "silu", "sine", "gelu"])
def test_fused_mlp_any_activation(tmp_path, act):
    module = torch_mlp([3, 64, 64, 64, 1], act, seed=3)
    path = export_batched(module, 3, tmp_path / "m.onnx")
    net = luisaml.compile(path)
    assert net.plan.fused is not None and net.plan.fused.mode == "gpu", net.plan.fusion_note
    x = np.random.default_rng(2).uniform(-1, 1, (100_003, 3)).astype(np.float32)
    with torch.no_grad():  # float64 is the reference; torch's own float32 error sets the bar
        torch32 = module.float()(torch.from_numpy(x)).numpy()
        want = module.double()(torch.from_numpy(x).double()).numpy()
    got = net.run({"x": x})["y"]

    def rel(a):
        return float(np.abs(a - want).max() / np.abs(want).max())

    assert rel(got) <= max(4 * rel(torch32), 1e-5)


def test_transformer_per_batch(tmp_path):
    torch.manual_seed(4)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
    m = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    model = _torch_model(m, (3, 8, 32), tmp_path / "tfm.onnx")
    net = _check(model, {"x": np.random.default_rng(5).standard_normal((6, 8, 32)).astype(np.float32)})
    assert isinstance(net, luisaml.PerBatchNetwork)


def test_gather_error_flag_on_cuda():
    F = TensorProto.FLOAT
    g = helper.make_graph([helper.make_node("Gather", ["x", "i"], ["y"], axis=1, name="g")], "g",
                          [helper.make_tensor_value_info("x", F, [2, 5]), helper.make_tensor_value_info("i", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("y", F, [2, 3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    net = luisaml.compile(model, batch_axis=None)
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    np.testing.assert_array_equal(net.run({"x": x, "i": np.array([0, 4, -1])})["y"], x[:, [0, 4, -1]])
    with pytest.raises(luisaml.RunError, match="'g'"):
        net.run({"x": x, "i": np.array([0, 5, 1])})
