"""Topology ops over a grid bound at run time, built on the device (grid_build="device") against the
host's numpy builder (grid_build="host", the same code that folds them at compile time), over a
one-voxel sphere shell (radius 126 voxels, ~200k voxels, centre 256: a 512^3 extent; the sparse
convolution benchmark's grid). Correctness first: every bundle array of the device's grid equal to
the host builder's (the blob byte for byte), over two shells.

CUDA (writes benchmarks/results/topology-<gpu>.json, e.g. topology-h200.json):
    python benchmarks/bench_topology.py
CPU backend, a smaller shell (writes benchmarks/results/topology-cpu.json):
    python benchmarks/bench_topology.py --cpu [--radius 24]

Per op (CoarsenedGrid 2, ConvGrid 2/2 and 3/1, DilatedGrid 1, RefinedGrid 2; then GridBatchFromPoints
over clouds of a dynamic count, 1M and 0.9M points on a sphere, 64K on the CPU), P50/P95/P99 over --reps:
- `run_ms`: host wall time of net.run of the op alone, numpy in and out, a different grid every run
  (two shells in turn, so the step's cache never answers): what a perception pipeline with a new
  grid every frame pays (the bundle checked, uploaded, built, read back);
- `device_ms` (CUDA): the sum of the build's kernel durations per run (CUPTI), the device's own work;
- `span_ms` (CUDA): first kernel start to last kernel end per run (bench_mlp.device_times: with the
  launches' gaps and the read-back's round trip);
- `host_ms`: the host builder (grid_build="host") in the same process on the same grids.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fvdb import (CPU_RADIUS, GPU_RADIUS, bundle_inputs, device_rows, fmt_ms, onnx_model,  # noqa: E402
                        record, shell_voxels, start, write_record)  # (sys.path: the checkout, tests/fvdb)
from bench_mlp import percentiles, timed  # noqa: E402

OPS = [("CoarsenedGrid", {"coarsening_factor": [2, 2, 2]}), ("ConvGrid", {"kernel_size": [2, 2, 2], "stride": [2, 2, 2]}),
       ("ConvGrid", {"kernel_size": [3, 3, 3], "stride": [1, 1, 1]}), ("DilatedGrid", {"dilation": 1}),
       ("RefinedGrid", {"subdiv_factor": [2, 2, 2]})]


def op_model(op_type: str, attrs: dict, bundle: list):
    """The model of op_type alone over a bound grid (bundle: its arrays), its new bundle the outputs."""
    from onnx import helper

    from fvdb_reference import ELEM
    from luisaml.opsets import fvdb as schema

    new = [f"new_{n}" for n in schema.BUNDLE]
    node = helper.make_node(op_type, list(schema.BUNDLE), new, name="topo", domain=schema.DOMAIN, **attrs)
    outs = [helper.make_tensor_value_info(n, ELEM[a.dtype], [None] * a.ndim) for n, a in zip(new, bundle)]
    return onnx_model([node], bundle_inputs(bundle), outs)


def _points_of_any_count(rec: dict, cuda: bool, reps: int) -> bool:
    """GridBatchFromPoints over clouds of a dynamic count (1M and 0.9M points on a sphere: a step, its
    network counting the points by joffsets) against GridBatch.from_points; a row of rec["ops"].
    Return whether the grids were equal."""
    from onnx import TensorProto, helper

    import luisaml
    from bench_grid_build import H, sphere_points
    from fvdb_reference import ELEM
    from luisaml.fvdb import GridBatch
    from luisaml.opsets import fvdb as schema

    n = (1 << 20) if cuda else (1 << 16)
    rng = np.random.default_rng(0)
    clouds = [sphere_points(n, 200.0, 256.0, rng), sphere_points(n - n // 10, 190.0, 250.0, rng)]
    feeds = [{"jdata": p, "joffsets": np.array([0, len(p)], np.int64), "jidx": np.zeros(0, np.int32),
              "jlidx": np.zeros((0, 1), np.int32), "voxel_sizes": np.full((1, 3), H), "origins": np.zeros((1, 3))}
             for p in clouds]
    ins = [helper.make_tensor_value_info("jdata", TensorProto.FLOAT, ["N", 3])]
    ins += [helper.make_tensor_value_info(k, ELEM[v.dtype], list(v.shape)) for k, v in feeds[0].items() if k != "jdata"]
    new = [f"new_{b}" for b in schema.BUNDLE]
    node = helper.make_node("GridBatchFromPoints", list(feeds[0]), new, name="build", domain=schema.DOMAIN)
    outs = [helper.make_tensor_value_info(b, ELEM[np.dtype(t)], [None] * d) for b, t, d in
            zip(new, ["uint8", "int64", "float64", "float64", "int32", "int64", "int32"], [1, 1, 2, 2, 1, 1, 1])]
    model = onnx_model([node], ins, outs)
    t0 = time.perf_counter()
    net = luisaml.compile(model, batch_axis=None, grid_build="device")
    got = [net.run(f) for f in feeds]
    first_s = time.perf_counter() - t0
    want = [GridBatch.from_points([p], H, 0.0).bundle() for p in clouds]
    bad = [b for g, w in zip(got, want) for b, x in zip(new, w) if g[b].shape != x.shape or not np.array_equal(g[b], x)]
    print(f"GridBatchFromPoints of any count ({len(clouds[0]):,} / {len(clouds[1]):,} points): "
          f"{'equal' if not bad else 'DIFFERS in ' + ', '.join(sorted(set(bad)))} to GridBatch.from_points; "
          f"compile + first runs {first_s:.1f} s", flush=True)
    if bad:
        return False
    turn = iter(range(10**9))
    run = lambda: net.run(feeds[next(turn) % 2])  # noqa: E731
    row = {"op": "GridBatchFromPoints", "attrs": {"points": [len(c) for c in clouds]},
           "voxels_out": [int(w[5][-1]) for w in want], "compile_and_first_runs_s": first_s,
           "correct": "every bundle array equal to GridBatch.from_points, two clouds",
           "run_ms": percentiles(timed(run, reps)),
           "host_ms": percentiles(timed(lambda: GridBatch.from_points([clouds[next(turn) % 2]], H, 0.0),
                                        max(3, reps // 4), warmup=1))}
    if cuda:
        row.update(device_rows(run, reps))
    rec["ops"].append(row)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU backend (a smaller shell by default)")
    ap.add_argument("--radius", type=float, help=f"shell radius in voxels (default {GPU_RADIUS:g}; {CPU_RADIUS:g} on the CPU)")
    ap.add_argument("--host-layout", action="store_true", help="device builds laid out by the host mid-run (two "
                    "waits a build: DeviceGridBuild.LAYOUT_ON_DEVICE = False, the A/B of operators/fvdb/build_layout.py)")
    started = start(ap, argv, (20, 3))
    if started is None:
        return 2
    a, backend, name, tag, reps = started
    import luisaml
    from luisaml.fvdb import GridBatch
    from luisaml.operators.fvdb.topology import DeviceGridBuild
    from luisaml.opsets import fvdb as schema

    DeviceGridBuild.LAYOUT_ON_DEVICE = not a.host_layout  # (before any network is compiled)
    cuda = not a.cpu
    radius = a.radius or (GPU_RADIUS if cuda else CPU_RADIUS)
    shells = [GridBatch.from_ijk([shell_voxels(radius)], 1.0 / 256, 0.0),
              GridBatch.from_ijk([shell_voxels(radius - 3.0, 250)], 1.0 / 256, 0.0)]
    bundles = [list(g.bundle()) for g in shells]
    feeds = [dict(zip(schema.BUNDLE, b)) for b in bundles]
    voxels = [int(g.total_voxels) for g in shells]
    print(f"{name}: shells of {voxels[0]:,} and {voxels[1]:,} voxels", flush=True)
    rec: dict = {**record(backend, name, "bench_topology.py", argv),
                 "grids": f"one-voxel sphere shells of radius {radius:g} and {radius - 3:g} voxels (a 512^3 extent)",
                 "voxels": voxels, "layout": "host" if a.host_layout else "device", "ops": []}
    failed = False
    for op_type, attrs in OPS:
        model = op_model(op_type, attrs, bundles[0])
        t0 = time.perf_counter()
        dev = luisaml.compile(model, batch_axis=None, grid_build="device")
        got = [dev.run(f) for f in feeds]
        first_s = time.perf_counter() - t0
        host = luisaml.compile(model, batch_axis=None, grid_build="host")
        want = [host.run(f) for f in feeds]
        bad = [n for g, w in zip(got, want) for n in w if g[n].shape != w[n].shape or not np.array_equal(g[n], w[n])]
        label = f"{op_type} {attrs}"
        out_voxels = [int(w["new_batch_offsets"][-1]) for w in want]
        print(f"{label}: {out_voxels[0]:,} / {out_voxels[1]:,} voxels out; against the host builder: "
              f"{'equal' if not bad else 'DIFFERS in ' + ', '.join(sorted(set(bad)))}; compile + first runs "
              f"{first_s:.1f} s", flush=True)
        if bad:
            failed = True
            continue
        turn = iter(range(10**9))

        def alternate(net):
            return lambda: net.run(feeds[next(turn) % 2])
        row = {"op": op_type, "attrs": attrs, "voxels_out": out_voxels, "compile_and_first_runs_s": first_s,
               "correct": "every bundle array equal to the host builder's, two shells",
               "run_ms": percentiles(timed(alternate(dev), reps)),
               "host_ms": percentiles(timed(alternate(host), max(3, reps // 4), warmup=1))}
        if cuda:
            row.update(device_rows(alternate(dev), reps))
        rec["ops"].append(row)
    failed |= not _points_of_any_count(rec, cuda, reps)
    path = write_record(rec, a.out_dir, f"topology-{tag}.json")
    print(f"\n{name}  {rec['date']}  shells of {voxels[0]:,} / {voxels[1]:,} voxels")
    print("| op | voxels out | device ms P50 / P95 / P99 | span ms P50 / P95 / P99 | net.run ms P50 / P95 / P99 | "
          "host builder ms P50 | host / run |")
    print("|---|---|---|---|---|---|---|")
    for row in rec["ops"]:
        print(f"| {row['op']} {row['attrs']} | {row['voxels_out'][0]:,} | {fmt_ms(row, 'device_ms', 2)} | "
              f"{fmt_ms(row, 'span_ms', 2)} | {fmt_ms(row, 'run_ms', 2)} | "
              f"{row['host_ms']['p50']:.1f} | {row['host_ms']['p50'] / row['run_ms']['p50']:.1f}x |")
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
