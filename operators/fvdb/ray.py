"""Rays through a grid: VoxelsAlongRays, SegmentsAlongRays, UniformRaySamples and RaysIntersectVoxels
(fVDB's ops/VoxelsAlongRays.cu, SegmentsAlongRays.cu, SampleRaysUniform.cu and GridBatch.rays_intersect_voxels),
each ray walked by NanoVDB's hierarchical DDA (shaders/hdda.py).

How many hits a ray has is known only once it is walked, so the first three run as phases
(luisaml/dynamic.py): `count` walks every ray and writes its hit count into joffsets[ray + 1] (and
jlidx), the prefix sum turns joffsets into offsets in place, the host reads the total back and
sizes the outputs, and `fill` walks every ray again, writing its hits from joffsets[ray]. Both walks
run the same code; a fill that finds more or fewer hits than its count flags a run-time error.
RaysIntersectVoxels has one bool per ray: a plain items op, one thread per ray.

Where this differs from fVDB on purpose: the segment walk re-aligns the DDA to the tree's level up
to three times before testing a cell, as fVDB's voxel walk does (fVDB's segment walk re-aligns once
and then tests the corner of a coarse cell, which can start a span early or end a walk); a ray whose
direction is zero has no hits; UniformRaySamples' differences are in its schema doc (opsets/fvdb_rays.py).
The rays' JaggedTensor layout (joffsets spanning the rays, jidx naming the grid joffsets give, every
jagged input laid out as the origins) is checked on the host when the rays are bound
(check_ray_layout, a derived input beside the grids' metadata); the kernels still guard `0 <= b < B`.

The walk: fVDB's dual transform, the root bbox clip (from 0, or a ray's own [t_min, t_max]), empty
nodes skipped a node at a time. One change from NanoVDB's update on purpose: a level change takes
the new cell from the integer walk (a coarser cell holds the current one, a finer one is clamped
inside it), because floor(ray(t)) at a cell face rounds to either side and re-probing the wrong side
sent the walk back and forth between two levels without advancing. The float attributes (eps,
step_size, cone_angle) are checked as finite float32 when compiled, and a step or cone below
float32's smallest normal (flushed to zero on the device) is refused.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from luisaml import dtypes
from luisaml.errors import InputError
from luisaml.dynamic import Phase, scan_phases
from luisaml.model import shape_str
from luisaml.operator import Derived
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_rays as ray_schema
from luisaml.registry import register

from .common import META_FIELDS, GridOp, Meta, bundle_grids, rule_types

FLT_MAX = 3.4028234663852886e38
FLT_MIN_NORMAL = float(np.finfo(np.float32).tiny)  # 1.1754944e-38: the device flushes smaller floats to zero
DELTA = 1e-5  # NanoVDB's Delta<float> (shaders/hdda.py DELTA): fVDB's smallest end piece of a segment
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


def check_ray_layout(*parts, node: str, names: tuple, grids: int | None, rays: int) -> np.ndarray:
    """Check the JaggedTensor layout of a ray op's inputs when they are bound and return int32 [1] (zero):
    parts are (joffsets, jidx) of each jagged input, names their input names (ray_origins first). The
    first's joffsets must rise from 0 to the rays and its jidx (or none: one grid) name, ray by ray, the
    grid joffsets give; every other jagged input must be laid out as it (fVDB's jagged_like). Without
    this, a ray whose jidx names a grid outside the batch had no hits and joffsets that do not span the
    rays sized the jlidx of rays outside them: answers, not errors. grids None: the grid count is bound
    at run time (grid_count.py), the first joffsets' (checked against the blob with the metadata)."""
    if grids is None:
        grids = int(np.shape(parts[0])[0]) - 1
    expected = None
    for k in range(0, len(parts), 2):
        off, idx = np.asarray(parts[k]).reshape(-1), np.asarray(parts[k + 1]).reshape(-1)
        off_name, idx_name = names[k], names[k + 1]
        if off.size != grids + 1 or off[0] != 0 or off[-1] != rays or (np.diff(off) < 0).any():
            raise InputError(f"{node}: input '{off_name}' must rise from 0 to {rays} (the rays) in {grids + 1} "
                             f"entries (one tensor per grid), got {_few(off)}")
        want = np.repeat(np.arange(grids, dtype=np.int64), np.diff(off))
        if idx.size:
            bad = np.flatnonzero(idx.astype(np.int64) != want)
            if bad.size:
                r = int(bad[0])
                raise InputError(f"{node}: input '{idx_name}' names grid {int(idx[r])} at ray {r}, but '{off_name}' "
                                 f"{_few(off)} puts that ray in grid {int(want[r])} (the batch has {grids} "
                                 f"grid{'s' if grids != 1 else ''})")
        if expected is None:
            expected = off
        elif not np.array_equal(off, expected):
            raise InputError(f"{node}: input '{off_name}' {_few(off)} differs from '{names[0]}' {_few(expected)}: "
                             "every jagged input of a ray op is laid out as the ray origins")
    return np.zeros(1, np.int32)


def _few(a: np.ndarray) -> str:
    return str(a.tolist()) if a.size <= 8 else f"{a[:8].tolist()} ... ({a.size} entries)"


def _infer(node, inputs):
    return rule_types(node, inputs, lambda ins: ray_schema.ray_rule(node.op_type, ins, dict(node.attrs)))


class RayOp(GridOp):
    """Base of the ray ops: the checks, the metadata, the walk's set-up and the phases; subclasses
    emit what they do along one walk (emit_hits), or, without outputs sized at run time, one item."""

    specs = ray_schema.OPS
    any_grid = any_count = True  # (GridOp: a grid of any size and grid count, bound at run time)

    infer = staticmethod(_infer)
    JOFFSETS = 0  # output index of joffsets (subclasses with runtime_sized outputs)

    def check_inputs(self):
        origins, directions = self.jagged[:2]
        for jt in (origins, directions):
            self.expect_points(jt)
        for jt in self.jagged:
            self.expect(not jt.jdata.batched, f"{jt.name}_jdata '{jt.jdata.name}' follows the batch axis; rays are "
                        "walked once for the whole batch: compile with batch_axis=None to bind any number of rays "
                        "at run time, or give them a static first dimension")
        self.rays = origins.jdata.shape[0]
        self.expect(directions.jdata.shape[0] == self.rays,
                    f"ray_directions_jdata '{directions.jdata.name}' {shape_str(directions.jdata.shape)} must have "
                    f"as many rows as ray_origins_jdata '{origins.jdata.name}' {shape_str(origins.jdata.shape)}")
        self.eps = self.float32_attr("eps", 0.0, ">= 0")
        self.expect(self.eps >= 0.0, f"eps must be >= 0, got {self.eps}")
        names = ray_schema.RAY_OUTPUTS[self.node.op_type]
        self.expect(len(self.outputs) == len(names) and all(t is not None for t in self.outputs),
                    f"has {len(names)} outputs ({', '.join(names)}), got {len(self.outputs)}")
        if self.runtime_sized:
            self.expect_shape(self.output(self.JOFFSETS), (self.rays + 1,), "output joffsets")
            self.expect_dtype(self.output(self.JOFFSETS), ("INT64",), "output joffsets")
            self.expect_shape(self.output(self.JOFFSETS + 2), (self.rays, 2), "output jlidx")
        self.check_outputs()

    def check_outputs(self) -> None:
        """Check the op's own outputs (subclasses)."""

    def float32_attr(self, name: str, default, want: str) -> float:
        """Return a float attribute as the float32 the kernel computes with (as fVDB's ScalarType), after
        checking that it is finite in float32 (inf, NaN or beyond float32's range would reach the kernel's
        code as a literal it cannot compile, or as a comparison that is always false); want: what it must be."""
        value = float(self.attr(name) if default is None else self.attr(name, default))
        self.expect(np.isfinite(value) and abs(value) <= FLT_MAX,
                    f"attribute {name} must be a finite float32 {want}, got {value!r}")
        return float(np.float32(value))

    def max_hits(self, name: str) -> int:
        n = int(self.attr(name, -1))
        self.expect(n > 0 or n == -1, f"{name} must be > 0 or -1 (no limit), got {n}")
        return n

    def derived_inputs(self):
        # the rays' layout is checked where the grids' metadata is derived: when they are bound
        first = len(schema.BUNDLE)
        sources = tuple(first + 4 * j + part for j in range(len(self.jagged)) for part in (1, 2))
        names = tuple(self.inputs[k].name for k in sources)
        layout = Derived(check_ray_layout, sources, dtypes.INT32, (1,),
                         (("node", self.node.describe()), ("names", names),
                          ("grids", None if self.count_bound else self.B), ("rays", self.rays)))
        # (GridOp's list first: the metadata, then under a grid count bound at run time the count)
        return super().derived_inputs() + [Derived(ray_metadata, tuple(range(6)), dtypes.INT32, (self.B, RAY_FIELDS),
                                                   any_rows=self.count_bound), layout]

    # ---- phases -----------------------------------------------------------------------------
    def phases(self):
        joffsets = self.output(self.JOFFSETS)
        return ([Phase("count", self.rays, lambda ctx, ray: self.emit_walk(ctx, ray, fill=False))]
                + scan_phases(joffsets, self.rays)
                + [Phase("fill", self.rays, lambda ctx, ray: self.emit_walk(ctx, ray, fill=True))])

    def grid_id(self, ctx, ray: str) -> str:
        """Emit and return the grid id of a ray (its jidx; 0 for a single tensor)."""
        origins = self.jagged[0]
        return ctx.let(origins.jidx.load(ray), "b") if origins.jidx.numel else "0"

    def time_span(self, ctx, ray: str) -> tuple[str, str, str] | None:
        """Return (t_min, t_max, condition) of a ray whose walk is limited in time, or None: from 0 on."""
        return None

    @contextlib.contextmanager
    def walk(self, ctx, ray: str, b: str, on_grid=None) -> Iterator[tuple[tuple, str]]:
        """Emit the set-up of one ray's walk and yield (walk state, metadata row m) where it has begun:
        inside `0 <= b < B` (on_grid() emitted there first), the dual-space ray clipped to the grid's
        box (and to time_span), the DDA initialised; after it, flag a walk that overflowed."""
        meta, ray_meta = self.derived[0], self.derived[2 if self.count_bound else 1]
        origins, directions = self.jagged[:2]
        blob, base = self.input(0).storage.byte_address()
        for helper in ("hdda_clip", "hdda_clip_span", "hdda_init", "hdda_next_voxel", "hdda_next_segment",
                       "hdda_overflowed"):
            ctx.use_helper(helper, "hdda")
        f_state = ctx.local_array("float", 19, "ray_f")  # shaders/hdda.py: HDDA_FLOATS, HDDA_INTS
        i_state = ctx.local_array("int", 15, "ray_i")
        count = self.derived[1].load("0") if self.count_bound else str(self.B)  # (grid_count.py)
        ctx.line(f"if {b} >= 0 and {b} < {count}:")
        with ctx.indent():
            if on_grid is not None:
                on_grid()
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
            span = self.time_span(ctx, ray)
            clip = f"hdda_clip({f_state}, {box})" if span is None else \
                f"({span[2]}) and hdda_clip_span({f_state}, {span[0]}, {span[1]}, {box})"
            ctx.line(f"if ({' or '.join(moving)}) and {clip}:")
            with ctx.indent():
                ctx.line(f"hdda_init({blob}, {tiles}, {ntiles}, {f_state}, {i_state})")
                yield (blob, tiles, ntiles, f_state, i_state), m
                overflow = ctx.flag_error(f"{self.node.describe()}: a ray's DDA walk passed 2^24 steps (a degenerate "
                                          "ray whose time no longer advances)")
                if overflow:
                    ctx.line_if(f"hdda_overflowed({i_state})", overflow)

    def emit_walk(self, ctx, ray: str, fill: bool) -> None:
        """Emit one ray's walk: the count phase stores the hit count and jlidx (grid, ray in grid;
        (b, -1) for a grid id outside the batch), the fill phase the hits (emit_hits)."""
        joffsets, jlidx = self.output(self.JOFFSETS), self.output(self.JOFFSETS + 2)
        b = self.grid_id(ctx, ray)
        count = ctx.fresh("count")
        ctx.line(f"{count} = 0")
        if not fill:
            ctx.store(jlidx, f"{ray} * 2", b)
            ctx.store(jlidx, f"{ray} * 2 + 1", "-1")

        def on_grid():
            if not fill:
                ctx.store(jlidx, f"{ray} * 2 + 1", f"{ray} - {self.jagged[0].joffsets.load(b)}")

        with self.walk(ctx, ray, b, on_grid) as (walk, m):
            start = ctx.let(joffsets.load(ray), "start") if fill else None
            end = ctx.let(joffsets.load(f"{ray} + 1"), "end") if fill else None
            self.emit_hits(ctx, ray, count, walk, start, end, b, m)
        if not fill:
            ctx.store(joffsets, f"{ray} + 1", count)
        else:
            mismatch = ctx.flag_error(f"{self.node.describe()}: a ray's fill walk found a different number of hits "
                                      "than its count walk (the outputs were sized by the count)")
            if mismatch:
                ctx.line_if(f"{count} != {joffsets.load(f'{ray} + 1')} - {joffsets.load(ray)}", mismatch)

    def emit_hits(self, ctx, ray, count, walk, start, end, b, m) -> None:
        """Emit the loop over one ray's hits: count them, and with start/end given store them."""
        raise NotImplementedError


@register(ray_schema.VOXELS_ALONG_RAYS, domain="fvdb", since=1)
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


@register(ray_schema.SEGMENTS_ALONG_RAYS, domain="fvdb", since=1)
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


@register(ray_schema.UNIFORM_RAY_SAMPLES, domain="fvdb", since=1)
class UniformRaySamples(RayOp):
    """Samples at a uniform (or cone-growing) step along each ray's runs of active voxels within its
    [t_min, t_max], as [t0, t1] or midpoints: a JaggedTensor (grid -> ray). fVDB's SampleRaysUniform.cu
    fill walk; where it differs on purpose (count = rows written, non-finite spans, stalled steps):
    opsets/fvdb_rays.py's doc of the op."""

    runtime_sized = (0, 2)  # samples, jidx
    JOFFSETS = 1

    def check_inputs(self):
        super().check_inputs()
        for jt in self.jagged[2:]:
            self.expect_dtype(jt.jdata, ("FLOAT",), f"{jt.name}_jdata")
            self.expect_shape(jt.jdata, (self.rays,), f"{jt.name}_jdata (one time per ray)")

    def check_outputs(self):
        self.step = self.float32_attr("step_size", None, "> 0")  # fVDB's kernel: ScalarType (float32)
        self.cone = self.float32_attr("cone_angle", 0.0, ">= 0")
        self.expect(self.step > 0.0, f"step_size must be > 0, got {self.step}")
        self.expect(self.cone >= 0.0, f"cone_angle must be >= 0, got {self.cone}")
        # a float32 below the smallest normal number is flushed to zero by the device: a step of 0 makes
        # every sample's time NaN (no samples, no stalled step to flag), a cone angle of 0 another op
        for name, value in (("step_size", self.step), ("cone_angle", self.cone)):
            self.expect(value == 0.0 or value >= FLT_MIN_NORMAL,
                        f"{name} {value!r} is below float32's smallest normal number {FLT_MIN_NORMAL!r}, which the "
                        "device flushes to zero; use a step the rays' float32 times can advance by")
        self.include_end = bool(self.attr("include_end_segments", 1))
        self.midpoints = bool(self.attr("return_midpoints", 0))
        out = self.output(0)
        self.expect(out.shape[1:] == (() if self.midpoints else (2,)), f"output samples '{out.name}' must be "
                    f"{'[M] (return_midpoints=1)' if self.midpoints else '[M, 2]'}, got {shape_str(out.shape)}")

    def time_span(self, ctx, ray):
        lo, hi = (ctx.let(jt.jdata.load(ray), name) for jt, name in zip(self.jagged[2:], ("tmin", "tmax")))
        return lo, hi, f"{lo} >= {-FLT_MAX!r} and {lo} <= {FLT_MAX!r} and {lo} <= {hi}"

    def step_at(self, t: str) -> str:
        """fVDB's _calcDt: clamp(t * cone_angle, step_size, 1e10)."""
        return repr(self.step) if self.cone == 0.0 else f"min(max({t} * {self.cone!r}, {self.step!r}), 1e10)"

    def emit_hits(self, ctx, ray, count, walk, start, end, b, m):
        blob, tiles, ntiles, F, I = walk
        samples, jidx = self.output(0), self.output(2)
        t0, t1, dt, stalled = (ctx.fresh(n) for n in ("t0", "t1", "dt", "stalled"))
        ctx.line(f"{t0} = {self.jagged[2].jdata.load(ray)}")  # the samples' grid starts at t_min
        ctx.line(f"{dt} = {self.step_at(t0)}")
        ctx.line(f"{t1} = {t0}")
        ctx.line(f"{stalled} = False")

        def sample(a: str, z: str) -> None:
            if start is not None:
                row = ctx.let(f"{start} + {count}", "row")
                ctx.line(f"if {row} < {end}:")  # never past the range the count sized
                with ctx.indent():
                    if self.midpoints:
                        ctx.store(samples, row, f"({a} + {z}) / 2.0")
                    else:
                        ctx.store(samples, f"{row} * 2", a)
                        ctx.store(samples, f"{row} * 2 + 1", z)
                    ctx.store(jidx, row, ray)
            ctx.line(f"{count} += 1")

        def advance() -> None:  # t0 = t1; the step at t0; t1 += step; a step that no longer moves t stops
            ctx.line(f"{t0} = {t1}")
            ctx.line(f"{dt} = {self.step_at(t0)}")
            ctx.line(f"{t1} = {t1} + {dt}")
            ctx.line(f"{stalled} = not ({t1} > {t0})")

        ctx.line(f"while (not {stalled}) and hdda_next_segment({blob}, {tiles}, {ntiles}, {F}, {I}):")
        with ctx.indent():
            s0, s1 = ctx.let(f"{F}[17]", "s0"), ctx.let(f"{F}[18]", "s1")  # F_HIT_T0, F_HIT_T1
            ctx.line(f"if {s1} - {s0} >= {self.eps!r}:")
            with ctx.indent():
                if self.include_end:  # the grid points inside the segment cut it; the end pieces kept
                    ctx.line(f"{t0} = {t0} + ceil(({s0} - {t0}) / {dt}) * {dt}")
                    ctx.line(f"{t1} = {t0} + {dt}")
                    ctx.line(f"if {t0} > {s1}:")
                    with ctx.indent():
                        sample(s0, s1)
                    ctx.line("else:")
                    with ctx.indent():
                        ctx.line(f"if {t0} - {s0} > {DELTA!r}:")
                        with ctx.indent():
                            sample(s0, t0)
                        ctx.line(f"while (not {stalled}) and {t1} < {s1}:")
                        with ctx.indent():
                            sample(t0, t1)
                            advance()
                        ctx.line(f"if (not {stalled}) and {s1} - {t0} > {DELTA!r}:")
                        with ctx.indent():
                            sample(t0, s1)
                else:  # whole steps whose midpoint lies in [s0, s1)
                    ctx.line(f"{t0} = {t0} + floor(({s0} - {t0}) / {dt} + 0.5) * {dt}")
                    ctx.line(f"{dt} = {self.step_at(t0)}")
                    ctx.line(f"{t1} = {t0} + {dt}")
                    mid = f"({t0} + {t1}) * 0.5"
                    ctx.line(f"while (not {stalled}) and {mid} < {s1} and {mid} >= {s0}:")
                    with ctx.indent():
                        sample(t0, t1)
                        advance()
        flag = ctx.flag_error(f"{self.node.describe()}: a ray's sample step no longer advances its float32 time "
                              "(step_size too small for the ray's times)")
        if flag:
            ctx.line_if(stalled, flag)

    def describe(self):
        how = "cut at the segment ends" if self.include_end else "whole steps"
        return (f"HDDA walk of {self.rays} rays into samples of step {self.step} (cone {self.cone}, {how}"
                f"{', midpoints' if self.midpoints else ''}): count, prefix sum, host read-back, fill (eps {self.eps})")


@register(ray_schema.RAYS_INTERSECT_VOXELS, domain="fvdb", since=1)
class RaysIntersectVoxels(RayOp):
    """Whether each ray crosses an active voxel for at least eps (fVDB: voxels_along_rays with
    max_voxels=1, hit = a count > 0): bool [R], laid out as the rays. One item per ray, no phases."""

    def check_outputs(self):
        hit = self.output(0)
        self.expect_dtype(hit, ("BOOL",), "output hit")
        self.expect_shape(hit, (self.rays,), "output hit (one per ray)")

    def work_items(self):
        return self.rays

    def emit_item(self, ctx, ray):
        found = ctx.fresh("found")
        ctx.line(f"{found} = False")
        with self.walk(ctx, ray, self.grid_id(ctx, ray)) as ((blob, tiles, ntiles, F, I), _):
            ctx.line(f"while (not {found}) and hdda_next_voxel({blob}, {tiles}, {ntiles}, {F}, {I}):")
            with ctx.indent():
                ctx.line(f"{found} = {F}[18] - {F}[17] >= {self.eps!r}")  # F_HIT_T1 - F_HIT_T0
        ctx.store(self.output(0), ray, found)

    def forward(self, ctx):
        with ctx.loop(self.rays, "ray") as ray:
            self.emit_item(ctx, ray)

    def describe(self):
        return f"HDDA walk of {self.rays} rays to their first active voxel (eps {self.eps}): a thread per ray"
