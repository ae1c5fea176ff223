"""Operators that generate values from coordinates: Range, EyeLike and OneHot."""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import compute_dtype, convert


@register("Range", since=11)
class Range(Operator):
    """start + i * delta for i below the output's length (its shape is static: from constant
    inputs, or inferred); start and delta may be runtime scalars. Floats (half through float) are
    computed as start + i * delta, not by accumulating delta."""

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

    def forward(self, ctx):
        y = self.output()
        if y.numel == 0:
            return
        dt = compute_dtype(y.dtype)
        start = ctx.let(convert(self.input(0).load("0"), y.dtype, dt), "start")
        delta = ctx.let(convert(self.input(2).load("0"), y.dtype, dt), "delta")
        with ctx.loop(y.numel) as i:
            k = convert(i, dtypes.INT32, dt)
            ctx.line(y.store(i, convert(f"{start} + {k} * {delta}", dt, y.dtype)))


@register("EyeLike", since=9)
class EyeLike(Operator):
    """Ones on diagonal k of a 2-d tensor shaped like the input, zeros elsewhere (dtype: the
    attribute, or the input's)."""

    def check(self):
        x, y = self.input(0), self.output()
        self.expect(x.rank == 2, f"input '{x.name}' has rank {x.rank}, expected 2")
        if x.batched:
            raise self.error(f"the rows of '{x.name}' are the batch axis: the diagonal mixes samples "
                             "(compile with batch_axis=None)")
        self.expect(tuple(y.shape) == tuple(x.shape), f"output shape {list(y.shape)} is not the input's {list(x.shape)}")

    def forward(self, ctx):
        y = self.output()
        if y.numel == 0:
            return
        rows, cols = y.shape
        k = int(self.attr("k", 0))
        loops = [(ctx.fresh("r"), rows), (ctx.fresh("c"), cols)]
        r, c = (v if n > 1 else "0" for v, n in loops)
        one, zero = literal(1, y.dtype), literal(0, y.dtype)
        body = [y.store(ix.add(ix.mul(r, cols), c), f"({one} if {c} - {r} == {k} else {zero})")]
        ctx.render("nest.py.j2", loops=[(v, n) for v, n in loops if n > 1], body=body)


@register("OneHot", since=9)
class OneHot(Operator):
    """out[..., d, ...] = values[1] where d == indices[...] (negative indices count from the end),
    values[0] elsewhere; the new axis of length depth (a constant) goes at `axis`. Indices out of
    [-depth, depth) give a row of values[0]."""

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

    def forward(self, ctx):
        idx, values, y = self.input(0), self.input(2), self.output()
        if y.numel == 0:
            return
        outer = int(np.prod(idx.shape[: self.ax], dtype=np.int64))
        inner = int(np.prod(idx.shape[self.ax:], dtype=np.int64))
        loops = [(ctx.fresh("o"), outer), (ctx.fresh("d"), self.depth), (ctx.fresh("r"), inner)]
        o, d, r = (v if n > 1 else "0" for v, n in loops)
        off, on = ctx.let(values.load("0"), "off"), ctx.let(values.load("1"), "on")
        g = ctx.fresh("g")
        body = [f"{g} = {convert(idx.load(ix.add(ix.mul(o, inner), r)), idx.dtype, dtypes.INT32)}",
                f"{g} = ({g} + {self.depth} if {g} < 0 else {g})",
                y.store(ix.add(ix.mul(o, self.depth * inner), ix.mul(d, inner), r), f"({on} if {g} == {d} else {off})")]
        ctx.render("nest.py.j2", loops=[(v, n) for v, n in loops if n > 1], body=body)


@register("AffineGrid", since=20)
class AffineGrid(Operator):
    """The sampling grid [N, (D,) H, W, k] of theta [N, k, k + 1] applied to the positions of an
    image of `size` (a constant [N, C, (D,) H, W]) normalised to [-1, 1] (pixel centres, or
    corners with align_corners), x first. An axis of one pixel sits at 0 (PyTorch's choice; the
    formula divides by zero there, and onnxruntime and ONNX's reference disagree)."""

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

    def forward(self, ctx):
        theta, y = self.input(0), self.output()
        if y.numel == 0:
            return
        k = self.k
        loops = [(ctx.fresh("n"), theta.shape[0])] + [(ctx.fresh("p"), s) for s in self.spatial]
        coords = [v if s > 1 else "0" for v, s in loops]
        pos = [ctx.fresh("q") for _ in range(k)]
        # the spatial axes are (D,) H, W; the position vector is x (W) first
        body = [f"{q} = {self.position(c, s)}" for q, c, s in zip(pos, coords[1:], self.spatial)]
        vec = list(reversed(pos))
        dst = ix.mul(ix.ravel(coords, tuple(int(np.prod(y.shape[d + 1:-1], dtype=np.int64)) for d in range(k + 1))), k)
        for row in range(k):
            base = ix.add(ix.mul(coords[0], k * (k + 1)), str(row * (k + 1)))
            t = [convert(theta.load(ix.add(base, str(j))), theta.dtype, dtypes.FLOAT) for j in range(k + 1)]
            value = " + ".join([f"{t[j]} * {vec[j]}" for j in range(k)] + [t[k]])
            body.append(y.store(ix.add(dst, str(row)), convert(value, dtypes.FLOAT, y.dtype)))
        ctx.render("nest.py.j2", loops=[(v, s) for v, s in loops if s > 1], body=body)


class Window(Operator):
    """A window function of `size` (a constant) samples: sum_k a_k cos(2 pi k n / N) with N = size
    (periodic) or size - 1 (symmetric); output_datatype gives the type."""

    coeffs: tuple[float, ...] = ()

    def check(self):
        y = self.output()
        self.expect_dtype(y, ("float", "int"), "output")
        self.n = y.numel
        self.periodic = bool(int(self.attr("periodic", 1)))

    def forward(self, ctx):
        y = self.output()
        if self.n == 0:
            return
        denom = float(self.n if self.periodic else max(self.n - 1, 1))
        with ctx.loop(self.n) as i:
            phase = f"(6.283185307179586 * float({i}) / {denom})"
            terms = [repr(self.coeffs[0])] + [f"{'-' if c < 0 else '+'} {abs(c)!r} * cos({k}.0 * {phase})"
                                              for k, c in enumerate(self.coeffs[1:], start=1)]
            ctx.line(y.store(i, convert(" ".join(terms), dtypes.FLOAT, y.dtype)))


register("HannWindow", since=17)(type("HannWindow", (Window,), {"coeffs": (0.5, -0.5)}))
register("HammingWindow", since=17)(type("HammingWindow", (Window,), {"coeffs": (25 / 46, -(1 - 25 / 46))}))
register("BlackmanWindow", since=17)(type("BlackmanWindow", (Window,), {"coeffs": (0.42, -0.5, 0.08)}))
