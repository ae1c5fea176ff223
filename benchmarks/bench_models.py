"""Whole models exported from torch (random weights), luisaml against onnxruntime in the same process.

CPU backend, small batches (writes benchmarks/results/models-cpu.json, or --out-dir):
    python benchmarks/bench_models.py --cpu
CUDA backend, the issue-11 models against torch on the same GPU (writes models-h200.json):
    python benchmarks/bench_models.py --device cuda [--models ...] [--reps 20]
A smoke run of one tiny model (what tests/test_bench_models.py runs):
    python benchmarks/bench_models.py --cpu --quick --out-dir /tmp/x

For every model: the outputs are checked against onnxruntime first (the command fails on a
mismatch), then luisaml's `net.run` and onnxruntime's `session.run` are timed interleaved on the
same inputs (host copies included on both sides: `net.run` uploads the inputs and reads the
outputs back as `session.run` does), P50/P95/P99 of each and their ratio, plus compile time
(`luisaml.compile` and the first run, which builds the kernels). On CUDA the baselines are torch
fp32 eager, fp16 eager, torch.compile and (convolutions) fp32 with TF32 off, all on the same
inputs in the same process; times are device spans from CUPTI (a forward: its first kernel's
start to its last kernel's end), correctness against torch fp32 first."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if importlib.util.find_spec("luisaml") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

REL_TOL = 1e-4  # max|y - y_ort| / max|y_ort|: float32 sums in another order, erf/exp approximations
TARGET_RATIO = 5.0  # the target: luisaml within 5x of onnxruntime


# ---- the models -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One benchmarked model: how to build the torch module, its per-sample input shape, the batch."""

    name: str
    build: Callable[[], object]
    sample_shape: tuple[int, ...]
    batch: int


def mlp(k0: int, width: int, layers: int, out: int):
    """The ReLU MLPs of benchmarks/bench_mlp.py's table."""
    import torch

    mods, d = [], k0
    for _ in range(layers):
        mods += [torch.nn.Linear(d, width), torch.nn.ReLU()]
        d = width
    mods.append(torch.nn.Linear(d, out))
    return torch.nn.Sequential(*mods)


def small_cnn():
    """conv 3->8 3x3 pad 1, relu, maxpool 2, conv 8->16 3x3 pad 1, relu, maxpool 2, linear 1024->10."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(1024, 10))


def lenet5():
    """LeNet-5 style: conv 5x5 3->6, pool, conv 5x5 6->16, pool, fc 400->120->84->10 (ReLU)."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def transformer():
    """torch.nn.TransformerEncoder: batch_first, 2 layers, d_model 64, 4 heads, feed-forward 128."""
    from torch import nn

    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


# name, module, per-sample input shape, batch (the MLPs at bench_mlp.py's --cpu batches)
MODELS = [
    Spec("mlp 32-32x3-4", lambda: mlp(32, 32, 3, 4), (32,), 8192),
    Spec("mlp 32-64x3-4", lambda: mlp(32, 64, 3, 4), (32,), 8192),
    Spec("mlp 63-128x4-4", lambda: mlp(63, 128, 4, 4), (63,), 1024),
    Spec("mlp 63-256x4-4", lambda: mlp(63, 256, 4, 4), (63,), 512),
    Spec("small cnn", small_cnn, (3, 32, 32), 64),
    Spec("lenet-5", lenet5, (3, 32, 32), 64),
    Spec("transformer d64x2", transformer, (16, 64), 64),
]
QUICK = [Spec("mlp 8-16x1-4", lambda: mlp(8, 16, 1, 4), (8,), 64)]


