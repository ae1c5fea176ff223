"""ReLU MLPs exported from torch to ONNX, compiled by luisaml, against torch in the same process.

GPU (one command, on the machine with the GPU; writes benchmarks/results/mlp-h200.json and
benchmarks/RESULTS.md, or --out-dir):
    python benchmarks/bench_mlp.py
CPU backend, small batches, against onnxruntime's CPU provider:
    python benchmarks/bench_mlp.py --cpu
--tensor-cores: compile with tensor_cores="auto" (the device started in the tensor-core front's directory):
precision="fp16" then runs the layers as stages on the FP16 mma tile (luisaml/rewrites/mlp.py f16_stages);
the fp32 row stays the fused kernel.

For every model: correctness first (relative error max|y - y_torch32| / max|y_torch32|; the fp32
path must stay within 1e-5), then P50/P95/P99 of the device time of one forward, TFLOP/s, cold and
cached compile time (each in a fresh process: cold with empty luisaml and LuisaCompute caches),
and peak device memory. Device times come from CUPTI (torch.profiler) kernel records, the same
clock for luisaml's kernel and torch's kernels; a forward's time is the span from its first
kernel's start to its last kernel's end. Where CUPTI sees no kernels, host wall time around a
launch and a full synchronisation is used instead (the JSON says which)."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if importlib.util.find_spec("luisaml") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

# name, inputs, width, hidden layers, outputs, GPU batch, CPU batch, targets (fp32, fp16) vs torch eager
MODELS = [
    ("32-32x3-4", 32, 32, 3, 4, 4 << 20, 8192, (3.0, 1.0)),
    ("32-64x3-4", 32, 64, 3, 4, 4 << 20, 8192, (2.0, 1.0)),
    ("63-128x4-4", 63, 128, 4, 4, 1 << 20, 1024, (1.5, None)),
    ("63-256x4-4", 63, 256, 4, 4, 1 << 20, 512, (1.2, None)),
]
FP32_TOL = 1e-5


def build_torch(k0: int, width: int, layers: int, out: int, seed: int = 0):
    """Return a torch ReLU MLP (eval mode, float32) with seeded weights."""
    import torch

    torch.manual_seed(seed)
    mods, d = [], k0
    for _ in range(layers):
        mods += [torch.nn.Linear(d, width), torch.nn.ReLU()]
        d = width
    mods.append(torch.nn.Linear(d, out))
    return torch.nn.Sequential(*mods).eval()


def export_onnx(model, k0: int, path: Path) -> None:
    """Export with a symbolic batch dimension (the TorchScript exporter: Gemm + Relu nodes)."""
    import torch

    x = torch.randn(8, k0)
    kw = dict(input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    try:
        torch.onnx.export(model, (x,), str(path), dynamo=False, **kw)
    except TypeError:  # a torch without the dynamo switch
        torch.onnx.export(model, (x,), str(path), **kw)


def rel_err(y, ref) -> float:
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30))


def percentiles(ms: list[float]) -> dict:
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "n": len(ms)}


def start_device(cpu: bool) -> tuple[str, str, str] | None:
    """Start luisaml's backend for a benchmark: (backend, device name, the results file's tag, e.g.
    "h200" or "cpu"), or None (after saying so) when CUDA is asked for and torch sees no GPU."""
    import luisaml

    if not cpu:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu", file=sys.stderr)
            return None
        name = torch.cuda.get_device_name(0)
    else:
        name = "cpu"
    backend = "cpu" if cpu else "cuda"
    luisaml.device.init(backend)
    tag = "h200" if "H200" in name else ("cpu" if cpu else "".join(c for c in name.lower() if c.isalnum()))
    return backend, name, tag


def timed(fn, reps: int, warmup: int = 2) -> list[float]:
    """Host wall milliseconds of fn, reps times after `warmup` calls."""
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1e3)
    return ms


def kernel_ms(fn, reps: int) -> list[float]:
    """Per-call sum of CUDA kernel durations (CUPTI through torch.profiler): the device's own work,
    without the gaps between kernels (device_times' spans include them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA
                     and not e.name.lower().startswith(("memcpy", "memset")))
    if not kernels or len(kernels) % reps:
        raise RuntimeError(f"{len(kernels)} kernels for {reps} calls")
    per = len(kernels) // reps
    return [sum(b - a for a, b in kernels[i * per:(i + 1) * per]) / 1e3 for i in range(reps)]


# ---- timing ---------------------------------------------------------------------------------------


