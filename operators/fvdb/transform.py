"""VoxelToWorld and WorldToVoxel: fVDB's primal transform in float32 (ops/VoxelToWorld.cu with
VoxelCoordTransform): world -> voxel is x * s + t, voxel -> world is (x - t) / s, where
s = float(1/h) and t = float(-origin/h) come from the grid's metadata."""
from __future__ import annotations

from luisaml import indexing as ix
from luisaml.registry import register

from .common import GridOp, infer_rule


class _Transform(GridOp):
    """The primal transforms: per point, with the grid's voxel size and origin."""

    any_grid = any_count = True  # (GridOp: a grid of any size and grid count, bound at run time)
    infer = staticmethod(infer_rule)

    def check_inputs(self):
        self.expect_points(self.jagged[0])

    def value(self, x: str, g, a: int) -> str:
        raise NotImplementedError

    def forward(self, ctx):
        pts, y = self.jagged[0], self.output()

        def zero(n):
            for a in range(3):
                ctx.store(y, ix.add(ix.mul(n, 3), str(a)), "0.0")

        with self.point_loop(ctx, pts, zero) as (n, g):
            for a in range(3):
                i = ix.add(ix.mul(n, 3), str(a))
                ctx.store(y, i, self.value(pts.jdata.load(i), g, a))


@register("WorldToVoxel", domain="fvdb", since=1)
class WorldToVoxel(_Transform):
    """Voxel-space coordinates of world points: x * s + t."""

    def value(self, x, g, a):
        scale, translate = g.transform()
        return f"{x} * {scale[a]} + {translate[a]}"


@register("VoxelToWorld", domain="fvdb", since=1)
class VoxelToWorld(_Transform):
    """World positions of voxel-space coordinates: (x - t) / s."""

    def value(self, x, g, a):
        scale, translate = g.transform()
        return f"({x} - {translate[a]}) / {scale[a]}"
