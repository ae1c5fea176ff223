"""`luisaml.load` + first run of ResNet-18's .lml on the CPU backend, with LuisaCompute's kernel
cache cold (empty) and warm (filled by an earlier load of the same artifact), and whether the warm
first run is served from that cache.

    python benchmarks/bench_first_run.py [--rounds 3] [--lml FILE] [--out-dir DIR] [--json FILE]

LuisaCompute's CPU backend keeps its kernels in `.cache` beside the running Python executable
(`/proc/self/exe`'s folder, its choice): a folder every process of that Python shares. To make it
cold without touching anyone else's, the script runs the measured processes on a private copy of
the interpreter (`python -m venv --copies` in a temporary folder, this environment's packages on its
path through a .pth file), so their kernel cache is that copy's own folder.

Each round: the kernel cache and luisaml's module cache (LUISAML_CACHE, a private folder) are
emptied, then one fresh process (cold) and two more (warm) each `import luisaml`, `luisaml.load`
the artifact, run it twice on the same input and check the outputs against the builder's (bit for
bit). Each process reports its times (wall; and CPU time, its threads', which moves less on a shared
host but leaves out clang, a child process) and the kernel files (`kernel_<hash>.bc`, `.hash`) the cache
gained: a warm first run that adds no kernel_<hash>.bc was served from the cache (a hit). Printed: per round and
kind the times, and P50 over the rounds; the builder compiles bench_models.resnet18 (random
weights, seed 0, batch fixed at 1) unless --lml names an artifact."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import site
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import numpy as np
import luisaml
from luisaml import cache
t1 = time.perf_counter()
kdir = cache.kernel_cache_dir()
before = set(os.listdir(kdir)) if kdir.is_dir() else set()
c1 = time.process_time()
net = luisaml.load(sys.argv[1])
t2, c2 = time.perf_counter(), time.process_time()
x = np.load(sys.argv[2])
y1 = net.run({"x": x})["y"]
t3, c3 = time.perf_counter(), time.process_time()
y2 = net.run({"x": x})["y"]
t4 = time.perf_counter()
ref = np.load(sys.argv[3])
after = set(os.listdir(kdir))
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "first_run": t3 - t2, "second_run": t4 - t3,
                  "load_plus_first": t3 - t1, "load_cpu": c2 - c1, "first_run_cpu": c3 - c2, "equal": bool(np.array_equal(y1, ref) and np.array_equal(y2, ref)),
                  "kernel_dir": str(kdir), "new_kernel_files": sorted(after - before)}))
"""


def private_python(folder: Path) -> Path:
    """A copy of this interpreter whose kernel cache (.cache beside it) is its own, with this
    environment's packages importable; return its executable."""
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--without-pip", str(folder)], check=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(folder), "platbase": str(folder)})["purelib"])
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    (purelib / "outer_env.pth").write_text("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
    return folder / "bin" / "python"


def build(out: Path) -> tuple[Path, Path, Path]:
    """Export and compile ResNet-18, save its .lml, an input and the compiled network's output."""
    import torch

    sys.path.insert(0, str(HERE))
    from bench_models import resnet18

    import luisaml

    onnx_path, lml = out / "resnet18.onnx", out / "resnet18.lml"
    torch.manual_seed(0)
    torch.onnx.export(resnet18().eval(), torch.randn(1, 3, 224, 224), onnx_path, input_names=["x"],
                      output_names=["y"], dynamo=False)
    net = luisaml.compile(str(onnx_path), backend="cpu", batch_axis=None)
    net.save(lml)
    return lml, *inputs_and_reference(net, out)


def inputs_and_reference(net, out: Path) -> tuple[Path, Path]:
    """Write a random input and the network's output for it; return their paths."""
    x = np.random.default_rng(0).standard_normal(net.inputs[0].shape).astype(np.float32)
    np.save(out / "x.npy", x)
    np.save(out / "y.npy", net.run({"x": x})["y"])
    return out / "x.npy", out / "y.npy"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=2, help="warm processes a round")
    ap.add_argument("--lml", type=Path, default=None, help="an artifact (input 'x', output 'y') instead of ResNet-18")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the records here")
    a = ap.parse_args()
    out = a.out_dir or Path(tempfile.mkdtemp(prefix="luisaml-first-run-"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ["LUISAML_BACKEND"] = "cpu"
    if a.lml:
        import luisaml

        lml = a.lml
        x, ref = inputs_and_reference(luisaml.load(lml), out)
    else:
        lml, x, ref = build(out)
    py = private_python(out / "py")
    kdir = out / "py" / "bin" / ".cache"
    env = dict(os.environ, LUISAML_BACKEND="cpu", LUISAML_CACHE=str(out / "luisaml-cache"))
    records = []
    for r in range(a.rounds):
        shutil.rmtree(kdir, ignore_errors=True)
        shutil.rmtree(out / "luisaml-cache", ignore_errors=True)
        for i in range(1 + a.warm):
            t = time.perf_counter()
            p = subprocess.run([str(py), "-c", CHILD, str(lml), str(x), str(ref)], capture_output=True, text=True,
                               env=env, cwd=out)
            if p.returncode:
                sys.exit(f"round {r} process {i} failed:\n{p.stderr[-3000:]}")
            rec = json.loads(p.stdout.strip().splitlines()[-1])
            built = [n for n in rec["new_kernel_files"] if n.startswith("kernel_") and n.endswith(".bc")]
            rec.update(round=r, kind="cold" if i == 0 else "warm", wall=time.perf_counter() - t, built=built,
                       hit=not built)
            assert rec["kernel_dir"] == str(kdir), rec["kernel_dir"]
            records.append(rec)
            print(f"round {r} {rec['kind']}: import {rec['import']:.2f} s, load {rec['load']:.2f} s, first run "
                  f"{rec['first_run']:.2f} s, load + first run {rec['load_plus_first']:.2f} s, second run "
                  f"{rec['second_run'] * 1e3:.0f} ms (CPU time: load {rec['load_cpu']:.2f} s, first run "
                  f"{rec['first_run_cpu']:.2f} s); kernels built {len(built)}; outputs equal "
                  f"{rec['equal']}", flush=True)
    for kind in ("cold", "warm"):
        rs = [r for r in records if r["kind"] == kind]
        med = {k: statistics.median(r[k] for r in rs) for k in ("import", "load", "first_run", "load_plus_first", "load_cpu", "first_run_cpu")}
        print(f"P50 {kind} ({len(rs)} processes): " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items())
              + f"; served from the kernel cache: {sum(r['hit'] for r in rs)} of {len(rs)}")
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {lml} ({lml.stat().st_size / 2**20:.1f} MiB)")
    if a.json:
        a.json.write_text(json.dumps({"records": records, "loadavg": load}, indent=1))


if __name__ == "__main__":
    main()
