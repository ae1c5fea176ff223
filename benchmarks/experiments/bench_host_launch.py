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
    python3 -P benchmarks/experiments/bench_host_launch.py chain-300"""
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("network")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--zero-copy", action="store_true")
    ap.add_argument("--in-a-row", action="store_true",
                    help="only net.run with the launches stubbed, run after run (the caches warm): the per-run cost")
    ap.add_argument("--pause", type=float, default=0.01, help="seconds between a run with kernels and one without")
    ap.add_argument("--cprofile", choices=("enqueue", "fixed"), help="profile the enqueues or the stubbed runs")
    a = ap.parse_args(argv)

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
