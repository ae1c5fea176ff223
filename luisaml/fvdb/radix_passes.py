"""The radix passes a device grid build can leave out, known on the host before it launches.

A device build (operators/fvdb/topology.py DeviceGridBuild) sorts its leaves in radix passes of a byte
each over a key packed from the slot key (27 bits) and the root tile's k, j and i and the grid, each taken
relative to its minimum over the leaves in the bits its span takes (shaders/grid_layout.PASSES): the passes
past the key's bytes do nothing on the device (gb_pass_active), but their stages are still launched: the
histograms (the first pass's; a later pass's are counted by the scatter before it), the prefix sum's up
stages and the scatter, 3 launches a later pass at the smallest capacity (1,024 keys), 5 at 100k points. A root tile spans 4096 voxels, so a LiDAR frame (a few hundred voxels across) spans at most two
tiles an axis: a key of 27 + 3 bits, 4 passes of PASSES (13).

`idle_passes` bounds, on the host, the root tiles the new grid's voxels can lie in: from the points of
a GridBatchFromPoints (or ijk, or the nearest voxels), or, for a topology op, from the leaves of a
source bundle luisaml built or checked in full (fvdb/checked.py: their origins are what the kernels
read) through the op's candidate voxels (topology_device.candidates). A pass is idle when it lies past
the key that bound's spans make, so past the device's key too (its leaves' spans lie within the bound).
The bound is wide where it must be (a point's voxel within 2 voxels and a float32 rounding of its
float64 position; an unknown source grid, a non-finite point or an op without candidates: no pass left
out): a pass left out wrongly would sort the leaves wrongly. The idle passes are always the last ones:
`idle_stages` names a network's stages of those passes, and the launcher leaves them out of that run
(launch.KernelLauncher.skipped); the pass counters that a pass's up sweep and scatter set are then read
by no stage launched after them. The bytes built are the same (tests/fvdb/test_topology_device.py against
the host's builder).
"""
from __future__ import annotations

import re

import numpy as np

from . import checked
from .nanovdb import record_field, records
from . import layout as L

PASSES = 13  # shaders/grid_layout.PASSES and SLOT_BITS (a test checks they agree)
SLOT_BITS = 27
_TILE_SHIFT = 12  # a root tile is 4096 voxels an axis: leaf key (voxel >> 3) >> 9
_LIMIT = 2 ** 30  # voxel coordinates past this: no bound (int32 overflow is the build's own error)
_STAGE = re.compile(r"radix pass (\d+): ")


def passes(spans: tuple[int, int, int, int]) -> int:
    """The passes a key takes whose fields (tile k, j, i, grid) span at most these (gb_passes)."""
    return -(-(SLOT_BITS + sum(int(x).bit_length() for x in spans)) // 8)


def _idle(spans: tuple[int, int, int, int]) -> frozenset[int]:
    """The passes idle for these upper bounds of the leaves' spans of tile k, j, i and grid."""
    return frozenset(range(passes(spans), PASSES))


def _spans(lo: np.ndarray, hi: np.ndarray, grids: int) -> tuple[int, int, int, int]:
    """Upper bounds of the fields' spans for voxels within [lo, hi] (ijk) of `grids` grids."""
    tiles = [(int(hi[a]) >> _TILE_SHIFT) - (int(lo[a]) >> _TILE_SHIFT) for a in range(3)]
    return tiles[2], tiles[1], tiles[0], max(grids - 1, 0)


_FEW_GRIDS = 16  # grids whose points' extremes are taken one grid at a time (_columns); more: one reduceat
_ROW = 64  # points a row of _columns' wide view


def _columns(f, pts: np.ndarray) -> np.ndarray:
    """f (np.minimum or np.maximum) over the rows of pts [N, C]: over a view of _ROW points a row (numpy
    reduces a wide row in vector lanes; over [N, 3] along axis 0 it goes three elements at a time,
    ~20x slower), then the rows left."""
    m = len(pts) - len(pts) % _ROW
    body = f.reduce(pts[:m].reshape(-1, _ROW * pts.shape[1]), axis=0).reshape(_ROW, -1) if m else pts[:0]
    return f.reduce(np.concatenate([body, pts[m:]]), axis=0)


def _from_points(op_type: str, arrays: list) -> tuple | None:
    """The voxels' bound [lo, hi] of a GridBatchFrom* over its jdata; None where none is sure."""
    from .topology import per_grid

    jdata, offsets = np.asarray(arrays[0]), np.asarray(arrays[1]).reshape(-1)
    grids = len(offsets) - 1
    if not len(jdata) or grids < 1:
        return None
    if op_type == "GridBatchFromIJK":
        v = jdata.astype(np.int64)
        return v.min(0) - 1, v.max(0) + 1, grids
    sizes, origins = (arrays[k] if len(arrays) > k and arrays[k] is not None else None for k in (4, 5))
    try:
        h = per_grid(1.0 if sizes is None else sizes, grids, "voxel_sizes", True)
        o = per_grid(0.0 if origins is None else origins, grids, "origins", False)
    except ValueError:
        return None  # (the build names it)
    counts = np.diff(offsets)
    if counts.sum() != len(jdata) or (counts < 0).any():
        return None
    # each grid's points' extremes in their own type, then its transform of those alone: (x - o) / h in
    # float64 is monotone in x (each rounding is), so its min and max over a grid's points are its values
    # at their min and max, the bound every point's float64 position gave bit for bit, without a float64
    # copy of the points (86 of 105 ms of a 1M-point build's host time on a 2-core Xeon). A NaN or an
    # infinity among a grid's points is its min's or max's (numpy's reductions propagate NaN): no bound
    used = np.flatnonzero(counts)
    pts = jdata.reshape(len(jdata), -1)
    if len(used) <= _FEW_GRIDS:
        ends = [np.stack([_columns(f, pts[offsets[b]:offsets[b + 1]]) for b in used]) for f in (np.minimum, np.maximum)]
    else:
        starts = offsets[:-1][used]
        ends = [f.reduceat(pts, starts, axis=0) for f in (np.minimum, np.maximum)]
    with np.errstate(all="ignore"):
        v = [(e.astype(np.float64) - o[used]) / h[used] for e in ends]
        lo, hi = np.minimum(*v).min(0), np.maximum(*v).max(0)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()) or max(np.abs(lo).max(), np.abs(hi).max()) > _LIMIT:
        return None
    # the device's float32 voxel position is within a float32 rounding of this one; its voxel (or the
    # nearest voxels' corners) within 1 of its floor: a slack of 2 voxels and that rounding
    slack = 2 + np.maximum(np.abs(lo), np.abs(hi)) * 2.0 ** -20
    return np.floor(lo - slack).astype(np.int64), np.ceil(hi + slack).astype(np.int64), grids