def device_times(fn, sync, reps: int, warmup: int = 3) -> tuple[list[float], str]:
    """Return (per-forward device ms, method): CUPTI kernel spans, or host wall time."""
    import torch

    for _ in range(warmup):
        fn()
        sync()
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
                sync()
        kernels = []
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            if e.name.lower().startswith(("memcpy", "memset")):
                continue
            kernels.append((e.time_range.start, e.time_range.end))
        kernels.sort()
        if kernels and len(kernels) % reps == 0:
            per = len(kernels) // reps
            spans = [(kernels[i * per + per - 1][1] - kernels[i * per][0]) / 1e3 for i in range(reps)]
            return spans, f"cupti ({per} kernel{'s' if per > 1 else ''} per forward)"
    except Exception as e:  # no CUPTI here: fall back to the host clock
        print(f"  (CUPTI timing unavailable: {e})", file=sys.stderr)
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        ms.append((time.perf_counter() - t) * 1e3)
    return ms, "host wall (launch + synchronize)"


def precompile_bytecode() -> None:
    """Write the .pyc files of luisaml and its operators, as `pip install` does, so that the
    compile probes do not time Python compiling luisaml's own sources (a source checkout run
    with PYTHONDONTWRITEBYTECODE would otherwise do that in every fresh process)."""
    import compileall

    import luisaml
    import luisaml.operators

    for pkg in (luisaml, luisaml.operators):
        compileall.compile_dir(str(Path(pkg.__file__).parent), quiet=1)


def compile_probe(onnx_path: Path, backend: str, precision: str, cold: bool) -> dict:
    """Compile and run once in a fresh process; cold empties luisaml's and LuisaCompute's caches."""
    env = dict(os.environ)
    cache = Path(tempfile.gettempdir()) / "luisaml-bench-cache"
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
        for d in luisa_cache_dirs():
            shutil.rmtree(d, ignore_errors=True)
    env["LUISAML_CACHE"] = str(cache)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", str(onnx_path), "--backend", backend,
           "--precision", precision]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return {"error": (out.stderr or out.stdout)[-2000:]}


def luisa_cache_dirs() -> list[Path]:
    """LuisaCompute's on-disk shader caches (under its runtime directory)."""
    try:
        spec = importlib.util.find_spec("luisa")
        base = Path(spec.origin).parent / "dylibs"
    except Exception:
        return []
    return [p for p in (base / ".cache", Path.cwd() / ".cache", Path.home() / ".luisa" / "cache") if p.exists()]


def probe_main(a) -> int:
    """--probe: time compile() and the first launch (which builds the kernel) on a tiny batch."""
    import luisaml

    t = time.perf_counter()
    luisaml.device.init(a.backend)  # once per process, not per model: timed apart
    t0 = time.perf_counter()
    net = luisaml.compile(a.probe, backend=a.backend, precision=a.precision)
    t1 = time.perf_counter()
    k0 = net.inputs[0].kernel_shape[1]
    x = np.ones((256, k0), np.float16 if a.precision == "fp16" else np.float32)
    net.run({"x": x})
    t2 = time.perf_counter()
    print("PROBE " + json.dumps({"device_init_s": t0 - t, "compile_s": t1 - t0, "first_run_s": t2 - t1, "total_s": t2 - t0}))
    return 0


# ---- one model on the GPU -------------------------------------------------------------------------


def luisaml_launcher(net, x):
    """Return (launch, outputs, accounted device bytes): the kernel on DLPack-shared torch tensors."""
    import torch

    from luisaml.interop import dlpack_buffer as _dlpack_buffer

    s_out = net.outputs[0]
    n = x.shape[0]
    y = torch.empty((n, s_out.kernel_shape[1]), dtype=x.dtype, device=x.device)
    torch.cuda.synchronize()
    args = [_dlpack_buffer(x), _dlpack_buffer(y)]
    blob = len(net.weight_bytes())
    nbytes = x.numel() * x.element_size() + y.numel() * y.element_size() + blob

    def launch():
        net.launch(args, [], n)

    return launch, y, nbytes


