"""The `fvdb` domain's ray schemas (version 1; what they share with the rest of the domain is in
opsets/fvdb.py), registered with onnx.defs when this module is imported: VoxelsAlongRays,
SegmentsAlongRays, UniformRaySamples and RaysIntersectVoxels, whose outputs are sized at run time
(operators/fvdb/ray.py).
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, defs

from .fvdb import (BUNDLE, DOMAIN, TYPE_CONSTRAINTS, VERSION, OpSpec, grid_inputs, input_types, register_schemas,
                   set_output)

VOXELS_ALONG_RAYS = "VoxelsAlongRays"
SEGMENTS_ALONG_RAYS = "SegmentsAlongRays"
_RAYS = (("ray_origins", "T"), ("ray_directions", "T"))
RAY_ROWS = "ray_hits"  # the symbolic first dimension of the outputs sized at run time
OPS: dict[str, OpSpec] = {}  # the ray ops (read by operators/fvdb/ray.py and luisaml/fvdb/torch_rays.py)
OPS[VOXELS_ALONG_RAYS] = OpSpec(
    VOXELS_ALONG_RAYS,
    "fVDB voxels_along_rays: each ray (world space, through the grid of its jidx) mapped by the dual "
    "transform, clipped to the grid's bounding box and walked by NanoVDB's hierarchical DDA; every active "
    "voxel it crosses with [t0, t1] (world-ray times), hits shorter than eps dropped, consecutive repeats of "
    "a voxel merged, at most max_voxels per ray (-1: all). Outputs: a JaggedTensor of ldim 2 (grid -> ray): "
    "voxels (int32 [M, 3] ijk, or [M] indices with return_ijk=0, plus the grid's batch offset when "
    "cumulative), times [M, 2], joffsets int64 [R+1], jidx int32 [M] (the ray of each row), jlidx int32 "
    "[R, 2] (grid, ray in grid). M is known only at run time.",
    _RAYS, "voxels",
    (("max_voxels", "most voxels per ray; -1: no limit", -1),
     ("return_ijk", "1: ijk per hit; 0: the voxel's index", 1),
     ("cumulative", "with return_ijk=0, add the grid's batch offset to the indices", 0)))
OPS[SEGMENTS_ALONG_RAYS] = OpSpec(
    SEGMENTS_ALONG_RAYS,
    "fVDB segments_along_rays: the same walk as VoxelsAlongRays, runs of consecutive active voxels merged "
    "into [t0, t1] spans; spans shorter than eps dropped, at most max_segments per ray (-1: all). Outputs: "
    "segments [M, 2], joffsets int64 [R+1], jidx int32 [M], jlidx int32 [R, 2] (ldim 2: grid -> ray).",
    _RAYS, "segments",
    (("max_segments", "most segments per ray; -1: no limit", -1),))
UNIFORM_RAY_SAMPLES = "UniformRaySamples"
RAYS_INTERSECT_VOXELS = "RaysIntersectVoxels"
OPS[UNIFORM_RAY_SAMPLES] = OpSpec(
    UNIFORM_RAY_SAMPLES,
    "fVDB uniform_ray_samples (ops/SampleRaysUniform.cu): each ray, with its own [t_min, t_max], walked as "
    "SegmentsAlongRays over that span (segments shorter than eps skipped); samples on the ray's own grid "
    "t_min + k * dt, dt = clamp(t * cone_angle, step_size, 1e10) re-evaluated at each sample start (cone_angle "
    "0: a constant step). include_end_segments=1: each segment is cut by the grid points inside it, the first "
    "and last pieces kept when longer than 1e-5 (NanoVDB's Delta), a segment no grid point falls into is one "
    "sample; include_end_segments=0: the whole steps whose midpoint lies in [t0, t1) of the segment. Outputs: "
    "samples [M, 2] ([t0, t1]) or [M] midpoints with return_midpoints=1, joffsets int64 [R+1], jidx int32 [M], "
    "jlidx int32 [R, 2] (ldim 2: grid -> ray). M is known only at run time. Differences from fVDB on purpose: "
    "the row count is the number of samples the walk writes (with include_end_segments=1 fVDB's count pass "
    "moves to a segment with floor where its fill moves with ceil, so its counts can disagree with its rows); "
    "a ray whose t_min is not finite or whose t_max is NaN has no samples; "
    "a step too small to advance a ray's float32 time flags a run-time error (fVDB loops forever); a "
    "step_size or cone_angle below float32's smallest normal number (which the device flushes to zero) is "
    "refused when compiled.",
    _RAYS + (("t_min", "T"), ("t_max", "T")), "samples",
    (("step_size", "the smallest step (fVDB's min_step_size); > 0, required", None),
     ("cone_angle", "the step grows as t * cone_angle (radians); >= 0", 0.0),
     ("include_end_segments", "1: keep the partial steps at the ends of each segment", 1),
     ("return_midpoints", "1: one midpoint per sample instead of [t0, t1]", 0)))
OPS[RAYS_INTERSECT_VOXELS] = OpSpec(
    RAYS_INTERSECT_VOXELS,
    "fVDB rays_intersect_voxels (GridBatch.rays_intersect_voxels: voxels_along_rays with max_voxels=1): whether "
    "each ray's walk, as VoxelsAlongRays, crosses an active voxel for at least eps. Output: bool [R], the jdata "
    "of a JaggedTensor laid out as ray_origins (fVDB's ray_origins.jagged_like; ldim 1, not 2).",
    _RAYS, "hit")
RAY_OUTPUTS = {
    VOXELS_ALONG_RAYS: ("voxels", "times", "joffsets", "jidx", "jlidx"),
    SEGMENTS_ALONG_RAYS: ("segments", "joffsets", "jidx", "jlidx"),
    UNIFORM_RAY_SAMPLES: ("samples", "joffsets", "jidx", "jlidx"),
    RAYS_INTERSECT_VOXELS: ("hit",),
}
RAY_REQUIRED = {"step_size"}  # attributes without a default (fVDB's uniform_ray_samples has none for step_size)


def ray_rule(op_type: str, inputs: list, attrs: dict) -> list[tuple[int, list | None]]:
    """Return [(elem_type, dims)] of a ray op's outputs: the rows sized at run time are RAY_ROWS, the
    rays R the rows of ray_origins' jdata."""
    want = len(OPS[op_type].input_names())
    if len(inputs) != want:
        raise ValueError(f"fvdb.{op_type} takes {want} inputs ({', '.join(OPS[op_type].input_names())}), "
                         f"got {len(inputs)}")
    origins = inputs[len(BUNDLE)]
    rays = None if origins is None or origins[1] is None else origins[1][0]
    elem = origins[0] if origins is not None else TensorProto.FLOAT
    plus_one = rays + 1 if isinstance(rays, int) else None
    jagged = [(TensorProto.INT64, [plus_one]), (TensorProto.INT32, [RAY_ROWS]), (TensorProto.INT32, [rays, 2])]
    if op_type == SEGMENTS_ALONG_RAYS:
        return [(elem, [RAY_ROWS, 2])] + jagged
    if op_type == UNIFORM_RAY_SAMPLES:
        return [(elem, [RAY_ROWS] if int(attrs.get("return_midpoints", 0)) else [RAY_ROWS, 2])] + jagged
    if op_type == RAYS_INTERSECT_VOXELS:
        return [(TensorProto.BOOL, [rays])]
    voxels = [RAY_ROWS, 3] if int(attrs.get("return_ijk", 1)) else [RAY_ROWS]
    return [(TensorProto.INT32, voxels), (elem, [RAY_ROWS, 2])] + jagged


