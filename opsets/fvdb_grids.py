"""The `fvdb` domain's pooling and topology schemas (version 1; what they share with the rest of the
domain is in opsets/fvdb.py), registered with onnx.defs when this module is imported.

Pooling is two nodes, like the sparse convolution: a map of the grid pair (PoolingMap: coarse voxel ->
the fine voxels of its window; RefineMap: fine voxel -> its coarse parent), inputs and attributes as
SparseConvKernelMap's, then MaxPool / AvgPool / Refine(features, map) (operators/fvdb/pool.py).
Topology ops return a new GridBatch bundle; they fold on the host when their inputs are constants,
or build on the device (operators/fvdb/topology.py, operators/fvdb/topology_device.py,
luisaml/fvdb/host_steps.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx.numpy_helper
from onnx import TensorProto, defs

from .fvdb import (BUNDLE, BUNDLE_ELEM, BUNDLE_TYPES, DOMAIN, JAGGED, JAGGED_TYPES, TYPE_CONSTRAINTS, VERSION,
                   input_types, kernel_map_input_names, register_schemas, set_output)

POOL_MAP = "PoolingMap"
REFINE_MAP = "RefineMap"
POOL_OPS = {
    "MaxPool": "fVDB's max_pool over a PoolingMap: out[c] = max over the map's fine voxels of features[f], -inf "
               "where the window holds none; features [N_fine, C], output [N_coarse, C].",
    "AvgPool": "fVDB's avg_pool over a PoolingMap: out[c] = (sum over the map's fine voxels of features[f]) / "
               "(p0*p1*p2), the window's volume whatever it holds; features [N_fine, C], output [N_coarse, C].",
    "Refine": "fVDB's refine (nearest upsampling) over a RefineMap: out[f] = features[parent of f], 0 where the "
              "parent is inactive; features [N_coarse, C], output [N_fine, C].",
}
MAP_DOCS = {
    POOL_MAP: "The pooling window of every output (coarse) voxel c: int32 [N_coarse, p0*p1*p2], column t = "
              "(a*p1 + b)*p2 + c, the batch-global index of input (fine) voxel c*S + t, -1 where inactive; "
              "stride 0 means stride = pool_size (fVDB). Inputs: the fine grid's bundle (in_*), then the coarse "
              "grid's (out_*).",
    REFINE_MAP: "The coarse parent floor(f / S) of every output (fine) voxel f: int32 [N_fine, 1], its batch-global "
                "index, -1 where inactive. Inputs: the coarse grid's bundle (in_*), then the fine grid's (out_*).",
}


@dataclass(frozen=True)
class GridOpSpec:
    """A topology op: what it reads after the bundle (or instead of it), its attributes (name, type,
    default or None if required)."""

    name: str
    doc: str
    inputs: tuple[tuple[str, str, bool], ...]  # (name, type, optional)
    attributes: tuple[tuple[str, str, object], ...] = ()

    def input_names(self) -> list[str]:
        return [n for n, _, _ in self.inputs]


_B = tuple((n, t, False) for n, t in zip(BUNDLE, BUNDLE_TYPES))
_SIZES = (("voxel_sizes", "T_f64", True), ("origins", "T_f64", True))


def _jagged_in(name: str, jtype: str) -> tuple:
    return tuple((f"{name}_{p}", t or jtype, False) for p, t in zip(JAGGED, JAGGED_TYPES))


_CONV_ATTRS = (("kernel_size", "INTS", None), ("stride", "INTS", [1]))
_GRID_OPS = [
    GridOpSpec("CoarsenedGrid", "fVDB coarsened_grid: voxels floor(ijk / f); voxel size f*h, origin "
               "origin + (f - 1)*h/2.", _B, (("coarsening_factor", "INTS", None),)),
    GridOpSpec("RefinedGrid", "fVDB refined_grid: voxels c*f + [0, f)^3 of the voxels mask (bool [N], index order) "
               "keeps (all without it); voxel size h/f, origin origin - (f - 1)*(h/f)/2.",
               _B + (("mask", "tensor(bool)", True),), (("subdiv_factor", "INTS", None),)),
    GridOpSpec("DilatedGrid", "fVDB dilated_grid: `dilation` passes of 26-neighbour dilation.", _B,
               (("dilation", "INT", 1),)),
    GridOpSpec("PrunedGrid", "fVDB pruned_grid: the voxels whose mask entry (bool [N], index order) is true.",
               _B + (("mask", "tensor(bool)", False),)),
    GridOpSpec("ConvGrid", "fVDB conv_grid: every c some active f reaches through f = S*c + t - P; voxel size h*S, "
               "origin unchanged.", _B, _CONV_ATTRS),
    GridOpSpec("ConvTransposeGrid", "fVDB conv_transpose_grid: every S*c + t - P of an active c; voxel size h/S, "
               "origin unchanged.", _B, _CONV_ATTRS),
    GridOpSpec("GridBatchFromIJK", "fVDB gridbatch_from_ijk: one grid per tensor of the ijk JaggedTensor, its voxels "
               "deduplicated; voxel_sizes / origins [B, 3] or [3] (default 1 and 0).",
               _jagged_in("ijk", "T_ijk") + _SIZES),
    GridOpSpec("GridBatchFromPoints", "fVDB gridbatch_from_points: the voxels round(world_to_voxel(p)) of each "
               "tensor's points.", _jagged_in("points", "T") + _SIZES),
    GridOpSpec("GridBatchFromNearestVoxelsToPoints", "fVDB gridbatch_from_nearest_voxels_to_points: "
               "floor(world_to_voxel(p)) + {0, 1}^3 of each tensor's points.", _jagged_in("points", "T") + _SIZES),
]
GRID_OPS: dict[str, GridOpSpec] = {op.name: op for op in _GRID_OPS}
# the attribute luisaml/fvdb/host_steps.py (DeviceBuilds) sets on a topology or GridBatchFrom* node it builds
# on the device as a network of its own: the voxels or points that network takes, at most
CAPACITY = "voxel_capacity"


def pool_map_rule(op_type: str, inputs: list, attrs: dict) -> tuple[int, list | None]:
    """Return (elem_type, dims) of a PoolingMap / RefineMap: [output voxels, p0*p1*p2 or 1]."""
    if len(inputs) != 2 * len(BUNDLE):
        raise ValueError(f"fvdb.{op_type} takes {2 * len(BUNDLE)} inputs (the input grid's bundle, then the "
                         f"output grid's), got {len(inputs)}")
    taps = 1
    if op_type == POOL_MAP:
        pool = [int(k) for k in attrs.get("pool_size", ())]
        if len(pool) not in (1, 3) or min(pool) < 1:
            raise ValueError(f"pool_size must be 1 or 3 positive integers, got {pool}")
        taps = pool[0] ** 3 if len(pool) == 1 else pool[0] * pool[1] * pool[2]
    rows = attrs.get("output_voxels")
    return TensorProto.INT32, None if rows is None else [int(rows), taps]


def pool_rule(inputs: list) -> tuple[int, list | None]:
    """Return (elem_type, dims) of MaxPool / AvgPool / Refine: [map rows, features' channels]."""
    if len(inputs) != 2:
        raise ValueError(f"takes 2 inputs (features, map), got {len(inputs)}")
    feats, pmap = inputs
    elem = feats[0] if feats is not None else TensorProto.FLOAT
    if feats is None or feats[1] is None or pmap is None or pmap[1] is None:
        return elem, None
    return elem, [pmap[1][0], feats[1][1]]



def _pool_inference(op_type: str):
    def infer(ctx) -> None:
        ins = input_types(ctx)
        if op_type in POOL_OPS:
            set_output(ctx, 0, *pool_rule(ins))
            return
        attrs = {}
        a = ctx.get_attribute("output_voxels")
        if a is not None:
            attrs["output_voxels"] = a.i
        a = ctx.get_attribute("pool_size")
        if a is not None:
            attrs["pool_size"] = list(a.ints)
        pos = len(BUNDLE) + BUNDLE.index("batch_offsets")
        offsets = ctx.get_input_data(pos) if ctx.get_num_inputs() > pos else None
        if "output_voxels" not in attrs and offsets is not None and len(offsets.dims) == 1 and offsets.dims[0]:
            attrs["output_voxels"] = int(onnx.numpy_helper.to_array(offsets)[-1])
        set_output(ctx, 0, *pool_map_rule(op_type, ins, attrs))

    return infer


def _grid_inference(ctx) -> None:
    # the new grids' sizes are known once the op is evaluated (luisaml folds it); ranks here
    for k, (elem, rank) in enumerate(zip(BUNDLE_ELEM, (1, 1, 2, 2, 1, 1, 1))):
        set_output(ctx, k, elem, [None] * rank)


def _pool_schemas() -> list[defs.OpSchema]:
    S = defs.OpSchema
    f64 = [("T_f64", *TYPE_CONSTRAINTS["T_f64"])]
    out = []
    for name, attrs in ((POOL_MAP, [S.Attribute("pool_size", S.AttrType.INTS, "pool size, one or per axis"),
                                    S.Attribute("stride", onnx.helper.make_attribute("stride", [0]),
                                                "stride, one or per axis; 0 = pool_size")]),
                        (REFINE_MAP, [S.Attribute("subdiv_factor", S.AttrType.INTS, "refinement factor")])):
        types = list(BUNDLE_TYPES) * 2
        ins = [S.FormalParameter(n, t, "GridBatch bundle") for n, t in zip(kernel_map_input_names(), types)]
        attrs = attrs + [S.Attribute("output_voxels", S.AttrType.INT, "rows of the output (the output grids' "
                                     "active voxels); needed when out_batch_offsets is not a constant", required=False)]
        schema = S(name, DOMAIN, VERSION, doc=MAP_DOCS[name], inputs=ins,
                   outputs=[S.FormalParameter("map", "tensor(int32)", "input voxel indices, -1 where missing")],
                   type_constraints=f64, attributes=attrs)
        schema.set_type_and_shape_inference_function(_pool_inference(name))
        out.append(schema)
    for name, doc in POOL_OPS.items():
        ins = [S.FormalParameter("features", "T", "[N_in, C] features in linear-index order"),
               S.FormalParameter("map", "tensor(int32)", "from PoolingMap (MaxPool, AvgPool) or RefineMap (Refine)")]
        schema = S(name, DOMAIN, VERSION, doc=doc, inputs=ins, outputs=[S.FormalParameter("output", "T", "[N_out, C]")],
                   type_constraints=[("T", *TYPE_CONSTRAINTS["T"])])
        schema.set_type_and_shape_inference_function(_pool_inference(name))
        out.append(schema)
    return out


def _grid_op_schema(spec: GridOpSpec) -> defs.OpSchema:
    S = defs.OpSchema
    opt = S.FormalParameterOption.Optional
    ins = [S.FormalParameter(n, t, "", param_option=opt) if o else S.FormalParameter(n, t, "")
           for n, t, o in spec.inputs]
    out_types = [t.replace("T_f64", "tensor(double)") for t in BUNDLE_TYPES]
    outs = [S.FormalParameter(n, t, "GridBatch bundle of the new grids") for n, t in zip(BUNDLE, out_types)]
    used = {t for _, t, _ in spec.inputs}
    constraints = [(k, v[0], v[1]) for k, v in TYPE_CONSTRAINTS.items() if k in used]
    kinds = {"INTS": S.AttrType.INTS, "INT": S.AttrType.INT}
    attrs = [S.Attribute(n, kinds[kind], "") if default is None
             else S.Attribute(n, onnx.helper.make_attribute(n, default), "") for n, kind, default in spec.attributes]
    schema = S(spec.name, DOMAIN, VERSION, doc=spec.doc, inputs=ins, outputs=outs, type_constraints=constraints,
               attributes=attrs)
    schema.set_type_and_shape_inference_function(_grid_inference)
    return schema


register_schemas(_pool_schemas() + [_grid_op_schema(s) for s in _GRID_OPS])