def resnet18(classes: int = 1000):
    """torchvision's resnet18 layout (built here: torchvision does not install beside the CPU
    torch wheel), random weights."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else None)

        def forward(self, x):
            y = self.b2(self.c2(nn.functional.relu(self.b1(self.c1(x)))))
            return nn.functional.relu(y + (x if self.down is None else self.down(x)))

    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def act_mlp(k0: int, width: int, layers: int, out: int, act, siren: bool = False):
    """An MLP with another activation: the SDF (Softplus) and SIREN (sin(30 x)) rows. siren: the
    SIREN paper's initialisation (first layer U(-1/in, 1/in), the others U(-sqrt(6/n)/30, ...)),
    which keeps sin's arguments in range (torch's default makes them chaotic: two float32
    implementations then differ by far more than rounding)."""
    import math

    import torch

    mods, d = [], k0
    for k in range(layers):
        lin = torch.nn.Linear(d, width)
        if siren:
            bound = 1 / d if k == 0 else math.sqrt(6 / d) / 30
            torch.nn.init.uniform_(lin.weight, -bound, bound)
        mods += [lin, act()]
        d = width
    last = torch.nn.Linear(d, out)
    if siren:
        torch.nn.init.uniform_(last.weight, -math.sqrt(6 / d) / 30, math.sqrt(6 / d) / 30)
    mods.append(last)
    return torch.nn.Sequential(*mods)


def _sine():
    import torch

    class Sine(torch.nn.Module):
        def forward(self, x):
            return torch.sin(30.0 * x)

    return Sine()


def transformer4():
    """The issue-11 transformer: 4 layers, d_model 128, 4 heads, feed-forward 512, batch-first."""
    from torch import nn

    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)


# the models of issue 11's table on one GPU: (spec, target speed-up over torch fp32 eager)
GPU_MODELS = [
    (Spec("lenet-5", lenet5, (3, 32, 32), 8192), 1.5),
    (Spec("resnet-18", resnet18, (3, 224, 224), 32), 0.7),
    (Spec("transformer d128x4", transformer4, (32, 128), 256), 1.0),
    (Spec("sdf 3-64x4-1 softplus", lambda: act_mlp(3, 64, 4, 1, lambda: __import__("torch").nn.Softplus()), (3,), 4 << 20), 2.0),
    (Spec("siren 2-256x3-3 sin", lambda: act_mlp(2, 256, 3, 3, _sine, siren=True), (2,), 1 << 20), 1.2),
    (Spec("small cnn", small_cnn, (3, 32, 32), 4096), None),
]


def export(spec: Spec, path: Path, seed: int = 0) -> None:
    """Export the model with seeded random weights and a symbolic batch dimension (TorchScript
    exporter, opset 17)."""
    import torch

    torch.manual_seed(seed)
    model = spec.build().eval()
    x = torch.randn(2, *spec.sample_shape)
    kw = {"input_names": ["x"], "output_names": ["y"], "dynamic_axes": {"x": {0: "batch"}, "y": {0: "batch"}},
          "opset_version": 17}
    # grad enabled on purpose: in eval mode under no_grad, nn.TransformerEncoderLayer takes its fused
    # fast path (aten::_transformer_encoder_layer_fwd), which the exporter cannot write in ONNX
    try:
        torch.onnx.export(model, (x,), str(path), dynamo=False, **kw)
    except TypeError:  # a torch without the dynamo switch
        torch.onnx.export(model, (x,), str(path), **kw)


# ---- measuring ------------------------------------------------------------------------------------


def rel_err(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30))


def percentiles(ms: list[float]) -> dict:
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 2) -> dict[str, list[float]]:
    """Return milliseconds per call of each function, the functions called in turn every repetition
    (so a noisy neighbour on a shared machine slows both sides alike)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            out[k].append((time.perf_counter() - t) * 1e3)
    return out


def bench_cpu(spec: Spec, tmp: Path, reps: int, threads: int | None) -> dict:
    """One model on the CPU backend against onnxruntime's CPU provider; raises on a mismatch."""
    import onnxruntime as ort

    import luisaml

    path = tmp / (spec.name.replace(" ", "_") + ".onnx")
    export(spec, path)
    x = np.random.default_rng(1).standard_normal((spec.batch, *spec.sample_shape)).astype(np.float32)
    opts = ort.SessionOptions()
    # onnxruntime's pool threads busy-wait after each run by default; on a small machine they then
    # take the cores from the luisaml run timed next to it (63-128x4-4: 78 ms instead of 11 ms next
    # to a spinning session, benchmarks/NOTES.md), while onnxruntime's own time barely changes
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x})[0]
    t0 = time.perf_counter()
    net = luisaml.compile(str(path), backend="cpu")
    y = net.run({"x": x})["y"]  # the first run builds the kernels
    compile_s = time.perf_counter() - t0
    err = rel_err(y, ref)
    if not np.all(np.isfinite(y)) or err > REL_TOL:
        raise SystemExit(f"{spec.name}: luisaml differs from onnxruntime: relative error {err:.2e} > {REL_TOL}")
    ms = interleaved({"luisaml": lambda: net.run({"x": x}), "ort": lambda: sess.run(None, {"x": x})}, reps)
    rec = {"model": spec.name, "batch": spec.batch, "luisaml_ms": percentiles(ms["luisaml"]),
           "ort_ms": percentiles(ms["ort"]), "reps": reps, "rel_err": err, "compile_s": compile_s,
           "ort_spinning": False}
    rec["ratio"] = rec["luisaml_ms"]["p50"] / rec["ort_ms"]["p50"]
    rec["stages"] = len(net.plan.schedule.stages) if net.plan.schedule is not None else 1
    return rec


