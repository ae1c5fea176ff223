"""The `fvdb` operators as torch functions: CPU implementations with fVDB's semantics (differentiable
where fVDB's are: samplers and splats with respect to their data, transforms with respect to the
points), which ``torch.onnx.export(..., dynamo=False)`` turns into ``fvdb.*`` nodes.

A grid enters as the seven GridBatch bundle tensors (:func:`bundle_tensors`), a JaggedTensor as its
four tensors (:func:`jagged_tensors`), in the order of opsets/fvdb.py; per-point functions return the
jdata of their result. Exported, the bundle is whatever the tensors are in the traced model: graph
inputs when they are forward() arguments, initializers when they are buffers of the module.

    bundle = bundle_tensors(GridBatch.from_points(pts, voxel_sizes=0.05))
    feats = sample_trilinear(bundle, jagged_tensors(x), jagged_tensors(features))
    export_onnx(model, (x,), "model.onnx", input_names=["x"], dynamic_axes={"x": {0: "N"}})

Sparse convolution is two functions, as fVDB's ConvolutionPlan: sparse_conv_kernel_map(grid_in,
grid_out, kernel_size, stride) once per grid pair, then sparse_conv3d(features, kernel_map, weight,
bias) per layer (gather-matmul-scatter, differentiable in features, weight and bias).

Lookups run on the host (luisaml.fvdb's reader, checked against warp) with the grids parsed and
validated once per bundle; the arithmetic is fVDB's float32 arithmetic, so these functions and the
compiled kernels agree to the last bit where the kernel runs the same operations.
"""
from __future__ import annotations

import functools
import hashlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..opsets import fvdb as schema
from .grid_batch import GridBatch
from .jagged import JaggedTensor
from .nanovdb import NanoGrid, active_voxels
from .nanovdb import ijk_to_index as _host_ijk_to_index
from .sparse_conv import conv_geometry
from .sparse_conv import kernel_map as _host_kernel_map

# fVDB's trilinear corner order (utils/TrilinearStencil.h)
_CORNERS = ((0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 0), (1, 0, 0), (1, 0, 1), (1, 1, 1), (1, 1, 0))


def bundle_tensors(grid: GridBatch) -> tuple[torch.Tensor, ...]:
    """Return the seven GridBatch bundle arrays as torch tensors (grid_blob, grid_byte_offsets, ...)."""
    return tuple(torch.from_numpy(np.array(a)) for a in grid.bundle())


def jagged_tensors(x: JaggedTensor | torch.Tensor | np.ndarray | Sequence) -> tuple[torch.Tensor, ...]:
    """Return (jdata, joffsets, jidx, jlidx) as torch tensors for a JaggedTensor, one tensor (a single-element
    list: empty jidx, as fVDB leaves it) or a list of tensors (one per grid)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        data = torch.as_tensor(x)
        n = data.shape[0]
        return (data, torch.tensor([0, n], dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                torch.zeros((0, 1), dtype=torch.int32))
    if not isinstance(x, JaggedTensor):
        parts = [torch.as_tensor(t) for t in x]
        counts = torch.tensor([0] + [len(t) for t in parts], dtype=torch.int64)
        offsets = torch.cumsum(counts, 0)
        jidx = (torch.repeat_interleave(torch.arange(len(parts), dtype=torch.int32), counts[1:])
                if len(parts) > 1 else torch.zeros(0, dtype=torch.int32))
        return torch.cat(parts), offsets, jidx, torch.zeros((0, 1), dtype=torch.int32)
    return tuple(torch.from_numpy(np.array(a)) for a in x.bundle())


# ---- the grids behind a bundle, parsed once -------------------------------------------------------


# A grid whose active bounding box has at most this many cells is looked up through a dense table
# built once from its validated tree (one gather per query instead of a tree walk).
DENSE_TABLE_CELLS = 1 << 24


class _Index:
    """ijk -> index (-1 inactive) of one grid: a dense table over its bounding box, or the tree walk."""

    def __init__(self, grid: NanoGrid):
        self.grid = grid
        self.lo = grid.root_bbox[0].astype(np.int64)
        dims = grid.root_bbox[1].astype(np.int64) - self.lo + 1
        self.table = None
        if grid.voxel_count and int(np.prod(dims)) <= DENSE_TABLE_CELLS:
            ijk = active_voxels(grid).astype(np.int64)  # ordered by index
            self.dims = dims
            self.table = np.full(int(np.prod(dims)), -1, np.int64)
            self.table[self._flat(ijk - self.lo)] = np.arange(len(ijk))

    def _flat(self, rel: np.ndarray) -> np.ndarray:
        return (rel[:, 0] * self.dims[1] + rel[:, 1]) * self.dims[2] + rel[:, 2]

    def __call__(self, ijk: np.ndarray) -> np.ndarray:
        if self.table is None:
            return _host_ijk_to_index(self.grid, ijk) if self.grid.voxel_count else np.full(len(ijk), -1, np.int64)
        rel = ijk.astype(np.int64) - self.lo
        inside = ((rel >= 0) & (rel < self.dims)).all(1)
        out = np.full(len(ijk), -1, np.int64)
        out[inside] = self.table[self._flat(rel[inside])]
        return out


class _Grids(NamedTuple):
    index: list[_Index]
    voxel_offsets: np.ndarray  # int64 [B]
    total_voxels: int
    scale: torch.Tensor  # float32 [B, 3], fVDB's 1/h
    translate: torch.Tensor  # float32 [B, 3], fVDB's -origin/h


_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 8


def _key(bundle: Sequence[torch.Tensor]) -> tuple:
    """Return the cache key of a bundle: the blob tensor's identity and version (in-place writes bump
    it), and the contents of the small tensors."""
    blob = bundle[0]
    small = hashlib.blake2b(digest_size=16)
    for t in bundle[1:6]:
        a = np.ascontiguousarray(t.detach().cpu().numpy())
        small.update(f"{a.dtype.str}{a.shape};".encode())
        small.update(memoryview(a).cast("B"))
    return (id(blob), blob.data_ptr(), blob.numel(), blob._version, small.digest())


def _grids(bundle: Sequence[torch.Tensor]) -> _Grids:
    """Return the bundle's grids (validated against the blob as the shader side does), cached per bundle."""
    if len(bundle) != len(schema.BUNDLE):
        raise ValueError(f"a grid bundle has {len(schema.BUNDLE)} tensors ({', '.join(schema.BUNDLE)}), got {len(bundle)}")
    key = _key(bundle)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is bundle[0]:  # the very tensor, still alive: its bytes are the same
        _CACHE.move_to_end(key)
        return hit[1]
    from ..operators.fvdb.common import bundle_grids, fvdb_transform

    arrays = [t.detach().cpu().numpy() for t in bundle]
    grids = bundle_grids(*arrays[:6])  # every check the kernels rely on
    offsets = np.asarray(arrays[5], np.int64).reshape(-1)
    scale, translate = fvdb_transform(arrays[2], arrays[3])
    out = _Grids([_Index(g) for g in grids], offsets[:-1], int(offsets[-1]), torch.from_numpy(scale),
                 torch.from_numpy(translate))
    _CACHE[key] = (weakref.ref(bundle[0]), out)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return out


