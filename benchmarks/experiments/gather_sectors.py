"""The mma tile's Conv gather, counted in 32-byte sectors (benchmarks/NOTES.md, "The mma tile's loads are in
flight"): for one 128 x 128 block of a Conv's implicit GEMM, the sectors of X (A, the gather) and of the packed
W (B) each k step reads, and of A's those an L1 of a given size (LRU over sectors, one block alone: the other
block on its SM only adds misses) does not hold, under conv_tiles' "step" order (k = tap, channel: a tap's pass
over every channel, then the next tap) and "reuse" (channel block, tap, channel: a block of 16 channels
through every tap in turn). No GPU: an address model of the loaders, NCHW X, rows a sample's output positions.

    python benchmarks/experiments/gather_sectors.py [--l1-kib 64] [--row-block 1]

Prints, per shape and order, A's sectors read a step, A's sectors from L2 a step (L1 misses), B's, and the
FLOP a byte from L2 (2 x 128 x 128 x 16 over the missed bytes)."""
from __future__ import annotations

import argparse
from collections import OrderedDict

import numpy as np

BM = BN = 128
BK = 16
SECTOR = 32

# (name, C, input side(s), K, kernel, stride, pad): wav2vec2's 1-d layers (batch 8, 16,000 samples), ResNet-50's
# direct 3 x 3s (its stride-2 ones on CUDA; stride 1 where Winograd is off)
SHAPES = [("wav2vec2 512 3199 k3 s2", 512, (3199,), 512, 3, 2, 0),
          ("wav2vec2 512 199 k2 s2", 512, (199,), 512, 2, 2, 0),
          ("r50 3x3 28 128", 128, (28, 28), 128, 3, 1, 1),
          ("r50 3x3 14 256", 256, (14, 14), 256, 3, 1, 1),
          ("r50 3x3 7 512", 512, (7, 7), 512, 3, 1, 1),
          ("r50 3x3 s2 56->28 128", 128, (56, 56), 128, 3, 2, 1)]


def steps(C: int, taps: int, order: str):
    """(tap, first channel) of each k step."""
    if order == "step":
        return [(t, c0) for t in range(taps) for c0 in range(0, C, BK)]
    return [(t, c0) for c0 in range(0, C, BK) for t in range(taps)]


def count(C, sizes, K, k, s, p, order, l1_bytes, row_block):
    d = len(sizes)
    out = [(n + 2 * p - k) // s + 1 for n in sizes]
    positions = int(np.prod(out))
    taps = k ** d
    rows = np.arange(row_block * BM, min((row_block + 1) * BM, positions))  # (a sample's positions; a short last
    # block of ResNet's 7 x 7 takes the next sample's rows in luisaml: one sample here)
    coords = np.stack(np.unravel_index(rows, out), 1) * s - p
    plane = int(np.prod(sizes))
    cache: OrderedDict = OrderedDict()
    cap = l1_bytes // SECTOR
    read = missed = 0
    for t, c0 in steps(C, taps, order):
        off = np.array(np.unravel_index(t, (k,) * d))
        pos = coords + off
        ok = np.all((pos >= 0) & (pos < np.array(sizes)), 1)
        lin = np.ravel_multi_index(pos[ok].T, sizes)
        addr = (np.arange(c0, c0 + BK)[:, None] * plane + lin[None, :]) * 4
        sectors = np.unique(addr // SECTOR)
        read += len(sectors)
        for sec in sectors:
            if sec in cache:
                cache.move_to_end(sec)
            else:
                missed += 1
                cache[sec] = None
                if len(cache) > cap:
                    cache.popitem(last=False)
    n = len(steps(C, taps, order))
    b_sectors = BK * BN * 4 // SECTOR  # (16 packed rows of 128 consecutive columns: always whole sectors)
    return read / n, missed / n, b_sectors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--l1-kib", type=int, default=64, help="the L1 a block has (LRU; ~256 KiB an SM less shared memory, two blocks)")
    ap.add_argument("--row-block", type=int, default=0)
    args = ap.parse_args()
    flop = 2 * BM * BN * BK
    for name, C, sizes, K, k, s, p in SHAPES:
        for order in ("step", "reuse"):
            a_read, a_missed, b = count(C, sizes, K, k, s, p, order, args.l1_kib * 1024, args.row_block)
            l2 = (a_missed + b) * SECTOR
            print(f"{name:26s} {order:6s} A sectors a step {a_read:6.1f} read, {a_missed:6.1f} from L2; B {b}; "
                  f"{l2 / 1024:5.1f} KiB from L2 a step, {flop / l2:5.1f} FLOP a byte")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
