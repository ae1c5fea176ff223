"""Operators that reshape or re-index a tensor: views (Reshape, Flatten, Squeeze, Unsqueeze),
Expand, Shape and Size, Pad and CenterCropPad, Tile, DepthToSpace / SpaceToDepth and Trilu.

Each output element is a pure expression of its index (a remapped load, a select), so all of them
are inline (schedule.py): a stage computes them where it reads them, and forward() is the same
expression over a loop nest (emit_nest / element_at share the value function between the two)."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal, row_major_strides

from .common import bload, emit_copy, emit_map
from .indexing import remap


def emit_nest(ctx, y, value) -> None:
    """Emit y[i] = value(i, coords, let) for every element i of y, over a loop nest of its
    coordinates (shaders/nest.py.j2); let(expr, prefix) binds a variable in the loop body."""
    if y.numel == 0:
        return
    loops = [(ctx.fresh("o"), n) for n in y.shape]
    coords = [v if n > 1 else "0" for v, n in loops]
    body: list[str] = []

    def let(expr: str, prefix: str = "t") -> str:
        if expr.replace("_", "").isalnum():
            return expr
        v = ctx.fresh(prefix)
        body.append(f"{v} = {expr}")
        return v

    i = ix.ravel(coords, y.strides)
    body.append(y.store(i, value(i, coords, let)))  # value() binds its variables first
    ctx.render("nest.py.j2", loops=[(v, n) for v, n in loops if n > 1], body=body)


def element_at(ctx, i: str, shape, value) -> str:
    """Return value(i, coords, let) at flat index i of `shape`: element()'s form of emit_nest
    (ctx.let binds, or in a pure context returns the expression)."""
    i = ctx.let(i, "i")
    return value(i, [ctx.let(c, "c") for c in ix.unravel(i, tuple(shape))], ctx.let)


class View(Operator):
    """Output 0 is input 0 with another shape (ONNX shape inference gives it, for every version);
    it shares storage unless it is a graph output, which gets a copy."""

    view = True
    shape_inputs_ok = True  # the shape input may depend on the batch size: only the output shape is used
    inline = True
    inline_cost = 0  # element i is the input's element i
    in_order = True

    def check(self):
        x, y = self.input(0), self.output()
        self.expect(x.numel == y.numel, f"input '{x.name}' has {x.numel} elements, output '{y.name}' {y.numel}")

    def forward(self, ctx):
        emit_map(ctx, self.output(), [self.input(0)], lambda v: v, broadcast=False)

    def element(self, ctx, i, k=0):
        return self.input(0).load(i)


register("Reshape", since=1)(type("Reshape", (View,), {}))
register("Flatten", since=1)(type("Flatten", (View,), {}))
register("Squeeze", since=1)(type("Squeeze", (View,), {}))
register("Unsqueeze", since=1)(type("Unsqueeze", (View,), {}))


@register("Expand", since=8)
class Expand(Operator):
    """Input 0 broadcast to the output shape (numpy rules; the shape input is only checked)."""

    shape_inputs_ok = True
    inline = True
    in_order = True  # a broadcast: the innermost axis is the input's or repeats one element

    def check(self):
        x, y = self.input(0), self.output()
        try:
            ok = tuple(np.broadcast_shapes(x.shape, y.shape)) == tuple(y.shape)
        except ValueError:
            ok = False
        self.expect(ok, f"input '{x.name}' {list(x.shape)} does not broadcast to the output shape {list(y.shape)}")

    def forward(self, ctx):
        emit_map(ctx, self.output(), [self.input(0)], lambda v: v)

    def element(self, ctx, i, k=0):
        return bload(self.input(0), self.output(), i)


@register("Shape", since=1)
class Shape(Operator):
    """The input's shape (start/end from opset 15) as int64 literals. Shapes are static, so the
    constant folder normally replaces this node; the batch dimension is not known per sample."""

    inline = True
    inline_cost = 0

    def check(self):
        x = self.input(0)
        start, end = int(self.attr("start", 0)), self.attr("end", None)
        r = x.rank
        start = min(max(start + r if start < 0 else start, 0), r)
        end = r if end is None else min(max(int(end) + r if int(end) < 0 else int(end), 0), r)
        self.dims = list(range(start, end))
        if x.batched and 0 in self.dims:
            raise self.mixing(f"the shape of '{x.name}' includes the batch dimension, which a per-sample kernel does "
                              "not know")

    def forward(self, ctx):
        y = self.output()
        for k in range(len(self.dims)):
            ctx.line(y.store(str(k), self.element(ctx, str(k))))

    def element(self, ctx, i, k=0):
        x, y = self.input(0), self.output()
        values = [literal(x.shape[d], y.dtype) for d in self.dims]
        if i.isdigit():
            return values[int(i)]
        v = values[-1] if values else literal(0, y.dtype)
        for j in range(len(values) - 2, -1, -1):
            v = f"({values[j]} if {i} == {j} else {v})"
        return v


# ---- the second round: Pad, CenterCropPad, Tile, DepthToSpace/SpaceToDepth, Trilu, Size -----------


def _const_ints(v) -> list[int]:
    return [int(a) for a in np.asarray(v).reshape(-1)]


def source_coord(o: str, begin: int, n: int, mode: str) -> tuple[str, bool]:
    """Return (the input coordinate that output coordinate `o` of a padded axis reads, whether it
    may fall outside [0, n)): begin elements come before the n input elements (negative: cropped)."""
    s = f"({o} - {begin})" if begin > 0 else f"({o} + {-begin})" if begin < 0 else o
    if mode == "constant":
        return s, True
    if mode == "edge":
        return f"clamp({s}, 0, {n - 1})", False
    if mode == "wrap":
        return f"((({s}) % {n}) + {n}) % {n}", False
    if n == 1:  # reflect of one element: always that element
        return "0", False
    period = 2 * (n - 1)  # reflect repeats every 2 (n - 1) elements, as numpy's reflect pad does
    m = f"(((({s}) % {period}) + {period}) % {period})"
    return f"({m} if {m} < {n} else {period} - {m})", False


def pad_value(x, y, begins: list[int], mode: str, fill: str, coords: list[str], let) -> str:
    """Return the element of y = x padded by begins[d] elements before axis d (negative: cropped),
    the rest after, at output coordinates `coords`; `fill` is the constant mode's value (a DSL
    expression of y's dtype). The load's index is clamped into x: a select evaluates both sides."""
    src, conds = [], []
    for d, (o, b, n) in enumerate(zip(coords, begins, x.shape)):
        e = y.shape[d] - n - b
        if b <= 0 and e <= 0:  # a crop (or nothing): inside the input everywhere
            src.append(ix.mul(ix.add(o, str(-b)), x.strides[d]))
            continue
        # negative pads crop first, then the rest pads what is left (as onnxruntime does)
        crop_b, kept = max(-b, 0), n - max(-b, 0) - max(-e, 0)
        if kept == 0:  # constant mode on an axis with nothing left: all fill
            return fill
        expr, check = source_coord(o, max(b, 0), kept, mode)
        c = let(expr, "c")
        if check:
            conds.append(f"{c} >= 0 and {c} < {kept}")
            c = f"clamp({c}, 0, {kept - 1})"
        src.append(ix.mul(ix.add(c, str(crop_b)), x.strides[d]))
    load = x.load(ix.add(*src))
    return f"({load} if {' and '.join(conds)} else {fill})" if conds else load


@register("Pad", since=11)
class Pad(Operator):
    """Pad with pads (and, from opset 18, axes) as constant inputs and constant_value as an
    optional input (a constant or a runtime scalar). Modes constant, reflect, edge and wrap
    (opset 19); negative pads crop. Reflection and wrapping repeat for pads longer than the axis,
    as numpy.pad (and ONNX's reference) do; onnxruntime rejects those."""

    inline = True
    inline_cost = 2  # the source coordinates, the select
    in_order = True  # shifted, not permuted (reflect's mirrored edges aside)

    def params(self) -> tuple[list[int], list[int] | None, str]:
        """Return (pads, axes or None, mode)."""
        axes = _const_ints(self.const(3, "axes")) if self.has_input(3) else None
        return _const_ints(self.const(1, "pads")), axes, self.attr("mode", "constant")

    def fill(self) -> str:
        """Return the DSL of the constant mode's fill value."""
        y = self.output()
        if self.has_input(2):
            v = self.input(2)
            self.expect(v.numel == 1, f"constant_value '{v.name}' must hold one value, it has shape {list(v.shape)}")
            self.expect(v.dtype == y.dtype, f"constant_value '{v.name}' has type {v.dtype.name.lower()}, data {y.dtype.name.lower()}")
            return v.load("0")
        return literal(0, y.dtype)

    def check(self):
        x, y = self.input(0), self.output()
        pads, axes, self.mode = self.params()
        self.expect(self.mode in ("constant", "reflect", "edge", "wrap"),
                    f"mode {self.mode!r} is not constant, reflect, edge or wrap")
        axes = list(range(x.rank)) if axes is None else [self.axis(a, x.rank, what="axis of axes") for a in axes]
        self.expect(len(pads) == 2 * len(axes), f"pads has {len(pads)} values for {len(axes)} axes, expected {2 * len(axes)}")
        begins, ends = [0] * x.rank, [0] * x.rank
        for k, a in enumerate(axes):
            begins[a], ends[a] = pads[k], pads[len(axes) + k]
        want = [n + b + e for n, b, e in zip(x.shape, begins, ends)]
        self.expect(tuple(want) == tuple(y.shape), f"computed output shape {want} differs from the inferred {list(y.shape)}")
        for d in range(x.rank):
            if begins[d] or ends[d]:
                self.axis(d, x.rank, batched=x.batched, what="padded axis")
            kept = x.shape[d] + min(begins[d], 0) + min(ends[d], 0)
            if self.mode != "constant" and (begins[d] > 0 or ends[d] > 0):
                self.expect(kept > 0, f"{self.mode} padding of axis {d} of '{x.name}', which has no element left")
        self.begins = begins

    def value(self, i, coords, let) -> str:
        fill = self.fill() if self.mode == "constant" else ""
        return pad_value(self.input(0), self.output(), self.begins, self.mode, fill, coords, let)

    def forward(self, ctx):
        emit_nest(ctx, self.output(), self.value)

    def element(self, ctx, i, k=0):
        return element_at(ctx, i, self.output().shape, self.value)


@register("Pad", since=2)
class Pad2(Pad):
    """Pad-2: pads, mode and value as attributes."""

    def params(self):
        return [int(p) for p in self.attr("pads")], None, self.attr("mode", "constant")

    def fill(self):
        return literal(self.attr("value", 0.0), self.output().dtype)


@register("CenterCropPad", since=18)
class CenterCropPad(Pad):
    """Crop or pad (with zeros) each axis of `axes` to the size in `shape`, centred: a crop starts
    at (n - size) // 2, a pad puts (size - n) // 2 elements before."""

    def params(self):
        x = self.input(0)
        shape = _const_ints(self.const(1, "shape"))
        axes = [self.axis(a, x.rank, what="axis of axes") for a in self.attr("axes", list(range(x.rank)))]
        self.expect(len(shape) == len(axes), f"shape has {len(shape)} values for {len(axes)} axes")
        begins, ends = [], []
        for a, size in zip(axes, shape):
            n = x.shape[a]
            b = -((n - size) // 2) if n >= size else (size - n) // 2
            begins.append(b)
            ends.append(size - n - b)
        return begins + ends, axes, "constant"

    def fill(self):
        return literal(0, self.output().dtype)


class Rearrange(Operator):
    """A copy in which output element i reads one input element: layout() gives sizes over which
    i is row-major and the input strides of those sizes (remap, in operators/indexing.py)."""

    inline = True

    def layout(self) -> tuple[list[int], list[int]]:
        """Return (sizes whose row-major index is the output's, the input stride of each)."""
        raise NotImplementedError

    @property
    def in_order(self) -> bool:  # type: ignore[override]
        """Whether the innermost size over one element steps the input by 1 (Tile) or 0, not a row
        (DepthToSpace's blocks)."""
        sizes, src = self.layout()
        inner = [st for n, st in zip(sizes, src) if n > 1]
        return not inner or inner[-1] in (0, 1)

    def forward(self, ctx):
        x, y = self.input(0), self.output()
        if y.numel == 0:
            return
        sizes, src = self.layout()
        emit_copy(ctx, sizes, row_major_strides(tuple(sizes)), 0, src, 0, x.load, y.store)

    def element(self, ctx, i, k=0):
        sizes, src = self.layout()
        return self.input(0).load(remap(ctx, i, sizes, 0, src))


@register("Tile", since=6)
class Tile(Rearrange):
    """Repeat the input along each axis (repeats, a constant input): per axis, the copy index
    (stride 0) then the element."""

    def check(self):
        x, y = self.input(0), self.output()
        self.repeats = _const_ints(self.const(1, "repeats"))
        self.expect(len(self.repeats) == x.rank, f"repeats has {len(self.repeats)} values for rank {x.rank}")
        self.expect(all(r >= 0 for r in self.repeats), f"repeats {self.repeats} has a negative value")
        want = [n * r for n, r in zip(x.shape, self.repeats)]
        self.expect(tuple(want) == tuple(y.shape), f"computed output shape {want} differs from the inferred {list(y.shape)}")
        if x.batched and self.repeats[0] != 1:
            self.axis(0, x.rank, batched=True, what="repeated axis")

    def layout(self):
        x = self.input(0)
        sizes, src = [], []
        for n, r, xs in zip(x.shape, self.repeats, x.strides):
            sizes += [r, n]
            src += [0, xs]
        return sizes, src


class BlockRearrange(Rearrange):
    """DepthToSpace / SpaceToDepth: a permutation of a 6-d view of the input."""

    def check(self):
        x, y = self.input(0), self.output()
        self.expect(x.rank == 4, f"input '{x.name}' has rank {x.rank}, expected 4 (N, C, H, W)")
        self.b = int(self.attr("blocksize"))
        self.mode = self.attr("mode", "DCR")
        self.expect(self.b > 0, f"blocksize {self.b} is not positive")
        self.expect(self.mode in ("DCR", "CRD"), f"mode {self.mode!r} is not DCR or CRD")
        self.expect(y.numel == x.numel, f"output '{y.name}' {list(y.shape)} does not hold the {x.numel} input elements")

    def blocks(self) -> tuple[list[int], list[int]]:
        """Return (the 6-d view of the input, the permutation giving the output's order)."""
        raise NotImplementedError

    def layout(self):
        shape, perm = self.blocks()
        strides = row_major_strides(tuple(shape))
        return [shape[p] for p in perm], [strides[p] for p in perm]


@register("DepthToSpace", since=1)
class DepthToSpace(BlockRearrange):
    """Move blocks of channels into b x b spatial blocks (DCR: depth-column-row, CRD)."""

    def check(self):
        super().check()
        n, c, h, w = self.input(0).shape
        self.expect(c % (self.b * self.b) == 0, f"channels {c} are not a multiple of blocksize^2 = {self.b ** 2}")
        self.expect(tuple(self.output().shape) == (n, c // self.b ** 2, h * self.b, w * self.b),
                    f"output shape {list(self.output().shape)} is not [N, C/b^2, H*b, W*b]")

    def blocks(self):
        n, c, h, w = self.input(0).shape
        b = self.b
        if self.mode == "DCR":
            return [n, b, b, c // (b * b), h, w], [0, 3, 4, 1, 5, 2]
        return [n, c // (b * b), b, b, h, w], [0, 1, 4, 2, 5, 3]


@register("SpaceToDepth", since=1)
class SpaceToDepth(BlockRearrange):
    """Move b x b spatial blocks into channels (DCR; CRD from opset 28)."""

    def check(self):
        super().check()
        h, w = self.input(0).shape[2:]
        self.expect(h % self.b == 0 and w % self.b == 0, f"height {h} and width {w} are not multiples of blocksize {self.b}")

    def blocks(self):
        n, c, h, w = self.input(0).shape
        b = self.b
        shape = [n, c, h // b, b, w // b, b]
        return shape, ([0, 3, 5, 1, 2, 4] if self.mode == "DCR" else [0, 1, 3, 5, 2, 4])


@register("Trilu", since=14)
class Trilu(Operator):
    """Keep the upper (upper=1) or lower triangle of the last two axes, from diagonal k (an
    optional scalar input, constant or runtime), zeroing the rest."""

    inplace = (0,)
    inline = True
    elementwise = True  # element i reads x at i (and the scalar k)

    def check(self):
        x = self.input(0)
        self.expect(x.rank >= 2, f"input '{x.name}' has rank {x.rank}, expected at least 2")
        if x.batched and x.rank == 2:
            raise self.mixing(f"the rows of '{x.name}' {list(x.shape)} are the batch axis: the triangle mixes samples")
        if self.has_input(1):
            self.expect_dtype(self.input(1), ("int",), "input 1 (k)")
            self.expect(self.input(1).numel == 1, f"k '{self.input(1).name}' must hold one value")

    def value(self, i, coords, let) -> str:
        x, y = self.input(0), self.output()
        r, c = coords[-2:]
        k = self.input(1).load("0") if self.has_input(1) else "0"
        keep = f"{c} - {r} >= {k}" if int(self.attr("upper", 1)) else f"{c} - {r} <= {k}"
        return f"({x.load(i)} if {keep} else {literal(0, y.dtype)})"

    def forward(self, ctx):
        emit_nest(ctx, self.output(), self.value)

    def element(self, ctx, i, k=0):
        return element_at(ctx, i, self.output().shape, self.value)


@register("Size", since=1)
class Size(Operator):
    """The number of elements as an int64 scalar (static; normally folded before compiling)."""

    inline = True
    inline_cost = 0

    def check(self):
        x = self.input(0)
        if x.batched:
            raise self.mixing(f"the size of '{x.name}' includes the batch dimension, which a per-sample kernel does "
                              "not know")

    def forward(self, ctx):
        ctx.line(self.output().store("0", self.element(ctx, "0")))

    def element(self, ctx, i, k=0):
        return literal(self.input(0).numel, self.output().dtype)
