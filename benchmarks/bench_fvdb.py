"""Sparse convolution 3x3x3, 64 -> 64 channels over a surface-like grid (a sphere shell), luisaml's
fvdb.SparseConv3d against a torch gather-matmul-scatter reference on the same inputs, same process.

CUDA, the issue's size (~200k voxels of a shell in a 512^3 extent; writes
benchmarks/results/fvdb-<gpu>.json, e.g. fvdb-h200.json):
    python benchmarks/bench_fvdb.py
CPU backend, a smaller shell (writes benchmarks/results/fvdb-cpu.json):
    python benchmarks/bench_fvdb.py --cpu [--radius 24]

Measured, correctness first (the command fails when luisaml's output differs from the reference by
more than 1e-5 relative, max|y - y_ref| / max|y_ref|, or the device-built kernel map differs from the
host's by one entry):
- `layer`: one SparseConv3d. luisaml compiles KernelMap -> SparseConv3d over constant grids (the map
  folds on the host at compile time, so a run is the convolution stage alone); the reference runs,
  per tap, index_select of the input rows, a [n_t, 64] x [64, 64] matmul and index_add_ into the
  output, its per-tap (output, input) index pairs built once from the same kernel map, untimed.
  On CUDA the reference is true float32 (TF32 off, as fVDB's and spconv's fp32 paths).
- `layer_bn_relu`: the same with BatchNorm (inference) and ReLU after it: luisaml fuses both into the
  convolution's stores; the reference adds torch's batch_norm and relu.
- `kernel_map`: the map built on the device (grids bound at run time): luisaml's KernelMap stage alone.
- `map_and_layer`: both on the device (grids fed at run time, as a network over grids it builds
  runs): the map's stage, then the layer over it in index order (no tap-grouped order: that is
  derived on the host from a folded map only).
- `any_grid`: the same network compiled for grids of any size (the grid's growing inputs and the
  features' rows dynamic: the voxels are the batch, a map row and a layer item a voxel; README,
  "Grids of any size"), run on this grid.
- `any_grid_same_grid_wall`, `any_grid_new_grid_wall`: that network as a pipeline runs it, host wall
  time of `net.run` to its outputs (the bundle's check, hashing, metadata, uploads and the kernels;
  torch tensors on the device on CUDA): the same grid bound every run, and two grids (this shell
  and one half a voxel larger) bound in turn, each checked against the reference first.
- `--tensor-cores` (CUDA): the device starts in the tensor-core front's directory, and `layer` and
  `any_grid` are compiled a second time with tensor_cores="auto" (the gather-GEMM on TF32 mma tiles,
  operators/tiled_mma.py) and timed beside the FP32 tiles on the same voxels (`layer_mma`,
  `any_grid_mma`; each checked at TF32's 1e-2, and failed when the route is not live, the plan has no
  mma tile or its error is FP32's: the FP32 body ran); `--mma-tiles` times the layer on other mma
  tilings. `--only-layers` skips the map, map-and-layer and wall rows (a shorter device call).
Times: P50/P95/P99 in ms; on CUDA device spans from CUPTI (a forward: its first kernel's start to its
last kernel's end), on the CPU wall time of net.run (host copies included) interleaved with the
reference."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if importlib.util.find_spec("luisaml") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "fvdb"))  # fvdb_reference (bench_rays, bench_topology, ... import it)

from bench_mlp import kernel_ms, percentiles, start_device  # noqa: E402

REL_TOL = 1e-5
TF32_TOL = 1e-2  # (tests/gpu/test_tensor_cores_cuda.py's, torch's: TF32 rounds A and B to 10 bits)
CHANNELS = 64
KERNEL = 3
GPU_RADIUS = 126.0  # a one-voxel shell of radius 126: ~200k voxels
CPU_RADIUS = 24.0
TARGET = 3.0  # the target against a torch gather-matmul-scatter reference on the H200


# ---- what the fVDB benchmarks share (bench_rays, bench_topology, bench_grid_build, bench_counted import
# this module first: it puts the checkout, when luisaml is not installed, and tests/fvdb on sys.path) ----


def start(ap, argv, reps: tuple[int, int], what: str = "timed runs"):
    """Add --reps (default `reps`: on CUDA, on the CPU) and --out-dir to ap (a benchmark's parser, --cpu
    among its options), parse argv and start luisaml's backend (on CUDA in the tensor-core front's
    directory where the parser has a --tensor-cores and it is given). Return (the arguments, the
    backend, the device's name, the results file's tag, reps), or None (said) when CUDA is asked for and
    torch sees none."""
    ap.add_argument("--reps", type=int, help=f"{what} (default {reps[0]} on CUDA, {reps[1]} on the CPU)")
    ap.add_argument("--out-dir", help="where the JSON goes (default benchmarks/results)")
    a = ap.parse_args(argv)
    if getattr(a, "tensor_cores", False) and not a.cpu:
        import torch

        import luisaml

        if torch.cuda.is_available():  # (else start_device says so)
            luisaml.device.init("cuda", tensor_cores=True)
    started = start_device(a.cpu)
    if started is None:
        return None
    return (a, *started, a.reps or (reps[1] if a.cpu else reps[0]))


def record(backend: str, device: str, script: str, argv=None) -> dict:
    """Return a results record's head: today's date, the device, the backend and the command that made it
    (`python benchmarks/<script>` and argv, default the process's arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {"date": datetime.date.today().isoformat(), "device": device, "backend": backend,
            "command": " ".join([f"python benchmarks/{script}", *args])}


