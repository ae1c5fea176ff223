"""Operators that move elements: Transpose, Slice, Concat, Split (strided copies over coalesced
loop nests, shaders/copy.py.j2) and Gather (shaders/gather.py.j2)."""
from __future__ import annotations

import numpy as np

from luisaml.operator import _REQUIRED, Operator
from luisaml.registry import register
from luisaml import indexing as ix
from luisaml.storage import constant_storage, row_major_strides

from .common import coalesce, emit_copy, loop_vars


def _prod(dims) -> int:
    return int(np.prod(dims, dtype=np.int64))


def remap(ctx, i: str, shape, base: int, strides) -> str:
    """Return base + sum(coordinate d of flat index i over `shape` * strides[d]): where an output
    element of a copy (transpose, slice, split) reads its input. Runs of dimensions that the
    strides walk as one are merged first (fewer divisions)."""
    sizes, (out_s, in_s) = coalesce(shape, list(row_major_strides(tuple(shape))), list(strides))
    if not sizes:
        return str(base)
    i = ctx.let(i, "i")
    terms = [str(base)] if base else []
    for n, os_, is_ in zip(sizes, out_s, in_s):
        c = ix.div(i, os_)
        if os_ * n < _prod(shape):  # not the outermost run: wrap
            c = ix.mod(c, n)
        terms.append(ix.mul(c, is_))
    return ix.add(*terms)


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
            raise self.mixing(f"perm {self.perm} moves the batch axis of '{x.name}': per-sample execution needs it first")

    inline = True
    inline_cost = 0  # index arithmetic only: cheap to redo wherever it is read

    @property
    def in_order(self) -> bool:  # type: ignore[override]
        """Whether the output's last axis is the input's innermost (unit-stride) one."""
        x = self.input(0)
        return not self.perm or x.strides[self.perm[-1]] == 1

    def axis_map(self, k):
        return list(self.perm) if k == 0 else None

    def forward(self, ctx):
        x, y = self.input(0), self.output()
        src = [x.strides[p] for p in self.perm]
        emit_copy(ctx, y.shape, y.strides, 0, src, 0, x.load, y.store)

    def element(self, ctx, i, k=0):
        x, y = self.input(0), self.output()
        return x.load(remap(ctx, i, y.shape, 0, [x.strides[p] for p in self.perm]))

    # ---- the CPU's tiles: a Transpose stored by a stage of its own ------------------------------
    # An element stage's thread copies ELEMENTS consecutive outputs, which for a permutation that
    # moves the innermost axis are loads a row apart, each behind its own divisions (~5 GB/s alone,
    # ~2 in a network: benchmarks/NOTES.md, "Inlining into multi-read stages"). On the CPU (no_blocks,
    # set by luisaml/compiler.py) such a stored Transpose is an items stage (schedule.py) whose work
    # item copies a TILE x TILE tile of the two axes that swap: its index arithmetic once, then a
    # loop nest of constant trip counts whose inner loop stores along the output's rows (the loads a
    # row apart, in cache across the tile). 3x the element stage's rate; tiles of 8 or 32, the loop
    # order that loads along the input's rows, and a local array between the two orders were slower
    # (benchmarks/NOTES.md, "Transpose tiles on the CPU").
    no_blocks = False
    TILE = 16
    cpu_tiles = True  # an A/B switch
    stored_as_items = True  # (its stage's form where tiling() applies: luisaml/operator.py)

    def tiling(self):
        """Return (coalesced sizes, output strides, input strides, a, b) where the CPU's tiles
        apply, else None: a is the output's unit-stride axis (the last), b the input's; they differ."""
        x, y = self.input(0), self.output()
        if not (self.no_blocks and self.cpu_tiles):
            return None
        sizes, (out_s, in_s) = coalesce(y.shape, y.strides, [x.strides[p] for p in self.perm])
        if len(sizes) < 2 or in_s[-1] == 1:
            return None  # in order: the element stage's run already loads consecutive elements
        return sizes, out_s, in_s, len(sizes) - 1, in_s.index(1)

    def work_items(self):
        t = self.tiling()
        if t is None:
            return None
        sizes, _, _, a, b = t
        return _prod(sizes) // (sizes[a] * sizes[b]) * -(-sizes[a] // self.TILE) * -(-sizes[b] // self.TILE)

    def emit_item(self, ctx, item):
        x, y = self.input(0), self.output()
        sizes, out_s, in_s, a, b = self.tiling()
        ta, tb = min(self.TILE, sizes[a]), min(self.TILE, sizes[b])
        na, nb = -(-sizes[a] // ta), -(-sizes[b] // tb)
        others = _prod(sizes) // (sizes[a] * sizes[b])
        item = ctx.let(item, "item")

        def origin(k: str, n: int, t: int) -> str:
            # a ragged last tile overlaps the one before (stores of the same values): every tile
            # keeps constant trip counts and no guard, as the Conv's overlapping strips do
            return ctx.let(f"min({ix.mul(k, t)}, {n - t})" if n % t else ix.mul(k, t), "o")

        a0 = origin(ix.mod(item, na), sizes[a], ta)
        b0 = origin(ix.mod(ix.div(item, na), nb) if others > 1 else ix.div(item, na), sizes[b], tb)
        src, dst = [ix.mul(a0, in_s[a]), b0], [ix.mul(b0, out_s[b]), a0]
        rest, inner = ix.div(item, na * nb), 1
        for d in reversed([d for d in range(len(sizes)) if d not in (a, b)]):  # (the axes outside the tile)
            c = ix.div(rest, inner)
            c = ix.mod(c, sizes[d]) if inner * sizes[d] < others else c
            src.append(ix.mul(c, in_s[d]))
            dst.append(ix.mul(c, out_s[d]))
            inner *= sizes[d]
        src, dst = ctx.let(ix.add(*src), "src"), ctx.let(ix.add(*dst), "dst")
        with ctx.loop(tb, "q") as q:
            with ctx.loop(ta, "p") as p:
                ctx.line(y.store(ix.add(dst, ix.mul(q, out_s[b]), p), x.load(ix.add(src, ix.mul(p, in_s[a]), q))))

    def describe(self):
        t = self.tiling()
        if t is None:
            return ""
        sizes, _, _, a, b = t
        return f"the CPU's tiles: {min(self.TILE, sizes[b])} x {min(self.TILE, sizes[a])} of the swapped axes a work item"


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

    inline = True
    inline_cost = 0

    @property
    def in_order(self) -> bool:  # type: ignore[override]
        """Whether the last axis is taken with step 1 (or is the only element)."""
        return not self.step or self.step[-1] == 1 or self.output().shape[-1] <= 1

    def forward(self, ctx):
        x, y = self.input(0), self.output()
        if y.numel == 0:
            return
        base = sum(f * s for f, s in zip(self.first, x.strides))
        src = [s * st for s, st in zip(x.strides, self.step)]
        emit_copy(ctx, y.shape, y.strides, 0, src, base, x.load, y.store)

    def element(self, ctx, i, k=0):
        x, y = self.input(0), self.output()
        base = sum(f * s for f, s in zip(self.first, x.strides))
        return x.load(remap(ctx, i, y.shape, base, [s * st for s, st in zip(x.strides, self.step)]))


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

    inline = True
    in_order = True  # each input in place along the axis, its rows whole
    # set on a plan without blocks stages (the CPU backend; luisaml/compiler.py)
    no_blocks = False

    @property
    def inline_cost(self) -> int:  # type: ignore[override]
        """1; on the CPU one more per input: the select chain loads every input at each read, so a
        reader that reads each element many times (a Conv's taps, a GEMM's column blocks) reads a
        materialised copy instead (schedule.CHEAP_FOR_MULTI_READ)."""
        return 2 + len(self.inputs) if self.no_blocks else 1

    def pieces(self):
        """The inputs end to end where the dimensions before the axis are 1 (per sample)."""
        y = self.output()
        if _prod(y.shape[:self.ax]) != 1:
            return None
        out, offset = [], 0
        for k, t in enumerate(self.inputs):
            if t is not None:
                out.append((k, offset * y.strides[self.ax]))
                offset += t.shape[self.ax]
        return out

    def forward(self, ctx):
        y = self.output()
        offset = 0
        for t in (t for t in self.inputs if t is not None):
            if t.numel:
                emit_copy(ctx, t.shape, y.strides, offset * y.strides[self.ax], t.strides, 0, t.load, y.store)
            offset += t.shape[self.ax]

    def element(self, ctx, i, k=0):
        """The input whose range along the axis holds the output coordinate: a chain of selects,
        each branch's index clamped into its input (a select evaluates both sides)."""
        y = self.output()
        i = ctx.let(i, "i")
        inner = _prod(y.shape[self.ax + 1:])
        c = ctx.let(ix.mod(ix.div(i, inner), y.shape[self.ax]), "c")
        outer = ix.div(i, inner * y.shape[self.ax])
        parts, offset = [], 0
        for t in (t for t in self.inputs if t is not None):
            n = t.shape[self.ax]
            if n:
                local = f"clamp({c} - {offset}, 0, {n - 1})" if offset or len(self.inputs) > 1 else c
                src = ix.add(ix.mul(outer, n * inner), ix.mul(local, inner), ix.mod(i, inner) if inner > 1 else "0")
                parts.append((offset + n, t.load(src)))
            offset += n
        value = parts[-1][1]
        for end, load in reversed(parts[:-1]):
            value = f"({load} if {c} < {end} else {value})"
        return value


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

    inline = True
    inline_cost = 0
    in_order = True  # a range of rows along the axis

    def forward(self, ctx):
        x = self.input(0)
        offset = 0
        for t in self.outputs:
            if t.numel:
                emit_copy(ctx, t.shape, t.strides, 0, x.strides, offset * x.strides[self.ax], x.load, t.store)
            offset += t.shape[self.ax]

    def element(self, ctx, i, k=0):
        x = self.input(0)
        offset = sum(t.shape[self.ax] for t in self.outputs[:k])
        return x.load(remap(ctx, i, self.outputs[k].shape, offset * x.strides[self.ax], x.strides))


# ---- Gather ----------------------------------------------------------------------------------


@register("Gather", since=1)
class Gather(Operator):
    """out[a, j, b] = data[a, indices[j], b] along `axis`. Negative indices count from the end.
    Constant indices are checked when compiling; an out-of-range runtime index fails the run (it
    reads the nearest valid element first, so the access stays in bounds), as onnxruntime fails."""

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
        # constant indices make it a pure remap; runtime ones need the range check's statement
        self.inline = self.fixed is not None

    @property
    def in_order(self) -> bool:  # type: ignore[override]
        """Whether whole rows are gathered (an axis before the innermost: ViT's class token), not
        single elements of the innermost axis."""
        x = self.input(0)
        return _prod(x.shape[self.ax + 1:]) > 1

    def element(self, ctx, i, k=0):
        x, idx = self.input(0), self.input(1)
        inner, nidx = _prod(x.shape[self.ax + 1:]), idx.numel
        i = ctx.let(i, "i")
        o, j, r = ix.div(i, nidx * inner), ix.mod(ix.div(i, inner), nidx), ix.mod(i, inner)
        pattern = constant_storage(self.fixed, idx.dtype) if self.fixed is not None else None
        if pattern is not None:
            g = ctx.let(pattern.load(j), "g")
        else:
            g = ctx.let(idx.load(j), "g")
            if self.fixed is None or np.any(np.asarray(idx.value) < 0):
                g = ctx.let(f"({g} + {self.dim} if {g} < 0 else {g})", "g")
            if self.fixed is None:
                flag = index_flag(ctx, self, 1, self.dim)
                if flag:
                    ctx.line(f"if {g} < 0 or {g} >= {self.dim}: {flag}")
                g = ctx.let(f"clamp({g}, 0, {self.dim - 1})", "g")
        return x.load(ix.add(ix.mul(o, self.dim * inner), ix.mul(g, inner), r))

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
            flag=index_flag(ctx, self, 1, self.dim) if clamp else None,
            dim=self.dim,
            dst=ix.add(ix.mul(o, nidx * inner), ix.mul(j, inner), r),
            src=ix.add(ix.mul(o, self.dim * inner), ix.mul(g, inner), r),
            load=x.load,
            store=y.store,
        )


