"""spconv 2.3.8's SubMConv3d on bench_fvdb.py's layer (3x3x3, 64 -> 64 channels, the one-voxel sphere
shell of radius 126 in a 512^3 extent, the same seed's features, weights and bias), checked against
bench_fvdb's torch gather-matmul-scatter reference on a kernel map built here in numpy, then timed.

spconv and luisa-python do not fit one device call together (64 MiB), so this runs in a call of its
own (`../shared/device/spconv-pack.sh` packs spconv into .spconv/):
    source .spconv/env.sh && python benchmarks/bench_spconv.py     # writes results/spconv-<gpu>.json
Measured: `layer` (the map built once by a first call with the same indice_key, then reused, as a
network's later layers do; the comparable number to bench_fvdb's folded map) and `layer_and_map`
(a fresh SparseConvTensor each time: the rulebook built too). fp32 with torch's TF32 switches off,
and fp16 for scale. Times: CUPTI device spans (bench_mlp.device_times), P50/P95/P99 in ms."""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_fvdb import CHANNELS, GPU_RADIUS, KERNEL, REL_TOL, TorchReference, rel_err, shell_voxels  # noqa: E402
from bench_mlp import percentiles  # noqa: E402


def kernel_map(ijk: np.ndarray, k: int = KERNEL) -> np.ndarray:
    """Return int32 [N, k^3]: the row of voxel c + d - (k - 1) / 2 for each tap d (d0 slowest, as
    fVDB's weight [C_out, C_in, k0, k1, k2]), -1 where it is not a voxel: an independent numpy map."""
    lo = ijk.min(0) - k
    span = ijk.max(0) + k - lo + 1
    keys = ((ijk - lo) * np.array([span[1] * span[2], span[2], 1])).sum(1)
    order = np.argsort(keys)
    sorted_keys = keys[order]
    p = (k - 1) // 2
    taps = [(a - p, b - p, c - p) for a in range(k) for b in range(k) for c in range(k)]
    out = np.full((len(ijk), len(taps)), -1, np.int32)
    for t, d in enumerate(taps):
        q = ((ijk + np.array(d) - lo) * np.array([span[1] * span[2], span[2], 1])).sum(1)
        at = np.minimum(np.searchsorted(sorted_keys, q), len(keys) - 1)
        hit = sorted_keys[at] == q
        out[hit, t] = order[at[hit]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out-dir", help="where the JSON goes (default benchmarks/results)")
    a = ap.parse_args(argv)
    import spconv
    import spconv.pytorch as sp
    import torch

    from bench_mlp import device_times

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda"
    from luisaml.fvdb import GridBatch  # (host code only: no luisa-python needed)

    ijk = np.asarray(GridBatch.from_ijk([shell_voxels(GPU_RADIUS)]).ijk.jdata, np.int64)  # bench_fvdb's row order
    n = len(ijk)
    rng = np.random.default_rng(0)  # bench_fvdb's draws, in its order
    w = (rng.standard_normal((CHANNELS, CHANNELS, KERNEL, KERNEL, KERNEL)) / np.sqrt(CHANNELS * 27)).astype(np.float32)
    b = rng.standard_normal(CHANNELS).astype(np.float32)
    for _ in range(3):  # (its BatchNorm's parameters)
        rng.standard_normal(CHANNELS)
    rng.uniform(0.5, 2, CHANNELS)
    x_np = rng.standard_normal((n, CHANNELS)).astype(np.float32)
    kmap = kernel_map(ijk)
    ref = TorchReference(kmap, w, b, dev)
    x = torch.from_numpy(x_np).to(dev)
    with torch.no_grad():
        want = ref(x).cpu().numpy()
    lo = ijk.min(0)
    indices = torch.from_numpy(np.concatenate([np.zeros((n, 1), np.int32), ijk - lo], 1).astype(np.int32)).to(dev)
    shape = [int(v) for v in ijk.max(0) - lo + 1]

    conv = sp.SubMConv3d(CHANNELS, CHANNELS, KERNEL, bias=True, indice_key="subm").to(dev)
    errs, chosen = {}, None
    with torch.no_grad():
        conv.bias.copy_(torch.from_numpy(b))
        # spconv's weight is [C_out, k0, k1, k2, C_in]; try fVDB's tap order and its mirror
        for name, wt in (("same", w), ("mirrored", w[:, :, ::-1, ::-1, ::-1])):
            conv.weight.copy_(torch.from_numpy(np.ascontiguousarray(wt.transpose(0, 2, 3, 4, 1))))
            got = conv(sp.SparseConvTensor(x, indices, shape, 1)).features.cpu().numpy()
            errs[name] = rel_err(got, want)
            if errs[name] <= REL_TOL:
                chosen = name
                break
    print(f"spconv {spconv.__version__}, {n} voxels, {int((kmap >= 0).sum())} pairs; rel err {errs}", flush=True)
    if chosen is None:
        print(f"FAILED correctness: spconv differs from the reference by {errs}")
        return 1

    def fresh():
        return sp.SparseConvTensor(x, indices, shape, 1)

    with torch.no_grad():
        warm = conv(fresh())  # builds the rulebook under indice_key "subm"; `warm` carries it
        reuse = sp.SparseConvTensor(x, indices, shape, 1, indice_dict=warm.indice_dict)
        runs = {"layer": lambda: conv(reuse), "layer_and_map": lambda: conv(fresh())}
        out = {}
        for k, fn in runs.items():
            ms, how = device_times(fn, torch.cuda.synchronize, a.reps)
            out[k] = {"spconv_ms": percentiles(ms), "timing": how}
        half = conv.half()
        xh = x.half()
        reuse_h = sp.SparseConvTensor(xh, indices, shape, 1, indice_dict=warm.indice_dict)
        ms, how = device_times(lambda: half(reuse_h), torch.cuda.synchronize, a.reps)
        out["layer_fp16"] = {"spconv_ms": percentiles(ms), "timing": how}
    name = torch.cuda.get_device_name(0)
    tag = "h200" if "H200" in name else "".join(c for c in name.lower() if c.isalnum())
    rec = {"date": datetime.date.today().isoformat(), "device": name, "torch": torch.__version__,
           "spconv": spconv.__version__, "command": "python benchmarks/bench_spconv.py"
           + (f" --reps {a.reps}" if a.reps != 30 else ""), "voxels": n, "pairs": int((kmap >= 0).sum()),
           "rel_err": errs, "weight_taps": chosen, **out}
    out_dir = Path(a.out_dir) if a.out_dir else HERE / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"spconv-{tag}.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    for k, r in out.items():
        print(f"{k}: " + " / ".join(f"{r['spconv_ms'][p]:.3f}" for p in ("p50", "p95", "p99")) + f" ms ({r['timing']})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
