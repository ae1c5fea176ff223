"""Conv's GPU form: the implicit GEMM in blocks through shared memory, on tiled.py's FP32 tile or, where
the plan asks for tensor cores, tiled_mma.py's TF32 mma tile (operators/conv.py's Conv delegates its
block_tiling, block_samples and emit_block here).

Per group the product's rows m are (sample, output position), its columns the group's output
channels, its k (input channel in the group, kernel tap): A is the im2col view of X, never
materialised, B the weights (prepacked in the blob where constant). On the mma tile a sample of
fewer output positions than the tile's 128 rows (ResNet-50's 7 x 7 layers at 224 x 224: 49 rows a
sample, under a warp's 64) shares a block's rows with the next samples (a grouped blocks stage,
Operator.block_samples, as Winograd's products: operators/winograd.py), each row read and written at
its own sample (KernelContext.at_sample); the FP32 tile keeps one sample a block. On the mma tile k runs
(tap, channel) (k_layout; GATHER): a k step's 16 k's are channels of one tap (or whole taps of a few
padded channels), so a thread's row decides its tap, bounds and address once a step and each element is
that address plus a channel stride (StepLoader); W keeps its (channel, tap) rows, read at c * taps + tap.

A 1 x 1 Conv over a 1 x 1 input (a squeeze-and-excitation's two fully connected layers, a head written
as Conv) is a dot product an output: a warp per output channel of a sample (operators/rows.py's
RowTiling, the lanes' partial sums combined with warp_active_sum; `dot_tiling`). The product has one
row a sample, so the tiles above had too few rows to fill the GPU: EfficientNet-B0's fc layers at
batch 32 ran as 32 to 64 threads (one item a sample) or 2 to 9 blocks, 0.34 ms for its slowest."""
from __future__ import annotations

import contextlib
import math
import os

import numpy as np

from luisaml import indexing as ix

from .common import load_f
from .conv import bounds, lin, store_f

# (the mma tile) a sample of fewer output positions than this shares a block's rows with others
MMA_ROWS = 128
# the dot form (dot_tiling) reads W's row once an output of every sample, from L2 after the first:
# bounded so that W stays in L2 and a large batch's re-reads stay small against a tile's (EfficientNet-B0's
# largest fc, 1,152 x 48, is 55,296 weights; a 1,000-class head over 2,048 channels keeps its tile)
DOT_MAX_WEIGHTS = 1 << 17
# a product of fewer k than this (input channels a group x taps), under one k step of the mma tile, runs direct
# (`direct`): Conv's items form, a thread per output position x 16 channels (conv.tiles: P = 1), each output's
# k multiply-adds from L1 and a warp's stores 32 consecutive positions of a channel, rather than a tile whose
# fixed work -- A's and B's copies into shared memory, the barriers, a thread's 64 or 128 stores with their
# index arithmetic -- buys one k step, most of it padding (wav2vec2's first layer, 1 channel x 10 taps: the mma
# tile's one step of 16, 0.169 ms on the H100 for an output of 52 MB; benchmarks/NOTES.md, "wav2vec2's first
# layer on CUDA"). 16 k (a 1 x 1 over 16 channels: MobileNet-V3's, EfficientNet's, SqueezeNet's) fill the step
# and keep their tile.
DIRECT_K = 16
# The mma tile's im2col gather (benchmarks/NOTES.md, "Conv's gather on the tensor-core tile"): "step" orders
# k as (tap, channel) where a group's channels are a multiple of the k step, so a step's k's are channels of
# one tap: the tap, its bounds tests and clamps and the row's address are worked out once a row a step
# (StepLoader.at_step) and each element is that address plus its channel's stride; "first" decomposes each
# k into (channel, taps) by divisions and tests its bounds, the gather as first merged (kept to measure
# against). "reuse" is "step" with the steps in another order: a block of BK channels through every tap in
# turn, then the next block (k = (channel block, tap, channel)), so the input lines a step reads (its 16
# channels' rows, and the halo a stride or the next tap shares) are read again from L1 by the next taps'
# steps instead of from L2 a whole pass over the channels later (benchmarks/NOTES.md, "The mma tile's loads
# are in flight"); the same products summed in another order, so not bit-identical to "step". Where a group's
# channels are fewer than BK or its taps one, "reuse" is "step". LUISAML_CONV_GATHER where set, else GATHER
# (read at plan time: one process, one gather).
GATHERS = ("step", "first", "reuse")
GATHER = "step"


