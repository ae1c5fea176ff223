"""Gemm and MatMul layers of one row a sample and few columns on CUDA (a classifier's head over a batch:
cifar-cnn's 2,048 -> 10): a warp a sample, its lanes splitting k, the columns' partial sums combined
across the warp (operators/gemm_blocks.py's `Dense.block_tiling` takes it where tiled.py's tile of samples
declines, N under its MIN_SIDE).

The items form gives such a layer a thread a sample: a dependent chain of K multiply-adds per output,
each lane of a warp loading from its own row (addresses a row apart), and only as many threads as
samples (4,096 for cifar-cnn: a warp or so an SM), so the stage waits on ~K serial loads: 0.57 ms of
cifar-cnn's 1.7 ms on the H200. Here lane l of sample s's warp takes k = l, l + 32, ...: A's loads
are one contiguous run a warp, B is read as [N][K] (the constant's rows transposed once into the
blob: a warp's load of column n is contiguous too), each lane keeps N accumulators over K / 32
steps, and warp_active_sum combines them (shaders/warp.py; rows.py's reductions do the same). A
block holds SAMPLES samples, a warp each (a grouped blocks stage: Operator.block_samples), each read
and written at its own sample (KernelContext.at_sample); a warp past the batch's last sample skips
the whole (warp-uniform) body, so every lane of a live warp reaches the reductions."""
from __future__ import annotations

from dataclasses import dataclass

from luisaml import indexing as ix

WARP = 32
SAMPLES = 4  # a block's samples: 128 threads, as rows.py's ROWS_PER_BLOCK
MAX_COLUMNS = 16  # a lane's accumulators (the FP32 tile takes N from tiled.MIN_SIDE = 16 on)


@dataclass(frozen=True)
class WarpRows:
    """SAMPLES samples a block, a warp a sample, of a 1 x K by K x N product (N <= MAX_COLUMNS)."""

    N: int
    K: int
    warp_rows = True  # (what operators/gemm.py's cpu_items asks)
    rows_b = True  # reads B as [N][K] (operators/gemm_blocks.py's _b_rows)

    @property
    def M(self) -> int:
        """The tile's rows: its samples (Dense.block_samples)."""
        return SAMPLES

    @property
    def threads(self) -> int:
        return WARP * SAMPLES

    @property
    def blocks(self) -> int:
        """Blocks per group of SAMPLES samples."""
        return 1

    def describe(self) -> str:
        return (f"a warp per sample ({SAMPLES} a block of {self.threads} threads), its lanes splitting k = {self.K}, "
                f"{self.N} sums combined across the warp")

    def emit(self, ctx, item: str, thread: str, a_row, b_value, finish_row, store_row) -> None:
        emit(ctx, self, thread, a_row, b_value, finish_row, store_row)  # (one block a group: item is 0)


def choose(N: int, K: int, min_k: int) -> WarpRows | None:
    """Return the warp-a-sample tiling of a sample-row product of N columns and depth K, or None: more
    columns than a lane's accumulators, or K under min_k (a short chain the items form runs as fast;
    0: never)."""
    if not min_k or N > MAX_COLUMNS or N < 1 or K < min_k:
        return None
    return WarpRows(N, K)


def emit(ctx, tl: WarpRows, thread: str, a_row, b_value, finish_row, store_row) -> None:
    """Emit thread `thread` of a block: a_row(bi, m) -> k -> A of the group's sample m (gemm_blocks.py's
    sample-row loaders), b_value(k, n) -> B[k, n], finish_row / store_row(bi, m, n, value) at sample m."""
    from . import tiled

    N, K = tl.N, tl.K
    warp, lane = ctx.let(ix.div(thread, WARP), "wp"), ctx.let(ix.mod(thread, WARP), "ln")
    live = tiled.group_rows(ctx, SAMPLES)
    ctx.line(f"if {warp} < {live}:")
    with ctx.indent():
        load = a_row("0", warp)
        acc = [ctx.fresh("acc") for _ in range(N)]
        for name in acc:
            ctx.line(f"{name} = 0.0")
        step = ctx.fresh("step")
        ctx.line(f"for {step} in range({-(-K // WARP)}):")
        with ctx.indent():
            k = ctx.let(ix.add(lane, ix.mul(step, WARP)), "k")
            guard = K % WARP != 0
            if guard:
                ctx.line(f"if {k} < {K}:")
                ctx.level += 1
            x = ctx.let(load(k), "x")
            for j, name in enumerate(acc):
                ctx.line(f"{name} = fma({x}, {b_value(k, str(j))}, {name})")
            if guard:
                ctx.level -= 1
        total = ctx.use_helper("warp_active_sum", "warp")
        sums = [ctx.let(f"{total}({name})", "w") for name in acc]
        ctx.line(f"if {lane} == 0:")
        with ctx.indent():
            for j, s in enumerate(sums):
                ctx.line(store_row("0", warp, str(j), ctx.let(finish_row("0", warp, str(j), s), "f")))
