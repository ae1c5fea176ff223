"""TopK's GPU form for long lines: a block of threads per line shares each of the k passes.

The items form (operators/topk.py) selects a line in k passes in one thread: O(k n) sequential,
475 ms of a 588 ms frame for the LiDAR detector's TopK over one line of 80,000 heatmap scores (k = 64,
benchmarks/NOTES.md, "TopK over a long line"). Here each pass is a scan and a reduction:

- every thread scans its strided share of the line (elements thread, thread + T, ...: a warp's loads
  are one contiguous run) for its best element after the previous pick, in the order of topk.Order
  (value, then the lower index; NaN as the module docstring says);
- a tree over shared memory (log2 T levels, a barrier each) takes the best of the T candidates,
  equal values by the lower index; the last level writes the winner into cells of its own, so that
  the next pass's candidates never overwrite it while a slower warp still reads it;
- every thread takes the winner as the previous pick, and thread 0 stores it.

CUDA only, as every blocks stage (the schedule asks `block_tiling` only there): the CPU backend keeps
the item per line. A line shorter than MIN_LENGTH keeps the items form too: TopK's short lines come in
numbers (a router's top 2 of 8-256 experts per token), a thread each fills the GPU; its long lines
come few (detection heads over thousands of anchors or positions), where one thread a line leaves
the GPU idle. At MIN_LENGTH a line's block is one warp of 32 elements a thread.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix

from .common import convert
from .reduce import line_start

MIN_LENGTH = 1024
WARP = 32
MAX_THREADS = 1024
# a thread's share of a line, at least: fewer threads for shorter lines (the reduction's levels
# cost barriers; 80,000 elements take 1,024 threads of 79)
PER_THREAD = 32


@dataclass(frozen=True)
class LineTiling:
    """`lines` lines (per sample) of `length` elements, a block of `threads` each."""

    lines: int
    length: int
    threads: int

    @property
    def blocks(self) -> int:
        """Blocks per sample."""
        return self.lines

    @property
    def steps(self) -> int:
        """Strided steps a thread takes along its line."""
        return -(-self.length // self.threads)

    def describe(self) -> str:
        return f"a block of {self.threads} threads per line of {self.length}, each pass reduced through shared memory"


def choose(lines: int, length: int) -> LineTiling | None:
    """Return the block-per-line tiling, or None (keep the items form)."""
    if lines <= 0 or length < MIN_LENGTH:
        return None
    threads = 1 << int(np.log2(max(length // PER_THREAD, 1)))
    return LineTiling(lines, length, min(MAX_THREADS, max(WARP, threads)))


def emit(ctx, op, tiling: LineTiling, item: str, thread: str) -> None:
    """Emit thread `thread` of block `item` (a line) of TopK `op` (operators/topk.py)."""
    from .topk import Order

    x, vals, idx = op.input(0), op.output(0), op.output(1)
    shape, axis = op.lines()
    outer, n, stride = (int(np.prod(s, dtype=np.int64)) for s in (shape[:axis], shape[axis], shape[axis + 1:]))
    T, order = tiling.threads, Order(x.dtype.is_float, op.largest)
    o = ctx.let(ix.div(item, stride), "o") if outer > 1 else "0"
    r = ctx.let(ix.mod(item, stride), "r") if stride > 1 else "0"
    base, out_base = line_start(o, r, n, stride), line_start(o, r, op.kk, stride)
    sv, si = ctx.shared_array(x.dtype.dsl, T, "shv"), ctx.shared_array("int", T, "shi")
    wv, wi = ctx.shared_array(x.dtype.dsl, 1, "winv"), ctx.shared_array("int", 1, "wini")
    pv, pi, bv, bi, v, j, s, t = (ctx.fresh(p) for p in ("pv", "pi", "bv", "bi", "x", "j", "s", "t"))
    h, lvl, mv, mi, ov, oi = (ctx.fresh(p) for p in ("h", "lvl", "mv", "mi", "ov", "oi"))

    def take(into_v: str, into_i: str, keep: bool) -> list[str]:
        """Lines storing the better of candidates (mv, mi) and (ov, oi) into shared cells into_v/into_i
        (keep: (mv, mi) are there already)."""
        lines = [f"if {oi} >= 0 and ({mi} < 0 or {order.better(ov, mv)} or ({order.same(ov, mv)} and {oi} < {mi})):",
                 f"    {into_v} = {ov}", f"    {into_i} = {oi}"]
        return lines if keep else lines + ["else:", f"    {into_v} = {mv}", f"    {into_i} = {mi}"]

    def pair(at: str) -> list[str]:
        return [f"{mv} = {sv}[{at}]", f"{mi} = {si}[{at}]", f"{ov} = {sv}[{at} + {h}]", f"{oi} = {si}[{at} + {h}]"]

    scan = [f"{v} = {x.load(ix.add(base, ix.mul(t, stride)))}",
            f"if {order.after(v, t, pv, pi)}:",
            f"    if {bi} < 0 or {order.better(v, bv)}:",
            f"        {bv} = {v}", f"        {bi} = {t}"]
    if n % T:  # the last step's threads past the end
        scan = [f"if {t} < {n}:"] + ["    " + line for line in scan]
    levels = int(np.log2(T))
    at = ix.add(out_base, ix.mul(j, stride))
    stores = ([vals.store(at, pv)] if vals is not None else []) + \
             ([idx.store(at, convert(pi, dtypes.INT32, idx.dtype))] if idx is not None else [])
    body = [f"{pv} = {x.load(base)}", f"{pi} = -1", f"for {j} in range({op.kk}):",
            f"    {bv} = {x.load(base)}", f"    {bi} = -1",
            f"    for {s} in range({tiling.steps}):", f"        {t} = {s} * {T} + {thread}"]
    body += ["        " + line for line in scan]
    body += [f"    {sv}[{thread}] = {bv}", f"    {si}[{thread}] = {bi}", "    sync_block()",
             f"    {h} = {T // 2}", f"    for {lvl} in range({levels - 1}):", f"        if {thread} < {h}:"]
    body += ["            " + line for line in pair(thread) + take(f"{sv}[{thread}]", f"{si}[{thread}]", True)]
    body += ["        sync_block()", f"        {h} = {h} // 2", f"    if {thread} == 0:"]
    body += ["        " + line for line in pair("0") + take(f"{wv}[0]", f"{wi}[0]", False)]
    body += ["    sync_block()", f"    {pv} = {wv}[0]", f"    {pi} = {wi}[0]", f"    if {thread} == 0:"]
    body += ["        " + line for line in stores]
    ctx.render("nest.py.j2", loops=[], body=body)