def write_record(rec: dict, out_dir: str | None, name: str) -> Path:
    """Write rec as JSON to out_dir (default benchmarks/results)/name; return the file's path."""
    folder = Path(out_dir) if out_dir else HERE / "results"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(rec, indent=1) + "\n")
    return path


def device_rows(run, reps: int) -> dict:
    """CUDA: {device_ms, span_ms, span_method} of run over reps calls each: the sum of its kernels'
    durations (CUPTI), and its first kernel's start to its last kernel's end (bench_mlp.device_times)."""
    import torch

    from bench_mlp import device_times

    rows = {"device_ms": percentiles(kernel_ms(run, reps))}
    spans, rows["span_method"] = device_times(run, torch.cuda.synchronize, reps)
    rows["span_ms"] = percentiles(spans)
    return rows


def fmt_ms(row: dict, key: str, digits: int = 3) -> str:
    """Return "P50 / P95 / P99" of the percentiles row[key] (milliseconds), "-" when row has none."""
    return " / ".join(f"{row[key][p]:.{digits}f}" for p in ("p50", "p95", "p99")) if row.get(key) else "-"


def onnx_model(nodes: list, inputs: list, outputs: list, initializers: list = ()):
    """Return the ONNX model of nodes over the opsets the fVDB benchmarks use (ONNX 17, fvdb 1)."""
    from onnx import helper

    from luisaml.opsets import fvdb as schema

    g = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


def bundle_inputs(bundle: list) -> list:
    """Return the graph inputs of a GridBatch bundle (its arrays, under schema.BUNDLE's names), the parts
    that grow with the grid (grid_blob, leaf_batch_indices, list_indices) of any number of rows."""
    from onnx import helper

    from fvdb_reference import ELEM
    from luisaml.opsets import fvdb as schema

    growing = ("grid_blob", "leaf_batch_indices", "list_indices")
    return [helper.make_tensor_value_info(n, ELEM[a.dtype], [f"{n} rows"] + list(a.shape[1:]) if n in growing
                                          else list(a.shape)) for n, a in zip(schema.BUNDLE, bundle)]


def shell_voxels(radius: float, center: int = 256) -> np.ndarray:
    """Return the voxels (int32 [N, 3]) within half a voxel of a sphere of `radius` around
    (center, center, center): a closed one-voxel surface inside a 512^3 extent."""
    r = int(np.ceil(radius)) + 1
    jk = np.stack(np.meshgrid(np.arange(-r, r + 1), np.arange(-r, r + 1), indexing="ij"), -1).reshape(-1, 2)
    parts = []
    for i in range(-r, r + 1):  # one slice at a time: the box is (2r)^3
        d = np.sqrt(i * i + (jk ** 2).sum(1))
        on = jk[np.abs(d - radius) < 0.5]
        parts.append(np.concatenate([np.full((len(on), 1), i), on], 1))
    return (np.concatenate(parts) + center).astype(np.int32)


def rel_err(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(y - ref), initial=0.0) / max(np.max(np.abs(ref), initial=0.0), 1e-30))


