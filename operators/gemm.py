"""Gemm and MatMul: a dot product per output element (shaders/matmul.py.j2), accumulated in float
for float and half (rounded to half once), in int for integers."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import compute_dtype, convert, upcast


def _same_types(op: Operator, names: list[tuple[int, str]]) -> None:
    """Raise unless the inputs (index, role) present all have input 0's dtype."""
    first = op.input(0)
    for k, role in names:
        if op.has_input(k):
            t = op.input(k)
            op.expect(
                t.dtype == first.dtype,
                f"input {k} ({role}) '{t.name}' has type {t.dtype.name.lower()}, but A '{first.name}' has "
                f"{first.dtype.name.lower()}; they must match",
            )


def dot(ctx, K: int, acc_dt, load_a, load_b, finish) -> str:
    """Emit sum over k < K of load_a(k) * load_b(k) into a fresh accumulator; return finish(acc)."""
    acc = ctx.fresh("acc")
    ctx.line(f"{acc} = {literal(0, acc_dt)}")
    with ctx.loop(K, "k") as kk:
        ctx.line(f"{acc} += {load_a(kk)} * {load_b(kk)}")
    return finish(acc)


@register("Gemm", since=7)
class Gemm(Operator):
    """Y = alpha * A' B' + beta * C, A' = A or A^T, B' = B or B^T, C broadcast to [M, N]
    (C is optional from opset 11; opsets 7-10 only require it, with the same meaning)."""

    def check(self):
        a, b = self.input(0), self.input(1)
        self.expect_dtype(a, ("float", "int"), "input 0 (A)")
        _same_types(self, [(1, "B"), (2, "C")])
        self.expect(
            a.rank == 2 and b.rank == 2, f"A '{a.name}' and B '{b.name}' must be 2-D, got shapes {list(a.shape)} and {list(b.shape)}"
        )
        self.ta, self.tb = int(self.attr("transA", 0)), int(self.attr("transB", 0))
        self.alpha, self.beta = float(self.attr("alpha", 1.0)), float(self.attr("beta", 1.0))
        self.M, K = (a.shape[1], a.shape[0]) if self.ta else a.shape
        K2, self.N = (b.shape[1], b.shape[0]) if self.tb else b.shape
        self.expect(
            K == K2, f"inner dimensions differ: A {list(a.shape)} (transA={self.ta}), B {list(b.shape)} (transB={self.tb})"
        )
        self.K = K
        if self.has_input(2):
            c = self.input(2)
            ok = c.rank <= 2 and all(d in (1, w) for d, w in zip(reversed(c.shape), (self.N, self.M)))
            self.expect(ok, f"C '{c.name}' of shape {list(c.shape)} does not broadcast to [M, N] = [{self.M}, {self.N}]")
        if a.dtype.is_int:
            for name, v in (("alpha", self.alpha), ("beta", self.beta)):
                self.expect(v == int(v), f"integer Gemm needs a whole {name}, got {v}")

    def loaders(self):
        """Return (load_a(m, k), load_b(k, n), finish(m, n, acc) -> the output value, accumulator dtype)."""
        a, b, y = self.input(0), self.input(1), self.output()
        c = self.input(2) if self.has_input(2) and self.beta != 0 else None
        M, N, K = self.M, self.N, self.K
        acc_dt = compute_dtype(y.dtype)

        def load_a(m, k):
            return upcast(a.load(ix.add(ix.mul(k, M), m) if self.ta else ix.add(ix.mul(m, K), k)), a.dtype)

        def load_b(k, n):
            return upcast(b.load(ix.add(ix.mul(n, K), k) if self.tb else ix.add(ix.mul(k, N), n)), b.dtype)

        def scaled(v, s):
            return v if s == 1 else f"{literal(s, acc_dt)} * {v}"

        def finish(m, n, acc):
            v = scaled(acc, self.alpha)
            if c is not None:
                cv = upcast(c.load(ix.broadcast_index(ix.add(ix.mul(m, N), n), (M, N), c.shape)), c.dtype)
                v = f"{v} + {scaled(cv, self.beta)}"
            return convert(v, acc_dt, y.dtype)

        return load_a, load_b, finish, acc_dt

    def forward(self, ctx):
        y = self.output()
        load_a, load_b, finish, acc_dt = self.loaders()
        ctx.render("matmul.py.j2", batch=1, M=self.M, N=self.N, K=self.K, zero=literal(0, acc_dt),
                   a=lambda _, m, k: load_a(m, k), bm=lambda _, k, n: load_b(k, n),
                   store=lambda _, m, n, acc: y.store(ix.add(ix.mul(m, self.N), n), finish(m, n, acc)))

    def element(self, ctx, i, k=0):
        load_a, load_b, finish, acc_dt = self.loaders()
        m, n = ctx.let(ix.div(i, self.N), "m"), ctx.let(ix.mod(i, self.N), "n")
        return dot(ctx, self.K, acc_dt, lambda kk: load_a(m, kk), lambda kk: load_b(kk, n), lambda acc: finish(m, n, acc))

    def describe(self):
        return f"naive dot products, M={self.M} N={self.N} K={self.K}"


