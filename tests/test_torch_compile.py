"""luisaml.torch.compile: a torch module exported (torch.onnx.export, dynamo=False, a symbolic batch
on dim 0), compiled, and handed back as a torch.nn.Module whose outputs equal the module's own."""
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