class TorchReference:
    """Gather-matmul-scatter over a kernel map: per tap, index_select, mm, index_add_ (the pairs of
    each tap built once here, as a rulebook)."""

    def __init__(self, kmap, w, b, device):
        import torch

        k = torch.as_tensor(kmap, dtype=torch.int64, device=device)
        self.pairs = []
        for t in range(k.shape[1]):
            rows = torch.nonzero(k[:, t] >= 0).reshape(-1)
            self.pairs.append((rows, k[rows, t]))
        self.w = torch.as_tensor(w, device=device).reshape(w.shape[0], w.shape[1], -1)
        self.wt = [self.w[:, :, t].T.contiguous() for t in range(self.w.shape[2])]
        self.b = torch.as_tensor(b, device=device)
        self.n_out = k.shape[0]

    def __call__(self, x, bn=None):
        import torch

        out = self.b.expand(self.n_out, -1).clone()
        for (rows, src), wt in zip(self.pairs, self.wt):
            out.index_add_(0, rows, torch.index_select(x, 0, src) @ wt)
        if bn is not None:
            scale, shift, mean, var = bn
            out = torch.relu(torch.nn.functional.batch_norm(out, mean, var, scale, shift, False, 0.0, 1e-5))
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU backend and a smaller shell")
    ap.add_argument("--radius", type=float, help=f"shell radius in voxels (default {GPU_RADIUS:g} on CUDA, "
                    f"{CPU_RADIUS:g} on the CPU)")
    ap.add_argument("--tile", help="R,O: the voxels x channels of a convolution thread instead of the operator's "
                    "choice (for measuring tile shapes)")
    ap.add_argument("--tilings", nargs="*", metavar="BM,BN,BK[,TM,TN]", help="CUDA: also time the layer with "
                    "these double-buffered block tilings (e.g. 64,64,16 128,64,8 64,64,8,4,8), each checked first "
                    "(for measuring; TM x TN a thread's tile, default 8 x 8, 4 where a side is 32)")
    ap.add_argument("--tensor-cores", action="store_true", help="CUDA: also the layers on TF32 mma tiles "
                    "(tensor_cores='auto'), timed beside the FP32 tiles on the same voxels")
    ap.add_argument("--mma-tiles", nargs="*", metavar="BM,BN[,V]", help="with --tensor-cores: also time the layer "
                    "on mma tiles of these sides (64,64 128,64 128,128; whole warps of 64 x 32) and V K variants a "
                    "tile (SparseConv3d.mma_buckets, default 1), each checked first")
    ap.add_argument("--fp32-forms", nargs="*", metavar="FORM", help="CUDA: also time the layer on the FP32 tile "
                    "in each SparseConv3d.fp32_form (early rows ahead uniform: the A/B of benchmarks/NOTES.md, \"The "
                    "FP32 tile's next step in flight\" and \"addresses a tap, not a step\"), each checked and compared "
                    "bit for bit with the first", choices=("early", "rows", "ahead", "uniform"))
    ap.add_argument("--only-layers", action="store_true", help="only the layer rows (and their mma twins): no "
                    "kernel_map, map_and_layer or wall rows")
    started = start(ap, argv, (50, 10), "timed runs per measurement")
    if started is None:
        return 2
    a, backend, name, tag, reps = started
    import torch

    import luisaml
    from luisaml.fvdb import GridBatch
    from luisaml.fvdb import torch_ops as F

    cuda = not a.cpu
    if a.tile:  # a measurement of another tile shape: replace the operator's choice for this process
        from luisaml.operators.fvdb import conv as conv_op

        tile = tuple(int(v) for v in a.tile.split(","))
        conv_op.conv_tile = lambda n_out, c_out: tile
    radius = a.radius or (GPU_RADIUS if cuda else CPU_RADIUS)
    dev = "cuda" if cuda else "cpu"

    t0 = time.perf_counter()
    gb = GridBatch.from_ijk([shell_voxels(radius)])
    rng = np.random.default_rng(0)
    n = gb.total_voxels
    w = (rng.standard_normal((CHANNELS, CHANNELS, KERNEL, KERNEL, KERNEL)) / np.sqrt(CHANNELS * 27)).astype(np.float32)
    b = rng.standard_normal(CHANNELS).astype(np.float32)
    bn = [rng.standard_normal(CHANNELS).astype(np.float32), rng.standard_normal(CHANNELS).astype(np.float32),
          rng.standard_normal(CHANNELS).astype(np.float32), rng.uniform(0.5, 2, CHANNELS).astype(np.float32)]
    x_np = rng.standard_normal((n, CHANNELS)).astype(np.float32)
    bundle = F.bundle_tensors(gb)
    kmap = F.sparse_conv_kernel_map(bundle, bundle, KERNEL).numpy()  # the host's map (numpy)
    pairs = int((kmap >= 0).sum())
    print(f"shell radius {radius:g}: {n} voxels, {gb.total_leaves} leaves, {pairs} (input, output) pairs "
          f"({pairs / n:.1f} of 27 taps a voxel); set-up {time.perf_counter() - t0:.1f} s", flush=True)

    layer_m, fused_m, map_m, map_feeds, both_m, any_m = _models(gb, w, b, bn)
    t0 = time.perf_counter()
    layer = luisaml.compile(layer_m, backend=backend, batch_axis=None)
    fused = luisaml.compile(fused_m, backend=backend, batch_axis=None)
    whole = not a.only_layers
    mapper = luisaml.compile(map_m, backend=backend, batch_axis=None) if whole else None
    both = luisaml.compile(both_m, backend=backend, batch_axis=None) if whole else None
    any_grid = luisaml.compile(any_m, backend=backend)  # (batch_axis 'auto': the features' rows)
    x = torch.from_numpy(x_np).to(dev)
    both_feeds = {**map_feeds, "x": x}
    layer.run({"x": x}), fused.run({"x": x}), any_grid.run(both_feeds)  # (builds the kernels)
    if whole:
        mapper.run(map_feeds), both.run(both_feeds)
    mma = {}
    if cuda and a.tensor_cores:  # the same three networks on TF32 mma tiles
        # (not layer_bn_relu: its epilogue is the store's, and each network over the folded map folds it
        # again on the host, seconds a network; tests/gpu/test_sparse_conv_mma_cuda.py checks it); the
        # SparseConv3d mma form is opt-in (luisaml/rewrites/tensor_cores.py: it measured slower)
        from luisaml.rewrites import tensor_cores as tc_rewrite

        os.environ[tc_rewrite.SPARSE_MMA_ENV] = "on"
        mma = {"layer_mma": luisaml.compile(layer_m, backend=backend, batch_axis=None, tensor_cores="auto"),
               "any_grid_mma": luisaml.compile(any_m, backend=backend, tensor_cores="auto")}
        for k, net in mma.items():
            net.run(both_feeds if k.startswith("any") else {"x": x})
    compile_s = time.perf_counter() - t0
    print(f"compiled in {compile_s:.1f} s:\n  " + layer.plan.schedule.describe().replace("\n", "\n  ")
          + "\n  " + fused.plan.schedule.describe().replace("\n", "\n  "), flush=True)

    ref = TorchReference(kmap, w, b, dev)
    bn_t = [torch.from_numpy(v).to(dev) for v in bn]
    failed = []
    if cuda:  # the reference in true float32
        torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        want, want_bn = ref(x), ref(x, bn_t)
        got, got_bn = layer.run({"x": x})["y"], fused.run({"x": x})["y"]
        got_map = mapper.run(map_feeds)["kmap"] if whole else kmap
        got_any = any_grid.run(both_feeds)["y"]
        errs = {"layer": rel_err(_np(got), _np(want)), "layer_bn_relu": rel_err(_np(got_bn), _np(want_bn)),
                "any_grid": rel_err(_np(got_any), _np(want))}
        if whole:
            errs["map_and_layer"] = rel_err(_np(both.run(both_feeds)["y"]), _np(want))
        mma_errs = {k: rel_err(_np(net.run(both_feeds if k.startswith("any") else {"x": x})["y"]),
                               _np(want_bn if "bn" in k else want)) for k, net in mma.items()}
    # the reference against section 5's relation written out: every pair of a few output voxels
    check = rng.choice(n, min(n, 64), replace=False)
    direct = np.stack([b + sum(w.reshape(CHANNELS, CHANNELS, -1)[:, :, t] @ x_np[kmap[o, t]]
                               for t in range(27) if kmap[o, t] >= 0) for o in check])
    errs["reference"] = rel_err(_np(want)[check], direct)
    map_mismatch = int((_np(got_map) != kmap).sum())
    for k, e in errs.items():
        if not np.isfinite(e) or e > REL_TOL:
            failed.append(f"{k}: relative error {e:.2e} > {REL_TOL}")
    if map_mismatch:
        failed.append(f"kernel_map: {map_mismatch} entries differ from the host's")
    for k, net in mma.items():
        fp32 = errs[k[:-len("_mma")]]
        if "mma_tf32_m16n8k8" not in net.plan.source:
            failed.append(f"{k}: no mma tile in the plan (tensor cores not live here: luisaml.tensor_cores.status)")
        elif not np.isfinite(mma_errs[k]) or mma_errs[k] > TF32_TOL:
            failed.append(f"{k}: relative error {mma_errs[k]:.2e} > {TF32_TOL}")
        elif mma_errs[k] <= 10 * fp32:  # TF32 rounds: an answer as close as FP32's came from the FP32 body
            failed.append(f"{k}: relative error {mma_errs[k]:.2e}, FP32's {fp32:.2e}: the mma tile ran its FP32 body")
    print(f"correctness: {json.dumps(errs)}; device kernel map differs in {map_mismatch} entries"
          + (f"; TF32 mma: {json.dumps(mma_errs)}" if mma else ""), flush=True)
    if failed:
        for f in failed:
            print("FAILED correctness: " + f)
        return 1

    with torch.no_grad():
        runs = {"layer": (lambda: layer.run({"x": x}), lambda: ref(x)),
                "layer_bn_relu": (lambda: fused.run({"x": x}), lambda: ref(x, bn_t))}
        if whole:
            runs.update({"kernel_map": (lambda: mapper.run(map_feeds), None),
                         "map_and_layer": (lambda: both.run(both_feeds), None)})
        runs["any_grid"] = (lambda: any_grid.run(both_feeds), None)
        for k, net in mma.items():  # (the FP32 rows' twins, timed right after them in one process)
            runs[k] = ((lambda net=net: net.run(both_feeds)) if k.startswith("any") else
                       (lambda net=net: net.run({"x": x})), None)
        times = _time(runs, reps, cuda)
    if whole:
        walls = _new_grid_walls(any_grid, gb, radius, w, b, x, dev, reps)
        if walls is None:
            print("FAILED correctness: any_grid over the second grid")
            return 1
        times.update(walls)
    if cuda and a.tilings:
        times["tilings"] = _other_tilings(a.tilings, layer_m, backend, x, want, reps)
    if cuda and a.fp32_forms:
        times["fp32_forms"] = _fp32_forms(a.fp32_forms, layer_m, backend, x, want, reps)
    if mma and a.mma_tiles:
        times["mma_tiles"] = _other_mma_tiles(a.mma_tiles, layer_m, backend, x, want, reps)
    rec = {**record(backend, name, "bench_fvdb.py", argv), "torch": torch.__version__,
           "grid": {"shape": f"sphere shell, radius {radius:g}, in a 512^3 extent", "voxels": n,
                    "leaves": int(gb.total_leaves), "pairs": pairs},
           "conv": {"kernel": KERNEL, "stride": 1, "in_channels": CHANNELS, "out_channels": CHANNELS},
           "baseline": "torch gather-matmul-scatter (per tap: index_select, mm, index_add_), fp32"
           + (", TF32 off" if cuda else ""),
           "timing": times.pop("timing"), "rel_err": errs, "compile_and_first_runs_s": compile_s,
           "plan": {"layer": layer.plan.schedule.describe(), "layer_bn_relu": fused.plan.schedule.describe(),
                    **{k: net.plan.schedule.describe() for k, net in mma.items()}},
           **({"rel_err_tf32": mma_errs} if mma else {}),
           "target_speedup": TARGET if cuda else None, **times}
    for k in ("layer", "layer_bn_relu"):
        rec[k]["speedup"] = rec[k]["torch_ms"]["p50"] / rec[k]["luisaml_ms"]["p50"]
        if k + "_mma" in rec:
            rec[k + "_mma"]["speedup"] = rec[k]["torch_ms"]["p50"] / rec[k + "_mma"]["luisaml_ms"]["p50"]
    for k in mma:  # the mma row against its FP32 twin
        rec[k]["vs_fp32_tile"] = rec[k[:-len("_mma")]]["luisaml_ms"]["p50"] / rec[k]["luisaml_ms"]["p50"]
    path = write_record(rec, a.out_dir, f"fvdb-{tag}{'-mma' if mma else ''}{'-layers' if not whole else ''}.json")
    print(f"\n{name}  {rec['date']}  torch {torch.__version__}  timing: {rec['timing']}")
    print("| measurement | luisaml ms P50 / P95 / P99 | torch ms P50 / P95 / P99 | speedup |")
    print("|---|---|---|---|")
    for k in ("layer", "layer_bn_relu", "kernel_map", "map_and_layer", "any_grid", "any_grid_same_grid_wall",
              "any_grid_new_grid_wall", *mma):
        if k not in rec:
            continue
        r = rec[k]
        print(f"| {k} | {fmt_ms(r, 'luisaml_ms')} | {fmt_ms(r, 'torch_ms')} | {r.get('speedup', float('nan')):.2f}x |"
              + (f" {r['vs_fp32_tile']:.2f}x the FP32 tile" if "vs_fp32_tile" in r else ""))
    if mma:
        spconv = HERE / "results" / "spconv-h200.json"  # (spconv runs in a call of its own: bench_spconv.py)
        if spconv.is_file():
            ref_ms = json.loads(spconv.read_text())["layer"]["spconv_ms"]["p50"]
            print(f"against spconv 2.3.8 SubMConv3d fp32 (H200, {spconv.name}): {ref_ms:.3f} ms; layer "
                  f"{ref_ms / rec['layer']['luisaml_ms']['p50']:.2f}x, layer_mma "
                  f"{ref_ms / rec['layer_mma']['luisaml_ms']['p50']:.2f}x")
    print(f"wrote {path}")
    for k, r in rec.get("mma_tiles", {}).items():
        if r["luisaml_ms"] is not None:
            print(f"| layer_mma on {k} (BM,BN[,K variants]) | {fmt_ms(r, 'luisaml_ms')} | - | "
                  f"{rec['layer_mma']['luisaml_ms']['p50'] / r['luisaml_ms']['p50']:.2f}x layer_mma |")
    bad = [k for k, r in rec.get("mma_tiles", {}).items() if r["luisaml_ms"] is None]
    if bad:
        print(f"FAILED correctness: mma tiles {bad}")
        return 1
    return 0


