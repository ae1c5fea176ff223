"""net.run's host time alone, on any backend (issue 27): one zoo network compiled at a small batch, and per
run (a) the time KernelLauncher.launch takes to enqueue the stages (the device waited for outside the
timing, so the CPU backend's kernels do not count) and (b) the time of a whole net.run with the stages'
launches stubbed out (feeds checked, inputs bound, state upload, read-backs, one wait, results): the
per-run fixed cost. Each as the median wall time and the median of the main thread's CPU time
(time.thread_time: what other processes on a loaded host take from it does not count). --zero-copy runs
torch tensors through luisaml/zero_copy.py (the zoo benchmark's CUDA path; mapped to the CPU backend's
memory as the tests do); --cprofile enqueue|fixed profiles the one or the other; --in-a-row times only
stubbed runs, one after another.

On the CPU backend a zoo network's kernels (170 ms for densenet-121 at batch 1) evict the host's caches
between runs, which slows the host side measured after them 2-10x (net.run without launches: ~110 us in a
row, ~900 us after each run with kernels); `chain-K` (a chain of K MatMul + Relu layers, 16 wide: K
stages of trivial kernels) measures the host side with warm caches, as on a GPU.

    python3 -P benchmarks/experiments/bench_host_launch.py densenet-121 [--batch 1] [--reps 200] [--zero-copy]
    python3 -P benchmarks/experiments/bench_host_launch.py chain-300

Grids built on the device (issue 28 item 3): `topology` runs bench_topology.py's ops (CoarsenedGrid 2,
ConvGrid 2/2 and 3/1, DilatedGrid 1, RefinedGrid 2 over two one-voxel sphere shells of --radius voxels,
and GridBatchFromPoints over two clouds of a dynamic count, --points and 0.9x as many) compiled with
grid_build="device" (the device form, CUDA's default, on the CPU backend); `detector` runs bench_detector's
quick frames (grid_build="device", the voxelization in net A). Each case's first runs are real (kernels
built, results correct); then --reps runs alternate the inputs (a new grid every run: the steps' caches
never answer) with the kernel launches stubbed: each launch's command is still created, encoded and built
(luisa-python's per-command work) but dropped instead of added to the stream, so a run times luisaml's
Python, luisa-python's per-command work and the uploads, downloads and waits (reported apart: `waits`)
of what remains. The device grid builds' networks (host_steps.DeviceBuilds._run_net: a build's or a pair's
run) launch for real: a build reads back counts and a blob its own kernels wrote, and its kernels share
their scratch with the other builds' (pool.SharedBuffers), so a stubbed build read another build's words
(until 2026-12-07: "bad magic" in checked.built). On the CPU backend their kernels run inside the waits,
timed apart, so "less waits" stays the host's work; the main thread's CPU time (`cpu`) is the steadier
figure on a loaded host.
Per case: us a run (median, min; without the waits), the launches and host synchronisations a run;
--cprofile prints each case's functions by internal time; --regions the main thread's CPU time in a fixed list
of luisaml's functions (REGIONS; no profiler), a device build's apart.

    python3 -P benchmarks/experiments/bench_host_launch.py topology [--radius 12] [--points 4096] [--reps 100] [--cprofile fixed]
    python3 -P benchmarks/experiments/bench_host_launch.py detector [--reps 30] [--only CoarsenedGrid,points] [--regions]"""
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


