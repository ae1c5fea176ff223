"""DFT and STFT as direct sums (O(n^2) per transformed axis: the signal lengths of real models are
small, and each output bin is one independent loop: a stage runs one work item per bin, which
writes its real and imaginary parts). The twiddle angle is reduced to
2 pi ((k n) mod N) / N before cos and sin, so large k n lose no precision; sums are in float (half
inputs too)."""
from __future__ import annotations

import math

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register

from .common import convert

F = dtypes.FLOAT


def _scalar(op: Operator, k: int, what: str) -> int | None:
    """Return the int value of optional constant scalar input k, None when absent or empty."""
    if not op.has_input(k):
        return None
    v = np.asarray(op.const(k, what)).reshape(-1)
    return int(v[0]) if v.size else None


def dft_lines(ctx, load_re, load_im, n_in: int, length: int, k: str, inverse: bool, hermitian: bool,
              re: str, im: str) -> list[str]:
    """Return lines summing bin (or sample) k of a length-`length` transform into floats re, im.
    load_re(i) / load_im(i) read element i of the input line (load_im None: real input);
    `hermitian`: the input holds bins 0..n_in-1 of a real signal's spectrum, the rest mirror them."""
    i, m, q, th, c0, s0, c, s, a, b = (ctx.fresh(p) for p in ("n", "m", "q", "th", "c", "s", "cs", "sn", "a", "b"))
    count = length if hermitian else min(n_in, length)
    # the angle 2 pi m / N is (pi / 2) (q + r / N) with q = 4m // N: cos and sin of the part within
    # the quadrant, then the quadrant's rotation, so that quarter turns are exact (0, +-1)
    lines = [f"{re} = 0.0", f"{im} = 0.0", f"for {i} in range({count}):",
             f"    {m} = ({k} * {i}) % {length}",
             f"    {q} = (4 * {m}) // {length}",
             f"    {th} = float((4 * {m}) % {length}) * {math.pi / 2 / length!r}",
             f"    {c0} = cos({th})", f"    {s0} = sin({th})",
             f"    {c} = ({c0} if {q} == 0 else (-{s0} if {q} == 1 else (-{c0} if {q} == 2 else {s0})))",
             f"    {s} = ({s0} if {q} == 0 else ({c0} if {q} == 1 else (-{s0} if {q} == 2 else -{c0})))"]
    if not inverse:  # e^{-i theta}
        lines.append(f"    {s} = -{s}")
    if hermitian:  # X[i] for i < n_in, conj(X[length - i]) above
        j = ctx.fresh("j")
        lines += [f"    {j} = ({i} if {i} < {n_in} else {length} - {i})",
                  f"    {a} = {load_re(j)}",
                  f"    {b} = ({load_im(j)} if {i} < {n_in} else -{load_im(j)})"]
    else:
        lines += [f"    {a} = {load_re(i)}", f"    {b} = {load_im(i) if load_im else '0.0'}"]
    lines += [f"    {re} = {re} + {a} * {c} - {b} * {s}", f"    {im} = {im} + {a} * {s} + {b} * {c}"]
    return lines


@register("DFT", since=20)
class DFT(Operator):
    """DFT along one axis of [batch, ..., signal, 1 | 2] (real or complex): dft_length pads with
    zeros or truncates; onesided keeps bins 0..N/2 (an inverse onesided transform takes those bins
    of a real signal's spectrum and returns the real signal); inverse divides by N."""

    stores_once = True  # each bin stores its parts once and never reads them back

    def axis_value(self) -> int:
        a = _scalar(self, 2, "axis")
        return -2 if a is None else a

    def check(self):
        x, y = self.input(0), self.output()
        self.expect_dtype(x, ("float",), "input 0")
        self.expect(x.rank >= 3 and x.shape[-1] in (1, 2), f"input '{x.name}' {list(x.shape)} is not [batch, ..., 1 or 2]")
        r = x.rank
        a = self.axis_value()
        self.expect(-r <= a < r, f"axis {a} is out of range for [batch, ..., 1 or 2] of rank {r}")
        self.ax = a % r
        self.expect(self.ax not in (0, r - 1), f"axis {a} must name a signal axis, not the batch or the complex axis")
        self.inverse = bool(int(self.attr("inverse", 0)))
        self.onesided = bool(int(self.attr("onesided", 0)))
        n_in = x.shape[self.ax]
        length = _scalar(self, 1, "dft_length")
        if length is None:
            length = 2 * (n_in - 1) if (self.onesided and self.inverse) else n_in
        self.expect(length > 0, f"dft_length {length} is not positive")
        self.length = length
        out_n = length // 2 + 1 if (self.onesided and not self.inverse) else length
        want = list(x.shape)
        want[self.ax] = out_n
        want[-1] = 1 if (self.onesided and self.inverse) else 2
        self.expect(tuple(y.shape) == tuple(want), f"output shape {list(y.shape)} is not {want}")
        if self.onesided and self.inverse:
            self.expect(n_in == length // 2 + 1, f"an inverse onesided DFT of length {length} takes {length // 2 + 1} bins, "
                                                 f"the input has {n_in}")

    def bins(self) -> tuple[int, int, int]:
        """Return (outer, output bins, inner): the output is [outer, bins, inner, 1 or 2]."""
        x, y = self.input(0), self.output()
        prod = lambda dims: int(np.prod(dims, dtype=np.int64))  # noqa: E731
        return prod(x.shape[: self.ax]), y.shape[self.ax], prod(x.shape[self.ax + 1: -1])

    def bin_lines(self, ctx, o: str, k: str, r: str) -> list[str]:
        """Return the lines computing and storing output bin (o, k, r)."""
        x, y = self.input(0), self.output()
        comps, n_in, oc = x.shape[-1], x.shape[self.ax], y.shape[-1]
        _, n_out, inner = self.bins()

        def at(i: str, comp: int) -> str:
            return ix.add(ix.mul(o, n_in * inner * comps), ix.mul(i, inner * comps), ix.mul(r, comps), str(comp))

        def load(comp):
            return lambda i: convert(x.load(at(i, comp)), x.dtype, F)

        re, im = ctx.fresh("re"), ctx.fresh("im")
        hermitian = self.onesided and self.inverse
        body = dft_lines(ctx, load(0), load(1) if comps == 2 else None, n_in, self.length, k, self.inverse, hermitian, re, im)
        scale = f" / {float(self.length)!r}" if self.inverse else ""
        dst = ix.add(ix.mul(o, n_out * inner * oc), ix.mul(k, inner * oc), ix.mul(r, oc))
        body.append(y.store(dst, convert(f"{re}{scale}", F, y.dtype)))
        if oc == 2:
            body.append(y.store(ix.add(dst, "1"), convert(f"{im}{scale}", F, y.dtype)))
        return body

    def forward(self, ctx):
        if self.output().numel == 0:
            return
        loops = [(ctx.fresh(v), n) for v, n in zip("okr", self.bins())]
        o, k, r = (v if n > 1 else "0" for v, n in loops)
        ctx.render("nest.py.j2", loops=[(v, n) for v, n in loops if n > 1], body=self.bin_lines(ctx, o, k, r))

    def work_items(self) -> int | None:
        return int(np.prod(self.bins(), dtype=np.int64)) or None

    def emit_item(self, ctx, item):
        o, k, r = ix.unravel(ctx.let(item, "item"), self.bins())
        ctx.render("nest.py.j2", loops=[], body=self.bin_lines(ctx, *(ctx.let(c, v) for c, v in zip((o, k, r), "okr"))))


