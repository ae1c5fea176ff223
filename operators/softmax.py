"""Softmax and LogSoftmax, numerically stable (the maximum is subtracted first), computed in
float for float and half (shaders/softmax.py.j2)."""
from __future__ import annotations

from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import literal

from .common import affine, compute_dtype, convert, reduction_loops, upcast


class Softmax(Operator):
    """Opset 13 on: normalise along one axis (default -1)."""

    inplace = (0,)  # every element is read before the same element is written, after the sums
    log = False

    def axes(self, rank: int, batched: bool) -> list[int]:
        """Return the axes normalised over."""
        return [self.axis(self.attr("axis", -1), rank, batched=batched)]

    def check(self):
        x, y = self.input(0), self.output()
        self.expect_dtype(x, ("float",), "input 0")
        self.expect(tuple(x.shape) == tuple(y.shape), f"output '{y.name}' {list(y.shape)} differs from input {list(x.shape)}")
        self.red_axes = self.axes(x.rank, x.batched)

    def forward(self, ctx):
        x, y = self.input(0), self.output()
        if x.numel == 0:
            return
        acc = compute_dtype(x.dtype)
        kept, kx, _, red, rx = reduction_loops(ctx, x, self.red_axes)
        src = affine(0, kept + red, kx + rx)
        ctx.render(
            "softmax.py.j2",
            kept=kept,
            red=red,
            m=ctx.fresh("m"),
            s=ctx.fresh("s"),
            first=upcast(x.load(affine(0, kept, kx)), x.dtype),
            zero=literal(0, acc),
            log=self.log,
            src=src,
            dst=src,
            load=lambda i: upcast(x.load(i), x.dtype),
            store=lambda i, v: y.store(i, convert(v, acc, y.dtype)),
        )


class SoftmaxV1(Softmax):
    """Opsets 1-12: the input is seen as 2-D [prod(dims before axis), prod(dims from axis)]
    (axis default 1) and normalised along the second."""

    def axes(self, rank, batched):
        a = self.axis(self.attr("axis", 1), rank, batched=batched)
        return list(range(a, rank))


register("Softmax", since=1)(type("Softmax", (SoftmaxV1,), {}))
register("Softmax", since=13)(type("Softmax", (Softmax,), {}))
register("LogSoftmax", since=1)(type("LogSoftmax", (SoftmaxV1,), {"log": True}))
register("LogSoftmax", since=13)(type("LogSoftmax", (Softmax,), {"log": True}))
