"""A warp per row on GPUs: the cooperative form of row reductions (the normalizations, Softmax and
LogSoftmax). The items form gives a row to a thread, so neighbouring threads read addresses a row
apart (512 B for the transformer's d = 128) and a warp's load touches 32 cache lines; here the 32
lanes of a warp share a row, lane l taking its elements l, l + 32, ..., so a warp's load is one
contiguous run, and each lane's partial sum (or maximum) is combined across the warp
(warp_active_sum / warp_active_max) before the next pass. A block holds ROWS_PER_BLOCK rows, a warp
each; a row's warp is whole (the row guard is uniform across it), and every lane runs the same
number of strided steps (a ragged end is a guard inside the step), so all 32 lanes reach each warp
reduction together.

CUDA only, as every blocks stage (the schedule asks `block_tiling` only there): the CPU backend
has no warps worth the name and keeps the thread per row."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

WARP = 32
ROWS_PER_BLOCK = 4  # 128 threads a block
# a row shorter than this leaves most of a warp's lanes idle: it keeps the thread per row
MIN_LENGTH = 16


@dataclass(frozen=True)
class RowTiling:
    """rows rows (per sample) of `length` elements, a warp each."""

    rows: int
    length: int

    @property
    def threads(self) -> int:
        return ROWS_PER_BLOCK * WARP

    @property
    def blocks(self) -> int:
        """Blocks per sample."""
        return -(-self.rows // ROWS_PER_BLOCK)

    @property
    def steps(self) -> int:
        """Strided steps a lane takes along a row."""
        return -(-self.length // WARP)

    def describe(self) -> str:
        return f"a warp per row of {self.length}, {ROWS_PER_BLOCK} rows a block of {self.threads} threads"


def choose(rows: int, length: int) -> RowTiling | None:
    """Return the warp-per-row tiling of `rows` rows of `length` elements, or None (keep the items form)."""
    if rows <= 0 or length < MIN_LENGTH:
        return None
    return RowTiling(rows, length)


def begin(ctx, tiling: RowTiling, item: str, thread: str) -> tuple[str, str]:
    """Emit the row and lane of thread `thread` of block `item`; return (row, lane). The row's code
    goes under row_guard."""
    row = ctx.let(f"{item} * {ROWS_PER_BLOCK} + {thread} // {WARP}", "row")
    lane = ctx.let(f"{thread} % {WARP}", "lane")
    return row, lane


@contextlib.contextmanager
def row_guard(ctx, tiling: RowTiling, row: str) -> Iterator[None]:
    """Emit the row's code (the block) under `if row < rows:` when the last block holds rows past the
    last (the condition is uniform across a warp), else as it is."""
    if tiling.rows % ROWS_PER_BLOCK == 0:
        yield
        return
    ctx.line(f"if {row} < {tiling.rows}:")
    with ctx.indent():
        yield



def warp_loop(ctx, tiling: RowTiling, lane: str) -> dict:
    """Return the `warp` value of shaders/norm.py.j2 and softmax.py.j2: how a lane walks its row
    (lane + width * step, a guard where the length is ragged) and the names of the warp reductions,
    imported into the module."""
    return {"lane": lane, "width": WARP, "step": ctx.fresh("step"), "steps": tiling.steps,
            "ragged": tiling.length % WARP != 0, "sum": ctx.use_helper("warp_active_sum", "warp"),
            "max": ctx.use_helper("warp_active_max", "warp")}
