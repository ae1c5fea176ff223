"""Normalizations: BatchNormalization (inference and training mode), InstanceNormalization,
LayerNormalization (with its Mean and InvStdDev outputs), GroupNormalization (opset 18 and 21
semantics), RMSNormalization, LpNormalization and MeanVarianceNormalization.

Each normalizes groups of elements: the tensor's axes split into kept ones (one group per
coordinate) and reduced ones (the group's elements); shaders/norm.py.j2 runs passes over each
group, and a stage runs one work item per group. Statistics are computed in float, two-pass
(mean, then squared deviations), also for half. BatchNormalization in inference is a per-channel
affine map, computed inline; LRN, a window per element, runs one thread per element."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Operator
from luisaml.registry import register
from luisaml.storage import Tensor, literal, row_major_strides

from .common import load_f
from .conv import expect_float, store_f


def _merge(sizes: list[int], strides: list[int]) -> tuple[list[int], list[int]]:
    """Return (sizes, strides) with size-1 dims dropped and contiguous neighbours merged."""
    out_n: list[int] = []
    out_s: list[int] = []
    for n, s in zip(sizes, strides):
        if n == 1:
            continue
        if out_n and out_s[-1] == s * n:
            out_n[-1] *= n
            out_s[-1] = s
        else:
            out_n.append(n)
            out_s.append(s)
    return out_n, out_s


class Blocks:
    """A tensor's elements grouped by the kept axes: group o, element r of the group."""

    def __init__(self, shape: tuple[int, ...], reduced: list[int]) -> None:
        strides = row_major_strides(tuple(shape))
        kept = [d for d in range(len(shape)) if d not in reduced]
        red = sorted(reduced)
        self.kept_sizes, self.kept_strides = _merge([shape[d] for d in kept], [strides[d] for d in kept])
        self.red_sizes, self.red_strides = _merge([shape[d] for d in red], [strides[d] for d in red])
        self.outer = int(np.prod([shape[d] for d in kept], dtype=np.int64))
        self.inner = int(np.prod([shape[d] for d in red], dtype=np.int64))

    def index(self, o: str, r: str) -> str:
        """Return the flat index of element r of group o."""
        a = ix.ravel(ix.unravel(o, tuple(self.kept_sizes)), tuple(self.kept_strides)) if self.kept_sizes else "0"
        b = ix.ravel(ix.unravel(r, tuple(self.red_sizes)), tuple(self.red_strides)) if self.red_sizes else "0"
        return ix.add(a, b)


def _var(ctx, n: int, prefix: str) -> str:
    return ctx.fresh(prefix) if n > 1 else "0"


def _pass(var: str, n: int, body: list[str], pre=(), post=(), sums=None) -> dict:
    """One pass over a group's n elements (shaders/norm.py.j2). sums: the accumulators the body adds
    into, which the warp form adds across its lanes before `post`; None (undeclared) keeps a node
    that has such a pass out of the warp form (a sum left per lane would be a silent wrong answer)."""
    return {"var": var, "n": n, "body": list(body), "pre": list(pre), "post": list(post),
            "sums": None if sums is None else list(sums)}


# a group's elements in lanes from this many on: four chunks of reduce.LANES at least. The measured
# gains were on rows of 192-768 (benchmarks/NOTES.md); a shorter group gains little, and its sums in
# another order moved the ONNX suite's test_layer_normalization_4d_axis1 (groups of 60) by 8e-7 at an
# output of 7e-4 that cancels terms near 3: float32 rounding, past the suite's atol of 1e-7
LANES_MIN_NORM = 64


def lanes_fit(blocks: Blocks) -> bool:
    """Whether a group's sums may run in reduce.LANES partial sums (lanes_pass): its elements one
    contiguous run of LANES_MIN_NORM or more."""
    return blocks.red_strides == [1] and blocks.inner >= LANES_MIN_NORM


