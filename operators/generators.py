"""Operators that generate values from coordinates: Range, EyeLike, OneHot, AffineGrid and the
window functions. Each output element is a pure expression of its index, so all are inline
(schedule.py); forward() is the same value over a loop nest (shape.emit_nest)."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import compute_dtype, convert
from .shape import element_at, emit_nest


@register("Range", since=11)
class Range(Operator):
    """start + i * delta for i below the output's length (its shape is static: from constant
    inputs, or inferred); start and delta may be runtime scalars. Floats (half through float) are
    computed as start + i * delta, not by accumulating delta."""

    inline = True

    def check(self):
        y = self.output()
        for k, what in ((0, "start"), (1, "limit"), (2, "delta")):
            t = self.input(k)
            self.expect(t.numel == 1, f"input {k} ({what}) '{t.name}' must hold one value, it has shape {list(t.shape)}")
            self.expect(t.dtype == y.dtype, f"input {k} ({what}) '{t.name}' has type {t.dtype.name.lower()}, output {y.dtype.name.lower()}")
        self.expect_dtype(y, ("float", "int"), "output")
        vals = [self.input(k).value for k in range(3)]
        if all(v is not None for v in vals):
            start, limit, delta = (np.asarray(v).reshape(-1)[0].item() for v in vals)
            self.expect(delta != 0, "delta is 0")
            n = max(int(np.ceil((limit - start) / delta)), 0)
            self.expect(y.numel == n, f"output '{y.name}' has {y.numel} elements, the range {n}")

    def scalars(self, ctx) -> tuple[str, str]:
        """Return (start, delta) in the compute dtype, bound once."""
        dt = compute_dtype(self.output().dtype)
        return tuple(ctx.let(convert(self.input(k).load("0"), self.output().dtype, dt), what)
                     for k, what in ((0, "start"), (2, "delta")))

    def value(self, i: str, start: str, delta: str) -> str:
        y = self.output()
        dt = compute_dtype(y.dtype)
        return convert(f"{start} + {convert(i, dtypes.INT32, dt)} * {delta}", dt, y.dtype)

    def forward(self, ctx):
        y = self.output()
        if y.numel == 0:
            return
        start, delta = self.scalars(ctx)
        with ctx.loop(y.numel) as i:
            ctx.line(y.store(i, self.value(i, start, delta)))

    def element(self, ctx, i, k=0):
        return self.value(i, *self.scalars(ctx))


@register("EyeLike", since=9)
class EyeLike(Operator):
    """Ones on diagonal k of a 2-d tensor shaped like the input, zeros elsewhere (dtype: the
    attribute, or the input's)."""

    inline = True

    def check(self):
        x, y = self.input(0), self.output()
        self.expect(x.rank == 2, f"input '{x.name}' has rank {x.rank}, expected 2")
        if x.batched:
            raise self.mixing(f"the rows of '{x.name}' are the batch axis: the diagonal mixes samples")
        self.expect(tuple(y.shape) == tuple(x.shape), f"output shape {list(y.shape)} is not the input's {list(x.shape)}")

    def value(self, i, coords, let) -> str:
        y = self.output()
        r, c = coords
        one, zero = literal(1, y.dtype), literal(0, y.dtype)
        return f"({one} if {c} - {r} == {int(self.attr('k', 0))} else {zero})"

    def forward(self, ctx):
        emit_nest(ctx, self.output(), self.value)

    def element(self, ctx, i, k=0):
        return element_at(ctx, i, self.output().shape, self.value)


@register("OneHot", since=9)
class OneHot(Operator):
    """out[..., d, ...] = values[1] where d == indices[...] (negative indices count from the end),
    values[0] elsewhere; the new axis of length depth (a constant) goes at `axis`. Indices out of
    [-depth, depth) give a row of values[0]."""

    inline = True
    inline_cost = 2

    @classmethod
    def infer(cls, node, inputs):
        """Return the output's type and shape when depth is a constant (onnx may leave it unknown)."""
        idx, depth, values = (inputs + [None] * 3)[:3]
        if idx is None or depth is None or depth.value is None or values is None or idx.shape is None:
            return None
        d = int(np.asarray(depth.value).reshape(-1)[0])
        shape = list(idx.shape)
        axis = int(node.attrs.get("axis", -1))
        shape.insert(axis % (len(shape) + 1), d)
        return [(values.elem_type, tuple(shape))]

    def check(self):
        idx, values, y = self.input(0), self.input(2), self.output()
        self.expect_dtype(idx, ("float", "int"), "input 0 (indices)")
        self.expect(values.numel == 2, f"values '{values.name}' must hold 2 values (off, on), it has {values.numel}")
        self.depth = int(np.asarray(self.const(1, "depth")).reshape(-1)[0])
        self.expect(self.depth > 0, f"depth {self.depth} is not positive")
        self.ax = self.axis(self.attr("axis", -1), idx.rank + 1, batched=idx.batched)
        want = list(idx.shape)
        want.insert(self.ax, self.depth)
        self.expect(tuple(y.shape) == tuple(want), f"output shape {list(y.shape)} is not {want}")

    def value(self, i, coords, let) -> str:
        idx, values = self.input(0), self.input(2)
        d = coords[self.ax]
        g = let(convert(idx.load(ix.ravel(coords[:self.ax] + coords[self.ax + 1:], idx.strides)), idx.dtype, dtypes.INT32), "g")
        g = let(f"({g} + {self.depth} if {g} < 0 else {g})", "g")
        return f"({values.load('1')} if {g} == {d} else {values.load('0')})"

    def forward(self, ctx):
        emit_nest(ctx, self.output(), self.value)

    def element(self, ctx, i, k=0):
        return element_at(ctx, i, self.output().shape, self.value)


@register("AffineGrid", since=20)
class AffineGrid(Operator):
    """The sampling grid [N, (D,) H, W, k] of theta [N, k, k + 1] applied to the positions of an
    image of `size` (a constant [N, C, (D,) H, W]) normalised to [-1, 1] (pixel centres, or
    corners with align_corners), x first. An axis of one pixel sits at 0 (PyTorch's choice; the
    formula divides by zero there, and onnxruntime and ONNX's reference disagree)."""

    inline = True
    inline_cost = 2

    def check(self):
        theta, y = self.input(0), self.output()
        self.expect_dtype(theta, ("float",), "input 0 (theta)")
        size = [int(v) for v in np.asarray(self.const(1, "size")).reshape(-1)]
        self.expect(len(size) in (4, 5), f"size {size} must be [N, C, H, W] or [N, C, D, H, W]")
        self.k = len(size) - 2
        self.spatial = size[2:]
        self.expect(tuple(theta.shape[1:]) == (self.k, self.k + 1),
                    f"theta '{theta.name}' has shape {list(theta.shape)}, expected [N, {self.k}, {self.k + 1}]")
        want = (theta.shape[0], *self.spatial, self.k)
        self.expect(tuple(y.shape) == want, f"output shape {list(y.shape)} is not {list(want)}")
        self.align = bool(int(self.attr("align_corners", 0)))

    def position(self, i: str, n: int) -> str:
        """Return the DSL of the normalised position of pixel i of n along an axis (one rounding)."""
        if self.align:  # one pixel sits at 0, as in onnxruntime and PyTorch (ONNX's reference: -1)
            return "0.0" if n == 1 else f"(float(2 * {i} - {n - 1}) / {float(n - 1)})"
        return f"(float(2 * {i} + {1 - n}) / {float(n)})"

    def value(self, i, coords, let) -> str:
        theta, y, k = self.input(0), self.output(), self.k
        n, row = coords[0], coords[-1]
        # the spatial axes are (D,) H, W; the position vector is x (W) first
        vec = [let(self.position(c, s), "q") for c, s in zip(coords[1:-1], self.spatial)][::-1]
        base = ix.add(ix.mul(n, k * (k + 1)), ix.mul(row, k + 1))
        t = [convert(theta.load(ix.add(base, str(j))), theta.dtype, dtypes.FLOAT) for j in range(k + 1)]
        return convert(" + ".join([f"{t[j]} * {vec[j]}" for j in range(k)] + [t[k]]), dtypes.FLOAT, y.dtype)

    def forward(self, ctx):
        emit_nest(ctx, self.output(), self.value)

    def element(self, ctx, i, k=0):
        return element_at(ctx, i, self.output().shape, self.value)


class Window(Operator):
    """A window function of `size` (a constant) samples: sum_k a_k cos(2 pi k n / N) with N = size
    (periodic) or size - 1 (symmetric); output_datatype gives the type."""

    coeffs: tuple[float, ...] = ()
    inline = True
    inline_cost = 4  # cosines

    def check(self):
        y = self.output()
        self.expect_dtype(y, ("float", "int"), "output")
        self.n = y.numel
        self.periodic = bool(int(self.attr("periodic", 1)))

    def forward(self, ctx):
        y = self.output()
        if self.n == 0:
            return
        with ctx.loop(self.n) as i:
            ctx.line(y.store(i, self.element(ctx, i)))

    def element(self, ctx, i, k=0):
        denom = float(self.n if self.periodic else max(self.n - 1, 1))
        phase = f"(6.283185307179586 * float({i}) / {denom})"
        terms = [repr(self.coeffs[0])] + [f"{'-' if c < 0 else '+'} {abs(c)!r} * cos({m}.0 * {phase})"
                                          for m, c in enumerate(self.coeffs[1:], start=1)]
        return convert(" ".join(terms), dtypes.FLOAT, self.output().dtype)


register("HannWindow", since=17)(type("HannWindow", (Window,), {"coeffs": (0.5, -0.5)}))
register("HammingWindow", since=17)(type("HammingWindow", (Window,), {"coeffs": (25 / 46, -(1 - 25 / 46))}))
register("BlackmanWindow", since=17)(type("BlackmanWindow", (Window,), {"coeffs": (0.42, -0.5, 0.08)}))
