"""The `fvdb` operator domain (version 1): what every family of it shares (the GridBatch bundle, the
JaggedTensor parts, OpSpec, the onnx schema helpers and their registration), and the schemas of the
per-point ops, the sparse convolution and GridFromNanoVDB. The other families' schemas are beside it,
each registered with onnx.defs when its module is imported (operators/fvdb/ imports every one):
pooling and topology in opsets/fvdb_grids.py, rays in opsets/fvdb_rays.py, the sparse-to-dense step
in opsets/fvdb_dense.py.

Every op that reads a grid takes the seven GridBatch bundle tensors first (BUNDLE, in this order),
then each JaggedTensor input as its four tensors (jdata, joffsets, jidx, jlidx); a per-point op
returns the jdata of its result. Semantics are fVDB's (shared/reference/fvdb-ops.md); the
operators are in operators/fvdb/, the torch functions that export them in luisaml/fvdb/torch_ops.py.

Sparse convolution is two ops: SparseConvKernelMap (two bundles: the input grid's, then the output
grid's) builds the kernel map of a grid pair once, and SparseConv3d(features, kernel_map, weight,
bias) is the gather-GEMM every layer over that pair runs on it (luisaml/fvdb/sparse_conv.py).
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
BUNDLE_TYPES = ("tensor(uint8)", "tensor(int64)", "T_f64", "T_f64", "tensor(int32)", "tensor(int64)",
                "tensor(int32)")
JAGGED_TYPES = (None, "tensor(int64)", "tensor(int32)", "tensor(int32)")  # None: the jdata constraint
# the bundle's element types as a node that makes new grids outputs them (T_f64 as double)
BUNDLE_ELEM = (TensorProto.UINT8, TensorProto.INT64, TensorProto.DOUBLE, TensorProto.DOUBLE, TensorProto.INT32,
               TensorProto.INT64, TensorProto.INT32)


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
    OpSpec("SplatNearest", "luisaml's addition to the domain (fVDB has none): each point's value += into the voxel "
           "round(world_to_voxel(p)) (NanoVDB's round, floor(x + 0.5)) when it is active; output [total_voxels, *], "
           "zero elsewhere: a point cloud's sum by voxel (values of ones give the count, so a mean is two sums "
           "and a division).", (_POINTS, ("values", "T")), "grid_data",
           (("total_voxels", "rows of the output; needed when batch_offsets is not a constant", None),)),
]
OPS: dict[str, OpSpec] = {op.name: op for op in _OPS}
KERNEL_MAP = "SparseConvKernelMap"
KERNEL_MAP_DOC = (
    "fVDB's sparse convolution relation between an input and an output grid (the same grid count B): "
    "int32 [N_out, T], T = k0*k1*k2, row o the batch-global output voxel, column t = (a*k1 + b)*k2 + c the "
    "tap; the batch-global index of the input voxel S*o + t - P (P = floor((K-1)/2)), or with transposed=1 "
    "of the input voxel c with o = S*c + t - P; -1 where that voxel is inactive. Built once per grid pair, "
    "read by every SparseConv3d over the pair. Inputs: the input grid's bundle (in_*), then the output "
    "grid's (out_*)."
)
SPARSE_CONV = "SparseConv3d"
SPARSE_CONV_DOC = (
    "fVDB's sparse convolution over a kernel map: out[o] = bias + sum over taps t with kernel_map[o, t] >= 0 "
    "of weight[:, :, t] @ features[kernel_map[o, t]]; weight [C_out, C_in, k0, k1, k2] (k0 along x), "
    "features [N_in, C_in], output [N_out, C_out]. The transposed convolution is the same node over a "
    "transposed kernel map."
)
GRID_FROM_NANOVDB = "GridFromNanoVDB"
GRID_FROM_NANOVDB_DOC = (
    "The GridBatch bundle of the grids in a raw NanoVDB buffer (grids back to back, validated, blind data "
    "stripped): voxel sizes and origins from the grids (fVDB's load_nanovdb) unless given. Evaluated on the "
    "host: every input must be a constant."
)
TYPE_CONSTRAINTS = {
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


def kernel_map_input_names() -> list[str]:
    """Return SparseConvKernelMap's input names: the input grid's bundle, then the output grid's."""
    return [f"in_{n}" for n in BUNDLE] + [f"out_{n}" for n in BUNDLE]


