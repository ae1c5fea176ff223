"""Operators that move elements: Transpose, Slice, Concat, Split (strided copies over coalesced
loop nests, shaders/copy.py.j2) and Gather (shaders/gather.py.j2)."""
from __future__ import annotations

import numpy as np

from luisaml.operator import _REQUIRED, Operator
from luisaml.registry import register
from luisaml import indexing as ix
from luisaml.storage import constant_storage

from .common import emit_copy, loop_vars


def _prod(dims) -> int:
    return int(np.prod(dims, dtype=np.int64))


@register("Transpose", since=1)
class Transpose(Operator):
    """Permute the axes (perm, default: reversed)."""

    def check(self):
        x = self.input(0)
        self.perm = [int(p) for p in self.attr("perm", list(range(x.rank))[::-1])]
        self.expect(
            sorted(self.perm) == list(range(x.rank)), f"perm {self.perm} is not a permutation of the {x.rank} axes of '{x.name}'"
        )
        if x.batched and self.perm[0] != 0:
            raise self.error(
                f"perm {self.perm} moves the batch axis of '{x.name}': per-sample execution needs it first "
                "(compile with batch_axis=None)"
            )

    def forward(self, ctx):
        x, y = self.input(0), self.output()
        src = [x.strides[p] for p in self.perm]
        emit_copy(ctx, y.shape, y.strides, 0, src, 0, x.load, y.store)


# ---- Slice -----------------------------------------------------------------------------------