def _other_tilings(tilings: list[str], layer_m, backend: str, x, want, reps: int) -> dict:
    """Return {tiling: luisaml_ms} of the layer compiled with each BM,BN,BK[,TM,TN] (double-buffered
    tiles) in place of the operator's choice, each checked."""
    import torch

    import luisaml
    from bench_mlp import device_times
    from luisaml.operators import tiled
    from luisaml.operators.fvdb.conv import SparseConv3d

    chosen = SparseConv3d.block_tiling
    out = {}
    try:
        for spec in tilings:
            v = [int(t) for t in spec.split(",")]
            BM, BN, BK = v[:3]
            TM, TN = v[3:5] if len(v) == 5 else (8 if BM >= 64 else 4, 8 if BN >= 64 else 4)
            SparseConv3d.block_tiling = lambda op, BM=BM, BN=BN, BK=BK, TM=TM, TN=TN: tiled.Tiling(
                op.n_out, op.c_out, op.taps * op.c_in, 1, BM, BN, TM, TN, BK, False, double=True)
            net = luisaml.compile(layer_m, backend=backend, batch_axis=None)
            with torch.no_grad():
                err = rel_err(_np(net.run({"x": x})["y"]), _np(want))
                ms, how = device_times(lambda: net.run({"x": x}), torch.cuda.synchronize, reps) if err <= REL_TOL else ([], "")
            out[spec] = {"rel_err": err, "luisaml_ms": percentiles(ms) if ms else None, "timing": how}
            print(f"tiling {spec}: rel err {err:.1e}" + (f", {out[spec]['luisaml_ms']['p50']:.3f} ms" if ms else
                                                         " FAILED correctness"), flush=True)
    finally:
        SparseConv3d.block_tiling = chosen
    return out


