"""Load time of a built .lml artifact: `luisaml.load(path)` and the first `run` in fresh processes,
and where the time goes.

One command per device (writes benchmarks/results/load-<device>.json and the device's part of the
"Load time" section of benchmarks/RESULTS.md; --out-dir and --no-md to write elsewhere or not):

    python benchmarks/bench_load.py                  # CPU backend: rapidocr's cls model, the bench MLPs
    python benchmarks/bench_load.py --device cuda    # CUDA: the bench MLPs (rapidocr's cls with --cls FILE)

A builder process compiles every model, runs it once (its outputs are the reference, and
LuisaCompute's kernel cache is then warm, as on a machine that has run the model before) and saves
the artifact. Then, per model, `--processes` fresh Python processes each import luisaml, load the
artifact, run it twice and check the outputs are the builder's bit for bit; the table is the P50
over those processes of each step:

- import: `import luisaml` (no onnx, no torch);
- read, hash: the zip read, and every member's sha256 and the content hash checked;
- device: LuisaCompute's device started (`luisa.init`);
- check: safe_source's whitelist over the module (only when the module is not in luisaml's cache);
- exec: the module written to the cache (when new) and imported;
- kernel build, split into: source (luisa-python's `sourceinspect.getsourcelines` of each function),
  AST->IR (the rest of luisa-python's compile: textwrap, ast.parse, the AST walk that builds
  LuisaCompute's IR), shader (LuisaCompute's `create_shader`: on the CPU backend a JIT of the LLVM
  bitcode it cached under .cache beside the Python executable, on CUDA NVRTC or its cache);
- run: the first run less its kernel build (uploads, launch, readback); steady: the second run;
- total: import + load + first run, timed inside the process; wall: the whole process, timed
  by this script (interpreter start and exit included).

Each model is timed three ways: "compile", the baseline in the same run (a fresh process runs
`luisaml.compile` on the ONNX model, onnx imported, caches warm, then the same two runs; its
`compile` column is the compile call); "empty", luisaml.load with an empty luisaml cache (each
process gets a new LUISAML_CACHE: the module is checked, written and compiled to bytecode, as on a
machine that never loaded it); "warm", luisaml.load with the cache the builder wrote. Targets (issue 13): total under 2 s for rapidocr's cls model
on the CPU backend, under 1 s for the MLPs on CUDA."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET_S = {"cpu": {"cls": 2.0}, "cuda": {"mlp": 1.0}}  # model family -> seconds (issue 13)
CLS_WHEEL = ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx")
STEPS = ["import", "compile", "read", "hash", "device", "check", "exec", "load other", "source", "AST->IR",
         "shader", "run", "total", "steady", "wall"]

# compiles every model, runs it once (the reference outputs), saves the artifact; sys.argv[1]: jobs.json
BUILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[2])
import numpy as np
import luisaml
jobs = json.load(open(sys.argv[1]))
for job in jobs:
    if job.get("mlp"):
        import bench_mlp
        k0, width, layers, out = job["mlp"]
        bench_mlp.export_onnx(bench_mlp.build_torch(k0, width, layers, out), k0, __import__("pathlib").Path(job["onnx"]))
    t = time.perf_counter()
    net = luisaml.compile(job["onnx"], backend=job["device"], **job["options"])
    feeds = dict(np.load(job["feeds"]))
    out = net.run(feeds)
    job["compile_and_first_run_s"] = time.perf_counter() - t
    np.savez(job["ref"], **out)
    net.save(job["lml"], model_name=job["name"])
    job["stages"] = len(net.plan.schedule.stages) if net.plan.schedule is not None else 1
    job["kernels"] = len(net.plan.kernels)
    job["module_bytes"] = len(net.source)
json.dump(jobs, open(sys.argv[1], "w"))
"""

