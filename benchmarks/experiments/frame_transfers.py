"""A detector frame's transfers and the cost of the blobs' uploads (issue 28 item 3, benchmarks/NOTES.md "The
blobs' round trip"): bench_detector's quick frames compiled as bench_host_launch.py's `detector` case (grids
built on the device, CPU backend).

`bytes`: each upload, download and copy on the device a frame, by kind and the luisaml functions that
enqueued it (kB and commands a frame). `ab`: in one process, rounds of frames alternating the blobs bound by
a copy on the device (luisaml/resident.py) and by an upload from the host (resident.source answering None:
the path before), wall and wall less the waits and the main thread's CPU time, p10 and p50; the launches
stubbed as bench_host_launch.py's (--real: the CPU backend runs them). One process, so the load of a shared
host moves both modes alike (the process-to-process noise here is +-15%).

    python -P benchmarks/experiments/frame_transfers.py bytes [--frames 6]
    python -P benchmarks/experiments/frame_transfers.py ab [--rounds 12] [--real]"""
from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _case():
    import bench_host_launch as b
    import luisaml

    luisaml.device.init("cpu")
    (label, run, inputs), = b._detector_case()
    for x in inputs * 2:  # (real runs: every kernel built)
        run(x)
    return run, inputs


def transfers(frames: int) -> None:
    from luisa import lcapi

    stats: collections.Counter = collections.Counter()
    on = [False]
    root = str(HERE.parent.parent)

    def wrap(cls, kind: str):
        create = cls.create

        def counted(*a):
            if on[0]:
                where = [f.name for f in traceback.extract_stack(limit=14)[:-1]
                         if f.filename.startswith(root) and "/benchmarks/" not in f.filename]
                key = (kind, " < ".join(reversed(where[-5:])))
                stats[key] += a[4] if kind == "copy" else a[2]
                stats[key + ("n",)] += 1
            return create(*a)
        return counted

    originals = [(c, c.create) for c in (lcapi.BufferUploadCommand, lcapi.BufferDownloadCommand, lcapi.BufferCopyCommand)]
    lcapi.BufferUploadCommand.create = wrap(lcapi.BufferUploadCommand, "up")
    lcapi.BufferDownloadCommand.create = wrap(lcapi.BufferDownloadCommand, "down")
    lcapi.BufferCopyCommand.create = wrap(lcapi.BufferCopyCommand, "copy")
    try:
        run, inputs = _case()
        on[0] = True
        for k in range(frames):
            run(inputs[k % len(inputs)])
        on[0] = False
    finally:
        for c, create in originals:
            c.create = create
    for key, v in sorted(stats.items(), key=lambda kv: -kv[1]):
        if len(key) == 2:
            print(f"{v / frames / 1e3:10.1f} kB {stats[key + ('n',)] / frames:5.1f} a frame  {key[0]:5} {key[1]}")
    for kind in ("up", "down", "copy"):
        total = sum(v for key, v in stats.items() if len(key) == 2 and key[0] == kind)
        print(f"{kind}: {total / frames / 1e6:.3f} MB a frame")


def ab(rounds: int, real: bool) -> None:
    from luisaml import counts, resident

    run, inputs = _case()
    source = resident.source
    add_launches, sync = counts.CountingStream.add_launches, counts.CountingStream.synchronize
    waited = [0.0]

    def stubbed(self):
        _, done = add_launches(self)
        return (lambda command: None), done

    def timed_sync(self):
        t = time.perf_counter()
        sync(self)
        waited[0] += time.perf_counter() - t

    res = {"copy": ([], [], []), "upload": ([], [], [])}
    if not real:
        counts.CountingStream.add_launches = stubbed
    counts.CountingStream.synchronize = timed_sync
    k = 0
    try:
        for r in range(rounds):
            for mode in (("copy", "upload") if r % 2 == 0 else ("upload", "copy")):
                resident.source = source if mode == "copy" else (lambda a: None)
                for _ in range(3):  # (the other mode's buffers warmed)
                    run(inputs[k % len(inputs)])
                    k += 1
                for _ in range(15):
                    x = inputs[k % len(inputs)]
                    k += 1
                    waited[0] = 0.0
                    t, tc = time.perf_counter(), time.thread_time()
                    run(x)
                    wall = time.perf_counter() - t
                    for v, value in zip(res[mode], (wall, wall - waited[0], time.thread_time() - tc)):
                        v.append(value)
    finally:
        resident.source = source
        counts.CountingStream.add_launches, counts.CountingStream.synchronize = add_launches, sync
    print(f"{'mode':8} {'wall p10':>9} {'p50':>7} {'less waits p10':>15} {'p50':>7} {'cpu p10':>8} {'p50':>7}  "
          f"({'kernels run' if real else 'launches stubbed'}, us)")
    for mode, (wall, own, cpu) in res.items():
        p = lambda v, q: np.percentile(v, q) * 1e6  # noqa: E731
        print(f"{mode:8} {p(wall, 10):9.0f} {p(wall, 50):7.0f} {p(own, 10):15.0f} {p(own, 50):7.0f} {p(cpu, 10):8.0f} "
              f"{p(cpu, 50):7.0f}  n={len(wall)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("bytes", "ab"))
    ap.add_argument("--frames", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--real", action="store_true", help="ab: the kernels launched (the CPU backend runs them)")
    a = ap.parse_args(argv)
    if a.what == "bytes":
        transfers(a.frames)
    else:
        ab(a.rounds, a.real)
    return 0


if __name__ == "__main__":
    sys.exit(main())
