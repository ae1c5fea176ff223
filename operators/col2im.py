"""Col2Im, the inverse of im2col (opset 18): image blocks summed back into an image, each output
element gathering the columns whose blocks cover it."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register

from .conv import int_list


@register("Col2Im", since=18)
class Col2Im(Operator):
    """The inverse of im2col: Y[n, c, o] = sum over block offsets b of X[n, c*K + b, l] where, per
    spatial dimension, o = l * stride + b * dilation - pad_begin (overlapping blocks add up), K the
    block's element count and l the column's position on the sliding grid."""

    def check(self):
        from .common import compute_dtype

        x = self.input(0)
        self.expect_dtype(x, ("float",), "input 0")
        self.expect(x.rank == 3, f"input 0 '{x.name}' has rank {x.rank}, expected 3 ([N, C * prod(block_shape), L])")
        self.image = [int(v) for v in np.asarray(self.const(1, "image_shape")).reshape(-1)]
        self.block = [int(v) for v in np.asarray(self.const(2, "block_shape")).reshape(-1)]
        k = len(self.image)
        self.expect(len(self.block) == k, f"block_shape has {len(self.block)} values, image_shape {k}")
        self.strides = int_list(self, "strides", [1] * k, k)
        self.dil = int_list(self, "dilations", [1] * k, k)
        pads = int_list(self, "pads", [0] * 2 * k, 2 * k)
        self.pad = pads[:k]
        self.K = int(np.prod(self.block))
        self.expect(x.shape[1] % self.K == 0,
                    f"input 0 has {x.shape[1]} rows, not a multiple of prod(block_shape) = {self.K}")
        self.grid = [(self.image[d] + pads[d] + pads[k + d] - self.dil[d] * (self.block[d] - 1) - 1) // self.strides[d] + 1
                     for d in range(k)]
        self.expect(all(g >= 1 for g in self.grid) and int(np.prod(self.grid)) == x.shape[2],
                    f"input 0 has {x.shape[2]} columns, the sliding grid {self.grid} needs {int(np.prod(self.grid))}")
        y = self.output()
        want = (x.shape[0], x.shape[1] // self.K, *self.image)
        self.expect(tuple(y.shape) == want, f"output '{y.name}' has shape {list(y.shape)}, expected {list(want)}")
        self.acc_dtype = compute_dtype(x.dtype)

    def forward(self, ctx):
        from .common import convert, upcast

        x, y = self.input(0), self.output()
        k, K, L = len(self.image), self.K, x.shape[2]
        with ctx.loop(y.numel) as i:
            n, c, *o = ix.unravel(i, tuple(y.shape))
            acc = ctx.fresh("acc")
            ctx.line(f"{acc} = {ctx.lit(0, self.acc_dtype)}")
            with ctx.loop(K, "b") as b:
                bs = ix.unravel(b, tuple(self.block))
                ts, cond = [], []
                for d in range(k):
                    t = ctx.fresh("t")
                    ctx.line(f"{t} = {ix.add(o[d], str(self.pad[d]))} - {ix.mul(bs[d], self.dil[d])}")
                    cond += [f"{t} >= 0", f"{t} % {self.strides[d]} == 0" if self.strides[d] > 1 else "True",
                             f"{ix.div(t, self.strides[d])} < {self.grid[d]}"]
                    ts.append(ix.div(t, self.strides[d]))
                col = ix.ravel(ts, tuple(int(np.prod(self.grid[d + 1:])) for d in range(k)))
                src = ix.add(ix.mul(n, x.shape[1] * L), ix.mul(ix.add(ix.mul(c, K), b), L), col)
                ctx.line(f"if {' and '.join(c_ for c_ in cond if c_ != 'True')}:")
                with ctx.indent():
                    ctx.line(f"{acc} += {upcast(x.load(src), x.dtype)}")
            ctx.store(y, i, convert(acc, self.acc_dtype, y.dtype))
