"""Issue 28's detector benchmark: examples/lidar_detector.py's CenterPoint-style detector from points to
boxes, luisaml against the same detector in torch (spconv's SubMConv3d / SparseConv3d where spconv is
importable), each side in its own process over the same saved frames.

Sides (`--side`):
- `frames`: write the frames file only (needs torch and luisaml's host code, no device): frames of
  different point counts drawn from one seed, the detector's weights (torch's initialisation, saved
  so a process with another torch reads the same numbers) and the torch reference's detections per
  frame (luisaml.fvdb.torch_ops on the host, float32). Every side writes it first when it is missing.
- `luisaml` (default): the detector compiled once (two networks split at the dense step, as the
  example says why) and run per frame: points in, net A, net B, the kept boxes. `--voxelize device`
  (default): the voxelization inside net A (fvdb GridBatchFromPoints, built where the backend builds
  grids, and SplatNearest's sums by voxel in kernels); `--voxelize host`: torch_ops on the host first.
- `torch-spconv`: the same weights on spconv's layers where `import spconv` works (voxelization,
  the BEV scatter and the 2-D head in torch on the device, CircleNMS on the host as CenterPoint's
  numba circle_nms); where it does not, says so and times the torch_ops reference on the host instead.
  spconv and luisa-python do not fit one device call's payload (bench_spconv.py): run it in its own
  call (`source .spconv/env.sh && python benchmarks/bench_detector.py --side torch-spconv --device cuda`).

Correctness first: every frame's boxes, scores and labels equal the torch reference's in count and
order (boxes within 1e-4 + 1e-4 |x|, scores within 1e-5), or the side writes its record with
"correct": false, no timings, and exits 1. Then each frame is run `--reps` times: frame time P50/P95/P99
(wall, points in to boxes out), the host's part of it (host_ms: the wall time less the host's waits for the
stream), and one frame's host synchronisations, kernel launches and device bytes
(luisaml/counts.py; torch: torch.cuda.max_memory_allocated). The luisaml side also profiles its two
networks on the middle frame: each kernel timed alone (their sum, the kernels' time) against a whole
net.run (issue 28 item 3's target: run ≤ 1.3x the device span). Results: benchmarks/results/
detector-<side>-<device>.json, the frames file's sha256 in each; with both sides' records present, the
end-to-end ratio is printed. `--results-md` appends the run's section to benchmarks/RESULTS.md.

    python benchmarks/bench_detector.py --device cuda                 # luisaml on the GPU (default sizes)
    python benchmarks/bench_detector.py --device cuda --voxelize host # the same, voxelized on the host
    python benchmarks/bench_detector.py --device cpu --quick          # tiny frames, CPU backend (the test)
    python benchmarks/bench_detector.py --device cpu --quick --grid-build device  # CUDA's grid path on the CPU
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCALES = (1.0, 0.6, 1.5, 0.8, 1.2, 0.9, 1.3, 0.7)  # each frame's points, times --points
SIZES = {  # the Settings fields a run sets; --quick is the example test's detector
    "full": {"points": 100_000, "frames": 6, "radius": 40.0, "voxel_size": 0.2, "channels": 32, "classes": 2,
             "candidates": 64, "min_radius": 1.2, "seed": 0},
    "quick": {"points": 700, "frames": 3, "radius": 5.0, "voxel_size": 0.4, "channels": 4, "classes": 2,
              "candidates": 10, "min_radius": 1.2, "seed": 0},
}
BOX_TOL, SCORE_TOL = 1e-4, 1e-5


def example():
    """examples/lidar_detector.py as a module."""
    if "lidar_detector" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lidar_detector", ROOT / "examples" / "lidar_detector.py")
        module = sys.modules["lidar_detector"] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
        spec.loader.exec_module(module)
    return sys.modules["lidar_detector"]


def percentiles(ms: list[float]) -> dict:
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "n": len(ms)}


# ---- the frames file ------------------------------------------------------------------------------


def write_frames(path: Path, settings: dict) -> None:
    """Draw the frames and weights from settings' seed; save them with the torch reference's detections."""
    import torch

    ex = example()
    cfg = ex.Settings(**settings)
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    backbone, head = ex.Backbone(cfg).eval(), ex.Head(cfg).eval()
    arrays = {"settings": np.frombuffer(json.dumps(settings).encode(), np.uint8)}
    for prefix, module in (("backbone", backbone), ("head", head)):
        for name, t in module.state_dict().items():
            arrays[f"w.{prefix}.{name}"] = t.numpy()
    for k, scale in enumerate(SCALES[:cfg.frames]):
        points = ex.lidar_frame(int(cfg.points * scale), rng, cfg.radius)
        fine, x = ex.voxelize(points, cfg.voxel_size)
        with torch.no_grad():
            out = [t.numpy() for t in head(backbone(x, *fine), *fine)]
        arrays[f"points.{k}"] = points
        for name, value in zip(("boxes", "scores", "labels"), ex.detections(*out)):
            arrays[f"ref.{k}.{name}"] = value
        arrays[f"ref.{k}.kept"] = out[3]
        arrays[f"ref.{k}.voxels"] = np.int64(fine[5][-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def read_frames(path: Path) -> dict:
    """The frames file as {settings, points: [..], weights: {backbone: {..}, head: {..}}, reference: [..], sha256}."""
    with np.load(path) as z:
        settings = json.loads(bytes(z["settings"]).decode())
        n = sum(1 for k in z.files if k.startswith("points."))
        weights = {"backbone": {}, "head": {}}
        for k in z.files:
            if k.startswith("w."):
                _, module, name = k.split(".", 2)
                weights[module][name] = z[k]
        reference = [{name: z[f"ref.{k}.{name}"] for name in ("boxes", "scores", "labels", "kept", "voxels")}
                     for k in range(n)]
        points = [z[f"points.{k}"] for k in range(n)]
    return {"settings": settings, "points": points, "weights": weights, "reference": reference,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def modules(ex, data: dict):
    """The example's Backbone and Head with the frames file's weights."""
    import torch

    cfg = ex.Settings(**data["settings"])
    backbone, head = ex.Backbone(cfg).eval(), ex.Head(cfg).eval()
    for module, name in ((backbone, "backbone"), (head, "head")):
        module.load_state_dict({k: torch.from_numpy(v) for k, v in data["weights"][name].items()})
    return cfg, backbone, head


def compare(got: tuple, want: dict) -> dict:
    """Whether detections (boxes, scores, labels) equal the reference's in count and order."""
    boxes, scores, labels = (np.asarray(a) for a in got)
    same_count = len(boxes) == len(want["boxes"])
    row = {"detections": int(len(want["boxes"])), "got": int(len(boxes)), "same_count": same_count}
    if not same_count:
        return {**row, "correct": False}
    box_err = np.abs(boxes - want["boxes"]) - BOX_TOL * np.abs(want["boxes"])
    row.update(same_labels=bool(np.array_equal(labels, want["labels"])),
               max_abs_diff_boxes=float(np.abs(boxes - want["boxes"]).max(initial=0)),
               max_abs_diff_scores=float(np.abs(scores - want["scores"]).max(initial=0)))
    row["correct"] = bool(row["same_labels"] and box_err.max(initial=0) <= BOX_TOL
                          and row["max_abs_diff_scores"] <= SCORE_TOL)
    return row


