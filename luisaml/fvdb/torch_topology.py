"""fVDB's pooling and topology as torch functions. Pooling, as the sparse convolution, is a map of
the grid pair (pooling_map: each coarse voxel's window of fine voxels; refine_map: each fine voxel's
coarse parent) and a reduction over it; the gradients are torch autograd's of the gather
formulation. Topology functions return a new bundle, built on the host with the project's builder;
exported, they become fvdb.* nodes that luisaml folds when their inputs are constants (module
buffers)."""
from __future__ import annotations

import numpy as np
import torch

from ..opsets import fvdb as schema
from ..opsets import fvdb_grids as grid_schema
from .nanovdb_query import active_voxels
from .sparse_conv import kernel_map as _host_kernel_map
from .torch_common import bundle_voxels, flat_args, grids_of, host_forward, rows_of


class _PoolMap(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, op_type: str, attrs: tuple, output_voxels: int, *tensors):
        from .topology import pool_geometry, refine_parents

        g_in, g_out = grids_of(tensors[:7]), grids_of(tensors[7:])
        if len(g_in.index) != len(g_out.index):
            raise ValueError(f"the input bundle has {len(g_in.index)} grids, the output bundle {len(g_out.index)}; a "
                             "pooling map pairs grid b with grid b")

        def lookup(b, ijk):
            idx = g_in.index[b](ijk)
            return np.where(idx >= 0, idx + g_in.voxel_offsets[b], -1)

        ijk_out = [active_voxels(index.grid) if index.grid.voxel_count else np.zeros((0, 3), np.int32)
                   for index in g_out.index]
        a = dict(attrs)
        if op_type == grid_schema.POOL_MAP:
            return torch.from_numpy(_host_kernel_map(ijk_out, lookup, pool_geometry(a["pool_size"], a["stride"])))
        rows = [lookup(b, refine_parents(v, a["subdiv_factor"])) for b, v in enumerate(ijk_out)]
        return torch.from_numpy(np.concatenate(rows).astype(np.int32).reshape(-1, 1))

    @staticmethod
    def symbolic(g, op_type, attrs, output_voxels, *tensors):
        kwargs = {f"{k}_i": list(v) for k, v in attrs}
        out = g.op(f"{schema.DOMAIN}::{op_type}", *tensors, output_voxels_i=int(output_voxels), **kwargs)
        taps = int(np.prod(dict(attrs)["pool_size"])) if op_type == grid_schema.POOL_MAP else 1
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
    args = flat_args(fine) + flat_args(coarse)
    return _PoolMap.apply(grid_schema.POOL_MAP, attrs, bundle_voxels(args[7:]), *args)


def refine_map(coarse, fine, subdiv_factor) -> torch.Tensor:
    """fVDB's refine relation: int32 [N_fine, 1], the batch-global coarse voxel floor(f / S) of each
    fine voxel f, -1 where inactive. Exports to fvdb.RefineMap."""
    attrs = (("subdiv_factor", _three(subdiv_factor, "subdiv_factor")),)
    args = flat_args(coarse) + flat_args(fine)
    return _PoolMap.apply(grid_schema.REFINE_MAP, attrs, bundle_voxels(args[7:]), *args)


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
    @host_forward
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
        sizes = [rows_of(pmap), (symbolic_helper._get_tensor_sizes(features) or [None, None])[1]]
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
    if op_type not in grid_schema.POOL_OPS:
        raise ValueError(f"op_type must be one of {sorted(grid_schema.POOL_OPS)}, got {op_type!r}")
    return _PoolFn.apply(op_type, features, pmap)


class _GridFn(torch.autograd.Function):
    @staticmethod
    @host_forward
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
                     flat_args(bundle))


def refined_grid(bundle, subdiv_factor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """fVDB refined_grid: c*f + [0, f)^3 of the voxels mask (bool [N]) keeps; voxel size h/f."""
    extra = () if mask is None else (mask,)
    return _new_grid("RefinedGrid", (("subdiv_factor", _three(subdiv_factor, "subdiv_factor")),),
                     flat_args(bundle) + extra)


def dilated_grid(bundle, dilation: int = 1) -> tuple[torch.Tensor, ...]:
    """fVDB dilated_grid: `dilation` passes of 26-neighbour dilation."""
    return _new_grid("DilatedGrid", (("dilation", int(dilation)),), flat_args(bundle))


def pruned_grid(bundle, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fVDB pruned_grid: the voxels whose mask entry (bool [N], index order) is true."""
    return _new_grid("PrunedGrid", (), flat_args(bundle) + (mask,))


def conv_grid(bundle, kernel_size, stride=1) -> tuple[torch.Tensor, ...]:
    """fVDB conv_grid: the output grid of a sparse convolution (voxel size h*S, origin unchanged)."""
    attrs = (("kernel_size", _three(kernel_size, "kernel_size")), ("stride", _three(stride, "stride")))
    return _new_grid("ConvGrid", attrs, flat_args(bundle))


def conv_transpose_grid(bundle, kernel_size, stride=1) -> tuple[torch.Tensor, ...]:
    """fVDB conv_transpose_grid: the output grid of a transposed sparse convolution (voxel size h/S)."""
    attrs = (("kernel_size", _three(kernel_size, "kernel_size")), ("stride", _three(stride, "stride")))
    return _new_grid("ConvTransposeGrid", attrs, flat_args(bundle))


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