def _fp32_forms(forms: list[str], layer_m, backend: str, x, want, reps: int) -> dict:
    """Return {form: {rel_err, luisaml_ms, same_bits}} of the layer compiled with each SparseConv3d.fp32_form
    (operators/fvdb/conv.py: "early" the FP32 tile as it was, "rows", "ahead", "uniform"), each checked, and its
    output against the first form's bit for bit (the forms change loads, never sums)."""
    import torch

    import luisaml
    from bench_mlp import device_times
    from luisaml.operators.fvdb.conv import SparseConv3d

    default, out, first = SparseConv3d.fp32_form, {}, None
    try:
        for f in forms:
            SparseConv3d.fp32_form = f
            net = luisaml.compile(layer_m, backend=backend, batch_axis=None)
            with torch.no_grad():
                y = _np(net.run({"x": x})["y"])
                err = rel_err(y, _np(want))
                ms, how = device_times(lambda: net.run({"x": x}), torch.cuda.synchronize, reps) if err <= REL_TOL else ([], "")
            first = y if first is None else first
            out[f] = {"rel_err": err, "luisaml_ms": percentiles(ms) if ms else None, "timing": how,
                      "same_bits": bool(np.array_equal(y, first))}
            print(f"fp32_form {f}: rel err {err:.1e}, bits {'equal to' if out[f]['same_bits'] else 'DIFFER from'} "
                  f"{forms[0]}'s" + (f", {out[f]['luisaml_ms']['p50']:.3f} ms" if ms else " FAILED correctness"), flush=True)
    finally:
        SparseConv3d.fp32_form = default
    return out


