"""A built .lml stands alone: every entry point that takes one (luisaml.load, InferenceSession, the
CLI's run, bench, inspect and emit) runs in a fresh process where onnx, onnxruntime and torch cannot
be imported, and gives what the compiled network gives in this process (bit for bit) and what
onnxruntime gives (within tolerance)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from util import assert_close_to_ort, assert_same_bits

import luisaml
from luisaml import artifact

# put first in a fresh process: any import of onnx, onnxruntime or torch raises, and at exit the
# process says on stderr which third-party modules it imported (none of them may be one of these)
BLOCK = """
import atexit, json, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('onnx', 'onnxruntime', 'torch'):
            raise ModuleNotFoundError(f'No module named {name!r} (blocked)', name=name)  # (as when not installed)
sys.meta_path.insert(0, Block())
atexit.register(lambda: print('IMPORTED ' + json.dumps(
    sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names))), file=sys.stderr))
"""
CLI = BLOCK + "from luisaml.cli import main\nsys.exit(main(sys.argv[1:]))\n"
SESSION = BLOCK + """
import numpy as np, luisaml
s = luisaml.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])
feeds = dict(np.load(sys.argv[2]))
names = [o.name for o in s.get_outputs()]
np.savez(sys.argv[3], **dict(zip(names, s.run(None, feeds))))
print(json.dumps({'inputs': [[a.name, a.shape, a.type] for a in s.get_inputs()],
                  'outputs': [[a.name, a.shape, a.type] for a in s.get_outputs()],
                  'providers': s.get_providers()}))
"""


def _blocked(code: str, *args, cwd) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `code` with ARGS in a fresh process (the CPU backend) where onnx, onnxruntime and torch
    cannot be imported; return the process and the third-party modules it imported."""
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                       env=dict(os.environ, LUISAML_BACKEND="cpu"), timeout=600)
    said = r.stderr.splitlines()
    imported = json.loads(said[-1][len("IMPORTED "):]) if said and said[-1].startswith("IMPORTED ") else None
    return r, imported


def _none_of_them(imported) -> None:
    assert imported is not None, "the process never reached its exit"
    assert not {"onnx", "onnxruntime", "torch"} & set(imported), imported


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """(onnx model, feeds, the compiled network's outputs, the .lml, the feeds' .npz) of a small CNN."""
    from robustness.artifact_fuzz import cnn_model

    d = tmp_path_factory.mktemp("standalone")
    model, feeds, _ = cnn_model()
    net = luisaml.compile(model)
    want = net.run(feeds)
    lml = net.save(d / "cnn.lml", model_name="cnn.onnx")
    np.savez(d / "feeds.npz", **feeds)
    return model, feeds, want, lml, d / "feeds.npz"


def test_session_over_a_lml_runs_without_onnx_or_torch(cnn, tmp_path):
    model, feeds, want, lml, npz = cnn
    r, imported = _blocked(SESSION, lml, npz, tmp_path / "out.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    _none_of_them(imported)
    with np.load(tmp_path / "out.npz") as z:
        got = {k: z[k] for k in z.files}
    assert_same_bits(got, want)
    assert_close_to_ort(got, model, feeds)
    said = json.loads(r.stdout.strip().splitlines()[-1])
    # what onnxruntime's own session over the ONNX model lists
    import onnxruntime as ort

    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert said["inputs"] == [[a.name, a.shape, a.type] for a in ref.get_inputs()]
    assert said["outputs"] == [[a.name, a.shape, a.type] for a in ref.get_outputs()]
    assert said["providers"] == ref.get_providers()


def test_cli_run_on_a_lml_without_onnx_or_torch(cnn, tmp_path):
    model, feeds, want, lml, _ = cnn
    for name, v in feeds.items():
        np.save(tmp_path / f"{name}.npy", v)
    given = [f"--input={k}={tmp_path / k}.npy" for k in feeds]
    r, imported = _blocked(CLI, "run", lml, *given, "--out", tmp_path / "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    _none_of_them(imported)
    got = {k: np.load(tmp_path / "out" / f"{k}.npy") for k in want}
    assert_same_bits(got, want)
    assert_close_to_ort(got, model, feeds)


def test_cli_bench_on_a_lml_without_onnx_or_torch(cnn, tmp_path):
    *_, lml, _ = cnn
    trace = tmp_path / "trace.json"
    r, imported = _blocked(CLI, "bench", lml, "--warmup", "1", "--iterations", "2", "--profile-json", trace,
                           cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    _none_of_them(imported)
    assert "latency: P50" in r.stdout and "throughput:" in r.stdout, r.stdout
    # one event a stage of the artifact's plan, as the network loaded here has them
    stages = len(luisaml.load(lml).plan.schedule.stages)
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert len([e for e in events if e.get("ph") == "X"]) == stages


def test_cli_inspect_on_a_lml_without_onnx_or_torch(cnn, tmp_path):
    *_, lml, _ = cnn
    page = tmp_path / "r.html"
    r, imported = _blocked(CLI, "inspect", lml, "--json", "--html", page, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    _none_of_them(imported)
    rep = json.loads(r.stdout)
    art = artifact.read(lml)
    assert rep["artifact"]["content_hash"] == art.manifest["content_hash"]
    assert rep["nodes"] == art.report["nodes"]
    assert page.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")


def test_cli_emit_on_a_lml_without_onnx_or_torch(cnn, tmp_path):
    *_, lml, _ = cnn
    r, imported = _blocked(CLI, "emit", lml, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    _none_of_them(imported)
    # the module the artifact's manifest names by its hash, which load regenerates and checks
    assert hashlib.sha256(r.stdout.encode()).hexdigest() == artifact.read(lml).manifest["source_sha256"]


def test_cli_on_a_model_without_onnx_names_the_package_to_install(cnn, tmp_path):
    """What needs onnx (compiling a model: run, build, inspect of an .onnx) says so in one line, exit 2,
    instead of an internal error."""
    from onnx import save

    model, *_ = cnn
    save(model, str(tmp_path / "m.onnx"))
    for args in (["run", tmp_path / "m.onnx"], ["build", tmp_path / "m.onnx", "-o", tmp_path / "m.lml"],
                 ["inspect", tmp_path / "m.onnx"]):
        r, imported = _blocked(CLI, *args, cwd=tmp_path)
        lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("IMPORTED ")]
        assert r.returncode == 2 and len(lines) == 1, (args, r.stderr)
        assert "needs the Python package 'onnx', which is not installed (pip install onnx)" in lines[0], lines
        assert "internal error" not in lines[0] and "runs built .lml artifacts" in lines[0]
        _none_of_them(imported)
