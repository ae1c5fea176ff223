"""net.run's host time alone, on any backend (issue 27): one zoo network compiled at a small batch, and per
run (a) the time KernelLauncher.launch takes to enqueue the stages (the device waited for outside the
timing, so the CPU backend's kernels do not count) and (b) the time of a whole net.run with the stages'
launches stubbed out (feeds checked, inputs bound, state upload, read-backs, one wait, results): the
per-run fixed cost. Each as the median wall time and the median of the main thread's CPU time
(time.thread_time: what other processes on a loaded host take from it does not count). --zero-copy runs torch tensors through luisaml/zero_copy.py (the zoo benchmark's CUDA
path; mapped to the CPU backend's memory as the tests do); --cprofile prints the enqueue's profile.

    python3 -P benchmarks/experiments/bench_host_launch.py densenet-121 [--batch 1] [--reps 200] [--zero-copy]"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("network")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--zero-copy", action="store_true")
    ap.add_argument("--cprofile", choices=("enqueue", "fixed"), help="profile the enqueues or the stubbed runs")
    a = ap.parse_args(argv)

    import bench_zoo
    import luisaml
    import zoo_models
    from luisa import globalvars
    from luisaml import launch, zero_copy

    net = next(n for n in zoo_models.ZOO if n.name == a.network)
    tmp = Path(tempfile.mkdtemp())
    _, inputs = bench_zoo.prepare(net, a.batch, False, tmp, {})
    luisaml.device.init(a.device)
    cn = luisaml.compile(str(tmp / "model.onnx"), backend=a.device)
    if a.zero_copy:
        zero_copy.SHARED_DEVICES.setdefault(a.device, a.device)
        feeds = dict(inputs) if a.device != "cuda" else {k: v.cuda() for k, v in inputs.items()}
    else:
        feeds = {k: v.numpy() for k, v in inputs.items()}
    cn.run(feeds)
    one = cn.network_for(a.batch) if hasattr(cn, "network_for") else cn
    stages = len(one.plan.schedule.stages) if one.plan.schedule is not None else 1
    original = launch.KernelLauncher.launch
    enqueue: list[float] = []
    enqueue_cpu: list[float] = []

    def timed(self, *args, **kw):  # the enqueue alone: the device drained before, waited for after
        globalvars.vars.stream.synchronize()
        t, c = time.perf_counter(), time.thread_time()
        original(self, *args, **kw)
        enqueue.append(time.perf_counter() - t)
        enqueue_cpu.append(time.thread_time() - c)

    def stubbed(self, *args, **kw):  # no stage launched: the run's own cost
        return None

    def sync():
        if a.zero_copy and a.device == "cuda":
            import torch

            torch.cuda.synchronize()

    fixed: list[float] = []
    fixed_cpu: list[float] = []
    pr = cProfile.Profile() if a.cprofile else None
    for _ in range(a.reps):
        launch.KernelLauncher.launch = timed
        if pr is not None and a.cprofile == "enqueue":
            pr.enable()
        cn.run(feeds)
        if pr is not None:
            pr.disable()
        launch.KernelLauncher.launch = stubbed
        if pr is not None and a.cprofile == "fixed":
            pr.enable()
        t, c = time.perf_counter(), time.thread_time()
        cn.run(feeds)
        sync()
        fixed.append(time.perf_counter() - t)
        fixed_cpu.append(time.thread_time() - c)
        if pr is not None:
            pr.disable()
    launch.KernelLauncher.launch = original
    e, f = np.median(enqueue) * 1e6, np.median(fixed) * 1e6
    ec, fc = np.median(enqueue_cpu) * 1e6, np.median(fixed_cpu) * 1e6
    em, fm = np.min(enqueue) * 1e6, np.min(fixed) * 1e6
    print(f"{net.name} batch {a.batch} on {a.device}{' (zero copy)' if a.zero_copy else ''}: {stages} stages; "
          f"enqueue {e:.0f} us a run ({e / stages:.2f} us a stage; the thread's CPU time {ec:.0f}, {ec / stages:.2f}; "
          f"min {em:.0f}, {em / stages:.2f}); run without launches {f:.0f} us (CPU {fc:.0f}, min {fm:.0f})")
    if pr is not None:
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
