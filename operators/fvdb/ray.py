"""Rays through a grid: VoxelsAlongRays and SegmentsAlongRays (fVDB's ops/VoxelsAlongRays.cu,
SegmentsAlongRays.cu), each ray walked by NanoVDB's hierarchical DDA (shaders/hdda.py).

How many hits a ray has is known only once it is walked, so these nodes run as phases
(luisaml/dynamic.py): `count` walks every ray and writes its hit count into joffsets[ray + 1] (and
jlidx), the prefix sum turns joffsets into offsets in place, the host reads the total back and
sizes the outputs, and `fill` walks every ray again, writing its hits from joffsets[ray]. Both walks
run the same code; a fill that finds more or fewer hits than its count flags a run-time error.

Where this differs from fVDB on purpose: the segment walk re-aligns the DDA to the tree's level up
to three times before testing a cell, as fVDB's voxel walk does (fVDB's segment walk re-aligns once
and then tests the corner of a coarse cell, which can start a span early or end a walk); a ray whose
direction is zero, or whose grid id is outside the batch, has no hits (jlidx (b, -1) for the latter).
"""
from __future__ import annotations

import numpy as np

from luisaml import dtypes
from luisaml.dynamic import Phase, scan_phases
from luisaml.model import shape_str
from luisaml.operator import CompileError, Derived
from luisaml.opsets import fvdb as schema
from luisaml.registry import register

from .common import META_FIELDS, GridOp, Meta, bundle_grids

RAY_FIELDS = 9  # per grid: float32 bits of the dual translate (3), the tree's bbox min (3) and max (3)


def ray_metadata(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets) -> np.ndarray:
    """Return int32 [B, RAY_FIELDS] per grid of a checked bundle: fVDB's dual translate
    float32(-origin/h + 1/2) (computed in float64, as VoxelCoordTransform does) as float bits, then the
    tree's bounding box (min, max inclusive; min > max for an empty grid: every ray misses)."""
    grids = bundle_grids(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets)
    h = np.asarray(voxel_sizes, np.float64).reshape(-1, 3)
    o = np.asarray(origins, np.float64).reshape(-1, 3)
    out = np.zeros((len(grids), RAY_FIELDS), np.int32)
    out[:, 0:3] = (-o / h + 0.5).astype(np.float32).view(np.int32)
    for b, g in enumerate(grids):
        out[b, 3:9] = g.root_bbox.reshape(-1) if g.voxel_count else (1, 1, 1, 0, 0, 0)
    return out


def _infer(node, inputs):
    ins = [None if v is None or v.shape is None else (v.elem_type, list(v.shape)) for v in inputs]
    try:
        rules = schema.ray_rule(node.op_type, ins, dict(node.attrs))
    except ValueError as e:
        raise CompileError(f"{node.describe()}: {e}") from None
    return [(elem, None if dims is None else tuple(dims)) for elem, dims in rules]