def _other_mma_tiles(tiles: list[str], layer_m, backend: str, x, want, reps: int) -> dict:
    """Return {BM,BN[,V]: {rel_err, luisaml_ms}} of the layer compiled with tensor_cores="auto" on mma tiles
    of those sides in place of tiled_mma.choose's (and V K variants: SparseConv3d.mma_buckets), each
    checked at TF32's tolerance."""
    import torch

    import luisaml
    from bench_mlp import device_times
    from luisaml.operators.fvdb.conv import SparseConv3d

    chosen, variants = SparseConv3d._mma_tiling, SparseConv3d.mma_buckets
    out = {}
    try:
        for spec in tiles:
            BM, BN, *V = (int(t) for t in spec.split(","))
            SparseConv3d._mma_tiling = lambda op, rows, sides=None, BM=BM, BN=BN: chosen(op, rows, (BM, BN))
            SparseConv3d.mma_buckets = V[0] if V else 1
            try:  # (a tiling that fails to build is a row that failed, not a lost run)
                net = luisaml.compile(layer_m, backend=backend, batch_axis=None, tensor_cores="auto")
                net.run({"x": x})
            except Exception as e:  # noqa: BLE001
                out[spec] = {"error": f"{type(e).__name__}: {e}", "luisaml_ms": None}
                print(f"mma tile {spec}: FAILED to build or run: {out[spec]['error']}", flush=True)
                continue
            with torch.no_grad():
                err = rel_err(_np(net.run({"x": x})["y"]), _np(want))
                ok = err <= TF32_TOL and "mma_tf32_m16n8k8" in net.plan.source
                ms, how = device_times(lambda: net.run({"x": x}), torch.cuda.synchronize, reps) if ok else ([], "")
            out[spec] = {"rel_err": err, "luisaml_ms": percentiles(ms) if ms else None, "timing": how}
            print(f"mma tile {spec}: rel err {err:.1e}" + (f", {out[spec]['luisaml_ms']['p50']:.3f} ms" if ms else
                                                           " FAILED correctness"), flush=True)
    finally:
        SparseConv3d._mma_tiling, SparseConv3d.mma_buckets = chosen, variants
    return out


