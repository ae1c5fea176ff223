"""NanoVDB's hierarchical DDA in the LuisaCompute DSL: a ray clipped to a grid's bounding box, then
walked through the tree of the same byte layout shaders/nanovdb.py reads, skipping an empty node in
one step of its own size (4096 at the root, 128 in an upper node, 8 in a lower node) and stepping
voxel by voxel inside leaves.

It follows NanoVDB's math/HDDA.h and fVDB's utils/nanovdb/HDDAIterators.h statement for statement
(the order of the float operations included, so times agree to the last bit where the backend does
not contract them): init, update (re-snap to another level's size), step (the axis of the smallest
next crossing, ties to z, then y), fVDB's voxel iterator (re-align to the tree's level up to three
times, then yield an active voxel with [time, next crossing]) and segment iterator (runs of active
cells, leaving time at the first inactive one).

A walk's state lives in two local arrays the caller declares (HDDA_FLOATS floats, HDDA_INTS ints)
and passes by reference; the F_* and I_* constants name their slots. The leaf found last is cached,
as NanoVDB's ReadAccessor does, so stepping inside a leaf reads one mask word per voxel.

Rays are in the grid's *dual* index space (fVDB's dualTransform: x * (1/h) - origin/h + 1/2, the
direction scaled by 1/h, so t keeps its world meaning), voxel ijk spanning [ijk, ijk + 1).
"""
import luisa
from luisa.builtin import bitwise_cast
from luisa.types import uint  # noqa: F401

from .nanovdb import (LEAF_OFF_VALUE_MASK, LOWER_OFF_CHILD_MASK, LOWER_OFF_TABLE, UPPER_OFF_CHILD_MASK,  # noqa: F401
                      UPPER_OFF_TABLE, nvdb_child, nvdb_root_child)

HDDA_FLOATS = 19
HDDA_INTS = 15

F_EYE = 0  # 0..2: the ray's origin (dual index space)
F_DIR = 3  # 3..5: its direction
F_INV = 6  # 6..8: 1 / direction (unused on an axis whose direction is 0)
F_NEXT = 9  # 9..11: the time of the next crossing per axis (FLT_MAX where disabled)
F_DELTA = 12  # 12..14: the time to cross one unit per axis
F_TIME = 15  # the current time (HDDA mT0)
F_MAX_TIME = 16  # the end of the clipped ray (HDDA mT1)
F_HIT_T0 = 17  # the current hit: a voxel's [t0, t1], or a segment's
F_HIT_T1 = 18
I_VOXEL = 0  # 0..2: the current cell (its low corner at the current level)
I_STEP = 3  # 3..5: +1, -1, or 0 on an axis whose direction is 0
I_DIM = 6  # the current level's size: 1, 8, 128 or 4096
I_HIT = 7  # 7..9: the voxel a voxel walk yielded last
I_LEAF = 10  # the cached leaf's byte position, or -1
I_LEAF_ORIGIN = 11  # 11..13: its origin
I_STEPS = 14  # steps taken (a walk stops at MAX_STEPS: see hdda_overflowed)

FLT_MAX = 3.4028234663852886e38
DELTA = 1e-5  # NanoVDB's Delta<float>: where the first cell is probed past t0
MAX_STEPS = 1 << 24  # a walk this long is a degenerate ray (float time that no longer advances)


@luisa.func
def hdda_probe(blob, tiles, tile_count, i, j, k, I):
    """(level size << 1) | active of cell (i, j, k): NanoVDB's ReadAccessor getDim (4096 where the
    root has no node, 128 an empty upper slot, 8 an empty lower slot, 1 inside a leaf) and isActive
    (a leaf voxel's mask bit; fVDB grids have no active tiles). Caches the leaf in I."""
    result = 4096 << 1
    if (i & -8) == I[I_LEAF_ORIGIN] and (j & -8) == I[I_LEAF_ORIGIN + 1] and (k & -8) == I[I_LEAF_ORIGIN + 2] \
            and I[I_LEAF] >= 0:
        result = 1 << 1
    else:
        upper = nvdb_root_child(blob, tiles, tile_count, i, j, k)
        if upper >= 0:
            result = 128 << 1
            n2 = (((i & 4095) >> 7) << 10) | (((j & 4095) >> 7) << 5) | ((k & 4095) >> 7)
            lower = nvdb_child(blob, upper, UPPER_OFF_CHILD_MASK, UPPER_OFF_TABLE, n2)
            if lower >= 0:
                result = 8 << 1
                n1 = (((i & 127) >> 3) << 8) | (((j & 127) >> 3) << 4) | ((k & 127) >> 3)
                leaf = nvdb_child(blob, lower, LOWER_OFF_CHILD_MASK, LOWER_OFF_TABLE, n1)
                if leaf >= 0:
                    result = 1 << 1
                    I[I_LEAF] = leaf
                    I[I_LEAF_ORIGIN] = i & -8
                    I[I_LEAF_ORIGIN + 1] = j & -8
                    I[I_LEAF_ORIGIN + 2] = k & -8
    if result == (1 << 1):
        n = ((i & 7) << 6) | ((j & 7) << 3) | (k & 7)
        word = blob.read(uint, I[I_LEAF] + LEAF_OFF_VALUE_MASK + (n >> 5) * 4)
        if ((word >> uint(n & 31)) & uint(1)) != uint(0):
            result = 3
    return result


