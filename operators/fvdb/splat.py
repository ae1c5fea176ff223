"""The splats: SplatTrilinear and SplatBezier (fVDB's ops/SplatTrilinear.cu, SplatBezier.cu), the
adjoints of the samplers, and SplatNearest (luisaml's: a point cloud's sum by voxel, what voxelizing
it needs). Each active tap of each point adds w * value into [total_voxels, C]; in batch mode every
sample adds into the shared output with atomics (Operator.accumulates).

SplatNearest also runs over a grid bound at run time with the voxels as the batch (VoxelBatch: the
points are the batch's rows too, a sparse network's first layer), as two phases: each sample zeroes
its voxel's row, then each sample that is a point adds its value into its voxel's row atomically."""
from __future__ import annotations

from luisaml import indexing as ix
from luisaml.dynamic import Phase
from luisaml.fvdb.op_mixins import VoxelBatch
from luisaml.fvdb.voxel_rows import GRID
from luisaml.model import shape_str
from luisaml.operator import CompileError
from luisaml.opsets import fvdb as schema
from luisaml.registry import register

from .common import GridRef
from .sample import _Interpolation


class _Splat(_Interpolation):
    accumulates = (0,)

    def check_inputs(self):
        super().check_inputs()
        pts, values = self.jagged
        v, y = values.jdata, self.output()
        self.expect(v.shape[0] == pts.jdata.shape[0] and v.batched == pts.jdata.batched,
                    f"values_jdata '{v.name}' {shape_str(v.shape)} must have one row per point of "
                    f"points_jdata {shape_str(pts.jdata.shape)}")
        self.voxels = y.shape[0]
        self.expect(tuple(y.shape[1:]) == tuple(v.shape[1:]),
                    f"output '{y.name}' {shape_str(y.shape)} must be [total_voxels] + {list(v.shape[1:])}")
        total = self.attr("total_voxels", None)
        self.expect(total is None or int(total) == self.voxels,
                    f"attribute total_voxels = {total} but the output has {self.voxels} rows")

    def metadata_params(self):
        return (("expect_voxels", self.voxels),)

    def add(self, ctx, index: str, value: str) -> None:
        """Emit out[index] += value: atomically when every sample adds into the output."""
        y = self.output()
        if self.cooperative(0):
            ctx.line(f"{ctx.fresh('old')} = {y.storage.atomic_add(index, value)}")
        else:
            ctx.store(y, index, f"{y.load(index)} + {value}")

    def forward(self, ctx):
        # zero the output, unless the runtime zeroed it for the samples to add into
        if not self.cooperative(0):
            y = self.output()
            with ctx.loop(y.numel, "i") as i:
                ctx.store(y, i, "0.0")
        with self.voxel_points(ctx, lambda n: None) as (n, g, x):
            self.scatter(ctx, n, g, x)

    def scatter(self, ctx, n: str, g: GridRef, x: list[str]) -> None:
        """Emit the adds of point n's values into the taps around voxel-space x (subclasses)."""
        raise NotImplementedError

    def describe(self):
        return f"{self.taps} NanoVDB lookups per point, {'atomic adds' if self.cooperative(0) else 'one thread'}"

    def value(self, n: str, ch: str) -> str:
        """Return the load of channel ch of point n's value."""
        return self.jagged[1].jdata.load(ix.add(ix.mul(n, self.channels), ch))


@register("SplatTrilinear", domain="fvdb", since=1)
class SplatTrilinear(_Splat):
    """fVDB splat_trilinear: every active corner gets += w * value, no normalisation."""

    taps = 8

    def scatter(self, ctx, n, g, x):
        C = self.channels
        rows, w, _ = self.trilinear_stencil(ctx, x, g, inactive_row=-1)
        with ctx.loop(8, "corner") as c:
            ctx.line(f"if {rows}[{c}] >= 0:")
            with ctx.indent(), ctx.loop(C, "ch") as ch:
                self.add(ctx, ix.add(ix.mul(f"{rows}[{c}]", C), ch), f"{w}[{c}] * {self.value(n, ch)}")


@register("SplatBezier", domain="fvdb", since=1)
class SplatBezier(_Splat):
    """fVDB splat_bezier: every active tap of the 27 gets += w * value."""

    taps = 27

    def scatter(self, ctx, n, g, x):
        C = self.channels
        with self.bezier_taps(ctx, x, g) as (v, w, row):
            ctx.line(f"if {v} > 0:")
            with ctx.indent(), ctx.loop(C, "ch") as ch:
                self.add(ctx, ix.add(ix.mul(row, C), ch), f"{w} * {self.value(n, ch)}")


