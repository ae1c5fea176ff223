"""luisaml.torch.compile: a torch module exported (torch.onnx.export's dynamo exporter, TorchScript's
where that fails; a symbolic batch on dim 0), compiled, and handed back as a torch.nn.Module whose
outputs equal the module's own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import luisaml
import luisaml.torch as lt


class TwoHeads(torch.nn.Module):
    """Two inputs, two outputs: a small CNN on an image and a dense layer on a feature vector."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)
        self.fc = torch.nn.Linear(6 * 4 * 4 + 5, 4)

    def forward(self, image, features):
        h = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(image))), 2).flatten(1)
        logits = self.fc(torch.cat([h, features], dim=1))
        return logits, torch.softmax(logits, dim=-1)


def test_outputs_equal_the_module_for_other_batch_sizes():
    torch.manual_seed(0)
    m = TwoHeads().eval()
    compiled = luisaml.torch.compile(m, (torch.randn(2, 3, 8, 8), torch.randn(2, 5)))
    assert isinstance(compiled, torch.nn.Module) and compiled.input_names == ["image", "features"]
    assert [s.shape for s in compiled.net.inputs] == [("batch", 3, 8, 8), ("batch", 5)]
    for n in (1, 7):
        image, features = torch.randn(n, 3, 8, 8), torch.randn(n, 5)
        got = compiled(image, features)
        with torch.no_grad():
            want = m(image, features)
        assert isinstance(got, tuple) and len(got) == 2
        for g, w in zip(got, want):
            assert isinstance(g, torch.Tensor) and g.device == image.device and g.dtype == w.dtype
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    by_name = compiled(features=features, image=image)  # by name, as the module's forward takes them
    torch.testing.assert_close(by_name[0], got[0])


def test_one_output_is_a_tensor_and_the_module_is_left_as_it_was():
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).train()
    compiled = lt.compile(m, torch.randn(4, 5), output_names=["y"])
    assert m.training  # exported in eval mode, handed back as it came
    x = torch.randn(9, 5)
    y = compiled(x)
    assert isinstance(y, torch.Tensor) and y.shape == (9, 3)
    torch.testing.assert_close(y, m(x).detach(), rtol=1e-5, atol=1e-6)
    assert compiled.net.output_names == ["y"] and "backend=" in repr(compiled)


def test_fixed_shapes_when_told_and_errors():
    m = torch.nn.Linear(3, 2)
    compiled = lt.compile(m, torch.randn(4, 3), dynamic_axes={})
    assert compiled.net.batch_symbol is None
    np.testing.assert_allclose(compiled(torch.ones(4, 3)).numpy(), m(torch.ones(4, 3)).detach().numpy(), rtol=1e-6)
    with pytest.raises(luisaml.InputError):
        compiled(torch.ones(5, 3))
    with pytest.raises(luisaml.UsageError, match="torch.nn.Module"):
        lt.compile(lambda x: x, torch.ones(1))
    with pytest.raises(luisaml.UsageError, match="takes 1 input "):
        compiled(torch.ones(4, 3), torch.ones(4, 3))


def _compile_quietly(capfd, *args, **kwargs):
    """Return lt.compile(*args, **kwargs) with every warning it lets out recorded; assert none is a
    deprecation or future notice and that torch's exporter logged nothing to the terminal."""
    import warnings

    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = lt.compile(*args, **kwargs)
    noise = [f"{w.category.__name__}: {w.message}" for w in caught
             if issubclass(w.category, (DeprecationWarning, FutureWarning, UserWarning))]
    assert not noise, noise
    out, err = capfd.readouterr()
    assert "deprecat" not in (out + err).lower() and "torch.onnx" not in err and "torchvision" not in err, out + err
    return compiled


