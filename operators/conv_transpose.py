"""ConvTranspose over 1-D, 2-D and 3-D inputs (groups, dilations, pads, strides, auto_pad,
output_padding, output_shape), accumulated in float also for half inputs.

`forward` sums each output element's window on its own (ConvBase's window sum, shaders/conv.py.j2).
In a stage a work item is a tile of P consecutive outputs along the last spatial dimension x O
output channels (Conv's tile, read backwards): P is a multiple of the stride s along that
dimension, so which taps reach output o_last + pp (o = i * s + k * d - pad) is known at compile
time for each pp, and the input positions a tap reads are consecutive (i = o_last / s + (pp + pad -
k * d) / s). The tile reads each input element once per tap that uses it and stores P consecutive
outputs a channel (what clang's SLP vectoriser seeds from: benchmarks/NOTES.md, "CPU stage
kernels"). U-Net's 2 x 2 stride-2 up-convolution is the GEMM [input pixels, C] x [C, 4 M] and a
pixel shuffle; this is that GEMM with the shuffle in the store's addresses. A stride along the last
dimension past MAX_STRIDE keeps a thread per output element (ConvBase.emit_item)."""
from __future__ import annotations

import numpy as np

from luisaml import indexing as ix
from luisaml.registry import register

from .common import load_f
from .conv import AUTO_PADS, ConvBase, Geometry, bounds, emit_strip, finished, int_list, lin

