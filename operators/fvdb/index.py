"""Queries of a grid: IJKToIndex, CoordsInGrid, PointsInGrid (fVDB's ops/IjkToIndex.cu,
CoordsInGrid.cu, PointsInGrid.cu): one NanoVDB lookup per element."""
from __future__ import annotations

from luisaml import indexing as ix
from luisaml.registry import register

from .common import GridOp, infer_rule


@register("IJKToIndex", domain="fvdb", since=1)
class IJKToIndex(GridOp):
    """int64 index of each ijk in its grid: getValue - 1 (+ batch_offsets[b] when cumulative), -1 if inactive."""

    any_grid = any_count = True  # (GridOp: a grid of any size and grid count, bound at run time)

    infer = staticmethod(infer_rule)

    def check_inputs(self):
        ijk = self.jagged[0]
        self.expect_points(ijk, ("INT32", "INT64"))
        self.cumulative = bool(self.attr("cumulative", 0))

    def forward(self, ctx):
        ijk, y = self.jagged[0], self.output()
        coords = lambda n: [ijk.jdata.load(ix.add(ix.mul(n, 3), str(a))) for a in range(3)]  # noqa: E731
        with self.point_loop(ctx, ijk, lambda n: ctx.store(y, n, "(-1)")) as (n, g):
            v = ctx.let(g.lookup(coords(n)), "v")
            base = f" + {g.voxel_offset}" if self.cumulative else ""
            ctx.line(f"if {v} > 0:")
            with ctx.indent():
                ctx.store(y, n, f"{v} - 1{base}")

    def describe(self):
        return f"NanoVDB lookup per ijk, {'cumulative' if self.cumulative else 'per-grid'} indices"


@register("CoordsInGrid", domain="fvdb", since=1)
class CoordsInGrid(GridOp):
    """Whether each integer ijk is an active voxel of its grid."""

    any_grid = any_count = True  # (GridOp: a grid of any size and grid count, bound at run time)

    infer = staticmethod(infer_rule)

    def check_inputs(self):
        self.expect_points(self.jagged[0], ("INT32", "INT64"))

    def forward(self, ctx):
        ijk, y = self.jagged[0], self.output()
        with self.point_loop(ctx, ijk, lambda n: ctx.store(y, n, "False")) as (n, g):
            coords = [ijk.jdata.load(ix.add(ix.mul(n, 3), str(a))) for a in range(3)]
            ctx.store(y, n, f"{g.lookup(coords)} > 0")


@register("PointsInGrid", domain="fvdb", since=1)
class PointsInGrid(GridOp):
    """Whether the voxel round(world_to_voxel(p)) of each point is active (NanoVDB's round: floor(x + 0.5))."""

    any_grid = any_count = True  # (GridOp: a grid of any size and grid count, bound at run time)

    infer = staticmethod(infer_rule)

    def check_inputs(self):
        self.expect_points(self.jagged[0])

    def forward(self, ctx):
        pts, y = self.jagged[0], self.output()
        rnd = ctx.use_helper("nvdb_round", "nanovdb")
        with self.point_loop(ctx, pts, lambda n: ctx.store(y, n, "False")) as (n, g):
            x = self.world_to_voxel(ctx, pts, n, g)
            ctx.store(y, n, f"{g.lookup([f'{rnd}({c})' for c in x])} > 0")