@register("MatMul", since=1)
class MatMul(Operator):
    """numpy matmul: 1-D operands promoted (and the added dimension dropped), leading (batch)
    dimensions broadcast."""

    def check(self):
        a, b = self.input(0), self.input(1)
        self.expect_dtype(a, ("float", "int"), "input 0 (A)")
        _same_types(self, [(1, "B")])
        self.expect(a.rank >= 1 and b.rank >= 1, f"MatMul operands must have rank >= 1, got {list(a.shape)} x {list(b.shape)}")
        ash = (1,) + a.shape if a.rank == 1 else a.shape
        bsh = b.shape + (1,) if b.rank == 1 else b.shape
        self.M, self.K = ash[-2], ash[-1]
        self.N = bsh[-1]
        self.expect(bsh[-2] == self.K, f"inner dimensions differ: A {list(a.shape)} x B {list(b.shape)}")
        self.a_batch, self.b_batch = ash[:-2], bsh[:-2]
        try:
            self.batch_shape = tuple(np.broadcast_shapes(self.a_batch, self.b_batch))
        except ValueError:
            raise self.error(f"batch dimensions do not broadcast: A {list(a.shape)} x B {list(b.shape)}") from None
        y = self.output()
        want = int(np.prod(self.batch_shape, dtype=np.int64)) * self.M * self.N
        self.expect(y.numel == want, f"output '{y.name}' has shape {list(y.shape)}, expected {want} elements")

    def loaders(self):
        """Return (load_a(bi, m, k), load_b(bi, k, n), finish(acc), accumulator dtype)."""
        a, b, y = self.input(0), self.input(1), self.output()
        M, N, K = self.M, self.N, self.K
        acc_dt = compute_dtype(y.dtype)

        def base(t_batch, bi, size):
            idx = ix.broadcast_index(bi, self.batch_shape, t_batch) if self.batch_shape else "0"
            return ix.mul(idx, size)

        def load_a(bi, m, k):
            return upcast(a.load(ix.add(base(self.a_batch, bi, M * K), ix.mul(m, K), k)), a.dtype)

        def load_b(bi, k, n):
            return upcast(b.load(ix.add(base(self.b_batch, bi, K * N), ix.mul(k, N), n)), b.dtype)

        return load_a, load_b, (lambda acc: convert(acc, acc_dt, y.dtype)), acc_dt

    def forward(self, ctx):
        y = self.output()
        M, N, K = self.M, self.N, self.K
        nb = int(np.prod(self.batch_shape, dtype=np.int64))
        load_a, load_b, finish, acc_dt = self.loaders()

        def store(bi, m, n, acc):
            return y.store(ix.add(ix.mul(bi, M * N), ix.mul(m, N), n), finish(acc))

        ctx.render("matmul.py.j2", batch=nb, M=M, N=N, K=K, zero=literal(0, acc_dt), a=load_a, bm=load_b, store=store)

    def element(self, ctx, i, k=0):
        M, N = self.M, self.N
        load_a, load_b, finish, acc_dt = self.loaders()
        bi = ctx.let(ix.div(i, M * N), "b") if self.batch_shape else "0"
        m, n = ctx.let(ix.mod(ix.div(i, N), M), "m"), ctx.let(ix.mod(i, N), "n")
        return dot(ctx, self.K, acc_dt, lambda kk: load_a(bi, m, kk), lambda kk: load_b(bi, kk, n), finish)

    def describe(self):
        return f"naive dot products, batch={list(self.batch_shape)} M={self.M} N={self.N} K={self.K}"
