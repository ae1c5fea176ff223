"""SampleTrilinear and SampleBezier (fVDB's ops/SampleTrilinear.cu with utils/TrilinearStencil.h,
ops/SampleBezier.cu with utils/BezierInterpolationIterator.h), in float32 like fVDB's float path."""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from luisaml import dtypes
from luisaml import indexing as ix
from luisaml.operator import Derived
from luisaml.opsets import fvdb as schema
from luisaml.registry import register

from .common import META_FIELDS, GridOp, GridRef, grid_metadata_for_data, infer_rule

# fVDB's trilinear corner order (di, dj, dk): (0,0,0) (0,0,1) (0,1,1) (0,1,0) (1,0,0) (1,0,1) (1,1,1) (1,1,0),
# i.e. di = c >> 2, dj = (c >> 1) & 1, dk = (c & 1) ^ dj.
TRILINEAR_CORNERS = np.array([[c >> 2, (c >> 1) & 1, (c & 1) ^ ((c >> 1) & 1)] for c in range(8)], np.int32)


class _Interpolation(GridOp):
    """Points (jagged input 0) and per-voxel data or values (jagged input 1)."""

    infer = staticmethod(infer_rule)
    taps = 0  # NanoVDB lookups per point, for describe()

    def check_inputs(self):
        pts, data = self.jagged
        self.expect_points(pts)
        self.expect_dtype(data.jdata, ("FLOAT",), f"{data.name}_jdata")
        self.channels = int(np.prod(data.jdata.shape[1:], dtype=np.int64))

    def trilinear_stencil(self, ctx, x: list[str], g, inactive_row: int = 0) -> tuple[str, str, str]:
        """Emit fVDB's resolveTrilinearStencil at voxel-space x: return the names of (row array,
        weight array, any-active flag); an inactive corner has row `inactive_row` and weight 0."""
        f = [ctx.let(f"floor({c})", "f") for c in x]
        ijk = [ctx.let(f"int({c})", "c") for c in f]
        u = [ctx.let(f"{c} - {fl}", "u") for c, fl in zip(x, f)]
        one_minus = [ctx.let(f"1.0 - {c}", "U") for c in u]
        rows = ctx.local_array("int", 8, "rows")
        weights = ctx.local_array("float", 8, "w")
        active = ctx.fresh("active")
        ctx.line(f"{active} = False")
        stencil = g.stencil_leaf(ijk, 0, 1)
        with ctx.loop(8, "corner") as c:
            d = [f"({c} >> 2)", f"(({c} >> 1) & 1)", f"(({c} & 1) ^ (({c} >> 1) & 1))"]
            v = g.cached_lookup(stencil, [f"{ijk[a]} + {d[a]}" for a in range(3)])
            factors = [f"({u[a]} if {d[a]} == 1 else {one_minus[a]})" for a in range(3)]
            ctx.line(f"{rows}[{c}] = {inactive_row}")
            ctx.line(f"{weights}[{c}] = 0.0")
            ctx.line(f"if {v} > 0:")
            with ctx.indent():
                ctx.line(f"{rows}[{c}] = {g.voxel_offset} + {v} - 1")
                ctx.line(f"{weights}[{c}] = {factors[0]} * {factors[1]} * {factors[2]}")
                ctx.line(f"{active} = True")
        return rows, weights, active

    @contextlib.contextmanager
    def voxel_points(self, ctx, defaults) -> Iterator[tuple[str, GridRef, list[str]]]:
        """Emit the loop over the points (jagged input 0) as point_loop does and yield (n, grid,
        voxel-space position) inside it."""
        pts = self.jagged[0]
        with self.point_loop(ctx, pts, defaults) as (n, g):
            yield n, g, self.world_to_voxel(ctx, pts, n, g)

    @contextlib.contextmanager
    def bezier_taps(self, ctx, x: list[str], g) -> Iterator[tuple[str, str, str]]:
        """Emit the loop over fVDB's 27 Bezier taps around round(x) (dz fastest) and yield inside it
        (v: getValue of the tap, w: its weight, row: its data row when v > 0)."""
        rnd = ctx.use_helper("nvdb_round", "nanovdb")
        bz = ctx.use_helper("bezier_weight", "nanovdb")
        c = [ctx.let(f"{rnd}({v})", "c") for v in x]
        u = [ctx.let(f"{v} - float({cc})", "u") for v, cc in zip(x, c)]
        stencil = g.stencil_leaf(c, -1, 1)
        with ctx.loop(27, "tap") as tap:
            d = [ctx.let(f"{tap} // 9 - 1", "dx"), ctx.let(f"({tap} // 3) % 3 - 1", "dy"),
                 ctx.let(f"{tap} % 3 - 1", "dz")]
            w = ctx.let(" * ".join(f"{bz}({u[a]} - float({d[a]}))" for a in range(3)), "wb")
            v = g.cached_lookup(stencil, [f"{c[a]} + {d[a]}" for a in range(3)])
            yield v, w, f"({g.voxel_offset} + {v} - 1)"


