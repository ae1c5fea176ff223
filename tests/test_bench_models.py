"""benchmarks/bench_models.py cannot rot: its --quick smoke run (one tiny model, checked against
onnxruntime, timed against it) writes a record with every field the full run writes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a fresh process with torch, onnxruntime and a kernel build: ~20 s (CI runs slow tests)
def test_bench_models_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_models.py"), "--cpu", "--quick",
                          "--out-dir", str(tmp_path)], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    records = json.loads((tmp_path / "models-cpu.json").read_text())
    assert len(records) == 1
    rec = records[0]
    for key in ("model", "batch", "luisaml_ms", "ort_ms", "ratio", "rel_err", "compile_s", "machine", "date"):
        assert key in rec, key
    for side in ("luisaml_ms", "ort_ms"):
        assert set(rec[side]) == {"p50", "p95", "p99"} and rec[side]["p50"] > 0
    assert rec["rel_err"] <= 1e-4
    assert "| model |" in out.stdout


@pytest.mark.slow  # a fresh process with torch and a kernel build
def test_profile_stages_prints_each_stage_with_its_rate():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "experiments" / "profile_stages.py"), "--model", "small cnn",
                          "--batch", "32", "--top", "3"], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if " TFLOP/s  stage " in ln]
    assert len(lines) == 3 and all(float(ln.split("%")[1].split("TFLOP/s")[0]) >= 0 for ln in lines)
    assert any("Conv" in ln and float(ln.split("%")[1].split("TFLOP/s")[0]) > 0 for ln in lines)