# ---- the luisaml side -----------------------------------------------------------------------------


@contextlib.contextmanager
def stream_waits(waited: list):
    """Add the seconds the host waits for the stream (LuisaCompute's synchronize: a run's end, a grid
    build's read-back) to waited[0] while inside; the counted stream's own synchronize again after."""
    from luisaml import counts

    sync = counts.CountingStream.synchronize

    def timed_sync(self):
        t = time.perf_counter()
        sync(self)
        waited[0] += time.perf_counter() - t

    counts.CountingStream.synchronize = timed_sync
    try:
        yield waited
    finally:
        counts.CountingStream.synchronize = sync


def run_luisaml(data: dict, a) -> dict:
    """Compile once, check every frame, then time frames points-to-boxes with counts and profiles."""
    import luisaml
    from luisaml import counts
    from luisaml.operators.fvdb.topology import DeviceGridBuild

    backend = luisaml.device.init(a.device)
    DeviceGridBuild.LAYOUT_ON_DEVICE = not getattr(a, "host_layout", False)  # (before any network is compiled)
    ex = example()
    cfg, backbone, head = modules(ex, data)
    cfg = dataclasses.replace(cfg, voxelize=a.voxelize)
    t0 = time.perf_counter()
    grid_build = {} if a.grid_build is None else {"grid_build": a.grid_build}
    nets = ex.compile_networks(cfg, backbone, head, data["points"][0], backend=backend, **grid_build)
    rec: dict = {"compile_s": None, "voxelize": a.voxelize, "grid_build": a.grid_build or "auto"}

    def frame(points):
        out, feats = nets.run(points)
        return ex.detections(*(out[n] for n in ex.OUTPUTS)), feats

    rec["checks"] = [compare(frame(p)[0], want) for p, want in zip(data["points"], data["reference"])]
    rec["compile_s"] = time.perf_counter() - t0  # (two compiles and the kernels' first builds)
    rec["correct"] = all(c["correct"] for c in rec["checks"])
    if not rec["correct"]:
        return rec
    # the frames in turn, never one twice in a row: a grid step given the bytes of its last run returns its
    # last result (luisaml/fvdb/host_steps.py), which a stream of new frames never hits
    per_frame = []
    for k, points in enumerate(data["points"]):
        with counts.measure() as c:
            frame(points)
        per_frame.append({"points": len(points), "voxels": int(data["reference"][k]["voxels"]), "ms": [],
                          **c.as_dict()})
    # the host's part of a frame: its wall time less the time the host waits for the stream (LuisaCompute's
    # synchronize: a run's end, a grid build's read-back); on the CPU backend the kernels run in that wait
    waited = [0.0]
    host = []
    with stream_waits(waited):
        for _ in range(a.reps):
            for f, points in zip(per_frame, data["points"]):
                waited[0] = 0.0
                t = time.perf_counter()
                frame(points)
                f["ms"].append((time.perf_counter() - t) * 1e3)
                host.append(f["ms"][-1] - waited[0] * 1e3)
    rec["frames"] = per_frame
    rec["frame_ms"] = percentiles([m for f in per_frame for m in f["ms"]])
    rec["host_ms"] = percentiles(host)  # (wall less the waits for the stream)
    for key in ("syncs", "launches", "uploads", "downloads"):
        rec[f"{key}_per_frame"] = max(f[key] for f in per_frame)
    rec["peak_bytes"] = max(f["peak_bytes"] for f in per_frame)
    # the two networks profiled on the middle frame: kernels each timed alone vs whole runs
    mid = int(np.argsort([len(p) for p in data["points"]])[len(data["points"]) // 2])
    feeds_a = nets.a_feeds(data["points"][mid])  # (host mode: this voxelizes, timed)
    t = time.perf_counter()
    feeds_a = nets.a_feeds(data["points"][mid])
    host_ms = (time.perf_counter() - t) * 1e3
    feats = nets.a.run(feeds_a)["coarse_features"]
    # host mode: voxelize_ms is the torch_ops voxelization; device mode: the feeds' split of the points
    rec["profile"] = {"frame": mid, "voxelize": a.voxelize, "voxelize_ms" if a.voxelize == "host" else "feeds_ms": host_ms}
    for name, net, feeds in (("backbone", nets.a, feeds_a), ("head", nets.b, nets.b_feeds(feeds_a, feats))):
        prof = net.profile(feeds, repeat=max(a.reps, 3))
        kernels = sum(ms for _, ms in prof)
        rec["profile"][name] = {"run_ms": prof.run_ms, "kernels_ms": kernels, "stages": len(prof),
                                "run_over_kernels": prof.run_ms / kernels if kernels else None,
                                **prof.counts.as_dict()}
    return rec


# ---- the torch side -------------------------------------------------------------------------------


class SpconvDetector:
    """The detector on spconv's layers with the frames file's weights: voxelization (round(p / h), the
    voxel's mean point), SubMConv3d, SparseConv3d stride 2 padding 1 (fVDB's conv_grid(3, 2): output c
    reads input 2c + t - 1), SubMConv3d, the BEV scatter [1, C*Z, Y, X], the example's 2-D head."""

    def __init__(self, data: dict, dev: str, taps: str):
        import spconv.pytorch as sp
        import torch

        s, w = data["settings"], data["weights"]
        self.sp, self.torch, self.dev, self.s = sp, torch, dev, s
        c = s["channels"]
        half = int(np.ceil(s["radius"] / (2 * s["voxel_size"]))) + 1
        z_lo = -int(np.ceil(2.0 / (2 * s["voxel_size"]))) - 1
        self.lo = (-half, -half, z_lo)  # the example's Settings.box()
        self.size = (2 * half + 1, 2 * half + 1, -2 * z_lo + 1)
        reach = max(s["radius"], 2.0) / s["voxel_size"] + 2
        self.shift = -2 * int(np.ceil(reach / 2))  # even: the coarse grid's coordinates stay whole
        self.shape = [-2 * self.shift + 4] * 3
        layers = {"conv_in": sp.SubMConv3d(4, c, 3, bias=True, indice_key="fine"),
                  "down": sp.SparseConv3d(c, c, 3, stride=2, padding=1, bias=True),
                  "conv_coarse": sp.SubMConv3d(c, c, 3, bias=True, indice_key="coarse")}
        with torch.no_grad():
            for name, layer in layers.items():
                wt = w["backbone"][f"{name}.weight"]
                wt = wt if taps == "same" else wt[:, :, ::-1, ::-1, ::-1]
                layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(wt.transpose(0, 2, 3, 4, 1))))
                layer.bias.copy_(torch.from_numpy(w["backbone"][f"{name}.bias"]))
        self.layers = {k: v.to(dev).eval() for k, v in layers.items()}
        self.head = {k: torch.from_numpy(v).to(dev) for k, v in w["head"].items()}

    def __call__(self, points: np.ndarray) -> tuple:
        torch, sp, s = self.torch, self.sp, self.s
        with torch.no_grad():
            p = torch.from_numpy(points).to(self.dev)
            ijk = torch.floor(p[:, :3] / s["voxel_size"] + 0.5).to(torch.int32)
            ijk, inverse = torch.unique(ijk, dim=0, return_inverse=True)
            total = torch.zeros((len(ijk), 4), device=self.dev).index_add_(0, inverse, p)
            count = torch.zeros(len(ijk), device=self.dev).index_add_(0, inverse, torch.ones(len(p), device=self.dev))
            idx = torch.cat([torch.zeros((len(ijk), 1), dtype=torch.int32, device=self.dev), ijk - self.shift], 1)
            h = sp.SparseConvTensor(total / count[:, None], idx.contiguous(), self.shape, 1)
            for name in ("conv_in", "down", "conv_coarse"):
                h = self.layers[name](h)
                h = h.replace_feature(torch.relu(h.features))
            xyz = h.indices[:, 1:].long() + self.shift // 2 - torch.tensor(self.lo, device=self.dev)
            X, Y, Z = self.size
            inside = ((xyz >= 0) & (xyz < torch.tensor([X, Y, Z], device=self.dev))).all(1)
            C = s["channels"]
            dense = torch.zeros((C, Z, Y, X), device=self.dev)
            q = xyz[inside]
            dense[:, q[:, 2], q[:, 1], q[:, 0]] = h.features[inside].T
            return self.from_bev(dense.reshape(1, C * Z, Y, X))

    def from_bev(self, bev) -> tuple:
        """examples/lidar_detector.py Head.from_bev's arithmetic, then the kept detections on the host."""
        torch, s, w = self.torch, self.s, self.head
        F = torch.nn.functional
        X, Y, _ = self.size
        maps = F.conv2d(torch.relu(F.conv2d(bev, w["conv.weight"], w["conv.bias"], padding=1)),
                        w["out.weight"], w["out.bias"])[0]
        k = s["classes"]
        scores, index = torch.topk(torch.sigmoid(maps[:k]).reshape(-1), s["candidates"])
        labels = torch.div(index, Y * X, rounding_mode="floor")
        cell = index - labels * (Y * X)
        reg = maps[k:].reshape(-1, Y * X)[:, cell]
        cy = torch.div(cell, X, rounding_mode="floor")
        cx = cell - cy * X
        h = 2 * s["voxel_size"]
        x = (cx.to(torch.float32) + self.lo[0] + reg[0]) * h
        y = (cy.to(torch.float32) + self.lo[1] + reg[1]) * h
        size = torch.exp(reg[3:6])
        boxes = torch.stack([x, y, reg[2], size[0], size[1], size[2], torch.atan2(reg[6], reg[7])], 1).cpu().numpy()
        scores, labels = scores.cpu().numpy(), labels.cpu().numpy()
        keep = circle_nms(boxes[:, :2], scores, s["min_radius"])
        return boxes[keep], scores[keep], labels[keep]


