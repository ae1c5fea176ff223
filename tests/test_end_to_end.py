"""End to end: torch exports with a dynamic batch, compiled and run, against torch and onnxruntime."""
import math

import numpy as np
import onnx
import pytest
import torch

import luisaml
from util import ort_run


def _export(module, example, path, dynamo: bool):
    module.eval()
    if dynamo:
        torch.onnx.export(module, (example,), str(path), dynamo=True, opset_version=18,
                          input_names=["x"], output_names=["y"],
                          dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)
    else:
        torch.onnx.export(module, (example,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return path


def _check(path, x: torch.Tensor, want: torch.Tensor, rtol=1e-5):
    net = luisaml.compile(path)
    assert net.batch_symbol is not None
    got = net.run({"x": x.numpy()})
    ref = ort_run(onnx.load(path), {"x": x.numpy()})
    for name, g in got.items():
        scale = np.abs(ref[name]).max()
        np.testing.assert_allclose(g, ref[name], rtol=rtol, atol=rtol * scale, err_msg=f"{name} vs onnxruntime")
    first = got[net.output_names[0]]
    np.testing.assert_allclose(first, want.numpy(), rtol=rtol, atol=rtol * np.abs(want.numpy()).max(), err_msg="vs torch")
    return net


class MLP(torch.nn.Module):
    def __init__(self, widths):
        super().__init__()
        layers = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers[:-1])

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("dynamo", [False, True])
def test_mlp_matches_torch_and_onnxruntime(tmp_path, dynamo):
    torch.manual_seed(0)
    m = MLP([32, 64, 64, 64, 4])
    x = torch.randn(257, 32)
    net = _check(_export(m, torch.randn(3, 32), tmp_path / "mlp.onnx", dynamo), x, m(x).detach())
    # another batch size, same compiled network
    x2 = torch.randn(5, 32)
    np.testing.assert_allclose(net.run({"x": x2.numpy()})["y"], m(x2).detach().numpy(), rtol=1e-5, atol=1e-6)


class NeRF(torch.nn.Module):
    """A NeRF-style MLP: positional encoding of xyz, a skip connection, density and colour heads."""

    def __init__(self, freqs=6, width=64):
        super().__init__()
        self.freqs = freqs
        enc = 3 + 3 * 2 * freqs
        self.l1, self.l2 = torch.nn.Linear(enc, width), torch.nn.Linear(width, width)
        self.l3 = torch.nn.Linear(width + enc, width)
        self.sigma, self.rgb = torch.nn.Linear(width, 1), torch.nn.Linear(width, 3)

    def forward(self, x):
        bands = [x]
        for k in range(self.freqs):
            bands += [torch.sin(x * (2.0 ** k) * math.pi), torch.cos(x * (2.0 ** k) * math.pi)]
        e = torch.cat(bands, dim=-1)
        h = torch.relu(self.l2(torch.relu(self.l1(e))))
        h = torch.relu(self.l3(torch.cat([h, e], dim=-1)))
        return torch.cat([torch.nn.functional.softplus(self.sigma(h)), torch.sigmoid(self.rgb(h))], dim=-1)


@pytest.mark.parametrize("dynamo", [False, True])
def test_nerf_mlp_matches_torch_and_onnxruntime(tmp_path, dynamo):
    torch.manual_seed(1)
    m = NeRF()
    x = torch.rand(300, 3) * 2 - 1
    _check(_export(m, torch.rand(4, 3), tmp_path / "nerf.onnx", dynamo), x, m(x).detach())


def test_wrong_input_shape_names_input_and_shapes(tmp_path):
    m = MLP([8, 16, 2])
    net = luisaml.compile(_export(m, torch.randn(2, 8), tmp_path / "m.onnx", False))
    with pytest.raises(ValueError, match=r"input 'x': expected shape \[batch, 8\], got \[4, 7\]"):
        net.run({"x": np.zeros((4, 7), np.float32)})
    with pytest.raises(TypeError, match=r"input 'x': expected dtype float32, got float64"):
        net.run({"x": np.zeros((4, 8))})
    with pytest.raises(KeyError, match=r"missing input\(s\) \['x'\]"):
        net.run({})


def test_torch_in_torch_out_and_call(tmp_path):
    torch.manual_seed(2)
    m = MLP([8, 16, 2])
    net = luisaml.compile(_export(m, torch.randn(2, 8), tmp_path / "m.onnx", False))
    x = torch.randn(6, 8)
    y = net(x=x)
    assert isinstance(y, torch.Tensor) and y.shape == (6, 2)
    torch.testing.assert_close(y, m(x).detach(), rtol=1e-5, atol=1e-6)


def test_empty_batch(tmp_path):
    m = MLP([8, 16, 2])
    net = luisaml.compile(_export(m, torch.randn(2, 8), tmp_path / "m.onnx", False))
    assert net.run({"x": np.zeros((0, 8), np.float32)})["y"].shape == (0, 2)


def test_single_instance_mode(tmp_path):
    """batch_axis=None compiles the graph as its shapes say (the batch fixed by input_shapes)."""
    torch.manual_seed(3)
    m = MLP([8, 16, 2])
    path = _export(m, torch.randn(2, 8), tmp_path / "m.onnx", False)
    net = luisaml.compile(path, batch_axis=None, input_shapes={"x": [5, 8]})
    x = torch.randn(5, 8)
    np.testing.assert_allclose(net.run({"x": x.numpy()})["y"], m(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(luisaml.ModelError, match=r"inputs with dynamic dimensions: 'x' \[batch, 8\]"):
        luisaml.compile(path, batch_axis=None)


def test_mixing_samples_compiles_per_batch_size(tmp_path):
    """A mean over the batch cannot run one sample at a time: the network compiles itself for
    each batch size it runs with, and its missing per-sample forward names the node."""
    class Norm(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(dim=0, keepdim=True)  # mean over the batch

    path = _export(Norm(), torch.randn(3, 4), tmp_path / "norm.onnx", False)
    net = luisaml.compile(path)
    assert isinstance(net, luisaml.PerBatchNetwork)
    with pytest.raises(luisaml.UsageError, match=r"ReduceMean.*mixes samples across the batch"):
        net.forward
    for n in (3, 6):
        x = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
        np.testing.assert_allclose(net.run({"x": x})["y"], x - x.mean(0, keepdims=True), rtol=1e-5, atol=1e-6)
    net = luisaml.compile(path, batch_axis=None, input_shapes={"x": [3, 4]})  # as one instance too
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(net.run({"x": x})["y"], x - x.mean(0, keepdims=True), rtol=1e-5, atol=1e-6)


def test_rows_of_a_sample_folded_into_the_batch_dimension(tmp_path):
    """[B, 4, 3] viewed as [4B, 3] keeps each sample's rows together: per sample it is 4 rows."""

    class Rows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(3, 5)

        def forward(self, x):
            return torch.relu(self.l(x.reshape(-1, 3)))  # [4B, 5] as a graph output

    torch.manual_seed(4)
    m = Rows()
    net = luisaml.compile(_export(m, torch.randn(2, 4, 3), tmp_path / "rows.onnx", False))
    out = next(s for s in net.outputs)
    assert out.shape == ("4*batch", 5) and out.kernel_shape == (4, 5)
    x = torch.randn(7, 4, 3)
    np.testing.assert_allclose(net.run({"x": x.numpy()})["y"], m(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_concat_along_the_batch_compiles_per_batch_size(tmp_path):
    class Twice(torch.nn.Module):
        def forward(self, x):
            return torch.cat([x, x * 2], dim=0)

    net = luisaml.compile(_export(Twice(), torch.randn(2, 3), tmp_path / "twice.onnx", False))
    assert isinstance(net, luisaml.PerBatchNetwork)
    for n in (2, 5):
        x = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32)
        np.testing.assert_allclose(net.run({"x": x})["y"], np.concatenate([x, 2 * x]), rtol=1e-6)