@luisa.func
def hdda_finite(x):
    """x is neither inf nor NaN, read from its exponent bits: CUDA's fast math assumes no NaN or
    infinity, so isnan, isinf and a NaN's comparisons may fold (a NaN ray then walked 2^24 steps
    on the H200 while the CPU backend stopped it)."""
    return (bitwise_cast(uint, x) & uint(0x7f800000)) != uint(0x7f800000)


@luisa.func
def hdda_clip(F, lo_x, lo_y, lo_z, hi_x, hi_y, hi_z):
    """hdda_clip_span of the ray in F from t = 0 to FLT_MAX (fVDB's rays without a time span)."""
    return hdda_clip_span(F, 0.0, FLT_MAX, lo_x, lo_y, lo_z, hi_x, hi_y, hi_z)


@luisa.func
def hdda_clip_span(F, t_min, t_max, lo_x, lo_y, lo_z, hi_x, hi_y, hi_z):
    """Clip the ray in F (t from t_min to t_max) to the cells [lo, hi] + [0, 1) (nanovdb Ray::clip
    of a CoordBBox, which pads max by 1, starting from the ray's time span); set F_TIME and
    F_MAX_TIME; return whether it hits. An axis whose direction is 0 constrains nothing when the
    origin lies on [lo, hi + 1], as the IEEE infinities and NaNs of NanoVDB's arithmetic give, and
    misses otherwise. A ray whose origin, direction or t_min is not finite, or whose t_max is NaN,
    misses (checked on the bits: hdda_finite)."""
    t0 = t_min
    t1 = t_max
    hit = hdda_finite(t_min) and (hdda_finite(t_max) or bitwise_cast(uint, t_max) == uint(0x7f800000))  # (+inf ok)
    for axis in range(3):
        if not (hdda_finite(F[F_EYE + axis]) and hdda_finite(F[F_DIR + axis])):
            hit = False
    for axis in range(3):
        lo = float(lo_x)
        hi = float(hi_x + 1)
        if axis == 1:
            lo = float(lo_y)
            hi = float(hi_y + 1)
        elif axis == 2:
            lo = float(lo_z)
            hi = float(hi_z + 1)
        eye = F[F_EYE + axis]
        if lo >= hi:
            hit = False
        elif F[F_DIR + axis] == 0.0:
            if eye < lo or eye > hi:
                hit = False
        else:
            a = (lo - eye) * F[F_INV + axis]
            b = (hi - eye) * F[F_INV + axis]
            if a > b:
                tmp = a
                a = b
                b = tmp
            if a > t0:
                t0 = a
            if b < t1:
                t1 = b
            if t0 > t1:
                hit = False
    F[F_TIME] = t0
    F[F_MAX_TIME] = t1
    return hit


@luisa.func
def hdda_snap(F, I, dim):
    """HDDA update: the cell of size dim at the current time, and the next crossings from it.

    Unlike NanoVDB's update, the new cell is taken from the integer walk, not from floor(ray(t))
    alone: a coarser cell is the one holding the current cell, a finer one is clamped inside it,
    and no next crossing lies before t. At a cell face ray(t) rounds to either side, and
    re-probing a cell on the wrong side sent the walk back and forth between two levels without
    advancing (a ray stuck until MAX_STEPS)."""
    old = I[I_DIM]
    I[I_DIM] = dim
    t = F[F_TIME]
    for axis in range(3):
        pos = F[F_EYE + axis] + F[F_DIR + axis] * t
        corner = I[I_VOXEL + axis]
        cell = corner
        if dim < old:
            cell = min(max(int(floor(pos)), corner), corner + old - 1)
        cell = cell & (-dim)
        I[I_VOXEL + axis] = cell
        if I[I_STEP + axis] != 0:
            nxt = t + (float(cell) - pos) * F[F_INV + axis]
            if I[I_STEP + axis] > 0:
                nxt += float(dim) * F[F_INV + axis]
            F[F_NEXT + axis] = max(nxt, t)


