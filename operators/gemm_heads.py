"""Gemm and MatMul layers of one row a sample and a large weight matrix on CUDA (a classifier's head
after the pool: ResNet-50's 2,048 -> 1,000): a block per COLUMNS columns and WARPS x SAMPLES samples,
a warp per SAMPLES of them, its lanes splitting k (operators/gemm_blocks.py's `Dense.block_tiling` takes it
before either tile of samples where W has at least `Dense.HEAD_MIN_WEIGHTS` weights).

Why. A plan does not know the batch, and at the batches CNNs run (8-64) the tile of 64 or 128
samples is starved: ResNet-50's head at batch 16 was 8 blocks on a 132-SM GPU (0.29 ms on the
H100 against torch's ~15 us), each block walking k = 2,048 in serial steps. Here the same head at
batch 16 is 125 blocks of 4 warps, a lane's 64 k's in 16 iterations of UNROLL loads each.

How. Lane l of a warp takes k = l, l + 32, ...: A's rows are one contiguous run a warp, and W is
read as [N][K] (the constant's rows transposed once into the blob, as gemm_rows.py reads it), so a
column's loads are contiguous across the lanes too. Each lane keeps SAMPLES x COLUMNS partial sums;
warp_active_sum (shaders/warp.py) combines each, lane 0 applies the epilogue once to the full sum
and stores. A block's warps share its columns, so W's rows a block reads come from L2 once and from
L1 for the other warps (they run in step); W is read from L2 once per WARPS x SAMPLES samples. The k
loop has UNROLL steps' loads in flight at once: with a few warps an SM (the small batches this form
is for) each k step would otherwise wait one round trip to L2 or HBM (the recurrent block loop
measured ~300 clocks a k that way, benchmarks/NOTES.md). Written as "the steps' loads first, then
their multiply-adds", the compilers sank the loads to one step's (_loop_ahead), so they are loaded
an iteration ahead (Heads.AHEAD; False: as written, the A/B's baseline). A warp whose first
sample is past the batch skips the whole (warp-uniform) body, so a live warp's lanes all reach the
reductions; a live warp's samples past the batch read the last live sample again and store nothing,
and the last column block's columns past N read column N - 1 again and store nothing."""
from __future__ import annotations

from dataclasses import dataclass

from luisaml import indexing as ix

WARP = 32
WARPS = 4  # a block's warps (128 threads), each its own SAMPLES samples of the block's columns
SAMPLES = 4  # a warp's samples: W's loads shared by this many sums
COLUMNS = 8  # a block's columns: A's loads shared by this many sums (SAMPLES x COLUMNS = 32 a lane)
UNROLL = 4  # k steps of WARP whose loads a lane issues before their multiply-adds
MIN_K = 256  # a head over pooled features: a lane's 8 k's or more (a shorter k is not a head's)


