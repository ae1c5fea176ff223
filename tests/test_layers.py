"""The import layers of .importlinter hold (issue 26): lint-imports over the package as the wheel lays
it out. In a checkout, operators/, opsets/ and shaders/ sit beside luisaml/ and reach it through
setuptools' package-dir mapping, which grimp (import-linter's graph builder) does not follow; the
test copies them into one luisaml/ folder first, so that every import, lazy ones included, is seen."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_import_points_down_the_layers(tmp_path):
    pytest.importorskip("importlinter")
    pkg = tmp_path / "luisaml"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "luisaml", pkg, ignore=ignore)
    for part in ("operators", "opsets", "shaders"):
        shutil.copytree(ROOT / part, pkg / part, ignore=ignore)
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    # lint_imports' console entry point, run from the interpreter the tests use
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    r = subprocess.run([sys.executable, "-c", code, "--config", ".importlinter", "--no-cache"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout, r.stdout[-3000:]