@register("DFT", since=17)
class DFT17(DFT):
    """DFT-17: axis as an attribute (default 1)."""

    def axis_value(self):
        return int(self.attr("axis", 1))


@register("STFT", since=17)
class STFT(Operator):
    """Short-time Fourier transform of signal [batch, length, 1 | 2]: frames of frame_length every
    frame_step samples (constants), times the optional window, each transformed; onesided (default)
    keeps bins 0..frame_length/2. Output [batch, frames, bins, 2]."""

    stores_once = True  # each bin stores its parts once and never reads them back

    def check(self):
        x, y = self.input(0), self.output()
        self.expect_dtype(x, ("float",), "input 0 (signal)")
        self.expect(x.rank == 3 and x.shape[-1] in (1, 2), f"signal '{x.name}' {list(x.shape)} is not [batch, length, 1 or 2]")
        self.step = _scalar(self, 1, "frame_step")
        self.expect(self.step is not None and self.step > 0, f"frame_step {self.step} is not positive")
        length = _scalar(self, 3, "frame_length")
        if self.has_input(2):
            w = self.input(2)
            self.expect(w.rank == 1, f"window '{w.name}' must be 1-d")
            self.expect(length is None or length == w.numel, f"frame_length {length} differs from the window's {w.numel}")
            length = w.numel
        self.expect(length is not None and 0 < length <= x.shape[1], f"frame_length {length} must be in (0, {x.shape[1]}]")
        self.length = length
        self.onesided = bool(int(self.attr("onesided", 1)))
        self.frames = (x.shape[1] - length) // self.step + 1
        bins = length // 2 + 1 if self.onesided else length
        want = (x.shape[0], self.frames, bins, 2)
        self.expect(tuple(y.shape) == want, f"output shape {list(y.shape)} is not {list(want)}")

    def bin_lines(self, ctx, b: str, f: str, k: str) -> list[str]:
        """Return the lines computing and storing bin k of frame f of signal b."""
        x, y = self.input(0), self.output()
        comps, n_sig, bins = x.shape[-1], x.shape[1], y.shape[2]
        win = self.input(2) if self.has_input(2) else None

        def load(comp):
            def at(i):
                v = convert(x.load(ix.add(ix.mul(b, n_sig * comps), ix.mul(ix.add(ix.mul(f, self.step), i), comps), str(comp))), x.dtype, F)
                return f"{v} * {convert(win.load(i), win.dtype, F)}" if win is not None else v
            return at

        re, im = ctx.fresh("re"), ctx.fresh("im")
        body = dft_lines(ctx, load(0), load(1) if comps == 2 else None, self.length, self.length, k, False, False, re, im)
        dst = ix.mul(ix.add(ix.mul(b, self.frames * bins), ix.mul(f, bins), k), 2)
        return body + [y.store(dst, convert(re, F, y.dtype)), y.store(ix.add(dst, "1"), convert(im, F, y.dtype))]

    def forward(self, ctx):
        if self.output().numel == 0:
            return
        loops = [(ctx.fresh(v), n) for v, n in zip("bfk", self.output().shape[:3])]
        b, f, k = (v if n > 1 else "0" for v, n in loops)
        ctx.render("nest.py.j2", loops=[(v, n) for v, n in loops if n > 1], body=self.bin_lines(ctx, b, f, k))

    def work_items(self) -> int | None:
        return self.output().numel // 2 or None

    def emit_item(self, ctx, item):
        b, f, k = ix.unravel(ctx.let(item, "item"), self.output().shape[:3])
        ctx.render("nest.py.j2", loops=[], body=self.bin_lines(ctx, *(ctx.let(c, v) for c, v in zip((b, f, k), "bfk"))))
