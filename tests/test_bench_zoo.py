"""benchmarks/bench_zoo.py cannot rot: a zoo network at batch 2 goes through the correctness path
(checked against onnxruntime, then timed against every CPU baseline) into a results file whose
table renders; a network that fails is recorded with its error, and a mismatch is never timed."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.slow  # a fresh process with torch, onnxruntime and a kernel build: ~15 s
def test_zoo_network_checked_and_timed_against_every_cpu_baseline(tmp_path):
    out = tmp_path / "zoo.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_zoo.py"), "--only", "cifar-cnn",
                          "--batch", "2", "--reps", "3", "--budget", "1", "--out", str(out)],
                         check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["omp_wait_policy"]
    (rec,) = doc["records"]
    assert rec["model"] == "cifar-cnn" and rec["status"] == "ok", rec
    assert rec["inputs"] == {"x": [2, 3, 32, 32]}
    assert rec["rel_err"] <= rec["tol"] <= max(1e-4, 10 * rec["reference_floor"])
    for side in ("luisaml", "ort", "ort_1thread", "torch"):
        assert set(rec["ms"][side]) == {"p50", "p95", "p99"} and rec["ms"][side]["p50"] > 0
    assert rec["x_ort"] == pytest.approx(rec["ms"]["luisaml"]["p50"] / rec["ms"]["ort"]["p50"])
    assert doc["summary"]["x_ort"]["geomean"] == pytest.approx(rec["x_ort"])
    table = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_zoo.py"), "--table", "--out", str(out)],
                           check=True, capture_output=True, text=True, timeout=120).stdout
    assert "| cifar-cnn | 2 | 3x32x32 |" in table and "1 of 1 networks pass." in table


def test_mismatch_is_recorded_not_passed():
    import bench_zoo

    ref = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    rec = {"status": "ok"}
    assert bench_zoo.check(rec, ref * (1 + 1e-6), ref, floor=0.0) and rec["status"] == "ok"
    bad = ref.copy()
    bad[1, 3] += 0.01 * np.abs(ref).max()
    assert not bench_zoo.check(rec, bad, ref, floor=0.0)
    assert rec["status"] == "mismatch" and "relative error 0.01" in rec["error"]
    rec = {"status": "ok"}
    assert not bench_zoo.check(rec, np.full_like(ref, np.nan), ref, floor=0.0) and rec["status"] == "mismatch"
    rec = {"status": "ok"}  # two references that disagree by 2e-3 leave room for 2e-2
    assert bench_zoo.check(rec, bad, ref, floor=2e-3) and rec["tol"] == pytest.approx(2e-2)


def test_failed_export_is_recorded_with_its_first_line(tmp_path):
    import torch

    import bench_zoo
    from zoo_models import Net

    net = Net("wrong input", "cnn", lambda: torch.nn.Linear(4, 2), lambda b, q: {"x": torch.zeros(b, 5)}, 2, 2)
    rec = bench_zoo.bench_cpu(net, 2, False, tmp_path, reps=3, budget_s=1, profile=0)
    assert rec["status"] == "export failed" and "\n" not in rec["error"] and "4" in rec["error"], rec
    doc = {"device": "cpu", "records": [rec], "summary": bench_zoo.summary([rec], "cpu")}
    assert "| wrong input | 2 |" in bench_zoo.table(doc) and "**export failed**" in bench_zoo.table(doc)
    assert doc["summary"]["failed"] == {"wrong input": "export failed"} and doc["summary"]["ok"] == 0
