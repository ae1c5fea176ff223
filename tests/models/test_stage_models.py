"""Whole networks as stages, compiled with the defaults, against onnxruntime: a small CNN (per
sample, any batch size), a ResNet-18 (torchvision's layout, built here: torchvision does not
install beside the CPU torch wheel) at a small resolution, and what `inspect` says of them."""
from __future__ import annotations

import io
from contextlib import redirect_stdout

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from util import ort_run, stage_of

import luisaml
from luisaml import cli

pytestmark = pytest.mark.slow


def _export(module, shape, path) -> str:
    module.eval()
    torch.onnx.export(module, (torch.randn(*shape),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return str(path)


def _check(net, path, x, rtol=1e-4, atol=1e-4):
    want = ort_run(onnx.load(path), {"x": x})["y"]
    got = net.run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * max(1.0, float(np.abs(want).max())))


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.c1(x)), 2)
        x = F.max_pool2d(torch.relu(self.bn(self.c2(x))), 2)
        return self.fc(x.flatten(1))


class BasicBlock(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(torch.nn.Module):
    """torchvision.models.resnet18's layers and shapes, random weights and batch statistics."""

    def __init__(self, classes=1000):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(64)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(512, classes)
        for m in self.modules():  # non-trivial batch statistics, so BatchNormalization matters
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def test_small_cnn_runs_as_parallel_stages(tmp_path):
    torch.manual_seed(0)
    path = _export(SmallCNN(), (2, 3, 32, 32), tmp_path / "cnn.onnx")
    net = luisaml.compile(path)
    assert not isinstance(net, luisaml.PerBatchNetwork)
    domains = [st.domain for st in net.plan.schedule.stages]
    assert "sample" not in domains and "single" not in domains, net.plan.schedule.describe()
    conv2 = stage_of(net, "/c2/Conv")  # (the exporter folds the BatchNorm into the Conv's weights)
    assert {n.op_type for n, _ in conv2.epilogue} == {"Relu"}  # one stage: conv and relu
    for n in (1, 7):
        _check(net, path, np.random.default_rng(n).standard_normal((n, 3, 32, 32)).astype(np.float32))
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["inspect", path]) == 0
    assert "launched as one command list" in out.getvalue() and "epilogue" in out.getvalue()


def test_resnet18_matches_onnxruntime(tmp_path):
    torch.manual_seed(1)
    path = _export(ResNet18(classes=20), (2, 3, 64, 64), tmp_path / "resnet18.onnx")
    net = luisaml.compile(path)
    sched = net.plan.schedule
    convs = [st for st in sched.stages if st.root[0].op_type == "Conv"]
    assert len(convs) == 20  # every convolution a stage of its own (BN folded into it by the exporter)
    adds = {n.op_type for st in convs for n, _ in st.epilogue}
    assert {"Add", "Relu"} <= adds, sched.describe()  # the residual Add and the Relu: epilogues
    _check(net, path, np.random.default_rng(2).standard_normal((2, 3, 64, 64)).astype(np.float32), rtol=2e-4)