# ---- the second round: GatherElements, GatherND, Compress, ReverseSequence ------------------------


def index_lines(var: str, load: str, dim: int, flag: str | None = None) -> list[str]:
    """Return DSL lines setting `var` to a runtime index into an axis of `dim` elements: negative
    indices count from the end; an out-of-range one runs `flag` (the run then fails naming the
    node, as onnxruntime's does: ctx.flag_error) and is clamped into [0, dim) so the access stays
    inside the buffer."""
    lines = [f"{var} = {load}", f"{var} = ({var} + {dim} if {var} < 0 else {var})"]
    if flag:
        lines.append(f"if {var} < 0 or {var} >= {dim}: {flag}")
    return lines + [f"{var} = clamp({var}, 0, {dim - 1})"]


def index_flag(ctx, op: Operator, k: int, dim: int) -> str | None:
    """Return the statement that flags an index of input k outside [-dim, dim) (ctx.flag_error)."""
    return ctx.flag_error(str(op.error(f"input {k} '{op.input(k).name}' holds an index outside [{-dim}, {dim})")))


def element_nest(ctx, idx, dim: int, flag: str | None = None) -> tuple[list[tuple[str, int]], list[str], str, str, list[str]]:
    """Loops over every element of an index tensor (GatherElements, ScatterElements): return the
    loops (loop variable, extent; extents of 1 are left out), each element's coordinates, its flat
    index, the variable holding its index value (negative ones wrapped by `dim`) and the body lines
    that compute it."""
    loops = [(ctx.fresh("o"), n) for n in idx.shape]
    coords = [v if n > 1 else "0" for v, n in loops]
    i = ix.ravel(coords, idx.strides)
    g = ctx.fresh("g")
    return [(v, n) for v, n in loops if n > 1], coords, i, g, index_lines(g, idx.load(i), dim, flag)


