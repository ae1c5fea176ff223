"""TopK's GPU form for long lines: chunks a warp each, then a warp per line merges their picks.

A line of n elements (the LiDAR detector's 80,000 heatmap scores, k = 64: benchmarks/NOTES.md, "TopK
over a long line: chunks over the SMs") runs as two phases (luisaml/dynamic.py's Phase, the node's
own scratch between them):

1. **chunks**: the line cut into chunks of L = 32 S elements, a block of one warp each (C of them
   a line, spread over the SMs). A lane keeps the best element of its strided share (S elements:
   lane, lane + 32, ...). Each pass two warp reductions pick the warp's best (the highest rank, then
   the lowest index among lanes of that rank), the lane that owns it writes it to scratch and alone
   rescans its share for its best after that pick: the others' candidates still stand, as every
   pick comes from one lane's share. A chunk writes its top min(k, L), in order.
2. **merge**: a warp per line over the C chunks' sorted lists (a lane owns lists lane, lane + 32,
   ...: G of them), each lane's candidate the best of its lists' heads; each pass the same two
   reductions pick the winner, whose lane stores it as output j and steps that list's head.

The union of the chunks' top k holds the line's top k, and both phases pick in topk.Order's order
(value, then the lower index; NaN above every number), so the picks are the items form's.
Values are compared as int ranks made from their bits (dsl_lib.order_key: -0 as +0, every NaN
above +inf; the smallest: -1 - key), so that a warp reduction (one `redux.sync` on sm_80+) selects
them and fast math cannot flush a subnormal to zero. S and G balance the two rescans (S ~ G ~
sqrt(n / 1024): 9 and 9 for 80,000). Neither phase has shared memory; a barrier after each pass's
divergent rescan makes sure the whole warp is back (the warp reductions take the active lanes).

CUDA only (no_blocks), float, half and int (int64 in 32 bits) values; uint32 and lines shorter than
topk_block.MIN_LENGTH keep the block per line or the items form (operators/topk.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.dynamic import Phase
from luisaml.storage import literal

from .common import compute_dtype, convert
from .reduce import line_start

WARP = 32
INT_MIN = -2147483648  # a lane with no candidate (its index is n, above every index)


@dataclass(frozen=True)
class ChunkTiling:
    """`lines` lines (per sample) of `length` elements, k picks; chunks of 32 x `share` elements."""

    lines: int
    length: int
    k: int
    share: int

    @property
    def chunk(self) -> int:
        return WARP * self.share

    @property
    def chunks(self) -> int:
        """C, chunks a line (the last may be short)."""
        return -(-self.length // self.chunk)

    @property
    def lists(self) -> int:
        """G, the chunks' lists a lane of the merge owns."""
        return -(-self.chunks // WARP)

    @property
    def slots(self) -> int:
        """Picks a chunk keeps in scratch: its top min(k, L)."""
        return min(self.k, self.chunk)

    @property
    def words(self) -> int:
        """Scratch words a sample of each kind (values, indices)."""
        return self.lines * self.chunks * self.slots

    def describe(self) -> str:
        return (f"{self.chunks} chunks a line of {self.length}, a warp each keeping its top {self.slots}, "
                f"then a warp a line merging them")


# a lane's share of its chunk, S; None: ~sqrt(n / 1024), the chunks' rescan as long as the merge's
# (a knob for benchmarks/experiments/micro_topk.py --share: the two rescans' costs are guesses)
SHARE: int | None = None


def choose(lines: int, length: int, k: int, dtype) -> ChunkTiling | None:
    """Return the chunked tiling of lines (CUDA), or None (their values have no rank here)."""
    if lines <= 0 or k <= 0 or dtype.dsl not in ("float", "half", "int"):
        return None
    share = SHARE or max(1, int(np.ceil(np.sqrt(length / (WARP * WARP)))))
    return ChunkTiling(lines, length, k, min(share, -(-length // WARP)))


def scratch(op, tiling: ChunkTiling) -> dict[str, int]:
    """The node's scratch a sample: the chunks' picks, values then indices."""
    value = compute_dtype(op.input(0).dtype).dsl
    return {"float": tiling.words, "int": tiling.words} if value == "float" else {"int": 2 * tiling.words}


def phases(op, tiling: ChunkTiling) -> list[Phase]:
    return [Phase(f"chunks: {tiling.chunks} a line of {tiling.chunk}, a warp each", tiling.lines * tiling.chunks,
                  partial(_emit_chunks, op, tiling), threads=WARP),
            Phase(f"merge: a warp a line over the chunks' top {tiling.slots}", tiling.lines,
                  partial(_emit_merge, op, tiling), threads=WARP)]


def _geometry(op, tiling, ctx, line: str):
    """(value dtype, rank of a value expression, scratch loads/stores, line start, outer stride)."""
    x = op.input(0)
    shape, axis = op.lines()
    outer, stride = (int(np.prod(s, dtype=np.int64)) for s in (shape[:axis], shape[axis + 1:]))
    o = ctx.let(ix.div(line, stride), "o") if outer > 1 else "0"
    r = ctx.let(ix.mod(line, stride), "r") if stride > 1 else "0"
    value = compute_dtype(x.dtype)
    if value.is_float:
        key = f"{ctx.use_helper('order_key')}({{}})"
        sv, si, words = "scratch_float", "scratch_int", tiling.words
    else:  # (int64 held in 32 bits: its own order)
        key, sv, si, words = "{}", "scratch_int", "scratch_int", 2 * tiling.words
    rank = (lambda v: key.format(v)) if op.largest else (lambda v: f"(-1 - {key.format(v)})")
    # this sample's picks: values at [0, words), indices after them (ints' in the same buffer)
    first = ctx.let(f"sample * {words}", "sw")
    idx_first = ctx.let(f"{first} + {tiling.words}", "si") if sv == si else first
    return value, rank, (sv, first), (si, idx_first), (o, r, stride)


def _put(ctx, lines: list[str]) -> None:
    for line in lines:
        ctx.line(line)


def _pick(ctx, bq: str, bi: str, none: int) -> tuple[str, str, str]:
    """Emit the warp's pick: (its rank, its index, whether this lane owns it)."""
    m, w, mine = ctx.fresh("m"), ctx.fresh("w"), ctx.fresh("mine")
    top, low = ctx.use_helper("warp_active_max", "warp"), ctx.use_helper("warp_active_min", "warp")
    ctx.line("sync_block()")  # (the lanes a divergent rescan left behind: the reductions take the active ones)
    ctx.line(f"{m} = {top}({bq})")
    ctx.line(f"{w} = {low}(select({none}, {bi}, {bq} == {m}))")
    ctx.line(f"{mine} = {bi} == {w}")
    return m, w, mine


def _emit_chunks(op, tiling: ChunkTiling, ctx, item: str, thread: str) -> None:
    """Emit lane `thread` of block `item` (line item // C, chunk item % C) of phase 1."""
    x, n, C, L, K1 = op.input(0), tiling.length, tiling.chunks, tiling.chunk, tiling.slots
    line, c = (ctx.let(ix.div(item, C), "ln"), ctx.let(ix.mod(item, C), "c")) if C > 1 else (item, "0")
    value, rank, (sv, sv0), (si, si0), (o, r, stride) = _geometry(op, tiling, ctx, line)
    base = line_start(o, r, n, stride)
    c0 = ctx.let(ix.mul(c, L), "c0")
    picks = ctx.let(f"min({K1}, {n} - {c0})", "picks") if n % L else str(K1)
    at = ctx.let(f"({line} * {C} + {c}) * {K1}", "at")  # the chunk's first pick in scratch
    bq, bi, bv, pm, pw, mine0, j, s, t, v, q = (ctx.fresh(p) for p in ("bq", "bi", "bv", "pm", "pw", "scan", "j", "s",
                                                                      "t", "x", "q"))
    # the lane's best after its last pick (pm, pw), rescanned while `scan`; before the first pick
    # (INT_MAX, -1), which every element comes after
    _put(ctx, [f"{bq} = {INT_MIN}", f"{bi} = {n}", f"{bv} = {literal(0, value)}", f"{pm} = {-1 - INT_MIN}", f"{pw} = -1",
               f"{mine0} = True", f"for {j} in range({picks}):"])
    with ctx.indent():
        _put(ctx, [f"if {mine0}:", f"    {bq} = {INT_MIN}", f"    {bi} = {n}", f"    for {s} in range({tiling.share}):",
                   f"        {t} = {c0} + {s} * {WARP} + {thread}"])
        scan = [f"{v} = {convert(x.load(ix.add(base, ix.mul(t, stride))), x.dtype, value)}", f"{q} = {rank(v)}",
                # after the last pick, and (the share walked upwards) above the best so far
                f"if ({q} < {pm} or ({q} == {pm} and {t} > {pw})) and ({bi} == {n} or {q} > {bq}):",
                f"    {bq} = {q}", f"    {bi} = {t}", f"    {bv} = {v}"]
        if n % L:  # the last chunk's lanes past the end
            scan = [f"if {t} < {n}:"] + ["    " + ln for ln in scan]
        _put(ctx, ["        " + ln for ln in scan])
        m, w, mine = _pick(ctx, bq, bi, n)
        _put(ctx, [f"{mine0} = {mine}", f"if {mine}:",
                   f"    {sv}.write({sv0} + {at} + {j}, {bv})", f"    {si}.write({si0} + {at} + {j}, {w})",
                   f"    {pm} = {m}", f"    {pw} = {w}"])


def _emit_merge(op, tiling: ChunkTiling, ctx, item: str, thread: str) -> None:
    """Emit lane `thread` of block `item` (a line) of phase 2."""
    vals, idx = op.output(0), op.output(1)
    n, C, L, K1, G = tiling.length, tiling.chunks, tiling.chunk, tiling.slots, tiling.lists
    value, rank, (sv, sv0), (si, si0), (o, r, stride) = _geometry(op, tiling, ctx, item)
    out_base = line_start(o, r, op.kk, stride)
    lists = ctx.let(f"{sv0} + {item} * {C * K1}", "lists")
    ilists = ctx.let(f"{si0} + {item} * {C * K1}", "ilists") if si0 != sv0 else lists
    head = ctx.local_array("int", G, "head")  # picks taken from each of the lane's lists
    bq, bi, bv, bg, g, c, h, mine0, j, v, t, q = (ctx.fresh(p) for p in ("bq", "bi", "bv", "bg", "g", "c", "h", "scan",
                                                                        "j", "x", "t", "q"))
    _put(ctx, [f"for {g} in range({G}):", f"    {head}[{g}] = 0",
               f"{bq} = {INT_MIN}", f"{bi} = {n}", f"{bv} = {literal(0, value)}", f"{bg} = 0",
               f"{mine0} = True", f"for {j} in range({op.kk}):"])
    with ctx.indent():
        # the best head of the lane's lists: of equal ranks the first list's, whose chunk comes first
        # in the line; a list past the line's chunks has no picks (n - c L <= 0)
        heads = [f"{h} = {head}[{g}]",
                 f"if {h} < " + (f"min({K1}, {n} - {c} * {L}):" if n % L or C % WARP else f"{K1}:"),
                 f"    {v} = {sv}.read({lists} + {c} * {K1} + {h})",
                 f"    {t} = {si}.read({ilists} + {c} * {K1} + {h})",
                 f"    {q} = {rank(v)}",
                 f"    if {bi} == {n} or {q} > {bq}:",
                 f"        {bq} = {q}", f"        {bi} = {t}", f"        {bv} = {v}", f"        {bg} = {g}"]
        _put(ctx, [f"if {mine0}:", f"    {bq} = {INT_MIN}", f"    {bi} = {n}",
                   f"    for {g} in range({G}):", f"        {c} = {g} * {WARP} + {thread}"])
        _put(ctx, ["        " + ln for ln in heads])
        _, w, mine = _pick(ctx, bq, bi, n)
        at = ix.add(out_base, ix.mul(j, stride))
        stores = ([vals.store(at, convert(bv, value, vals.dtype))] if vals is not None else []) + \
                 ([idx.store(at, convert(w, dtypes.INT32, idx.dtype))] if idx is not None else [])
        _put(ctx, [f"{mine0} = {mine}", f"if {mine}:"] + ["    " + ln for ln in stores]
                  + [f"    {head}[{bg}] = {head}[{bg}] + 1"])