def lanes_pass(ctx, x: Tensor, blocks: Blocks, o: str, acc: str, step, pre=(), post=()) -> dict:
    """A pass (_pass) adding step(x) of each element of group o into acc in reduce.LANES partial
    sums over consecutive elements (reduce.fold_lanes), added into acc at the end: independent
    chains that the CPU backend's compiler turns into vector steps, where one accumulator is a
    chain of dependent adds (as Softmax's rows in lanes). The loop's variable is the chunk's."""
    from .reduce import fold_lanes

    lanes = fold_lanes(ctx, lambda i: load_f(x, i), blocks.index(o, "0"), blocks.inner, acc, "0.0",
                       lambda a, v: f"{a} + {step(v)}", lambda a, v: f"{a} + {v}")
    return _pass(lanes["q"], lanes["chunks"], lanes["body"], list(pre) + lanes["init"],
                 lanes["tail"] + lanes["merge"] + list(post), sums=[acc])


def mean_var_passes(ctx, x: Tensor, blocks: Blocks, o: str,
                    lanes: bool = False) -> tuple[list[dict], str, str, Callable[[str], str]]:
    """Return (passes, mean, variance, centred): the two-pass population statistics of group o and
    centred(v), the expression of v - mean. The group's first element x0 is taken out first: the
    mean is x0 + shift, shift the mean of the differences from x0, and v - mean is computed as
    (v - x0) - shift, never through the rounded mean. A group of equal values then centres to 0
    exactly (sum / n of three equal floats near 245 is another float, which LayerNorm's eps-sized
    variance made an output 2e-3 off its bias: fuzz graph 5:943), and close values keep the
    digits a float32 mean near them would round away. With `lanes` (the CPU backend) a contiguous
    group's sums run in lanes (lanes_fit, lanes_pass)."""
    n = blocks.inner
    r1, r2 = _var(ctx, n, "r"), _var(ctx, n, "r")
    s, mean, q, var, d, x0, shift = (ctx.fresh(p) for p in ("sum", "mean", "sq", "var", "d", "x0", "shift"))

    def centred(v: str) -> str:
        return f"(({v} - {x0}) - {shift})"

    if lanes and lanes_fit(blocks):
        p1 = lanes_pass(ctx, x, blocks, o, s, lambda v: f"({v} - {x0})",
                        [f"{x0} = {load_f(x, blocks.index(o, '0'))}", f"{s} = 0.0"],
                        [f"{shift} = {s} / {float(n)!r}", f"{mean} = {x0} + {shift}"])
        p2 = lanes_pass(ctx, x, blocks, o, q, lambda v: f"{centred(v)} * {centred(v)}", [f"{q} = 0.0"],
                        [f"{var} = {q} / {float(n)!r}"])
        return [p1, p2], mean, var, centred
    p1 = _pass(r1, n, [f"{s} += {load_f(x, blocks.index(o, r1))} - {x0}"],
               [f"{x0} = {load_f(x, blocks.index(o, '0'))}", f"{s} = 0.0"],
               [f"{shift} = {s} / {float(n)!r}", f"{mean} = {x0} + {shift}"], sums=[s])
    p2 = _pass(
        r2,
        n,
        [f"{d} = {centred(load_f(x, blocks.index(o, r2)))}", f"{q} += {d} * {d}"],
        [f"{q} = 0.0"],
        [f"{var} = {q} / {float(n)!r}"],
        sums=[q],
    )
    return [p1, p2], mean, var, centred


def standardize_passes(
    ctx, x: Tensor, y: Tensor, blocks: Blocks, o: str, inv_of: Callable[[str], str], affine: Callable[[str, str], str],
    lanes: bool = False,
) -> tuple[list[dict], str, str, str]:
    """Return (passes, mean, var, inv): the statistics passes of group o (`lanes`: mean_var_passes'),
    then a pass that sets inv = inv_of(var) and stores y = affine((x - mean) * inv, r) at each element r."""
    passes, mean, var, centred = mean_var_passes(ctx, x, blocks, o, lanes)
    inv, r = ctx.fresh("inv"), _var(ctx, blocks.inner, "r")
    i = blocks.index(o, r)
    value = affine(f"{centred(load_f(x, i))} * {inv}", r)
    passes.append(_pass(r, blocks.inner, [store_f(y, i, value)], [f"{inv} = {inv_of(var)}"], sums=[]))
    return passes, mean, var, inv


