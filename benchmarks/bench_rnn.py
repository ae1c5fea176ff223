"""GRU and LSTM exported from torch (nn.GRU / nn.LSTM, 64 -> 128, seq 32, batch_first, random weights):
luisaml's recurrent stages (operators/rnn_stages.py) against a baseline in the same process.

CUDA (batch 1,024) against torch fp32 eager (TF32 as torch ships it, which an RNN does not use):
    LUISAML_BACKEND=cuda python benchmarks/bench_rnn.py --device cuda
CPU backend (batch 64) against onnxruntime (its default threads, and one thread):
    python benchmarks/bench_rnn.py --device cpu

Correctness first (the command fails past REL_TOL of the reference's largest value), then the two
sides timed interleaved on the same inputs, P50/P95/P99 in milliseconds and the ratio of medians.
luisaml runs `net.run` (on CUDA with torch tensors in and out: no host copies, as torch; on the CPU
with numpy arrays, as onnxruntime). Writes benchmarks/results/rnn-<device>.json (or --out)."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

# torch's OpenMP threads (the export) would spin after each parallel region, as onnxruntime's pool
# does without allow_spinning=0 below, taking the cores from the side timed next (bench_zoo.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("luisaml") is None:
    sys.path.insert(0, str(HERE.parent))

REL_TOL = 1e-4
INPUT, HIDDEN, SEQ = 64, 128, 32


def module(cell: str, layers: int = 1, bidirectional: bool = False):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            kind = torch.nn.GRU if cell == "gru" else torch.nn.LSTM
            self.rnn = kind(INPUT, HIDDEN, num_layers=layers, batch_first=True, bidirectional=bidirectional)

        def forward(self, x):
            return self.rnn(x)[0]

    torch.manual_seed(0)
    return Net().eval()


def export(mod, batch: int):
    import onnx
    import torch

    buf = io.BytesIO()
    x = torch.zeros(batch, SEQ, INPUT)
    torch.onnx.export(mod, (x,), buf, input_names=["x"], output_names=["y"], opset_version=17, dynamo=False)
    return onnx.load_from_string(buf.getvalue())


def pcts(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99))}


def interleaved(fns: dict, reps: int, warmup: int = 3) -> dict:
    """Time each fn (it synchronises) reps times, round robin; return name -> P50/P95/P99 ms."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: pcts(v) for k, v in times.items()}


def check(name: str, got: np.ndarray, want: np.ndarray) -> float:
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    if not err <= REL_TOL:
        raise SystemExit(f"{name}: luisaml differs from the reference by {err:.3g} of its largest value (> {REL_TOL})")
    return err


def run_cuda(cells: list[str], batch: int, reps: int) -> list[dict]:
    import torch

    import luisaml

    rows = []
    for cell in cells:
        mod = module(cell).cuda()
        x = torch.randn(batch, SEQ, INPUT, device="cuda")
        t0 = time.perf_counter()
        net = luisaml.compile(export(module(cell), batch), backend="cuda")
        y = net.run({"x": x})["y"]
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        with torch.no_grad():
            want = mod(x)
        err = check(cell, y.detach().cpu().numpy().reshape(want.shape), want.cpu().numpy())

        def ours():
            net.run({"x": x})
            torch.cuda.synchronize()

        def theirs():
            with torch.no_grad():
                mod(x)
            torch.cuda.synchronize()

        t = interleaved({"luisaml": ours, "torch_fp32": theirs}, reps)
        rows.append({"model": f"{cell} {INPUT}->{HIDDEN} seq {SEQ}", "batch": batch, "rel_err": err,
                     "compile_s": compile_s, "ms": t, "speedup_vs_torch_fp32": t["torch_fp32"]["p50"] / t["luisaml"]["p50"],
                     "stages": len(net.plan.schedule.stages) if getattr(net, "plan", None) and net.plan.schedule else None})
        print(f"{cell}: luisaml {t['luisaml']['p50']:.3f} ms, torch fp32 {t['torch_fp32']['p50']:.3f} ms "
              f"({rows[-1]['speedup_vs_torch_fp32']:.2f}x), rel err {err:.2g}", flush=True)
    return rows


def run_cpu(cells: list[str], batch: int, reps: int) -> list[dict]:
    import onnxruntime as ort

    import luisaml

    rows = []
    for cell in cells:
        model = export(module(cell), batch)
        x = np.random.default_rng(0).standard_normal((batch, SEQ, INPUT)).astype(np.float32)
        sessions = {}
        for name, threads in (("ort", 0), ("ort_1thread", 1)):
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            # pool threads that spin after a run take the cores from the side timed next (as bench_zoo.py)
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sessions[name] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        want = sessions["ort"].run(None, {"x": x})[0]
        t0 = time.perf_counter()
        net = luisaml.compile(model, backend="cpu")
        got = net.run({"x": x})["y"]
        compile_s = time.perf_counter() - t0
        err = check(cell, np.asarray(got).reshape(want.shape), want)
        fns = {"luisaml": lambda: net.run({"x": x})}
        for name, s in sessions.items():
            fns[name] = (lambda s=s: s.run(None, {"x": x}))
        t = interleaved(fns, reps)
        row = {"model": f"{cell} {INPUT}->{HIDDEN} seq {SEQ}", "batch": batch, "rel_err": err, "compile_s": compile_s,
               "ort_spinning": False,
               "ms": t, "x_ort": t["luisaml"]["p50"] / t["ort"]["p50"],
               "x_ort_1thread": t["luisaml"]["p50"] / t["ort_1thread"]["p50"]}
        rows.append(row)
        print(f"{cell}: luisaml {t['luisaml']['p50']:.2f} ms, onnxruntime {t['ort']['p50']:.2f} ms ({row['x_ort']:.2f}x), "
              f"1 thread {t['ort_1thread']['p50']:.2f} ms ({row['x_ort_1thread']:.2f}x), compile {compile_s:.1f} s, "
              f"rel err {err:.2g}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cells", nargs="+", default=["gru", "lstm"], choices=("gru", "lstm"))
    ap.add_argument("--batch", type=int, default=None, help="default: 1024 on CUDA, 64 on the CPU")
    ap.add_argument("--reps", type=int, default=None, help="default: 50 on CUDA, 15 on the CPU")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    batch = args.batch or (1024 if cuda else 64)
    reps = args.reps or (50 if cuda else 15)
    rows = (run_cuda if cuda else run_cpu)(args.cells, batch, reps)
    out = args.out or HERE / "results" / f"rnn-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "host": platform.node(), "device": args.device, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
