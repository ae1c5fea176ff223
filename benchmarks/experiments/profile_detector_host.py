"""Where a detector frame's host time goes (issue 28): bench_detector.py's luisaml side compiled over a
frames file, then `--reps` loops over its frames under cProfile (by internal and cumulative time), the
host's waits for the stream timed apart (on the CPU backend the kernels run in them), and the time
inside each region named below summed a frame (a region's time includes the regions it calls).

    python benchmarks/experiments/profile_detector_host.py --quick [--grid-build device] [--reps 20]"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# (module, qualified name) of the functions whose time a frame is summed, less the host's waits for the
# stream inside them: what a frame's host work is made of (a region includes the regions it calls; a name
# missing in this checkout is skipped)
REGIONS = [
    ("luisaml.network", "CompiledNetwork.run"),
    ("luisaml.network", "CompiledNetwork.run_hashed"),  # a device build's network run (its own binding)
    ("luisaml.feeds", "host_feeds"),  # the grid steps (HostSteps.complete) and the feeds' conversion
    ("luisaml.fvdb.host_steps", "HostSteps.complete"),
    ("luisaml.fvdb.host_steps", "HostSteps._host_array"),  # each step input's hash
    ("luisaml.fvdb.host_steps", "DeviceBuilds.run"),
    ("luisaml.fvdb.host_steps", "on_host"),
    ("luisaml.fvdb.checked", "built"),
    ("luisaml.fvdb.checked", "freeze"),
    ("operators.fvdb.topology", "DeviceGridBuild._host_step"),  # a device build's read-back parsed (before layout2)
    ("operators.fvdb.build_layout", "GridLayout._host_step"),  # the same, the host's layout (LAYOUT_ON_DEVICE False)
    ("operators.fvdb.build_layout", "GridLayout._end_step"),  # the device's layout: the headers at the run's end
    ("luisaml.launch", "KernelLauncher._patch"),  # their patches over the downloaded blob
    ("luisaml.network", "CompiledNetwork.check_feeds"),
    ("luisaml.network", "CompiledNetwork._voxel_batch"),
    ("luisaml.network", "CompiledNetwork._bind"),
    ("luisaml.feeds", "BoundInputs.derived_buffers"),  # grid metadata and checks (bundle_grids), transforms
    ("operators.fvdb.common", "bundle_grids"),
    ("luisaml.feeds", "BoundInputs.byte_input"),  # a grid blob's hash and upload
    ("luisaml.feeds", "bytes_digest"),
    ("luisaml.pool", "BufferPool.sized"),
    ("luisaml.launch", "KernelLauncher.run"),
    ("luisaml.launch", "KernelLauncher.launch"),
    ("luisaml.launch", "KernelLauncher._read_rows"),
    ("luisaml.dispatch", "Launcher.__call__"),
]

_WAITED = [0.0]  # the host's waits for the stream so far (timed_sync)


def wrap(regions: dict) -> None:
    for mod_name, qual in REGIONS:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        owner, *rest = qual.split(".")
        target = getattr(mod, owner, None)
        if target is None:
            continue
        if rest:
            attr = rest[0]
            fn = getattr(target, attr, None)
        else:
            target, attr, fn = mod, owner, target
        if fn is None:
            continue
        depth = [0]

        def timed(*args, __fn=fn, __qual=qual, __depth=depth, **kw):
            __depth[0] += 1
            t, w = time.perf_counter(), _WAITED[0]
            try:
                return __fn(*args, **kw)
            finally:
                __depth[0] -= 1
                if __depth[0] == 0:  # (a recursive call counted once)
                    regions[__qual][0] += time.perf_counter() - t - (_WAITED[0] - w)
                    regions[__qual][1] += 1

        setattr(target, attr, timed)
        if not rest:  # (a function imported by name elsewhere: that name too)
            for m in list(sys.modules.values()):
                if getattr(m, "__name__", "").startswith(("luisaml", "operators")) and getattr(m, attr, None) is fn:
                    setattr(m, attr, timed)


def main(argv=None) -> int:
    import bench_detector as bd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--frames", help="the frames file (default bench_detector's)")
    ap.add_argument("--grid-build", choices=("device", "host"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-cprofile", action="store_true", help="the regions' times only (no profiler overhead)")
    ap.add_argument("--dump", help="write the cProfile stats there (pstats' format)")
    a = ap.parse_args(argv)
    path = Path(a.frames) if a.frames else HERE.parent / "results" / f"detector-frames{'-quick' if a.quick else ''}.npz"
    if not path.exists():
        bd.write_frames(path, bd.SIZES["quick" if a.quick else "full"])
    data = bd.read_frames(path)
    import dataclasses

    import luisaml
    from luisaml import counts

    backend = luisaml.device.init("cpu")
    ex = bd.example()
    cfg, backbone, head = bd.modules(ex, data)
    grid_build = {} if a.grid_build is None else {"grid_build": a.grid_build}
    nets = ex.compile_networks(dataclasses.replace(cfg, voxelize="device"), backbone, head, data["points"][0],
                               backend=backend, **grid_build)

    def frame(points):
        out, _ = nets.run(points)
        return ex.detections(*(out[n] for n in ex.OUTPUTS))

    for p, want in zip(data["points"], data["reference"]):  # (compiles the device builds' buckets too)
        assert bd.compare(frame(p), want)["correct"]
    regions = defaultdict(lambda: [0.0, 0])
    wrap(regions)
    waited = _WAITED
    regions.clear()
    waited[0] = 0.0
    n = a.reps * len(data["points"])
    prof = cProfile.Profile()
    with bd.stream_waits(waited), counts.measure() as c:
        t = time.perf_counter()
        if not a.no_cprofile:
            prof.enable()
        for _ in range(a.reps):
            for p in data["points"]:
                frame(p)
        prof.disable()
        wall = time.perf_counter() - t
    print(f"{n} frames: wall {wall / n * 1e3:.2f} ms a frame, waits for the stream {waited[0] / n * 1e3:.2f} ms, "
          f"host {(wall - waited[0]) / n * 1e3:.2f} ms{'' if a.no_cprofile else ' (under cProfile)'}; a frame: "
          + ", ".join(f"{k} {v / n:.1f}" for k, v in c.as_dict().items() if k in counts._SUMMED))
    for qual, (s, calls) in sorted(regions.items(), key=lambda kv: -kv[1][0]):
        print(f"  {qual:32s} {s / n * 1e3:7.3f} ms a frame less waits ({calls / n:.1f} calls)")
    if not a.no_cprofile:
        if a.dump:
            prof.dump_stats(a.dump)
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(a.top)
        st.sort_stats("cumulative").print_stats(a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