class RayOp(GridOp):
    """Base of the ray ops: the checks, the metadata and the phases; subclasses emit one walk."""

    any_grid = True  # (GridOp: a grid of any size, bound at run time)

    infer = staticmethod(_infer)
    JOFFSETS = 0  # output index of joffsets (subclasses)

    def check_inputs(self):
        origins, directions = self.jagged
        for jt in (origins, directions):
            self.expect_points(jt)
            self.expect(not jt.jdata.batched, f"{jt.name}_jdata '{jt.jdata.name}' follows the batch axis; rays are "
                        "walked once for the whole batch (give them a static first dimension)")
        self.rays = origins.jdata.shape[0]
        self.expect(directions.jdata.shape[0] == self.rays,
                    f"ray_directions_jdata '{directions.jdata.name}' {shape_str(directions.jdata.shape)} must have "
                    f"as many rows as ray_origins_jdata '{origins.jdata.name}' {shape_str(origins.jdata.shape)}")
        self.eps = float(self.attr("eps", 0.0))
        self.expect(self.eps >= 0.0, f"eps must be >= 0, got {self.eps}")
        names = schema.RAY_OUTPUTS[self.node.op_type]
        self.expect(len(self.outputs) == len(names) and all(t is not None for t in self.outputs),
                    f"has {len(names)} outputs ({', '.join(names)}), got {len(self.outputs)}")
        self.expect_shape(self.output(self.JOFFSETS), (self.rays + 1,), "output joffsets")
        self.expect_dtype(self.output(self.JOFFSETS), ("INT64",), "output joffsets")
        self.expect_shape(self.output(self.JOFFSETS + 2), (self.rays, 2), "output jlidx")
        self.check_outputs()

    def check_outputs(self) -> None:
        """Check the op's own outputs (subclasses)."""

    def max_hits(self, name: str) -> int:
        n = int(self.attr(name, -1))
        self.expect(n > 0 or n == -1, f"{name} must be > 0 or -1 (no limit), got {n}")
        return n

    def derived_inputs(self):
        return super().derived_inputs() + [Derived(ray_metadata, tuple(range(6)), dtypes.INT32, (self.B, RAY_FIELDS))]

    # ---- phases -----------------------------------------------------------------------------
    def phases(self):
        joffsets = self.output(self.JOFFSETS)
        return ([Phase("count", self.rays, lambda ctx, ray: self.emit_walk(ctx, ray, fill=False))]
                + scan_phases(joffsets, self.rays)
                + [Phase("fill", self.rays, lambda ctx, ray: self.emit_walk(ctx, ray, fill=True))])

    def rows_total(self):
        return self.JOFFSETS, self.rays

    def emit_walk(self, ctx, ray: str, fill: bool) -> None:
        """Emit one ray's walk: its grid, the dual-space ray clipped to the grid's box, the DDA; the
        count phase stores the hit count and jlidx, the fill phase the hits (emit_hits)."""
        meta, ray_meta = self.derived
        origins, directions = self.jagged
        joffsets, jlidx = self.output(self.JOFFSETS), self.output(self.JOFFSETS + 2)
        blob, base = self.input(0).storage.byte_address()
        for helper in ("hdda_clip", "hdda_init", "hdda_next_voxel", "hdda_next_segment", "hdda_overflowed"):
            ctx.use_helper(helper, "hdda")
        f_state = ctx.local_array("float", 19, "ray_f")  # shaders/hdda.py: HDDA_FLOATS, HDDA_INTS
        i_state = ctx.local_array("int", 15, "ray_i")
        b = ctx.let(origins.jidx.load(ray), "b") if origins.jidx.numel else "0"
        count = ctx.fresh("count")
        ctx.line(f"{count} = 0")
        ctx.line(f"if {b} >= 0 and {b} < {self.B}:")
        with ctx.indent():
            if not fill:
                first = origins.joffsets.load(b)
                ctx.store(jlidx, f"{ray} * 2", b)
                ctx.store(jlidx, f"{ray} * 2 + 1", f"{ray} - {first}")
            m = ctx.let(f"{b} * {META_FIELDS}", "m")
            rm = ctx.let(f"{b} * {RAY_FIELDS}", "rm")
            f = ctx.use_helper("nvdb_float", "nanovdb")
            tiles = meta.load(f"{m} + {int(Meta.TILES)}")
            tiles = ctx.let(f"{base} + {tiles}" if base != "0" else tiles, "tiles")
            ntiles = ctx.let(meta.load(f"{m} + {int(Meta.TILE_COUNT)}"), "ntiles")
            moving = []
            for a in range(3):
                s = ctx.let(f"{f}({meta.load(f'{m} + {int(Meta.SCALE_X) + a}')})", "s")
                t = ctx.let(f"{f}({ray_meta.load(f'{rm} + {a}')})", "t")
                o = origins.jdata.load(f"{ray} * 3 + {a}")
                d = ctx.let(f"{directions.jdata.load(f'{ray} * 3 + {a}')} * {s}", "d")
                ctx.line(f"{f_state}[{a}] = {o} * {s} + {t}")
                ctx.line(f"{f_state}[{3 + a}] = {d}")
                # 1/0 is never computed: an axis whose direction is 0 is handled apart (hdda_clip, hdda_init)
                ctx.line(f"{f_state}[{6 + a}] = 1.0 / {d} if {d} != 0.0 else 0.0")
                moving.append(f"{d} != 0.0")
            box = ", ".join(ray_meta.load(f"{rm} + {3 + k}") for k in range(6))
            ctx.line(f"if ({' or '.join(moving)}) and hdda_clip({f_state}, {box}):")
            with ctx.indent():
                ctx.line(f"hdda_init({blob}, {tiles}, {ntiles}, {f_state}, {i_state})")
                start = ctx.let(joffsets.load(ray), "start") if fill else None
                end = ctx.let(joffsets.load(f"{ray} + 1"), "end") if fill else None
                self.emit_hits(ctx, ray, count, (blob, tiles, ntiles, f_state, i_state), start, end, b, m)
                overflow = ctx.flag_error(f"{self.node.describe()}: a ray's DDA walk passed 2^24 steps (a degenerate "
                                          "ray whose time no longer advances)")
                if overflow:
                    ctx.line_if(f"hdda_overflowed({i_state})", overflow)
        if not fill:
            ctx.line(f"if not ({b} >= 0 and {b} < {self.B}):")
            with ctx.indent():
                ctx.store(jlidx, f"{ray} * 2", b)
                ctx.store(jlidx, f"{ray} * 2 + 1", "-1")
            ctx.store(joffsets, f"{ray} + 1", count)
        else:
            mismatch = ctx.flag_error(f"{self.node.describe()}: a ray's fill walk found a different number of hits "
                                      "than its count walk (the outputs were sized by the count)")
            if mismatch:
                ctx.line_if(f"{count} != {joffsets.load(f'{ray} + 1')} - {joffsets.load(ray)}", mismatch)

    def emit_hits(self, ctx, ray, count, walk, start, end, b, m) -> None:
        """Emit the loop over one ray's hits: count them, and with start/end given store them."""
        raise NotImplementedError


