"""Detection post-processing with outputs sized at run time: ONNX NonZero and NonMaxSuppression, and
the `luisaml` domain's RotatedNMS (bird's-eye-view boxes) and CircleNMS (opsets/luisaml.py).

Each runs as the phases of luisaml/dynamic.py: a count phase, the in-place prefix sum over the
counts, a fill phase. The counts and offsets live in the node's own int scratch (words 0..items),
not in an output: these ops have one output, whose size is the total (a `ScratchTotal`: word
`items`, counted on the device and read with the outputs at the run's end).

NonZero: a work item per PER_ITEM consecutive elements; the fill writes each nonzero's coordinates
in flat (row-major) order, as the spec and onnxruntime give them. Its output is [rank, N], N the
count: the run-time sized dimension is the last (Operator.runtime_axis).

The NMS ops: a work item per (batch, class) group runs the greedy suppression of
onnxruntime (non_max_suppression.cc): repeatedly the candidate of highest score (ties: the lower
box index, as onnxruntime's priority queue orders them) is selected, and every remaining candidate
it overlaps by more than the threshold is dropped, until max_output are selected or none remains.
Each box's state is a scratch word (0 candidate, -1 dropped, k > 0 selected k-th), so the fill
phase writes the selected boxes at their rank without walking again. O(N x selected) per group; the
groups run in parallel.

No output of these nodes is per sample (NonZero over a batched tensor names the batch coordinate
too; NMS selects across the batch's boxes in one list), so a batched input makes the network compile
per batch size (BatchMixingError), where the batch is a static dimension like any other.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from luisaml.dynamic import Phase, ScratchTotal, scan_phases
from luisaml.model import shape_str
from luisaml.operator import Operator
from luisaml.opsets import luisaml as schema
from luisaml.registry import register
from luisaml.storage import Buffer, literal

PER_ITEM = 64  # NonZero: input elements one work item counts and fills

SCRATCH = "scratch_int"  # the node's own int scratch (Operator.scratch)


def _offsets() -> Buffer:
    """The counts, then exclusive offsets, of a node's work items: words 0..items of its scratch."""
    return Buffer(SCRATCH, "0")


class CountedOp(Operator):
    """Base of the ops here: count, prefix sum, fill; the total is scratch word `items` (a
    ScratchTotal). Subclasses set self.items and emit count_item/fill_item."""

    runtime_sized = (0,)
    items = 0
    state_words = 0  # scratch words after the offsets (the NMS ops' per-box state)

    def scratch(self):
        return {"int": self.items + 1 + self.state_words}

    def phases(self):
        scan = scan_phases(_offsets(), self.items)
        # the total is the last offset, in the scratch (no static output holds it)
        scan[-1] = dataclasses.replace(scan[-1], readback=ScratchTotal(self.items))
        return ([Phase("count", self.items, self.count_item)] + scan
                + [Phase("fill", self.items, self.fill_item)])

    def no_batch(self) -> None:
        """Raise BatchMixingError for a batched input: the output lists rows of every sample."""
        for k, t in enumerate(self.inputs):
            if t is not None and t.batched:
                raise self.mixing(f"input {k} '{t.name}' follows the batch, and the output gathers rows of every "
                                  "sample (its size is the whole batch's count)")

    def count_item(self, ctx, item: str) -> None:
        raise NotImplementedError

    def fill_item(self, ctx, item: str) -> None:
        raise NotImplementedError