def _ray_schema(op_type: str) -> defs.OpSchema:
    S = defs.OpSchema
    spec = OPS[op_type]
    ins = grid_inputs(spec)
    types = {"voxels": "tensor(int32)", "times": "T", "segments": "T", "samples": "T", "joffsets": "tensor(int64)",
             "jidx": "tensor(int32)", "jlidx": "tensor(int32)", "hit": "tensor(bool)"}
    outs = [S.FormalParameter(n, types[n], "the result JaggedTensor's " + n) for n in RAY_OUTPUTS[op_type]]
    attrs = [S.Attribute(n, S.AttrType.FLOAT, doc, required=True) if n in RAY_REQUIRED
             else S.Attribute(n, onnx.helper.make_attribute(n, default), doc) for n, doc, default in spec.attributes]
    attrs.append(S.Attribute("eps", onnx.helper.make_attribute("eps", 0.0), "drop hits shorter than this (time)"))
    schema = S(op_type, DOMAIN, VERSION, doc=spec.doc, inputs=ins, outputs=outs,
               type_constraints=[(k, *TYPE_CONSTRAINTS[k]) for k in ("T", "T_f64")], attributes=attrs)

    def infer(ctx) -> None:
        ins_ = input_types(ctx)
        flags = {}
        for name in ("return_ijk", "return_midpoints"):
            a = ctx.get_attribute(name)
            if a is not None:
                flags[name] = a.i
        for k, (elem, dims) in enumerate(ray_rule(op_type, ins_, flags)):
            set_output(ctx, k, elem, dims)

    schema.set_type_and_shape_inference_function(infer)
    return schema


register_schemas([_ray_schema(op_type) for op_type in RAY_OUTPUTS])