def circle_nms(centers: np.ndarray, scores: np.ndarray, min_radius: float) -> np.ndarray:
    """CenterPoint's circle_nms (the example's): greedy by descending score, float32 squared distances."""
    c, thresh = centers.astype(np.float32), np.float32(min_radius ** 2)
    keep: list[int] = []
    for i in np.argsort(-scores.astype(np.float64), kind="stable"):
        if not (((c[keep, 0] - c[i, 0]) ** 2 + (c[keep, 1] - c[i, 1]) ** 2) <= thresh).any():
            keep.append(int(i))
    return np.asarray(keep, np.int64)


def run_torch(data: dict, a) -> dict:
    """spconv's pipeline where spconv imports, else the torch_ops reference on the host; checked, then timed."""
    import torch

    dev = "cuda" if a.device == "cuda" else "cpu"
    # float32 as the reference and luisaml's kernels compute it: torch's convolutions take TF32 tensor
    # cores by default on the GPU, which moves the heatmap's scores by ~5e-3 and so the boxes kept
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        import spconv
    except ImportError as e:
        spconv, missing = None, e
    if spconv is not None:
        rec: dict = {"pipeline": f"torch {torch.__version__} + spconv {spconv.__version__}", "device": dev, "tf32": False}
        run = None
        for taps in ("same", "mirrored"):  # fVDB's tap order or its mirror in spconv's weight layout
            det = SpconvDetector(data, dev, taps)
            rec["checks"] = [compare(det(p), want) for p, want in zip(data["points"], data["reference"])]
            if all(c["correct"] for c in rec["checks"]):
                run, rec["weight_taps"] = det, taps
                break
    else:
        print(f"spconv is not importable here ({missing}): the torch+spconv pipeline is skipped; timing the "
              "luisaml.fvdb.torch_ops reference on the host instead (not the comparison issue 28 asks for)",
              flush=True)
        ex = example()
        cfg, backbone, head = modules(ex, data)
        dev = "cpu"
        rec = {"pipeline": f"torch {torch.__version__}, luisaml.fvdb.torch_ops reference (host)", "device": dev,
               "spconv": f"not importable: {missing}"}

        def run(points):
            fine, x = ex.voxelize(points, cfg.voxel_size)
            with torch.no_grad():
                return ex.detections(*head(backbone(x, *fine), *fine))

        rec["checks"] = [compare(run(p), want) for p, want in zip(data["points"], data["reference"])]
    rec["correct"] = run is not None and all(c["correct"] for c in rec["checks"])
    if not rec["correct"]:
        return rec
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    frames = []
    for points in data["points"]:
        ms = []
        for _ in range(a.reps):
            t = time.perf_counter()
            run(points)
            sync()
            ms.append((time.perf_counter() - t) * 1e3)
        frames.append({"points": len(points), "ms": ms})
    rec["frames"] = frames
    rec["frame_ms"] = percentiles([m for f in frames for m in f["ms"]])
    rec["peak_bytes"] = int(torch.cuda.max_memory_allocated()) if dev == "cuda" else None
    return rec