def kernel_map_rule(inputs: list, attrs: dict) -> tuple[int, list | None]:
    """Return (elem_type, dims) of SparseConvKernelMap's output: [output voxels, taps], the rows
    from the output_voxels attribute or a constant out_batch_offsets (attrs["output_voxels"])."""
    if len(inputs) != 2 * len(BUNDLE):
        raise ValueError(f"fvdb.{KERNEL_MAP} takes {2 * len(BUNDLE)} inputs (the input grid's bundle, then the "
                         f"output grid's), got {len(inputs)}")
    kernel = [int(k) for k in attrs.get("kernel_size", ())]
    if len(kernel) not in (1, 3) or min(kernel) < 1:
        raise ValueError(f"kernel_size must be 1 or 3 positive integers, got {kernel}")
    taps = kernel[0] ** 3 if len(kernel) == 1 else kernel[0] * kernel[1] * kernel[2]
    rows = attrs.get("output_voxels")
    return TensorProto.INT32, None if rows is None else [int(rows), taps]


def sparse_conv_rule(inputs: list) -> tuple[int, list | None]:
    """Return (elem_type, dims) of SparseConv3d's output: [kernel_map rows, weight's C_out]."""
    if len(inputs) not in (3, 4):
        raise ValueError(f"fvdb.{SPARSE_CONV} takes 3 or 4 inputs (features, kernel_map, weight[, bias]), "
                         f"got {len(inputs)}")
    feats, kmap, weight = inputs[:3]
    elem = feats[0] if feats is not None else TensorProto.FLOAT
    if kmap is None or kmap[1] is None or weight is None or weight[1] is None:
        return elem, None
    return elem, [kmap[1][0], weight[1][0]]


def _schema(spec: OpSpec) -> defs.OpSchema:
    S = defs.OpSchema
    ins = grid_inputs(spec)
    out_type = {"IJKToIndex": "tensor(int64)", "CoordsInGrid": "tensor(bool)", "PointsInGrid": "tensor(bool)"}
    outs = [S.FormalParameter(spec.output, out_type.get(spec.name, "T"), "the result's jdata")]
    used = {t for _, t in spec.jagged} | {"T_f64"} | ({"T"} if spec.name not in out_type else set())
    constraints = [(k, v[0], v[1]) for k, v in TYPE_CONSTRAINTS.items() if k in used]
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
    out_types = [t.replace("T_f64", "tensor(double)") for t in BUNDLE_TYPES]
    outs = [S.FormalParameter(n, t, "GridBatch bundle") for n, t in zip(BUNDLE, out_types)]
    return S(GRID_FROM_NANOVDB, DOMAIN, VERSION, doc=GRID_FROM_NANOVDB_DOC, inputs=ins, outputs=outs,
             type_constraints=[("T_f64", *TYPE_CONSTRAINTS["T_f64"])])


def _kernel_map_schema() -> defs.OpSchema:
    S = defs.OpSchema
    types = list(BUNDLE_TYPES) * 2
    ins = [S.FormalParameter(n, t, "GridBatch bundle") for n, t in zip(kernel_map_input_names(), types)]
    outs = [S.FormalParameter("kernel_map", "tensor(int32)", "[N_out, T] input indices, -1 where missing")]
    attrs = [
        S.Attribute("kernel_size", S.AttrType.INTS, "kernel size, one value or one per axis (x, y, z)"),
        S.Attribute("stride", onnx.helper.make_attribute("stride", [1]), "stride, one value or one per axis"),
        S.Attribute("transposed", onnx.helper.make_attribute("transposed", 0), "1: the transposed relation"),
        S.Attribute("output_voxels", S.AttrType.INT, "rows of the output (the output grids' active voxels); "
                    "needed when out_batch_offsets is not a constant", required=False),
    ]
    schema = S(KERNEL_MAP, DOMAIN, VERSION, doc=KERNEL_MAP_DOC, inputs=ins, outputs=outs,
               type_constraints=[("T_f64", *TYPE_CONSTRAINTS["T_f64"])], attributes=attrs)
    schema.set_type_and_shape_inference_function(_onnx_inference(KERNEL_MAP))
    return schema