# a tile holds at least one whole period of the last dimension's stride: P >= s outputs
MAX_STRIDE = 8
# accumulators of a tile (P x O), as Conv's: the tile's values and weights stay in registers
MAX_ACC = 64


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

    # ---- the stage form: a work item is a tile of P outputs along the last dimension x O channels --

    def tiles(self) -> tuple[int, int, int, int] | None:
        """Return (P outputs along the last spatial dimension, O channels of one group, strips per
        row, channel blocks per group), or None where the tile does not apply (a stride along the
        last dimension past MAX_STRIDE). P is a multiple of the stride, 8 outputs or one period
        if larger, and divides the row where such a P exists (a ragged last strip runs the masked
        copy of the nest, as Conv measured)."""
        s, row = self.geo.strides[-1], self.geo.out[-1]
        if s > MAX_STRIDE:
            return None
        options = [s * q for q in (8, 4, 2, 1) if s * q <= max(8, s)]
        P = next((p for p in options if row % p == 0), options[-1])
        mg = self.M // self.group
        top = min(MAX_ACC // P, 16)
        O = mg if mg <= top else min(range(4, top + 1), key=lambda o: (-(-mg // o) * o - mg, -o))
        return P, O, -(-row // P), -(-mg // O)

    def work_items(self) -> int:
        t = self.tiles()
        if t is None:
            return super().work_items()
        _, _, strips, blocks = t
        return self.output().shape[0] * self.group * blocks * int(np.prod(self.geo.out[:-1], dtype=np.int64)) * strips

    def packed_w(self, O: int, blocks: int):
        """Return the byte offset in the blob of W prepacked as float32 [group][C/group][kernel
        taps][channel blocks x O] (a tap's O output channels consecutive), or None when W is not a
        constant of the weight blob."""
        from luisaml.plan import BlobWeight

        w = self.input(1)
        if w.value is None or not isinstance(w.home, BlobWeight):
            return None
        mg, cg = self.M // self.group, w.shape[0] // self.group
        taps = int(np.prod(self.kernel, dtype=np.int64))

        def pack() -> np.ndarray:  # W is [C, M / group, taps...]: C = group x cg
            v = np.asarray(w.value, np.float32).reshape(self.group, cg, mg, taps).transpose(0, 1, 3, 2)
            packed = np.zeros((self.group, cg, taps, blocks * O), np.float32)
            packed[..., :mg] = v
            return packed

        return w.home.blob.add_packed(f"{w.name}/transposed-packed[{cg}x{taps}x{blocks * O}]", pack)

    def emit_item(self, ctx, item: str) -> None:
        t = self.tiles()
        if t is None:
            super().emit_item(ctx, item)
            return
        x, w, y = self.input(0), self.input(1), self.output()
        g, k = self.geo, self.k
        P, O, strips, blocks = t
        mg, cg = self.M // self.group, x.shape[1] // self.group
        taps = int(np.prod(self.kernel, dtype=np.int64))
        sizes = x.shape[2:]
        # item -> (n, group, channel block, outer output coordinates, strip), the strip fastest
        dims = [y.shape[0], self.group, blocks] + list(g.out[:-1]) + [strips]
        n, grp, cb, *outer, strip = [ctx.let(c, "t") if d > 1 else "0" for c, d in zip(ix.unravel(item, tuple(dims)), dims)]
        m0 = ctx.let(ix.mul(cb, O), "m")
        s_l, d_l, pad_l, kl = g.strides[-1], g.dilations[-1], g.pads_begin[-1], g.kernel[-1]
        i_base = ctx.let(ix.mul(strip, P // s_l), "ib")  # the input position of the strip's first period
        # (last tap, output pp of the strip) -> the input offset from i_base, for the pairs that meet
        reads = {kv: [(pp, (pp + pad_l - kv * d_l) // s_l) for pp in range(P) if (pp + pad_l - kv * d_l) % s_l == 0]
                 for kv in range(kl)}
        offsets = sorted({e for pairs in reads.values() for _, e in pairs})
        safe = mg % O or O  # channels j >= safe may fall past the group in the last block
        acc = [[ctx.fresh("acc") for _ in range(O)] for _ in range(P)]
        b = self.input(2) if self.has_input(2) else None
        for j in range(O):
            m = ix.add(ix.mul(grp, mg), m0, str(j))
            init = load_f(b, m if j < safe else f"min({m}, {self.M - 1})") if b is not None else "0.0"
            for pp in range(P):
                ctx.line(f"{acc[pp][j]} = {init if pp == 0 else acc[0][j]}")
        packed = self.packed_w(O, blocks)
        if packed is not None:
            wbase = ctx.let(ix.add(str(packed), ix.mul(grp, cg * taps * blocks * O * 4), ix.mul(cb, O * 4)), "wb")
        else:
            wm = [ctx.let(ix.add(m0, str(j)) if j < safe else f"min({ix.add(m0, str(j))}, {mg - 1})", "wm")
                  for j in range(O)]
        # a strip whose every read lies inside the row runs the loop nest without masks
        lo_fails = bool(offsets) and offsets[0] < 0
        hi_fails = bool(offsets) and (strips - 1) * (P // s_l) + offsets[-1] >= sizes[-1]

        def nest(masked: bool) -> None:
            """Emit the loops over the group's channels and the outer taps (each guarded by whether
            it reaches this output), the last dimension's taps unrolled, its loads masked (or not)."""

            def outer_taps(d, c, x_base, kvs):
                if d == k - 1:
                    last_taps(c, x_base, kvs)
                    return
                with ctx.loop(g.kernel[d], "k") as kv:
                    s, size = g.strides[d], sizes[d]
                    tt = ctx.let(lin([(outer[d], 1), (kv, -g.dilations[d])], g.pads_begin[d]), "t")
                    cond = bounds(tt, g.pads_begin[d] < (g.kernel[d] - 1) * g.dilations[d], None)
                    iv = tt
                    if s > 1:
                        cond.append(f"{tt} % {s} == 0")
                        iv = ctx.let(f"{tt} // {s}", "ix")
                    if ((g.out[d] - 1) + g.pads_begin[d]) // s >= size:
                        cond.append(f"{iv} < {size}")
                    base = ix.add(x_base, ix.mul(iv, x.strides[2 + d]))
                    if cond:
                        ctx.line(f"if {' and '.join(cond)}:")
                        with ctx.indent():
                            outer_taps(d + 1, c, base, kvs + [kv])
                    else:
                        outer_taps(d + 1, c, base, kvs + [kv])

            def last_taps(c, x_base, kvs):
                xs = {}
                for e in offsets:
                    iw = ix.add(i_base, str(e)) if e >= 0 else f"{i_base} - {-e}"
                    if masked:
                        cond = bounds(f"({iw})", lo_fails and e < 0, sizes[-1] if hi_fails else None)
                    if masked and cond:
                        clamped = f"min(max({iw}, 0), {sizes[-1] - 1})"
                        xs[e] = ctx.let(f"({load_f(x, ix.add(x_base, clamped))} if {' and '.join(cond)} else 0.0)", "xv")
                    else:
                        xs[e] = ctx.let(load_f(x, ix.add(x_base, iw)), "xv")
                for kv in range(kl):
                    if not reads[kv]:
                        continue
                    tap = ix.ravel(kvs + [str(kv)], tuple(int(np.prod(self.kernel[d + 1:], dtype=np.int64)) for d in range(k)))
                    if packed is not None:
                        wk = ctx.let(ix.add(wbase, ix.mul(ix.add(ix.mul(c, taps), tap), blocks * O * 4)), "wk")
                        ws = [ctx.let(f"weights.read(float, {ix.add(wk, str(4 * j))})", "w") for j in range(O)]
                    else:
                        c_abs = ix.add(ix.mul(grp, cg), c) if self.group > 1 else c
                        ws = [ctx.let(load_f(w, ix.ravel([c_abs, wm[j]] + kvs + [str(kv)], w.strides)), "w")
                              for j in range(O)]
                    for pp, e in reads[kv]:
                        for j in range(O):
                            ctx.line(f"{acc[pp][j]} = fma({xs[e]}, {ws[j]}, {acc[pp][j]})")

            with ctx.loop(cg, "c") as c:
                c_abs = ix.add(ix.mul(grp, cg), c) if self.group > 1 else c
                outer_taps(0, c, ix.add(ix.mul(n, x.strides[0]), ix.mul(c_abs, x.strides[1])), [])

        emit_strip(ctx, ([f"{i_base} >= {-offsets[0]}"] if lo_fails else [])
                   + ([f"{ix.add(i_base, str(offsets[-1]))} < {sizes[-1]}"] if hi_fails else []), nest)
        done = finished(ctx, acc, y)
        o_last = ctx.let(ix.mul(strip, P), "o")
        in_row = g.out[-1] % P or P  # a ragged last strip: its positions past the row store nothing
        for j in range(O):
            m = ix.add(ix.mul(grp, mg), m0, str(j))
            base = ix.add(ix.mul(n, y.strides[0]), ix.mul(m, y.strides[1]),
                          *(ix.mul(o, st) for o, st in zip(outer, y.strides[2:-1])), o_last)
            if j >= safe:
                ctx.line(f"if {ix.add(m0, str(j))} < {mg}:")
                ctx.level += 1
            for pp in range(P):
                ctx.line_if(None if pp < in_row else f"{ix.add(o_last, str(pp))} < {g.out[-1]}",
                            y.store(ix.add(base, str(pp)), done[pp][j]))
            if j >= safe:
                ctx.level -= 1

    def describe(self) -> str:
        t = self.tiles()
        if t is None:
            return super().describe() + "; a thread per output element"
        return super().describe() + f"; a thread per {t[0]} outputs along the row x {t[1]} channels"