def bench_gpu_model(spec, reps: int, tmp: Path, probes: bool, tensor_cores: bool = False) -> dict:
    import luisa
    import torch

    import luisaml

    name, k0, width, layers, out, batch, _, targets = spec
    rec: dict = {"model": name, "batch": batch}
    model = build_torch(k0, width, layers, out).cuda()
    path = tmp / f"mlp-{name}.onnx"
    export_onnx(build_torch(k0, width, layers, out), k0, path)
    flops = 2 * batch * (k0 * width + width * width * (layers - 1) + width * out)
    torch.manual_seed(1)
    x = torch.randn(batch, k0, device="cuda")
    x16 = x.half()
    sync = torch.cuda.synchronize
    with torch.no_grad():
        ref = model(x)
        ref_np = ref.float().cpu().numpy()
        # torch fp32 eager, with its peak memory
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x)
        sync()
        rec["torch_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        rec["torch_peak_above_inputs_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms, how = device_times(lambda: model(x), sync, reps)
        rec["torch_fp32"] = percentiles(ms)
        rec["timing"] = {"torch": how}
        m16 = build_torch(k0, width, layers, out).cuda().half()
        y16 = m16(x16)
        rec["torch_rel_err_fp16"] = rel_err(y16.float().cpu().numpy(), ref_np)
        ms, _ = device_times(lambda: m16(x16), sync, reps)
        rec["torch_fp16"] = percentiles(ms)
        try:
            mc = torch.compile(model)
            for _ in range(3):
                mc(x)
            sync()
            ms, _ = device_times(lambda: mc(x), sync, reps)
            rec["torch_compile"] = percentiles(ms)
        except Exception as e:  # no Triton or no compiler: say so
            rec["torch_compile"] = {"error": str(e)[:300]}
    # luisaml: compile time in fresh processes, then this process's network
    if probes:
        rec["compile_cold"] = compile_probe(path, "cuda", "fp32", cold=True)
        rec["compile_cached"] = compile_probe(path, "cuda", "fp32", cold=False)
    for prec, xin in (("fp32", x), ("fp16", x16)):
        t0 = time.perf_counter()
        net = luisaml.compile(str(path), backend="cuda", precision=prec, tensor_cores="auto" if tensor_cores else False)
        got = net.run({"x": xin})["y"]  # DLPack zero-copy, first launch compiles the kernel
        rec.setdefault("compile_in_process_s", {})[prec] = time.perf_counter() - t0
        key = "" if prec == "fp32" else "_fp16"
        rec["rel_err" + key] = rel_err(got.float().cpu().numpy(), ref_np)
        rec["algorithm" + key] = net.plan.fusion_note
        launch, _, nbytes = luisaml_launcher(net, xin)
        ms, how = device_times(launch, luisa.synchronize, reps)
        rec["luisaml_" + prec] = percentiles(ms)
        rec["timing"]["luisaml"] = how
        rec["luisaml_peak_mib" + key] = nbytes / 2**20
        del net
    rec["flops"] = flops
    for k in ("luisaml_fp32", "luisaml_fp16", "torch_fp32", "torch_fp16", "torch_compile"):
        if "p50" in rec.get(k, {}):
            rec[k]["tflops"] = flops / (rec[k]["p50"] * 1e-3) / 1e12
    rec["speedup_fp32"] = rec["torch_fp32"]["p50"] / rec["luisaml_fp32"]["p50"]
    rec["speedup_fp16"] = rec["torch_fp16"]["p50"] / rec["luisaml_fp16"]["p50"]
    rec["target_fp32"], rec["target_fp16"] = targets
    rec["input_output_weights_mib"] = (x.numel() * 4 + batch * out * 4 + sum(p.numel() * 4 for p in model.parameters())) / 2**20
    return rec


def flat_record(rec: dict, device: str, date: str) -> dict:
    """The issue's record: one line per model (details stay in 'detail')."""
    g = lambda k: rec.get(k, {}).get("p50") if isinstance(rec.get(k), dict) else None
    return {
        "model": rec["model"], "batch": rec["batch"],
        "luisaml_ms": g("luisaml_fp32"), "luisaml_fp16_ms": g("luisaml_fp16"),
        "torch_fp32_ms": g("torch_fp32"), "torch_fp16_ms": g("torch_fp16"), "torch_compile_ms": g("torch_compile"),
        "rel_err": rec.get("rel_err"), "rel_err_fp16": rec.get("rel_err_fp16"),
        "luisaml_peak_mib": rec.get("luisaml_peak_mib"), "torch_peak_mib": rec.get("torch_peak_mib"),
        "device": device, "date": date, "detail": rec,
    }


def table(records: list[dict]) -> str:
    """Markdown table of the flat records."""
    head = ("| model | batch | luisaml fp32 ms (P50/P95/P99) | fp16 ms | torch fp32 | torch fp16 | torch.compile | "
            "speed-up fp32 / fp16 (target) | TFLOP/s fp32 | rel err fp32 / fp16 | compile cold / cached s | "
            "peak MiB luisaml / torch |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        d = r["detail"]
        lf, lh = d["luisaml_fp32"], d["luisaml_fp16"]
        tc = d.get("torch_compile", {})
        cold = d.get("compile_cold", {}).get("total_s")
        cached = d.get("compile_cached", {}).get("total_s")
        t32, t16 = d["target_fp32"], d["target_fp16"]
        tcs = f"{tc['p50']:.3f}" if "p50" in tc else "n/a"
        lines.append(
            f"| {r['model']} | {r['batch'] // 1024}K | {lf['p50']:.3f} / {lf['p95']:.3f} / {lf['p99']:.3f} | "
            f"{lh['p50']:.3f} | {r['torch_fp32_ms']:.3f} | {r['torch_fp16_ms']:.3f} | {tcs} | "
            f"{d['speedup_fp32']:.2f}x ({t32}x) / {d['speedup_fp16']:.2f}x ({t16 if t16 else 'report'}) | "
            f"{lf['tflops']:.1f} | {r['rel_err']:.1e} / {r['rel_err_fp16']:.1e} | "
            f"{cold if cold is None else round(cold, 2)} / {cached if cached is None else round(cached, 2)} | "
            f"{r['luisaml_peak_mib']:.1f} / {r['torch_peak_mib']:.1f} |"
        )
    return "\n".join(lines)


def results_md(records: list[dict], cmd: str, device: str, date: str, torch_version: str) -> str:
    """benchmarks/RESULTS.md: the table, the targets and how the numbers were taken."""
    lines = [
        "# MLP benchmark: luisaml against torch on one GPU",
        "",
        f"{device}, {date}, command `{cmd}` (writes this file and `benchmarks/results/mlp-h200.json`), "
        f"torch {torch_version}, same process, same inputs. Design notes and rejected designs: NOTES.md.",
        "",
        table(records),
        "",
        "## Targets (luisaml time / torch eager time as a speed-up, P50)",
        "",
        "| model | fp32 vs torch fp32 | target | fp16 vs torch fp16 | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        d = r["detail"]
        t32, t16 = d["target_fp32"], d["target_fp16"]
        ok = d["speedup_fp32"] >= t32 and (t16 is None or d["speedup_fp16"] >= t16)
        lines.append(f"| {r['model']} | {d['speedup_fp32']:.2f}x | {t32}x | {d['speedup_fp16']:.2f}x | "
                     f"{str(t16) + 'x' if t16 else 'report'} | {'yes' if ok else 'no'} |")
    lines += [
        "",
        "## How the numbers are taken",
        "",
        f"- Device time per forward from CUPTI kernel records (torch.profiler), the same clock for both: "
        f"torch {records[0]['detail']['timing']['torch']}, luisaml {records[0]['detail']['timing']['luisaml']}; "
        "a forward is its first kernel's start to its last kernel's end. P50/P95/P99 over the timed forwards "
        "after 3 warm-ups. TFLOP/s counts 2 x multiply-adds of the dense layers.",
        "- luisaml runs on torch CUDA tensors shared through DLPack (`net.run` zero-copy path; the timed "
        "launch is `net.launch` on those buffers). fp16: half inputs and outputs (`precision=\"fp16\"`) "
        "against torch's `model.half()` on half inputs.",
        "- Correctness first: relative error = max|y - y_torch_fp32| / max|y_torch_fp32| on the whole "
        "batch; the fp32 path must stay within 1e-5 (the command fails otherwise).",
        "- Compile time: a fresh process per probe; cold with luisaml's and LuisaCompute's caches emptied, "
        "cached right after; each is `luisaml.compile` plus the first launch (which builds the kernel), "
        "device start-up (about 0.5 s, once per process) excluded; luisaml's .pyc files are written "
        "first, as `pip install` does.",
        "- Peak memory: luisaml = its inputs + outputs + weight blob (it keeps no activations in device "
        "memory and this network has no scratch); torch = `torch.cuda.max_memory_allocated` around one "
        "eager fp32 forward (inputs and weights included).",
        "",
    ]
    return "\n".join(lines)


def gpu_main(a) -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: run with --cpu", file=sys.stderr)
        return 2
    import luisaml

    luisaml.device.init("cuda", tensor_cores=a.tensor_cores)
    if not a.no_probes:
        precompile_bytecode()
    device = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    out_dir = Path(a.out_dir) if a.out_dir else HERE / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    records, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in MODELS:
            if a.models and spec[0] not in a.models:
                continue
            print(f"== {spec[0]} batch {spec[5]}", flush=True)
            rec = bench_gpu_model(spec, a.reps, Path(tmp), probes=not a.no_probes, tensor_cores=a.tensor_cores)
            r = flat_record(rec, device, date)
            records.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "detail"}), flush=True)
            if rec["rel_err"] > FP32_TOL:
                failed.append(f"{spec[0]}: fp32 relative error {rec['rel_err']:.2e} > {FP32_TOL}")
    (out_dir / "mlp-h200.json").write_text(json.dumps(records, indent=1) + "\n")
    cmd = "python benchmarks/bench_mlp.py" + (f" --reps {a.reps}" if a.reps != 50 else "") + \
        (" --tensor-cores" if a.tensor_cores else "")
    md_path = (Path(a.out_dir) if a.out_dir else HERE) / "RESULTS.md"
    md_path.write_text(results_md(records, cmd, device, date, torch.__version__))
    print()
    print(f"{device}  {date}  torch {torch.__version__}  timing: {records[0]['detail']['timing']}")
    print(table(records))
    for f in failed:
        print("FAILED correctness: " + f)
    return 1 if failed else 0