def check_constant_indices(op: Operator, idx, dims) -> None:
    """Raise when a constant index tensor holds an index outside [-dim, dim); `dims` is the axis
    size, or a list of sizes cycled over the last axis (GatherND's index tuples)."""
    if idx.value is None:
        return
    v = np.asarray(idx.value).astype(np.int64)
    d = np.broadcast_to(np.asarray(dims, dtype=np.int64), v.shape) if np.ndim(dims) else np.int64(dims)
    bad = (v < -d) | (v >= d)
    if bad.any():
        k = tuple(int(a) for a in np.argwhere(bad)[0])
        dim = int(np.broadcast_to(d, v.shape)[k])
        raise op.error(f"input 1 '{idx.name}': index {int(v[k])} at {list(k)} is out of range for an axis of size {dim}")


@register("GatherElements", since=11)
class GatherElements(Operator):
    """out[i] = data[i with its `axis` coordinate replaced by indices[i]] (out has the shape of
    indices). Runtime indices wrap when negative and are clamped into range."""

    def check(self):
        x, idx, y = self.input(0), self.input(1), self.output()
        self.expect_dtype(idx, ("int",), "input 1 (indices)")
        self.expect(idx.rank == x.rank, f"indices '{idx.name}' has rank {idx.rank}, data '{x.name}' {x.rank}")
        self.ax = self.axis(self.attr("axis", 0), x.rank, batched=x.batched)
        self.expect(tuple(y.shape) == tuple(idx.shape), f"output shape {list(y.shape)} is not the indices' {list(idx.shape)}")
        for d in range(x.rank):
            self.expect(d == self.ax or idx.shape[d] <= x.shape[d],
                        f"indices '{idx.name}' {list(idx.shape)} is larger than data {list(x.shape)} on axis {d}")
        self.expect(x.shape[self.ax] > 0 or y.numel == 0, f"axis {self.ax} of '{x.name}' is empty")
        check_constant_indices(self, idx, x.shape[self.ax])

    def forward(self, ctx):
        x, idx, y = self.input(0), self.input(1), self.output()
        if y.numel == 0:
            return
        loops, coords, i, g, body = element_nest(ctx, idx, x.shape[self.ax], index_flag(ctx, self, 1, x.shape[self.ax]))
        src = ix.ravel([g if d == self.ax else c for d, c in enumerate(coords)], x.strides)
        body.append(y.store(i, x.load(src)))
        ctx.render("nest.py.j2", loops=loops, body=body)

    def element(self, ctx, i, k=0):
        x, idx = self.input(0), self.input(1)
        i = ctx.let(i, "i")
        coords = [ctx.let(c, "c") for c in ix.unravel(i, tuple(idx.shape))]
        g = ctx.fresh("g")
        for line in index_lines(g, idx.load(i), x.shape[self.ax], index_flag(ctx, self, 1, x.shape[self.ax])):
            ctx.line(line)
        return x.load(ix.ravel([g if d == self.ax else c for d, c in enumerate(coords)], x.strides))