def _new_grid_walls(net, gb, radius: float, w, b, x, dev: str, reps: int) -> dict | None:
    """Return the two wall-time rows of the any-grid network (module docstring), or None when its
    output over the second grid differs from the reference."""
    import torch

    from luisaml.fvdb import GridBatch
    from luisaml.fvdb import torch_ops as F
    from luisaml.opsets import fvdb as schema

    def feeds(grid, feats):
        arrays = dict(zip(schema.kernel_map_input_names(), list(grid.bundle()) * 2))
        return {**{k: torch.from_numpy(np.array(v)).to(dev) for k, v in arrays.items()}, "x": feats}

    gb2 = GridBatch.from_ijk([shell_voxels(radius + 0.5)])
    bundle2 = F.bundle_tensors(gb2)
    x2 = torch.from_numpy(np.random.default_rng(1).standard_normal((gb2.total_voxels, CHANNELS)).astype(np.float32)).to(dev)
    ref2 = TorchReference(F.sparse_conv_kernel_map(bundle2, bundle2, KERNEL).numpy(), w, b, dev)
    first, second = feeds(gb, x), feeds(gb2, x2)
    with torch.no_grad():
        err = rel_err(_np(net.run(second)["y"]), _np(ref2(x2)))
    print(f"any grid, a second grid of {gb2.total_voxels} voxels: rel err {err:.1e}", flush=True)
    if not np.isfinite(err) or err > REL_TOL:
        return None
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def wall(pick) -> list[float]:
        out = []
        for i in range(reps + 2):
            t = time.perf_counter()
            net.run(pick(i))
            sync()
            out.append((time.perf_counter() - t) * 1e3)
        return out[2:]  # (two warm-ups)

    return {"any_grid_same_grid_wall": {"luisaml_ms": percentiles(wall(lambda i: first))},
            "any_grid_new_grid_wall": {"luisaml_ms": percentiles(wall(lambda i: (first, second)[i % 2])),
                                       "second_grid_voxels": int(gb2.total_voxels)}}


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


