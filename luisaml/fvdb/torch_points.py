"""fVDB's per-point torch functions: ijk_to_index, coords_in_grid / points_in_grid, the
world <-> voxel transforms, the trilinear and Bezier samplers and splats (differentiable in the
data, values or points, as fVDB's are), with fVDB's float32 arithmetic on the host; and luisaml's
splat_nearest, a point cloud's sum by voxel (what voxelizing it needs)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .torch_common import (Grids, bundle_voxels, export_node, flat_args, grids_of, host_forward, rows_of,
                           trailing_sizes)

# fVDB's trilinear corner order (utils/TrilinearStencil.h)
_CORNERS = ((0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 0), (1, 0, 0), (1, 0, 1), (1, 1, 1), (1, 1, 0))


def _grid_ids(jagged: Sequence[torch.Tensor]) -> torch.Tensor:
    jdata, _, jidx, _ = jagged
    return jidx.long() if jidx.numel() else torch.zeros(jdata.shape[0], dtype=torch.long)


def _lookup(g: Grids, ijk: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Return the batch-global index (int64) of each ijk in its grid b, -1 where inactive."""
    ijk_np = ijk.detach().cpu().numpy().astype(np.int32)
    b_np = b.cpu().numpy()
    out = np.full(len(ijk_np), -1, np.int64)
    for k, index in enumerate(g.index):
        sel = np.flatnonzero(b_np == k) if len(g.index) > 1 else np.arange(len(ijk_np))
        if len(sel):
            idx = index(ijk_np[sel])
            out[sel] = np.where(idx >= 0, idx + g.voxel_offsets[k], -1)
    return torch.from_numpy(out)