def f32(v: float) -> str:
    """Return a float literal (statistics are computed in float)."""
    return literal(v, dtypes.FLOAT)


def trailing_broadcast(op: Operator, t: Tensor, shape: tuple[int, ...], role: str) -> tuple[int, ...]:
    """Return t's shape as it broadcasts (numpy rules) onto `shape`, or raise naming t."""
    s = tuple(t.shape)
    while len(s) > len(shape) and s[0] == 1:
        s = s[1:]
    ok = len(s) <= len(shape) and all(a in (1, b) for a, b in zip(reversed(s), reversed(shape)))
    if not ok:
        raise op.error(f"{role} '{t.name}' has shape {list(t.shape)}, which does not broadcast to {list(shape)}")
    if t.batched:
        raise op.error(f"{role} '{t.name}' has the batch dimension; per-sample parameters are not supported")
    return s


class Norm(Operator):
    """A normalization of groups: blocks() says how the elements group, group() builds the passes
    of group o; forward loops over the groups, a stage runs one work item per group."""

    stores_once = True  # every output element is stored once, in the last pass, and never read
    # set on a plan without blocks stages (the CPU backend; luisaml/compiler.py): the statistics'
    # sums of a contiguous group in lanes (mean_var_passes), unless cpu_lanes is off (an A/B
    # switch: benchmarks/NOTES.md, "Normalization sums in lanes on the CPU")
    no_blocks = False
    cpu_lanes = True

    def in_lanes(self) -> bool:
        """Whether the statistics may run in lanes (the CPU backend: see no_blocks)."""
        return self.no_blocks and self.cpu_lanes

    def blocks(self) -> Blocks:
        raise NotImplementedError

    def group(self, ctx, blocks: Blocks, o: str) -> tuple[list[str], list[dict]]:
        """Return (head lines, passes) normalizing group o (a DSL int expression)."""
        raise NotImplementedError

    def forward(self, ctx) -> None:
        blocks = self.blocks()
        if blocks.outer * blocks.inner == 0:
            return
        o = _var(ctx, blocks.outer, "o")
        head, passes = self.group(ctx, blocks, o)
        ctx.render("norm.py.j2", outer=blocks.outer, o=o, head=head, passes=passes, warp=None)

    def work_items(self) -> int | None:
        blocks = self.blocks()
        return blocks.outer if blocks.outer * blocks.inner else None

    def emit_item(self, ctx, item: str) -> None:
        head, passes = self.group(ctx, self.blocks(), item)
        ctx.render("norm.py.j2", outer=1, o=item, head=head, passes=passes, warp=None)

    def block_tiling(self):
        """A warp per group on GPUs (operators/rows.py), for float tensors. A pass's post lines (the
        statistics outputs: LayerNorm's Mean, BatchNorm training's running mean) are run by every
        lane of the warp, which store the same value."""
        from . import rows

        blocks = self.blocks()
        if self.input(0).dtype.dsl != "float" or self.output().dtype.dsl != "float" or blocks.outer * blocks.inner == 0:
            return None
        return rows.choose(blocks.outer, blocks.inner)

    def emit_block(self, ctx, item: str, thread: str) -> None:
        from . import rows

        tiling, blocks = self.block_tiling(), self.blocks()
        row, lane = rows.begin(ctx, tiling, item, thread)
        head, passes = self.group(ctx, blocks, row)
        undeclared = [p["var"] for p in passes if p["sums"] is None]
        if undeclared:  # a programming error: a pass added without saying what it sums
            raise self.error(f"internal: passes over {undeclared} do not declare their sums (normalization._pass)")
        warp = rows.warp_loop(ctx, tiling, lane)
        with rows.row_guard(ctx, tiling, row):
            ctx.render("norm.py.j2", outer=1, o=row, head=head, passes=passes, warp=warp)

    def epsilon(self, default: float = 1e-5) -> str:
        return f32(float(self.attr("epsilon", default)))

    @classmethod
    def infer(cls, node, inputs):
        """Y has X's type and shape (onnx leaves GroupNormalization and MVN untyped)."""
        x = inputs[0] if inputs else None
        if x is None or x.shape is None:
            return None
        return [(x.elem_type, x.shape)]