def slice_range(start: int, end: int, step: int, dim: int) -> tuple[int, int]:
    """Return (first index, count) of ONNX Slice along one axis (negatives wrap, then clamp)."""
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        return start, max(0, -(-(end - start) // step))
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return start, max(0, -(-(start - end) // -step))


_FULL_END = 2**31 - 1  # ends at least this large mean "to the end" (torch writes INT64_MAX)


@register("Slice", since=10)
class Slice(Operator):
    """Slice with constant starts/ends/axes/steps inputs (opset 10 on)."""

    def params(self):
        """Return (starts, ends, axes or None, steps or None) as lists of ints."""
        as_list = lambda a: None if a is None else [int(v) for v in np.asarray(a).reshape(-1)]  # noqa: E731
        return (
            as_list(self.const(1, "starts")),
            as_list(self.const(2, "ends")),
            as_list(self.optional_const(3)) if self.has_input(3) else None,
            as_list(self.optional_const(4)) if self.has_input(4) else None,
        )

    def check(self):
        x, y = self.input(0), self.output()
        starts, ends, axes, steps = self.params()
        axes = list(range(len(starts))) if axes is None else axes
        steps = [1] * len(starts) if steps is None else steps
        self.expect(
            len(starts) == len(ends) == len(axes) == len(steps),
            f"starts, ends, axes and steps have lengths {len(starts)}, {len(ends)}, {len(axes)}, {len(steps)}; they must match",
        )
        first = [0] * x.rank
        step = [1] * x.rank
        count = list(x.shape)
        seen = set()
        for s, e, a, st in zip(starts, ends, axes, steps):
            a = self.axis(a, x.rank)
            self.expect(a not in seen, f"axis {a} appears twice in axes")
            seen.add(a)
            self.expect(st != 0, f"step of axis {a} is 0")
            if x.batched and a == 0:
                if s == 0 and st == 1 and e >= _FULL_END:
                    continue  # the whole batch axis: nothing to do per sample
                self.axis(a, x.rank, batched=True)
            first[a], count[a] = slice_range(s, e, st, x.shape[a])
            step[a] = st
        self.expect(
            tuple(count) == tuple(y.shape), f"computed output shape {count} differs from the inferred {list(y.shape)}"
        )
        self.first, self.step = first, step

    def forward(self, ctx):
        x, y = self.input(0), self.output()
        if y.numel == 0:
            return
        base = sum(f * s for f, s in zip(self.first, x.strides))
        src = [s * st for s, st in zip(x.strides, self.step)]
        emit_copy(ctx, y.shape, y.strides, 0, src, base, x.load, y.store)


@register("Slice", since=1)
class SliceAttr(Slice):
    """Slice-1: starts, ends and axes as attributes, step 1."""

    def params(self):
        return [int(v) for v in self.attr("starts")], [int(v) for v in self.attr("ends")], self.attr("axes", None), None


# ---- Concat and Split --------------------------------------------------------------------------


@register("Concat", since=1)
class Concat(Operator):
    """Join the inputs along an axis (axis is required from opset 4; before, it defaults to 1)."""

    def check(self):
        ins = [t for t in self.inputs if t is not None]
        self.expect(len(ins) > 0, "Concat needs at least one input")
        y = self.output()
        rank = y.rank
        self.ax = self.axis(self.attr("axis", 1 if self.opset < 4 else _REQUIRED), rank, batched=y.batched)
        total = 0
        for k, t in enumerate(ins):
            self.expect(t.dtype == y.dtype, f"input {k} '{t.name}' has type {t.dtype.name.lower()}, output {y.dtype.name.lower()}")
            other = [d for i, d in enumerate(t.shape) if i != self.ax]
            want = [d for i, d in enumerate(y.shape) if i != self.ax]
            self.expect(
                t.rank == rank and other == want,
                f"input {k} '{t.name}' has shape {list(t.shape)}, which does not fit {list(y.shape)} outside axis {self.ax}",
            )
            total += t.shape[self.ax]
        self.expect(total == y.shape[self.ax], f"inputs add up to {total} along axis {self.ax}, output has {y.shape[self.ax]}")

    def forward(self, ctx):
        y = self.output()
        offset = 0
        for t in (t for t in self.inputs if t is not None):
            if t.numel:
                emit_copy(ctx, t.shape, y.strides, offset * y.strides[self.ax], t.strides, 0, t.load, y.store)
            offset += t.shape[self.ax]


@register("Split", since=1)
class Split(Operator):
    """Cut input 0 along an axis into the outputs. The output shapes (from the split attribute or
    input, or num_outputs in opset 18, as ONNX shape inference resolved them) give the sizes."""

    def check(self):
        x = self.input(0)
        self.ax = self.axis(self.attr("axis", 0), x.rank, batched=x.batched)
        outs = [t for t in self.outputs if t is not None]
        total = 0
        for t in self.outputs:
            if t is None:
                continue
            other = [d for i, d in enumerate(t.shape) if i != self.ax]
            want = [d for i, d in enumerate(x.shape) if i != self.ax]
            self.expect(t.rank == x.rank and other == want, f"output '{t.name}' has shape {list(t.shape)}, input {list(x.shape)}")
        total = sum(t.shape[self.ax] for t in outs)
        self.expect(
            len(outs) == len(self.outputs) and total == x.shape[self.ax],
            f"the outputs add up to {total} along axis {self.ax}, the input has {x.shape[self.ax]}",
        )

    def forward(self, ctx):
        x = self.input(0)
        offset = 0
        for t in self.outputs:
            if t.numel:
                emit_copy(ctx, t.shape, t.strides, 0, x.strides, offset * x.strides[self.ax], x.load, t.store)
            offset += t.shape[self.ax]


# ---- Gather ----------------------------------------------------------------------------------


@register("Gather", since=1)
class Gather(Operator):
    """out[a, j, b] = data[a, indices[j], b] along `axis`. Negative indices count from the end.
    Constant indices are checked when compiling; an out-of-range runtime index reads the nearest
    valid element (a kernel cannot raise), where onnxruntime would fail."""

    def check(self):
        x, idx, y = self.input(0), self.input(1), self.output()
        self.expect_dtype(idx, ("int",), "input 1 (indices)")
        self.ax = self.axis(self.attr("axis", 0), x.rank, batched=x.batched)
        self.dim = x.shape[self.ax]
        want = x.shape[: self.ax] + idx.shape + x.shape[self.ax + 1 :]
        self.expect(y.numel == _prod(want), f"output '{y.name}' has shape {list(y.shape)}, expected {list(want)}")
        self.fixed = None
        if idx.value is not None:
            v = np.asarray(idx.value).astype(np.int64).reshape(-1)
            bad = v[(v < -self.dim) | (v >= self.dim)]
            self.expect(bad.size == 0, f"index {bad[:1].tolist()} is out of range for axis {self.ax} of size {self.dim}")
            self.fixed = np.where(v < 0, v + self.dim, v).astype(np.int32)
        self.expect(self.dim > 0 or y.numel == 0, f"axis {self.ax} of '{x.name}' is empty")

    def forward(self, ctx):
        x, idx, y = self.input(0), self.input(1), self.output()
        if y.numel == 0:
            return
        outer, inner, nidx = _prod(x.shape[: self.ax]), _prod(x.shape[self.ax + 1 :]), idx.numel
        outer_loops = loop_vars(ctx, [outer] if outer > 1 else [], "o")
        j_loops = loop_vars(ctx, [nidx] if nidx > 1 else [], "j")
        inner_loops = loop_vars(ctx, [inner] if inner > 1 else [], "r")
        o, j, r = (loops[0][0] if loops else "0" for loops in (outer_loops, j_loops, inner_loops))
        # the index: a pattern of the host-normalised constant (a literal for one index), or a load
        pattern = constant_storage(self.fixed, idx.dtype) if self.fixed is not None else None
        if pattern is not None:
            index, wrap, clamp = pattern.load(j), False, False
        else:
            runtime = self.fixed is None
            index, wrap, clamp = idx.load(j), runtime or bool(np.any(np.asarray(idx.value) < 0)), runtime
        g = ctx.fresh("g")
        ctx.render(
            "gather.py.j2",
            outer=outer_loops,
            js=j_loops,
            inner=inner_loops,
            idx=g,
            index=index,
            wrap=wrap,
            clamp=clamp,
            dim=self.dim,
            dst=ix.add(ix.mul(o, nidx * inner), ix.mul(j, inner), r),
            src=ix.add(ix.mul(o, self.dim * inner), ix.mul(g, inner), r),
            load=x.load,
            store=y.store,
        )