def machine() -> str:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def bench_cuda(spec: Spec, tmp: Path, reps: int, threads: int | None, target: float | None = None) -> dict:
    """One model on the CUDA backend against torch on the same GPU and inputs (CUPTI device
    spans); raises when luisaml's fp32 result differs from torch fp32."""
    import torch

    import luisaml
    from bench_mlp import device_times

    path = tmp / (spec.name.replace(" ", "_") + ".onnx")
    export(spec, path)
    torch.manual_seed(0)
    model = spec.build().eval().cuda()
    model.load_state_dict(_exported_state(spec))
    x = torch.randn(spec.batch, *spec.sample_shape, device="cuda")
    with torch.no_grad():
        # the reference is true float32: torch's convolutions and matmuls default to TF32 on Hopper
        tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        ref = model(x)
        torch.cuda.synchronize()
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
        t0 = time.perf_counter()
        net = luisaml.compile(str(path), backend="cuda")
        y = net.run({"x": x})["y"]  # the first run builds the kernels (a fresh machine: cold)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        err = rel_err(y.float().cpu().numpy(), ref.float().cpu().numpy())
        if not torch.isfinite(y).all() or err > REL_TOL:
            raise SystemExit(f"{spec.name}: luisaml differs from torch fp32: relative error {err:.2e} > {REL_TOL}")
        sync = torch.cuda.synchronize
        rec = {"model": spec.name, "batch": spec.batch, "rel_err": err, "compile_cold_s": compile_s}
        ms, how = device_times(lambda: net.run({"x": x}), sync, reps)
        rec["luisaml_ms"], rec["timing"] = percentiles(ms), how
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms, _ = device_times(lambda: model(x), sync, reps)
        rec["torch_fp32_ms"] = percentiles(ms)
        rec["torch_peak_mib"] = (torch.cuda.max_memory_allocated() - base + _bytes(model, x)) / 2**20
        rec["luisaml_peak_mib"] = _luisaml_bytes(net, spec.batch) / 2**20
        if any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
            tf32 = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False
            ms, _ = device_times(lambda: model(x), sync, reps)
            rec["torch_fp32_notf32_ms"] = percentiles(ms)
            torch.backends.cudnn.allow_tf32 = tf32
        half, xh = spec.build().eval().cuda().half(), x.half()
        half.load_state_dict(_exported_state(spec))
        half = half.half()
        ms, _ = device_times(lambda: half(xh), sync, reps)
        rec["torch_fp16_ms"] = percentiles(ms)
        try:
            compiled = torch.compile(model)
            compiled(x)
            ms, _ = device_times(lambda: compiled(x), sync, reps)
            rec["torch_compile_ms"] = percentiles(ms)
        except Exception as e:  # inductor is not always there
            rec["torch_compile_ms"] = None
            rec["torch_compile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    rec["speedup_vs_torch_fp32"] = rec["torch_fp32_ms"]["p50"] / rec["luisaml_ms"]["p50"]
    rec["target"] = target
    rec["stages"] = len(net.plan.schedule.stages) if net.plan.schedule is not None else 1
    rec["plan"] = net.plan.fusion_note if net.plan.fused is not None else None
    return rec


_STATES: dict[str, dict] = {}


def _exported_state(spec: Spec) -> dict:
    """The state dict export() used (seed 0), so torch runs the exported weights."""
    import torch

    if spec.name not in _STATES:
        torch.manual_seed(0)
        _STATES[spec.name] = {k: v.clone() for k, v in spec.build().eval().state_dict().items()}
    return _STATES[spec.name]


def _bytes(model, x) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + x.numel() * x.element_size()


def _luisaml_bytes(net, n: int) -> int:
    """Device bytes a run of n samples holds: inputs, outputs, pooled stage buffers, scratch, weights."""
    plan = net.plan
    total = len(net.weight_bytes())
    for s in plan.inputs + plan.outputs:
        total += s.numel * (n if s.batched else 1) * net.io_dtype(s).itemsize
    if plan.schedule is not None:
        total += sum(slot.size * n * slot.itemsize for slot in plan.schedule.buffers.slots)
    total += sum(size * n * 4 for size in plan.kernel_scratch.values())
    return total


DEVICES = {"cpu": bench_cpu, "cuda": bench_cuda}


def table(records: list[dict]) -> str:
    """Markdown table of the records."""
    head = ("| model | batch | luisaml ms P50 / P95 / P99 | onnxruntime ms P50 / P95 / P99 | ratio (P50) | "
            "rel err | compile s |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in records:
        lm, om = r["luisaml_ms"], r["ort_ms"]
        lines.append(f"| {r['model']} | {r['batch']} | {lm['p50']:.2f} / {lm['p95']:.2f} / {lm['p99']:.2f} | "
                     f"{om['p50']:.2f} / {om['p95']:.2f} / {om['p99']:.2f} | {r['ratio']:.2f}x | "
                     f"{r['rel_err']:.1e} | {r['compile_s']:.1f} |")
    return "\n".join(lines)


def gpu_table(records: list[dict]) -> str:
    """Markdown table of CUDA records (device P50 ms)."""
    lines = ["| model | batch | luisaml fp32 | torch fp32 | torch fp32 no TF32 | torch fp16 | torch.compile | "
             "speed-up (target) | rel err | peak MiB luisaml / torch | cold compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        def ms(key):
            v = r.get(key)
            return f"{v['p50']:.3f}" if v else "-"
        tgt = f" ({r['target']:g}x)" if r.get("target") else ""
        lines.append(f"| {r['model']} | {r['batch']} | {ms('luisaml_ms')} | {ms('torch_fp32_ms')} | "
                     f"{ms('torch_fp32_notf32_ms')} | {ms('torch_fp16_ms')} | {ms('torch_compile_ms')} | "
                     f"{r['speedup_vs_torch_fp32']:.2f}x{tgt} | {r['rel_err']:.1e} | "
                     f"{r['luisaml_peak_mib']:.0f} / {r['torch_peak_mib']:.0f} | {r['compile_cold_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="where luisaml runs")
    ap.add_argument("--cpu", action="store_true", help="the same as --device cpu")
    ap.add_argument("--quick", action="store_true", help="one tiny model, few repetitions (a smoke run)")
    ap.add_argument("--models", nargs="*", help="a subset of: " + ", ".join(repr(s.name) for s in MODELS)
                    + "; on cuda: " + ", ".join(repr(s.name) for s, _ in GPU_MODELS))
    ap.add_argument("--reps", type=int, default=None, help="timed runs of each side (default 30, --quick 3)")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: its own)")
    ap.add_argument("--out-dir", help="where models-<device>.json goes (default benchmarks/results; "
                                      "--quick writes only where told)")
    a = ap.parse_args(argv)
    dev = a.device or "cpu"
    sys.path.insert(0, str(HERE))  # bench_mlp's CUPTI timing
    import luisaml

    luisaml.device.init(dev)
    catalog = [(s, None) for s in MODELS] if dev == "cpu" else GPU_MODELS
    specs = [(s, None) for s in QUICK] if a.quick else [(s, t) for s, t in catalog if not a.models or s.name in a.models]
    reps = a.reps or (3 if a.quick else 30)
    date = datetime.date.today().isoformat()
    where = machine()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec, target in specs:
            print(f"== {spec.name} batch {spec.batch}", flush=True)
            rec = (bench_cpu(spec, Path(tmp), reps, a.threads) if dev == "cpu"
                   else bench_cuda(spec, Path(tmp), reps, a.threads, target))
            rec.update(machine=where, date=date, device=dev)
            records.append(rec)
            print(json.dumps(rec), flush=True)
    out_dir = Path(a.out_dir) if a.out_dir else (None if a.quick else HERE / "results")
    name = "models-cpu.json" if dev == "cpu" else "models-h200.json"
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(json.dumps(records, indent=1) + "\n")
    if dev == "cuda":
        print(f"\n{where}, {date}, `python benchmarks/bench_models.py --device cuda`")
        print(gpu_table(records))
        return 0
    print(f"\n{where}, {date}, `python benchmarks/bench_models.py --{dev}` (net.run and session.run, "
          "host copies included, interleaved)")
    print(table(records))
    over = [r["model"] for r in records if r["ratio"] > TARGET_RATIO]
    if over and not a.quick:
        print(f"over the {TARGET_RATIO:g}x target: {', '.join(over)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
