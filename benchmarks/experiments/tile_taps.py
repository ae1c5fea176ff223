"""The taps a tile of SparseConv3d's FP32 tile runs on bench_fvdb's layer grid (benchmarks/NOTES.md,
"addresses a tap, not a step"): the map folded on the CPU (no GPU), its rows in rows_by_taps' order
(lexsorted by tap mask) against a packing that keeps each mask's rows together in whole tiles and fills
the other tiles greedily with the rows whose masks add the fewest taps. Printed for 64-row tiles (the
FP32 tile) and 128-row ones (the mma tile, whose K is the most taps any tile reads): the taps a tile on
average, the most, the k steps in all (taps summed over tiles), and the order's host time.

    python benchmarks/experiments/tile_taps.py [--radius 126]

A row's sum runs over its tile's taps in tap order, the taps its voxel lacks adding zeros: which tile a
row lands in changes no value (not checked here: the packing is not built into rows_by_taps)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tile_sass import plan_stage  # noqa: E402


def tile_taps(active: np.ndarray, order: np.ndarray, BM: int) -> np.ndarray:
    """The taps each BM-row tile of `order` reads (the last tile padded with rows of none)."""
    a = active[order]
    a = np.concatenate([a, np.zeros((-len(a) % BM, a.shape[1]), bool)])
    return a.reshape(-1, BM, a.shape[1]).any(1).sum(1)


def packed(active: np.ndarray, BM: int) -> np.ndarray:
    """Rows ordered so that each tap mask's whole BM-row chunks come first (a tile of one mask: its
    taps only), then tiles filled greedily: the largest remainder first, then the remainders that add
    the fewest taps to the tile's union (ties: the larger)."""
    taps = active.shape[1]
    if taps > 28:
        raise ValueError("packed: at most 28 taps")
    masks = (active.astype(np.int64) << np.arange(taps)).sum(1)
    order = np.argsort(masks, kind="stable")
    m = masks[order]
    starts = np.flatnonzero(np.r_[True, m[1:] != m[:-1]])
    lens = np.diff(np.r_[starts, len(m)])
    whole = lens // BM * BM
    head = np.concatenate([order[s:s + w] for s, w in zip(starts, whole)]) if whole.any() else order[:0]
    rest = [(int(m[s]), order[s + w:s + n]) for s, w, n in zip(starts, whole, lens) if n > w]
    rmask = np.array([k for k, _ in rest], np.int64)
    left = np.array([len(r) for _, r in rest])
    taken = np.zeros(len(rest), np.int64)
    table = np.array([bin(v).count("1") for v in range(1 << 14)], np.int64)

    def bitcount(v: np.ndarray) -> np.ndarray:  # (masks of up to 28 taps: two 14-bit halves)
        return table[v & 0x3FFF] + table[(v >> 14) & 0x3FFF]

    out, union, space = [], 0, BM
    while left.sum():
        if space == BM:
            i = int(np.argmax(left))
        else:
            new = np.where(left > 0, bitcount(rmask & ~union), taps + 1)
            i = int(np.lexsort((-left, new))[0])
        n = min(space, int(left[i]))
        out.append(rest[i][1][taken[i]:taken[i] + n])
        taken[i] += n
        left[i] -= n
        union |= int(rmask[i])
        space -= n
        if space == 0:
            union, space = 0, BM
    return np.concatenate([head] + out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--radius", type=float, default=126.0)  # (bench_fvdb.GPU_RADIUS)
    args = ap.parse_args()
    from luisaml.operators.fvdb.conv import rows_by_taps

    plan, _, _ = plan_stage("sparse", "uniform", args.radius)
    op = next(s for s in plan.schedule.stages if s.domain == "blocks").root[1]
    kmap = np.asarray(op.input(1).value)
    active = kmap >= 0
    print(f"{len(kmap)} voxels, {active.sum(1).mean():.2f} taps a voxel")
    t = time.perf_counter()
    orders = {"rows_by_taps": rows_by_taps(kmap)}
    took = {"rows_by_taps": time.perf_counter() - t}
    for BM in (64, 128):
        t = time.perf_counter()
        orders[f"packed {BM}"] = packed(active, BM)
        took[f"packed {BM}"] = time.perf_counter() - t
    for name, order in orders.items():
        assert np.array_equal(np.sort(order), np.arange(len(kmap)))
        cells = []
        for BM in (64, 128):
            u = tile_taps(active, order, BM)
            cells.append(f"{BM} rows: {u.mean():.2f} taps a tile, most {u.max()}, {u.sum()} in all")
        print(f"{name:13s} ({took[name]:.2f} s): " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
