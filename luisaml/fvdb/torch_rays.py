"""fVDB's ray functions as torch functions (outputs sized at run time): voxels_along_rays,
segments_along_rays, uniform_ray_samples, rays_intersect_voxels; each walks with the op compiled
as a one-node luisaml network, so eager torch and a compiled model walk with the same code."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..opsets import fvdb as schema
from ..opsets import fvdb_rays as ray_schema
from .jagged import JaggedTensor
from .torch_common import flat_args, host_forward, jagged_tensors


_TORCH_OF = {1: torch.float32, 6: torch.int32, 7: torch.int64, 9: torch.bool, 11: torch.float64}  # TensorProto -> torch
_RAY_NETS: OrderedDict = OrderedDict()  # (op, attrs, input types) -> the compiled one-node network
_RAY_NETS_KEPT = 8


class _RayFn(torch.autograd.Function):
    @staticmethod
    @host_forward
    def forward(ctx, op_type: str, attrs: tuple, *tensors):
        outs = tuple(_walk_rays(op_type, attrs, tensors))
        ctx.mark_non_differentiable(*outs)
        return outs

    @staticmethod
    def symbolic(g, op_type, attrs, *tensors):
        from torch.onnx import symbolic_helper

        kwargs = {f"{k}_f" if isinstance(v, float) else f"{k}_i": v for k, v in attrs}
        outs = g.op(f"{schema.DOMAIN}::{op_type}", *tensors, outputs=len(ray_schema.RAY_OUTPUTS[op_type]), **kwargs)
        outs = outs if len(ray_schema.RAY_OUTPUTS[op_type]) > 1 else (outs,)  # (g.op gives one output bare)
        origins = tensors[len(schema.BUNDLE)]
        ins = [None] * len(schema.BUNDLE) + [(1, symbolic_helper._get_tensor_sizes(origins))]
        for out, (elem, dims) in zip(outs, ray_schema.ray_rule(op_type, ins + [None] * (len(tensors) - len(ins)),
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

    names = ray_schema.OPS[op_type].input_names()
    rays = tensors[len(schema.BUNDLE)]
    np_types = [torch.empty((), dtype=t.dtype).numpy().dtype for t in tensors]
    key = (op_type, attrs, tuple((d.str, tuple(t.shape)) for d, t in zip(np_types, tensors)))
    net = _RAY_NETS.get(key)
    if net is None:
        ins = [helper.make_tensor_value_info(n, from_numpy(d).onnx, list(t.shape))
               for n, d, t in zip(names, np_types, tensors)]
        outs = list(ray_schema.RAY_OUTPUTS[op_type])
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
        return [out[o] for o in ray_schema.RAY_OUTPUTS[op_type]]
    arrays = [np.ascontiguousarray(t.detach().cpu().numpy()) for t in tensors]
    out = net.run(dict(zip(names, arrays)))
    return [torch.from_numpy(np.array(out[o])).to(rays.device) for o in ray_schema.RAY_OUTPUTS[op_type]]


def voxels_along_rays(bundle, ray_origins, ray_directions, max_voxels: int = -1, eps: float = 0.0,
                      return_ijk: bool = True, cumulative: bool = False) -> tuple[torch.Tensor, ...]:
    """fVDB voxels_along_rays: (voxels int32 [M, 3] ijk or [M] indices, times [M, 2], joffsets int64
    [R+1], jidx int32 [M], jlidx int32 [R, 2]), a JaggedTensor of ldim 2 (grid -> ray); not
    differentiable. Rays: world-space JaggedTensors (a tensor per grid) or their four tensors."""
    attrs = (("max_voxels", int(max_voxels)), ("return_ijk", int(bool(return_ijk))),
             ("cumulative", int(bool(cumulative))), ("eps", float(eps)))
    return _RayFn.apply("VoxelsAlongRays", attrs,
                        *flat_args(bundle, _rays(ray_origins), _rays(ray_directions)))


def _rays(rays) -> tuple:
    """The four tensors of a JaggedTensor of rays, or the (jdata, joffsets, jidx, jlidx) given."""
    return jagged_tensors(rays) if isinstance(rays, JaggedTensor) else tuple(rays)


def segments_along_rays(bundle, ray_origins, ray_directions, max_segments: int = -1,
                        eps: float = 0.0) -> tuple[torch.Tensor, ...]:
    """fVDB segments_along_rays: (segments [M, 2], joffsets int64 [R+1], jidx int32 [M], jlidx int32
    [R, 2]): runs of active voxels along each ray as [t0, t1]; not differentiable."""
    attrs = (("max_segments", int(max_segments)), ("eps", float(eps)))
    return _RayFn.apply("SegmentsAlongRays", attrs, *flat_args(bundle, _rays(ray_origins), _rays(ray_directions)))


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
                        *flat_args(bundle, o, _rays(ray_directions), _per_ray(t_min, o), _per_ray(t_max, o)))


def rays_intersect_voxels(bundle, ray_origins, ray_directions, eps: float = 0.0) -> torch.Tensor:
    """fVDB rays_intersect_voxels: bool [R], whether each ray crosses an active voxel for at least eps (the
    jdata of a JaggedTensor laid out as the rays); not differentiable."""
    (hit,) = _RayFn.apply("RaysIntersectVoxels", (("eps", float(eps)),),
                          *flat_args(bundle, _rays(ray_origins), _rays(ray_directions)))
    return hit
