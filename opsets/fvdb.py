"""The `fvdb` operator domain (version 1): schemas, output type rules, and their registration with
onnx.defs so that onnx's checker and shape inference accept fvdb.* nodes.

Every op that reads a grid takes the seven GridBatch bundle tensors first (BUNDLE, in this order),
then each JaggedTensor input as its four tensors (jdata, joffsets, jidx, jlidx); a per-point op
returns the jdata of its result. Semantics are fVDB's (shared/reference/fvdb-ops.md); the
operators are in operators/fvdb/, the torch functions that export them in luisaml/fvdb/torch_ops.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx.numpy_helper
from onnx import TensorProto, defs

DOMAIN = "fvdb"
VERSION = 1

BUNDLE = ("grid_blob", "grid_byte_offsets", "voxel_sizes", "origins", "leaf_batch_indices", "batch_offsets",
          "list_indices")
JAGGED = ("jdata", "joffsets", "jidx", "jlidx")
_BUNDLE_TYPES = ("tensor(uint8)", "tensor(int64)", "T_f64", "T_f64", "tensor(int32)", "tensor(int64)",
                 "tensor(int32)")
_JAGGED_TYPES = (None, "tensor(int64)", "tensor(int32)", "tensor(int32)")  # None: the jdata constraint


@dataclass(frozen=True)
class OpSpec:
    """One op of the domain: its jagged inputs (name, jdata type constraint) and output rule."""

    name: str
    doc: str
    jagged: tuple[tuple[str, str], ...]
    output: str  # output name
    attributes: tuple[tuple[str, str, object], ...] = ()  # (name, doc, default or None if optional)

    def input_names(self) -> list[str]:
        """Return the op's input names in order: the bundle, then each jagged input's four tensors."""
        return list(BUNDLE) + [f"{j}_{part}" for j, _ in self.jagged for part in JAGGED]


_POINTS = ("points", "T")
_OPS = [
    OpSpec("IJKToIndex", "fVDB ijk_to_index: the int64 index of each ijk in its grid (getValue - 1, plus the "
           "grid's batch offset when cumulative), -1 where the voxel is inactive.", (("ijk", "T_ijk"),), "index",
           (("cumulative", "add batch_offsets[b] to the indices of grid b", 0),)),
    OpSpec("CoordsInGrid", "fVDB coords_in_grid: whether each integer ijk is an active voxel of its grid.",
           (("ijk", "T_ijk"),), "mask"),
    OpSpec("PointsInGrid", "fVDB points_in_grid: whether round(world_to_voxel(p)) is an active voxel.",
           (_POINTS,), "mask"),
    OpSpec("VoxelToWorld", "fVDB voxel_to_world (primal): (ijk - t) / s with fVDB's float32 transform "
           "s = 1/voxel_size, t = -origin/voxel_size.", (("ijk", "T"),), "xyz"),
    OpSpec("WorldToVoxel", "fVDB world_to_voxel (primal): xyz * s + t.", (_POINTS,), "ijk"),
    OpSpec("SampleTrilinear", "fVDB sample_trilinear: the 8 voxels around world_to_voxel(p) in fVDB's corner "
           "order, inactive ones weighing 0 with no renormalisation; 0 where none is active.",
           (_POINTS, ("data", "T")), "features"),
    OpSpec("SampleBezier", "fVDB sample_bezier: the 27 voxels around round(world_to_voxel(p)), weighted by "
           "fVDB's quadratic Bezier kernel (weights sum to 8); inactive voxels are skipped.",
           (_POINTS, ("data", "T")), "features"),
    OpSpec("SplatTrilinear", "fVDB splat_trilinear: each active corner of each point gets += w * value; "
           "output [total_voxels, *], zero elsewhere.", (_POINTS, ("values", "T")), "grid_data",
           (("total_voxels", "rows of the output (the batch's active voxels); needed when batch_offsets is "
             "not a constant", None),)),
    OpSpec("SplatBezier", "fVDB splat_bezier: the adjoint of SampleBezier, += w * value into [total_voxels, *].",
           (_POINTS, ("values", "T")), "grid_data",
           (("total_voxels", "rows of the output; needed when batch_offsets is not a constant", None),)),
]
OPS: dict[str, OpSpec] = {op.name: op for op in _OPS}
GRID_FROM_NANOVDB = "GridFromNanoVDB"
GRID_FROM_NANOVDB_DOC = (
    "The GridBatch bundle of the grids in a raw NanoVDB buffer (grids back to back, validated, blind data "
    "stripped): voxel sizes and origins from the grids (fVDB's load_nanovdb) unless given. Evaluated on the "
    "host: every input must be a constant."
)
_TYPE_CONSTRAINTS = {
    "T": (["tensor(float)"], "point coordinates and features (float32)"),
    "T_ijk": (["tensor(int32)", "tensor(int64)"], "integer voxel coordinates"),
    "T_f64": (["tensor(double)", "tensor(float)"], "voxel sizes and origins"),
}


def output_rule(op_type: str, inputs: list, attrs: dict) -> list[tuple[int, list | None]]:
    """Return [(elem_type, dims)] of an op's output from its inputs' (elem_type, dims) (None where
    unknown; dims hold ints, or strings for symbolic dims). Raises ValueError on a bad signature."""
    spec = OPS[op_type]
    want = len(spec.input_names())
    if len(inputs) != want:
        raise ValueError(f"fvdb.{op_type} takes {want} inputs ({', '.join(spec.input_names())}), got {len(inputs)}")
    first = inputs[len(BUNDLE)]  # the first jagged input's jdata
    rows = None if first is None or first[1] is None else list(first[1][:1])
    if op_type == "IJKToIndex":
        return [(TensorProto.INT64, rows)]
    if op_type in ("CoordsInGrid", "PointsInGrid"):
        return [(TensorProto.BOOL, rows)]
    if op_type in ("VoxelToWorld", "WorldToVoxel"):
        return [(first[0], None if rows is None else rows + [3])]
    second = inputs[len(BUNDLE) + len(JAGGED)]
    trailing = None if second is None or second[1] is None else list(second[1][1:])
    elem = second[0] if second is not None else TensorProto.FLOAT
    if op_type.startswith("Sample"):
        return [(elem, None if rows is None or trailing is None else rows + trailing)]
    total = attrs.get("total_voxels")
    return [(elem, None if total is None or trailing is None else [int(total)] + trailing)]


def _schema(spec: OpSpec) -> defs.OpSchema:
    S = defs.OpSchema
    ins = [S.FormalParameter(n, t, "GridBatch bundle") for n, t in zip(BUNDLE, _BUNDLE_TYPES)]
    for name, jtype in spec.jagged:
        for part, t in zip(JAGGED, _JAGGED_TYPES):
            ins.append(S.FormalParameter(f"{name}_{part}", t or jtype, f"JaggedTensor {name}"))
    out_type = {"IJKToIndex": "tensor(int64)", "CoordsInGrid": "tensor(bool)", "PointsInGrid": "tensor(bool)"}
    outs = [S.FormalParameter(spec.output, out_type.get(spec.name, "T"), "the result's jdata")]
    used = {t for _, t in spec.jagged} | {"T_f64"} | ({"T"} if spec.name not in out_type else set())
    constraints = [(k, v[0], v[1]) for k, v in _TYPE_CONSTRAINTS.items() if k in used]
    attrs = [
        S.Attribute(n, onnx.helper.make_attribute(n, default), doc) if default is not None
        else S.Attribute(n, S.AttrType.INT, doc, required=False)
        for n, doc, default in spec.attributes
    ]
    schema = S(spec.name, DOMAIN, VERSION, doc=spec.doc, inputs=ins, outputs=outs, type_constraints=constraints,
               attributes=attrs)
    schema.set_type_and_shape_inference_function(_onnx_inference(spec.name))
    return schema


def _grid_from_nanovdb_schema() -> defs.OpSchema:
    S = defs.OpSchema
    opt = S.FormalParameterOption.Optional
    ins = [S.FormalParameter("grid_blob_in", "tensor(uint8)", "raw NanoVDB buffer"),
           S.FormalParameter("voxel_sizes_in", "T_f64", "[B,3] voxel sizes", param_option=opt),
           S.FormalParameter("origins_in", "T_f64", "[B,3] world centres of voxel (0,0,0)", param_option=opt)]
    out_types = [t.replace("T_f64", "tensor(double)") for t in _BUNDLE_TYPES]
    outs = [S.FormalParameter(n, t, "GridBatch bundle") for n, t in zip(BUNDLE, out_types)]
    return S(GRID_FROM_NANOVDB, DOMAIN, VERSION, doc=GRID_FROM_NANOVDB_DOC, inputs=ins, outputs=outs,
             type_constraints=[("T_f64", *_TYPE_CONSTRAINTS["T_f64"])])


def _dims_of(tp: onnx.TypeProto) -> list | None:
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tp.tensor_type.shape.dim]


def _onnx_inference(op_type: str):
    def infer(ctx) -> None:
        ins = []
        for k in range(ctx.get_num_inputs()):
            tp = ctx.get_input_type(k)
            ins.append(None if tp is None else (tp.tensor_type.elem_type, _dims_of(tp)))
        attrs = {}
        for name in ("cumulative", "total_voxels"):
            a = ctx.get_attribute(name)
            if a is not None:
                attrs[name] = a.i
        offsets = ctx.get_input_data(BUNDLE.index("batch_offsets")) if ctx.get_num_inputs() > 5 else None
        if "total_voxels" not in attrs and offsets is not None and len(offsets.dims) == 1 and offsets.dims[0]:
            attrs["total_voxels"] = int(onnx.numpy_helper.to_array(offsets)[-1])
        elem, dims = output_rule(op_type, ins, attrs)[0]
        out = onnx.TypeProto()
        out.tensor_type.elem_type = elem
        if dims is not None:
            shape = out.tensor_type.shape
            for d in dims:
                dim = shape.dim.add()
                if isinstance(d, int):
                    dim.dim_value = d
                elif d:
                    dim.dim_param = d
        ctx.set_output_type(0, out)

    return infer


_registered = False


def register() -> None:
    """Register the domain's schemas with onnx.defs (once per process)."""
    global _registered
    if _registered:
        return
    for schema in [_schema(s) for s in _OPS] + [_grid_from_nanovdb_schema()]:
        if not defs.has(schema.name, DOMAIN):
            defs.register_schema(schema)
    _registered = True


register()