def _assert_equals_module(compiled, module, batches=(1, 7)):
    for n in batches:
        image, features = torch.randn(n, 3, 8, 8), torch.randn(n, 5)
        with torch.no_grad():
            want = module(image, features)
        for g, w in zip(compiled(image, features), want):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_the_dynamo_exporter_where_it_works_without_deprecation_noise(capfd):
    torch.manual_seed(3)
    m = TwoHeads().eval()
    compiled = _compile_quietly(capfd, m, (torch.randn(2, 3, 8, 8), torch.randn(2, 5)))
    assert compiled.exporter == "dynamo"
    assert [s.shape for s in compiled.net.inputs] == [("batch", 3, 8, 8), ("batch", 5)]
    _assert_equals_module(compiled, m)


def test_torchscript_when_the_dynamo_exporter_fails_quietly(capfd, monkeypatch):
    """A module torch.export cannot take (forced: the dynamo export raises) is exported by TorchScript,
    with no deprecation notice; exporter="dynamo" raises that failure instead."""
    def fail(*args, **kwargs):
        raise RuntimeError("torch.export cannot trace this module")

    monkeypatch.setattr(lt, "_export_dynamo", fail)
    torch.manual_seed(4)
    m = TwoHeads().eval()
    example = (torch.randn(2, 3, 8, 8), torch.randn(2, 5))
    compiled = _compile_quietly(capfd, m, example)
    assert compiled.exporter == "torchscript"
    assert [s.shape for s in compiled.net.inputs] == [("batch", 3, 8, 8), ("batch", 5)]
    _assert_equals_module(compiled, m)
    with pytest.raises(RuntimeError, match="cannot trace"):
        lt.compile(m, example, exporter="dynamo")
    with pytest.raises(luisaml.UsageError, match="exporter must be one of"):
        lt.compile(m, example, exporter="onnx")


def _on_cuda(fn):
    """Mark a test that needs luisaml's CUDA backend (skipped elsewhere, as tests/gpu are)."""
    from util import cuda_only

    for mark in cuda_only():
        fn = mark(fn)
    return fn


@_on_cuda
def test_cuda_tensors_in_cuda_tensors_out_without_copies():
    """On the CUDA backend the compiled module takes and returns torch CUDA tensors, shared with
    the kernels through DLPack: no buffer of luisaml's own for an input or an output."""
    torch.manual_seed(2)
    two = TwoHeads().eval()
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).eval()
    cases = [(two, (torch.randn(2, 3, 8, 8), torch.randn(2, 5))), (mlp, (torch.randn(8, 32),))]
    for module, example in cases:
        compiled = lt.compile(module, example)
        assert compiled.net.backend == "cuda"
        n = 4099
        cpu_inputs = tuple(torch.randn(n, *e.shape[1:]) for e in example)
        got = compiled(*(x.cuda() for x in cpu_inputs))
        got = (got,) if isinstance(got, torch.Tensor) else got
        with torch.no_grad():
            want = module(*cpu_inputs)  # torch on the CPU: no TF32 in the reference
        want = (want,) if isinstance(want, torch.Tensor) else want
        for g, w in zip(got, want):
            assert g.is_cuda and g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
        io = {s.ident for s in compiled.net.inputs + compiled.net.outputs}
        assert not [k for k in compiled.net.pool.held if k[0] in io], "torch CUDA tensors were copied"


# ---- torch.compile(model, backend="luisaml") ------------------------------------------------------
def test_torch_compile_backend_luisaml_matches_the_module_and_falls_back_eagerly(monkeypatch):
    import tomllib
    import warnings
    from pathlib import Path

    import luisaml.torch as lt
    from torch._dynamo.backends.registry import lookup_backend

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["torch_dynamo_backends"]["luisaml"] == "luisaml.torch:dynamo_backend"
    assert lookup_backend("luisaml") is not None  # registered on import of luisaml.torch
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).eval()
    x = torch.randn(4, 5)
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")  # no deprecation noise, no fallback
        y = torch.compile(m, backend="luisaml")(x)
    torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-6)

    def refuse(*a, **k):
        raise luisaml.UsageError("no such operator")

    monkeypatch.setattr(lt, "compile", refuse)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="cannot compile this torch.compile subgraph.*runs eagerly.*no such operator"), \
            torch.no_grad():
        y = torch.compile(m, backend="luisaml")(x)
    torch.testing.assert_close(y, m(x))
    torch._dynamo.reset()