@register(schema.VOXELS_ALONG_RAYS, domain="fvdb", since=1)
class VoxelsAlongRays(RayOp):
    """Every active voxel along each ray with its [t0, t1]: a JaggedTensor (grid -> ray) of ijk or indices."""

    runtime_sized = (0, 1, 3)  # voxels, times, jidx
    JOFFSETS = 2

    def check_outputs(self):
        self.max_voxels = self.max_hits("max_voxels")
        self.return_ijk = bool(self.attr("return_ijk", 1))
        self.cumulative = bool(self.attr("cumulative", 0))
        voxels, times = self.output(0), self.output(1)
        self.expect_dtype(voxels, ("INT32",), "output voxels")
        self.expect(voxels.rank == (2 if self.return_ijk else 1) and (not self.return_ijk or voxels.shape[1] == 3),
                    f"output voxels '{voxels.name}' must be [M, 3] (ijk) or [M] (return_ijk=0), got "
                    f"{shape_str(voxels.shape)}")
        self.expect(times.rank == 2 and times.shape[1] == 2, f"output times '{times.name}' must be [M, 2], got "
                    f"{shape_str(times.shape)}")

    def emit_hits(self, ctx, ray, count, walk, start, end, b, m):
        blob, tiles, ntiles, F, I = walk
        voxels, times, jidx = self.output(0), self.output(1), self.output(3)
        last = [ctx.fresh("last") for _ in range(3)]
        lt = [ctx.fresh("lt0"), ctx.fresh("lt1")]
        for v in last:
            ctx.line(f"{v} = 0")
        for v in lt:
            ctx.line(f"{v} = 0.0")
        ctx.line(f"while {count} != {self.max_voxels} and hdda_next_voxel({blob}, {tiles}, {ntiles}, {F}, {I}):")
        with ctx.indent():
            t0, t1 = ctx.let(f"{F}[17]", "t0"), ctx.let(f"{F}[18]", "t1")  # F_HIT_T0, F_HIT_T1
            ijk = [ctx.let(f"{I}[{7 + a}]", "h") for a in range(3)]  # I_HIT
            ctx.line(f"if {t1} - {t0} >= {float(self.eps)!r}:")
            with ctx.indent():
                same = " and ".join(f"{ijk[a]} == {last[a]}" for a in range(3))
                ctx.line(f"if {count} > 0 and {same}:")  # the same voxel again (float error): merge its times
                with ctx.indent():
                    if start is not None:
                        row = ctx.let(f"{start} + {count} - 1", "row")
                        ctx.line(f"{lt[0]} = min({lt[0]}, {t0})")
                        ctx.line(f"{lt[1]} = max({lt[1]}, {t1})")
                        ctx.store(times, f"{row} * 2", lt[0])
                        ctx.store(times, f"{row} * 2 + 1", lt[1])
                    else:
                        ctx.line("pass")
                ctx.line("else:")
                with ctx.indent():
                    if start is not None:
                        row = ctx.let(f"{start} + {count}", "row")
                        ctx.line(f"if {row} < {end}:")  # never past the range the count sized
                        with ctx.indent():
                            self.store_voxel(ctx, voxels, row, ijk, blob, I, m)
                            ctx.store(times, f"{row} * 2", t0)
                            ctx.store(times, f"{row} * 2 + 1", t1)
                            ctx.store(jidx, row, ray)
                    for a in range(3):
                        ctx.line(f"{last[a]} = {ijk[a]}")
                    ctx.line(f"{lt[0]} = {t0}")
                    ctx.line(f"{lt[1]} = {t1}")
                    ctx.line(f"{count} += 1")

    def store_voxel(self, ctx, voxels, row, ijk, blob, I, m) -> None:
        if self.return_ijk:
            for a in range(3):
                ctx.store(voxels, f"{row} * 3 + {a}", ijk[a])
            return
        # the walk just probed this voxel, so its leaf is the cached one (shaders/hdda.py I_LEAF)
        value = ctx.use_helper("nvdb_leaf_value", "nanovdb")
        index = f"{value}({blob}, {I}[10], {', '.join(ijk)}) - 1"
        if self.cumulative:
            index += f" + {self.derived[0].load(f'{m} + {int(Meta.VOXEL_OFFSET)}')}"
        ctx.store(voxels, row, index)

    def describe(self):
        what = "ijk" if self.return_ijk else ("cumulative indices" if self.cumulative else "indices")
        return (f"HDDA walk of {self.rays} rays, voxels as {what}: count, prefix sum, host read-back, fill "
                f"(max_voxels {self.max_voxels}, eps {self.eps})")