def _training(node, opset: int) -> bool:
    """Return whether a BatchNormalization node runs in training mode (before opset 14: when it
    has the running statistics outputs)."""
    return bool(node.attrs.get("training_mode", 0)) or (opset < 14 and any(node.outputs[1:]))


@register("BatchNormalization", since=1)
class BatchNormalization(Norm):
    """Y = scale * (X - mean) / sqrt(var + epsilon) + B per channel. In inference a per-channel
    affine map: inline, or the epilogue of the node before it (Conv, BatchNormalization, Relu in
    one stage). Training mode (BatchNormTraining) uses the batch's own statistics and updates the
    running mean and variance."""

    inline = True
    elementwise = True
    inline_cost = 4  # a square root and four loads per element

    def __new__(cls, node, inputs, outputs, opset, subgraphs=None):
        # the schedule asks the class whether element() exists: training mode, a reduction over
        # the batch, is the subclass without it
        return super().__new__(BatchNormTraining if cls is BatchNormalization and _training(node, opset) else cls)

    def check(self) -> None:
        x = self.input(0)
        expect_float(self, x, "X")
        self.expect(x.rank >= 2, f"X '{x.name}' has rank {x.rank}; BatchNormalization needs [N, C, ...]")
        C = x.shape[1]
        for i, role in enumerate(("scale", "B", "input_mean", "input_var"), start=1):
            t = self.input(i)
            expect_float(self, t, role)
            self.expect_shape(t, (C,), role)
            self.expect(not t.batched, f"{role} '{t.name}' has the batch dimension")

    def channel(self, c: str) -> tuple[str, str, str]:
        """Return (input_mean, scale / sqrt(input_var + epsilon), B) of channel c, in float."""
        scale, bias, mean, var = (self.input(i) for i in range(1, 5))
        return load_f(mean, c), f"{load_f(scale, c)} / sqrt({load_f(var, c)} + {self.epsilon()})", load_f(bias, c)

    def blocks(self) -> Blocks:
        return Blocks(self.input(0).shape, list(range(2, self.input(0).rank)))

    def group(self, ctx, blocks, o):
        # group o: one channel of one sample, its affine coefficients computed once
        x, y = self.input(0), self.output()
        mean, inv, bias = self.channel(ix.mod(o, x.shape[1]))
        m, s = ctx.fresh("mean"), ctx.fresh("inv")
        r = _var(ctx, blocks.inner, "r")
        i = blocks.index(o, r)
        body = [store_f(y, i, f"({load_f(x, i)} - {m}) * {s} + {bias}")]
        return [f"{m} = {mean}", f"{s} = {inv}"], [_pass(r, blocks.inner, body, sums=[])]

    def element(self, ctx, i, k=0):
        x, y = self.input(0), self.output()
        mean, inv, bias = self.channel(ctx.let(ix.coord(i, tuple(x.shape), 1), "c"))
        v = f"({load_f(x, i)} - {mean}) * ({inv}) + {bias}"
        return f"half({v})" if y.dtype.dsl == "half" else v


