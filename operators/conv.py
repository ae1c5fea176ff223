"""Convolutions: Conv over 1-D, 2-D and 3-D inputs (groups, dilations, pads, strides, auto_pad),
accumulated in float also for half inputs. In a stage a Conv thread computes a tile of positions
along a row x output channels from weights prepacked at compile time (Conv.emit_item); `forward`
sums each output element's window on its own (shaders/conv.py.j2). Col2Im: operators/col2im.py.

The window geometry here (strides, dilations, pads, output size) and ConvBase, the checks and the
window sum, are shared with the pools and ConvTranspose (operators/conv_transpose.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import Tensor

from .common import emit_epilogue_loop, load_f, loop_vars, loops_epilogue

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


@dataclass
class Geometry:
    """The window of a convolution or pool along each spatial dimension."""

    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    pads_begin: list[int]
    pads_end: list[int]
    out: list[int]  # output spatial size


def int_list(op: Operator, name: str, default: list[int], k: int) -> list[int]:
    """Return an int-list attribute of length k (default when absent), or raise naming it."""
    value = op.attr(name, None)
    if value is None:
        return list(default)
    value = [int(v) for v in value]
    if len(value) != k:
        raise op.error(f"attribute '{name}' has {len(value)} values, expected {k} (one per spatial dimension)")
    return value


def window_geometry(op: Operator, spatial: tuple[int, ...], kernel: list[int], ceil_mode: bool = False) -> Geometry:
    """Return the geometry of a Conv or pool node over input spatial sizes, per ONNX's rules."""
    k = len(spatial)
    strides = int_list(op, "strides", [1] * k, k)
    dil = int_list(op, "dilations", [1] * k, k)
    op.expect(all(s > 0 for s in strides) and all(d > 0 for d in dil), f"strides {strides} and dilations {dil} must be positive")
    auto_pad = op.attr("auto_pad", "NOTSET")
    op.expect(auto_pad in AUTO_PADS, f"auto_pad must be one of {', '.join(AUTO_PADS)}, not {auto_pad!r}")
    extent = [(kk - 1) * d + 1 for kk, d in zip(kernel, dil)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-n // s) for n, s in zip(spatial, strides)]
        total = [max(0, (o - 1) * s + e - n) for o, s, e, n in zip(out, strides, extent, spatial)]
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad == "VALID":
        begin, end = [0] * k, [0] * k
        out = [(n - e) // s + 1 for n, e, s in zip(spatial, extent, strides)]
    else:
        pads = int_list(op, "pads", [0] * 2 * k, 2 * k)
        begin, end = pads[:k], pads[k:]
        out = []
        for n, e, s, b, f in zip(spatial, extent, strides, begin, end):
            span = n + b + f - e
            o = (-(-span // s) if ceil_mode else span // s) + 1
            if ceil_mode and (o - 1) * s >= n + b:
                o -= 1  # the last window must start inside the input or its left padding
            out.append(o)
    if any(o < 1 for o in out):
        raise op.error(
            f"the window (kernel {kernel}, dilations {dil}, strides {strides}, pads {begin + end}) does not fit "
            f"the input's spatial size {list(spatial)}"
        )
    return Geometry(list(kernel), strides, dil, begin, end, out)


def check_output(op: Operator, y: Tensor, expected: list[int], what: str = "Y") -> None:
    """Raise unless output y has the shape this operator computes."""
    got = list(y.shape)
    if got != expected:
        note = ""
        if op.attr("ceil_mode", 0):
            # onnx's shape inference omits the rule that drops a last window starting in the right
            # pad; onnxruntime and onnx's reference apply it, and so does luisaml
            note = " (ceil_mode drops a last window that would start in the right padding; onnx's shape inference does not)"
        raise op.error(f"output {what} '{y.name}' has shape {got}, but the attributes give {expected}{note}")


def store_f(t: Tensor, i: str, value: str) -> str:
    """Return the store of a float value into element i of t (narrowed for half)."""
    return t.store(i, f"half({value})" if t.dtype.dsl == "half" else value)


def lin(terms: list[tuple[str, int]], const: int = 0) -> str:
    """Return the DSL of sum(var * coef) + const, simplified."""
    parts = [ix.mul(v, c) for v, c in terms]
    e = ix.add(*[p for p in parts if p != "0"]) if any(p != "0" for p in parts) else "0"
    if const == 0:
        return e
    if e == "0":
        return f"({const})" if const < 0 else str(const)
    return f"{e} - {-const}" if const < 0 else f"{e} + {const}"


def bounds(var: str, lo_needed: bool, hi: int | None) -> list[str]:
    """Return the conditions that keep var inside [0, hi): only the sides that can fail."""
    conds = []
    if lo_needed:
        conds.append(f"{var} >= 0")
    if hi is not None:
        conds.append(f"{var} < {hi}")
    return conds


def emit_strip(ctx, cond: list[str], nest) -> None:
    """Emit nest(False) where every condition of cond holds (the strip's reads stay inside the row:
    no bounds checks), else nest(True); nest(False) alone where cond is empty."""
    if cond:
        ctx.line(f"if {' and '.join(cond)}:")
        with ctx.indent():
            nest(False)
        ctx.line("else:")
        with ctx.indent():
            nest(True)
    else:
        nest(False)


def finished(ctx, acc, y) -> list[list[str]]:
    """The tile's accumulators converted to y's type, one statement each before the stores (clang
    vectorises the tile only so: benchmarks/NOTES.md)."""
    return [[ctx.let(f"half({a})" if y.dtype.dsl == "half" else a, "f") for a in row] for row in acc]


# a tuned strip (luisaml/tune.py) stays within these: 64 accumulators, 16 channels (the rules' bounds)
MAX_STRIP_ACC, MAX_STRIP_CHANNELS = 64, 16


def strip_choice(choice: dict | None) -> tuple[int, int] | None:
    """Return (P, O) of a tuned items schedule of a Conv, or None where there is none or it is out
    of bounds (a hand-edited cache entry cannot make a bad kernel)."""
    if not choice or choice.get("form") != "items":
        return None
    P, O = choice.get("P"), choice.get("O")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (P, O)):
        return None
    return (P, O) if P in (1, 2, 4, 8) and 1 <= O <= MAX_STRIP_CHANNELS and P * O <= MAX_STRIP_ACC else None


def strip_candidates(mg: int, rule: tuple[int, int], wide: bool) -> list[dict]:
    """Return the items schedules of a Conv a search measures: the rules' strip (P positions x O
    channels) first, then strips near it, 4 in all or (wide) up to 12; none with more channels than
    the group has (rounded up to 4)."""
    P0, O0 = rule
    top = max(-(-mg // 4) * 4, 1)
    out = [rule]
    near = [(P0, O0 * 2), (P0 // 2, O0 * 2), (P0 * 2, O0 // 2), (P0, O0 // 2), (P0 // 2, O0), (P0 * 2, O0),
            (4, 8), (8, 8), (2, 16), (4, 16), (1, 16), (8, 4), (4, 4)]
    for P, O in near:
        c = strip_choice({"form": "items", "P": P, "O": O})
        if c is not None and c not in out and O <= top:
            out.append(c)
    return [{"form": "items", "P": P, "O": O} for P, O in out[:12 if wide else 4]]


def expect_float(op: Operator, t: Tensor, role: str) -> None:
    """Raise unless t is float or float16 (the types these operators compute in)."""
    if t.dtype.name not in ("FLOAT", "FLOAT16"):
        raise op.error(f"{role} '{t.name}' has type {t.dtype.name.lower()}; supported: float, float16")


class ConvBase(Operator):
    """Shared checks of Conv and ConvTranspose: X [N, C, D...], W, optional B [M]."""

    transpose = False

    def check(self) -> None:
        x, w = self.input(0), self.input(1)
        expect_float(self, x, "X")
        self.expect(w.dtype == x.dtype, f"W '{w.name}' has type {w.dtype.name.lower()}, X has {x.dtype.name.lower()}")
        self.expect(x.rank >= 3, f"X '{x.name}' has rank {x.rank}; Conv needs [N, C, spatial...] with 1 to 3 spatial dims")
        self.expect(w.rank == x.rank, f"W '{w.name}' has rank {w.rank}, X has rank {x.rank}")
        self.expect(not w.batched, f"W '{w.name}' has the batch dimension; per-sample weights are not supported")
        self.k = x.rank - 2
        self.group = int(self.attr("group", 1))
        self.expect(self.group >= 1, f"group must be >= 1, not {self.group}")
        self.kernel = int_list(self, "kernel_shape", list(w.shape[2:]), self.k)
        self.expect(self.kernel == list(w.shape[2:]), f"kernel_shape {self.kernel} differs from W's spatial shape {list(w.shape[2:])}")
        C = x.shape[1]
        self.expect(C % self.group == 0, f"X has {C} channels, not divisible by group {self.group}")
        if self.transpose:
            self.expect(w.shape[0] == C, f"W '{w.name}' has shape {list(w.shape)}; ConvTranspose needs W[0] == C = {C}")
            self.M = w.shape[1] * self.group
        else:
            self.M = w.shape[0]
            self.expect(self.M % self.group == 0, f"W has {self.M} output channels, not divisible by group {self.group}")
            self.expect(
                w.shape[1] * self.group == C,
                f"W '{w.name}' has shape {list(w.shape)}; with group {self.group} it needs W[1] = {C // self.group}",
            )
        if self.has_input(2):
            b = self.input(2)
            self.expect(b.dtype == x.dtype, f"B '{b.name}' has type {b.dtype.name.lower()}, X has {x.dtype.name.lower()}")
            self.expect_shape(b, (self.M,), "B")
            self.expect(not b.batched, f"B '{b.name}' has the batch dimension")
        self.geometry()
        check_output(self, self.output(), [x.shape[0], self.M] + self.geo.out)

    def geometry(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        g = self.geo
        return (
            f"direct {self.k}-D {'transposed ' if self.transpose else ''}convolution, kernel {g.kernel}, "
            f"strides {g.strides}, dilations {g.dilations}, pads {g.pads_begin + g.pads_end}, group {self.group}"
        )

    stores_once = True

    def window_code(self, ctx, coords: list[str], window_dims, x_coords, w_coords):
        """Return (head, window, body, accumulator) of the window sum for the output element at
        `coords` (variables or "0"): the pieces shaders/conv.py.j2 nests."""
        x, w = self.input(0), self.input(1)
        n, m, ospat = coords[0], coords[1], coords[2:]
        acc = ctx.fresh("acc")
        cg = x.shape[1] // self.group
        mg = self.M // self.group
        head = [f"{acc} = {load_f(self.input(2), m) if self.has_input(2) else '0.0'}"]
        c_var = ctx.fresh("c") if cg > 1 else "0"
        window = [{"var": c_var, "n": cg, "pre": [], "cond": None}]
        kvars = loop_vars(ctx, self.kernel, "k", unit_zero=True)
        spatial_in = []
        for d, (kv, kn) in enumerate(kvars):
            pre, cond, coord = window_dims(ctx, d, ospat[d], kv)
            window.append({"var": kv, "n": kn, "pre": pre, "cond": " and ".join(cond) or None})
            spatial_in.append(coord)
        group_of_m = ix.div(m, mg) if self.group > 1 else "0"
        c_abs = lin([(group_of_m, cg), (c_var, 1)]) if self.group > 1 else c_var
        xi = ix.ravel(x_coords(n, c_abs, spatial_in), x.strides)
        wi = ix.ravel(w_coords(m, c_var, c_abs, [v for v, _ in kvars], mg), w.strides)
        body = [f"{acc} += {load_f(x, xi)} * {load_f(w, wi)}"]
        return head, window, body, acc

    def emit(self, ctx, window_dims, x_coords, w_coords) -> None:
        """Render the loop nest: outer over Y, window over (channel in group, kernel dims)."""
        y = self.output()
        outer = loop_vars(ctx, y.shape, "o", unit_zero=True)
        head, window, body, acc = self.window_code(ctx, [v for v, _ in outer], window_dims, x_coords, w_coords)
        tail = [store_f(y, ix.ravel([v for v, _ in outer], y.strides), acc)]
        ctx.render("conv.py.j2", outer=outer, head=head, window=window, body=body, tail=tail)

    def emit_element(self, ctx, i: str, window_dims, x_coords, w_coords) -> str:
        """Emit the window sum of output element i (a stage thread's share) and return its value."""
        y = self.output()
        coords = [ctx.let(c, "o") if n > 1 else "0" for c, n in zip(ix.unravel(i, tuple(y.shape)), y.shape)]
        head, window, body, acc = self.window_code(ctx, coords, window_dims, x_coords, w_coords)
        ctx.render("conv.py.j2", outer=[], head=head, window=window, body=body, tail=[])
        return f"half({acc})" if y.dtype.dsl == "half" else acc

    def forward(self, ctx) -> None:
        self.emit(ctx, *self.window_fns())

    def work_items(self) -> int:
        """One work item per output element (Conv overrides this with its tiles)."""
        return self.output().numel

    def emit_item(self, ctx, item: str) -> None:
        ctx.line(self.output().store(item, self.emit_element(ctx, item, *self.window_fns())))

    def window_fns(self):
        """Return (window_dims, x_coords, w_coords): how an input coordinate follows from an output
        coordinate and a window offset, and how X and W are indexed."""
        raise NotImplementedError


@register("Conv", since=1)
class Conv(ConvBase):
    """Y[n, m, o] = B[m] + sum over c in m's group, k of X[n, c, o * s + k * d - pad] * W[m, c, k]."""

    def geometry(self) -> None:
        self.geo = window_geometry(self, self.input(0).shape[2:], self.kernel)

    def reads_per_element(self, k: int) -> float:
        """Of the input: its multiply-adds over its elements (a depthwise 7 x 7: 49)."""
        x, w = self.input(0), self.input(1)
        return self.output().numel * int(np.prod(w.shape[1:])) / x.numel if k == 0 and x.numel else 0.0

    def window_fns(self):
        g, x = self.geo, self.input(0)

        def window_dims(ctx, d, o, kv):
            iv = ctx.fresh("ix")
            pre = [f"{iv} = {lin([(o, g.strides[d]), (kv, g.dilations[d])], -g.pads_begin[d])}"]
            last = (g.out[d] - 1) * g.strides[d] + (g.kernel[d] - 1) * g.dilations[d] - g.pads_begin[d]
            size = x.shape[2 + d]
            return pre, bounds(iv, g.pads_begin[d] > 0, size if last >= size else None), iv

        return window_dims, (lambda n, c_abs, sp: [n, c_abs] + sp), (lambda m, c, c_abs, ks, mg: [m, c] + ks)

    # ---- the stage form: a work item is a tile of P output positions x O output channels --------

    # set on a plan without blocks stages (the CPU backend; luisaml/compiler.py): emit_item takes
    # the CPU's tiles, unless cpu_tiles is off (an A/B switch: benchmarks/NOTES.md, "Conv's CPU
    # tiles"): odd rows in strips of 2 that overlap at the row's end, W packed as a channel
    # block's panels, a tile's stores after all its epilogue's loads. CUDA's items form is kept.
    no_blocks = False
    cpu_tiles = True
    # the implicit GEMM as the tensor-core tile (operators/tiled_mma.py) where the plan asks: "tf32", or False
    tensor_cores = False

    def tiles(self) -> tuple[int, int, int, int]:
        """Return (P positions along the last spatial dimension, O channels of one group, strips
        per row, channel blocks per group). P is 8, 4, 2 or 1: clang forms one vector of a channel's
        P consecutive outputs from the P scalar accumulators (P = 7 for LeNet's 28-wide rows
        measured 25 ms, not vectorised, against 3.0 ms with P = 4).
        O channels share each input load, up to 64 / P accumulators and 16 channels, chosen to pad
        the group's channels least."""
        mg = self.M // self.group
        row = self.geo.out[-1]
        tuned = strip_choice(self.schedule)
        if tuned is not None:  # (a ragged last strip runs the masked copy of the loop nest)
            P, O = tuned
            return P, O, -(-row // P), -(-mg // O)
        from . import conv_tiles

        if self.whole_rows(mg):
            P = row
            O = min(mg, 16 if row <= 4 else 8)
            return P, O, 1, -(-mg // O)
        # a strip that divides the row: a ragged last strip runs the masked copy of the loop nest,
        # slower than narrower strips (LeNet: 8.6 ms with P = 8 on 28-wide rows, 3.0 ms with 4)
        P = next(p for p in (8, 4, 2, 1) if row % p == 0)
        if conv_tiles.direct(self):  # (a GPU's direct form: a position a thread, a warp's stores consecutive positions)
            P = 1
        if P == 1 and row > 1 and self.kernel[-1] > 1 and self.cpu():
            # an odd row on the CPU: strips of 2, the last overlapping the one before (emit_item);
            # not for one tap along the row, where the 16 channels' weights a load are the vector
            P = 2
        if P == 2 and row % 2 and self.channel_tile(mg):
            # the channel tiles over an odd row: overlapping strips of ODD_STRIP (not a 1x1), each
            # broadcast input feeding 16 channels (wav2vec2's Conv1d stages 42.8 -> 35.6 ms with 4)
            P = self.ODD_STRIP
        top = min(64 // P, 16)
        O = mg if mg <= top else min(range(4, top + 1), key=lambda o: (-(-mg // o) * o - mg, -o))
        return P, O, -(-row // P), -(-mg // O)

    def schedules(self, blocks: bool, wide: bool) -> list[dict]:
        from . import tiled

        def items() -> list[dict]:
            P, O, _, _ = self.tiles()
            return strip_candidates(self.M // self.group, (P, O), wide)

        # (the tensor cores' tile and the dot form have no knobs searched)
        return tiled.product_schedules(self, blocks, wide, items, fixed=lambda tl: getattr(tl, "mma", False)
                                       or not isinstance(tl, tiled.Tiling))

    def work_items(self) -> int:
        _, _, strips, blocks = self.tiles()
        y = self.output()
        return y.shape[0] * self.group * blocks * int(np.prod(self.geo.out[:-1], dtype=np.int64)) * strips

    def packed_w(self):
        """Return the byte offset in the blob of W prepacked as float32 [group][C/group][kernel
        taps][channel blocks x O] (a tap's O channels consecutive), or None when W is not a constant
        of the weight blob."""
        from luisaml.plan import BlobWeight

        w = self.input(1)
        if w.value is None or not isinstance(w.home, BlobWeight):
            return None
        _, O, _, blocks = self.tiles()
        mg, cg = self.M // self.group, w.shape[1]
        taps = int(np.prod(self.kernel, dtype=np.int64))

        def pack() -> np.ndarray:
            v = np.asarray(w.value, np.float32).reshape(self.group, mg, cg, taps).transpose(0, 2, 3, 1)
            packed = np.zeros((self.group, cg, taps, blocks * O), np.float32)
            packed[..., :mg] = v
            if self.panels():  # [group][channel block][C/group][taps][O]
                return packed.reshape(self.group, cg, taps, blocks, O).transpose(0, 3, 1, 2, 4).copy()
            return packed

        # the key names the layout: panels of O channels differ for each O with one blocks * O (the
        # schedule search's candidate copies share W; one key for two layouts fed them the wrong panels)
        key = f"{w.name}/panels[{cg}x{taps}x{blocks}x{O}]" if self.panels() else f"{w.name}/packed[{cg}x{taps}x{blocks * O}]"
        return w.home.blob.add_packed(key, pack)

    def cpu(self) -> bool:
        """Whether this node takes the CPU's tiles (see no_blocks)."""
        return self.no_blocks and self.cpu_tiles

    def panels(self) -> bool:
        """Whether W is packed as a channel block's panel after another (the CPU's tiles: a tile's
        weights one contiguous run, not rows blocks x O words apart, 2 KB for 512 channels)."""
        return self.cpu()

    # the most multiply-adds a row window unrolls (row_window): a depthwise 7 x 7 strip of 8 is 56
    ROW_WINDOW_FMAS = 256
    # the CPU's tiles of a depthwise Conv take the row window too (an A/B switch: benchmarks/NOTES.md,
    # "CPU zoo, fourth pass", its depthwise step)
    cpu_row_window = True

    def row_window(self, P: int, O: int) -> list[int]:
        """Return the offsets along the row that a strip of P outputs reads over the last kernel
        dimension, where its taps are unrolled over them loaded once (else []): CUDA's items form
        (depthwise and grouped convolutions, which have no block tiling) and the CPU's tiles of a
        depthwise Conv (one output channel a group, O = 1: ConvNeXt-T's 7 x 7 stages 23.7 -> 17.2 ms),
        where taps overlap. The CPU's other tiles keep the loop over taps, vectorised across their O
        channels (RegNet-Y's grouped 3 x 3, 8 channels a group, measured 4.1 -> 5.2 ms with the window)."""
        g = self.geo
        s, d, kl = g.strides[-1], g.dilations[-1], g.kernel[-1]
        offs = sorted({kv * d + pp * s for kv in range(kl) for pp in range(P)})
        if self.cpu() and (self.group == 1 or O > 1 or not self.cpu_row_window):
            return []
        if len(offs) == kl * P or kl * P * O > self.ROW_WINDOW_FMAS:
            return []
        return offs

    def emit_item(self, ctx, item: str) -> None:
        x, w, y = self.input(0), self.input(1), self.output()
        g, k = self.geo, self.k
        P, O, strips, blocks = self.tiles()
        mg, cg = self.M // self.group, x.shape[1] // self.group
        # item -> (n, group, channel block, outer output coordinates, strip), the strip fastest
        dims = [y.shape[0], self.group, blocks] + list(g.out[:-1]) + [strips]
        n, grp, cb, *outer, strip = [ctx.let(c, "t") if d > 1 else "0" for c, d in zip(ix.unravel(item, tuple(dims)), dims)]
        m0 = ctx.let(ix.mul(cb, O), "m")
        overlap = self.cpu() and g.out[-1] % P != 0
        # (overlapping: the last strip ends at the row's end, storing some of the one before's outputs again)
        o_last = ctx.let(f"min({ix.mul(strip, P)}, {g.out[-1] - P})" if overlap else ix.mul(strip, P), "o")
        safe = mg % O or O  # channels j >= safe may fall past the group in the last block
        acc = [[ctx.fresh("acc") for _ in range(O)] for _ in range(P)]
        b = self.input(2) if self.has_input(2) else None
        for j in range(O):
            m = ix.add(ix.mul(grp, mg), m0, str(j))
            init = load_f(b, m if j < safe else f"min({m}, {self.M - 1})") if b is not None else "0.0"
            for pp in range(P):
                ctx.line(f"{acc[pp][j]} = {init if pp == 0 else acc[0][j]}")
        packed = self.packed_w()
        taps = int(np.prod(self.kernel, dtype=np.int64))
        # bytes between a tap's O weights and the next tap's (the panels: O words; else a row of all blocks)
        w_row = O * 4 if self.panels() else blocks * O * 4
        if packed is not None and self.panels():
            wbase = ctx.let(ix.add(str(packed), ix.mul(ix.add(ix.mul(grp, blocks), cb), cg * taps * O * 4)), "wb")
        elif packed is not None:
            wbase = ctx.let(ix.add(str(packed), ix.mul(grp, cg * taps * blocks * O * 4), ix.mul(cb, O * 4)), "wb")
        else:
            wm = [ctx.let(ix.add(ix.mul(grp, mg), m0, str(j)) if j < safe
                          else f"min({ix.add(ix.mul(grp, mg), m0, str(j))}, {self.M - 1})", "wm") for j in range(O)]
        sizes = x.shape[2:]
        # the last dimension's window bounds: when a strip's whole window is inside the row, its
        # loads need no masks (a second copy of the loop nest)
        s_l, d_l, pad_l, kl = g.strides[-1], g.dilations[-1], g.pads_begin[-1], g.kernel[-1]
        lo_fails = pad_l > 0
        covered = g.out[-1] if overlap else strips * P  # outputs along the row the strips reach
        hi_fails = (covered - 1) * s_l + (kl - 1) * d_l - pad_l >= sizes[-1]
        row_window = self.row_window(P, O)

        def nest(masked: bool) -> None:
            """Emit the loops over the group's channels and the kernel taps, outer spatial dims
            guarded by conditions, the last one's loads masked (or not)."""

            def outer_taps(d, c, x_base, kvs):
                if d == k - 1:
                    last_taps(c, x_base, kvs)
                    return
                with ctx.loop(g.kernel[d], "k") as kv:
                    iv = ctx.let(lin([(outer[d], g.strides[d]), (kv, g.dilations[d])], -g.pads_begin[d]), "ix")
                    last = (g.out[d] - 1) * g.strides[d] + (g.kernel[d] - 1) * g.dilations[d] - g.pads_begin[d]
                    cond = bounds(iv, g.pads_begin[d] > 0, sizes[d] if last >= sizes[d] else None)
                    base = ix.add(x_base, ix.mul(iv, x.strides[2 + d]))
                    if cond:
                        ctx.line(f"if {' and '.join(cond)}:")
                        with ctx.indent():
                            outer_taps(d + 1, c, base, kvs + [kv])
                    else:
                        outer_taps(d + 1, c, base, kvs + [kv])

            def tap_weights(c, kvs, kv):
                tap = ix.ravel(kvs + [kv], tuple(int(np.prod(self.kernel[d + 1:], dtype=np.int64)) for d in range(k)))
                if packed is not None:
                    wk = ctx.let(ix.add(wbase, ix.mul(ix.add(ix.mul(c, taps), tap), w_row)), "wk")
                    return [ctx.let(f"weights.read(float, {ix.add(wk, str(4 * j))})", "w") for j in range(O)]
                return [ctx.let(load_f(w, ix.ravel([wm[j], c] + kvs + [kv], w.strides)), "w") for j in range(O)]

            def x_at(x_base, iw):
                if not masked:
                    return ctx.let(load_f(x, ix.add(x_base, iw)), "xv")
                cond = bounds(f"({iw})", lo_fails, sizes[-1] if hi_fails else None)
                clamped = f"min(max({iw}, 0), {sizes[-1] - 1})"
                return ctx.let(f"({load_f(x, ix.add(x_base, clamped))} if {' and '.join(cond)} else 0.0)", "xv")

            def last_taps(c, x_base, kvs):
                if row_window:
                    # the strip's row window loaded once, every tap unrolled over it: output pp's tap kv
                    # reads offset kv * d + pp * s, so a 7-wide window over 8 outputs is 14 loads, not 56
                    # (each load is also the inline producers' work: ConvNeXt's residual Adds, Transposes)
                    i0 = ctx.let(lin([(o_last, s_l)], -pad_l), "ix")
                    xs = {off: x_at(x_base, ix.add(i0, str(off))) for off in row_window}
                    for kv in range(kl):
                        ws = tap_weights(c, kvs, str(kv))
                        for pp in range(P):
                            for j in range(O):
                                ctx.line(f"{acc[pp][j]} = fma({xs[kv * d_l + pp * s_l]}, {ws[j]}, {acc[pp][j]})")
                    return
                with ctx.loop(kl, "k") as kv:
                    ws = tap_weights(c, kvs, kv)
                    i0 = ctx.let(lin([(o_last, s_l), (kv, d_l)], -pad_l), "ix")
                    for pp in range(P):
                        xv = x_at(x_base, ix.add(i0, str(pp * s_l)))
                        for j in range(O):
                            ctx.line(f"{acc[pp][j]} = fma({xv}, {ws[j]}, {acc[pp][j]})")

            with ctx.loop(cg, "c") as c:
                c_abs = ix.add(ix.mul(grp, cg), c) if self.group > 1 else c
                outer_taps(0, c, ix.add(ix.mul(n, x.strides[0]), ix.mul(c_abs, x.strides[1])), [])

        lo = lin([(o_last, s_l)], -pad_l)
        hi = lin([(o_last, s_l)], (P - 1) * s_l + (kl - 1) * d_l - pad_l)
        emit_strip(ctx, ([f"{lo} >= 0"] if lo_fails else []) + ([f"{hi} < {sizes[-1]}"] if hi_fails else []), nest)
        if self.cpu() and self.loops_channels(O, y):
            self._epilogue_loop(ctx, y, acc, n, grp, m0, outer, o_last, O, safe)
            return
        done = finished(ctx, acc, y)
        in_row = P if overlap else g.out[-1] % P or P  # a last strip past the row's end (P need not divide the row)
        writes = []  # (the CPU) the unconditional stores' writes, after every store's reads
        for j in range(O):
            m = ix.add(ix.mul(grp, mg), m0, str(j))
            base = ix.add(ix.mul(n, y.strides[0]), ix.mul(m, y.strides[1]),
                          *(ix.mul(o, st) for o, st in zip(outer, y.strides[2:-1])), o_last)
            if j >= safe:
                ctx.line(f"if {ix.add(m0, str(j))} < {mg}:")
                ctx.level += 1
            for pp in range(P):
                if self.cpu() and j < safe and pp < in_row:
                    # an epilogue's loads (a residual) between the stores stop clang vectorising the tile
                    lets, write = y.store_parts(ix.add(base, str(pp)), done[pp][j])
                    for line in lets:
                        ctx.line(line)
                    writes.append(write)
                    continue
                ctx.line_if(None if pp < in_row else f"{ix.add(o_last, str(pp))} < {g.out[-1]}",
                            y.store(ix.add(base, str(pp)), done[pp][j]))
            if j >= safe:
                ctx.level -= 1
        for write in writes:
            ctx.line(write)

    def _epilogue_loop(self, ctx, y, acc, n, grp, m0, outer, o_last, O, safe) -> None:
        """(epilogue_loop) The tile's epilogue as a loop over each position's O channels
        (common.emit_epilogue_loop), vectorised across the channels, their stores a row apart."""
        mg = self.M // self.group

        def store(pp, jv, value):
            m = ix.add(ix.mul(grp, mg), m0, jv)
            i = ix.add(ix.mul(n, y.strides[0]), ix.mul(m, y.strides[1]),
                       *(ix.mul(o, st) for o, st in zip(outer, y.strides[2:-1])), o_last, str(pp))
            lets, write = y.store_parts(i, ctx.let(f"half({value})" if y.dtype.dsl == "half" else value, "f"))
            for line in lets:
                ctx.line(line)
            ctx.line(write)

        emit_epilogue_loop(ctx, acc, "float", str(O) if safe == O else f"min({O}, {mg} - {m0})", store)

    # the CPU's tiles store through a loop over the tile's channels (common.emit_epilogue_loop, as
    # Gemm's and MatMul's GELU epilogues): "channels" where a tile has 8 channels or more (one group)
    # or a GELU epilogue, else common.loops_epilogue's rule for "gelu", True or False (A/B switches)
    epilogue_loop: bool | str = "channels"
    # a row this short is one strip on the CPU's channel tiles (whole_rows)
    WHOLE_ROW = 16

    def loops_channels(self, O: int, y) -> bool:
        """Whether the CPU's tile stores through a loop over its channels (epilogue_loop). Its
        local array, a position's channels consecutive, is what clang's SLP vectoriser then seeds
        from: the multiply-adds become a vector of 8 channels times a broadcast input (a weight
        load per 8), where the straight-line stores, a channel's positions consecutive, made
        vectors of the P positions (4 or 2 wide: 128 -> 128 3 x 3 at 14 x 14 3.66 -> 1.33 ms;
        benchmarks/NOTES.md, "Conv's CPU tiles as channel vectors")."""
        if self.epilogue_loop == "channels":
            return (self.group == 1 and O >= 8) or loops_epilogue("gelu", y)
        return loops_epilogue(self.epilogue_loop, y)

    def whole_rows(self, mg: int) -> bool:
        """Whether a short row (WHOLE_ROW) is one strip of the CPU's channel tiles: its positions
        then compile-time constants, so clang drops the masks at the row's ends that the masked
        copy of the nest pays on every load (3 x 3 at 14 x 14 in strips of 14 x 8 channels
        0.61 ms, 2 x 16 1.42; at 28 x 28, two strips of 14 both masked, 4x slower than 4 x 16)."""
        return self.channel_tile(mg) and self.geo.out[-1] <= self.WHOLE_ROW

    def channel_tile(self, mg: int) -> bool:
        """Whether this node's CPU tiles are channel vectors (loops_channels): one group of 8+ channels."""
        return self.cpu() and self.epilogue_loop == "channels" and self.group == 1 and mg >= 8

    # the strips over an odd row on the channel tiles (2: the straight-line tiles' rule, an A/B switch)
    ODD_STRIP = 4

    def describe(self) -> str:
        P, O, _, _ = self.tiles()
        return super().describe() + f"; a thread per {P} outputs along the row x {O} channels{self.tuned_note()}"

    def describe_block(self) -> str:
        G = self.block_samples() if self.output().batched else 1
        return (super().describe().replace("direct ", "implicit-GEMM ", 1) + "; " + self.block_tiling().describe()
                + (f", a block's rows the positions of {G} samples" if G > 1 else "") + self.tuned_note())

    # ---- the GPU form: an implicit GEMM in blocks through shared memory (operators/conv_tiles.py) --

    def block_tiling(self):
        from . import conv_tiles

        return conv_tiles.block_tiling(self)

    def block_samples(self) -> int:
        from . import conv_tiles

        return conv_tiles.block_samples(self)

    def emit_block(self, ctx, item: str, thread: str) -> None:
        from . import conv_tiles

        conv_tiles.emit_block(self, ctx, item, thread)
