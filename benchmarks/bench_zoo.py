"""The zoo: 26 networks nobody tuned luisaml for (benchmarks/zoo_models.py), exported from torch
with random weights, luisaml against torch and onnxruntime in the same process on the same inputs.

CPU backend, the --quick size profile (batch 1 and 112x112 images for the CNNs, sequences of 32
for BERT and GPT-2, ...: zoo_models.ZOO's quick_batch and inputs; 13 minutes with cold caches, 8.5
with warm ones, on the shared 2-core development host), writes benchmarks/results/zoo-cpu.json:
    python benchmarks/bench_zoo.py --device cpu --quick --profile 6
CUDA backend, the batches of zoo_models.ZOO (writes zoo-h200.json), one part per device command:
    python benchmarks/bench_zoo.py --device cuda --part 1      # ... --part 4
The markdown table of a results file (RESULTS.md's), with geometric means and medians:
    python benchmarks/bench_zoo.py --table [--device cuda]

On the lent GPU machine (benchmarks/NOTES.md, "Running the GPU command on the lent machine": run
../shared/device/prepare.sh here first, then carry [".device"]), each part as its own command:
    source .device/env.sh && mkdir -p /tmp/lm && cp -rs $PWD/luisaml /tmp/lm/luisaml \
      && ln -s $PWD/operators /tmp/lm/luisaml/operators && ln -s $PWD/shaders /tmp/lm/luisaml/shaders \
      && ln -s $PWD/opsets /tmp/lm/luisaml/opsets && export PYTHONPATH=/tmp/lm:$PYTHONPATH \
      && cp benchmarks/results/zoo-h200.json $OUT/ 2>/dev/null; \
      python3 benchmarks/bench_zoo.py --device cuda --part N --out $OUT/zoo-h200.json
then copy $OUT's zoo-h200.json back to benchmarks/results/ (each part merges its records into the file
it is given, by network name, so the four parts fill one file; commit the file before the next part
so that the next command starts from it).

The parts (each meant to finish within ten minutes on the H200: a cold luisaml compile, a
torch.compile and six timed sides per network; the slow compiles spread across them):
    1: resnet-18, resnet-50, mobilenet-v3-small, efficientnet-b0, cifar-cnn, lenet-5, sdf
    2: convnext-tiny, regnet-y-400mf, densenet-121, squeezenet-1.1, shufflenet-v2, unet-small, siren
    3: vit-tiny/16, deit-small/16, mixer-s/16, bert-base, transformer d64, nerf
    4: gpt-2 small, gru, lstm, bilstm tagger, wav2vec2 conv encoder, pointnet
`--only "resnet-50,gru 64-128 seq 32"` runs named networks instead (a part that ran out of time);
`--skip torch_compile` leaves a baseline out (inductor compiles take ~1 minute on the big networks).

For every network, correctness comes first: the reference is onnxruntime on the CPU and torch fp32
with TF32 off on CUDA; a network passes when luisaml's largest difference is within REL_TOL of the
reference's largest value, or within FLOOR_FACTOR times the difference between the two references
(torch's own output against onnxruntime's, or torch on the CPU against torch on CUDA: how far two
float32 implementations of this network already disagree). A network that fails to export,
compile or run, or that differs, is recorded with its status and the error's first line, not
dropped. Then every side is timed interleaved (the CPU: net.run, onnxruntime with its default
threads and with one, torch eager; host wall time, numpy in and out) or with CUPTI device spans
(CUDA: net.run on torch tensors against torch fp32 eager with TF32 as torch ships it, fp32 with
TF32 off, fp16 and torch.compile), P50/P95/P99 ms, with the ratio to each baseline: on the CPU
x_<baseline> = luisaml / baseline (times slower), on CUDA speedup_vs_<baseline> = baseline /
luisaml (bench_rnn.py's and bench_models.py's conventions)."""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("luisaml") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))  # bench_models' timers, bench_mlp's CUPTI spans, zoo_models

# torch's OpenMP threads spin after each parallel region by default; on a small shared host they then
# take the cores from the side timed next and from each other (ResNet-18 at 112x112, batch 1, 2
# cores: torch eager 0.5-2.8 s spinning, 22-25 ms passive) -- the counterpart of onnxruntime's
# allow_spinning=0 below. Read when libgomp starts, so before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench_models import interleaved, machine, percentiles, rel_err  # noqa: E402