@register("GatherND", since=11)
class GatherND(Operator):
    """Gather slices of data by index tuples (the last axis of indices), the first batch_dims axes
    shared between data and indices (opset 12 on). Runtime indices wrap and are clamped."""

    def check(self):
        x, idx, y = self.input(0), self.input(1), self.output()
        self.expect_dtype(idx, ("int",), "input 1 (indices)")
        self.b = int(self.attr("batch_dims", 0))
        self.expect(idx.rank >= 1, f"indices '{idx.name}' must have rank >= 1")
        self.m = idx.shape[-1]
        self.expect(0 <= self.b < min(x.rank, idx.rank), f"batch_dims {self.b} must be below the ranks of data and indices")
        self.expect(self.b + self.m <= x.rank, f"index tuples of {self.m} values reach past the rank {x.rank} of '{x.name}'")
        self.expect(tuple(idx.shape[: self.b]) == tuple(x.shape[: self.b]),
                    f"the batch axes of indices {list(idx.shape[:self.b])} differ from data's {list(x.shape[:self.b])}")
        want = list(idx.shape[:-1]) + list(x.shape[self.b + self.m:])
        self.expect(y.numel == int(np.prod(want, dtype=np.int64)), f"output {list(y.shape)} is not {want}")
        if x.batched and self.b == 0 and self.m > 0:
            self.axis(0, x.rank, batched=True, what="indexed axis")
        check_constant_indices(self, idx, list(x.shape[self.b: self.b + self.m]))

    def forward(self, ctx):
        x, idx, y = self.input(0), self.input(1), self.output()
        if y.numel == 0:
            return
        count = int(np.prod(idx.shape[:-1], dtype=np.int64))  # index tuples
        per_batch = int(np.prod(idx.shape[self.b:-1], dtype=np.int64))  # tuples per batch entry
        inner = int(np.prod(x.shape[self.b + self.m:], dtype=np.int64))
        batch_stride = int(np.prod(x.shape[self.b:], dtype=np.int64))
        j, r = ctx.fresh("j") if count > 1 else "0", ctx.fresh("r") if inner > 1 else "0"
        terms, body = [ix.mul(ix.div(j, per_batch), batch_stride)], []
        for k in range(self.m):
            g = ctx.fresh("g")
            dim = x.shape[self.b + k]
            body += index_lines(g, idx.load(ix.add(ix.mul(j, self.m), str(k))), dim, index_flag(ctx, self, 1, dim))
            terms.append(ix.mul(g, x.strides[self.b + k]))
        base = ctx.fresh("base")
        body.append(f"{base} = {ix.add(*terms)}")
        store = y.store(ix.add(ix.mul(j, inner), r), x.load(ix.add(base, r)))
        body += ([f"for {r} in range({inner}):", "    " + store] if inner > 1 else [store])
        ctx.render("nest.py.j2", loops=[(j, count)] if count > 1 else [], body=body)

    def element(self, ctx, i, k=0):
        x, idx = self.input(0), self.input(1)
        per_batch = _prod(idx.shape[self.b:-1])
        inner = _prod(x.shape[self.b + self.m:])
        batch_stride = _prod(x.shape[self.b:])
        i = ctx.let(i, "i")
        j, r = ctx.let(ix.div(i, inner), "j"), ix.mod(i, inner)
        terms = [ix.mul(ix.div(j, per_batch), batch_stride)]
        for k_ in range(self.m):
            g, dim = ctx.fresh("g"), x.shape[self.b + k_]
            for line in index_lines(g, idx.load(ix.add(ix.mul(j, self.m), str(k_))), dim, index_flag(ctx, self, 1, dim)):
                ctx.line(line)
            terms.append(ix.mul(g, x.strides[self.b + k_]))
        return x.load(ix.add(*terms, r))


