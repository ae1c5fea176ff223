"""The .lml artifact on the CUDA backend: a network built here (the fused MLP kernel; a CNN's stage
kernels) and loaded in a fresh process gives the compiled network's outputs bit for bit, and
onnxruntime's within the CUDA suite's tolerance, without importing onnx or torch. Skipped without
a CUDA device; run with the other CUDA tests:

    LUISAML_BACKEND=cuda python -m pytest tests/gpu -q"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from util import assert_close_scaled, cuda_only, export_batched, ort_run, torch_mlp

import luisaml

pytestmark = cuda_only()

LOAD_AND_RUN = """
import sys, json, numpy as np, luisaml
net = luisaml.load(sys.argv[1])
out = net.run(dict(np.load(sys.argv[2])))
np.savez(sys.argv[3], **out)
print(json.dumps({"imported": [m for m in ("onnx", "torch") if m in sys.modules], "backend": net.backend,
                  "fused": [st.domain for st in net.plan.schedule.stages]}))
"""


def _round_trip(net, feeds: dict, tmp_path) -> dict:
    want = net.run(feeds)
    lml = net.save(tmp_path / "net.lml")
    np.savez(tmp_path / "feeds.npz", **feeds)
    # cwd: the folder `-c` puts on sys.path, never a checkout that would shadow the luisaml of
    # PYTHONPATH (benchmarks/NOTES.md, "Running the GPU command on the lent machine")
    r = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, str(lml), str(tmp_path / "feeds.npz"),
                        str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, LUISAML_BACKEND="cuda"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout.strip().splitlines()[-1])
    assert said["imported"] == [] and said["backend"] == "cuda"
    with np.load(tmp_path / "out.npz") as z:
        got = {k: z[k] for k in z.files}
    for k, w in want.items():
        assert got[k].tobytes() == np.ascontiguousarray(w).tobytes(), f"{k}: not bit for bit"
    return said | {"outputs": got}


def test_fused_mlp_round_trip_bit_for_bit(tmp_path):
    path = export_batched(torch_mlp([32, 64, 64, 64, 4]), 32, tmp_path / "mlp.onnx")
    net = luisaml.compile(path, backend="cuda")
    feeds = {"x": np.random.default_rng(0).standard_normal((4099, 32)).astype(np.float32)}
    said = _round_trip(net, feeds, tmp_path)
    assert "fused" in said["fused"]  # the cooperative kernel, its dispatch size recomputed here
    assert_close_scaled(said["outputs"]["y"], ort_run(onnx.load(path), feeds)["y"], "mlp")


def test_cnn_stages_round_trip_bit_for_bit(tmp_path):
    class CNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 16, 3, padding=1)
            self.fc = torch.nn.Linear(16, 10)

        def forward(self, x):
            x = torch.nn.functional.max_pool2d(torch.relu(self.c1(x)), 2)
            return self.fc(torch.relu(self.c2(x)).mean(dim=(2, 3)))

    torch.manual_seed(0)
    path = tmp_path / "cnn.onnx"
    torch.onnx.export(CNN().eval(), (torch.zeros(2, 3, 16, 16),), str(path), dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
    net = luisaml.compile(path, backend="cuda")
    assert not net.plan.merged_stages  # a kernel per stage on CUDA
    feeds = {"x": np.random.default_rng(1).standard_normal((5, 3, 16, 16)).astype(np.float32)}
    said = _round_trip(net, feeds, tmp_path)
    assert_close_scaled(said["outputs"]["y"], ort_run(onnx.load(path), feeds)["y"], "cnn")


def test_a_cuda_artifact_is_refused_on_the_cpu_backend(tmp_path):
    path = export_batched(torch_mlp([4, 8, 2]), 4, tmp_path / "m.onnx")
    lml = luisaml.compile(path, backend="cuda").save(tmp_path / "m.lml")
    code = "import luisaml, sys; luisaml.load(sys.argv[1], backend='cpu')"
    r = subprocess.run([sys.executable, "-c", code, str(lml)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode != 0 and "built for the cuda backend and cannot run on cpu" in r.stderr


@pytest.mark.parametrize("batch", [1, 1000])
def test_torch_cuda_tensors_through_a_loaded_network(tmp_path, batch):
    path = export_batched(torch_mlp([16, 32, 3]), 16, tmp_path / "m.onnx")
    net = luisaml.compile(path, backend="cuda")
    loaded = luisaml.load(net.save(tmp_path / "m.lml"))
    x = torch.randn(batch, 16, device="cuda")
    y = loaded.run({"x": x})["y"]
    assert y.is_cuda and torch.equal(y, net.run({"x": x})["y"])  # DLPack zero-copy, as compiled
