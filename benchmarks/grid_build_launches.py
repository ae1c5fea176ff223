"""Launches of a device grid build by stage kind, and its CPU-backend run time (benchmarks/NOTES.md "Fewer
launches a device grid build: no top-level stage, the leaves in one stage").

GridBatchFromPoints over N points of a cloud across the origin (two root tiles an axis: 4 radix passes), with
`conv` a ConvGrid 3/2 of that grid too, both built on the device (host steps: the capacity buckets); one run
builds the kernels, then `reps` runs with the host steps' results forgotten (each builds again), timed and
counted (luisaml/counts.py). Prints the stages of each build network by kind and a TIMES line (JSON).

    python -P benchmarks/grid_build_launches.py 100000 pts 15
    python -P benchmarks/grid_build_launches.py 100000 conv 15

The base side of an A/B runs the same script with luisaml's four packages (luisaml, luisaml.operators,
luisaml.opsets, luisaml.shaders) mapped to another checkout: the venv's editable install maps them by name,
so PYTHONPATH alone does not switch them (a sys.meta_path finder first does).
"""
from __future__ import annotations

import collections
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "fvdb"), str(ROOT / "tests")]


def kind(name: str) -> str:
    return re.sub(r"level \d+", "level k", re.sub(r"radix pass \d+", "radix pass", name))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    n, conv, reps = int(argv[0]), argv[1] == "conv", int(argv[2])
    import luisaml
    from luisaml import counts
    from test_radix_passes import _forget_steps, points_model

    rng = np.random.default_rng(0)
    pts = rng.normal(0, 30.0, (n, 3)).astype(np.float32)
    feeds = {"jdata": pts, "joffsets": np.array([0, n], np.int64), "voxel_sizes": np.full((1, 3), 0.5),
             "origins": np.zeros((1, 3))}
    net = luisaml.compile(points_model("GridBatchFromPoints", conv), batch_axis=None, grid_build="device")
    net.run(feeds)
    times = []
    for _ in range(reps):
        _forget_steps(net)
        t = time.perf_counter()
        with counts.measure() as c:
            net.run(feeds)
        times.append(time.perf_counter() - t)
    print(f"{n} points{', then ConvGrid 3/2' if conv else ''}: launches {c.launches}; run median "
          f"{np.median(times) * 1e3:.2f} ms, p10 {np.percentile(times, 10) * 1e3:.2f} ms")
    for key, build in net.plan.host_steps.device.networks.items():
        tab = collections.Counter(kind(st.phase_name or "?") for st in build.plan.schedule.stages)
        print(f"  build network {key[0]} at {key[1]:,} (every pass: {sum(tab.values())} stages)")
        for k, v in tab.items():
            print(f"    {v:3d} x {k}")
    print("TIMES", json.dumps({"n": n, "conv": conv, "launches": c.launches, "t": times}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