@register(schema.SEGMENTS_ALONG_RAYS, domain="fvdb", since=1)
class SegmentsAlongRays(RayOp):
    """Runs of active voxels along each ray as [t0, t1] spans: a JaggedTensor (grid -> ray)."""

    runtime_sized = (0, 2)  # segments, jidx
    JOFFSETS = 1

    def check_outputs(self):
        self.max_segments = self.max_hits("max_segments")
        seg = self.output(0)
        self.expect(seg.rank == 2 and seg.shape[1] == 2, f"output segments '{seg.name}' must be [M, 2], got "
                    f"{shape_str(seg.shape)}")

    def emit_hits(self, ctx, ray, count, walk, start, end, b, m):
        blob, tiles, ntiles, F, I = walk
        segments, jidx = self.output(0), self.output(2)
        ctx.line(f"while {count} != {self.max_segments} and hdda_next_segment({blob}, {tiles}, {ntiles}, {F}, {I}):")
        with ctx.indent():
            t0, t1 = ctx.let(f"{F}[17]", "t0"), ctx.let(f"{F}[18]", "t1")  # F_HIT_T0, F_HIT_T1
            ctx.line(f"if {t1} - {t0} >= {float(self.eps)!r}:")
            with ctx.indent():
                if start is not None:
                    row = ctx.let(f"{start} + {count}", "row")
                    ctx.line(f"if {row} < {end}:")  # never past the range the count sized
                    with ctx.indent():
                        ctx.store(segments, f"{row} * 2", t0)
                        ctx.store(segments, f"{row} * 2 + 1", t1)
                        ctx.store(jidx, row, ray)
                ctx.line(f"{count} += 1")

    def describe(self):
        return (f"HDDA walk of {self.rays} rays into segments: count, prefix sum, host read-back, fill "
                f"(max_segments {self.max_segments}, eps {self.eps})")