class StepLoader:
    """A RowLoader's k -> element that tiled_mma.emit may instead ask at_step(k0, kk) -> element: k is the
    step's k0, a multiple of the step, plus kk below it (a run-time expression)."""

    def __init__(self, load, at_step):
        self.load, self.at_step = load, at_step

    def __call__(self, k: str) -> str:
        return self.load(k)


def k_layout(conv, BK: int = 16) -> tuple[int, int] | None:
    """(cpad, tpad) of the "step" gather's k = tap * cpad + channel (tpad taps of cpad channels, the padding's
    k zero on both sides): a group's channels where they are a multiple of the k step BK (no padding), else
    for fewer channels than BK their next power of two and the taps padded to whole steps (a stem's 3
    channels: 4 a tap, 4 taps a step, 7 x 7 taps as 52); None under the "first" gather or for other counts."""
    gather = _gather()
    cg, taps = conv.input(0).shape[1] // conv.group, int(np.prod(conv.kernel, dtype=np.int64))
    if gather == "first" or (cg % BK and cg > BK):
        return None
    if cg % BK == 0:
        return cg, taps
    cpad = 1 << (cg - 1).bit_length()
    return cpad, -(-taps // (BK // cpad)) * (BK // cpad)


def _gather() -> str:
    gather = os.environ.get("LUISAML_CONV_GATHER") or GATHER
    if gather not in GATHERS:
        raise ValueError(f"conv_tiles: unknown gather {gather!r} (one of {GATHERS})")
    return gather


def taps_inner(conv, BK: int = 16) -> bool:
    """Whether the "reuse" gather orders conv's steps (channel block, tap): k_layout's channels a multiple of BK
    and more than one tap (else its order is "step"'s)."""
    layout = k_layout(conv, BK)
    return _gather() == "reuse" and layout is not None and layout[0] % BK == 0 and layout[1] > 1


def tap_major(conv, tl) -> bool:
    """Whether conv's product on tiling tl orders k as k_layout's (tap, channel): the mma tile under the
    "step" gather."""
    return bool(getattr(tl, "mma", False)) and k_layout(conv, tl.BK) is not None


def dot_tiling(conv):
    """The dot form's tiling of a 1 x 1 Conv of one group over a 1 x 1 float input (channels
    contiguous) of rows.MIN_LENGTH or more channels and at most DOT_MAX_WEIGHTS weights: a warp
    per output channel of a sample (rows.RowTiling over the output's elements); else None."""
    from . import rows

    x, w, y = conv.input(0), conv.input(1), conv.output()
    if conv.group != 1 or any(t.dtype.dsl != "float" for t in (x, w, y)):
        return None
    if any(v != 1 for v in list(conv.kernel) + list(x.shape[2:]) + list(y.shape[2:])):
        return None
    C = x.shape[1]
    if C < rows.MIN_LENGTH or conv.M * C > DOT_MAX_WEIGHTS or x.strides[1] != 1 or w.strides[1] != 1:
        return None
    return rows.choose(y.numel, C)


def emit_dot(conv, ctx, tiling, item: str, thread: str) -> None:
    """Emit output (sample, channel) `row` of the dot form: lane l sums x[c] * W[m, c] over c = l,
    l + 32, ... (rows.fold_row), lane 0 stores the sum plus the bias through the stage's epilogue."""
    from . import rows

    x, w, y = conv.input(0), conv.input(1), conv.output()
    lead = (y.shape[0], conv.M)
    bases = {}

    def place(row):
        n, m = [ctx.let(c, "o") if d > 1 else "0" for c, d in zip(ix.unravel(row, lead), lead)]
        bases["x"] = ctx.let(ix.mul(n, x.strides[0]), "xb")
        bases["w"] = ctx.let(ix.mul(m, w.strides[0]), "wb")
        bases["m"] = m
        return "0", lambda v: store_f(y, ix.add(ix.mul(n, y.strides[0]), ix.mul(m, y.strides[1])), v)

    def load(c):
        return f"{load_f(x, ix.add(bases['x'], c))} * {load_f(w, ix.add(bases['w'], c))}"

    def finish(total):
        return f"{total} + {load_f(conv.input(2), bases['m'])}" if conv.has_input(2) else total

    rows.fold_row(ctx, tiling, item, thread, place, load, "0.0", lambda acc, v: f"{acc} + {v}",
                  lambda a, b: f"{a} + {b}", "sum", finish)


def samples_a_tile(conv) -> int:
    """Samples the rows of a block of conv's mma tile cover: 1, or for a batched output of fewer than
    MMA_ROWS positions a sample enough that the rows fill whole 64-row tiles (WinogradProduct.group's
    rule), at most 64."""
    positions = int(np.prod(conv.geo.out, dtype=np.int64))
    if not conv.output().batched or conv.output().shape[0] != 1 or positions >= MMA_ROWS:
        return 1
    return min(64 // math.gcd(positions, 64), 64)


def direct(conv) -> bool:
    """Whether conv runs direct on the GPU (DIRECT_K): a float Conv of one group in a blocks plan (not the
    CPU's) whose product has fewer than DIRECT_K k and that the dot form does not take. (A grouped or
    depthwise Conv keeps its items form's strips: a row window's loads shared by P outputs.)"""
    x, w, y = conv.input(0), conv.input(1), conv.output()
    if conv.no_blocks or conv.group != 1 or any(t.dtype.dsl != "float" for t in (x, w, y)):
        return False
    return x.shape[1] * int(np.prod(conv.kernel, dtype=np.int64)) < DIRECT_K and dot_tiling(conv) is None


def block_tiling(conv):
    """Conv.block_tiling: the dot form where dot_tiling takes the Conv; None (the items form, direct) for a
    product of fewer than DIRECT_K k (`direct`); the mma tiling where conv.tensor_cores and tiled_mma.choose takes the
    product (over samples_a_tile samples), else tiled.py's FP32 tiling (None: no block form)."""
    from . import tiled

    x, w, y = conv.input(0), conv.input(1), conv.output()
    if any(t.dtype.dsl != "float" for t in (x, w, y)):
        return None
    dot = dot_tiling(conv)
    if dot is not None:
        return dot
    taps = int(np.prod(conv.kernel, dtype=np.int64))
    rows = y.shape[0] * int(np.prod(conv.geo.out, dtype=np.int64))
    K = x.shape[1] // conv.group * taps
    if direct(conv):
        return None
    if conv.tensor_cores:  # (luisaml/rewrites/tensor_cores.py; None: too few channels a group, as a depthwise conv's)
        from luisaml.device import sm_count

        from . import tiled_mma

        # as Gemm's: a product launched whole (no batch the plan does not know) may take smaller tiles
        sms = 0 if y.batched else sm_count()
        layout = k_layout(conv)  # (the step gather's k: padded taps of padded channels where a group has few)
        mma = tiled_mma.choose(rows * samples_a_tile(conv), conv.M // conv.group,
                               layout[0] * layout[1] if layout else K, conv.group, sms=sms)
        if mma is not None:
            return mma
    return tiled.tuned(tiled.choose(rows, conv.M // conv.group, K, conv.group, m_fast=True, pipelined=True),
                       conv.schedule)


def block_samples(conv) -> int:
    """Conv.block_samples: samples_a_tile on the mma tile, else 1."""
    return samples_a_tile(conv) if getattr(block_tiling(conv), "mma", False) else 1


def emit_block(conv, ctx, item: str, thread: str) -> None:
    """Conv.emit_block: block `item`'s tile for thread `thread`."""
    from . import rows, tiled

    x, w, y = conv.input(0), conv.input(1), conv.output()
    g, tl = conv.geo, block_tiling(conv)
    if isinstance(tl, rows.RowTiling):
        emit_dot(conv, ctx, tl, item, thread)
        return
    mg, cg = conv.M // conv.group, x.shape[1] // conv.group
    taps = int(np.prod(conv.kernel, dtype=np.int64))
    K = cg * taps  # (W's rows a group; the tile's k may pad them: k_layout)
    positions = int(np.prod(g.out, dtype=np.int64))
    sizes = x.shape[2:]
    mma = getattr(tl, "mma", False)
    G = block_samples(conv)

    def at_row(m, named: bool):
        """(the bindings to enter, the sample within the tensor, the output position) of row m: a row of
        another sample of the group is read and written at that sample (a pooled buffer's samples lie
        its slot's size apart). named: the sample in a variable (a row's loads, emitted once)."""
        if G > 1:
            s = ctx.let(ix.add(ctx.sample, ix.div(m, positions)), "cs")
            return (lambda: ctx.at_sample(s)), "0", ix.mod(m, positions)
        if y.shape[0] == 1:
            return contextlib.nullcontext, "0", m
        nn = ctx.let(ix.div(m, positions), "nn") if named else ix.div(m, positions)
        return contextlib.nullcontext, nn, ix.mod(m, positions)

    by_tap = tap_major(conv, tl)
    cpad, tpad = k_layout(conv, tl.BK) if by_tap else (cg, taps)
    inner = by_tap and taps_inner(conv, tl.BK)  # ("reuse": step s is channel block s // tpad at tap s % tpad)
    steps = {}

    def step_of(k0):
        """(first tap, first channel) of step k0 (a multiple of the step), tap-major ("reuse": taps inner): once
        a step for every row and column of the thread."""
        if k0 not in steps and inner:
            s = ix.div(k0, tl.BK)
            steps[k0] = (ctx.let(ix.mod(s, tpad), "tp"), ctx.let(ix.mul(ix.div(s, tpad), tl.BK), "kc"))
        if k0 not in steps:
            steps[k0] = (ctx.let(ix.div(k0, cpad), "tp") if tpad > 1 else "0",
                         k0 if tpad == 1 else ctx.let(ix.mod(k0, cpad), "kc") if cpad > tl.BK else "0")
        return steps[k0]

    def tap_channel(k):
        """(tap, channel) of a whole k (the loaders' k -> element, where tiled_mma does not ask at_step)."""
        if inner:
            s = ctx.let(ix.div(k, tl.BK), "ks")
            return ix.mod(s, tpad), ix.add(ix.mul(ix.div(s, tpad), tl.BK), ix.mod(k, tl.BK))
        return ix.div(k, cpad), ix.mod(k, cpad)

    def split(kk):
        """(tap, channel) offsets of k offset kk from its step's first: a step within one tap (cpad a multiple
        of the step) or over BK / cpad taps (constants where kk is)."""
        return ("0", kk) if cpad >= tl.BK else (ix.div(kk, cpad), ix.mod(kk, cpad))

    def in_channel(c):
        """(c clamped to the group's channels, the condition that it is one of them) for a padded channel."""
        if cpad == cg or c.isdigit():
            return c, []
        return f"min({c}, {cg - 1})", [f"{c} < {cg}"]

    def window(starts, tap_coords, idx, conds):
        """Append to idx the input offsets of a row's window at tap_coords (clamped where a bound may
        fail) and to conds those bounds (both gathers' loaders)."""
        for d in range(conv.k):
            iv = ctx.let(ix.add(starts[d], ix.mul(tap_coords[d], g.dilations[d])), "iv")
            last = (g.out[d] - 1) * g.strides[d] + (g.kernel[d] - 1) * g.dilations[d] - g.pads_begin[d]
            cond = bounds(iv, g.pads_begin[d] > 0, sizes[d] if last >= sizes[d] else None)
            conds += cond
            idx.append(ix.mul(f"min(max({iv}, 0), {sizes[d] - 1})" if cond else iv, x.strides[2 + d]))

    def a_row(bi, m):
        binding, nn, pos = at_row(m, True)
        if by_tap:
            return a_row_by_tap(bi, binding, nn, pos)
        outs = ix.unravel(pos, tuple(g.out))
        starts = [ctx.let(lin([(o, s)], -p), "is") for o, s, p in zip(outs, g.strides, g.pads_begin)]
        x_base = ctx.let(ix.add(ix.mul(nn, x.strides[0]), ix.mul(bi, cg * x.strides[1])), "xb")

        def load(k):
            c, *taps = [ctx.let(v, "kc") for v in ix.unravel(k, (cg, *conv.kernel))]
            idx, conds = [ix.mul(c, x.strides[1])], []
            window(starts, taps, idx, conds)
            with binding():
                v = load_f(x, ix.add(x_base, *idx))
            return f"({v} if {' and '.join(conds)} else 0.0)" if conds else v

        return load

    packed = conv.packed_w()
    _, O, _, blocks = conv.tiles()

    def b_column(bi, n):
        if packed is not None:  # [group][K][channel blocks x O]
            base = ctx.let(ix.add(str(packed), ix.mul(bi, K * blocks * O * 4), ix.mul(n, 4)), "wb")
            return lambda k: f"weights.read(float, {ix.add(base, ix.mul(k, blocks * O * 4))})"
        base = ctx.let(ix.mul(ix.add(ix.mul(bi, mg), n), w.strides[0]), "wb")  # W[m, c, taps...] = W[m][k]
        return lambda k: load_f(w, ix.add(base, k))

    def a_row_by_tap(bi, binding, nn, pos):
        """a_row's loader for k = tap * cpad + channel (k_layout)."""
        outs = ix.unravel(pos, tuple(g.out))
        starts = [ctx.let(lin([(o, s)], -p), "is") for o, s, p in zip(outs, g.strides, g.pads_begin)]
        x_base = ctx.let(ix.add(ix.mul(nn, x.strides[0]), ix.mul(bi, cg * x.strides[1])), "xb")
        at_tap = {}

        def row_at(tap, c0):
            """(the row's address at tap and channel c0, its conditions): once a step a tap."""
            if (tap, c0) not in at_tap:
                tds = [ctx.let(v, "kt") for v in ix.unravel(tap, tuple(conv.kernel))]
                idx, conds = [], [f"{tap} < {taps}"] if tpad > taps else []
                window(starts, tds, idx, conds)
                at_tap[tap, c0] = ctx.let(ix.add(x_base, ix.mul(c0, x.strides[1]), *idx), "xa"), conds
            return at_tap[tap, c0]

        def element(tap, c0, c):
            if c.isdigit() and int(c) >= cg:  # (a padded channel: zero)
                return "0.0"
            base, conds = row_at(tap, c0)
            c, cc = in_channel(c)
            with binding():
                v = load_f(x, ix.add(base, ix.mul(c, x.strides[1])))
            return f"({v} if {' and '.join(conds + cc)} else 0.0)" if conds + cc else v

        def load(k):
            tap, c = tap_channel(k)
            return element(ctx.let(tap, "tp") if tpad > 1 else "0", "0", ctx.let(c, "kc"))

        def at_step(k0, kk):
            (t0, c0), (j, c) = step_of(k0), split(kk)
            return element(ix.add(t0, j), c0, c)

        return StepLoader(load, at_step)

    if by_tap:  # W's rows stay (channel, taps) ordered (the CPU's packing, a runtime W): row c * taps + tap
        w_rows = b_column

        def b_column(bi, n):
            row = w_rows(bi, n)

            def element(tap, c):
                if c.isdigit() and int(c) >= cg:
                    return "0.0"
                c, conds = in_channel(c)
                if tpad > taps:
                    conds, tap = conds + [f"{tap} < {taps}"], f"min({tap}, {taps - 1})"
                v = row(ix.add(ix.mul(c, taps), tap))
                return f"({v} if {' and '.join(conds)} else 0.0)" if conds else v

            def load(k):
                return element(*tap_channel(k))

            def at_step(k0, kk):
                (t0, c0), (j, c) = step_of(k0), split(kk)
                return element(ix.add(t0, j), ix.add(c0, c))

            return StepLoader(load, at_step)

    b_quad = None
    if packed is not None and packed % 16 == 0 and (blocks * O) % 4 == 0:
        def b_quad(bi, n):  # n a multiple of 4: 4 consecutive packed columns, one 16-byte load
            base = ctx.let(ix.add(str(packed), ix.mul(bi, K * blocks * O * 4), ix.mul(n, 4)), "wq")
            return lambda k: f"weights.read(float4, {ix.add(base, ix.mul(k, blocks * O * 4))})"

    def channel(bi, n):
        return ix.add(ix.mul(bi, mg), n) if conv.group > 1 else n

    def finish(bi, m, n, acc):
        return f"{acc} + {load_f(conv.input(2), channel(bi, n))}" if conv.has_input(2) else acc

    def store(bi, m, n, value):
        binding, nn, pos = at_row(m, False)
        with binding():
            return store_f(y, ix.add(ix.mul(nn, y.strides[0]), ix.mul(channel(bi, n), y.strides[1]), pos), value)

    if not mma:
        tiled.emit(ctx, tl, item, thread, a_row, b_column, finish, store, a_m_contiguous=True, b_quad=b_quad)
        return
    from . import tiled_mma

    if G == 1:
        tiled_mma.emit(ctx, tl, item, thread, a_row, b_column, finish, store, a_m_contiguous=True)
        return
    # the group's samples that exist (the last group of a batch may hold fewer); a tile wholly past
    # them leaves (uniform in the block)
    live = tiled.group_rows(ctx, G, positions)
    rb = ix.mod(ix.div(item, tl.col_blocks), tl.row_blocks)
    ctx.line(f"if {ix.mul(f'({rb})', tl.BM)} < {live}:")
    with ctx.indent():
        tiled_mma.emit(ctx, tl, item, thread, a_row, b_column, finish, store, a_m_contiguous=True, m_limit=live)
