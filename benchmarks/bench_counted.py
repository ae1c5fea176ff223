"""Counted execution (issue 28 item 3): what one `net.run` asks of the device — host synchronisations,
kernel launches, uploads, downloads (luisaml/counts.py) — and its wall time against the device's span,
for the fVDB steps and the detector, each network run over a new grid every call (two inputs in turn):

- `detector backbone`, `detector head`: examples/lidar_detector.py's two networks over bench_detector.py's
  frames (frames 0 and 1 in turn; the frames file is written first when missing), the backbone from the
  points (--voxelize device, the default) or from the host's voxels (--voxelize host);
- `GridBatchFromPoints`: a grid built from a fixed number of points as a stage of the network (its
  layout read back once mid-run: luisaml/dynamic.py HostRead);
- `ConvGrid (device build)`: a topology op over a grid bound at run time, built on the device
  (grid_build="device": a network of the node alone, run as a host step);
- `sparse U-Net`: examples/sparse_unet.py's FineGridUNet, its coarse level made per new grid.

The detector's and the U-Net's coarse grids are built where the backend builds them (--grid-build: on
the CPU `device` gives the counts a CUDA run has, the device builds' networks run as host steps).

Per network, P50 over --reps calls: `run_ms` (host wall of net.run, numpy in and out); on CUDA `span_ms`
(the first kernel's start to the last kernel's end of a call, CUPTI through torch.profiler:
bench_mlp.device_times) and `run / span` (issue 28's target: <= 1.3); on the CPU `kernels_ms`, the sum of
the stages each timed alone (net.profile; a host step's own network not included). The counts of one call.

    python benchmarks/bench_counted.py                  # CUDA (writes results/counted-<gpu>.json)
    python benchmarks/bench_counted.py --cpu            # CPU backend, small sizes (results/counted-cpu.json)
    python benchmarks/bench_counted.py --flush 16       # the command list committed every 16 launches
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from bench_fvdb import record, start, write_record  # noqa: E402  (sys.path: the checkout, tests/fvdb)
from bench_mlp import percentiles, timed  # noqa: E402

def detector(quick: bool, build: dict, voxelize: str) -> list:
    """[(name, network, [feeds, feeds])] of the detector's backbone and head over frames 0 and 1."""
    import dataclasses

    import bench_detector as bd

    settings = dict(bd.SIZES["quick" if quick else "full"])
    path = HERE / "results" / f"detector-frames{'-quick' if quick else ''}.npz"
    if not path.exists():
        bd.write_frames(path, settings)
    data = bd.read_frames(path)
    ex = bd.example()
    cfg, backbone, head = bd.modules(ex, data)
    nets = ex.compile_networks(dataclasses.replace(cfg, voxelize=voxelize), backbone, head, data["points"][0],
                               **build)
    a = [nets.a_feeds(points) for points in data["points"][:2]]
    b = [nets.b_feeds(f, nets.a.run(f)["coarse_features"]) for f in a]
    return [("detector backbone", nets.a, a), ("detector head", nets.b, b)]


def grid_from_points(cuda: bool) -> list:
    from onnx import helper

    import luisaml
    from bench_grid_build import H, OUTS_AS, sphere_points
    from fvdb_reference import fvdb_model
    from luisaml.opsets import fvdb as schema
    from luisaml.opsets import fvdb_grids  # noqa: F401 (the grid ops' schemas, for inference)

    n = (1 << 20) if cuda else (1 << 14)
    rng = np.random.default_rng(0)
    clouds = [sphere_points(n, 200.0, 256.0, rng), sphere_points(n, 120.0, 200.0, rng)]
    feeds = {"points": clouds[0], "joffsets": np.array([0, n], np.int64), "jidx": np.zeros(0, np.int32),
             "jlidx": np.zeros((0, 1), np.int32), "voxel_sizes": np.full((1, 3), H), "origins": np.zeros((1, 3))}
    node = helper.make_node("GridBatchFromPoints", list(feeds), OUTS_AS, name="build", domain=schema.DOMAIN)
    net = luisaml.compile(fvdb_model([node], feeds, constants=["jidx", "jlidx", "voxel_sizes", "origins"]),
                          batch_axis=None)
    return [("GridBatchFromPoints", net, [{"points": c, "joffsets": feeds["joffsets"]} for c in clouds])]


def conv_grid(cuda: bool) -> list:
    import luisaml
    from bench_fvdb import CPU_RADIUS, GPU_RADIUS, shell_voxels
    from bench_topology import op_model
    from luisaml.fvdb import GridBatch
    from luisaml.opsets import fvdb as schema

    r = GPU_RADIUS if cuda else CPU_RADIUS
    shells = [GridBatch.from_ijk([shell_voxels(r)], 1.0 / 256, 0.0),
              GridBatch.from_ijk([shell_voxels(r - 3, 250)], 1.0 / 256, 0.0)]
    bundles = [list(g.bundle()) for g in shells]
    model = op_model("ConvGrid", {"kernel_size": [2, 2, 2], "stride": [2, 2, 2]}, bundles[0])
    net = luisaml.compile(model, batch_axis=None, grid_build="device")
    return [("ConvGrid (device build)", net, [dict(zip(schema.BUNDLE, b)) for b in bundles])]