def _sparse_conv_schema() -> defs.OpSchema:
    S = defs.OpSchema
    opt = S.FormalParameterOption.Optional
    ins = [S.FormalParameter("features", "T", "[N_in, C_in] input voxel features in linear-index order"),
           S.FormalParameter("kernel_map", "tensor(int32)", "[N_out, T] from SparseConvKernelMap"),
           S.FormalParameter("weight", "T", "[C_out, C_in, k0, k1, k2]"),
           S.FormalParameter("bias", "T", "[C_out]", param_option=opt)]
    outs = [S.FormalParameter("output", "T", "[N_out, C_out]")]
    schema = S(SPARSE_CONV, DOMAIN, VERSION, doc=SPARSE_CONV_DOC, inputs=ins, outputs=outs,
               type_constraints=[("T", *TYPE_CONSTRAINTS["T"])])
    schema.set_type_and_shape_inference_function(_onnx_inference(SPARSE_CONV))
    return schema


def dims_of(tp: onnx.TypeProto) -> list | None:
    """Return a value type's dims (ints, symbols or None where unknown), or None without a shape."""
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tp.tensor_type.shape.dim]


def input_types(ctx) -> list:
    """Return the (elem_type, dims) of each input of a shape-inference context, None where untyped."""
    ins = []
    for k in range(ctx.get_num_inputs()):
        tp = ctx.get_input_type(k)
        ins.append(None if tp is None else (tp.tensor_type.elem_type, dims_of(tp)))
    return ins


def set_output(ctx, k: int, elem: int, dims) -> None:
    """Set output k's type in a shape-inference context: elem, and dims (ints, symbols or None) when known."""
    out = onnx.TypeProto()
    out.tensor_type.elem_type = elem
    if dims is not None:
        for d in dims:
            dim = out.tensor_type.shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif d:
                dim.dim_param = d
    ctx.set_output_type(k, out)


def grid_inputs(spec: OpSpec) -> list[defs.OpSchema.FormalParameter]:
    """Return the formal inputs of an op that reads a grid: the bundle, then each jagged input's parts."""
    S = defs.OpSchema
    ins = [S.FormalParameter(n, t, "GridBatch bundle") for n, t in zip(BUNDLE, BUNDLE_TYPES)]
    for name, jtype in spec.jagged:
        for part, t in zip(JAGGED, JAGGED_TYPES):
            ins.append(S.FormalParameter(f"{name}_{part}", t or jtype, f"JaggedTensor {name}"))
    return ins


def register_schemas(schemas: list[defs.OpSchema]) -> None:
    """Register those of the schemas onnx.defs does not hold yet (each family calls it on import)."""
    # onnx.reference builds a table of every registered schema by name when it is first imported and
    # refuses two domains with one name: fvdb.MaxPool and fvdb.AvgPool would make that import (the
    # fold pass's evaluator) fail for the rest of the process. Imported first, it sees ONNX's own only.
    import onnx.reference  # noqa: F401
    for schema in schemas:
        if not defs.has(schema.name, DOMAIN):
            defs.register_schema(schema)


def _onnx_inference(op_type: str):
    def infer(ctx) -> None:
        ins = input_types(ctx)
        attrs = {}
        for name in ("cumulative", "total_voxels", "output_voxels"):
            a = ctx.get_attribute(name)
            if a is not None:
                attrs[name] = a.i
        a = ctx.get_attribute("kernel_size")
        if a is not None:
            attrs["kernel_size"] = list(a.ints)
        # the row count from a constant batch_offsets (of the output grid for the kernel map)
        key, pos = (("output_voxels", len(BUNDLE) + BUNDLE.index("batch_offsets")) if op_type == KERNEL_MAP
                    else ("total_voxels", BUNDLE.index("batch_offsets")))
        offsets = ctx.get_input_data(pos) if ctx.get_num_inputs() > pos else None
        if key not in attrs and offsets is not None and len(offsets.dims) == 1 and offsets.dims[0]:
            attrs[key] = int(onnx.numpy_helper.to_array(offsets)[-1])
        if op_type == KERNEL_MAP:
            elem, dims = kernel_map_rule(ins, attrs)
        elif op_type == SPARSE_CONV:
            elem, dims = sparse_conv_rule(ins)
        else:
            elem, dims = output_rule(op_type, ins, attrs)[0]
        set_output(ctx, 0, elem, dims)

    return infer


def register() -> None:
    """Register this module's schemas with onnx.defs (once per process: at its import)."""
    register_schemas([_schema(s) for s in _OPS] + [_grid_from_nanovdb_schema(), _kernel_map_schema(),
                                                   _sparse_conv_schema()])


register()