# ---- the CPU variant ------------------------------------------------------------------------------


def cpu_main(a) -> int:
    import onnxruntime as ort
    import torch

    import luisaml

    luisaml.device.init("cpu")
    date = datetime.date.today().isoformat()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, k0, width, layers, out, _, batch, _ in MODELS:
            if a.models and name not in a.models:
                continue
            model = build_torch(k0, width, layers, out)
            path = Path(tmp) / f"{name}.onnx"
            export_onnx(model, k0, path)
            x = np.random.default_rng(1).standard_normal((batch, k0)).astype(np.float32)
            with torch.no_grad():
                ref = model(torch.from_numpy(x)).numpy()
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            ort_ms = []
            for i in range(a.reps + 2):
                t = time.perf_counter()
                sess.run(None, {"x": x})
                ort_ms.append((time.perf_counter() - t) * 1e3)
            row = {"model": name, "batch": batch, "onnxruntime_ms": percentiles(ort_ms[2:])}
            for fuse in (False, True):
                t0 = time.perf_counter()
                net = luisaml.compile(str(path), backend="cpu", fuse=fuse)
                y = net.run({"x": x})["y"]
                key = "luisaml_fused" if fuse else "luisaml"
                row[key + "_compile_s"] = time.perf_counter() - t0
                row[key + "_rel_err"] = rel_err(y, ref)
                ms = []
                for _ in range(a.reps):
                    t = time.perf_counter()
                    net.run({"x": x})
                    ms.append((time.perf_counter() - t) * 1e3)
                row[key + "_ms"] = percentiles(ms)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nCPU backend, {date}, `python benchmarks/bench_mlp.py --cpu` (net.run, host copies included)")
    print("| model | batch | luisaml ms P50 (per-sample kernel) | luisaml fused (emulated) ms | onnxruntime ms | rel err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {r['luisaml_ms']['p50']:.2f} | {r['luisaml_fused_ms']['p50']:.2f} | "
              f"{r['onnxruntime_ms']['p50']:.2f} | {max(r['luisaml_rel_err'], r['luisaml_fused_rel_err']):.1e} |")
    if a.out_dir:
        Path(a.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(a.out_dir) / "mlp-cpu.json").write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if max(r["luisaml_rel_err"], r["luisaml_fused_rel_err"]) > FP32_TOL]
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU backend against onnxruntime, small batches")
    ap.add_argument("--models", nargs="*", help="a subset of: " + ", ".join(m[0] for m in MODELS))
    ap.add_argument("--reps", type=int, default=50, help="timed forwards per measurement (CPU: 5 if not given)")
    ap.add_argument("--out-dir", help="where the JSON and the table go (default benchmarks/results)")
    ap.add_argument("--no-probes", action="store_true", help="skip the fresh-process compile-time probes")
    ap.add_argument("--tensor-cores", action="store_true",
                    help='compile with tensor_cores="auto" (fp16: the layers as stages on the FP16 mma tile)')
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.probe:
        return probe_main(a)
    if a.cpu and "--reps" not in " ".join(sys.argv if argv is None else argv):
        a.reps = 5
    return cpu_main(a) if a.cpu else gpu_main(a)


if __name__ == "__main__":
    sys.exit(main())
