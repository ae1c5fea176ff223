"""The taps a tile of SparseConv3d's FP32 tile runs on bench_fvdb's layer grid (benchmarks/NOTES.md,
"addresses a tap, not a step"): the map folded on the CPU (no GPU), its rows in rows_by_taps' order
lexsorted by tap mask (`tile` 0) against its packing for tiles of 64 (SparseConv3d.PACKED_ROWS, the
default) or 128 rows: each mask's whole tiles first, the other tiles filled greedily with the rows whose
masks add the fewest taps (conv.py's `_packed`; rows_by_taps takes it where it runs fewer taps). Printed
for 64-row tiles (the FP32 tile) and 128-row ones (the mma tile, whose K is the most taps any tile reads):
the taps a tile on average, the most, the k steps in all (taps summed over tiles), the order's host time.

    python benchmarks/experiments/tile_taps.py [--radius 126]

A row's sum runs over its tile's taps in tap order, the taps its voxel lacks adding zeros: which tile a
row lands in changes no value (tests/fvdb/test_sparse_conv_fp32_tile.py checks the bits)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tile_sass import plan_stage  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--radius", type=float, default=126.0)  # (bench_fvdb.GPU_RADIUS)
    args = ap.parse_args()
    from luisaml.operators.fvdb.conv import _packed, rows_by_taps, tile_taps

    plan, _, _ = plan_stage("sparse", "uniform", args.radius)
    op = next(s for s in plan.schedule.stages if s.domain == "blocks").root[1]
    kmap = np.asarray(op.input(1).value)
    active = kmap >= 0
    print(f"{len(kmap)} voxels, {active.sum(1).mean():.2f} taps a voxel")
    t = time.perf_counter()
    orders = {"lexsorted": rows_by_taps(kmap)}
    took = {"lexsorted": time.perf_counter() - t}
    for BM in (64, 128):
        t = time.perf_counter()
        orders[f"packed {BM}"] = _packed(active, BM)
        took[f"packed {BM}"] = time.perf_counter() - t
    for name, order in orders.items():
        assert np.array_equal(np.sort(order), np.arange(len(kmap)))
        cells = []
        for BM in (64, 128):
            u = tile_taps(active[order], BM)
            cells.append(f"{BM} rows: {u.mean():.2f} taps a tile, most {u.max()}, {u.sum()} in all")
        print(f"{name:13s} ({took[name]:.2f} s): " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
