"""A loaded .lml's first run is served from LuisaCompute's kernel cache when an earlier load (or a
compile) of the same artifact built its kernels: the module load regenerates hashes to the kernel
LuisaCompute cached, so no kernel is built again, even from another luisaml cache folder.

LuisaCompute's CPU backend caches kernels in `.cache` beside the running Python executable, shared
by every process of that Python; the processes here run on a private copy of the interpreter
(`venv --copies`) so that the folder starts empty and no other test adds to it meanwhile."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import luisaml

RUN = """
import json, os, sys
import numpy as np
import luisaml
from luisaml import cache
kdir = cache.kernel_cache_dir()
def kernels():
    return {n: os.stat(kdir / n).st_mtime_ns for n in os.listdir(kdir) if n.startswith('kernel_')} if kdir.is_dir() else {}
before = kernels()
net = luisaml.load(sys.argv[1])
feeds = dict(np.load(sys.argv[2]))
out = net.run(feeds)
np.savez(sys.argv[3], **out)
after = kernels()
print(json.dumps({'dir': str(kdir), 'new': sorted(set(after) - set(before)),
                  'rewritten': sorted(n for n in before if after.get(n) != before[n])}))
"""


@pytest.fixture(scope="module")
def private_python(tmp_path_factory) -> Path:
    """A copy of this interpreter with this environment's packages, whose kernel cache is its own."""
    d = tmp_path_factory.mktemp("py")
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--without-pip", str(d)], check=True, timeout=300)
    purelib = Path(sysconfig.get_paths(vars={"base": str(d), "platbase": str(d)})["purelib"])
    dirs = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "outer_env.pth").write_text("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in dirs) + "\n")
    return d / "bin" / "python"


def test_a_second_load_builds_no_kernel_even_from_another_module_cache(private_python, tmp_path):
    from robustness.artifact_fuzz import cnn_model

    model, feeds, _ = cnn_model()
    net = luisaml.compile(model)
    want = net.run(feeds)
    lml = net.save(tmp_path / "cnn.lml", model_name="cnn.onnx")
    np.savez(tmp_path / "feeds.npz", **feeds)

    def load_and_run(tag: str, module_cache: str) -> dict:
        env = dict(os.environ, LUISAML_BACKEND="cpu", LUISAML_CACHE=str(tmp_path / module_cache))
        r = subprocess.run([str(private_python), "-c", RUN, str(lml), str(tmp_path / "feeds.npz"),
                            str(tmp_path / f"{tag}.npz")], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        said = json.loads(r.stdout.strip().splitlines()[-1])
        got = dict(np.load(tmp_path / f"{tag}.npz"))
        for k in want:  # bit for bit the compiled network's outputs, every time
            assert got[k].tobytes() == np.ascontiguousarray(want[k]).tobytes(), (tag, k)
        return said

    cold = load_and_run("cold", "a")
    assert cold["dir"] == str(private_python.parent / ".cache")
    assert any(n.endswith(".bc") for n in cold["new"]), cold  # the copy's own cache got the kernels
    warm = load_and_run("warm", "a")
    assert warm["new"] == [] and warm["rewritten"] == [], warm
    elsewhere = load_and_run("elsewhere", "b")  # the module regenerated into another cache folder
    assert elsewhere["new"] == [] and elsewhere["rewritten"] == [], elsewhere
