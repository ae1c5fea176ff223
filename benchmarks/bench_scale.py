"""Past one device (issue 30): a NeRF-style MLP (xyz, its positional encoding of 10 frequencies,
63 -> WIDTH x DEPTH -> 4, ReLU) over many points, on 1 worker and on N, through luisaml.parallel (one
worker process per device) and through Ray Data actors (luisaml.ray), against one process's net.run
in the same run.

CPU backend (the workers share the host's cores: 1 worker runs all of them, N workers a share each):
    python benchmarks/bench_scale.py --backend cpu --points 65536 --devices 1,2 --ray
A host of several GPUs (one worker or actor a GPU; 256M points):
    python benchmarks/bench_scale.py --backend cuda --points 268435456 --width 256 --devices 1,2,4,8 --ray

Correctness first: every configuration's outputs must equal the single process's net.run bit for
bit (the command fails otherwise), then `--reps` timed runs of the whole batch (on the CPU
interleaved: a round of every configuration per rep, all pools started first): P50/P95/P99 ms,
throughput (points/s at P50), speed-up over 1 worker and scaling efficiency (speed-up / N). A
parallel.Pool is started once (its start, the workers' load and kernel build, reported apart); Ray
runs one job over reps + 1 passes of the batch (Ray Data's actor pool lives for one job): its first
pass, which includes the actors' start, is reported apart, the others are timed from one pass's
last row to the next's, every row checked. Writes benchmarks/results/scale-<backend>.json (or --out)."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("luisaml") is None:
    sys.path.insert(0, str(HERE.parent))

FREQUENCIES = 10  # NeRF's positional encoding of a point: 3 + 3 * 2 * 10 = 63 features


def nerf_mlp(width: int, depth: int):
    """A seeded torch module: points [B, 3] -> positional encoding [B, 63] -> depth ReLU layers -> [B, 4]."""
    import torch

    class NeRF(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("freqs", (2.0 ** torch.arange(FREQUENCIES, dtype=torch.float32)) * torch.pi)
            widths = [3 + 6 * FREQUENCIES] + [width] * depth
            layers = []
            for a, b in zip(widths, widths[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))

        def forward(self, x):
            angles = (x.unsqueeze(-1) * self.freqs).reshape(x.shape[0], 3 * FREQUENCIES)
            return self.mlp(torch.cat([x, torch.sin(angles), torch.cos(angles)], dim=-1))

    torch.manual_seed(0)
    return NeRF().eval()


def build(width: int, depth: int, backend: str, where: Path) -> str:
    """Export the module, compile it on `backend` and save the .lml; return its path."""
    import torch

    import luisaml

    onnx_path = where / "nerf.onnx"
    torch.onnx.export(nerf_mlp(width, depth), (torch.zeros(3, 3),), str(onnx_path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "B"}, "y": {0: "B"}}, opset_version=17, dynamo=False)
    return str(luisaml.compile(str(onnx_path), backend=backend).save(where / "nerf.lml", model_name="nerf.onnx"))


def pcts(ms: list[float]) -> dict:
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"p50_ms": round(float(p50), 3), "p95_ms": round(float(p95), 3), "p99_ms": round(float(p99), 3)}


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def same(name: str, got: np.ndarray, want: np.ndarray) -> None:
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = int(np.argmax(np.any(got != want, axis=-1))) if got.shape == want.shape else -1
        sys.exit(f"{name}: outputs differ from the single process's net.run (shape {got.shape} vs {want.shape}, "
                 f"first differing row {bad})")


def run_ray(lml: str, x: np.ndarray, want: np.ndarray, devices: list[int], backend: str, reps: int, cores: int) -> list[dict]:
    import ray

    import luisaml.ray

    # a CPU slot more than the actors take: the dataset's own tasks (reading the blocks) need one
    ray.init(num_cpus=cores + 1, include_dashboard=False, log_to_driver=False,
             configure_logging=False, object_store_memory=min(64 << 30, max(256 << 20, 3 * (x.nbytes + want.nbytes))))
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    rows = []
    try:
        for n in devices:
            cuts = _cuts(len(x), 4 * n)
            # one job over reps + 1 passes of the batch (Ray Data starts its actors once a job): the
            # first pass includes the actors' start, the others time the batch as the Pool's runs do
            refs = [ray.put(x[a:b]) for a, b in cuts]  # (each block once in the object store, read reps + 1 times)
            ds = ray.data.from_numpy_refs(refs * (reps + 1)).rename_columns({"data": "x"})
            kw = {} if backend == "cuda" else {"num_cpus": max(1, cores // n)}
            out = luisaml.ray.map_batches(ds, lml, actors=n, backend=backend, **kw)
            done, t0, ends = 0, time.perf_counter(), []
            for b in out.iter_batches(batch_size=None, batch_format="numpy"):
                y = b["y"]
                at = done % len(x)
                same(f"ray, {n} actor(s), rows {done}..", y, want[at:at + len(y)])  # (every pass checked)
                done += len(y)
                if done % len(x) == 0:
                    ends.append(time.perf_counter())
            if done != (reps + 1) * len(x):
                sys.exit(f"ray, {n} actor(s): {done} rows came back of {(reps + 1) * len(x)}")
            ms = [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]
            rows.append({"path": "ray", "workers": n, "first_pass_s": round(ends[0] - t0, 2), **pcts(ms)})
            print(f"ray {n} actor(s): first pass {ends[0] - t0:.2f} s, P50 {rows[-1]['p50_ms']:.1f} ms", flush=True)
    finally:
        ray.shutdown()
    return rows


def interleaved(lml: str, x: np.ndarray, want: np.ndarray, single, devices: list[int], reps: int) -> list[dict]:
    """The CPU's runs: every pool started, then a round of (net.run, each pool's run) per rep, so the
    load other processes put on a shared machine falls on every configuration alike."""
    from luisaml import parallel

    pools, starts = [], []
    try:
        for n in devices:
            t = time.perf_counter()
            pools.append(parallel.Pool(lml, n, backend="cpu"))
            starts.append(time.perf_counter() - t)
            same(f"parallel, {n} worker(s)", pools[-1].run({"x": x})["y"], want)
        runs = [single] + [lambda p=p: p.run({"x": x}) for p in pools]
        ms: list[list[float]] = [[] for _ in runs]
        for _ in range(reps):
            for k, fn in enumerate(runs):
                ms[k] += timed(fn, 1)
    finally:
        for p in pools:
            p.close()
    return ([{"path": "net.run, this process", "workers": 1, **pcts(ms[0])}]
            + [{"path": "parallel.run", "workers": n, "pool_start_s": round(t, 2), **pcts(m)}
               for n, t, m in zip(devices, starts, ms[1:])])


def _cuts(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // parts)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def device_name(backend: str) -> str:
    if backend == "cuda":
        try:
            import subprocess

            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=20).stdout.split("\n")
            names = [s for s in names if s.strip()]
            return f"{len(names)} x {names[0]}" if names else "cuda"
        except (OSError, subprocess.SubprocessError):
            return "cuda"
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "cpu")
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--points", type=int, default=65536)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4, help="hidden layers of --width")
    ap.add_argument("--devices", default="1,2", help="worker counts to time, e.g. 1,2,4,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ray", action="store_true", help="time Ray Data actors too")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    os.environ["LUISAML_BACKEND"] = args.backend
    devices = [int(d) for d in args.devices.split(",")]
    cores = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()

    import luisaml
    from luisaml import parallel

    with tempfile.TemporaryDirectory() as tmp:
        lml = build(args.width, args.depth, args.backend, Path(tmp))
        x = np.random.default_rng(0).uniform(-1, 1, (args.points, 3)).astype(np.float32)
        net = luisaml.load(lml)
        ins, outs = parallel.ports(net)
        chunk = parallel.max_rows(net)

        def single():
            return parallel.run_in_chunks(net, {"x": x}, ins, outs, len(x), chunk)["y"]

        want = single()  # (builds the kernels)
        # correctness against torch first: the reference itself is the model's
        import torch

        with torch.no_grad():
            ref = nerf_mlp(args.width, args.depth)(torch.from_numpy(x[:4096])).numpy()
        err = float(np.max(np.abs(want[:4096] - ref)) / max(1e-30, float(np.max(np.abs(ref)))))
        if err > 1e-4:
            sys.exit(f"net.run differs from torch by {err:.2e} of its largest output")
        if args.backend == "cpu":
            rows = interleaved(lml, x, want, single, devices, args.reps)
        else:  # (one pool at a time: the pools of one GPU would share its memory)
            rows = [{"path": "net.run, this process", "workers": 1, **pcts(timed(single, args.reps))}]
            for n in devices:
                t = time.perf_counter()
                with parallel.Pool(lml, n, backend=args.backend) as pool:
                    start = time.perf_counter() - t
                    same(f"parallel, {n} worker(s)", pool.run({"x": x})["y"], want)
                    ms = timed(lambda: pool.run({"x": x}), args.reps)
                rows.append({"path": "parallel.run", "workers": n, "pool_start_s": round(start, 2), **pcts(ms)})
        for r in rows:
            print(f"{r['path']} {r['workers']}: P50 {r['p50_ms']:.1f} ms", flush=True)
        if args.ray:
            rows += run_ray(lml, x, want, devices, args.backend, args.reps, cores)

    for r in rows:
        r["points_per_s"] = round(args.points / (r["p50_ms"] / 1e3))
        base = next((b for b in rows if b["path"] == r["path"] and b["workers"] == 1), None)
        if base is not None and r["path"] != "net.run, this process":
            r["speedup"] = round(base["p50_ms"] / r["p50_ms"], 2)
            r["efficiency"] = round(r["speedup"] / r["workers"], 2)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "device": device_name(args.backend), "backend": args.backend,
        "command": "python benchmarks/bench_scale.py " + " ".join(sys.argv[1:]),
        "model": f"NeRF-style MLP: xyz -> encoding of {FREQUENCIES} frequencies (63) -> {args.width} x {args.depth} -> 4",
        "points": args.points, "reps": args.reps, "cores": cores,
        "load_average_1_5_15min_before_1min_after": [round(v, 2) for v in load_before + os.getloadavg()[:1]],
        "rel_err_vs_torch": err, "rows": rows,
    }
    out = args.out or HERE / "results" / f"scale-{args.backend}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['device']}, {args.points:,} points, {result['model']}")
    print("| path | workers | P50 / P95 / P99 ms | points/s | speed-up | efficiency | start s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        start = r.get("pool_start_s", r.get("first_pass_s", "-"))
        print(f"| {r['path']} | {r['workers']} | {r['p50_ms']:.1f} / {r['p95_ms']:.1f} / {r['p99_ms']:.1f} | "
              f"{r['points_per_s']:,} | {r.get('speedup', '-')} | {r.get('efficiency', '-')} | {start} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