# `--option tune=fast --option tensor_cores=auto`: extra keyword arguments of luisaml.compile, recorded
# in each record; with tensor cores the tolerance also admits torch's own TF32 error (the issue's "tolerance
# as torch's TF32"): FLOOR_FACTOR times torch with TF32 on against the float32 reference
COMPILE_OPTIONS: dict = {}
REL_TOL = 1e-4  # bench_models.py's: float32 sums in another order, erf/exp approximations
FLOOR_FACTOR = 10  # deep random networks: the two references' own disagreement, with room
OPSET = 17
EXPORTER = "torch.onnx.export(dynamo=False), TorchScript exporter, opset 17, dynamic batch"
CPU_BASELINES = ("ort", "ort_1thread", "torch")
CUDA_BASELINES = ("torch_fp32", "torch_fp32_notf32", "torch_fp16", "torch_compile")
PARTS = {
    1: ["resnet-18", "resnet-50", "mobilenet-v3-small", "efficientnet-b0", "cifar-cnn", "lenet-5",
        "sdf 3-64x4-1 softplus"],
    2: ["convnext-tiny", "regnet-y-400mf", "densenet-121", "squeezenet-1.1", "shufflenet-v2", "unet-small",
        "siren 2-256x3-3"],
    3: ["vit-tiny/16", "deit-small/16 distilled", "mixer-s/16", "bert-base", "transformer d64 seq 16",
        "nerf mlp 8x256"],
    4: ["gpt-2 small", "gru 64-128 seq 32", "lstm 64-128 seq 32", "bilstm tagger 2x256",
        "wav2vec2 conv encoder", "pointnet"],
}


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:400]


def export(module, inputs: dict, path: Path) -> None:
    """Export with every input's and the output's first dimension symbolic (the batch). Grad stays
    on: in eval mode under no_grad, nn.TransformerEncoderLayer takes its fused fast path, which the
    exporter cannot write in ONNX (bench_models.export)."""
    import torch

    axes = {k: {0: "batch"} for k in inputs} | {"y": {0: "batch"}}
    torch.onnx.export(module, tuple(inputs.values()), str(path), input_names=list(inputs), output_names=["y"],
                      dynamic_axes=axes, opset_version=OPSET, dynamo=False)


def prepare(net, batch: int, quick: bool, tmp: Path, rec: dict):
    """Build the seeded module (non-trivial norms), its inputs, and its ONNX file; fills rec's
    description. Returns (module, inputs) — the ONNX file is tmp/model.onnx."""
    import torch

    from zoo_models import randomize_norms

    torch.manual_seed(0)
    module = randomize_norms(net.build().eval())
    inputs = net.inputs(batch, quick)
    rec.update(inputs={k: list(v.shape) for k, v in inputs.items()},
               params_m=round(sum(p.numel() for p in module.parameters()) / 1e6, 3), exporter=EXPORTER)
    t = time.perf_counter()
    export(module, inputs, tmp / "model.onnx")
    rec["export_s"] = time.perf_counter() - t
    return module, inputs


def check(rec: dict, y, ref, floor: float) -> bool:
    """Record luisaml's relative error and the tolerance; set the status to mismatch past it."""
    y, ref = np.asarray(y, np.float64).reshape(np.shape(ref)), np.asarray(ref, np.float64)
    err = rel_err(y, ref) if np.all(np.isfinite(y)) else float("inf")
    tol = max(REL_TOL, FLOOR_FACTOR * floor)
    rec.update(rel_err=err, tol=tol, reference_floor=floor)
    if not err <= tol:
        rec.update(status="mismatch", error=f"relative error {err:.3g} > tolerance {tol:.3g}")
        return False
    return True