def _world_to_voxel(g: Grids, pts: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return pts * g.scale[b] + g.translate[b]


def _trilinear(g: Grids, pts: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (index [N, 8] (-1 inactive), weight [N, 8] (0 inactive)) of fVDB's trilinear stencil."""
    x = _world_to_voxel(g, pts.detach(), b)
    base = torch.floor(x)
    u = x - base
    one_minus = 1.0 - u
    ijk = base.to(torch.int64)
    corners = torch.tensor(_CORNERS)
    idx = _lookup(g, (ijk[:, None, :] + corners).reshape(-1, 3), b.repeat_interleave(8)).reshape(-1, 8)
    w = []
    for k, corner in enumerate(_CORNERS):
        f = [u[:, a] if d else one_minus[:, a] for a, d in enumerate(corner)]
        w.append(torch.where(idx[:, k] >= 0, f[0] * f[1] * f[2], torch.zeros(())))
    return idx, torch.stack(w, 1)


def _bezier(t: torch.Tensor) -> torch.Tensor:
    """fVDB's Bezier kernel (twice the quadratic B-spline), with its double-precision 1.5 literals."""
    t64 = t.double()
    a = ((t64 + 1.5) * (t64 + 1.5)).float()
    c = ((-2.0 * t * t).double() + 1.5).float()
    e = ((t64 - 1.5) * (t64 - 1.5)).float()
    zero = torch.zeros_like(t)
    return torch.where((t >= -1.5) & (t < -0.5), a, torch.where((t >= -0.5) & (t < 0.5), c,
                                                                 torch.where((t >= 0.5) & (t < 1.5), e, zero)))


def _bezier_stencil(g: Grids, pts: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (index [N, 27], weight [N, 27]) of fVDB's Bezier taps (dz fastest), -1 / 0 where inactive."""
    x = _world_to_voxel(g, pts.detach(), b)
    c = torch.floor(x.double() + 0.5)  # NanoVDB's round: floor(double(x) + 0.5)
    u = x - c.float()
    c = c.to(torch.int64)
    taps = [(t // 9 - 1, (t // 3) % 3 - 1, t % 3 - 1) for t in range(27)]
    idx = _lookup(g, (c[:, None, :] + torch.tensor(taps)).reshape(-1, 3), b.repeat_interleave(27)).reshape(-1, 27)
    w = []
    for k, d in enumerate(taps):
        wt = _bezier(u[:, 0] - d[0]) * _bezier(u[:, 1] - d[1]) * _bezier(u[:, 2] - d[2])
        w.append(torch.where(idx[:, k] >= 0, wt, torch.zeros(())))
    return idx, torch.stack(w, 1)


def _gather(idx: torch.Tensor, w: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Return sum over taps k of w[:, k] * data[idx[:, k]] (tap order, float32), data [V, C]."""
    out = torch.zeros((idx.shape[0], data.shape[1]), dtype=data.dtype)
    if data.shape[0] == 0:
        return out
    for k in range(idx.shape[1]):
        out = out + w[:, k, None] * data[idx[:, k].clamp(min=0)]
    return out


def _scatter(idx: torch.Tensor, w: torch.Tensor, values: torch.Tensor, rows: int) -> torch.Tensor:
    """Return zeros [rows, C] with w[:, k] * values added at idx[:, k] for every active tap."""
    out = torch.zeros((rows, values.shape[1]), dtype=values.dtype)
    for k in range(idx.shape[1]):
        on = idx[:, k] >= 0
        out.index_add_(0, idx[on, k], w[on, k, None] * values[on])
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


def _check_points(name: str, x: torch.Tensor, dtype: torch.dtype | tuple = torch.float32) -> None:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if x.dtype not in dtypes or x.dim() != 2 or x.shape[1] != 3:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))} [N, 3], got {x.dtype} {list(x.shape)}")


class _IJKToIndex(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, cumulative: bool, *tensors):
        bundle, ijk = tensors[:7], tensors[7:]
        _check_points("ijk jdata", ijk[0], (torch.int32, torch.int64))
        g = grids_of(bundle)
        b = _grid_ids(ijk)
        out = _lookup(g, ijk[0], b)
        if not cumulative:
            out = torch.where(out >= 0, out - torch.from_numpy(g.voxel_offsets)[b], out)
        return out

    @staticmethod
    def symbolic(g, cumulative, *tensors):
        return export_node(g, "IJKToIndex", tensors, tensors[7], [rows_of(tensors[7])], torch.int64,
                           cumulative_i=int(cumulative))


class _InGrid(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, op_type: str, *tensors):
        bundle, x = tensors[:7], tensors[7:]
        g = grids_of(bundle)
        b = _grid_ids(x)
        if op_type == "CoordsInGrid":
            _check_points("ijk jdata", x[0], (torch.int32, torch.int64))
            ijk = x[0].long()
        else:
            _check_points("points jdata", x[0])
            ijk = torch.floor(_world_to_voxel(g, x[0].detach(), b).double() + 0.5).long()
        return _lookup(g, ijk, b) >= 0

    @staticmethod
    def symbolic(g, op_type, *tensors):
        return export_node(g, op_type, tensors, tensors[7], [rows_of(tensors[7])], torch.bool)


class _Transform(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, to_voxel: bool, *tensors):
        bundle, x = tensors[:7], tensors[7:]
        _check_points("points jdata", x[0])
        g = grids_of(bundle)
        b = _grid_ids(x)
        s, t = g.scale[b], g.translate[b]
        ctx.save_for_backward(s)
        ctx.to_voxel = to_voxel
        return x[0] * s + t if to_voxel else (x[0] - t) / s

    @staticmethod
    def backward(ctx, grad):
        (s,) = ctx.saved_tensors
        # fVDB's applyGrad / applyInvGrad: the scale, or 1 / scale, times the incoming gradient
        grad_points = grad * s if ctx.to_voxel else grad * (1.0 / s)
        return (None,) * 8 + (grad_points, None, None, None)

    @staticmethod
    def symbolic(g, to_voxel, *tensors):
        op_type = "WorldToVoxel" if to_voxel else "VoxelToWorld"
        return export_node(g, op_type, tensors, tensors[7], [rows_of(tensors[7]), 3])


class _Sample(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, bezier: bool, *tensors):
        bundle, pts, data = tensors[:7], tensors[7:11], tensors[11:15]
        _check_points("points jdata", pts[0])
        g = grids_of(bundle)
        d = data[0]
        if d.dtype != torch.float32 or d.dim() < 1 or d.shape[0] != g.total_voxels:
            raise ValueError(f"voxel data must be float32 [{g.total_voxels}, ...] (one row per active voxel), got "
                             f"{d.dtype} {list(d.shape)}")
        stencil = _bezier_stencil if bezier else _trilinear
        idx, w = stencil(g, pts[0], _grid_ids(pts))
        out = _gather(idx, w, _flat(d))
        if not bezier:  # fVDB returns 0 where no corner is active (inactive corners read row 0 at weight 0)
            out = torch.where((idx >= 0).any(1, keepdim=True), out, torch.zeros(()))
        ctx.save_for_backward(idx, w)
        ctx.data_shape = d.shape
        return out.reshape((pts[0].shape[0],) + tuple(d.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        idx, w = ctx.saved_tensors
        grad_data = _scatter(idx, w, _flat(grad), ctx.data_shape[0]).reshape(ctx.data_shape)
        return (None,) * 12 + (grad_data, None, None, None)

    @staticmethod
    def symbolic(g, bezier, *tensors):
        op_type = "SampleBezier" if bezier else "SampleTrilinear"
        return export_node(g, op_type, tensors, tensors[11], [rows_of(tensors[7])] + trailing_sizes(tensors[11]))


def _check_splat_values(points: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Check a splat's points and values (float32, one row per point); return the values."""
    _check_points("points jdata", points)
    if values.dtype != torch.float32 or values.dim() < 1 or values.shape[0] != points.shape[0]:
        raise ValueError(f"values must be float32 with one row per point ({points.shape[0]}), got "
                         f"{values.dtype} {list(values.shape)}")
    return values


class _Splat(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, bezier: bool, total_voxels: int, *tensors):
        bundle, pts, values = tensors[:7], tensors[7:11], tensors[11:15]
        v = _check_splat_values(pts[0], values[0])
        g = grids_of(bundle)
        if total_voxels != g.total_voxels:
            raise ValueError(f"total_voxels is {total_voxels}, the grids have {g.total_voxels} active voxels")
        stencil = _bezier_stencil if bezier else _trilinear
        idx, w = stencil(g, pts[0], _grid_ids(pts))
        ctx.save_for_backward(idx, w)
        ctx.values_shape = v.shape
        return _scatter(idx, w, _flat(v), g.total_voxels).reshape((g.total_voxels,) + tuple(v.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        idx, w = ctx.saved_tensors
        grad_values = _gather(idx, w, _flat(grad)).reshape(ctx.values_shape)
        return (None,) * 13 + (grad_values, None, None, None)

    @staticmethod
    def symbolic(g, bezier, total_voxels, *tensors):
        op_type = "SplatBezier" if bezier else "SplatTrilinear"
        return export_node(g, op_type, tensors, tensors[11], [total_voxels] + trailing_sizes(tensors[11]),
                           total_voxels_i=total_voxels)


class _SplatNearest(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, total_voxels: int, *tensors):
        bundle, pts, values = tensors[:7], tensors[7:11], tensors[11:15]
        v = _check_splat_values(pts[0], values[0])
        g = grids_of(bundle)
        b = _grid_ids(pts)
        idx = _lookup(g, torch.floor(_world_to_voxel(g, pts[0], b) + 0.5), b)[:, None]  # (NanoVDB's round)
        ctx.save_for_backward(idx)
        ctx.values_shape = v.shape
        return _scatter(idx, torch.ones(idx.shape), _flat(v), g.total_voxels).reshape((g.total_voxels,) + v.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        return (None,) * 12 + (_gather(idx, torch.ones(idx.shape), _flat(grad)).reshape(ctx.values_shape),) + (None,) * 3

    @staticmethod
    def symbolic(g, total_voxels, *tensors):
        # the rows are left unknown: over a grid bound at run time they are its voxels (the batch)
        return export_node(g, "SplatNearest", tensors, tensors[11], [None] + trailing_sizes(tensors[11]),
                           total_voxels_i=total_voxels)


def ijk_to_index(bundle, ijk, cumulative: bool = False) -> torch.Tensor:
    """fVDB ijk_to_index: int64 index of each ijk in its grid (+ the grid's batch offset when cumulative), -1 if inactive."""
    return _IJKToIndex.apply(bool(cumulative), *flat_args(bundle, ijk))


def coords_in_grid(bundle, ijk) -> torch.Tensor:
    """fVDB coords_in_grid: whether each integer ijk is an active voxel of its grid."""
    return _InGrid.apply("CoordsInGrid", *flat_args(bundle, ijk))


def points_in_grid(bundle, points) -> torch.Tensor:
    """fVDB points_in_grid: whether round(world_to_voxel(p)) is an active voxel."""
    return _InGrid.apply("PointsInGrid", *flat_args(bundle, points))


def world_to_voxel(bundle, points) -> torch.Tensor:
    """fVDB world_to_voxel (primal, float32): p * s + t; differentiable in the points."""
    return _Transform.apply(True, *flat_args(bundle, points))


def voxel_to_world(bundle, coords) -> torch.Tensor:
    """fVDB voxel_to_world (primal, float32): (x - t) / s; differentiable in the coordinates."""
    return _Transform.apply(False, *flat_args(bundle, coords))


def sample_trilinear(bundle, points, voxel_data) -> torch.Tensor:
    """fVDB sample_trilinear: [N, *] from voxel data [V, *]; differentiable in the data."""
    return _Sample.apply(False, *flat_args(bundle, points, voxel_data))


def sample_bezier(bundle, points, voxel_data) -> torch.Tensor:
    """fVDB sample_bezier (weights summing to 8): [N, *] from voxel data [V, *]; differentiable in the data."""
    return _Sample.apply(True, *flat_args(bundle, points, voxel_data))


def splat_trilinear(bundle, points, values) -> torch.Tensor:
    """fVDB splat_trilinear: [V, *] from per-point values [N, *]; differentiable in the values."""
    args = flat_args(bundle, points, values)
    return _Splat.apply(False, bundle_voxels(args), *args)


def splat_bezier(bundle, points, values) -> torch.Tensor:
    """fVDB splat_bezier: [V, *] from per-point values [N, *]; differentiable in the values."""
    args = flat_args(bundle, points, values)
    return _Splat.apply(True, bundle_voxels(args), *args)


def splat_nearest(bundle, points, values) -> torch.Tensor:
    """luisaml's splat_nearest: [V, *], each point's value added into its voxel round(world_to_voxel(p))
    when active (fVDB has no such op); differentiable in the values. A mean by voxel is two of them
    (values and ones) and a division. Exports to fvdb.SplatNearest."""
    args = flat_args(bundle, points, values)
    return _SplatNearest.apply(bundle_voxels(args), *args)