# luisa-python's kernel build, timed from outside (benchmark instrumentation only): `spent` gets
# the outermost func.compile calls ("build"), sourceinspect's lookups and LuisaCompute's create_shader
INSTRUMENT = r"""
import sys, time
import sourceinspect
from luisa import lcapi
func_class = sys.modules["luisa.func"].func  # (luisa.func is the class: the package re-exports it)
spent = {"build": 0.0, "source": 0.0, "shader": 0.0}
depth = [0]
def timed(key, fn, outer_only=False):
    def wrapper(*a, **k):
        if outer_only and depth[0]:
            return fn(*a, **k)
        depth[0] += outer_only
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t
            depth[0] -= outer_only
    return wrapper
func_class.compile = timed("build", func_class.compile, outer_only=True)
sourceinspect.getsourcelines = timed("source", sourceinspect.getsourcelines)
lcapi.DeviceInterface.create_shader = timed("shader", lcapi.DeviceInterface.create_shader)
"""

# after INSTRUMENT: two runs, the bit-for-bit check, one JSON line with the steps
RUN_AND_REPORT = r"""
t1 = time.perf_counter()
out = net.run(feeds)
t2 = time.perf_counter()
net.run(feeds)
t3 = time.perf_counter()
with np.load(sys.argv[3]) as ref:
    same = all(out[k].tobytes() == ref[k].tobytes() for k in ref.files) and sorted(out) == sorted(ref.files)
steps.update({"source": spent["source"], "AST->IR": spent["build"] - spent["source"] - spent["shader"],
              "shader": spent["shader"], "run": (t2 - t1) - spent["build"], "total": t2 - t0, "steady": t3 - t2,
              "bit_for_bit": same, "imported": [m for m in ("onnx", "torch") if m in sys.modules]})
print(json.dumps(steps))
"""

# one fresh process: import luisaml, load the artifact (argv 1), run it on the feeds (argv 2)
LOAD = r"""
import time
t0 = time.perf_counter()
import luisaml
t_import = time.perf_counter()
import json, sys
import numpy as np
feeds = dict(np.load(sys.argv[2]))
net = luisaml.load(sys.argv[1])
t_load = time.perf_counter()
s = net.artifact.seconds
known = sum(s.get(k, 0.0) for k in ("read", "hash", "device init", "source check", "module exec"))
steps = {"import": t_import - t0, "compile": None, "read": s["read"], "hash": s["hash"], "device": s["device init"],
         "check": s.get("source check", 0.0), "exec": s["module exec"], "load other": (t_load - t_import) - known}
""" + INSTRUMENT + RUN_AND_REPORT

# the baseline, in the same run: a fresh process compiles the ONNX model (argv 1; options: argv 4)
COMPILE = r"""
import time
t0 = time.perf_counter()
import luisaml
t_import = time.perf_counter()
import json, sys
import numpy as np
feeds = dict(np.load(sys.argv[2]))
net = luisaml.compile(sys.argv[1], **json.loads(sys.argv[4]))
t_compile = time.perf_counter()
steps = {"import": t_import - t0, "compile": t_compile - t_import, "read": None, "hash": None, "device": None,
         "check": None, "exec": None, "load other": None}
""" + INSTRUMENT + RUN_AND_REPORT


