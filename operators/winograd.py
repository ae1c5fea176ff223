"""Winograd convolution: a 2-D 3x3 stride-1 Conv as F(m x m, 3 x 3), three stages in place of one.

Each m x m tile of outputs comes from an (m + 2)^2 patch of the input. With a = m + 2 and E = a^2:
1. `WinogradInput`: V[e][c][t] = (B^T d B)[e] for every channel c and tile t (d the tile's patch,
   zero outside the input): a thread per (channel, tile), 36 loads and 36 stores for m = 4;
2. `WinogradProduct`: E independent matrix products M[e] = V[e] U[e] over the channels, U[e] = (G g
   G^T)[e] the weights transformed once at compile time (float64, then float32) and stored in the
   weight blob: on CUDA the cooperative GEMM tile (operators/tiled.py) with a tile's rows = (sample,
   tile) — a block covers several samples when a sample has few tiles (`block_samples`) — and
   elsewhere a thread per element;
3. `WinogradOutput`: Y = A^T M A + bias per (output channel, tile), its stores the usual epilogue
   (BatchNorm, the residual Add, Relu).
F(4x4, 3x3) does 36 / 16 = 2.25 multiply-adds an output per channel pair against 9 for the direct
form, F(2x2, 3x3) 4; the price is V and M (E / m^2 times the input and output) through memory, and
rounding: the transforms' coefficients (up to 8 for m = 4) lose about a decimal digit of float32 over
the direct sum (relative error ~2e-6 of the output's largest value per layer for m = 4, ~3e-7 for
m = 2, against ~2e-7 direct; tests/operators/test_winograd.py measures it against onnxruntime).

luisaml/rewrites/winograd.py replaces the Conv nodes that qualify (luisaml/compiler.py calls it; compile's
`winograd` decides: F(4x4) on CUDA by default). The per-sample `forward` keeps the direct form.
ResNet-18 at batch 32 on the H200: 4.65 -> 3.06 ms (benchmarks/NOTES.md, "Winograd convolutions and
tiles of samples").

Why a rewrite into three nodes rather than one operator with three forms: the intermediates then get
pooled buffers, the schedule fuses the epilogue, inspect shows each stage, all with no new
machinery. A Conv qualifies when it is 3x3, stride 1, one group, float, of 16+ channels;
compile(winograd="auto") rewrites on CUDA, 4 or 2 on either backend.
"""
from __future__ import annotations

import contextlib
import math
from fractions import Fraction as Fr

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.model import Node
from luisaml.operator import Operator

from .conv import store_f

# F(m x m, 3 x 3): (B^T, G, A^T), exact; points 0, +-1, +-1/2 for m = 2 and 0, +-1, +-2 (and infinity)
# for m = 4, as in Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks" (2016)
_F = {
    2: ([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [Fr(1, 2), Fr(1, 2), Fr(1, 2)], [Fr(1, 2), Fr(-1, 2), Fr(1, 2)], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]]),
    4: ([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
         [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
        [[Fr(1, 4), 0, 0], [Fr(-1, 6), Fr(-1, 6), Fr(-1, 6)], [Fr(-1, 6), Fr(1, 6), Fr(-1, 6)],
         [Fr(1, 24), Fr(1, 12), Fr(1, 6)], [Fr(1, 24), Fr(-1, 12), Fr(1, 6)], [0, 0, 1]],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]),
}
TILES = tuple(_F)

# a Conv takes the Winograd form from this many input and output channels: below it the product's
# k loop is too short for the transforms' traffic to pay (and the direct form's tile is small anyway)
MIN_CHANNELS = 16


