"""TopK: the k largest (or smallest) elements along an axis and their int64 indices, sorted, equal
values in index order (the lower index first, as ONNX says).

Each line is selected in k passes without scratch memory: pass j takes the best element that
comes after pick j-1 in the order (value descending, index ascending) — or value ascending for
the smallest. O(k n) per line, which suits the small k of real models. A stage runs one work
item per line (reduce.Lines); on GPUs a line of at least topk_block.MIN_LENGTH runs as two phases,
chunks of it a warp each over the SMs, then a warp a line merging the chunks' picks
(operators/topk_chunks.py; `long_lines = "block"` or LUISAML_TOPK=block: a block of threads a line
sharing each pass, operators/topk_block.py).

NaN sorts above every number, +inf included, and NaNs among themselves by index (numpy's sort,
and what onnxruntime returns): the first picks of largest=1, the last of largest=0."""
from __future__ import annotations

import os

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.registry import register

from .common import convert
from .reduce import Lines, line_start


class Order:
    """The order of a TopK's picks as DSL conditions: value descending (largest) or ascending, NaN
    above every number, equal values by index."""

    def __init__(self, nan: bool, largest: bool):
        self.nan, self.largest = nan, largest

    def above(self, a: str, b: str) -> str:
        """a comes after b in ascending order, NaN last (comparisons with NaN are all false)."""
        return f"((isnan({a}) and not isnan({b})) or {a} > {b})" if self.nan else f"{a} > {b}"

    def better(self, a: str, b: str) -> str:
        """Value a is picked before value b."""
        return self.above(a, b) if self.largest else self.above(b, a)

    def same(self, a: str, b: str) -> str:
        return f"({a} == {b} or (isnan({a}) and isnan({b})))" if self.nan else f"{a} == {b}"

    def after(self, v: str, t: str, pv: str, pi: str) -> str:
        """Element (v, index t) comes after the previous pick (pv, pi; none while pi < 0)."""
        return f"{pi} < 0 or {self.better(pv, v)} or ({self.same(v, pv)} and {t} > {pi})"


@register("TopK", since=10)
class TopK(Lines):
    """TopK with K as a constant input (opset 10), largest and sorted attributes (opset 11)."""

    # a long line's GPU form: "chunks" (operators/topk_chunks.py) or "block", the block per line
    # before it (operators/topk_block.py); LUISAML_TOPK where set (read at plan time: the A/B switch
    # of benchmarks/experiments/micro_topk.py and bench_detector.py, one process, one form)
    long_lines = "chunks"
    no_blocks = False  # set on the CPU backend's plans (luisaml/compiler.py): the item per line there

    def k(self) -> int:
        k = np.asarray(self.const(1, "K")).reshape(-1)
        self.expect(k.size == 1, f"K must hold one value, it has {k.size}")
        return int(k[0])

    def check(self):
        x, vals, idx = self.input(0), self.output(0), self.output(1)
        self.expect_dtype(x, ("float", "int"), "input 0 (X)")
        self.ax = self.axis(self.attr("axis", -1), x.rank, batched=x.batched)
        self.kk = self.k()
        n = x.shape[self.ax]
        self.expect(0 <= self.kk <= n, f"K = {self.kk} is not in [0, {n}], the length of axis {self.ax}")
        want = list(x.shape)
        want[self.ax] = self.kk
        for t in (vals, idx):
            if t is not None:
                self.expect(tuple(t.shape) == tuple(want), f"output '{t.name}' has shape {list(t.shape)}, expected {want}")
        self.expect(idx is None or idx.dtype is dtypes.INT64, "output 1 (indices) must be int64")
        self.largest = bool(int(self.attr("largest", 1)))

    def empty(self) -> bool:
        return self.kk == 0 or self.input(0).numel == 0

    def block_tiling(self):
        """A block of threads per line of at least topk_block.MIN_LENGTH on GPUs (operators/topk_block.py)."""
        from . import topk_block

        if self.empty():
            return None
        shape, axis = self.lines()
        return topk_block.choose(self.work_items(), shape[axis])

    def chunk_tiling(self):
        """The chunks and merge of lines of at least topk_block.MIN_LENGTH on GPUs (operators/topk_chunks.py)."""
        from . import topk_chunks

        form = os.environ.get("LUISAML_TOPK") or self.long_lines
        if self.no_blocks or form != "chunks" or self.block_tiling() is None:
            return None
        shape, axis = self.lines()
        return topk_chunks.choose(self.work_items(), shape[axis], self.kk, self.input(0).dtype)

    @property
    def phased(self) -> bool:  # (schedule.kind: the chunked form's two phases)
        return self.chunk_tiling() is not None

    def phases(self):
        from . import topk_chunks

        return topk_chunks.phases(self, self.chunk_tiling())

    def scratch(self):
        from . import topk_chunks

        return topk_chunks.scratch(self, self.chunk_tiling())

    def describe(self) -> str:
        tiling = self.chunk_tiling()
        return tiling.describe() if tiling is not None else ""

    def describe_block(self) -> str:  # (inspect's note of a blocks stage's root: the phases are blocks too)
        return self.describe() or super().describe_block()

    def emit_block(self, ctx, item, thread):
        from . import topk_block

        topk_block.emit(ctx, self, self.block_tiling(), item, thread)

    def line(self, ctx, o, r, n, stride):
        x, vals, idx = self.input(0), self.output(0), self.output(1)
        base, out_base = line_start(o, r, n, stride), line_start(o, r, self.kk, stride)
        pv, pi, bv, bi, v, j, t = (ctx.fresh(p) for p in ("pv", "pi", "bv", "bi", "x", "j", "t"))
        order = Order(x.dtype.is_float, self.largest)
        body = [f"{pv} = {x.load(base)}", f"{pi} = -1", f"for {j} in range({self.kk}):",
                f"    {bv} = {x.load(base)}", f"    {bi} = -1",
                f"    for {t} in range({n}):",
                f"        {v} = {x.load(ix.add(base, ix.mul(t, stride)))}",
                f"        if {order.after(v, t, pv, pi)}:",
                f"            if {bi} < 0 or {order.better(v, bv)}:",
                f"                {bv} = {v}",
                f"                {bi} = {t}",
                f"    {pv} = {bv}", f"    {pi} = {bi}"]
        at = ix.add(out_base, ix.mul(j, stride))
        if vals is not None:
            body.append(f"    {vals.store(at, bv)}")
        if idx is not None:
            body.append(f"    {idx.store(at, convert(bi, dtypes.INT32, idx.dtype))}")
        return body


@register("TopK", since=1)
class TopK1(TopK):
    """TopK-1: k as an attribute."""

    def k(self):
        return int(self.attr("k"))
