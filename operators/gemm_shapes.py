"""The tile shapes of Gemm and MatMul's items form (operators/gemm.py, Dense.tiles) and the tiles a
schedule search measures (luisaml/tune.py): the rules and the measurements behind them."""
from __future__ import annotations

# Accumulators one thread holds: 32 floats (4 AVX registers once clang vectorises them); tiles of 64
# spilled (the transformer's 1024x128x64 MatMul: 8.8-15.6 ms with 2x32 tiles, under 1.4 ms with
# 1x32; benchmarks/NOTES.md, "CPU stage kernels"); on a GPU they are 32 of a thread's registers.
MAX_ACC = 32
# A constant B with K and N of 128 or more (a wide MLP layer) takes 2 x 16 tiles instead of 1 x 32:
# each B load then feeds two rows. On the CPU backend 63-128x4-4 went 8.1-9.8 -> 6.0-7.5 ms and
# 63-256x4-4 13.9-17.4 -> 9.8-10.5 ms (2 x 8 tiles: 12.1-14.1); not measured on CUDA yet.
NARROW = 16
# On the CPU backend (the ragged tiles) a narrow tile takes up to 64 accumulators in up to 4 rows:
# 4 x 16, eight AVX vectors, each B load feeding four rows ([196, 512] x [512, 2048] 121 GFLOP/s against 81 as
# 2 x 16; 8 x 16 and 4 x 32 spilled: 57-64; benchmarks/NOTES.md, "GEMM tiles on AVX-512")
CPU_NARROW_ACC = 64
# The tile (rows, columns) of a product whose B is not a constant (Dense.square_tiles). Its loads
# once paid the index arithmetic of the inline nodes they read through, so that 16 x 8 (128
# accumulators, spilled) loaded least per multiply-add and won; with that arithmetic folded
# (Dense.affine_loads) the 4 x 16 tile of a constant B's wins too. ViT-Ti's attention block (CPU
# backend, A/B in one process): Q K^T (3 heads of [197, 64] x [64, 197], K^T's columns strided)
# 2.16 ms as 16 x 8, 1.35 as 4 x 16, 1.46 as 4 x 8, 2.38 as 8 x 8, 2.35 as 8 x 16; attn V 0.58
# as 16 x 8, 0.36 as 4 x 16 (benchmarks/NOTES.md, "Attention products on the CPU").
SQUARE = (4, 16)
# (Dense.shift_last) the square tiles' rows where N is not a multiple of 8 (their stores at row
# bases, Dense._finish): ViT-Ti's Q K^T ([197, 64] x [64, 197], B gathered along its columns, 8
# scalar loads a k step) 0.88 ms as 4 x 8, 0.60 as 8 x 8, 0.66 as 4 x 28 (one process, load ~5.5;
# benchmarks/NOTES.md, "Q K^T: consecutive stores")
UNALIGNED_ROWS = 8
WIDE = 32  # the widest column block: 64 measured no faster (63-256x4-4), and spilled before the stores were split


def block_columns(N: int, wide: int) -> int:
    """Return the columns O of a tile: a multiple of 4 (vector lanes), all of N up to `wide`, else
    the block of 8..wide columns that pads N least (then the widest)."""
    n4 = max(-(-N // 4), 1) * 4
    if n4 <= wide:
        return n4
    return min(range(8, wide + 1, 4), key=lambda o: (-(-N // o) * o - N, -o))


def tile_shape(M: int, N: int, narrow: bool = False, ragged: bool = False) -> tuple[int, int]:
    """Return (rows R, columns O) of a work item's tile: O of block_columns up to WIDE (NARROW when
    `narrow`), then as many rows as divide M within MAX_ACC accumulators (rows that divide M need
    no bounds checks), or with `ragged` (the CPU's) as many as fit (the last row block ragged:
    Dense.tiles), within CPU_NARROW_ACC and 4 rows when `narrow`."""
    O = block_columns(N, NARROW if narrow else WIDE)
    most = min(CPU_NARROW_ACC // O, 4) if ragged and narrow else min(MAX_ACC // O, 8)
    if ragged:
        return max(1, min(most, M)), O
    R = max(r for r in range(1, most + 1) if M % r == 0) if M else 1
    return R, O


def chains(R: int, O: int, K: int) -> int:
    """Return how many accumulator sets take turns over k. A narrow tile (one vector of 8 or fewer
    columns, a single row) is a chain of dependent multiply-adds, one k step per FMA latency: 4 sets
    hide it. Wider tiles keep one set: two sets of a 1 x 32 tile measured slower over K=256
    (4.4 ms vs 2.4 ms a 63-256x4-4 layer; benchmarks/NOTES.md)."""
    return max(1, min(4, K)) if R * -(-O // 8) == 1 else 1


# a tuned tile (luisaml/tune.py) stays within these: SQUARE's 128 accumulators, WIDE's columns
MAX_TUNED_ACC, MAX_TUNED_ROWS = 128, 16


def item_choice(choice: dict | None, M: int) -> tuple[int, int] | None:
    """Return (R, O) of a tuned items schedule, or None where there is none or it is out of bounds
    (a hand-edited cache entry cannot make a bad kernel)."""
    if not choice or choice.get("form") != "items":
        return None
    R, O = choice.get("R"), choice.get("O")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (R, O)):
        return None
    ok = 1 <= R <= min(max(M, 1), MAX_TUNED_ROWS) and 4 <= O <= WIDE and O % 4 == 0 and R * O <= MAX_TUNED_ACC
    return (R, O) if ok else None


def item_candidates(M: int, N: int, rule: tuple[int, int], wide: bool) -> list[dict]:
    """Return the items schedules a search measures: the rules' tile (R, O) first, then tiles near
    it and the shapes measured on other products (SQUARE, 1 x 32, 2 x 16, 8 x 8), then the rules'
    rows at every width (what a one-row product can vary), 4 in all or (wide) up to 12; none wider
    than N needs."""
    R0, O0 = rule
    n4 = max(-(-N // 4), 1) * 4
    out = [rule]
    near = [(R0 * 2, O0), (R0, O0 // 2), (R0 // 2, O0 * 2), (R0 * 2, O0 // 2), (R0, O0 * 2), (R0 // 2, O0),
            SQUARE, (8, 8), (1, 32), (2, 16), (4, 8), (8, 16), (4, 16), (1, 16)] + [(R0, o) for o in range(8, WIDE + 1, 4)]
    for R, O in near:
        c = item_choice({"form": "items", "R": R, "O": O}, M)
        if c is not None and c not in out and O <= n4:
            out.append(c)
    return [{"form": "items", "R": R, "O": O} for R, O in out[:12 if wide else 4]]