def transforms(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (B^T, G, A^T) of F(m x m, 3 x 3) as float64 arrays."""
    return tuple(np.array([[float(v) for v in row] for row in mat]) for mat in _F[m])


def transformed_weights(w: np.ndarray, m: int) -> np.ndarray:
    """Return U[e][c][k] = (G w[k, c] G^T)[e] (e = row * a + column) as float32, from W [K, C, 3, 3]."""
    _, g, _ = transforms(m)
    u = np.einsum("ei,kcij,fj->efck", g, np.asarray(w, np.float64), g, optimize=True)
    a = m + 2
    return np.ascontiguousarray(u.reshape(a * a, w.shape[1], w.shape[0]), dtype=np.float32)


def _combine(coefs, names: list[str]) -> str:
    """Return the DSL of sum(coef * name) over the nonzero integer coefficients."""
    out = ""
    for c, name in zip(coefs, names):
        c = int(c)
        if c == 0:
            continue
        term = name if abs(c) == 1 else f"{name} * {float(abs(c))}"
        out += (f" - {term}" if c < 0 else f" + {term}") if out else (f"-{term}" if c < 0 else term)
    return out or "0.0"


def _transform2(ctx, left: np.ndarray, d: list[list[str]], right: np.ndarray, prefix: str) -> list[list[str]]:
    """Emit left · d · right^T over names and return the result's names (rows of left x rows of right)."""
    rows = [[ctx.let(_combine(left[r], [d[i][j] for i in range(len(d))]), prefix) for j in range(len(d[0]))]
            for r in range(left.shape[0])]
    return [[ctx.let(_combine(right[s], rows[r]), prefix) for s in range(right.shape[0])] for r in range(len(rows))]


class _Winograd(Operator):
    """Shared geometry of the three stages: m, a, E, C, K, the tiles, units (the leading dimension)."""

    def __init__(self, node: Node, inputs, outputs, m: int, conv):
        g = conv.geo
        x = conv.input(0)
        self.m, self.a = m, m + 2
        self.E = self.a * self.a
        self.C, self.K = x.shape[1], conv.M
        self.H, self.W = x.shape[2], x.shape[3]
        self.Ho, self.Wo = g.out
        self.pt, self.pl = g.pads_begin
        self.TH, self.TW = -(-self.Ho // m), -(-self.Wo // m)
        self.T = self.TH * self.TW
        self.units = x.shape[0]  # 1 a sample, or the batch of a graph compiled for one batch size
        super().__init__(node, inputs, outputs, conv.opset)

    def check(self) -> None:
        pass  # the rewrite built the node from a checked Conv

    def forward(self, ctx) -> None:
        """The per-sample `forward` (one thread a sample) runs the direct form, all of it in
        WinogradOutput: a thread gains nothing from the transforms, and their code would be 7 KB of
        source a node (ResNet-18's forward: 305 KB with them, 23 KB without)."""
        ctx.comment("Winograd stage: in `forward` the direct form, in WinogradOutput")


class WinogradInput(_Winograd):
    """V[u][e][c][t] = (B^T d B)[e], d the (m + 2)^2 input patch of tile t (zero outside X)."""

    shared_kernel = "winograd_input"

    def work_items(self) -> int:
        return self.units * self.C * self.T

    def emit_item(self, ctx, item: str) -> None:
        x, v = self.input(0), self.output()
        a, T = self.a, self.T
        u, c, t = (ctx.let(s, "w") for s in ix.unravel(item, (self.units, self.C, T)))
        ty, tx = ix.mul(ix.div(t, self.TW), self.m), ix.mul(ix.mod(t, self.TW), self.m)  # the tile's first output
        y0 = ctx.let(f"({ty}) - {self.pt}" if self.pt else ty, "wy")  # its patch's first input row and column
        x0 = ctx.let(f"({tx}) - {self.pl}" if self.pl else tx, "wx")
        base = ctx.let(ix.add(ix.mul(u, x.strides[0]), ix.mul(c, x.strides[1])), "wb")
        rows, cols = [], []
        for i in range(a):  # each patch row and column: its index clamped inside X, and whether it is inside
            iy = ctx.let(ix.add(y0, str(i)) if i else y0, "iy")
            rows.append((ctx.let(f"min(max({iy}, 0), {self.H - 1})", "cy"), f"{iy} >= 0 and {iy} < {self.H}"))
            jx = ctx.let(ix.add(x0, str(i)) if i else x0, "ix")
            cols.append((ctx.let(f"min(max({jx}, 0), {self.W - 1})", "cx"), f"{jx} >= 0 and {jx} < {self.W}"))
        d = [[ctx.let(f"({x.load(ix.add(base, ix.mul(ry, self.W), rx))} if {cy} and {cx} else 0.0)", "d")
              for rx, cx in cols] for ry, cy in rows]
        bt, _, _ = transforms(self.m)
        vals = _transform2(ctx, bt, d, bt, "v")
        out = ctx.let(ix.add(ix.mul(u, v.strides[0]), ix.mul(c, T), t), "vo")
        for e in range(self.E):
            ctx.line(v.store(ix.add(out, str(e * self.C * T)) if e else out, vals[e // a][e % a]))

    def describe(self) -> str:
        return f"Winograd F({self.m}x{self.m}, 3x3) input transform: a thread per (channel, tile of {self.m}x{self.m})"


class WinogradProduct(_Winograd):
    """M[u][e][k][t] = sum over c of V[u][e][c][t] U[e][c][k], U the transformed weights in the blob."""

    def __init__(self, node, inputs, outputs, m, conv, blob):
        self.blob = blob
        self.weight = conv.input(1)
        super().__init__(node, inputs, outputs, m, conv)

    def packed(self) -> int:
        """Return the byte offset of U [E][C][K] in the weight blob (computed on first use)."""
        w, m = self.weight, self.m
        return self.blob.add_packed(f"{w.name}/winograd{m}[{self.E}x{self.C}x{self.K}]",
                                    lambda: transformed_weights(w.value, m))

    def work_items(self) -> int:
        return self.units * self.E * self.K * self.T

    def emit_item(self, ctx, item: str) -> None:
        v, mt = self.input(0), self.output()
        C, K, T = self.C, self.K, self.T
        u, e, k, t = (ctx.let(s, "w") for s in ix.unravel(item, (self.units, self.E, K, T)))
        vb = ctx.let(ix.add(ix.mul(u, v.strides[0]), ix.mul(e, C * T), t), "vb")
        wb = ctx.let(ix.add(str(self.packed()), ix.mul(ix.add(ix.mul(e, C * K), k), 4)), "ub")
        acc = ctx.fresh("acc")
        ctx.line(f"{acc} = 0.0")
        with ctx.loop(C, "c") as c:
            ctx.line(f"{acc} += {v.load(ix.add(vb, ix.mul(c, T)))} * weights.read(float, {ix.add(wb, ix.mul(c, K * 4))})")
        ctx.line(mt.store(ix.add(ix.mul(u, mt.strides[0]), ix.mul(e, K * T), ix.mul(k, T), t), acc))

    # ---- on CUDA: the GEMM tile, rows = (unit, tile), columns = output channels, k = input channels ----

    def group(self) -> int:
        """Samples a block's rows cover: enough that the rows fill whole 64-row tiles (a sample of 4
        tiles, ResNet's 7 x 7 layers: 16 samples), at most 64; 1 for a graph of fixed batch."""
        return min(64 // math.gcd(self.T, 64), 64) if self.output().batched else 1

    # the products as the tensor-core tile (operators/tiled_mma.py) where the plan asks: "tf32", or False
    tensor_cores = False

    def block_tiling(self):
        from . import tiled

        if self.output().dtype is not dtypes.FLOAT:
            return None
        if self.tensor_cores:  # (luisaml/rewrites/tensor_cores.py; None: a product too small for it)
            from luisaml.device import sm_count

            from . import tiled_mma

            # as Gemm's: a product launched whole (no batch the plan does not know) may take smaller tiles
            sms = 0 if self.output().batched else sm_count()
            mma = tiled_mma.choose(self.units * self.group() * self.T, self.K, self.C, self.E, sms=sms)
            if mma is not None:
                return mma
        return tiled.choose(self.units * self.group() * self.T, self.K, self.C, self.E, m_fast=True, pipelined=True,
                            narrow=True)

    def block_samples(self) -> int:
        return self.group() if self.block_tiling() is not None else 1

    def emit_block(self, ctx, item: str, thread: str) -> None:
        from . import tiled

        v, mt = self.input(0), self.output()
        C, K, T, E = self.C, self.K, self.T, self.E
        tl = self.block_tiling()
        G = self.group()
        packed = self.packed()
        # the group's samples that exist: the last group of a batch may hold fewer
        rows = tiled.group_rows(ctx, G, T) if G > 1 else None

        def at_row(m):
            """(a function giving the bindings to enter, the unit under them, the tile) of row m: a
            row of another sample of the group is read at that sample (a pooled buffer's samples lie
            its slot's size apart, not E x C x T)."""
            if self.units * G == 1:
                return contextlib.nullcontext, "0", m
            u, t = ctx.let(ix.div(m, T), "wu"), ctx.let(ix.mod(m, T), "wt")
            if G > 1:
                s = ctx.let(ix.add(ctx.sample, u), "ws")
                return (lambda: ctx.at_sample(s)), "0", t
            return contextlib.nullcontext, u, t

        def a_row(e, m):
            binding, u, t = at_row(m)
            base = ctx.let(ix.add(ix.mul(u, E * C * T), ix.mul(e, C * T), t), "va")

            def load(c):
                with binding():
                    return v.load(ix.add(base, ix.mul(c, T)))

            return load

        def b_column(e, n):
            base = ctx.let(ix.add(str(packed), ix.mul(ix.add(ix.mul(e, C * K), n), 4)), "ub")
            return lambda c: f"weights.read(float, {ix.add(base, ix.mul(c, K * 4))})"

        b_quad = None
        if packed % 16 == 0 and K % 4 == 0:
            def b_quad(e, n):  # n a multiple of 4: U[e][c][n .. n + 3] in one 16-byte load
                base = ctx.let(ix.add(str(packed), ix.mul(ix.add(ix.mul(e, C * K), n), 4)), "uq")
                return lambda c: f"weights.read(float4, {ix.add(base, ix.mul(c, K * 4))})"

        def store(e, m, n, value):
            binding, u, t = at_row(m)
            with binding():
                return mt.store(ix.add(ix.mul(u, E * K * T), ix.mul(e, K * T), ix.mul(n, T), t), value)

        idle = contextlib.nullcontext()
        if G > 1:  # a tile wholly past the group's rows leaves (uniform in the block)
            rb = ix.mod(ix.div(item, tl.col_blocks), tl.row_blocks)
            ctx.line(f"if {ix.mul(f'({rb})', tl.BM)} < {rows}:")
            idle = ctx.indent()
        with idle:
            if getattr(tl, "mma", False):
                from . import tiled_mma

                tiled_mma.emit(ctx, tl, item, thread, a_row, b_column, lambda e, m, n, acc: acc, store,
                               a_m_contiguous=True, m_limit=rows)
                return
            tiled.emit(ctx, tl, item, thread, a_row, b_column, lambda e, m, n, acc: acc, store,
                       a_m_contiguous=True, b_quad=b_quad, m_limit=rows)

    def describe(self) -> str:
        return (f"Winograd F({self.m}x{self.m}, 3x3): {self.E} products of (tiles x {self.C}) by ({self.C} x {self.K}),"
                f" a thread per element")

    def describe_block(self) -> str:
        G = self.group()
        return (f"Winograd F({self.m}x{self.m}, 3x3): {self.E} products of (tiles x {self.C}) by ({self.C} x {self.K}): "
                f"{self.block_tiling().describe()}" + (f", a block's rows the tiles of {G} samples" if G > 1 else ""))


class WinogradOutput(_Winograd):
    """Y[u][k][tile] = A^T M A (+ B[k]), the tile's outputs inside Y stored, each once."""

    stores_once = True
    shared_kernel = "winograd_output"

    def __init__(self, node, inputs, outputs, m, conv):
        self.conv = conv
        super().__init__(node, inputs, outputs, m, conv)

    def forward(self, ctx) -> None:
        self.conv.forward(ctx)

    def work_items(self) -> int:
        return self.units * self.K * self.T

    def emit_item(self, ctx, item: str) -> None:
        mt, y = self.input(0), self.output()
        a, m, K, T = self.a, self.m, self.K, self.T
        u, k, t = (ctx.let(s, "w") for s in ix.unravel(item, (self.units, K, T)))
        src = ctx.let(ix.add(ix.mul(u, mt.strides[0]), ix.mul(k, T), t), "mo")
        vals = [[ctx.let(mt.load(ix.add(src, str((r * a + s) * K * T)) if r or s else src), "mv") for s in range(a)]
                for r in range(a)]
        _, _, at = transforms(m)
        out = _transform2(ctx, at, vals, at, "o")
        bias = f" + {self.input(1).load(k)}" if self.has_input(1) else ""
        oy = ctx.let(ix.mul(ix.div(t, self.TW), m), "oy")
        ox = ctx.let(ix.mul(ix.mod(t, self.TW), m), "ox")
        base = ctx.let(ix.add(ix.mul(u, y.strides[0]), ix.mul(k, y.strides[1]), ix.mul(oy, self.Wo), ox), "yo")
        for i in range(m):
            for j in range(m):
                conds = ([f"{oy} + {i} < {self.Ho}"] if self.Ho % m else []) + ([f"{ox} + {j} < {self.Wo}"] if self.Wo % m else [])
                value = ctx.let(f"{out[i][j]}{bias}", "f")  # one statement: an epilogue may read it twice
                ctx.line_if(" and ".join(conds) or None, store_f(y, ix.add(base, str(i * self.Wo + j)), value))

    def describe(self) -> str:
        return f"Winograd F({self.m}x{self.m}, 3x3) output transform: a thread per (output channel, tile)"


def qualifies(conv) -> str | None:
    """Return why a Conv operator cannot take the Winograd form, or None when it can."""
    x, w = conv.input(0), conv.input(1)
    g = conv.geo
    if type(conv).__name__ != "Conv" or conv.k != 2:
        return "not a 2-D Conv"
    if conv.kernel != [3, 3] or g.strides != [1, 1] or g.dilations != [1, 1] or conv.group != 1:
        return "not 3x3, stride 1, dilation 1, one group"
    if x.dtype is not dtypes.FLOAT or w.value is None or (conv.has_input(2) and conv.input(2).value is None):
        return "not float32 with constant weights"
    if x.shape[1] < MIN_CHANNELS or conv.M < MIN_CHANNELS:
        return f"fewer than {MIN_CHANNELS} channels"
    if min(g.out) < 1:
        return "an empty output"
    return None
