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

The functions live by family beside this module (torch_points.py: queries, transforms, samplers
and splats; torch_conv.py: sparse convolution; torch_topology.py: pooling and new grids;
torch_rays.py: rays; torch_common.py what they share); this module is the one to import, but for
the sparse-to-dense step (torch_dense.py, imported on its own).

Lookups run on the host (luisaml.fvdb's reader, checked against warp) with the grids parsed and
validated once per bundle; the arithmetic is fVDB's float32 arithmetic, so these functions and the
compiled kernels agree to the last bit where the kernel runs the same operations.
"""
from __future__ import annotations

import warnings

import torch

from ..opsets import fvdb as schema
from .torch_common import bundle_tensors, jagged_tensors
from .torch_conv import SparseConv3d, sparse_conv3d, sparse_conv_kernel_map
from .torch_points import (coords_in_grid, ijk_to_index, points_in_grid, sample_bezier, sample_trilinear,
                           splat_bezier, splat_nearest, splat_trilinear, voxel_to_world, world_to_voxel)
from .torch_rays import rays_intersect_voxels, segments_along_rays, uniform_ray_samples, voxels_along_rays
from .torch_topology import (avg_pool, coarsened_grid, conv_grid, conv_transpose_grid, dilated_grid,
                             gridbatch_from_ijk, gridbatch_from_nearest_voxels_to_points, gridbatch_from_points,
                             max_pool, pool_over_map, pooling_map, pruned_grid, refine, refine_map, refined_grid)


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


__all__ = [
    # the arguments and the export
    "bundle_tensors",
    "export_onnx",
    "jagged_tensors",
    # per point (torch_points.py)
    "coords_in_grid",
    "ijk_to_index",
    "points_in_grid",
    "sample_bezier",
    "sample_trilinear",
    "splat_bezier",
    "splat_nearest",
    "splat_trilinear",
    "voxel_to_world",
    "world_to_voxel",
    # sparse convolution (torch_conv.py)
    "SparseConv3d",
    "sparse_conv3d",
    "sparse_conv_kernel_map",
    # pooling and new grids (torch_topology.py)
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
    # rays (torch_rays.py)
    "rays_intersect_voxels",
    "segments_along_rays",
    "uniform_ray_samples",
    "voxels_along_rays",
]