class BatchNormTraining(BatchNormalization):
    """BatchNormalization in training mode: statistics per channel over the batch and the spatial
    axes (one group per channel), the running mean and variance updated with `momentum`."""

    inline = False
    elementwise = False
    element = Operator.element  # not a map: a stage runs one work item per channel

    def check(self) -> None:
        super().check()
        # the statistics run over the batch axis: the graph compiles per batch size
        x = self.input(0)
        self.axis(0, x.rank, x.batched, "axis 0 (batch statistics of training mode)")

    def blocks(self) -> Blocks:
        return Blocks(self.input(0).shape, [0] + list(range(2, self.input(0).rank)))

    def group(self, ctx, blocks, c):
        x, y = self.input(0), self.output()
        scale, bias, mean_in, var_in = (self.input(i) for i in range(1, 5))
        eps = self.epsilon()
        passes, mean, var, _ = standardize_passes(
            ctx, x, y, blocks, c,
            lambda variance: f"{load_f(scale, c)} / sqrt({variance} + {eps})",
            lambda v, r: f"{v} + {load_f(bias, c)}", lanes=self.in_lanes(),
        )
        momentum = float(self.attr("momentum", 0.9))
        for k, (stat, running) in enumerate(((mean, mean_in), (var, var_in)), start=1):
            out = self.outputs[k] if k < len(self.outputs) else None
            if out is not None:
                passes[-1]["post"].append(
                    store_f(out, c, f"{load_f(running, c)} * {f32(momentum)} + {stat} * {f32(1 - momentum)}"))
        return [], passes


@register("InstanceNormalization", since=6)
class InstanceNormalization(Norm):
    """Y = scale[c] * (X - mean) / sqrt(var + epsilon) + B[c], statistics per sample and channel."""

    def check(self) -> None:
        x = self.input(0)
        expect_float(self, x, "input")
        self.expect(x.rank >= 3, f"input '{x.name}' has rank {x.rank}; InstanceNormalization needs [N, C, D...]")
        for i, role in ((1, "scale"), (2, "B")):
            self.expect_shape(self.input(i), (x.shape[1],), role)
            expect_float(self, self.input(i), role)

    def blocks(self) -> Blocks:
        return Blocks(self.input(0).shape, list(range(2, self.input(0).rank)))

    def group(self, ctx, blocks, o):
        x, y, scale, bias = self.input(0), self.output(), self.input(1), self.input(2)
        c = ix.mod(o, x.shape[1])
        passes, *_ = standardize_passes(
            ctx, x, y, blocks, o,
            lambda variance: f"{load_f(scale, c)} / sqrt({variance} + {self.epsilon()})",
            lambda v, r: f"{v} + {load_f(bias, c)}", lanes=self.in_lanes(),
        )
        return [], passes