def _chain(layers: int, batch: int, path: Path):
    """(a stand-in for a zoo entry, its inputs) of a chain of MatMul + Relu layers written to path."""
    import types

    import onnx
    import torch
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for k in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((16, 16)) / 4).astype(np.float32), f"w{k}"))
        nodes += [helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"]), helper.make_node("Relu", [f"m{k}"], [f"r{k}"])]
        x = f"r{k}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 16])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    x = torch.from_numpy(rng.standard_normal((batch, 16)).astype(np.float32))
    return types.SimpleNamespace(name=f"chain-{layers}"), {"x": x}


# ---- grids built on the device (the topology ops, GridBatchFromPoints, a detector frame) ----------------

TOPOLOGY = [("CoarsenedGrid", {"coarsening_factor": [2, 2, 2]}),
            ("ConvGrid", {"kernel_size": [2, 2, 2], "stride": [2, 2, 2]}),
            ("ConvGrid", {"kernel_size": [3, 3, 3], "stride": [1, 1, 1]}),
            ("DilatedGrid", {"dilation": 1}), ("RefinedGrid", {"subdiv_factor": [2, 2, 2]})]


def _topology_cases(radius: float, points: int):
    """[(label, network, [feeds, feeds])]: bench_topology's ops over two shells, and GridBatchFromPoints
    over two clouds of a dynamic count, each compiled with grid_build="device"."""
    import bench_topology as bt
    from bench_fvdb import shell_voxels
    from bench_grid_build import H, sphere_points
    from onnx import TensorProto, helper

    import luisaml
    from fvdb_reference import ELEM
    from luisaml.fvdb import GridBatch
    from luisaml.opsets import fvdb as schema

    shells = [GridBatch.from_ijk([shell_voxels(radius)], 1.0 / 256, 0.0),
              GridBatch.from_ijk([shell_voxels(radius - 3.0, 250)], 1.0 / 256, 0.0)]
    bundles = [list(g.bundle()) for g in shells]
    feeds = [dict(zip(schema.BUNDLE, b)) for b in bundles]
    cases = []
    for op, attrs in TOPOLOGY:
        net = luisaml.compile(bt.op_model(op, attrs, bundles[0]), batch_axis=None, grid_build="device")
        label = f"{op} " + "/".join(str(v[0] if isinstance(v, list) else v) for v in attrs.values())
        cases.append((f"{label} ({int(shells[0].total_voxels)} voxels)", net, feeds))
    rng = np.random.default_rng(0)
    clouds = [sphere_points(points, 200.0, 256.0, rng), sphere_points(points - points // 10, 190.0, 250.0, rng)]
    pfeeds = [{"jdata": p, "joffsets": np.array([0, len(p)], np.int64), "jidx": np.zeros(0, np.int32),
               "jlidx": np.zeros((0, 1), np.int32), "voxel_sizes": np.full((1, 3), H), "origins": np.zeros((1, 3))}
              for p in clouds]
    ins = [helper.make_tensor_value_info("jdata", TensorProto.FLOAT, ["N", 3])]
    ins += [helper.make_tensor_value_info(k, ELEM[v.dtype], list(v.shape)) for k, v in pfeeds[0].items() if k != "jdata"]
    new = [f"new_{b}" for b in schema.BUNDLE]
    node = helper.make_node("GridBatchFromPoints", list(pfeeds[0]), new, name="build", domain=schema.DOMAIN)
    outs = [helper.make_tensor_value_info(b, ELEM[np.dtype(t)], [None] * d) for b, t, d in
            zip(new, ["uint8", "int64", "float64", "float64", "int32", "int64", "int32"], [1, 1, 2, 2, 1, 1, 1])]
    from bench_fvdb import onnx_model

    net = luisaml.compile(onnx_model([node], ins, outs), batch_axis=None, grid_build="device")
    cases.append((f"GridBatchFromPoints ({points} points)", net, pfeeds))
    return [(label, lambda f, net=net: net.run(f), fs) for label, net, fs in cases]


def _detector_case():
    """[(label, frame(points), [points of each frame])]: bench_detector's quick frames, grids built on the device."""
    import dataclasses

    import bench_detector as bd

    path = HERE.parent / "results" / "detector-frames-quick.npz"
    if not path.exists():
        bd.write_frames(path, bd.SIZES["quick"])
    data = bd.read_frames(path)
    ex = bd.example()
    cfg, backbone, head = bd.modules(ex, data)
    nets = ex.compile_networks(dataclasses.replace(cfg, voxelize="device"), backbone, head, data["points"][0],
                               backend="cpu", grid_build="device")

    def frame(points):
        out, _ = nets.run(points)
        return ex.detections(*(out[n] for n in ex.OUTPUTS))

    for p, want in zip(data["points"], data["reference"]):
        assert bd.compare(frame(p), want)["correct"], "the detector's boxes differ from the torch reference"
    return [(f"detector frame (quick, {'/'.join(str(len(p)) for p in data['points'])} points)", frame, data["points"])]


# --regions: functions whose main-thread CPU time a stubbed run reports, a device build's apart (unprofiled: a
# wrapper costs ~1 us, where cProfile inflated this call-heavy Python ~2.5x and unevenly)
REGIONS = ["luisaml.network:CompiledNetwork.run", "luisaml.fvdb.host_steps:HostSteps.complete",
           "luisaml.fvdb.host_steps:HostStep.run", "luisaml.fvdb.host_steps:DeviceBuilds._build",
           "luisaml.fvdb.host_steps:DeviceBuilds.run_pair",
           "luisaml.network:CompiledNetwork.run_hashed", "luisaml.fvdb.radix_passes:idle_passes",
           "luisaml.fvdb.checked:built", "luisaml.network:CompiledNetwork.check_feeds", "luisaml.network:CompiledNetwork._voxel_batch",
           "luisaml.network:CompiledNetwork._bind", "luisaml.feeds:BoundInputs.derived_buffers",
           "luisaml.feeds:BoundInputs.byte_input", "luisaml.launch:KernelLauncher._run_once",
           "luisaml.launch:KernelLauncher.launch", "luisaml.dispatch:Launcher.enqueue",
           "luisaml.operators.fvdb.build_layout:GridLayout._lay_out", "luisaml.launch:KernelLauncher._patch",
           "luisaml.counts:CountingStream.synchronize"]


def _regions(building: list):
    """(install, remove, {label: [seconds, calls]}) of REGIONS' wrappers (counted while installed; a label
    ends in [build] inside a device build)."""
    import importlib

    acc: dict = {}
    saved = []
    for spec in REGIONS:
        module, path = spec.split(":")
        *owner, name = path.split(".")
        obj = importlib.import_module(module)
        for part in owner:
            obj = getattr(obj, part)
        saved.append((obj, name, obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)))

    def wrapped(f, label):
        def w(*args, **kw):
            t = time.thread_time()
            try:
                return f(*args, **kw)
            finally:
                row = acc.setdefault(label + (" [build]" if building[0] else ""), [0.0, 0])
                row[0] += time.thread_time() - t
                row[1] += 1
        return w

    def install():
        for obj, name, f in saved:
            setattr(obj, name, wrapped(f, f"{getattr(obj, '__name__', '')}.{name}"))

    def remove():
        for obj, name, f in saved:
            setattr(obj, name, f)
    return install, remove, acc


def grids(a) -> int:
    """The `topology` and `detector` cases (module docstring): per-run host us with the launches stubbed."""
    import luisaml
    from luisaml import counts

    sys.path.insert(0, str(HERE.parent.parent / "tests" / "fvdb"))
    luisaml.device.init("cpu")
    cases = _topology_cases(a.radius, a.points) if a.network == "topology" else _detector_case()
    if a.only:
        cases = [c for c in cases if any(o.lower() in c[0].lower() for o in a.only.split(","))]
    from luisaml.fvdb import host_steps

    add_launches = counts.CountingStream.add_launches
    sync = counts.CountingStream.synchronize
    build = host_steps.DeviceBuilds._run_net
    building = [0]  # device builds under way: their launches run (module docstring)

    def stubbed(self):  # (each command still created, encoded and built: dropped, not enqueued)
        if building[0]:
            return add_launches(self)
        _, done = add_launches(self)
        return (lambda command: None), done

    def real_build(self, *args, **kw):
        building[0] += 1
        try:
            return build(self, *args, **kw)
        finally:
            building[0] -= 1

    waited = [0.0]

    def timed_sync(self):
        t = time.perf_counter()
        sync(self)
        waited[0] += time.perf_counter() - t

    dumped: list[str] = []
    # (p10 less waits: steadier than the median on a shared host, benchmarks/NOTES.md "The detector frame's host Python")
    print(f"{'case':<44} {'us a run':>9} {'min':>8} {'cpu':>8} {'less waits':>10} {'min':>8} {'p10':>8} {'launches':>8} "
          f"{'syncs':>6}")
    for label, run, inputs in cases:
        for x in inputs * 2:  # (real runs: every kernel built, every bucket compiled)
            run(x)
        counts.CountingStream.add_launches = stubbed
        counts.CountingStream.synchronize = timed_sync
        host_steps.DeviceBuilds._run_net = real_build
        # (the thread's CPU time: a loaded host's preemptions are not charged to whatever function ran)
        pr = cProfile.Profile(time.thread_time) if a.cprofile else None
        regions = _regions(building) if a.regions else None
        try:
            warm = 10
            for k in range(warm):
                run(inputs[k % len(inputs)])
            if regions is not None:
                regions[0]()
            wall, cpu, own = [], [], []
            with counts.measure() as c:
                for k in range(a.reps):
                    # (the warm-up's order continued: a run of the inputs of the run before it, whose grid steps
                    # serve it from their cache, was the detector's `min` until 2026-12-07)
                    x = inputs[(warm + k) % len(inputs)]
                    waited[0] = 0.0
                    if pr is not None:
                        pr.enable()
                    t, tc = time.perf_counter(), time.thread_time()
                    run(x)
                    wall.append(time.perf_counter() - t)
                    cpu.append(time.thread_time() - tc)
                    if pr is not None:
                        pr.disable()
                    own.append(wall[-1] - waited[0])
        finally:
            counts.CountingStream.add_launches = add_launches
            counts.CountingStream.synchronize = sync
            host_steps.DeviceBuilds._run_net = build
            if regions is not None:
                regions[1]()
        us = lambda v: np.median(v) * 1e6  # noqa: E731
        print(f"{label:<44} {us(wall):9.0f} {np.min(wall) * 1e6:8.0f} {us(cpu):8.0f} {us(own):10.0f} "
              f"{np.min(own) * 1e6:8.0f} {np.percentile(own, 10) * 1e6:8.0f} {c.launches / a.reps:8.0f} "
              f"{c.syncs / a.reps:6.2f}", flush=True)
        if regions is not None:
            for name, (sec, calls) in sorted(regions[2].items(), key=lambda kv: -kv[1][0]):
                print(f"  {name:<48} {sec / a.reps * 1e6:8.0f} us a run (main thread CPU) {calls / a.reps:6.1f} calls")
        if pr is not None:
            pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
            if a.dump:
                pr.dump_stats(f"{a.dump}.{len(dumped)}")
                dumped.append(label)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("network", help="a zoo network's name, chain-K, topology or detector")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--zero-copy", action="store_true")
    ap.add_argument("--in-a-row", action="store_true",
                    help="only net.run with the launches stubbed, run after run (the caches warm): the per-run cost")
    ap.add_argument("--pause", type=float, default=0.01, help="seconds between a run with kernels and one without")
    ap.add_argument("--cprofile", choices=("enqueue", "fixed"), help="profile the enqueues or the stubbed runs")
    ap.add_argument("--radius", type=float, default=12.0, help="topology: the first shell's radius in voxels")
    ap.add_argument("--points", type=int, default=4096, help="topology: GridBatchFromPoints' first cloud")
    ap.add_argument("--only", help="topology, detector: the cases whose label holds one of these (comma-separated)")
    ap.add_argument("--regions", action="store_true",
                    help="topology, detector: main-thread CPU a run in REGIONS' functions (unprofiled)")
    ap.add_argument("--top", type=int, default=25, help="--cprofile: the functions printed")
    ap.add_argument("--dump", help="--cprofile, topology and detector: each case's stats written to DUMP.<k>")
    a = ap.parse_args(argv)
    if a.network in ("topology", "detector"):
        if a.reps == 200:
            a.reps = 100
        return grids(a)

    import bench_zoo
    import luisaml
    import zoo_models
    from luisa import globalvars
    from luisaml import launch, zero_copy

    tmp = Path(tempfile.mkdtemp())
    if a.network.startswith("chain-"):
        net, inputs = _chain(int(a.network[len("chain-"):]), a.batch, tmp / "model.onnx")
    else:
        net = next(n for n in zoo_models.ZOO if n.name == a.network)
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

    if a.in_a_row:
        launch.KernelLauncher.launch = stubbed
        for _ in range(50):
            cn.run(feeds)
        row = []
        for _ in range(a.reps * 5):
            t = time.perf_counter()
            cn.run(feeds)
            row.append(time.perf_counter() - t)
        print(f"{net.name} batch {a.batch} on {a.device}{' (zero copy)' if a.zero_copy else ''}: run without launches, "
              f"in a row: median {np.median(row) * 1e6:.1f} us, min {np.min(row) * 1e6:.1f}")
        return 0
    fixed: list[float] = []
    fixed_cpu: list[float] = []
    waits: list[float] = []  # the stubbed runs' time in the stream's synchronize (the backend's, not luisaml's)
    stream = globalvars.vars.stream
    wait = stream.synchronize

    def timed_wait():
        t = time.perf_counter()
        wait()
        waits[-1] += time.perf_counter() - t

    pr = cProfile.Profile() if a.cprofile else None
    for _ in range(a.reps):
        launch.KernelLauncher.launch = timed
        if pr is not None and a.cprofile == "enqueue":
            pr.enable()
        cn.run(feeds)
        if pr is not None:
            pr.disable()
        launch.KernelLauncher.launch = stubbed
        time.sleep(a.pause)  # (the backend's threads, busy after the kernels, let go of the cores)
        if pr is not None and a.cprofile == "fixed":
            pr.enable()
        waits.append(0.0)
        stream.synchronize = timed_wait
        t, c = time.perf_counter(), time.thread_time()
        cn.run(feeds)
        sync()
        fixed.append(time.perf_counter() - t)
        fixed_cpu.append(time.thread_time() - c)
        del stream.synchronize
        if pr is not None:
            pr.disable()
    launch.KernelLauncher.launch = original
    e, f = np.median(enqueue) * 1e6, np.median(fixed) * 1e6
    ec, fc = np.median(enqueue_cpu) * 1e6, np.median(fixed_cpu) * 1e6
    em, fm = np.min(enqueue) * 1e6, np.min(fixed) * 1e6
    own = np.array(fixed) - np.array(waits)
    om, omin = np.median(own) * 1e6, np.min(own) * 1e6
    print(f"{net.name} batch {a.batch} on {a.device}{' (zero copy)' if a.zero_copy else ''}: {stages} stages; "
          f"enqueue {e:.0f} us a run ({e / stages:.2f} us a stage; the thread's CPU time {ec:.0f}, {ec / stages:.2f}; "
          f"min {em:.0f}, {em / stages:.2f}); run without launches {f:.0f} us (CPU {fc:.0f}, min {fm:.0f}; "
          f"without its wait {om:.0f}, min {omin:.0f})")
    if pr is not None:
        pstats.Stats(pr).sort_stats("tottime" if a.cprofile == "enqueue" else "cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