@register("SplatNearest", domain="fvdb", since=1)
class SplatNearest(VoxelBatch, _Splat):
    """out[voxel of round(world_to_voxel(p))] += value, for each point whose voxel is active."""

    taps = 1
    # a grid bound at run time (of any size and count): the output then has a row per sample (probe_rows)
    any_grid = any_count = True

    @classmethod
    def pinned_by_example(cls, op_type):
        return ("total_voxels",)  # (torch_ops writes the traced grid's count)

    @classmethod
    def probe_rows(cls, node, probe, inputs):
        """Over a grid bound at run time, a row per sample (the voxels are the batch); else None."""
        if not (probe is not None and any(node.inputs[k] in probe.bound for k in range(len(schema.BUNDLE)))):
            return None
        values = inputs[len(schema.BUNDLE) + len(schema.JAGGED)] if inputs else None
        if probe.batch is None or values is None or values.shape is None:
            raise CompileError(f"{node.describe()}: the grid is bound at run time, so the output has a row per voxel "
                               "of a grid known only then: make the points the batch (a dynamic first dimension, "
                               "batch_axis='auto'), their voxels then the batch's rows too")
        return [(values.elem_type, (probe.batch,) + tuple(values.shape[1:]))]

    @property
    def phased(self) -> bool:  # (Operator.phased: over the voxels as the batch, two phases)
        return self.voxel_batch

    @property
    def accumulates(self) -> tuple:  # (over the voxels as the batch, the phases add; no shared output)
        return () if self.voxel_batch else (0,)

    def check_inputs(self):
        self.voxel_batch = self.output().batched
        if not self.voxel_batch:
            super().check_inputs()
            return
        _Interpolation.check_inputs(self)
        pts, values = self.jagged
        self.expect(pts.jdata.batched and values.jdata.batched, "the output follows the batch axis (the voxels of a "
                    "grid bound at run time), so the points and values must be the batch's rows too")
        self.expect(tuple(self.output().shape) == (1,) + tuple(values.jdata.shape[1:]),
                    f"output '{self.output().name}' {shape_str(self.output().shape)} per sample must be values' row")

    def metadata_params(self):
        return () if self.voxel_batch else super().metadata_params()

    def scatter(self, ctx, n, g, x):
        v = self._voxel(ctx, g, x)
        ctx.line(f"if {v} > 0:")
        with ctx.indent(), ctx.loop(self.channels, "ch") as ch:
            self.add(ctx, ix.add(ix.mul(f"({g.voxel_offset} + {v} - 1)", self.channels), ch), self.value(n, ch))

    @staticmethod
    def _voxel(ctx, g: GridRef, x: list[str]) -> str:
        rnd = ctx.use_helper("nvdb_round", "nanovdb")
        return ctx.let(g.lookup([f"{rnd}({c})" for c in x]), "v")

    # ---- the voxels as the batch -------------------------------------------------------------
    def row_links(self):
        if not self.voxel_batch:
            return None  # (its rows: the grid's voxels; the points' rows are the batch's, linked to no grid)
        return [(self.output().name, GRID + self.node.inputs[5])]

    def phases(self):
        return [Phase("each voxel's row zeroed", 1, self._emit_zero),
                Phase("each point's value added into its voxel's row (atomics)", 1, self._emit_add)]

    def _emit_zero(self, ctx, item):
        with ctx.loop(self.channels, "ch") as ch:
            ctx.store(self.output(), ch, "0.0")

    def _emit_add(self, ctx, item):
        pts, values = self.jagged
        C, y = self.channels, self.output()
        # the batch's rows past the points are padding (a grid with more voxels than points)
        count = self.derived[1].load("0") if self.count_bound else str(self.B)
        ctx.line(f"if {ctx.sample} < {pts.joffsets.load(count)}:")
        with ctx.indent(), self.voxel_points(ctx, lambda n: None) as (n, g, x):
            v = self._voxel(ctx, g, x)
            ctx.line(f"if {v} > 0:")
            with ctx.indent():
                vals = [ctx.let(values.jdata.load(str(ch)), "val") for ch in range(C)]  # (this sample's row)
                row = ctx.let(f"{g.voxel_offset} + {v} - 1", "row")
                ctx.line(f"if {row} < {ctx.n_samples}:")  # (run() makes the batch the grids' most voxels)
                with ctx.indent(), ctx.at_sample(row):
                    for ch, val in enumerate(vals):
                        ctx.line(f"{ctx.fresh('old')} = {y.storage.atomic_add(str(ch), val)}")

    def describe(self):
        if self.voxel_batch:
            return "a NanoVDB lookup per point, atomic adds into its voxel's row (the voxels as the batch)"
        return super().describe()