class TrailingNorm(Norm):
    """A normalization over the axes from `axis` to the last, with broadcast Scale (and B)."""

    def check(self) -> None:
        x = self.input(0)
        expect_float(self, x, "X")
        self.ax = self.axis(int(self.attr("axis", -1)), x.rank, x.batched)
        self.norm_shape = tuple(x.shape[self.ax :])
        self.params = {}
        for i, role in ((1, "Scale"), (2, "B")):
            if self.has_input(i):
                t = self.input(i)
                expect_float(self, t, role)
                self.params[i] = (t, trailing_broadcast(self, t, self.norm_shape, role))

    def blocks(self) -> Blocks:
        return Blocks(self.input(0).shape, list(range(self.ax, self.input(0).rank)))

    def across_tiling(self, axis: int):
        """A block per tile of rows on GPUs (rows.AcrossTiling), where X's loads step by 1 along
        `axis`, its innermost axis before the normalized ones (luisaml/across.py: a LayerNorm of a
        permuted NCHW tensor), for a float X whose rows fit the tile's shared memory; else None."""
        from . import rows

        x, blocks = self.input(0), self.blocks()
        inner = [d for d in range(self.ax) if x.shape[d] > 1]
        if (x.dtype.dsl != "float" or self.output().dtype.dsl != "float" or not inner or inner[-1] != axis
                or blocks.red_strides != [1] or len(blocks.kept_sizes) != 1):
            return None
        return rows.choose_across(blocks.outer, blocks.inner)

    def emit_across(self, ctx, item: str, thread: str, tiling) -> None:
        """Emit thread `thread` of block `item` of across_tiling(): the tile's rows loaded with lanes
        along the rows (X's unit stride) into shared memory, then a warp per row from it (rows.across_rows)."""
        from . import rows
        from luisaml.storage import Local, bind

        x, blocks = self.input(0), self.blocks()
        with rows.across_rows(ctx, tiling, item, thread, x.load) as (sh, row, lane, offset):
            with bind({x: Local(sh, offset)}):
                head, passes = self.group(ctx, blocks, row)
                warp = rows.warp_loop(ctx, rows.RowTiling(tiling.rows, tiling.length), lane)
                ctx.render("norm.py.j2", outer=1, o=row, head=head, passes=passes, warp=warp)

    def param(self, i: int, r: str) -> str | None:
        """Return the float load of Scale (1) or B (2) at normalized element r, or None."""
        if i not in self.params:
            return None
        t, shape = self.params[i]
        return load_f(t, ix.broadcast_index(r, self.norm_shape, shape))

    def affine(self, value: str, r: str) -> str:
        s, b = self.param(1, r), self.param(2, r)
        v = f"{value} * {s}" if s else value
        return f"{v} + {b}" if b else v


@register("LayerNormalization", since=17)
class LayerNormalization(TrailingNorm):
    """Y = (X - mean) / sqrt(var + epsilon) * Scale + B over the axes from `axis` on; optional
    outputs Mean and InvStdDev have X's leading dims and ones after."""

    def check(self) -> None:
        super().check()
        self.expect(1 in self.params, "input 1 (Scale) is required")
        for k in (1, 2):
            out = self.outputs[k] if k < len(self.outputs) else None
            if out is not None:
                self.expect(out.numel == int(np.prod(self.input(0).shape[: self.ax], dtype=np.int64)),
                            f"output {k} '{out.name}' has shape {list(out.shape)}, expected the leading dims of X")

    def group(self, ctx, blocks, o):
        x, y = self.input(0), self.output()
        passes, mean, _, inv = standardize_passes(
            ctx, x, y, blocks, o, lambda variance: f"1.0 / sqrt({variance} + {self.epsilon()})", self.affine,
            lanes=self.in_lanes()
        )
        for k, value in ((1, mean), (2, inv)):
            out = self.outputs[k] if k < len(self.outputs) else None
            if out is not None:
                passes[-1]["post"].append(store_f(out, o, value))
        return [], passes


@register("RMSNormalization", since=23)
class RMSNormalization(TrailingNorm):
    """Y = X / sqrt(mean(X^2) + epsilon) * Scale over the axes from `axis` on."""

    def check(self) -> None:
        super().check()
        self.expect(1 in self.params, "input 1 (scale) is required")

    def group(self, ctx, blocks, o):
        x, y = self.input(0), self.output()
        r1, r2 = _var(ctx, blocks.inner, "r"), _var(ctx, blocks.inner, "r")
        q, v, inv = ctx.fresh("sq"), ctx.fresh("v"), ctx.fresh("inv")
        n = float(blocks.inner)
        p1 = _pass(
            r1,
            blocks.inner,
            [f"{v} = {load_f(x, blocks.index(o, r1))}", f"{q} += {v} * {v}"],
            [f"{q} = 0.0"],
            [f"{inv} = 1.0 / sqrt({q} / {n!r} + {self.epsilon()})"],
            sums=[q],
        )
        i = blocks.index(o, r2)
        p2 = _pass(r2, blocks.inner, [store_f(y, i, self.affine(f"{load_f(x, i)} * {inv}", r2))], sums=[])
        return [], [p1, p2]


