"""benchmarks/bench_detector.py cannot rot: on tiny frames (--quick) each side runs in its own process
over one frames file, checks its boxes against the torch reference saved there and writes a record with
the fields the GPU run writes. The torch-spconv side's own code (voxelization, the shift that keeps the
strided layer's coordinates whole, the BEV scatter, the head) runs against a stand-in spconv that does
spconv's arithmetic with dense convolutions, since spconv itself does not install here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_detector.py"

FAKE_SPCONV = '''
import torch
import torch.nn.functional as F


class SparseConvTensor:
    def __init__(self, features, indices, spatial_shape, batch_size, indice_dict=None):
        self.features, self.indices, self.spatial_shape = features, indices, list(spatial_shape)

    def replace_feature(self, features):
        return SparseConvTensor(features, self.indices, self.spatial_shape, 1)

    def grid(self, values):
        g = torch.zeros((1, values.shape[1], *self.spatial_shape))
        i = self.indices.long()
        g[0, :, i[:, 1], i[:, 2], i[:, 3]] = values.T
        return g


class _Conv(torch.nn.Module):  # spconv's weight layout [C_out, k0, k1, k2, C_in]
    def __init__(self, cin, cout, k, stride=1, padding=None, bias=True, indice_key=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(cout, k, k, k, cin))
        self.bias = torch.nn.Parameter(torch.zeros(cout))
        self.k, self.stride, self.padding = k, stride, (k - 1) // 2 if padding is None else padding

    def dense(self, x):
        return F.conv3d(x.grid(x.features), self.weight.permute(0, 4, 1, 2, 3), self.bias, self.stride, self.padding)


class SubMConv3d(_Conv):  # the input's sites
    def forward(self, x):
        i = x.indices.long()
        return x.replace_feature(self.dense(x)[0, :, i[:, 1], i[:, 2], i[:, 3]].T.contiguous())


class SparseConv3d(_Conv):  # every site some input reaches, in the output's shape
    def forward(self, x):
        reach = F.conv3d(x.grid(torch.ones((len(x.features), 1))), torch.ones((1, 1, self.k, self.k, self.k)),
                         stride=self.stride, padding=self.padding)[0, 0]
        o = torch.nonzero(reach > 0)
        idx = torch.cat([torch.zeros((len(o), 1), dtype=torch.int32), o.to(torch.int32)], 1)
        values = self.dense(x)[0, :, o[:, 0], o[:, 1], o[:, 2]].T.contiguous()
        return SparseConvTensor(values, idx, list(reach.shape), 1)
'''


def bench(*args, env=None, timeout=600):
    out = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--quick", "--reps", "2", *args],
                         check=False, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    d = tmp_path_factory.mktemp("detector")
    bench("--side", "frames", "--out-dir", str(d))
    return d


@pytest.mark.slow  # fresh processes with torch and a kernel build: ~30 s (CI runs slow tests)
def test_luisaml_side_and_the_torch_fallback_over_the_same_frames(frames):
    out = bench("--side", "luisaml", "--out-dir", str(frames))
    rec = json.loads((frames / "detector-luisaml-cpu-quick.json").read_text())
    assert rec["correct"] and len(rec["checks"]) == 3 and len(set(rec["points"])) == 3
    assert all(c["same_count"] and c["same_labels"] and c["detections"] > 0 for c in rec["checks"])
    assert set(rec["frame_ms"]) == {"p50", "p95", "p99", "n"} and rec["frame_ms"]["n"] == 6
    # the host's part: the wall time less the waits for the stream, so within the frame's
    assert rec["host_ms"]["n"] == 6 and 0 < rec["host_ms"]["p50"] <= max(rec["frames"][0]["ms"] + rec["frames"][1]["ms"]
                                                                        + rec["frames"][2]["ms"])
    for key in ("syncs_per_frame", "launches_per_frame", "peak_bytes"):
        assert rec[key] > 0, key
    for name in ("backbone", "head"):
        p = rec["profile"][name]
        assert p["run_ms"] > 0 and p["kernels_ms"] > 0 and p["launches"] >= 1 and p["stages"] > 0
        assert p["syncs"] == 1  # the head's CircleNMS count too stays on the device: one wait a run
    assert rec["syncs_per_frame"] == 2  # (the grids built on the host on the CPU backend)
    assert rec["voxelize"] == "device" and "feeds_ms" in rec["profile"]  # (voxelized in the backbone network)
    bench("--side", "luisaml", "--voxelize", "host", "--out-dir", str(frames))
    host = json.loads((frames / "detector-luisaml-host-voxels-cpu-quick.json").read_text())
    assert host["correct"] and host["voxelize"] == "host" and host["profile"]["voxelize_ms"] > 0
    out = bench("--side", "torch-spconv", "--out-dir", str(frames))
    assert "spconv is not importable here" in out and "end to end, P50: luisaml" in out
    other = json.loads((frames / "detector-torch-spconv-cpu-quick.json").read_text())
    assert other["correct"] and "torch_ops reference" in other["pipeline"]
    assert other["frames_sha256"] == rec["frames_sha256"]


@pytest.mark.slow
def test_the_spconv_pipeline_equals_the_reference_on_a_stand_in_spconv(frames, tmp_path):
    (tmp_path / "spconv").mkdir()
    (tmp_path / "spconv" / "__init__.py").write_text('__version__ = "stand-in"\n')
    (tmp_path / "spconv" / "pytorch.py").write_text(FAKE_SPCONV)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    bench("--side", "torch-spconv", "--out-dir", str(frames), env=env)
    rec = json.loads((frames / "detector-torch-spconv-cpu-quick.json").read_text())
    assert rec["correct"] and rec["pipeline"].endswith("spconv stand-in") and rec["weight_taps"] == "same"
    assert all(c["same_count"] and c["detections"] > 0 for c in rec["checks"])
