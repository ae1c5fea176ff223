"""Where net.run's wall time goes beyond the kernels' span on CUDA: one zoo network compiled at its
zoo batch, run on torch CUDA tensors (zero copy); wall time per run with launch.FLUSH_LAUNCHES 0 and
N (interleaved), the host's time to enqueue the stages (KernelLauncher.launch) and a cProfile of the
runs by internal time.

    LUISAML_BACKEND=cuda python3 -P benchmarks/experiments/profile_run_host.py resnet-18 [--flush 4 16] [--reps 30]"""
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
    ap.add_argument("--flush", type=int, nargs="+", default=[8], help="launches between commits to compare with 0")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: this script's own test")
    a = ap.parse_args(argv)
    import torch

    import bench_zoo
    import luisaml
    import zoo_models
    from luisaml import launch

    net = next(n for n in zoo_models.ZOO if n.name == a.network)
    batch = a.batch or net.batch
    tmp = Path(tempfile.mkdtemp())
    _, inputs = bench_zoo.prepare(net, batch, False, tmp, {})
    luisaml.device.init(a.device)
    cn = luisaml.compile(str(tmp / "model.onnx"), backend=a.device)
    cuda = a.device == "cuda"
    feeds = {k: (v.cuda() if cuda else v.numpy()) for k, v in inputs.items()}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cn.run(feeds)
    sync()
    one = cn.network_for(batch) if hasattr(cn, "network_for") else cn
    stages = len(one.plan.schedule.stages) if one.plan.schedule is not None else 1
    enqueue: list[float] = []
    original = launch.KernelLauncher.launch

    def timed(self, *args, **kw):
        t = time.perf_counter()
        try:
            return original(self, *args, **kw)
        finally:
            enqueue.append(time.perf_counter() - t)

    launch.KernelLauncher.launch = timed
    walls: dict[int, list[float]] = {f: [] for f in [0, *a.flush]}
    for _ in range(a.reps):
        for flush in walls:
            launch.FLUSH_LAUNCHES = flush
            t = time.perf_counter()
            cn.run(feeds)
            sync()
            walls[flush].append((time.perf_counter() - t) * 1e3)
    launch.KernelLauncher.launch = original  # (net.profile's one-stage launches are not a run's enqueue)
    prof = net_kernels = None
    try:
        prof = one.profile({k: v for k, v in feeds.items()}, repeat=3)
        net_kernels = sum(ms for _, ms in prof)
    except Exception as e:  # (profile is informative only)
        print(f"net.profile failed: {e}")
    print(f"{net.name} batch {batch}: {stages} stages; enqueue {np.median(enqueue) * 1e3:.3f} ms "
          f"({np.median(enqueue) * 1e6 / stages:.1f} us a stage); kernels alone {net_kernels} ms")
    for flush, ms in walls.items():
        print(f"  flush {flush}: wall P50 {np.median(ms):.3f} ms P95 {np.percentile(ms, 95):.3f}")
    launch.FLUSH_LAUNCHES = 0
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        cn.run(feeds)
        sync()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    return 0


if __name__ == "__main__":
    sys.exit(main())
