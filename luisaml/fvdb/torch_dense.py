"""fVDB's sparse-to-dense step as a torch function that exports to an ``fvdb.InjectToDense`` node:
inject_to_dense(bundle, data, min_coord, grid_size, layout) (opsets/fvdb_dense.py; the kernel is
operators/fvdb/dense.py). Semantics are fVDB's inject_to_dense_cmajor: grid b's voxel features go
to the cell ijk - min_coord[b] of a [B, C, X, Y, Z] box, zeros elsewhere, voxels outside the box
dropped; layout "CZYX" is [B, C, Z, Y, X] (fVDB's write_to_dense_czyx, spconv's dense() order) and
"BEV" [B, C*Z, Y, X] with channel c*Z + z, the bird's-eye view a CenterPoint head reads.

    bev = inject_to_dense(bundle, features, min_coord=(0, -64, -4), grid_size=(128, 128, 8), layout="BEV")
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..opsets import fvdb as schema
from ..opsets import fvdb_dense as dense_schema
from .nanovdb_query import active_voxels
from .torch_common import export_node, flat_args, grids_of, host_forward, rows_of, trailing_sizes

__all__ = ["inject_to_dense", "dense_positions"]


def _box(min_coord, grid_size, grids: int) -> tuple[tuple[int, ...], tuple[int, int, int]]:
    lo = tuple(int(v) for v in np.asarray(min_coord, np.int64).reshape(-1))
    size = tuple(int(v) for v in np.asarray(grid_size, np.int64).reshape(-1))
    if len(size) != 3 or min(size) < 1:
        raise ValueError(f"grid_size must be 3 positive ints (x, y, z), got {list(size)}")
    if len(lo) not in (3, 3 * grids):
        raise ValueError(f"min_coord must be 3 ints or 3 per grid ({3 * grids}), got {list(lo)}")
    return lo, size


def dense_positions(bundle, min_coord, grid_size, layout: str = "CXYZ") -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rows, cells) int64: the batch-global voxel rows inside each grid's box and the flat
    index (b*C + 0) * cells + cell of their channel-0 output (channel c adds c * cells, C the
    channels); voxels outside the box are left out."""
    if layout not in dense_schema.DENSE_LAYOUTS:
        raise ValueError(f"layout must be one of {dense_schema.DENSE_LAYOUTS}, got {layout!r}")
    g = grids_of(tuple(bundle))
    B = len(g.index)
    lo, (X, Y, Z) = _box(min_coord, grid_size, B)
    corners = np.array(lo * (B if len(lo) == 3 else 1), np.int64).reshape(B, 3)
    rows, cells, grid_of = [], [], []
    for b, index in enumerate(g.index):
        ijk = (active_voxels(index.grid).astype(np.int64) if index.grid.voxel_count
               else np.zeros((0, 3), np.int64)) - corners[b]  # index order
        inside = ((ijk >= 0) & (ijk < [X, Y, Z])).all(1)
        x, y, z = ijk[inside].T
        rows.append(np.flatnonzero(inside) + g.voxel_offsets[b])
        cells.append((x * Y + y) * Z + z if layout == "CXYZ" else (z * Y + y) * X + x)
        grid_of.append(np.full(int(inside.sum()), b, np.int64))
    return (torch.from_numpy(np.concatenate(rows).astype(np.int64)),
            torch.from_numpy(np.concatenate(cells).astype(np.int64)),
            torch.from_numpy(np.concatenate(grid_of)))


class _InjectToDense(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, min_coord: tuple, grid_size: tuple, layout: str, *tensors):
        bundle, data = tensors[:7], tensors[7]
        g = grids_of(bundle)
        if data.dtype != torch.float32 or data.dim() != 2 or data.shape[0] != g.total_voxels:
            raise ValueError(f"data must be float32 [N, C] with a row per active voxel ({g.total_voxels}), got "
                             f"{data.dtype} {list(data.shape)}")
        rows, cells, grids = dense_positions(bundle, min_coord, grid_size, layout)
        B, C, n = len(g.index), data.shape[1], int(np.prod(grid_size))
        out = torch.zeros(B * C * n, dtype=data.dtype)
        # channel c of (b, cell) at (b*C + c)*n + cell
        at = (grids * C)[:, None] * n + torch.arange(C)[None, :] * n + cells[:, None]
        out[at.reshape(-1)] = data[rows].reshape(-1)
        ctx.save_for_backward(rows, at)
        ctx.rows_in = data.shape[0]
        return out.reshape(_shape(B, C, grid_size, layout))

    @staticmethod
    def backward(ctx, grad):
        rows, at = ctx.saved_tensors
        grad_data = torch.zeros((ctx.rows_in, at.shape[1]), dtype=grad.dtype)
        grad_data[rows] = grad.reshape(-1)[at]
        return (None,) * 10 + (grad_data, None, None, None)

    @staticmethod
    def symbolic(g, min_coord, grid_size, layout, *tensors):
        sizes = _shape(rows_of(tensors[1]), (trailing_sizes(tensors[7]) or [None])[0], grid_size, layout)
        return export_node(g, dense_schema.INJECT_TO_DENSE, tensors, tensors[7], sizes, min_coord_i=list(min_coord),
                           grid_size_i=list(grid_size), layout_s=layout)


def _shape(B, C, grid_size, layout: str) -> list:
    X, Y, Z = grid_size
    return {"CXYZ": [B, C, X, Y, Z], "CZYX": [B, C, Z, Y, X],
            "BEV": [B, None if C is None else C * Z, Y, X]}[layout]


def inject_to_dense(bundle, data, min_coord, grid_size, layout: str = "CXYZ") -> torch.Tensor:
    """fVDB inject_to_dense_cmajor: the voxel features data [N, C] (a tensor, or a JaggedTensor's four
    tensors) of each grid b in the dense box min_coord[b] + [0, grid_size), zeros elsewhere, voxels
    outside dropped: [B, C, X, Y, Z] (layout "CXYZ"), [B, C, Z, Y, X] ("CZYX") or [B, C*Z, Y, X] with
    channel c*Z + z ("BEV"); min_coord: 3 ints or [B, 3]. Differentiable in data."""
    if layout not in dense_schema.DENSE_LAYOUTS:
        raise ValueError(f"layout must be one of {dense_schema.DENSE_LAYOUTS}, got {layout!r}")
    bundle = tuple(bundle)
    if isinstance(data, torch.Tensor):
        # the grid gives each voxel's row, so jidx is not read: the data's offsets are the grids'
        data = (data, bundle[5], torch.zeros(0, dtype=torch.int32), torch.zeros((0, 1), dtype=torch.int32))
    elif not isinstance(data, Sequence) or len(data) != len(schema.JAGGED):
        raise ValueError("data must be a tensor [N, C] or a JaggedTensor's four tensors (jdata, joffsets, jidx, jlidx)")
    lo, size = _box(min_coord, grid_size, bundle[1].shape[0])
    return _InjectToDense.apply(lo, size, layout, *flat_args(bundle, data))
