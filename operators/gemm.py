"""Gemm and MatMul: a dot product per output element, accumulated in float for float and half."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import convert


def _acc_type(dt) -> tuple[str, str]:
    """Return (accumulator DSL type, zero literal) for an element type."""
    if dt.is_float:
        return "float", "0.0"
    return dt.dsl, ("uint(0)" if dt.dsl == "uint" else "0")


def _as_acc(expr: str, dt) -> str:
    return f"float({expr})" if dt.dsl == "half" else expr


@register("Gemm", since=11)
class Gemm(Operator):
    """Y = alpha * A' B' + beta * C, A' = A or A^T, B' = B or B^T, C broadcast to [M, N]."""

    def check(self):
        a, b = self.input(0), self.input(1)
        self.expect_dtype(a, ("float", "int"), "A")
        self.expect(a.rank == 2 and b.rank == 2, f"A and B must be 2-D, got ranks {a.rank} and {b.rank}")
        self.ta, self.tb = int(self.attr("transA", 0)), int(self.attr("transB", 0))
        self.alpha, self.beta = float(self.attr("alpha", 1.0)), float(self.attr("beta", 1.0))
        self.M, K = (a.shape[1], a.shape[0]) if self.ta else a.shape
        K2, self.N = (b.shape[1], b.shape[0]) if self.tb else b.shape
        self.expect(K == K2, f"inner dimensions differ: A {list(a.shape)} (transA={self.ta}), B {list(b.shape)} (transB={self.tb})")
        self.K = K

    def forward(self, ctx):
        a, b, y = self.input(0), self.input(1), self.output()
        c = self.input(2) if self.has_input(2) and self.beta != 0 else None
        M, N, K = self.M, self.N, self.K
        acc_t, zero = _acc_type(y.dtype)

        def load_a(_, m, k):
            return _as_acc(a.load(ix.add(ix.mul(k, M), m) if self.ta else ix.add(ix.mul(m, K), k)), a.dtype)

        def load_b(_, k, n):
            return _as_acc(b.load(ix.add(ix.mul(n, K), k) if self.tb else ix.add(ix.mul(k, N), n)), b.dtype)

        def store(_, m, n, acc):
            v = acc if self.alpha == 1 else f"{literal(self.alpha, _lit_dt(y.dtype))} * {acc}"
            if c is not None:
                cv = _as_acc(c.load(ix.broadcast_index(ix.add(ix.mul(m, N), n), (M, N), c.shape)), c.dtype)
                v = f"{v} + {cv}" if self.beta == 1 else f"{v} + {literal(self.beta, _lit_dt(y.dtype))} * {cv}"
            return y.store(ix.add(ix.mul(m, N), n), convert(v, _acc_dt(y.dtype), y.dtype))

        ctx.render("matmul.py.j2", batch=1, M=M, N=N, K=K, zero=zero, a=load_a, bm=load_b, store=store)

    def describe(self):
        return f"naive dot products, M={self.M} N={self.N} K={self.K}"


def _acc_dt(dt):
    from luisaml import dtypes

    return dtypes.FLOAT if dt.is_float else dt


def _lit_dt(dt):
    return _acc_dt(dt)


@register("MatMul", since=9)
class MatMul(Operator):
    """numpy matmul: 1-D operands promoted, leading dimensions broadcast."""

    def check(self):
        a, b = self.input(0), self.input(1)
        self.expect_dtype(a, ("float", "int"), "A")
        self.expect(a.rank >= 1 and b.rank >= 1, "MatMul operands must have rank >= 1")
        ash = (1,) + a.shape if a.rank == 1 else a.shape
        bsh = b.shape + (1,) if b.rank == 1 else b.shape
        self.M, self.K = ash[-2], ash[-1]
        self.N = bsh[-1]
        self.expect(bsh[-2] == self.K, f"inner dimensions differ: {list(a.shape)} x {list(b.shape)}")
        self.a_batch, self.b_batch = ash[:-2], bsh[:-2]
        try:
            self.batch_shape = tuple(np.broadcast_shapes(self.a_batch, self.b_batch))
        except ValueError:
            raise self.error(f"batch dimensions do not broadcast: {list(a.shape)} x {list(b.shape)}") from None

    def forward(self, ctx):
        a, b, y = self.input(0), self.input(1), self.output()
        M, N, K = self.M, self.N, self.K
        nb = int(np.prod(self.batch_shape, dtype=np.int64))
        acc_t, zero = _acc_type(y.dtype)
        bases = {}

        def base(t_batch, which, bi, size):
            key = (which, bi)
            if key not in bases:
                idx = ix.broadcast_index(bi, self.batch_shape, t_batch) if self.batch_shape else "0"
                bases[key] = ix.mul(idx, size)
            return bases[key]

        def load_a(bi, m, k):
            off = base(self.a_batch, "a", bi, M * K)
            return _as_acc(a.load(ix.add(off, ix.mul(m, K), k)), a.dtype)

        def load_b(bi, k, n):
            off = base(self.b_batch, "b", bi, K * N)
            return _as_acc(b.load(ix.add(off, ix.mul(k, N), n)), b.dtype)

        def store(bi, m, n, acc):
            return y.store(ix.add(ix.mul(bi, M * N), ix.mul(m, N), n), convert(acc, _acc_dt(y.dtype), y.dtype))

        ctx.render("matmul.py.j2", batch=nb, M=M, N=N, K=K, zero=zero, a=load_a, bm=load_b, store=store)

    def describe(self):
        return f"naive dot products, batch={list(self.batch_shape)} M={self.M} N={self.N} K={self.K}"