def _grid_ids(jagged: Sequence[torch.Tensor]) -> torch.Tensor:
    jdata, _, jidx, _ = jagged
    return jidx.long() if jidx.numel() else torch.zeros(jdata.shape[0], dtype=torch.long)


def _lookup(g: _Grids, ijk: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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


def _world_to_voxel(g: _Grids, pts: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return pts * g.scale[b] + g.translate[b]


def _trilinear(g: _Grids, pts: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def _bezier_stencil(g: _Grids, pts: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


# ---- export ----------------------------------------------------------------------------------------


def _node(g, op_type: str, inputs, like, sizes, dtype=None, **attrs):
    """Return an fvdb.<op_type> node's output in a TorchScript export graph, typed like `like`."""
    out = g.op(f"{schema.DOMAIN}::{op_type}", *inputs, **attrs)
    t = like.type()
    if dtype is not None:
        t = t.with_dtype(dtype)
    out.setType(t.with_sizes(sizes))
    return out


def _rows(v) -> int | None:
    from torch.onnx import symbolic_helper

    sizes = symbolic_helper._get_tensor_sizes(v)
    return sizes[0] if sizes else None


def _trailing(v) -> list:
    from torch.onnx import symbolic_helper

    return list(symbolic_helper._get_tensor_sizes(v) or [None, None])[1:]


def export_onnx(model: torch.nn.Module, args, f, **kwargs) -> None:
    """torch.onnx.export with the settings fvdb.* nodes need: the TorchScript exporter (dynamo=False),
    opset 17 and the fvdb custom opset."""
    kwargs.setdefault("opset_version", 17)
    kwargs["custom_opsets"] = {**kwargs.get("custom_opsets", {}), schema.DOMAIN: schema.VERSION}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # the TorchScript exporter
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        with torch.no_grad():  # the graph is traced for inference; parameters become initializers
            torch.onnx.export(model, args, f, dynamo=False, **kwargs)


# ---- the functions --------------------------------------------------------------------------------


def _host_forward(forward):
    """Run a Function's forward with the TorchScript tracer paused: the exporter records the node
    (its symbolic), not the host computation inside, whose constants it cannot always map."""

    @functools.wraps(forward)
    def wrapped(ctx, *args):
        state = torch._C._get_tracing_state()
        torch._C._set_tracing_state(None)
        try:
            return forward(ctx, *args)
        finally:
            torch._C._set_tracing_state(state)

    return wrapped


class _IJKToIndex(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, cumulative: bool, *tensors):
        bundle, ijk = tensors[:7], tensors[7:]
        _check_points("ijk jdata", ijk[0], (torch.int32, torch.int64))
        g = _grids(bundle)
        b = _grid_ids(ijk)
        out = _lookup(g, ijk[0], b)
        if not cumulative:
            out = torch.where(out >= 0, out - torch.from_numpy(g.voxel_offsets)[b], out)
        return out

    @staticmethod
    def symbolic(g, cumulative, *tensors):
        return _node(g, "IJKToIndex", tensors, tensors[7], [_rows(tensors[7])], torch.int64, cumulative_i=int(cumulative))


class _InGrid(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, op_type: str, *tensors):
        bundle, x = tensors[:7], tensors[7:]
        g = _grids(bundle)
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
        return _node(g, op_type, tensors, tensors[7], [_rows(tensors[7])], torch.bool)


class _Transform(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, to_voxel: bool, *tensors):
        bundle, x = tensors[:7], tensors[7:]
        _check_points("points jdata", x[0])
        g = _grids(bundle)
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
        return _node(g, op_type, tensors, tensors[7], [_rows(tensors[7]), 3])


class _Sample(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, bezier: bool, *tensors):
        bundle, pts, data = tensors[:7], tensors[7:11], tensors[11:15]
        _check_points("points jdata", pts[0])
        g = _grids(bundle)
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
        return _node(g, op_type, tensors, tensors[11], [_rows(tensors[7])] + _trailing(tensors[11]))


class _Splat(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, bezier: bool, total_voxels: int, *tensors):
        bundle, pts, values = tensors[:7], tensors[7:11], tensors[11:15]
        _check_points("points jdata", pts[0])
        v = values[0]
        if v.dtype != torch.float32 or v.dim() < 1 or v.shape[0] != pts[0].shape[0]:
            raise ValueError(f"values must be float32 with one row per point ({pts[0].shape[0]}), got "
                             f"{v.dtype} {list(v.shape)}")
        g = _grids(bundle)
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
        return _node(g, op_type, tensors, tensors[11], [total_voxels] + _trailing(tensors[11]),
                     total_voxels_i=total_voxels)


def _args(bundle, *jagged) -> tuple:
    bundle = tuple(bundle)
    if len(bundle) != len(schema.BUNDLE):
        raise ValueError(f"a grid bundle has {len(schema.BUNDLE)} tensors ({', '.join(schema.BUNDLE)}), got {len(bundle)}")
    out = bundle
    for j in jagged:
        j = tuple(j)
        if len(j) != len(schema.JAGGED):
            raise ValueError(f"a JaggedTensor is {len(schema.JAGGED)} tensors (jdata, joffsets, jidx, jlidx), got {len(j)}")
        out += j
    return out


def ijk_to_index(bundle, ijk, cumulative: bool = False) -> torch.Tensor:
    """fVDB ijk_to_index: int64 index of each ijk in its grid (+ the grid's batch offset when cumulative), -1 if inactive."""
    return _IJKToIndex.apply(bool(cumulative), *_args(bundle, ijk))


def coords_in_grid(bundle, ijk) -> torch.Tensor:
    """fVDB coords_in_grid: whether each integer ijk is an active voxel of its grid."""
    return _InGrid.apply("CoordsInGrid", *_args(bundle, ijk))


def points_in_grid(bundle, points) -> torch.Tensor:
    """fVDB points_in_grid: whether round(world_to_voxel(p)) is an active voxel."""
    return _InGrid.apply("PointsInGrid", *_args(bundle, points))


def world_to_voxel(bundle, points) -> torch.Tensor:
    """fVDB world_to_voxel (primal, float32): p * s + t; differentiable in the points."""
    return _Transform.apply(True, *_args(bundle, points))


def voxel_to_world(bundle, coords) -> torch.Tensor:
    """fVDB voxel_to_world (primal, float32): (x - t) / s; differentiable in the coordinates."""
    return _Transform.apply(False, *_args(bundle, coords))


def sample_trilinear(bundle, points, voxel_data) -> torch.Tensor:
    """fVDB sample_trilinear: [N, *] from voxel data [V, *]; differentiable in the data."""
    return _Sample.apply(False, *_args(bundle, points, voxel_data))


def sample_bezier(bundle, points, voxel_data) -> torch.Tensor:
    """fVDB sample_bezier (weights summing to 8): [N, *] from voxel data [V, *]; differentiable in the data."""
    return _Sample.apply(True, *_args(bundle, points, voxel_data))


def _total_voxels(bundle) -> int:
    with warnings.catch_warnings():  # while tracing, the example grid's count becomes an attribute
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        return int(bundle[5][-1].item())


def splat_trilinear(bundle, points, values) -> torch.Tensor:
    """fVDB splat_trilinear: [V, *] from per-point values [N, *]; differentiable in the values."""
    args = _args(bundle, points, values)
    return _Splat.apply(False, _total_voxels(args), *args)


def splat_bezier(bundle, points, values) -> torch.Tensor:
    """fVDB splat_bezier: [V, *] from per-point values [N, *]; differentiable in the values."""
    args = _args(bundle, points, values)
    return _Splat.apply(True, _total_voxels(args), *args)


class _KernelMap(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, kernel, stride, transposed: bool, output_voxels: int, *tensors):
        g_in, g_out = _grids(tensors[:7]), _grids(tensors[7:])
        if len(g_in.index) != len(g_out.index):
            raise ValueError(f"the input bundle has {len(g_in.index)} grids, the output bundle {len(g_out.index)}; a "
                             "kernel map pairs grid b with grid b")
        geo = conv_geometry(kernel, stride)

        def lookup(b, ijk):
            idx = g_in.index[b](ijk)
            return np.where(idx >= 0, idx + g_in.voxel_offsets[b], -1)

        ijk_out = [active_voxels(index.grid) if index.grid.voxel_count else np.zeros((0, 3), np.int32)
                   for index in g_out.index]
        return torch.from_numpy(_host_kernel_map(ijk_out, lookup, geo, transposed))

    @staticmethod
    def symbolic(g, kernel, stride, transposed, output_voxels, *tensors):
        out = g.op(f"{schema.DOMAIN}::{schema.KERNEL_MAP}", *tensors, kernel_size_i=list(kernel),
                   stride_i=list(stride), transposed_i=int(transposed), output_voxels_i=int(output_voxels))
        # rows left unknown in the graph: the traced grid's count holds only for constant grids (luisaml
        # infers them), and a grid given as an input may have any size (its voxels are then the batch)
        out.setType(tensors[0].type().with_dtype(torch.int32).with_sizes([None, int(np.prod(kernel))]))
        return out


def _tap_pairs(kernel_map: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (output rows, input rows) of tap t of a kernel map: fVDB's rulebook entry of the tap."""
    src = kernel_map[:, t].long()
    rows = torch.nonzero(src >= 0).reshape(-1)
    return rows, src[rows]


class _SparseConv(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, features, kernel_map, weight, bias):
        c_out, c_in = weight.shape[:2]
        taps = weight[0, 0].numel()
        if features.dim() != 2 or features.shape[1] != c_in:
            raise ValueError(f"features must be [N_in, {c_in}] for weight {list(weight.shape)}, got {list(features.shape)}")
        if kernel_map.dim() != 2 or kernel_map.shape[1] != taps:
            raise ValueError(f"kernel_map must be [N_out, {taps}] for weight {list(weight.shape)}, got "
                             f"{list(kernel_map.shape)}")
        if kernel_map.numel() and (kernel_map.min() < -1 or kernel_map.max() >= features.shape[0]):
            raise ValueError(f"kernel_map holds indices outside [-1, {features.shape[0]}) (the rows of features)")
        w = weight.reshape(c_out, c_in, taps)
        out = torch.zeros((kernel_map.shape[0], c_out), dtype=features.dtype, device=features.device)
        if bias is not None:
            out = out + bias
        for t in range(taps):  # gather, matmul, scatter per tap
            rows, src = _tap_pairs(kernel_map, t)
            out.index_add_(0, rows, features[src] @ w[:, :, t].T)
        ctx.save_for_backward(features, kernel_map, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        features, kernel_map, weight = ctx.saved_tensors
        c_out, c_in = weight.shape[:2]
        taps = weight[0, 0].numel()
        w = weight.reshape(c_out, c_in, taps)
        grad_x = torch.zeros_like(features)
        grad_w = torch.zeros_like(w)
        for t in range(taps):
            rows, src = _tap_pairs(kernel_map, t)
            grad_x.index_add_(0, src, grad[rows] @ w[:, :, t])
            grad_w[:, :, t] = grad[rows].T @ features[src]
        grad_b = grad.sum(0) if ctx.has_bias else None
        return grad_x, None, grad_w.reshape(weight.shape), grad_b

    @staticmethod
    def symbolic(g, features, kernel_map, weight, bias):
        from torch.onnx import symbolic_helper

        ins = [features, kernel_map, weight] + ([] if bias is None or symbolic_helper._is_none(bias) else [bias])
        out = g.op(f"{schema.DOMAIN}::{schema.SPARSE_CONV}", *ins)
        sizes = [_rows(kernel_map), (symbolic_helper._get_tensor_sizes(weight) or [None])[0]]
        out.setType(features.type().with_sizes(sizes))
        return out


def sparse_conv_kernel_map(grid_in, grid_out, kernel_size, stride=1, transposed: bool = False) -> torch.Tensor:
    """fVDB's sparse convolution relation between two grid bundles (grid b with grid b): int32 [N_out,
    k0*k1*k2], the batch-global input voxel each output voxel reads at each tap (x slowest), -1 where
    inactive; transposed: the relation the other way round (opsets/fvdb.py, SparseConvKernelMap).
    Build it once per grid pair and pass it to every sparse_conv3d over that pair."""
    geo = conv_geometry(kernel_size, stride)
    args = _args(grid_in) + _args(grid_out)
    return _KernelMap.apply(geo.kernel, geo.stride, bool(transposed), _total_voxels(args[7:]), *args)


def sparse_conv3d(features: torch.Tensor, kernel_map: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """fVDB's sparse convolution over a kernel map (sparse_conv_kernel_map): [N_out, C_out] = bias +
    sum over taps of weight[:, :, t] @ features[kernel_map[:, t]] (missing taps skipped); weight
    [C_out, C_in, k0, k1, k2] (k0 along x), transposed convolutions through a transposed map.
    Differentiable in features, weight and bias; exports to fvdb.SparseConv3d."""
    return _SparseConv.apply(features, kernel_map, weight, bias)


class SparseConv3d(torch.nn.Module):
    """A sparse convolution layer (fVDB's fvdb.nn.SparseConv3d weights): forward(features,
    kernel_map) with a map of this layer's kernel size, built by sparse_conv_kernel_map."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size=3, bias: bool = True):
        super().__init__()
        k = conv_geometry(kernel_size).kernel
        self.weight = torch.nn.Parameter(torch.empty(out_channels, in_channels, *k))
        self.bias = torch.nn.Parameter(torch.empty(out_channels)) if bias else None
        bound = 1.0 / float(np.sqrt(in_channels * np.prod(k)))
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, features: torch.Tensor, kernel_map: torch.Tensor) -> torch.Tensor:
        return sparse_conv3d(features, kernel_map, self.weight, self.bias)


__all__ = [
    "SparseConv3d",
    "bundle_tensors",
    "coords_in_grid",
    "export_onnx",
    "ijk_to_index",
    "jagged_tensors",
    "points_in_grid",
    "sample_bezier",
    "sample_trilinear",
    "sparse_conv3d",
    "sparse_conv_kernel_map",
    "splat_bezier",
    "splat_trilinear",
    "voxel_to_world",
    "world_to_voxel",
]


# ---- pooling and topology ----------------------------------------------------------------------------
# Pooling, as the sparse convolution, is a map of the grid pair (pooling_map: each coarse voxel's
# window of fine voxels; refine_map: each fine voxel's coarse parent) and a reduction over it; the
# gradients are torch autograd's of the gather formulation. Topology functions return a new bundle,
# built on the host with the project's builder; exported, they become fvdb.* nodes that luisaml folds
# when their inputs are constants (module buffers).


class _PoolMap(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, op_type: str, attrs: tuple, output_voxels: int, *tensors):
        from .topology import pool_geometry, refine_parents

        g_in, g_out = _grids(tensors[:7]), _grids(tensors[7:])
        if len(g_in.index) != len(g_out.index):
            raise ValueError(f"the input bundle has {len(g_in.index)} grids, the output bundle {len(g_out.index)}; a "
                             "pooling map pairs grid b with grid b")

        def lookup(b, ijk):
            idx = g_in.index[b](ijk)
            return np.where(idx >= 0, idx + g_in.voxel_offsets[b], -1)

        ijk_out = [active_voxels(index.grid) if index.grid.voxel_count else np.zeros((0, 3), np.int32)
                   for index in g_out.index]
        a = dict(attrs)
        if op_type == schema.POOL_MAP:
            return torch.from_numpy(_host_kernel_map(ijk_out, lookup, pool_geometry(a["pool_size"], a["stride"])))
        rows = [lookup(b, refine_parents(v, a["subdiv_factor"])) for b, v in enumerate(ijk_out)]
        return torch.from_numpy(np.concatenate(rows).astype(np.int32).reshape(-1, 1))

    @staticmethod
    def symbolic(g, op_type, attrs, output_voxels, *tensors):
        kwargs = {f"{k}_i": list(v) for k, v in attrs}
        out = g.op(f"{schema.DOMAIN}::{op_type}", *tensors, output_voxels_i=int(output_voxels), **kwargs)
        taps = int(np.prod(dict(attrs)["pool_size"])) if op_type == schema.POOL_MAP else 1
        out.setType(tensors[0].type().with_dtype(torch.int32).with_sizes([None, taps]))  # (as the kernel map's)
        return out


def _three(value, what: str, allow_zero: bool = False) -> tuple:
    from .topology import factor3

    return tuple(int(v) for v in factor3(value, what, allow_zero))


def pooling_map(fine, coarse, pool_size, stride=0) -> torch.Tensor:
    """fVDB's pooling window between two bundles (grid b with grid b): int32 [N_coarse, p0*p1*p2], the
    batch-global fine voxel c*S + t of each coarse voxel c and tap t (x slowest), -1 where inactive;
    stride 0 means stride = pool_size. Exports to fvdb.PoolingMap."""
    attrs = (("pool_size", _three(pool_size, "pool_size")), ("stride", _three(stride, "stride", True)))
    args = _args(fine) + _args(coarse)
    return _PoolMap.apply(schema.POOL_MAP, attrs, _total_voxels(args[7:]), *args)


def refine_map(coarse, fine, subdiv_factor) -> torch.Tensor:
    """fVDB's refine relation: int32 [N_fine, 1], the batch-global coarse voxel floor(f / S) of each
    fine voxel f, -1 where inactive. Exports to fvdb.RefineMap."""
    attrs = (("subdiv_factor", _three(subdiv_factor, "subdiv_factor")),)
    args = _args(coarse) + _args(fine)
    return _PoolMap.apply(schema.REFINE_MAP, attrs, _total_voxels(args[7:]), *args)


def _pool_formula(op_type: str, x: torch.Tensor, pmap: torch.Tensor) -> torch.Tensor:
    """The gather formulation of MaxPool / AvgPool / Refine over a map (autograd differentiates it)."""
    idx = pmap.long()
    valid = (idx >= 0)[..., None]
    if x.shape[0]:
        g = x[idx.clamp(min=0)]
    else:  # no input voxels: every entry of the map is -1
        g = x.new_zeros(tuple(idx.shape) + (x.shape[1],))
    if op_type == "MaxPool":
        return torch.where(valid, g, torch.full((), float("-inf"), dtype=x.dtype)).amax(1)
    s = torch.where(valid, g, torch.zeros((), dtype=x.dtype)).sum(1)
    return s * (1.0 / idx.shape[1]) if op_type == "AvgPool" else s


class _PoolFn(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, op_type: str, features, pmap):
        if features.dim() != 2 or pmap.dim() != 2:
            raise ValueError(f"{op_type}: features must be [N, C] and the map [N_out, taps], got "
                             f"{list(features.shape)} and {list(pmap.shape)}")
        if pmap.numel() and (pmap.min() < -1 or pmap.max() >= features.shape[0]):
            raise ValueError(f"{op_type}: the map holds indices outside [-1, {features.shape[0]}) (the rows of features)")
        ctx.save_for_backward(features, pmap)
        ctx.op_type = op_type
        return _pool_formula(op_type, features, pmap)

    @staticmethod
    def backward(ctx, grad):
        features, pmap = ctx.saved_tensors
        with torch.enable_grad():
            x = features.detach().requires_grad_()
            (grad_x,) = torch.autograd.grad(_pool_formula(ctx.op_type, x, pmap), x, grad)
        return None, grad_x, None

    @staticmethod
    def symbolic(g, op_type, features, pmap):
        from torch.onnx import symbolic_helper

        out = g.op(f"{schema.DOMAIN}::{op_type}", features, pmap)
        sizes = [_rows(pmap), (symbolic_helper._get_tensor_sizes(features) or [None, None])[1]]
        out.setType(features.type().with_sizes(sizes))
        return out


def max_pool(fine, coarse, fine_data: torch.Tensor, pool_size, stride=0) -> torch.Tensor:
    """fVDB max_pool: [N_coarse, C], the max over each coarse voxel c of the active fine voxels in
    c*S + [0, K)^3 (-inf where none; stride 0 = pool_size); differentiable in the data."""
    return _PoolFn.apply("MaxPool", fine_data, pooling_map(fine, coarse, pool_size, stride))


def avg_pool(fine, coarse, fine_data: torch.Tensor, pool_size, stride=0) -> torch.Tensor:
    """fVDB avg_pool: [N_coarse, C], the window's sum times 1 / (p0*p1*p2); differentiable in the data."""
    return _PoolFn.apply("AvgPool", fine_data, pooling_map(fine, coarse, pool_size, stride))


def refine(coarse, fine, coarse_data: torch.Tensor, subdiv_factor) -> torch.Tensor:
    """fVDB refine: [N_fine, C], each fine voxel's coarse parent's features (0 where the parent is
    inactive); differentiable in the data."""
    return _PoolFn.apply("Refine", coarse_data, refine_map(coarse, fine, subdiv_factor))


def pool_over_map(op_type: str, features: torch.Tensor, pmap: torch.Tensor) -> torch.Tensor:
    """MaxPool, AvgPool (over a pooling_map) or Refine (over a refine_map) with a map built once for
    the grid pair; differentiable in the features."""
    if op_type not in schema.POOL_OPS:
        raise ValueError(f"op_type must be one of {sorted(schema.POOL_OPS)}, got {op_type!r}")
    return _PoolFn.apply(op_type, features, pmap)


class _GridFn(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, op_type: str, attrs: tuple, shapes: tuple, *tensors):
        outs = tuple(torch.from_numpy(np.array(a)) for a in _grid_op(op_type, attrs, tensors))
        ctx.mark_non_differentiable(*outs)
        return outs

    @staticmethod
    def symbolic(g, op_type, attrs, shapes, *tensors):
        kwargs = {f"{k}_i": (list(v) if isinstance(v, tuple) else int(v)) for k, v in attrs}
        outs = g.op(f"{schema.DOMAIN}::{op_type}", *tensors, outputs=len(schema.BUNDLE), **kwargs)
        dtypes = (torch.uint8, torch.int64, torch.float64, torch.float64, torch.int32, torch.int64, torch.int32)
        for out, dtype, shape in zip(outs, dtypes, shapes):
            out.setType(tensors[0].type().with_dtype(dtype).with_sizes(list(shape)))
        return outs


def _grid_op(op_type: str, attrs: tuple, tensors) -> list[np.ndarray]:
    from ..model import Node
    from ..operators.fvdb.topology import evaluate_grid_op

    names = [f"input_{k}" for k in range(len(tensors))]
    node = Node(op_type, op_type, schema.DOMAIN, names, [], dict(attrs))
    return evaluate_grid_op(node, [t.detach().cpu().numpy() for t in tensors])


def _new_grid(op_type: str, attrs: tuple, tensors: tuple) -> tuple[torch.Tensor, ...]:
    shapes = tuple(a.shape for a in _grid_op(op_type, attrs, tensors))
    return _GridFn.apply(op_type, attrs, shapes, *tensors)


def coarsened_grid(bundle, coarsening_factor) -> tuple[torch.Tensor, ...]:
    """fVDB coarsened_grid: the bundle of floor(ijk / f), voxel size f*h, origin origin + (f - 1)*h/2."""
    return _new_grid("CoarsenedGrid", (("coarsening_factor", _three(coarsening_factor, "coarsening_factor")),),
                     _args(bundle))


def refined_grid(bundle, subdiv_factor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """fVDB refined_grid: c*f + [0, f)^3 of the voxels mask (bool [N]) keeps; voxel size h/f."""
    extra = () if mask is None else (mask,)
    return _new_grid("RefinedGrid", (("subdiv_factor", _three(subdiv_factor, "subdiv_factor")),),
                     _args(bundle) + extra)


def dilated_grid(bundle, dilation: int = 1) -> tuple[torch.Tensor, ...]:
    """fVDB dilated_grid: `dilation` passes of 26-neighbour dilation."""
    return _new_grid("DilatedGrid", (("dilation", int(dilation)),), _args(bundle))


def pruned_grid(bundle, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fVDB pruned_grid: the voxels whose mask entry (bool [N], index order) is true."""
    return _new_grid("PrunedGrid", (), _args(bundle) + (mask,))


def conv_grid(bundle, kernel_size, stride=1) -> tuple[torch.Tensor, ...]:
    """fVDB conv_grid: the output grid of a sparse convolution (voxel size h*S, origin unchanged)."""
    attrs = (("kernel_size", _three(kernel_size, "kernel_size")), ("stride", _three(stride, "stride")))
    return _new_grid("ConvGrid", attrs, _args(bundle))


def conv_transpose_grid(bundle, kernel_size, stride=1) -> tuple[torch.Tensor, ...]:
    """fVDB conv_transpose_grid: the output grid of a transposed sparse convolution (voxel size h/S)."""
    attrs = (("kernel_size", _three(kernel_size, "kernel_size")), ("stride", _three(stride, "stride")))
    return _new_grid("ConvTransposeGrid", attrs, _args(bundle))


def _sizes(jagged, voxel_sizes, origins) -> tuple:
    count = jagged[1].shape[0] - 1
    rows = []
    for value in (voxel_sizes, origins):
        t = torch.as_tensor(value, dtype=torch.float64)
        rows.append(t if t.dim() == 2 else t.reshape(-1).expand(3 if t.numel() == 1 else -1).repeat(count, 1))
    return tuple(rows)


def gridbatch_from_ijk(ijk, voxel_sizes=1.0, origins=0.0) -> tuple[torch.Tensor, ...]:
    """fVDB gridbatch_from_ijk: one grid per tensor of the ijk JaggedTensor (its four tensors), deduplicated."""
    j = tuple(ijk)
    return _new_grid("GridBatchFromIJK", (), j + _sizes(j, voxel_sizes, origins))


def gridbatch_from_points(points, voxel_sizes=1.0, origins=0.0) -> tuple[torch.Tensor, ...]:
    """fVDB gridbatch_from_points: the voxels round(world_to_voxel(p)) of each tensor's points."""
    j = tuple(points)
    return _new_grid("GridBatchFromPoints", (), j + _sizes(j, voxel_sizes, origins))


def gridbatch_from_nearest_voxels_to_points(points, voxel_sizes=1.0, origins=0.0) -> tuple[torch.Tensor, ...]:
    """fVDB gridbatch_from_nearest_voxels_to_points: floor(world_to_voxel(p)) + {0, 1}^3 of each tensor's points."""
    j = tuple(points)
    return _new_grid("GridBatchFromNearestVoxelsToPoints", (), j + _sizes(j, voxel_sizes, origins))


__all__ += [
    "avg_pool",
    "coarsened_grid",
    "conv_grid",
    "conv_transpose_grid",
    "dilated_grid",
    "gridbatch_from_ijk",
    "gridbatch_from_nearest_voxels_to_points",
    "gridbatch_from_points",
    "max_pool",
    "pool_over_map",
    "pooling_map",
    "pruned_grid",
    "refine",
    "refine_map",
    "refined_grid",
]


# ---- rays (outputs sized at run time) -------------------------------------------------------------

_TORCH_OF = {1: torch.float32, 6: torch.int32, 7: torch.int64, 9: torch.bool, 11: torch.float64}  # TensorProto -> torch
_RAY_NETS: OrderedDict = OrderedDict()  # (op, attrs, input types) -> the compiled one-node network
_RAY_NETS_KEPT = 8


class _RayFn(torch.autograd.Function):
    @staticmethod
    @_host_forward
    def forward(ctx, op_type: str, attrs: tuple, *tensors):
        outs = tuple(_walk_rays(op_type, attrs, tensors))
        ctx.mark_non_differentiable(*outs)
        return outs

    @staticmethod
    def symbolic(g, op_type, attrs, *tensors):
        from torch.onnx import symbolic_helper

        kwargs = {f"{k}_f" if isinstance(v, float) else f"{k}_i": v for k, v in attrs}
        outs = g.op(f"{schema.DOMAIN}::{op_type}", *tensors, outputs=len(schema.RAY_OUTPUTS[op_type]), **kwargs)
        outs = outs if len(schema.RAY_OUTPUTS[op_type]) > 1 else (outs,)  # (g.op gives one output bare)
        origins = tensors[len(schema.BUNDLE)]
        ins = [None] * len(schema.BUNDLE) + [(1, symbolic_helper._get_tensor_sizes(origins))]
        for out, (elem, dims) in zip(outs, schema.ray_rule(op_type, ins + [None] * (len(tensors) - len(ins)),
                                                           dict(attrs))):
            sizes = [d if isinstance(d, int) else None for d in dims]  # the run-time rows stay unknown
            out.setType(origins.type().with_dtype(_TORCH_OF[elem]).with_sizes(sizes))
        return outs


def _walk_rays(op_type: str, attrs: tuple, tensors) -> list[torch.Tensor]:
    """Return the ray op's outputs on the rays' device: the op compiled as a one-node luisaml network
    on the process's device (kept for the next call of the same types), so eager torch and an
    exported, compiled model walk with the same code. Rays on CUDA with luisaml on CUDA stay there:
    the network reads the tensors and writes its outputs in place (DLPack; the grid's bytes are read
    on the host for its metadata, and the read-back of the row count is the only other round trip).
    Otherwise the walk runs on host copies and its outputs are moved to the rays' device."""
    import onnx
    from onnx import helper

    from ..dtypes import from_numpy
    from ..runtime import compile as compile_model

    names = schema.OPS[op_type].input_names()
    rays = tensors[len(schema.BUNDLE)]
    np_types = [torch.empty((), dtype=t.dtype).numpy().dtype for t in tensors]
    key = (op_type, attrs, tuple((d.str, tuple(t.shape)) for d, t in zip(np_types, tensors)))
    net = _RAY_NETS.get(key)
    if net is None:
        ins = [helper.make_tensor_value_info(n, from_numpy(d).onnx, list(t.shape))
               for n, d, t in zip(names, np_types, tensors)]
        outs = list(schema.RAY_OUTPUTS[op_type])
        node = helper.make_node(op_type, names, outs, name=op_type, domain=schema.DOMAIN, **dict(attrs))
        m = helper.make_model(helper.make_graph([node], op_type, ins, []),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
        types = {v.name: v for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
        m.graph.output.extend([types[o] for o in outs])
        net = _RAY_NETS[key] = compile_model(m, batch_axis=None)
        while len(_RAY_NETS) > _RAY_NETS_KEPT:
            _RAY_NETS.popitem(last=False)
    if rays.is_cuda and net.backend == "cuda":
        out = net.run({n: t.detach().to(rays.device) for n, t in zip(names, tensors)})
        return [out[o] for o in schema.RAY_OUTPUTS[op_type]]
    arrays = [np.ascontiguousarray(t.detach().cpu().numpy()) for t in tensors]
    out = net.run(dict(zip(names, arrays)))
    return [torch.from_numpy(np.array(out[o])).to(rays.device) for o in schema.RAY_OUTPUTS[op_type]]


def voxels_along_rays(bundle, ray_origins, ray_directions, max_voxels: int = -1, eps: float = 0.0,
                      return_ijk: bool = True, cumulative: bool = False) -> tuple[torch.Tensor, ...]:
    """fVDB voxels_along_rays: (voxels int32 [M, 3] ijk or [M] indices, times [M, 2], joffsets int64
    [R+1], jidx int32 [M], jlidx int32 [R, 2]), a JaggedTensor of ldim 2 (grid -> ray); not
    differentiable. Rays: world-space JaggedTensors (a tensor per grid) or their four tensors."""
    attrs = (("max_voxels", int(max_voxels)), ("return_ijk", int(bool(return_ijk))),
             ("cumulative", int(bool(cumulative))), ("eps", float(eps)))
    return _RayFn.apply("VoxelsAlongRays", attrs,
                        *_args(bundle, _rays(ray_origins), _rays(ray_directions)))


def _rays(rays) -> tuple:
    """The four tensors of a JaggedTensor of rays, or the (jdata, joffsets, jidx, jlidx) given."""
    return jagged_tensors(rays) if isinstance(rays, JaggedTensor) else tuple(rays)


def segments_along_rays(bundle, ray_origins, ray_directions, max_segments: int = -1,
                        eps: float = 0.0) -> tuple[torch.Tensor, ...]:
    """fVDB segments_along_rays: (segments [M, 2], joffsets int64 [R+1], jidx int32 [M], jlidx int32
    [R, 2]): runs of active voxels along each ray as [t0, t1]; not differentiable."""
    attrs = (("max_segments", int(max_segments)), ("eps", float(eps)))
    return _RayFn.apply("SegmentsAlongRays", attrs, *_args(bundle, _rays(ray_origins), _rays(ray_directions)))


def _per_ray(t, rays: tuple) -> tuple:
    """The four tensors of a per-ray value: a JaggedTensor or its four tensors, or a tensor [R] laid out as the rays."""
    if isinstance(t, JaggedTensor):
        return jagged_tensors(t)
    if isinstance(t, (tuple, list)):
        return tuple(t)
    return (torch.as_tensor(t, dtype=rays[0].dtype),) + tuple(rays[1:])


def uniform_ray_samples(bundle, ray_origins, ray_directions, t_min, t_max, step_size: float, cone_angle: float = 0.0,
                        include_end_segments: bool = True, return_midpoints: bool = False,
                        eps: float = 0.0) -> tuple[torch.Tensor, ...]:
    """fVDB uniform_ray_samples: (samples [M, 2] ([t0, t1]) or [M] midpoints, joffsets int64 [R+1], jidx int32
    [M], jlidx int32 [R, 2]): samples every step_size (growing as t * cone_angle) along the runs of active
    voxels of each ray within its [t_min, t_max] (per-ray tensors [R] or JaggedTensors laid out as the rays);
    not differentiable."""
    attrs = (("step_size", float(step_size)), ("cone_angle", float(cone_angle)),
             ("include_end_segments", int(bool(include_end_segments))),
             ("return_midpoints", int(bool(return_midpoints))), ("eps", float(eps)))
    o = _rays(ray_origins)
    return _RayFn.apply("UniformRaySamples", attrs,
                        *_args(bundle, o, _rays(ray_directions), _per_ray(t_min, o), _per_ray(t_max, o)))


def rays_intersect_voxels(bundle, ray_origins, ray_directions, eps: float = 0.0) -> torch.Tensor:
    """fVDB rays_intersect_voxels: bool [R], whether each ray crosses an active voxel for at least eps (the
    jdata of a JaggedTensor laid out as the rays); not differentiable."""
    (hit,) = _RayFn.apply("RaysIntersectVoxels", (("eps", float(eps)),),
                          *_args(bundle, _rays(ray_origins), _rays(ray_directions)))
    return hit


__all__ += ["rays_intersect_voxels", "segments_along_rays", "uniform_ray_samples", "voxels_along_rays"]