def _zero_rows(ctx, y, C: int):
    def zero(n):
        with ctx.loop(C, "ch") as ch:
            ctx.store(y, ix.add(ix.mul(n, C), ch), "0.0")
    return zero


class _Sample(_Interpolation):
    """features[n] = sum over taps of w * data[row] (shared data), zero for points without a grid."""

    shared_jagged = (1,)
    any_grid = any_voxel_data = any_count = True

    def check_inputs(self):
        super().check_inputs()
        pts, data = self.jagged
        self.voxels = data.jdata.shape[0]

    def metadata_params(self):
        return (("expect_voxels", self.voxels),)

    def derived_inputs(self):
        data = self.jagged[1].jdata
        if getattr(data, "bound_rows", None) is None:
            return super().derived_inputs()
        # the voxel data's rows are known when it is bound: checked then against the grids' voxels
        k = len(schema.BUNDLE) + len(schema.JAGGED)  # input index of voxel_data_jdata
        if self.count_bound:
            return self.counted_derived(data=k)
        return [Derived(grid_metadata_for_data, tuple(range(6)) + (k,), dtypes.INT32, (self.B, META_FIELDS),
                        shape_only=(k,))]

    def forward(self, ctx):
        y = self.output()
        with self.voxel_points(ctx, _zero_rows(ctx, y, self.channels)) as (n, g, x):
            self.gather(ctx, n, g, x)

    def gather(self, ctx, n: str, g: GridRef, x: list[str]) -> None:
        """Emit features[n] from the taps around voxel-space x (subclasses)."""
        raise NotImplementedError

    def describe(self):
        return f"{self.taps} NanoVDB lookups per point, {self.channels} channels"


@register("SampleTrilinear", domain="fvdb", since=1)
class SampleTrilinear(_Sample):
    """fVDB sample_trilinear: 8 corners, inactive ones weigh 0 with no renormalisation."""

    taps = 8

    def gather(self, ctx, n, g, x):
        data, y, C = self.jagged[1], self.output(), self.channels
        rows, w, active = self.trilinear_stencil(ctx, x, g)
        ctx.line(f"if {active}:")
        with ctx.indent(), ctx.loop(C, "ch") as ch:
            acc = ctx.fresh("acc")
            ctx.line(f"{acc} = 0.0")
            with ctx.loop(8, "corner") as c:
                ctx.line(f"{acc} += {w}[{c}] * {data.jdata.load(ix.add(ix.mul(f'{rows}[{c}]', C), ch))}")
            ctx.store(y, ix.add(ix.mul(n, C), ch), acc)


@register("SampleBezier", domain="fvdb", since=1)
class SampleBezier(_Sample):
    """fVDB sample_bezier: 27 taps around round(x), weights that sum to 8, inactive taps skipped."""

    taps = 27

    def gather(self, ctx, n, g, x):
        data, y, C = self.jagged[1], self.output(), self.channels
        acc = ctx.local_array("float", C, "acc")
        with ctx.loop(C, "ch") as ch:
            ctx.line(f"{acc}[{ch}] = 0.0")
        with self.bezier_taps(ctx, x, g) as (v, w, row):
            ctx.line(f"if {v} > 0:")
            with ctx.indent(), ctx.loop(C, "ch") as ch:
                ctx.line(f"{acc}[{ch}] += {w} * {data.jdata.load(ix.add(ix.mul(row, C), ch))}")
        with ctx.loop(C, "ch") as ch:
            ctx.store(y, ix.add(ix.mul(n, C), ch), f"{acc}[{ch}]")