def _models(gb, w, b, bn):
    """Return (layer, layer + BN + ReLU, kernel map) ONNX models, the kernel map model's feeds, the
    map + layer model, and that model for grids of any size: the first two over constant grids
    (their map folds at compile time), the others over grids fed at run time (the map built on the
    device)."""
    from onnx import TensorProto, helper, numpy_helper

    from luisaml.opsets import fvdb as schema

    names = schema.kernel_map_input_names()
    grid = dict(zip(names, list(gb.bundle()) * 2))
    kmap_node = helper.make_node(schema.KERNEL_MAP, names, ["kmap"], name="kmap", domain=schema.DOMAIN,
                                 kernel_size=[KERNEL], stride=[1], output_voxels=gb.total_voxels)

    def conv(out):
        return helper.make_node(schema.SPARSE_CONV, ["x", "kmap", "w", "b"], [out], name="conv", domain=schema.DOMAIN)

    n = gb.total_voxels
    elem = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int64): TensorProto.INT64,
            np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.int32): TensorProto.INT32}

    def model(nodes, inits, inputs, out_type=TensorProto.FLOAT, out_shape=(n, CHANNELS), out="y"):
        return onnx_model(nodes, inputs, [helper.make_tensor_value_info(out, out_type, out_shape)],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])

    x_in = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, CHANNELS])]
    consts = {**grid, "w": w, "b": b}
    layer = model([kmap_node, conv("y")], consts, x_in)
    norm = helper.make_node("BatchNormalization", ["h", "scale", "shift", "mean", "var"], ["h1"], name="bn")
    fused = model([kmap_node, conv("h"), norm, helper.make_node("Relu", ["h1"], ["y"], name="relu")],
                  {**consts, **dict(zip(("scale", "shift", "mean", "var"), bn))}, x_in)
    map_in = [helper.make_tensor_value_info(k, elem[np.asarray(v).dtype], list(np.shape(v))) for k, v in grid.items()]
    mapper = model([kmap_node], {}, map_in, TensorProto.INT32, (n, KERNEL ** 3), "kmap")
    both = model([kmap_node, conv("y")], {"w": w, "b": b}, map_in + x_in)
    # for any grid: the parts that grow with it and the features' rows dynamic (the voxels the batch)
    grows = ("grid_blob", "leaf_batch_indices", "list_indices")
    any_in = [helper.make_tensor_value_info(k, elem[np.asarray(v).dtype],
                                            [f"rows of {k}" if k.endswith(grows) else d for d in np.shape(v)][:1]
                                            + list(np.shape(v))[1:]) for k, v in grid.items()]
    any_grid = model([kmap_node, conv("y")], {"w": w, "b": b},
                     any_in + [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["V", CHANNELS])],
                     out_shape=("V", CHANNELS))
    return layer, fused, mapper, {k: np.asarray(v) for k, v in grid.items()}, both, any_grid


def _time(runs: dict, reps: int, cuda: bool) -> dict:
    """Return {measurement: {luisaml_ms, torch_ms}} and the timing method."""
    import torch

    out: dict = {}
    if cuda:
        from bench_mlp import device_times

        how = None
        for k, (ours, theirs) in runs.items():
            ms, how = device_times(ours, torch.cuda.synchronize, reps)
            out[k] = {"luisaml_ms": percentiles(ms), "luisaml_timing": how}
            if theirs is not None:
                ms, how_t = device_times(theirs, torch.cuda.synchronize, reps)
                out[k]["torch_ms"], out[k]["torch_timing"] = percentiles(ms), how_t
        out["timing"] = "CUPTI device spans (first kernel start to last kernel end of a forward)"
        return out
    from bench_models import interleaved

    for k, (ours, theirs) in runs.items():
        fns = {"luisaml": ours} if theirs is None else {"luisaml": ours, "torch": theirs}
        ms = interleaved(fns, reps)
        out[k] = {f"{name}_ms": percentiles(v) for name, v in ms.items()}
    out["timing"] = "host wall time of net.run (copies included) and of the torch reference, interleaved"
    return out


if __name__ == "__main__":
    raise SystemExit(main())