def timed_reps(fns: dict, reps: int, budget_s: float) -> int:
    """Call each side once (a warm-up that also prices it) and return how many interleaved
    repetitions fit the budget: at least 3, at most reps."""
    t = time.perf_counter()
    for fn in fns.values():
        fn()
    one = time.perf_counter() - t
    return int(max(3, min(reps, budget_s // max(one, 1e-9))))


def stage_profile(net, feeds: dict, batch: int, top: int) -> dict:
    """Where the time goes (net.profile: each stage launched alone): the slowest stages with their
    achieved GFLOP/s, and the stages summed by form and root operator ("element Mul": every
    element stage whose root is a Mul, epilogues and inlined nodes included)."""
    sys.path.insert(0, str(HERE / "experiments"))
    from profile_stages import stage_tflops

    one = net.network_for(batch) if hasattr(net, "network_for") else net
    times = one.profile(feeds, repeat=3)
    rates = stage_tflops(one, batch, times)
    total = sum(t for _, t in times)
    rows = sorted(zip(times, rates), key=lambda p: -p[0][1])[:top]
    by_op: dict[str, dict] = {}
    stages = one.plan.schedule.stages if one.plan.schedule is not None else []
    for stage, (_, ms) in zip(stages, times):
        agg = by_op.setdefault(f"{stage.domain} {stage.root[0].op_type}", {"stages": 0, "ms": 0.0})
        agg["stages"] += 1
        agg["ms"] += ms
    for agg in by_op.values():
        agg["share"] = agg["ms"] / total
    return {"total_ms": total, "stages": len(times),
            "slowest": [{"stage": name[:300], "ms": ms, "share": ms / total, "gflops": 1e3 * rate}
                        for (name, ms), rate in rows],
            "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1]["ms"]))}


def bench_cpu(net, batch: int, quick: bool, tmp: Path, reps: int, budget_s: float, profile: int,
              skip: frozenset = frozenset()) -> dict:
    """One network on the CPU backend against onnxruntime (its threads, and one) and torch eager."""
    import onnxruntime as ort
    import torch

    import luisaml

    rec = {"model": net.name, "family": net.family, "batch": batch, "status": "ok"}
    try:
        module, inputs = prepare(net, batch, quick, tmp, rec)
    except Exception as e:
        return rec | {"status": "export failed", "error": first_line(e)}
    feeds = {k: v.numpy() for k, v in inputs.items()}
    sessions = {}
    try:
        for side, threads in (("ort", 0), ("ort_1thread", 1)):
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            # pool threads that spin after a run take the cores from the side timed next (bench_models.py)
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sessions[side] = ort.InferenceSession(str(tmp / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        ref = sessions["ort"].run(None, feeds)[0]
    except Exception as e:  # no reference to check against
        return rec | {"status": "onnxruntime failed", "error": first_line(e)}
    args = tuple(inputs.values())

    def torch_run():
        with torch.no_grad():
            return module(*args)

    floor = rel_err(torch_run().numpy(), ref)
    fns = {side: (lambda s=s: s.run(None, feeds)) for side, s in sessions.items()} | {"torch": torch_run}
    fns = {side: fn for side, fn in fns.items() if side not in skip}
    ok, net_ = False, None
    try:
        t = time.perf_counter()
        stage = "compile"
        net_ = luisaml.compile(str(tmp / "model.onnx"), backend="cpu", **COMPILE_OPTIONS)
        stage = "run"
        y = net_.run(feeds)["y"]  # the first run builds the kernels
        rec["compile_s"] = time.perf_counter() - t
        ok = check(rec, y, ref, floor)
    except Exception as e:
        rec.update(status=f"{stage} failed", error=first_line(e))
    if ok:
        fns = {"luisaml": lambda: net_.run(feeds)} | fns
    n = timed_reps(fns, reps, budget_s)
    ms = interleaved(fns, n, warmup=0)
    rec.update(reps=n, ms={k: percentiles(v) for k, v in ms.items()}, ort_spinning=False)
    if ok:
        for side in CPU_BASELINES:
            if side in rec["ms"]:
                rec[f"x_{side}"] = rec["ms"]["luisaml"]["p50"] / rec["ms"][side]["p50"]
        rec["stages"] = _stages(net_, batch)
        if profile:
            rec["profile"] = stage_profile(net_, feeds, batch, profile)
    return rec


def _stages(net, batch: int) -> int:
    one = net.network_for(batch) if hasattr(net, "network_for") else net
    return len(one.plan.schedule.stages) if one.plan.schedule is not None else 1


# the sides also timed by the host clock: a user's net.run against torch's eager call, each
# ended by a synchronize (CUPTI spans leave out the launch latency before the first kernel and the
# host's work after the last one)
WALL_SIDES = ("luisaml", "torch_fp32")


def wall_times(fn, sync, reps: int) -> list[float]:
    """Host milliseconds per call of fn, each followed by sync."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def bench_cuda(net, batch: int, quick: bool, tmp: Path, reps: int, budget_s: float, profile: int,
               skip: frozenset = frozenset()) -> dict:
    """One network on the CUDA backend against torch on the same GPU and inputs (CUPTI spans)."""
    import torch

    import luisaml
    from bench_mlp import device_times

    rec = {"model": net.name, "family": net.family, "batch": batch, "status": "ok"}
    try:
        module, inputs = prepare(net, batch, quick, tmp, rec)
    except Exception as e:
        return rec | {"status": "export failed", "error": first_line(e)}
    sync = torch.cuda.synchronize
    gpu = copy.deepcopy(module).cuda()
    feeds = {k: v.cuda() for k, v in inputs.items()}
    args = tuple(feeds.values())
    backends = torch.backends
    shipped = backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32

    def tf32(on: tuple[bool, bool]):
        backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32 = on

    with torch.no_grad():
        tf32((False, False))  # the reference is true float32
        ref = gpu(*args).float().cpu().numpy()
        tf32(shipped)
        floor = rel_err(module(*inputs.values()).numpy(), ref)  # torch on the CPU against torch on CUDA
        if COMPILE_OPTIONS.get("tensor_cores"):
            tf32((True, True))
            rec["torch_tf32_rel_err"] = rel_err(gpu(*args).float().cpu().numpy(), ref)
            floor = max(floor, rec["torch_tf32_rel_err"])
            tf32(shipped)
        ok, net_ = False, None
        try:
            t = time.perf_counter()
            stage = "compile"
            net_ = luisaml.compile(str(tmp / "model.onnx"), backend="cuda", **COMPILE_OPTIONS)
            stage = "run"
            y = net_.run(feeds)["y"]  # the first run builds the kernels (a fresh machine: cold)
            sync()
            rec["compile_cold_s"] = time.perf_counter() - t
            ok = check(rec, y.float().cpu().numpy(), ref, floor)
        except Exception as e:
            rec.update(status=f"{stage} failed", error=first_line(e))
        rec["ms"], rec["timing"], rec["errors"], rec["wall_ms"] = {}, {}, {}, {}

        def time_side(side, fn, setup=None):
            if side in skip:
                return
            try:
                if setup:
                    setup()
                ms, how = device_times(fn, sync, reps)
                rec["ms"][side] = percentiles(ms)
                rec["timing"][side] = how  # CUPTI spans, or the host clock where CUPTI fails
                if side in WALL_SIDES:  # what a caller waits: launch, kernels, synchronize
                    rec["wall_ms"][side] = percentiles(wall_times(fn, sync, reps))
            except Exception as e:  # a baseline that cannot run here (no inductor, no half kernel)
                rec["ms"][side] = None
                rec["errors"][side] = first_line(e)
            finally:
                tf32(shipped)

        if ok:
            time_side("luisaml", lambda: net_.run(feeds))
        time_side("torch_fp32", lambda: gpu(*args))
        time_side("torch_fp32_notf32", lambda: gpu(*args), setup=lambda: tf32((False, False)))
        half = copy.deepcopy(gpu).half()
        hargs = tuple(a.half() if a.is_floating_point() else a for a in args)
        time_side("torch_fp16", lambda: half(*hargs))
        compiled = torch.compile(gpu)  # lazy: nothing compiles until its setup call
        time_side("torch_compile", lambda: compiled(*args), setup=lambda: (compiled(*args), sync()))
    rec["reps"] = reps
    if ok:
        for side in CUDA_BASELINES:
            if rec["ms"].get(side) and rec["ms"].get("luisaml"):
                rec[f"speedup_vs_{side}"] = rec["ms"][side]["p50"] / rec["ms"]["luisaml"]["p50"]
        if all(rec["wall_ms"].get(side) for side in WALL_SIDES):
            rec["wall_speedup_vs_torch_fp32"] = rec["wall_ms"]["torch_fp32"]["p50"] / rec["wall_ms"]["luisaml"]["p50"]
        rec["stages"] = _stages(net_, batch)
        if profile:
            rec["profile"] = stage_profile(net_, feeds, batch, profile)
    return rec


# ---- the results file -------------------------------------------------------------------------------


def ratio_keys(device: str) -> list[str]:
    if device == "cpu":
        return [f"x_{b}" for b in CPU_BASELINES]
    return [f"speedup_vs_{b}" for b in CUDA_BASELINES] + ["wall_speedup_vs_torch_fp32"]


def summary(records: list[dict], device: str) -> dict:
    """Geometric mean, median, best and worst of each ratio over the networks that passed."""
    out = {"networks": len(records), "ok": sum(r["status"] == "ok" for r in records),
           "failed": {r["model"]: r["status"] for r in records if r["status"] != "ok"}}
    for key in ratio_keys(device):
        vals = {r["model"]: r[key] for r in records if r.get(key)}
        if vals:
            worst = (max if device == "cpu" else min)(vals, key=vals.get)
            out[key] = {"geomean": float(np.exp(np.mean(np.log(list(vals.values()))))),
                        "median": float(statistics.median(vals.values())), "n": len(vals),
                        "worst": [worst, vals[worst]]}
    return out


def merge(path: Path, records: list[dict], meta: dict) -> dict:
    """Add records to the results file at path (a record replaces the one of its network), in the
    catalogue's order, with the summary over all of them."""
    from zoo_models import ZOO

    old = json.loads(path.read_text()) if path.exists() else {}
    keep = {r["model"]: r for r in old.get("records", []) if old.get("device") == meta["device"]
            and old.get("profile") == meta["profile"]}
    keep.update({r["model"]: r for r in records})
    order = {n.name: i for i, n in enumerate(ZOO)}
    merged = sorted(keep.values(), key=lambda r: order.get(r["model"], len(order)))
    doc = meta | {"records": merged, "summary": summary(merged, meta["device"])}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _num(v: float) -> str:
    """Three significant digits, never an exponent (1316, 6.66, 0.0123)."""
    return f"{v:.{max(0, 2 - math.floor(math.log10(abs(v))))}f}" if v else "0"


def _ms(r: dict, side: str, all3: bool = False) -> str:
    v = (r.get("ms") or {}).get(side)
    if not v:
        return "-"
    return f"{_num(v['p50'])} / {_num(v['p95'])} / {_num(v['p99'])}" if all3 else _num(v["p50"])


def _x(r: dict, key: str) -> str:
    return f"{r[key]:.2f}x" if r.get(key) else "-"


def table(doc: dict) -> str:
    """The markdown table of a results file, and its summary lines."""
    cpu = doc["device"] == "cpu"
    if cpu:
        head = ["network", "batch", "input", "luisaml ms P50 / P95 / P99", "onnxruntime ms", "x ort",
                "ort 1 thread ms", "x ort 1t", "torch ms", "x torch", "rel err", "compile s"]
        cols = [("ort", "x_ort"), ("ort_1thread", "x_ort_1thread"), ("torch", "x_torch")]
    else:
        head = ["network", "batch", "input", "luisaml ms P50 / P95 / P99", "torch fp32 ms", "speed-up",
                "fp32 no TF32 ms", "speed-up", "fp16 ms", "speed-up", "torch.compile ms", "speed-up",
                "wall: luisaml / torch fp32 ms", "wall speed-up", "rel err", "compile s"]
        cols = [(b, f"speedup_vs_{b}") for b in CUDA_BASELINES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["records"]:
        shape = "; ".join(("" if k == "x" else k + " ") + "x".join(map(str, s[1:])) for k, s in r.get("inputs", {}).items())
        cells = [r["model"], str(r["batch"]), shape]
        if r["status"] == "ok":
            cells.append(_ms(r, "luisaml", True))
        else:
            cells.append(f"**{r['status']}**: {r.get('error', '')}".replace("|", "\\|"))
        for side, key in cols:
            cells += [_ms(r, side), _x(r, key)]
        if not cpu:
            w = r.get("wall_ms") or {}
            cells.append(" / ".join(f"{w[s]['p50']:.3g}" for s in WALL_SIDES) if all(w.get(s) for s in WALL_SIDES) else "-")
            cells.append(_x(r, "wall_speedup_vs_torch_fp32"))
        cells.append(f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-")
        comp = r.get("compile_s", r.get("compile_cold_s"))
        cells.append(f"{comp:.1f}" if comp is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    s = doc["summary"]
    lines.append("")
    lines.append(f"{s['ok']} of {s['networks']} networks pass"
                 + (": " + ", ".join(f"{k} ({v})" for k, v in s["failed"].items()) + " do not." if s["failed"] else "."))
    for key in ratio_keys(doc["device"]):
        if key in s:
            v = s[key]
            lines.append(f"- {key}: geometric mean {v['geomean']:.2f}x, median {v['median']:.2f}x over {v['n']}, "
                         f"worst {v['worst'][0]} {v['worst'][1]:.2f}x")
    return "\n".join(lines)


def _version(package: str) -> str | None:
    """The installed version, or None (the GPU machine needs no onnxruntime)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def select(only: str | None, part: int | None) -> list:
    from zoo_models import ZOO

    by_name = {n.name: n for n in ZOO}
    names = [s.strip() for s in only.split(",")] if only else PARTS[part] if part else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown network(s) {unknown}; the zoo: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where luisaml runs")
    ap.add_argument("--quick", action="store_true", help="the CPU size profile (zoo_models' quick batches and sizes)")
    ap.add_argument("--part", type=int, choices=sorted(PARTS), help="one of the four parts (see the docstring)")
    ap.add_argument("--only", help="comma-separated network names")
    ap.add_argument("--skip", default="", help="comma-separated baselines to leave out (cuda: torch_fp16, torch_compile, ...)")
    ap.add_argument("--batch", type=int, help="every network at this batch (a smoke run)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs of each side (default: 30 on CUDA, 15 on the CPU)")
    ap.add_argument("--budget", type=float, default=None,
                    help="CPU: seconds of timing per network; fewer repetitions (>= 3) when they do not fit (default 12)")
    ap.add_argument("--profile", type=int, default=0,
                    help="record the slowest N stages of each network and its stage times by operator (net.profile)")
    ap.add_argument("--out", type=Path, help="results file (default benchmarks/results/zoo-cpu.json or zoo-h200.json)")
    ap.add_argument("--table", action="store_true", help="print the markdown table of the results file and stop")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a luisaml.compile keyword for every network (tune=fast, tensor_cores=auto); repeatable")
    ap.add_argument("--flush", type=int, default=None, help="commit net.run's command list every N launches without "
                    "waiting, so the device starts while the host enqueues the rest (default: the backend's, "
                    "luisaml/launch.py BACKEND_FLUSH; 0: one commit a run)")
    a = ap.parse_args(argv)
    for kv in a.option:
        key, _, value = kv.partition("=")
        COMPILE_OPTIONS[key] = {"false": False, "true": True}.get(value.lower(), int(value) if value.isdigit() else value)  # (winograd=4)
    out = a.out or HERE / "results" / ("zoo-cpu.json" if a.device == "cpu" else "zoo-h200.json")
    if a.table:
        print(table(json.loads(out.read_text())))
        return 0
    import torch

    import luisaml

    luisaml.device.init(a.device, tensor_cores=bool(COMPILE_OPTIONS.get("tensor_cores")))
    from luisaml import launch

    launch.FLUSH_LAUNCHES = a.flush
    nets = select(a.only, a.part)
    reps = a.reps or (30 if a.device == "cuda" else 15)
    budget = a.budget or 12.0
    meta = {"device": a.device, "profile": "quick" if a.quick else "full",
            "machine": machine() + (", shared with other jobs" if a.device == "cpu" else ""),
            "torch": torch.__version__, "onnxruntime": _version("onnxruntime"), "exporter": EXPORTER,
            "compile_options": COMPILE_OPTIONS, "rel_tol": REL_TOL, "floor_factor": FLOOR_FACTOR, "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
            "luisa_num_threads": os.environ.get("LUISA_NUM_THREADS", "default (all cores)")}
    if a.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    bench = bench_cpu if a.device == "cpu" else bench_cuda
    records = []
    for net in nets:
        batch = a.batch or (net.quick_batch if a.quick else net.batch)
        print(f"== {net.name} batch {batch}", flush=True)
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            rec = bench(net, batch, a.quick, Path(tmp), reps, budget, a.profile, frozenset(filter(None, a.skip.split(","))))
        rec.update(compile_options=dict(COMPILE_OPTIONS), flush_launches=a.flush, date=datetime.date.today().isoformat(), command="python benchmarks/bench_zoo.py " + " ".join(
            sys.argv[1:] if argv is None else argv), wall_s=time.perf_counter() - t,
                   load_avg_1min=os.getloadavg()[0])  # the host's other jobs: a shared CPU's numbers move with it
        records.append(rec)
        brief = {k: v for k, v in rec.items() if k.startswith(("x_", "speedup_vs_")) or k in ("status", "error", "rel_err")}
        print(f"   {rec['wall_s']:.0f} s: {json.dumps(brief)}", flush=True)
        doc = merge(out, [rec], meta)  # after every network, so a part cut short keeps what it measured
    print(f"\nwrote {out}\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