@register("Compress", since=9)
class Compress(Operator):
    """The slices along `axis` (or elements of the flattened input) where a constant condition is
    true: the output's size depends on the condition, so it must be known when compiling."""

    @classmethod
    def infer(cls, node, inputs):
        """Return the output's type and shape when the condition is a constant (onnx leaves the
        kept axis unknown)."""
        x, cond = inputs[0], inputs[1] if len(inputs) > 1 else None
        if x is None or cond is None or cond.value is None or x.shape is None:
            return None
        kept = int(np.count_nonzero(np.asarray(cond.value).reshape(-1)))
        axis = node.attrs.get("axis")
        if axis is None:
            return [(x.elem_type, (kept,))]
        shape = list(x.shape)
        shape[int(axis) % len(shape)] = kept
        return [(x.elem_type, tuple(shape))]

    def check(self):
        x, y = self.input(0), self.output()
        cond = np.asarray(self.const(1, "condition")).reshape(-1).astype(bool)
        axis = self.attr("axis", None)
        self.ax = None if axis is None else self.axis(axis, x.rank, batched=x.batched)
        n = x.numel if self.ax is None else x.shape[self.ax]
        self.expect(cond.size <= n, f"condition has {cond.size} values for {n} slices")
        self.keep = [int(k) for k in np.flatnonzero(cond)]
        want = len(self.keep) if self.ax is None else len(self.keep) * (x.numel // max(n, 1))
        self.expect(y.numel == want, f"output '{y.name}' {list(y.shape)} does not hold the {want} kept elements")

    def forward(self, ctx):
        x, y = self.input(0), self.output()
        if y.numel == 0:
            return
        shape = (x.numel,) if self.ax is None else x.shape
        ax = 0 if self.ax is None else self.ax
        outer, inner = int(np.prod(shape[:ax], dtype=np.int64)), int(np.prod(shape[ax + 1:], dtype=np.int64))
        kept = len(self.keep)
        # one strided copy per run of consecutive kept slices
        start = 0
        while start < kept:
            end = start
            while end + 1 < kept and self.keep[end + 1] == self.keep[end] + 1:
                end += 1
            run = end - start + 1
            emit_copy(ctx, [outer, run * inner], [kept * inner, 1], start * inner,
                      [shape[ax] * inner, 1], self.keep[start] * inner, x.load, y.store)
            start = end + 1


@register("ReverseSequence", since=10)
class ReverseSequence(Operator):
    """Reverse the first sequence_lens[b] elements along time_axis of each batch entry b
    (batch_axis); the rest is copied. Runtime lengths are clamped into [0, T]."""

    def check(self):
        x, lens = self.input(0), self.input(1)
        self.expect_dtype(lens, ("int",), "input 1 (sequence_lens)")
        self.tax = self.axis(self.attr("time_axis", 0), x.rank, batched=x.batched, what="time_axis")
        self.bax = self.axis(self.attr("batch_axis", 1), x.rank, what="batch_axis")
        self.expect(self.tax != self.bax, "time_axis and batch_axis are the same axis")
        self.expect(x.rank >= 2, f"input '{x.name}' has rank {x.rank}, expected at least 2")
        self.expect(lens.numel == x.shape[self.bax],
                    f"sequence_lens has {lens.numel} values for {x.shape[self.bax]} batch entries")
        if x.batched and self.bax == 0 and not lens.batched:
            raise self.mixing(f"batch_axis 0 is the batch axis, but sequence_lens '{lens.name}' is shared by every sample")
        if lens.value is not None:
            v = np.asarray(lens.value).reshape(-1)
            self.expect(bool(np.all((v >= 0) & (v <= x.shape[self.tax]))),
                        f"sequence_lens {v.tolist()} must lie in [0, {x.shape[self.tax]}]")

    def forward(self, ctx):
        x, lens, y = self.input(0), self.input(1), self.output()
        if y.numel == 0:
            return
        loops = [(ctx.fresh("o"), n) for n in x.shape]
        coords = [v if n > 1 else "0" for v, n in loops]
        T = x.shape[self.tax]
        n, t = ctx.fresh("n"), coords[self.tax]
        body = [f"{n} = clamp({lens.load(coords[self.bax])}, 0, {T})"]
        s = ctx.fresh("s")
        body.append(f"{s} = ({n} - 1 - {t} if {t} < {n} else {t})")
        src = ix.ravel([s if d == self.tax else c for d, c in enumerate(coords)], x.strides)
        body.append(y.store(ix.ravel(coords, y.strides), x.load(src)))
        ctx.render("nest.py.j2", loops=[(v, k) for v, k in loops if k > 1], body=body)