@dataclass(frozen=True)
class Heads:
    """COLUMNS columns and WARPS x SAMPLES samples a block of a 1 x K by K x N product."""

    N: int
    K: int
    rows_b = True  # reads B as [N][K] (operators/gemm_blocks.py's _b_rows)
    # The k loop's loads an iteration ahead (_loop_ahead); False: the loads written first as main had them,
    # which NVVM and ptxas sink to one step's 12 a warp (benchmarks/NOTES.md, "The warp forms' loads"). The A/B.
    AHEAD = True

    @property
    def M(self) -> int:
        """The block's samples (Dense.block_samples)."""
        return WARPS * SAMPLES

    @property
    def threads(self) -> int:
        return WARP * WARPS

    @property
    def blocks(self) -> int:
        """Blocks per group of M samples: the column blocks."""
        return -(-self.N // COLUMNS)

    def describe(self) -> str:
        return (f"a block per {COLUMNS} columns and {self.M} samples, a warp per {SAMPLES} samples, its lanes "
                f"splitting k = {self.K} ({UNROLL} steps' loads at once), sums combined across the warp")

    def emit(self, ctx, item: str, thread: str, a_row, b_value, finish_row, store_row) -> None:
        emit(ctx, self, item, thread, a_row, b_value, finish_row, store_row)


def choose(N: int, K: int, min_weights: int, min_columns: int) -> Heads | None:
    """Return the head tiling of a sample-row product of N columns and depth K, or None: fewer than
    min_weights weights (0: never), K under MIN_K, or at most min_columns columns (gemm_rows.py's)."""
    if not min_weights or N <= min_columns or K < MIN_K or N * K < min_weights:
        return None
    return Heads(N, K)


def emit(ctx, tl: Heads, item: str, thread: str, a_row, b_value, finish_row, store_row) -> None:
    """Emit thread `thread` of column block `item`: a_row(bi, m) -> k -> A of the group's sample m
    (gemm_blocks.py's sample-row loaders), b_value(k, n) -> B[k, n], finish_row / store_row(bi, m, n, value)."""
    from . import tiled

    N, K = tl.N, tl.K
    warp, lane = ctx.let(ix.div(thread, WARP), "wp"), ctx.let(ix.mod(thread, WARP), "ln")
    live = tiled.group_rows(ctx, tl.M)
    first = ctx.let(ix.mul(warp, SAMPLES), "m")
    ctx.line(f"if {first} < {live}:")
    with ctx.indent():
        ms = [first] + [ctx.let(f"min({ix.add(first, str(s))}, {live} - 1)", "m") for s in range(1, SAMPLES)]
        loads = [a_row("0", m) for m in ms]
        n0 = ctx.let(ix.mul(item, COLUMNS), "n")
        ragged = N % COLUMNS != 0
        cols = [ctx.let(f"min({ix.add(n0, str(j))}, {N - 1})" if ragged and j >= N % COLUMNS else ix.add(n0, str(j)), "c")
                for j in range(COLUMNS)]
        acc = [[ctx.fresh("acc") for _ in cols] for _ in ms]
        for row in acc:
            for name in row:
                ctx.line(f"{name} = 0.0")

        def fmas(xs: list[list[str]], ws: list[list[str]]) -> None:
            # the steps' multiply-adds in k order (each sum's order as one step a time)
            for u in range(len(xs)):
                for s, row in enumerate(acc):
                    for j, name in enumerate(row):
                        ctx.line(f"{name} = fma({xs[u][s]}, {ws[u][j]}, {name})")

        def products(ks: list[str]) -> None:
            # every load of the steps first, then their multiply-adds
            fmas([[ctx.let(load(k), "x") for load in loads] for k in ks],
                 [[ctx.let(b_value(k, c), "w") for c in cols] for k in ks])

        full = K // (WARP * UNROLL)
        if full and tl.AHEAD:
            _loop_ahead(ctx, lane, full, loads, b_value, cols, fmas)
        elif full:
            it = ctx.fresh("it")
            ctx.line(f"for {it} in range({full}):")
            with ctx.indent():
                base = ctx.let(ix.add(lane, ix.mul(it, WARP * UNROLL)), "k")
                products([ix.add(base, str(WARP * u)) for u in range(UNROLL)])
        for t in range(full * UNROLL, -(-K // WARP)):  # (under UNROLL steps left: straight-line)
            k = ctx.let(ix.add(lane, str(WARP * t)), "k")
            if WARP * (t + 1) > K:  # (a ragged last step: its lanes past K load nothing)
                ctx.line(f"if {k} < {K}:")
                with ctx.indent():
                    products([k])
            else:
                products([k])
        total = ctx.use_helper("warp_active_sum", "warp")
        sums = [[ctx.let(f"{total}({name})", "w") for name in row] for row in acc]
        ctx.line(f"if {lane} == 0:")
        with ctx.indent():
            for s, m in enumerate(ms):
                if s:
                    ctx.line(f"if {ix.add(first, str(s))} < {live}:")
                    ctx.level += 1
                for j, c in enumerate(cols):
                    cond = f"{ix.add(n0, str(j))} < {N}" if ragged and j >= N % COLUMNS else None
                    ctx.line_if(cond, store_row("0", m, c, ctx.let(finish_row("0", m, c, sums[s][j]), "f")))
                if s:
                    ctx.level -= 1


def _loop_ahead(ctx, lane: str, full: int, loads, b_value, cols: list[str], fmas) -> None:
    """The k loop's `full` iterations of UNROLL steps with their loads an iteration ahead (operators/
    rnn_step.py's gemv_unrolled does the same for R): the loop runs full + 1 times; iteration it loads
    the steps of iteration min(it, full - 1) into named registers carried round the loop (the last
    iteration reloads the last steps: no read past A or W) and, from the second on, multiplies copies of
    the previous iteration's. Written as "all loads first, then the multiply-adds", NVVM sinks each load
    to its first use and ptxas hoists a few back: 12 of the 48 an iteration were in flight at the first
    FFMA, one step's, so a lane waited a round trip a step (benchmarks/experiments/heads_sass.py). Here
    nothing in an iteration uses what it loads, so all 48 are issued before its multiply-adds wait. The
    registers start at 0.0, not with loads before the loop (LLVM folds a phi of loads into a load of a
    phi at the loop's top, and ptxas interleaves it again). The same sums in the same order: the same bits."""
    nx, nw = len(loads), len(cols)
    xn = [[ctx.fresh("xn") for _ in range(nx)] for _ in range(UNROLL)]
    wn = [[ctx.fresh("wn") for _ in range(nw)] for _ in range(UNROLL)]
    for name in [v for rows in xn + wn for v in rows]:
        ctx.line(f"{name} = 0.0")
    it = ctx.fresh("it")
    ctx.line(f"for {it} in range({full + 1}):")
    with ctx.indent():
        xc = [[ctx.fresh("xc") for _ in row] for row in xn]  # (copies: let returns a bare name as it is)
        wc = [[ctx.fresh("wc") for _ in row] for row in wn]
        for cs, ns in ((xc, xn), (wc, wn)):
            for crow, nrow in zip(cs, ns):
                for c, n in zip(crow, nrow):
                    ctx.line(f"{c} = {n}")
        base = ctx.let(ix.add(lane, ix.mul(f"min({it}, {full - 1})", WARP * UNROLL)), "k")
        for u in range(UNROLL):
            k = ix.add(base, str(WARP * u))
            for s, load in enumerate(loads):
                ctx.line(f"{xn[u][s]} = {load(k)}")
            for j, c in enumerate(cols):
                ctx.line(f"{wn[u][j]} = {b_value(k, c)}")
        ctx.line(f"if {it} > 0:")
        with ctx.indent():
            fmas(xc, wc)