@register("NonZero", since=9)
class NonZero(CountedOp):
    """Indices of the nonzero elements, int64 [rank, N], in row-major order (NonZero-9 and -13)."""

    runtime_axis = 1

    def check(self):
        self.no_batch()
        x = self.input(0)
        self.expect_dtype(x, ("float", "int", "bool", "UINT32"), "input X")
        self.expect(x.rank >= 1, f"input X '{x.name}' is a scalar; NonZero needs rank >= 1")
        out = self.output(0)
        self.expect_dtype(out, ("INT64",), "output Y")
        self.expect(tuple(out.shape) == (x.rank, 0), f"output Y '{out.name}' must be [{x.rank}, N] for input "
                    f"{shape_str(x.shape)}, got {shape_str(out.shape)}")
        self.items = -(-x.numel // PER_ITEM)

    def _nonzero(self, v: str) -> str:
        x = self.input(0)
        return v if x.dtype.is_bool else f"{v} != {literal(0, x.dtype)}"

    def _walk(self, ctx, item: str, on_nonzero) -> str:
        """Emit the loop over the item's elements; return its count variable."""
        x = self.input(0)
        count = ctx.fresh("count")
        ctx.line(f"{count} = 0")
        first = ctx.let(f"{item} * {PER_ITEM}", "first")
        i = ctx.fresh("i")
        ctx.line(f"for {i} in range({first}, min({first} + {PER_ITEM}, {x.numel})):")
        with ctx.indent():
            ctx.line(f"if {self._nonzero(x.load(i))}:")
            with ctx.indent():
                on_nonzero(i, count)
                ctx.line(f"{count} += 1")
        return count

    def count_item(self, ctx, item):
        count = self._walk(ctx, item, lambda i, count: None)
        ctx.line(_offsets().store(f"{item} + 1", count))

    def fill_item(self, ctx, item):
        from luisaml.indexing import unravel

        x, out = self.input(0), self.output(0)
        offsets = _offsets()
        start = ctx.let(offsets.load(item), "start")
        total = ctx.let(offsets.load(str(self.items)), "total")

        def store(i, count):
            col = ctx.let(f"{start} + {count}", "col")
            for d, c in enumerate(unravel(i, tuple(x.shape))):
                ctx.store(out, f"{d} * {total} + {col}", c)

        self._walk(ctx, item, store)

    def describe(self):
        return (f"{self.items} items of {PER_ITEM} elements: count, prefix sum, fill "
                f"[{self.input(0).rank}, N]")


# ---- non-maximum suppression ----------------------------------------------------------------------

class GreedyNMS(CountedOp):
    """The greedy suppression of a group of n boxes per work item (the module's doc). Subclasses give
    n, the groups, each box's score (score_of), whether a candidate passes the score filter
    (eligible), suppress(ctx, i, j) and the rows each selected box writes (write_selected)."""

    n = 0

    def setup_groups(self, groups: int, n: int) -> None:
        self.items, self.n = groups, n
        self.state_words = groups * n

    def state(self, item: str, j: str) -> str:
        """The scratch word of box j of group item (an index expression)."""
        return f"{self.items + 1} + {item} * {self.n} + {j}"

    def max_output(self, ctx) -> str:
        """The most boxes a group selects (a DSL int expression)."""
        raise NotImplementedError

    def score_of(self, ctx, item: str, j: str) -> str:
        raise NotImplementedError

    def eligible(self, ctx, item: str, score: str) -> str | None:
        return None

    def suppress(self, ctx, item: str, cand: str, kept: str) -> str:
        """Emit the test of whether selected box `kept` suppresses candidate `cand`; return its bool."""
        raise NotImplementedError

    def write_selected(self, ctx, item: str, row: str, j: str) -> None:
        raise NotImplementedError

    def count_item(self, ctx, item):
        j = ctx.fresh("j")
        ctx.line(f"for {j} in range({self.n}):")
        with ctx.indent():
            score = ctx.let(self.score_of(ctx, item, j), "s")
            ok = self.eligible(ctx, item, score)
            ctx.line(f"{SCRATCH}.write({self.state(item, j)}, {'0' if ok is None else f'0 if {ok} else -1'})")
        kept, best, best_s, going = (ctx.fresh(v) for v in ("kept", "best", "best_s", "going"))
        limit = ctx.let(self.max_output(ctx), "limit")
        ctx.line(f"{kept} = 0")
        ctx.line(f"{going} = {kept} < {limit}")
        ctx.line(f"while {going}:")
        with ctx.indent():
            ctx.line(f"{best} = -1")
            ctx.line(f"{best_s} = 0.0")
            ctx.line(f"for {j} in range({self.n}):")
            with ctx.indent():
                ctx.line(f"if {SCRATCH}.read({self.state(item, j)}) == 0:")
                with ctx.indent():
                    s = ctx.let(self.score_of(ctx, item, j), "s")
                    # strictly greater: of equal scores the lower index comes first (onnxruntime's order)
                    ctx.line(f"if {best} < 0 or {s} > {best_s}:")
                    with ctx.indent():
                        ctx.line(f"{best} = {j}")
                        ctx.line(f"{best_s} = {s}")
            ctx.line(f"if {best} < 0:")
            with ctx.indent():
                ctx.line(f"{going} = False")
            ctx.line("else:")
            with ctx.indent():
                ctx.line(f"{kept} += 1")
                ctx.line(f"{SCRATCH}.write({self.state(item, best)}, {kept})")
                ctx.line(f"{going} = {kept} < {limit}")
                ctx.line(f"if {going}:")
                with ctx.indent():
                    ctx.line(f"for {j} in range({self.n}):")
                    with ctx.indent():
                        ctx.line(f"if {SCRATCH}.read({self.state(item, j)}) == 0:")
                        with ctx.indent():
                            sup = self.suppress(ctx, item, j, best)
                            ctx.line(f"if {sup}:")
                            with ctx.indent():
                                ctx.line(f"{SCRATCH}.write({self.state(item, j)}, -1)")
        ctx.line(_offsets().store(f"{item} + 1", kept))

    def fill_item(self, ctx, item):
        start = ctx.let(_offsets().load(item), "start")
        j = ctx.fresh("j")
        ctx.line(f"for {j} in range({self.n}):")
        with ctx.indent():
            rank = ctx.let(f"{SCRATCH}.read({self.state(item, j)})", "rank")
            ctx.line(f"if {rank} > 0:")
            with ctx.indent():
                self.write_selected(ctx, item, f"{start} + {rank} - 1", j)


def _scalar(op: Operator, k: int, what: str, dtype_kind: str):
    """Return (the host value or None, the tensor or None) of optional scalar input k: a constant,
    or a graph input read at run time (its load emitted where a phase runs, under its bindings)."""
    if not op.has_input(k):
        return None, None
    t = op.input(k)
    op.expect_dtype(t, (dtype_kind,), f"input {what}")
    op.expect(t.numel == 1, f"input {what} '{t.name}' must hold one value, got shape {shape_str(t.shape)}")
    if t.value is not None:
        return np.asarray(t.value).reshape(-1)[0], None
    return None, t


def _expr(value, tensor, default: str, float_kind: bool) -> str:
    """The DSL expression of a scalar from _scalar: its literal, its load, or the default."""
    if tensor is not None:
        return tensor.load("0")
    if value is None:
        return default
    return repr(float(np.float32(value))) if float_kind else str(int(value))


@register("NonMaxSuppression", since=10)
class NonMaxSuppression(GreedyNMS):
    """ONNX NonMaxSuppression (10, 11): int64 [num_selected, 3] (batch, class, box), per batch, per
    class, in selection (descending score) order; onnxruntime's IoU test (IoU > threshold, boxes of
    zero area or no overlap never suppress), score filter (score > score_threshold) and ties."""

    def check(self):
        self.no_batch()
        boxes, scores = self.input(0), self.input(1)
        self.expect_dtype(boxes, ("FLOAT",), "input boxes")
        self.expect_dtype(scores, ("FLOAT",), "input scores")
        self.expect(boxes.rank == 3 and boxes.shape[2] == 4, f"input boxes '{boxes.name}' must be "
                    f"[num_batches, spatial_dimension, 4], got {shape_str(boxes.shape)}")
        B, N = boxes.shape[0], boxes.shape[1]
        self.expect(scores.rank == 3 and scores.shape[0] == B and scores.shape[2] == N,
                    f"input scores '{scores.name}' must be [{B}, num_classes, {N}] for boxes "
                    f"{shape_str(boxes.shape)}, got {shape_str(scores.shape)}")
        self.B, self.C = B, scores.shape[1]
        self.center = int(self.attr("center_point_box", 0))
        self.expect(self.center in (0, 1), f"center_point_box must be 0 or 1, got {self.center}")
        self.max_out = _scalar(self, 2, "max_output_boxes_per_class", "int")
        self.iou = _scalar(self, 3, "iou_threshold", "float")
        self.score_min = _scalar(self, 4, "score_threshold", "float")
        if self.max_out[0] is not None:  # absent: 0 (no output); negative as 0; above N as N (a 32-bit int)
            self.max_out = (min(max(int(self.max_out[0]), 0), N), None)
        if self.iou[0] is not None:
            self.expect(0.0 <= float(self.iou[0]) <= 1.0, "iou_threshold must be in [0, 1] (as onnxruntime checks), "
                        f"got {float(self.iou[0])}")
        out = self.output(0)
        self.expect_dtype(out, ("INT64",), "output selected_indices")
        self.expect(tuple(out.shape) == (0, 3), f"output selected_indices '{out.name}' must be [num_selected, 3], "
                    f"got {shape_str(out.shape)}")
        self.setup_groups(self.B * self.C, N)

    def max_output(self, ctx):
        return _expr(*self.max_out, "0", False)

    def score_of(self, ctx, item, j):
        return self.input(1).load(f"{item} * {self.n} + {j}")  # scores [B, C, N]: item = b * C + c

    def eligible(self, ctx, item, score):
        if self.score_min == (None, None):
            return None
        return f"{score} > {_expr(*self.score_min, '', True)}"

    def _extent(self, ctx, item: str, j: str) -> tuple[str, str, str, str]:
        """Emit (x_min, x_max, y_min, y_max) of box j of the group's batch, as onnxruntime computes them."""
        boxes = self.input(0)
        base = ctx.let(f"(({item}) // {self.C} * {self.n} + {j}) * 4", "bx")
        v = [ctx.let(boxes.load(f"{base} + {k}"), "c") for k in range(4)]
        if self.center == 0:  # [y1, x1, y2, x2], any diagonal pair
            return (ctx.let(f"min({v[1]}, {v[3]})", "x0"), ctx.let(f"max({v[1]}, {v[3]})", "x1"),
                    ctx.let(f"min({v[0]}, {v[2]})", "y0"), ctx.let(f"max({v[0]}, {v[2]})", "y1"))
        hw, hh = ctx.let(f"{v[2]} / 2.0", "hw"), ctx.let(f"{v[3]} / 2.0", "hh")  # [xc, yc, w, h]
        return (ctx.let(f"{v[0]} - {hw}", "x0"), ctx.let(f"{v[0]} + {hw}", "x1"),
                ctx.let(f"{v[1]} - {hh}", "y0"), ctx.let(f"{v[1]} + {hh}", "y1"))

    def suppress(self, ctx, item, cand, kept):
        a = self._extent(ctx, item, cand)
        b = self._extent(ctx, item, kept)
        sup = ctx.fresh("sup")
        ctx.line(f"{sup} = False")
        ix0, ix1 = ctx.let(f"max({a[0]}, {b[0]})", "ix0"), ctx.let(f"min({a[1]}, {b[1]})", "ix1")
        iy0, iy1 = ctx.let(f"max({a[2]}, {b[2]})", "iy0"), ctx.let(f"min({a[3]}, {b[3]})", "iy1")
        ctx.line(f"if {ix1} > {ix0} and {iy1} > {iy0}:")
        with ctx.indent():
            inter = ctx.let(f"({ix1} - {ix0}) * ({iy1} - {iy0})", "inter")
            area_a = ctx.let(f"({a[1]} - {a[0]}) * ({a[3]} - {a[2]})", "area")
            area_b = ctx.let(f"({b[1]} - {b[0]}) * ({b[3]} - {b[2]})", "area")
            union = ctx.let(f"{area_a} + {area_b} - {inter}", "union")
            ctx.line(f"if {inter} > 0.0 and {area_a} > 0.0 and {area_b} > 0.0 and {union} > 0.0:")
            with ctx.indent():
                ctx.line(f"{sup} = {inter} / {union} > {_expr(*self.iou, '0.0', True)}")
        return sup

    def write_selected(self, ctx, item, row, j):
        out = self.output(0)
        r = ctx.let(row, "row")
        ctx.store(out, f"{r} * 3", f"({item}) // {self.C}")
        ctx.store(out, f"{r} * 3 + 1", f"({item}) % {self.C}")
        ctx.store(out, f"{r} * 3 + 2", j)

    def describe(self):
        return (f"greedy NMS of {self.n} boxes, a thread per (batch, class) of {self.B}x{self.C}: count, prefix "
                f"sum, fill (the count kept on the device)")


# ---- the luisaml domain: BEV boxes ----------------------------------------------------------------

class KeptIndices(GreedyNMS):
    """Base of the luisaml domain's NMS ops: one group of N boxes (scores [N]), int64 [K] kept indices
    in score order, at most max_output (-1: all)."""

    THRESHOLD = ""

    def check(self):
        self.no_batch()
        first, scores = self.input(0), self.input(1)
        self.expect_dtype(first, ("FLOAT",), f"input {first.name}")
        self.expect_dtype(scores, ("FLOAT",), "input scores")
        self.expect(scores.rank == 1, f"input scores '{scores.name}' must be [N], got {shape_str(scores.shape)}")
        n = scores.shape[0]
        self.expect(first.rank == 2 and first.shape[0] == n, f"input '{first.name}' must have {n} rows (one per "
                    f"score), got {shape_str(first.shape)}")
        self.threshold = float(np.float32(self.attr(self.THRESHOLD)))
        self.limit = int(self.attr("max_output", -1))
        self.expect(self.limit >= -1, f"max_output must be >= 0 or -1 (no limit), got {self.limit}")
        out = self.output(0)
        self.expect_dtype(out, ("INT64",), "output kept")
        self.expect(tuple(out.shape) == (0,), f"output kept '{out.name}' must be [K], got {shape_str(out.shape)}")
        self.setup_groups(1, n)
        self.check_boxes(first)

    def check_boxes(self, first) -> None:
        """Check the first input's columns (subclasses)."""

    def max_output(self, ctx):
        return str(self.n if self.limit < 0 else min(self.limit, self.n))

    def score_of(self, ctx, item, j):
        return self.input(1).load(j)

    def write_selected(self, ctx, item, row, j):
        ctx.store(self.output(0), row, j)


@register(schema.ROTATED_NMS, domain=schema.DOMAIN, since=1)
class RotatedNMS(KeptIndices):
    """luisaml.RotatedNMS: OpenPCDet's nms_gpu over rotated BEV boxes (opsets/luisaml.py). The
    intersection of the two rectangles is the candidate's corners clipped by the kept box's four edges
    (Sutherland-Hodgman: a convex polygon of up to 8 corners), its area by the shoelace formula;
    OpenPCDet gathers the same polygon from edge crossings and inside corners sorted by angle."""

    THRESHOLD = "iou_threshold"

    def check_boxes(self, boxes):
        self.expect(boxes.shape[1] in (5, 7), f"input boxes '{boxes.name}' must be [N, 5] (x, y, dx, dy, heading) "
                    f"or [N, 7] (x, y, z, dx, dy, dz, heading), got {shape_str(boxes.shape)}")
        w = boxes.shape[1]
        self.cols = (0, 1, 2, 3, 4) if w == 5 else (0, 1, 3, 4, 6)

    def _corners(self, ctx, j: str) -> tuple[str, str, str]:
        """Emit box j's four corners, counter-clockwise, into local arrays; return (xs, ys, area)."""
        boxes, w = self.input(0), self.input(0).shape[1]
        x, y, dx, dy, h = (ctx.let(boxes.load(f"{j} * {w} + {c}"), v) for c, v in zip(self.cols, "xywlh"))
        cs, sn = ctx.let(f"cos({h})", "cs"), ctx.let(f"sin({h})", "sn")
        xs, ys = ctx.local_array("float", 4, "cx"), ctx.local_array("float", 4, "cy")
        for k, (sx, sy) in enumerate(((-1, -1), (1, -1), (1, 1), (-1, 1))):
            ux = ctx.let(f"{dx} * {sx * 0.5}", "ux")
            uy = ctx.let(f"{dy} * {sy * 0.5}", "uy")
            ctx.line(f"{xs}[{k}] = {ux} * {cs} - {uy} * {sn} + {x}")
            ctx.line(f"{ys}[{k}] = {ux} * {sn} + {uy} * {cs} + {y}")
        return xs, ys, ctx.let(f"{dx} * {dy}", "area")

    def suppress(self, ctx, item, cand, kept):
        ax, ay, area_a = self._corners(ctx, cand)
        bx, by, area_b = self._corners(ctx, kept)
        px, py, qx, qy = (ctx.local_array("float", 8, v) for v in ("px", "py", "qx", "qy"))
        n, m = ctx.fresh("n"), ctx.fresh("m")
        k = ctx.fresh("k")
        ctx.line(f"for {k} in range(4):")
        with ctx.indent():
            ctx.line(f"{px}[{k}] = {ax}[{k}]")
            ctx.line(f"{py}[{k}] = {ay}[{k}]")
        ctx.line(f"{n} = 4")
        e = ctx.fresh("e")
        ctx.line(f"for {e} in range(4):")  # clip by the kept box's edge e (inside: to its left)
        with ctx.indent():
            e1 = ctx.let(f"({e} + 1) % 4", "e1")
            ex, ey = ctx.let(f"{bx}[{e1}] - {bx}[{e}]", "ex"), ctx.let(f"{by}[{e1}] - {by}[{e}]", "ey")
            ctx.line(f"{m} = 0")
            ctx.line(f"for {k} in range({n}):")
            with ctx.indent():
                prev = ctx.let(f"({k} + {n} - 1) % {n}", "prev")
                d_cur = ctx.let(f"{ex} * ({py}[{k}] - {by}[{e}]) - {ey} * ({px}[{k}] - {bx}[{e}])", "dc")
                d_prev = ctx.let(f"{ex} * ({py}[{prev}] - {by}[{e}]) - {ey} * ({px}[{prev}] - {bx}[{e}])", "dp")

                def crossing():
                    t = ctx.let(f"{d_prev} / ({d_prev} - {d_cur})", "t")
                    ctx.line(f"if {m} < 8:")
                    with ctx.indent():
                        ctx.line(f"{qx}[{m}] = {px}[{prev}] + {t} * ({px}[{k}] - {px}[{prev}])")
                        ctx.line(f"{qy}[{m}] = {py}[{prev}] + {t} * ({py}[{k}] - {py}[{prev}])")
                    ctx.line(f"{m} += 1")

                ctx.line(f"if {d_cur} >= 0.0:")
                with ctx.indent():
                    ctx.line(f"if {d_prev} < 0.0:")
                    with ctx.indent():
                        crossing()
                    ctx.line(f"if {m} < 8:")
                    with ctx.indent():
                        ctx.line(f"{qx}[{m}] = {px}[{k}]")
                        ctx.line(f"{qy}[{m}] = {py}[{k}]")
                    ctx.line(f"{m} += 1")
                ctx.line(f"elif {d_prev} >= 0.0:")
                with ctx.indent():
                    crossing()
            ctx.line(f"{n} = min({m}, 8)")
            ctx.line(f"for {k} in range({n}):")
            with ctx.indent():
                ctx.line(f"{px}[{k}] = {qx}[{k}]")
                ctx.line(f"{py}[{k}] = {qy}[{k}]")
        twice = ctx.fresh("twice")
        ctx.line(f"{twice} = 0.0")
        ctx.line(f"for {k} in range({n}):")
        with ctx.indent():
            k1 = ctx.let(f"({k} + 1) % {n}", "k1")
            ctx.line(f"{twice} += {px}[{k}] * {py}[{k1}] - {px}[{k1}] * {py}[{k}]")
        inter = ctx.let(f"abs({twice}) * 0.5 if {n} >= 3 else 0.0", "inter")
        iou = ctx.let(f"{inter} / max({area_a} + {area_b} - {inter}, 1e-8)", "iou")
        return ctx.let(f"{iou} > {self.threshold!r}", "sup")

    def describe(self):
        return (f"greedy rotated-BEV NMS of {self.n} boxes (IoU > {self.threshold}), one thread: count, fill "
                "(the count kept on the device)")


@register(schema.CIRCLE_NMS, domain=schema.DOMAIN, since=1)
class CircleNMS(KeptIndices):
    """luisaml.CircleNMS: CenterPoint's circle_nms (opsets/luisaml.py)."""

    THRESHOLD = "min_radius"

    def check_boxes(self, centers):
        self.expect(centers.shape[1] >= 2, f"input centers '{centers.name}' must be [N, D >= 2], got "
                    f"{shape_str(centers.shape)}")
        self.radius2 = float(np.float32(float(self.attr("min_radius")) ** 2))

    def suppress(self, ctx, item, cand, kept):
        c, w = self.input(0), self.input(0).shape[1]
        dx = ctx.let(f"{c.load(f'{kept} * {w}')} - {c.load(f'{cand} * {w}')}", "dx")
        dy = ctx.let(f"{c.load(f'{kept} * {w} + 1')} - {c.load(f'{cand} * {w} + 1')}", "dy")
        xx, yy = ctx.let(f"{dx} * {dx}", "xx"), ctx.let(f"{dy} * {dy}", "yy")
        return ctx.let(f"{xx} + {yy} <= {self.radius2!r}", "sup")

    def describe(self):
        return (f"greedy circle NMS of {self.n} centres (d^2 <= {self.radius2}), one thread: count, fill (the count "
                "kept on the device)")