@luisa.func
def hdda_init(blob, tiles, tile_count, F, I):
    """HDDA init at the clipped t0 with the level size of the cell just past it (fVDB probes at
    t0 + Delta); clears the leaf cache and the step count."""
    I[I_LEAF] = -1
    I[I_LEAF_ORIGIN] = 0
    I[I_LEAF_ORIGIN + 1] = 0
    I[I_LEAF_ORIGIN + 2] = 0
    I[I_STEPS] = 0
    t = F[F_TIME]
    for axis in range(3):
        I[I_HIT + axis] = int(floor(F[F_EYE + axis] + F[F_DIR + axis] * (t + DELTA)))
    dim = hdda_probe(blob, tiles, tile_count, I[I_HIT], I[I_HIT + 1], I[I_HIT + 2], I) >> 1
    I[I_DIM] = dim
    for axis in range(3):
        pos = F[F_EYE + axis] + F[F_DIR + axis] * t
        I[I_VOXEL + axis] = int(floor(pos)) & (-dim)
        d = F[F_DIR + axis]
        if d == 0.0:
            F[F_NEXT + axis] = FLT_MAX
            F[F_DELTA + axis] = 0.0
            I[I_STEP + axis] = 0
        elif F[F_INV + axis] > 0.0:
            I[I_STEP + axis] = 1
            F[F_NEXT + axis] = t + (float(I[I_VOXEL + axis] + dim) - pos) * F[F_INV + axis]
            F[F_DELTA + axis] = F[F_INV + axis]
        else:
            I[I_STEP + axis] = -1
            F[F_NEXT + axis] = t + (float(I[I_VOXEL + axis]) - pos) * F[F_INV + axis]
            F[F_DELTA + axis] = -F[F_INV + axis]


@luisa.func
def hdda_next_time(F):
    """HDDA next(): the earliest next crossing."""
    return min(min(F[F_NEXT], F[F_NEXT + 1]), F[F_NEXT + 2])


@luisa.func
def hdda_step(F, I):
    """HDDA step: cross into the next cell along the axis of the smallest next crossing (NanoVDB's
    MinIndex: x if strictly smallest, else y if smaller than z, else z); return time <= max time."""
    axis = 2
    if F[F_NEXT] < F[F_NEXT + 1] and F[F_NEXT] < F[F_NEXT + 2]:
        axis = 0
    elif F[F_NEXT + 1] < F[F_NEXT + 2]:
        axis = 1
    dim = I[I_DIM]
    F[F_TIME] = F[F_NEXT + axis]
    F[F_NEXT + axis] = F[F_NEXT + axis] + float(dim) * F[F_DELTA + axis]
    I[I_VOXEL + axis] = I[I_VOXEL + axis] + dim * I[I_STEP + axis]
    I[I_STEPS] = I[I_STEPS] + 1
    return F[F_TIME] <= F[F_MAX_TIME] and I[I_STEPS] < MAX_STEPS


@luisa.func
def hdda_align(blob, tiles, tile_count, F, I):
    """Re-align the walk to the tree's level at the current cell (up to three passes: 4096 -> 128
    -> 8 -> 1), then return whether that cell is active."""
    probe = hdda_probe(blob, tiles, tile_count, I[I_VOXEL], I[I_VOXEL + 1], I[I_VOXEL + 2], I)
    for _ in range(3):
        if (probe >> 1) != I[I_DIM]:
            hdda_snap(F, I, probe >> 1)
            probe = hdda_probe(blob, tiles, tile_count, I[I_VOXEL], I[I_VOXEL + 1], I[I_VOXEL + 2], I)
    return (probe & 1) == 1


@luisa.func
def hdda_next_voxel(blob, tiles, tile_count, F, I):
    """fVDB's HDDAVoxelIterator step: walk on to the next active voxel; yield it in I[I_HIT..] with
    [its entry time, the next crossing] in F[F_HIT_T0], F[F_HIT_T1]; return False at the ray's end."""
    found = False
    going = True
    while going and not found:
        if hdda_align(blob, tiles, tile_count, F, I):
            found = True
            for axis in range(3):
                I[I_HIT + axis] = I[I_VOXEL + axis]
            F[F_HIT_T0] = F[F_TIME]
            F[F_HIT_T1] = hdda_next_time(F)
            going = hdda_step(F, I)  # (the next call tests the cell past the end too, as fVDB's does)
        else:
            going = hdda_step(F, I)
    return found


@luisa.func
def hdda_next_segment(blob, tiles, tile_count, F, I):
    """fVDB's HDDASegmentIterator step: the next run of active cells as [t0, t1] in F[F_HIT_T0],
    F[F_HIT_T1] (t1: the time the walk enters the first inactive cell after it, or the ray's end);
    return whether it is a span longer than 0 (TimeSpan::valid(0))."""
    max_time = F[F_MAX_TIME]
    t0 = max_time + 5.0
    t1 = max_time
    going = True
    leaving = False
    while going and not leaving:
        active = hdda_align(blob, tiles, tile_count, F, I)
        was_valid = (t1 - t0) > DELTA  # TimeSpan::valid() with NanoVDB's default Delta
        t = F[F_TIME]
        if active and not was_valid:
            t0 = t
        if (not active) and was_valid:
            t1 = t
            leaving = True
        else:
            going = hdda_step(F, I)
    if not ((t1 - t0) > 0.0):
        t1 = min(max_time, F[F_TIME])
    F[F_HIT_T0] = t0
    F[F_HIT_T1] = t1
    return (t1 - t0) > 0.0


@luisa.func
def hdda_overflowed(I):
    """Whether the walk stopped at MAX_STEPS rather than at the ray's end."""
    return I[I_STEPS] >= MAX_STEPS