def unet(cuda: bool, build: dict) -> list:
    import torch

    import luisaml
    import sparse_unet as ex

    cfg = ex.Settings(points=200_000 if cuda else 3000, voxel_size=0.01 if cuda else 0.1, channels=16 if cuda else 8)
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = ex.FineGridUNet(ex.sphere_points(8, rng), cfg.voxel_size, cfg.in_channels, cfg.channels,
                            cfg.out_channels).eval()
    clouds = [ex.sphere_points(int(cfg.points * (1.0 - 0.2 * k)), rng) for k in range(2)]
    grids = [ex.grid_pair(p, cfg.voxel_size)[0] for p in clouds]
    xs = [torch.from_numpy(rng.standard_normal((int(g[5][-1]), cfg.in_channels)).astype(np.float32)) for g in grids]
    net = luisaml.compile(ex.export_fine_grid_unet(model, xs[0], grids[0]), **build)
    return [("sparse U-Net", net, [ex.fine_feeds(x, g) for x, g in zip(xs, grids)])]


def measure(name: str, net, feeds: list, reps: int, cuda: bool) -> dict:
    """The counts of one call, P50 wall time, and the device span (CUDA) or the kernels alone (CPU)."""
    from luisaml import counts

    turn = iter(range(10**9))

    def call():
        return net.run(feeds[next(turn) % 2])

    for _ in range(4):  # (kernels built, capacities learned, both grids' steps warm)
        call()
    with counts.measure() as c:
        call()
    row = {"network": name, **c.as_dict(), "run_ms": percentiles(timed(call, reps, warmup=0))}
    if cuda:
        from bench_mlp import device_times

        spans, row["span_method"] = device_times(call, lambda: None, reps)
        row["span_ms"] = percentiles(spans)
        row["run_over_span"] = row["run_ms"]["p50"] / row["span_ms"]["p50"]
    else:
        prof = net.profile(feeds[0], repeat=3)
        row["kernels_ms"] = sum(ms for _, ms in prof)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU backend, small sizes")
    ap.add_argument("--only", help="run only the networks whose name contains this")
    ap.add_argument("--grid-build", choices=("device", "host"), help="where the detector's and the U-Net's "
                    "coarse grids are built (default: the backend's, device on CUDA, host on the CPU)")
    ap.add_argument("--voxelize", choices=("device", "host"), default="device", help="the detector's voxelization: "
                    "inside its backbone network (device, the default) or on the host before it")
    ap.add_argument("--flush", type=int, default=None, help="commit the command list every N launches without waiting "
                    "(luisaml/launch.py FLUSH_LAUNCHES; default: the backend's, BACKEND_FLUSH; 0: one commit a wait)")
    started = start(ap, argv, (30, 5), "timed calls per network")
    if started is None:
        return 2
    a, backend, device, tag, reps = started
    cuda = not a.cpu
    from luisaml import launch

    launch.FLUSH_LAUNCHES = a.flush
    rows = []
    build = {"grid_build": a.grid_build} if a.grid_build else {}
    for make in (lambda: detector(not cuda, build, a.voxelize), lambda: grid_from_points(cuda), lambda: conv_grid(cuda),
                 lambda: unet(cuda, build)):
        for name, net, feeds in make():
            if a.only and a.only not in name:
                continue
            t = time.perf_counter()
            rows.append(measure(name, net, feeds, reps, cuda))
            r = rows[-1]
            extra = (f"span {r['span_ms']['p50']:.3f} ms, run / span {r['run_over_span']:.2f}" if cuda
                     else f"its kernels alone {r['kernels_ms']:.3f} ms")
            print(f"{name}: {r['syncs']} host synchronisations, {r['launches']} launches, {r['uploads']} uploads, "
                  f"{r['downloads']} downloads a call; run {r['run_ms']['p50']:.3f} ms, {extra} "
                  f"({time.perf_counter() - t:.1f} s)", flush=True)
    rec = {**record(backend, device, "bench_counted.py", argv), "flush_launches": a.flush, "grid_build": a.grid_build or "the backend's", "voxelize": a.voxelize, "networks": rows}
    variant = (f"-{a.grid_build}-builds" if a.grid_build else "") + ("-host-voxels" if a.voxelize == "host" else "") + (f"-flush{a.flush}" if a.flush else "")
    path = write_record(rec, a.out_dir, f"counted-{tag}{variant}.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