def _from_grids(op_type: str, attrs: dict, arrays: list) -> tuple | None:
    """The voxels' bound of a topology op over a source bundle luisaml built or checked; None where
    none is sure (another source, no candidate form)."""
    from ..operators.fvdb.topology_device import candidates

    known = checked.known(arrays[:6])
    if known is None:
        return None
    grids, _ = known
    try:
        cand = candidates(op_type, attrs)
    except ValueError:
        return None
    origins = [record_field(records(g.buffer, g.leaf_offset, g.leaf_count, L.LEAF_NODE_SIZE), L.LEAF_OFF_BBOX_MIN,
                            np.dtype("<i4"), 3) & ~np.int32(7) for g in grids if g.leaf_count]
    if not origins:
        return None
    o = np.concatenate(origins).astype(np.int64)
    # (a leaf's voxels lie in its 8^3 block, its origin the one the walk checks)
    return _through(cand, o.min(0), o.max(0) + 7, len(grids))


def _through(cand, c_lo: np.ndarray, c_hi: np.ndarray, grids: int) -> tuple | None:
    """The bound of the candidate voxels (cand: topology_device.Candidates) of source voxels within
    [c_lo, c_hi]; None past _LIMIT."""
    lo, hi = np.zeros(3, np.int64), np.zeros(3, np.int64)
    for a in range(3):
        ends = [c * cand.scale[a] + cand.base[a] + cand.step[a] * t
                for c in (int(c_lo[a]), int(c_hi[a])) for t in (0, cand.n[a] - 1)]
        lo[a], hi[a] = min(ends) // cand.div[a], max(ends) // cand.div[a]  # (floor: monotone in x)
    if max(np.abs(lo).max(), np.abs(hi).max()) > _LIMIT:
        return None
    return lo, hi, grids


def idle_passes(op_type: str, attrs: dict, arrays: list, from_grid: bool, both: bool = False) -> frozenset[int]:
    """The radix passes that do nothing in the device build of op_type over arrays (its inputs: points
    or ijk, or a source bundle when from_grid; a GridBatchFromPoints with topology.CONV_OF_POINTS: the
    ConvGrid of its points' grid, and with `both` the passes idle in that grid and in the points' own, whose
    builds one network runs: host_steps.DeviceBuilds.run_pair); empty where the host cannot be sure."""
    from ..operators.fvdb.topology import conv_of_points
    from ..operators.fvdb.topology_device import candidates

    bound = _from_grids(op_type, attrs, arrays) if from_grid else _from_points(op_type, arrays)
    conv = None if from_grid else conv_of_points(attrs)
    if bound is None:
        return frozenset()
    idle = _idle(_spans(*bound))
    if conv is not None:  # (the points' bound computed once, for both grids)
        try:
            through = _through(candidates("ConvGrid", conv), *bound)
        except ValueError:
            return frozenset()
        if through is None:
            return frozenset()
        idle = _idle(_spans(*through)) & idle if both else _idle(_spans(*through))
    return idle


def idle_stages(net, passes: frozenset[int]) -> frozenset[int]:
    """The indices of the stages of a device build's network (its plan's schedule) that run those
    radix passes (histograms, prefix sums, scatters)."""
    if not passes or net.plan.schedule is None:
        return frozenset()
    cache = net.__dict__.setdefault("_radix_stages", {})
    if not cache:
        for k, st in enumerate(net.plan.schedule.stages):
            m = _STAGE.match(st.phase_name or "")
            if m:
                cache.setdefault(int(m.group(1)), []).append(k)
    return frozenset(k for p in passes for k in cache.get(p, ()))
