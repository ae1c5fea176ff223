"""SplatTrilinear and SplatBezier (fVDB's ops/SplatTrilinear.cu, SplatBezier.cu): the adjoints of
the samplers. Each active tap of each point adds w * value into [total_voxels, C]; in batch mode
every sample adds into the shared output with atomics (Operator.accumulates)."""
from __future__ import annotations

from luisaml import indexing as ix
from luisaml.model import shape_str
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