@register("GroupNormalization", since=18)
class GroupNormalization(Norm):
    """Y = (X - mean) / sqrt(var + epsilon) * scale + bias, statistics per sample and group of
    C / num_groups channels; scale and bias are per group before opset 21, per channel from 21."""

    def check(self) -> None:
        x = self.input(0)
        expect_float(self, x, "X")
        self.expect(x.rank >= 3, f"X '{x.name}' has rank {x.rank}; GroupNormalization needs [N, C, D...]")
        self.G = int(self.attr("num_groups"))
        C = x.shape[1]
        self.expect(self.G >= 1 and C % self.G == 0, f"X has {C} channels, not divisible by num_groups {self.G}")
        self.per_channel = self.opset >= 21
        want = C if self.per_channel else self.G
        for i, role in ((1, "scale"), (2, "bias")):
            expect_float(self, self.input(i), role)
            self.expect_shape(self.input(i), (want,), role)

    def blocks(self) -> Blocks:
        # groups are contiguous: X seen as [N * G, C / G * spatial]
        x = self.input(0)
        spatial = int(np.prod(x.shape[2:], dtype=np.int64))
        return Blocks((x.shape[0] * self.G, x.shape[1] // self.G * spatial), [1])

    def group(self, ctx, blocks, o):
        x, y, scale, bias = self.input(0), self.output(), self.input(1), self.input(2)
        spatial = int(np.prod(x.shape[2:], dtype=np.int64))
        cg = x.shape[1] // self.G
        g = ix.mod(o, self.G)

        def affine(v: str, r: str) -> str:
            p = ix.add(ix.mul(g, cg), ix.div(r, spatial)) if self.per_channel else g
            return f"{v} * {load_f(scale, p)} + {load_f(bias, p)}"

        passes, *_ = standardize_passes(
            ctx, x, y, blocks, o, lambda variance: f"1.0 / sqrt({variance} + {self.epsilon()})", affine,
            lanes=self.in_lanes()
        )
        return [], passes


@register("LpNormalization", since=1)
class LpNormalization(Norm):
    """Y = X / ||X||_p along `axis` (p is 1 or 2); a zero norm gives zeros, an infinite one 0 for
    the finite elements and NaN for the infinite ones, as in onnxruntime."""

    def check(self) -> None:
        x = self.input(0)
        expect_float(self, x, "input")
        self.ax = self.axis(int(self.attr("axis", -1)), x.rank, x.batched)
        self.p = int(self.attr("p", 2))
        self.expect(self.p in (1, 2), f"p must be 1 or 2, not {self.p}")

    def blocks(self) -> Blocks:
        return Blocks(self.input(0).shape, [self.ax])

    def group(self, ctx, blocks, o):
        x, y = self.input(0), self.output()
        r1, r2 = _var(ctx, blocks.inner, "r"), _var(ctx, blocks.inner, "r")
        acc, v, norm, inv = ctx.fresh("acc"), ctx.fresh("v"), ctx.fresh("norm"), ctx.fresh("inv")
        term = f"abs({v})" if self.p == 1 else f"{v} * {v}"
        # x * (1 / norm), 1 / norm taken as 0 for a zero norm (zeros out) and an infinite one (a
        # finite x gives 0, inf NaN, as x / inf does): the backends turn 1 / sqrt into a
        # reciprocal square root whose refinement makes NaN of sqrt(inf)
        p1 = _pass(
            r1,
            blocks.inner,
            [f"{v} = {load_f(x, blocks.index(o, r1))}", f"{acc} += {term}"],
            [f"{acc} = 0.0"],
            [f"{norm} = {acc if self.p == 1 else f'sqrt({acc})'}",
             f"{inv} = (1.0 / {norm} if {norm} != 0.0 and not isinf({norm}) else 0.0)"],
            sums=[acc],
        )
        i = blocks.index(o, r2)
        p2 = _pass(r2, blocks.inner, [store_f(y, i, f"{load_f(x, i)} * {inv}")], sums=[])
        return [], [p1, p2]


@register("MeanVarianceNormalization", since=13)
class MeanVarianceNormalization(Norm):
    """Y = (X - mean) / (sqrt(var) + 1e-9) over `axes` (default [0, 2, 3]), as ONNX's function."""

    def check(self) -> None:
        x = self.input(0)
        expect_float(self, x, "X")
        axes = self.attr("axes", [0, 2, 3])
        self.axes = sorted({self.axis(a, x.rank, x.batched, "axes entry") for a in axes})

    def blocks(self) -> Blocks:
        return Blocks(self.input(0).shape, self.axes)

    def group(self, ctx, blocks, o):
        passes, *_ = standardize_passes(
            ctx, self.input(0), self.output(), blocks, o,
            lambda variance: f"1.0 / (sqrt({variance}) + {f32(1e-9)})", lambda v, r: v, lanes=self.in_lanes()
        )
        return [], passes


@register("LRN", since=1)
class LRN(Operator):
    """Local response normalization across channels:
    Y = X / (bias + alpha / size * sum of X^2 over the `size` channels around c) ^ beta.
    Each element is one window over the channels: a stage runs one thread per element."""

    stores_once = True

    def check(self) -> None:
        x = self.input(0)
        expect_float(self, x, "X")
        self.expect(x.rank >= 3, f"X '{x.name}' has rank {x.rank}; LRN needs [N, C, D...]")
        self.size = int(self.attr("size"))
        self.expect(self.size >= 1, f"size must be >= 1, not {self.size}")

    def emit(self, ctx, outer: list[tuple[str, int]], n: str, c: str, s: str, store: bool) -> str:
        """Render the window sum of the element at (sample n, channel c, spatial s) inside the
        loops `outer` (none: one element); with `store`, store it. Return its value."""
        x, y = self.input(0), self.output()
        _, C, S = self.dims()
        before = (self.size - 1) // 2  # channels below c in the window; ceil((size-1)/2) above
        j = ctx.fresh("j") if self.size > 1 else "0"
        cc, sq, v = ctx.fresh("cc"), ctx.fresh("sq"), ctx.fresh("v")
        xi = lambda ch: ix.add(ix.mul(ix.add(ix.mul(n, C), ch), S), s)  # noqa: E731
        window = [{"var": j, "n": self.size, "pre": [f"{cc} = {c} + {j} - {before}"], "cond": f"{cc} >= 0 and {cc} < {C}"}]
        alpha = float(self.attr("alpha", 1e-4)) / self.size
        base = f"{f32(float(self.attr('bias', 1.0)))} + {f32(alpha)} * {sq}"
        value = f"{load_f(x, xi(c))} / pow({base}, {f32(float(self.attr('beta', 0.75)))})"
        ctx.render("conv.py.j2", outer=outer, head=[f"{sq} = 0.0"], window=window,
                   body=[f"{v} = {load_f(x, xi(cc))}", f"{sq} += {v} * {v}"],
                   tail=[store_f(y, xi(c), value)] if store else [])
        return f"half({value})" if y.dtype.dsl == "half" else value

    def dims(self) -> tuple[int, int, int]:
        """Return X as [N, C, spatial]."""
        x = self.input(0)
        return x.shape[0], x.shape[1], int(np.prod(x.shape[2:], dtype=np.int64))

    def forward(self, ctx) -> None:
        outer = [(ctx.fresh("o") if k > 1 else "0", k) for k in self.dims()]
        self.emit(ctx, outer, *(v for v, _ in outer), store=True)

    def element(self, ctx, i, k=0):
        dims = self.dims()
        n, c, s = (ctx.let(v, "o") if d > 1 else "0" for v, d in zip(ix.unravel(i, dims), dims))
        return self.emit(ctx, [], n, c, s, store=False)