def _python(args: list[str], **kw) -> subprocess.CompletedProcess:
    """Run this Python on args in a temporary folder (so that a checkout never shadows the luisaml
    the environment provides: the GPU machine's PYTHONPATH recipe, benchmarks/NOTES.md)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tempfile.gettempdir(), **kw)


def _cls_model(given: str | None, work: Path) -> Path | None:
    """Return rapidocr's text-direction classifier: --cls FILE, else pip's download of its wheel
    (as tests/models/test_real_models.py fetches it); None when neither is possible."""
    if given:
        return Path(given)
    r = _python(["-m", "pip", "download", "-q", "--no-deps", CLS_WHEEL[0], "-d", str(work)], timeout=300)
    wheels = list(work.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        print(f"rapidocr's cls model skipped: cannot download {CLS_WHEEL[0]} (give --cls FILE)", file=sys.stderr)
        return None
    out = work / "cls.onnx"
    with zipfile.ZipFile(wheels[0]) as z:
        out.write_bytes(z.read(CLS_WHEEL[1]))
    return out


def _jobs(device: str, cls: Path | None, work: Path, batch: int | None) -> list[dict]:
    sys.path.insert(0, str(HERE))
    import bench_mlp

    jobs = []
    rng = np.random.default_rng(0)
    if cls is not None:
        x = rng.uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)
        jobs.append({"name": "rapidocr cls", "family": "cls", "onnx": str(cls), "device": device,
                     "options": {"batch_axis": None, "input_shapes": {"x": [1, 3, 48, 192]}}, "feeds": {"x": x}})
    for name, k0, width, layers, out, _, cpu_batch, _ in bench_mlp.MODELS:
        n = batch or (cpu_batch if device == "cpu" else 65536)
        x = rng.standard_normal((n, k0)).astype(np.float32)
        jobs.append({"name": f"mlp {name}", "family": "mlp", "onnx": str(work / f"mlp-{name}.onnx"), "device": device,
                     "options": {}, "mlp": [k0, width, layers, out], "feeds": {"x": x}, "batch": n})
    for k, job in enumerate(jobs):
        np.savez(work / f"feeds{k}.npz", **job["feeds"])
        job["feeds"] = str(work / f"feeds{k}.npz")
        job["ref"] = str(work / f"ref{k}.npz")
        job["lml"] = str(work / f"model{k}.lml")
    return jobs


def _p50(rows: list[dict]) -> dict:
    return {k: None if rows[0][k] is None else float(np.median([r[k] for r in rows])) for k in STEPS}


def _machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start"
    if device == "cuda" and shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            text = f"{r.stdout.strip().splitlines()[0]}; {text}"
    return text


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("luisa-python", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    out["commit"] = r.stdout.strip() if r.returncode == 0 else "unknown"
    return out


def _markdown(result: dict) -> str:
    device = result["device"]
    lines = [f"## {device.upper()} backend",
             "",
             f"{result['machine']}, {result['date']}, command `{result['command']}` (writes "
             f"`benchmarks/results/load-{device}.json`), commit {result['versions']['commit']}, luisa-python "
             f"{result['versions']['luisa-python']}, Python {result['versions']['python']}. P50 over "
             f"{result['processes']} fresh processes per row, seconds; LuisaCompute's kernel cache warm (the build ran "
             "each model once); every process's outputs equal the build's bit for bit"
             + ("" if result["all_bit_for_bit"] else " (NOT: see the JSON)") + ".",
             "",
             "| model | how | " + " | ".join(STEPS) + " | target |",
             "|---|---|" + "---|" * (len(STEPS) + 1)]
    for row in result["rows"]:
        p = row["p50"]
        target = row.get("target_s")
        verdict = "-" if target is None or row["cache"] == "compile" else (
            f"{target:g} s: {'met' if p['total'] < target else 'missed'}")
        lines.append(f"| {row['model']} | {row['cache']} | " + " | ".join("-" if p[k] is None else f"{p[k]:.3f}" for k in STEPS)
                     + f" | {verdict} |")
    lines.append("")
    return "\n".join(lines)


def _write_results_md(path: Path, result: dict) -> None:
    """Replace this device's part of the "Load time" section of RESULTS.md (appended when absent)."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    head = "# Load time: a built .lml artifact in a fresh process (bench_load.py)"
    start, end = f"<!-- bench_load {result['device']} -->", f"<!-- /bench_load {result['device']} -->"
    block = f"{start}\n{_markdown(result)}{end}\n"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end) + r"\n?", lambda _: block, text, flags=re.DOTALL)
    else:
        if head not in text:
            text = text.rstrip("\n") + f"\n\n{head}\n\nWhere the steps are defined: the docstring of "
            text += "benchmarks/bench_load.py. What the numbers mean: NOTES.md, \"Load time\".\n\n"
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--processes", type=int, default=5, help="fresh processes per model and cache state (P50)")
    ap.add_argument("--cls", metavar="FILE", help="rapidocr's ch_ppocr_mobile_v2.0_cls_infer.onnx (default: pip download)")
    ap.add_argument("--no-cls", action="store_true", help="the MLPs only")
    ap.add_argument("--batch", type=int, help="batch of the MLPs' inputs (default: bench_mlp's CPU batch; 65536 on CUDA)")
    ap.add_argument("--only", help="models whose name contains this text")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--no-md", action="store_true", help="do not write benchmarks/RESULTS.md")
    a = ap.parse_args(argv)
    command = "python benchmarks/bench_load.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    machine = _machine(a.device)
    work = Path(tempfile.mkdtemp(prefix="bench_load-"))
    try:
        cls = None if a.no_cls or (a.device == "cuda" and not a.cls) else _cls_model(a.cls, work)
        jobs = [j for j in _jobs(a.device, cls, work, a.batch) if not a.only or a.only in j["name"]]
        (work / "jobs.json").write_text(json.dumps(jobs))
        print(f"building {len(jobs)} artifacts on {a.device} ...", file=sys.stderr)
        r = _python(["-c", BUILD, str(work / "jobs.json"), str(HERE)], env=dict(os.environ, LUISAML_BACKEND=a.device))
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        jobs = json.loads((work / "jobs.json").read_text())
        rows = []
        for job in jobs:
            for state in ("compile", "empty", "warm"):
                samples = []
                for _ in range(a.processes):
                    env = dict(os.environ, LUISAML_BACKEND=a.device)
                    if state == "empty":
                        env["LUISAML_CACHE"] = tempfile.mkdtemp(prefix="cache-", dir=work)
                    args = ([COMPILE, job["onnx"], job["feeds"], job["ref"], json.dumps(job["options"])]
                            if state == "compile" else [LOAD, job["lml"], job["feeds"], job["ref"]])
                    t = time.perf_counter()
                    r = _python(["-c", *args], env=env, timeout=900)
                    wall = time.perf_counter() - t
                    if r.returncode != 0:
                        print(f"{job['name']}: the load process failed:\n{r.stderr}", file=sys.stderr)
                        return 1
                    sample = json.loads(r.stdout.strip().splitlines()[-1])
                    sample["wall"] = wall
                    samples.append(sample)
                p50 = _p50(samples)
                target = TARGET_S.get(a.device, {}).get(job["family"])
                rows.append({"model": job["name"], "cache": state, "p50": p50, "target_s": target,
                             "bit_for_bit": all(s["bit_for_bit"] for s in samples),
                             "imported": sorted({m for s in samples for m in s["imported"]}),
                             "batch": job.get("batch", 1), "stages": job["stages"], "kernels": job["kernels"],
                             "module_bytes": job["module_bytes"], "lml_bytes": os.path.getsize(job["lml"]),
                             "build_compile_and_first_run_s": job["compile_and_first_run_s"], "samples": samples})
                print(f"{job['name']:22s} {state:7s}: total {p50['total']:.3f} s (kernel build "
                      f"{p50['source'] + p50['AST->IR'] + p50['shader']:.3f} s), wall {p50['wall']:.3f} s", file=sys.stderr)
        result = {"device": a.device, "date": datetime.date.today().isoformat(), "machine": machine,
                  "command": command, "versions": _versions(), "processes": a.processes,
                  "all_bit_for_bit": all(r["bit_for_bit"] for r in rows), "rows": rows}
        out_dir = Path(a.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"load-{a.device}.json").write_text(json.dumps(result, indent=1))
        if not a.no_md:
            _write_results_md(HERE / "RESULTS.md", result)
        print(_markdown(result))
        return 0 if result["all_bit_for_bit"] else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
