"""One launch two ways: S dependent stages as consecutive dispatches in one command list, or one
persistent kernel whose stages are separated by a grid-wide barrier (an atomic counter every block
arrives at and spins on). The stress test first: each stage reads what *other* blocks wrote in
the stage before (a rotation by a block and a bit), so a barrier that lets a block run ahead, or
a write another block cannot see yet, gives a wrong sum. LuisaCompute exposes atomics and block
barriers but no memory fence, so the barrier must prove itself before its time means anything.

    python benchmarks/experiments/micro_grid_barrier.py [--n 1048576] [--stages 16] [--reps 50]

Prints JSON: the stress result (mismatches over runs) and the device time per forward of both
(CUDA only: the CPU backend cannot compile sync_block)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_mlp's timing
from bench_mlp import percentiles, timed  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--runs", type=int, default=200, help="stress runs of the barrier kernel")
    a = ap.parse_args(argv)
    import luisa

    luisa.init("cuda")
    from micro_grid_barrier_kernels import barrier_kernel, stage_kernel

    from luisaml.device import sm_count

    n, S, NT = a.n, a.stages, 256
    blocks = sm_count() * 2  # resident for sure: 256 threads and no shared arrays beyond one int
    x0 = np.arange(n, dtype=np.float32) % 7
    want = x0.copy()
    shift = NT * 3 + 1  # another block's elements
    for _ in range(S):
        want = np.roll(want, -shift) + 1.0
    bufs = [luisa.Buffer.from_array(x0.copy()), luisa.Buffer(n, float)]
    counter = luisa.Buffer.from_array(np.zeros(2, np.int32))
    flag = luisa.Buffer.from_array(np.zeros(1, np.int32))

    def dispatches():
        for s in range(S):
            stage_kernel(bufs[s % 2], bufs[(s + 1) % 2], n, shift, dispatch_size=n)

    def persistent():
        barrier_kernel(bufs[0], bufs[1], counter, flag, n, shift, S, dispatch_size=blocks * NT)

    out = np.empty(n, np.float32)
    result = {"n": n, "stages": S, "blocks": blocks}
    for name, fn in (("dispatches", dispatches), ("persistent", persistent)):
        bad, timeouts = 0, 0
        runs = a.runs if name == "persistent" else 3
        for _ in range(runs):
            bufs[0].copy_from_array(x0)
            flag.copy_from_array(np.zeros(1, np.int32))
            fn()
            luisa.synchronize()
            bufs[S % 2].copy_to(out)
            f = np.zeros(1, np.int32)
            flag.copy_to(f)
            timeouts += int(f[0] != 0)
            bad += int(not np.array_equal(out, want))
        # (the stress runs above were the warm-ups)
        p = percentiles(timed(lambda: (fn(), luisa.synchronize()), a.reps, warmup=0))
        result[name] = {"wrong_runs": bad, "spin_timeouts": timeouts, "runs": runs,
                        "p50_ms": p["p50"], "p95_ms": p["p95"]}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    sys.exit(main())
