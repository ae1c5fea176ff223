"""A warp per row on GPUs: the cooperative form of row reductions (the normalizations, Softmax and
LogSoftmax). The items form gives a row to a thread, so neighbouring threads read addresses a row
apart (512 B for the transformer's d = 128) and a warp's load touches 32 cache lines; here the 32
lanes of a warp share a row, lane l taking its elements l, l + 32, ..., so a warp's load is one
contiguous run, and each lane's partial sum (or maximum) is combined across the warp
(warp_active_sum / warp_active_max) before the next pass. A block holds ROWS_PER_BLOCK rows, a warp
each; a row's warp is whole (the row guard is uniform across it), and every lane runs the same
number of strided steps (a ragged end is a guard inside the step), so all 32 lanes reach each warp
reduction together.

The global pools (operators/pool.py) take the same form for their rows, a channel's spatial block
each (`choose_reduction`): a squeeze-and-excitation block's squeeze reduces few rows of many
elements (EfficientNet-B0's first: 32 channels of 112 x 112), where one thread a row left 1.7 ms
of an H200's 13.6 ms on serial loads. A row of BLOCK_LENGTH or more takes a block of BLOCK_WARPS
warps instead of one (`RowTiling.warps`), their partials combined through shared memory. The
reductions (operators/reduce.py, Fold.block_tiling) take the same form, through the same
`fold_row`, for an output whose reduced elements are one contiguous run: timm's squeeze, ReduceMean
over H, W.

CUDA only, as every blocks stage (the schedule asks `block_tiling` only there): the CPU backend
has no warps worth the name and keeps the thread per row."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from luisaml import indexing as ix

WARP = 32
ROWS_PER_BLOCK = 4  # 128 threads a block
# a row shorter than this leaves most of a warp's lanes idle: it keeps the thread per row
MIN_LENGTH = 16
# a reduction's row this long or longer takes a block of BLOCK_WARPS warps (choose_reduction): at
# 1,024 each of its 256 threads still folds 4 or more elements before the combine, and such rows
# come few (a squeeze's channels x batch: 1,024 rows of 12,544 for EfficientNet-B0's first at
# batch 32, 1,024 warps where an H100/H200 keeps ~8,400 resident), so a warp a row leaves most of
# the GPU's load slots empty; 8 warps a row fill 8 times as many
BLOCK_LENGTH = 1024
BLOCK_WARPS = 8


@dataclass(frozen=True)
class RowTiling:
    """rows rows (per sample) of `length` elements, a warp each (warps = 1: ROWS_PER_BLOCK rows a
    block), or a block of `warps` warps each."""

    rows: int
    length: int
    warps: int = 1

    @property
    def rows_per_block(self) -> int:
        return ROWS_PER_BLOCK if self.warps == 1 else 1

    @property
    def width(self) -> int:
        """Threads that share a row."""
        return WARP * self.warps

    @property
    def threads(self) -> int:
        return self.rows_per_block * self.width

    @property
    def blocks(self) -> int:
        """Blocks per sample."""
        return -(-self.rows // self.rows_per_block)

    @property
    def steps(self) -> int:
        """Strided steps a lane takes along a row."""
        return -(-self.length // self.width)

    def describe(self) -> str:
        if self.warps > 1:
            return (f"a block of {self.threads} threads ({self.warps} warps) per row of {self.length}, "
                    f"their partials combined through shared memory")
        return f"a warp per row of {self.length}, {ROWS_PER_BLOCK} rows a block of {self.threads} threads"


def choose(rows: int, length: int) -> RowTiling | None:
    """Return the warp-per-row tiling of `rows` rows of `length` elements, or None (keep the items form)."""
    if rows <= 0 or length < MIN_LENGTH:
        return None
    return RowTiling(rows, length)


def choose_reduction(rows: int, length: int) -> RowTiling | None:
    """Return the tiling of `rows` rows of `length` elements that reduce to one value each (the
    global pools): none under MIN_LENGTH, a block of BLOCK_WARPS warps a row from BLOCK_LENGTH, a
    warp a row between."""
    tiling = choose(rows, length)
    if tiling is not None and length >= BLOCK_LENGTH:
        return RowTiling(rows, length, BLOCK_WARPS)
    return tiling


def begin(ctx, tiling: RowTiling, item: str, thread: str) -> tuple[str, str]:
    """Emit the row and lane of thread `thread` of block `item`; return (row, lane). The row's code
    goes under row_guard. With a block a row, the row is the block and the lane the thread."""
    if tiling.warps > 1:
        return item, thread
    row = ctx.let(f"{item} * {ROWS_PER_BLOCK} + {thread} // {WARP}", "row")
    lane = ctx.let(f"{thread} % {WARP}", "lane")
    return row, lane


@contextlib.contextmanager
def row_guard(ctx, tiling: RowTiling, row: str) -> Iterator[None]:
    """Emit the row's code (the block) under `if row < rows:` when the last block holds rows past the
    last (the condition is uniform across a warp), else as it is."""
    if tiling.rows % tiling.rows_per_block == 0:
        yield
        return
    ctx.line(f"if {row} < {tiling.rows}:")
    with ctx.indent():
        yield


def warp_loop(ctx, tiling: RowTiling, lane: str) -> dict:
    """Return the `warp` value of shaders/norm.py.j2 and softmax.py.j2: how a lane walks its row
    (lane + width * step, a guard where the length is ragged) and the names of the warp reductions,
    imported into the module."""
    return {"lane": lane, "width": tiling.width, "step": ctx.fresh("step"), "steps": tiling.steps,
            "ragged": tiling.length % tiling.width != 0, "sum": ctx.use_helper("warp_active_sum", "warp"),
            "max": ctx.use_helper("warp_active_max", "warp")}


def combine(ctx, tiling: RowTiling, thread: str, value: str, kind: str, merge) -> str:
    """Emit the combine of every lane's partial `value` of a row (kind "sum", "max" or "min"); return
    the row's result, the same in every lane. The max and min are numpy's: NaN when any lane's partial
    is, which a warp's max need not say (a float max such as CUDA's fmaxf drops a NaN), so a warp also
    asks whether any lane holds one. With a block a row, lane 0 of each warp leaves its warp's result in shared memory, and after
    the barrier every thread merges them in warp order (merge(a, b): the pool's own two-value merge).
    Every thread of the row must reach it (no lane guarded off)."""
    if kind == "sum":
        v = ctx.let(f"{ctx.use_helper('warp_active_sum', 'warp')}({value})", "w")
    else:
        nan = ctx.let(f"{ctx.use_helper('warp_active_any', 'warp')}(isnan({value}))", "nan")
        m = ctx.let(f"{ctx.use_helper(f'warp_active_{kind}', 'warp')}({value})", "w")
        v = ctx.let(f"(quiet_nan() if {nan} else {m})", "w")  # not NAN: CUDA codegen aborts on a NaN literal (storage.literal)
    if tiling.warps == 1:
        return v
    part = ctx.shared_array("float", tiling.warps, "part")
    ctx.line(f"if {thread} % {WARP} == 0:")
    with ctx.indent():
        ctx.line(f"{part}[{thread} // {WARP}] = {v}")
    ctx.line("sync_block()")
    total = f"{part}[0]"
    for w in range(1, tiling.warps):
        total = ctx.let(merge(total, f"{part}[{w}]"), "w")
    return total


def fold_row(ctx, tiling: RowTiling, item: str, thread: str, place, load, init: str, step, merge, kind: str,
             finish, bind: bool = False) -> None:
    """Emit the fold of one row of `tiling` to one value (a global pool's channel, a reduction's
    output over a contiguous run): place(row) emits the row's first index and returns it with
    store(value), the line that stores its result; lane l folds the row's elements l, l + width, ...
    (load(index): one element in the accumulator's dtype; step(acc, x) from `init`, the identity of
    the fold, so a lane past a short row's end adds nothing), a guard inside the step where the
    row is ragged; the lanes' partials are combined (`combine`, by `kind` and merge(a, b)) and lane 0
    stores finish(result) (through the stage's epilogue, if any). bind: the element is loaded into a
    variable first (a step that names it twice, ReduceSumSquare's x * x, then loads it once)."""
    row, lane = begin(ctx, tiling, item, thread)
    with row_guard(ctx, tiling, row):
        start, store = place(row)
        acc, r = ctx.fresh("acc"), ctx.fresh("r")
        walk = warp_loop(ctx, tiling, lane)
        ctx.line(f"{acc} = {init}")
        ctx.line(f"for {walk['step']} in range({walk['steps']}):")
        with ctx.indent():
            ctx.line(f"{r} = {lane} + {walk['width']} * {walk['step']}")
            guard = f"{r} < {tiling.length}" if walk["ragged"] else None
            if bind:
                v = ctx.fresh("x")
                ctx.line_if(guard, f"{v} = {load(ix.add(start, r))}; {acc} = {step(acc, v)}")
            else:
                ctx.line_if(guard, f"{acc} = {step(acc, load(ix.add(start, r)))}")
        total = combine(ctx, tiling, thread, acc, kind, merge)
        ctx.line(f"if {lane} == 0:")
        with ctx.indent():
            ctx.line(store(finish(total)))


# ---- rows read across (luisaml/across.py) ---------------------------------------------------------
# A normalization whose input is contiguous along its rows rather than within them (ConvNeXt's
# LayerNorm of a permuted NCHW tensor: a row's elements H x W floats apart, neighbouring rows
# neighbours): a block of ACROSS_WARPS warps takes `tile` rows, their elements loaded into shared
# memory with lanes along the rows, a warp's load `tile` consecutive floats of each of 32 // tile
# rows' elements (one 32-byte sector a run at tile 8), then each warp normalizes tile / ACROSS_WARPS
# rows from shared memory as the warp per row does from global memory. The tile is the most rows
# (up to 32) whose elements fit ACROSS_SHARED bytes: 32 for 96 or 192 channels, 16 for 384, 8 for 768.
ACROSS_WARPS = 8
ACROSS_SHARED = 32 * 1024


@dataclass(frozen=True)
class AcrossTiling:
    """rows rows (per sample) of `length` elements, `tile` rows a block of ACROSS_WARPS warps."""

    rows: int
    length: int
    tile: int

    threads = ACROSS_WARPS * WARP

    @property
    def blocks(self) -> int:
        return -(-self.rows // self.tile)

    @property
    def pitch(self) -> int:
        """A row's place in shared memory: its length, made odd (lanes a row apart hit other banks)."""
        return self.length | 1

    def describe(self) -> str:
        return (f"a block of {self.threads} threads per {self.tile} rows of {self.length}, loaded along the rows "
                f"into shared memory, then a warp per row")


def choose_across(rows: int, length: int) -> AcrossTiling | None:
    """Return the across tiling of `rows` rows of `length` elements, or None (a short row keeps the
    thread per row; a long one, whose ACROSS_WARPS rows do not fit ACROSS_SHARED, its warp per row)."""
    if rows <= 0 or length < MIN_LENGTH:
        return None
    for tile in (32, 16, ACROSS_WARPS):
        if tile * (length | 1) * 4 <= ACROSS_SHARED:
            return AcrossTiling(rows, length, tile)
    return None


@contextlib.contextmanager
def across_rows(ctx, tiling: AcrossTiling, item: str, thread: str, load) -> Iterator[tuple[str, str, str, str]]:
    """Emit the load of block `item`'s rows into shared memory (load(i): element i of the input, at
    row * length + k), a barrier, then a loop over the rows of thread `thread`'s warp under the row
    guard; yield (the shared array, the row, the lane, the offset that maps an input index
    row * length + k of that row to its place in the shared array)."""
    t, n, pitch = tiling.tile, tiling.length, tiling.pitch
    sh = ctx.shared_array("float", t * pitch, "rows")
    row0 = ctx.let(f"{item} * {t}", "row0")
    cells, q = t * n, ctx.fresh("q")
    ctx.line(f"for {q} in range({-(-cells // tiling.threads)}):")
    with ctx.indent():
        c = ctx.let(f"{thread} + {tiling.threads} * {q}", "c")
        p, k = ctx.let(f"{c} % {t}", "p"), ctx.let(f"{c} // {t}", "k")
        guard = [f"{c} < {cells}"] * (cells % tiling.threads != 0) + [f"{row0} + {p} < {tiling.rows}"] * (tiling.rows % t != 0)
        # (an Affine index: the permuting reader's divisions by the row length and the rows fold)
        at = ix.add(ix.mul(ix.Affine.atom(item, tiling.blocks), t * n), ix.mul(ix.Affine.atom(p, t), n), ix.Affine.atom(k, n))
        ctx.line_if(" and ".join(guard) or None, f"{sh}[{p} * {pitch} + {k}] = {load(at)}")
    ctx.line("sync_block()")
    lane = ctx.let(f"{thread} % {WARP}", "lane")
    j = ctx.fresh("j")
    ctx.line(f"for {j} in range({t // ACROSS_WARPS}):")
    with ctx.indent():
        local = ctx.let(f"{thread} // {WARP} + {ACROSS_WARPS} * {j}", "local")
        row = ctx.let(f"{row0} + {local}", "row")
        offset = ctx.let(f"{ix.mul(local, pitch - n)} - {row0} * {n}" if pitch != n else f"0 - {row0} * {n}", "off")
        if tiling.rows % t:
            ctx.line(f"if {row} < {tiling.rows}:")
            with ctx.indent():
                yield sh, row, lane, offset
        else:
            yield sh, row, lane, offset
