"""ConvTranspose over 1-D, 2-D and 3-D inputs (groups, dilations, pads, strides, auto_pad,
output_padding, output_shape), accumulated in float also for half inputs: each output element sums
the input positions whose window reaches it (ConvBase's window sum, shaders/conv.py.j2)."""
from __future__ import annotations

from luisaml import indexing as ix
from luisaml.registry import register

from .conv import AUTO_PADS, ConvBase, Geometry, bounds, int_list, lin


@register("ConvTranspose", since=1)
class ConvTranspose(ConvBase):
    """Y[n, m, o] = B[m] + sum of X[n, c, i] * W[c, m % (M/group), k] over o = i * s + k * d - pad."""

    transpose = True

    def geometry(self) -> None:
        x = self.input(0)
        k, spatial = self.k, x.shape[2:]
        strides = int_list(self, "strides", [1] * k, k)
        dil = int_list(self, "dilations", [1] * k, k)
        out_pad = int_list(self, "output_padding", [0] * k, k)
        auto_pad = self.attr("auto_pad", "NOTSET")
        self.expect(auto_pad in AUTO_PADS, f"auto_pad must be one of {', '.join(AUTO_PADS)}, not {auto_pad!r}")
        extent = [(kk - 1) * d + 1 for kk, d in zip(self.kernel, dil)]
        full = [s * (n - 1) + p + e for s, n, p, e in zip(strides, spatial, out_pad, extent)]
        out_shape = self.attr("output_shape", None)
        if out_shape is not None:
            out_shape = [int(v) for v in out_shape][-k:]
            self.expect(len(out_shape) == k, f"output_shape {out_shape} needs {k} spatial sizes")
        elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out_shape = [n * s for n, s in zip(spatial, strides)]
        if out_shape is not None:
            total = [f - o for f, o in zip(full, out_shape)]
            small, big = [t // 2 for t in total], [t - t // 2 for t in total]
            begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
        else:
            pads = [0] * 2 * k if auto_pad == "VALID" else int_list(self, "pads", [0] * 2 * k, 2 * k)
            begin, end = pads[:k], pads[k:]
        out = [f - b - e for f, b, e in zip(full, begin, end)]
        self.expect(all(o >= 1 for o in out), f"output spatial size {out} is empty")
        self.geo = Geometry(self.kernel, strides, dil, begin, end, out)

    def window_fns(self):
        g, x = self.geo, self.input(0)

        def window_dims(ctx, d, o, kv):
            # o = i * s + k * dil - pad  =>  i = (o + pad - k * dil) / s when that divides
            s, size = g.strides[d], x.shape[2 + d]
            t = ctx.fresh("t")
            pre = [f"{t} = {lin([(o, 1), (kv, -g.dilations[d])], g.pads_begin[d])}"]
            lo = g.pads_begin[d] < (g.kernel[d] - 1) * g.dilations[d]
            hi_t = (g.out[d] - 1) + g.pads_begin[d]  # the largest t
            if s == 1:
                return pre, bounds(t, lo, size if hi_t >= size else None), t
            iv = ctx.fresh("ix")
            cond = bounds(t, lo, None) + [f"{t} % {s} == 0"]
            pre.append(f"{iv} = {t} // {s}")
            if hi_t // s >= size:
                cond.append(f"{iv} < {size}")
            return pre, cond, iv

        return (window_dims, (lambda n, c_abs, sp: [n, c_abs] + sp),
                (lambda m, c, c_abs, ks, mg: [c_abs, ix.mod(m, mg) if self.group > 1 else m] + ks))