# ---- the record ---------------------------------------------------------------------------------


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda (no torch device)"
    return f"cpu ({platform.processor() or platform.machine()})"


def tag_of(name: str) -> str:
    if "H200" in name:
        return "h200"
    return "cpu" if name.startswith("cpu") else "".join(c for c in name.lower() if c.isalnum())


def summary(rec: dict) -> list[str]:
    """Markdown lines of one side's record."""
    lines = [f"- **{rec['side']}** ({rec.get('pipeline', 'luisaml ' + rec.get('backend', ''))}), "
             f"{rec['device_name']}: correct over {len(rec['checks'])} frames: {rec['correct']}"]
    if rec.get("frame_ms"):
        f = rec["frame_ms"]
        lines.append(f"  frame ms P50/P95/P99 {f['p50']:.2f} / {f['p95']:.2f} / {f['p99']:.2f} ({f['n']} frames)"
                     + (f"; peak {rec['peak_bytes'] / 2**20:.1f} MiB" if rec.get("peak_bytes") else ""))
    if rec.get("host_ms"):
        h = rec["host_ms"]
        lines.append(f"  host ms a frame (wall less the waits for the stream) P50/P95 {h['p50']:.2f} / {h['p95']:.2f}"
                     f"; grids built {rec.get('grid_build', 'auto')}")
    if "syncs_per_frame" in rec:
        lines.append(f"  per frame: {rec['syncs_per_frame']} host synchronisations, {rec['launches_per_frame']} "
                     f"launches, {rec['uploads_per_frame']} uploads, {rec['downloads_per_frame']} downloads")
        p = rec["profile"]
        for name in ("backbone", "head"):
            q = p[name]
            lines.append(f"  {name}: net.run {q['run_ms']:.2f} ms, its kernels each alone {q['kernels_ms']:.2f} ms "
                         f"({q['stages']} stages): run / kernels {q['run_over_kernels']:.2f}x (target <= 1.3x)")
        if "voxelize_ms" in p:
            lines.append(f"  host voxelization (torch_ops) {p['voxelize_ms']:.2f} ms of the frame")
        else:
            lines.append(f"  voxelization in the backbone network (fvdb GridBatchFromPoints, SplatNearest); the "
                         f"points' split into its feeds {p['feeds_ms']:.2f} ms")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=("luisaml", "torch-spconv", "frames"), default="luisaml")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--frames", help="the frames file (default benchmarks/results/detector-frames[-quick].npz); "
                    "written first when missing")
    ap.add_argument("--quick", action="store_true", help="the example test's tiny detector and frames")
    ap.add_argument("--points", type=int, help="points of the first frame (default 100000; quick 700)")
    ap.add_argument("--voxelize", choices=("device", "host"), default="device",
                    help="luisaml side: voxelize inside network A (device, default) or with torch_ops on the host")
    ap.add_argument("--grid-build", choices=("device", "host"),
                    help="luisaml side: where the grid steps build (default: the backend's, device on CUDA, host on "
                         "the CPU; device on the CPU backend runs CUDA's path: device builds and their read-backs)")
    ap.add_argument("--host-layout", action="store_true", help="luisaml side: device builds laid out by the host "
                    "mid-run (two waits a build: DeviceGridBuild.LAYOUT_ON_DEVICE = False, operators/fvdb/build_layout.py)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out-dir", help="where the JSON goes (default benchmarks/results)")
    ap.add_argument("--results-md", action="store_true", help="append the run's section to benchmarks/RESULTS.md")
    a = ap.parse_args(argv)
    settings = dict(SIZES["quick" if a.quick else "full"])
    if a.points:
        settings["points"] = a.points
    out_dir = Path(a.out_dir) if a.out_dir else HERE / "results"
    path = Path(a.frames) if a.frames else out_dir / f"detector-frames{'-quick' if a.quick else ''}.npz"
    if not path.exists():
        t = time.perf_counter()
        write_frames(path, settings)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t:.1f} s", flush=True)
    if a.side == "frames":
        return 0
    data = read_frames(path)
    if (a.quick or a.points) and data["settings"] != settings:
        print(f"{path} holds frames of other settings ({data['settings']}); give another --frames", file=sys.stderr)
        return 2
    rec = {"side": a.side, "date": datetime.date.today().isoformat(), "device_name": device_name(a.device),
           "command": "python benchmarks/bench_detector.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "frames_file": path.name, "frames_sha256": data["sha256"], "settings": data["settings"],
           "points": [len(p) for p in data["points"]], "reps": a.reps}
    rec.update(run_luisaml(data, a) if a.side == "luisaml" else run_torch(data, a))
    if a.side == "luisaml":
        rec["layout"] = "host" if a.host_layout else "device"  # (the device builds' layout: --host-layout)
        import luisaml

        rec["backend"] = luisaml.device.current()
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = tag_of(rec["device_name"])
    host = "-host-voxels" if a.side == "luisaml" and a.voxelize == "host" else ""  # (beside the default's record)
    host += f"-grids-{a.grid_build}" if a.side == "luisaml" and a.grid_build else ""
    out = out_dir / f"detector-{a.side}{host}-{tag}{'-quick' if a.quick else ''}.json"
    out.write_text(json.dumps(rec, indent=1) + "\n")
    lines = [f"## Detector, points to boxes (bench_detector.py), {rec['device_name']}, {rec['date']}", "",
             f"Command `{rec['command']}`; frames {rec['points']} points (sha256 {data['sha256'][:12]}), "
             f"{a.reps} runs a frame.", ""] + summary(rec)
    quick = "-quick" if a.quick else ""
    name = f"detector-{'torch-spconv' if a.side == 'luisaml' else 'luisaml'}-{tag}{quick}.json"
    other = next((d / name for d in (out_dir, HERE / "results") if (d / name).exists()), out_dir / name)
    if other.exists():  # (in the output folder, or committed under benchmarks/results by an earlier call)
        o = json.loads(other.read_text())
        mine, theirs = (rec, o) if a.side == "luisaml" else (o, rec)
        if o.get("frames_sha256") == data["sha256"] and mine.get("frame_ms") and theirs.get("frame_ms"):
            ratio = theirs["frame_ms"]["p50"] / mine["frame_ms"]["p50"]
            target = ("issue 28's target: >= 1.5x" if "spconv" in theirs.get("pipeline", "")
                      else "not spconv: issue 28's comparison needs the spconv side")
            lines += summary(o) + [f"- end to end, P50: luisaml {ratio:.2f}x {theirs.get('pipeline')} ({target})"]
    text = "\n".join(lines) + "\n"
    print(text)
    print(f"wrote {out}")
    if a.results_md:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write("\n" + text)
    return 0 if rec["correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
