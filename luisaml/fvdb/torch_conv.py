"""fVDB's sparse convolution as torch functions, as fVDB's ConvolutionPlan: sparse_conv_kernel_map
once per grid pair, then sparse_conv3d per layer (gather-matmul-scatter, differentiable in features,
weight and bias), and the SparseConv3d layer."""
from __future__ import annotations

import numpy as np
import torch

from ..opsets import fvdb as schema
from .nanovdb_query import active_voxels
from .sparse_conv import conv_geometry
from .sparse_conv import kernel_map as _host_kernel_map
from .torch_common import bundle_voxels, flat_args, grids_of, host_forward, rows_of


class _KernelMap(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, kernel, stride, transposed: bool, output_voxels: int, *tensors):
        g_in, g_out = grids_of(tensors[:7]), grids_of(tensors[7:])
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
    @host_forward
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
        sizes = [rows_of(kernel_map), (symbolic_helper._get_tensor_sizes(weight) or [None])[0]]
        out.setType(features.type().with_sizes(sizes))
        return out


def sparse_conv_kernel_map(grid_in, grid_out, kernel_size, stride=1, transposed: bool = False) -> torch.Tensor:
    """fVDB's sparse convolution relation between two grid bundles (grid b with grid b): int32 [N_out,
    k0*k1*k2], the batch-global input voxel each output voxel reads at each tap (x slowest), -1 where
    inactive; transposed: the relation the other way round (opsets/fvdb.py, SparseConvKernelMap).
    Build it once per grid pair and pass it to every sparse_conv3d over that pair."""
    geo = conv_geometry(kernel_size, stride)
    args = flat_args(grid_in) + flat_args(grid_out)
    return _KernelMap.apply(geo.kernel, geo.stride, bool(transposed), bundle_voxels(args[7:]), *args)


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
