"""What a non-editable install holds: the wheel setuptools builds from pyproject.toml carries every
module and template of the source tree (a package missing from its list installs fine and then
fails at the first import of it: luisaml.rewrites did, so no installed luisaml could compile a model
or load a .lml)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir mapping)
TREES = {"luisaml": "luisaml", "operators": "luisaml/operators", "opsets": "luisaml/opsets",
         "shaders": "luisaml/shaders"}


def _source_files() -> set[str]:
    """Every file the installed package needs, as its path inside the wheel."""
    out = set()
    for src, dest in TREES.items():
        for p in (ROOT / src).rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".j2", ".json", ".typed"):
                out.add(f"{dest}/{p.relative_to(ROOT / src).as_posix()}")
    return out


def test_every_package_folder_is_listed():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    folders = {f"{dest}/{p.parent.relative_to(ROOT / src).as_posix()}".rstrip("/.").replace("/", ".")
               for src, dest in TREES.items() for p in (ROOT / src).rglob("__init__.py") if "__pycache__" not in p.parts}
    assert folders - listed == set(), "packages missing from pyproject.toml's [tool.setuptools] packages"


def test_the_wheel_holds_every_module_and_template(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools in this environment")
    src = tmp_path / "src"  # (a copy: setuptools writes build/ and *.egg-info beside pyproject.toml)
    for tree in TREES:
        shutil.copytree(ROOT / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(src)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel, = tmp_path.glob("luisaml-*.whl")
    with zipfile.ZipFile(wheel) as z:
        held = set(z.namelist())
    assert _source_files() - held == set()
