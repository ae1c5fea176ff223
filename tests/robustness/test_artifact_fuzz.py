"""The artifact fuzzer's CI sample (tests/robustness/artifact_fuzz.py: 300 mutated .lml files of an
MLP, a small CNN and an If model), in a child process so that an abort or a hang fails the test.
The full run is `python -m tests.robustness.artifact_fuzz --full`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from suite_mode import full_run

pytestmark = pytest.mark.robustness
REPO = Path(__file__).resolve().parents[2]


def test_artifact_fuzz_sample():
    env = dict(os.environ, LUISAML_BACKEND="cpu")
    full = full_run()
    r = subprocess.run([sys.executable, "-m", "tests.robustness.artifact_fuzz"] + (["--full"] if full else []),
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=3600 if full else 600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "FAIL" not in r.stdout and ("cases" if full else "300 cases") in r.stdout, r.stdout
