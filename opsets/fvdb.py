"""The `fvdb` operator domain (version 1): schemas, output type rules, and their registration with
onnx.defs so that onnx's checker and shape inference accept fvdb.* nodes.

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


def _kernel_map_schema() -> defs.OpSchema:
    S = defs.OpSchema
    types = list(_BUNDLE_TYPES) * 2
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
               type_constraints=[("T_f64", *_TYPE_CONSTRAINTS["T_f64"])], attributes=attrs)
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
               type_constraints=[("T", *_TYPE_CONSTRAINTS["T"])])
    schema.set_type_and_shape_inference_function(_onnx_inference(SPARSE_CONV))
    return schema


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
        _set_output(ctx, 0, elem, dims)

    return infer


_registered = False


def register() -> None:
    """Register the domain's schemas with onnx.defs (once per process)."""
    global _registered
    if _registered:
        return
    # onnx.reference builds a table of every registered schema by name when it is first imported and
    # refuses two domains with one name: fvdb.MaxPool and fvdb.AvgPool would make that import (the
    # fold pass's evaluator) fail for the rest of the process. Imported first, it sees ONNX's own only.
    import onnx.reference  # noqa: F401
    for schema in [_schema(s) for s in _OPS] + [_grid_from_nanovdb_schema(), _kernel_map_schema(),
                                                _sparse_conv_schema()]:
        if not defs.has(schema.name, DOMAIN):
            defs.register_schema(schema)
    _registered = True


register()


# ---- pooling and topology ------------------------------------------------------------------------
# Pooling is two nodes, like the sparse convolution: a map of the grid pair (PoolingMap: coarse
# voxel -> the fine voxels of its window; RefineMap: fine voxel -> its coarse parent), inputs and
# attributes as SparseConvKernelMap's, then MaxPool / AvgPool / Refine(features, map). Topology ops
# return a new GridBatch bundle; they are evaluated on the host when the model is compiled (their
# inputs must be constants: building grids on the device needs run-time-sized outputs).

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


_B = tuple((n, t, False) for n, t in zip(BUNDLE, _BUNDLE_TYPES))
_SIZES = (("voxel_sizes", "T_f64", True), ("origins", "T_f64", True))


def _jagged_in(name: str, jtype: str) -> tuple:
    return tuple((f"{name}_{p}", t or jtype, False) for p, t in zip(JAGGED, _JAGGED_TYPES))


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
BUNDLE_ELEM = (TensorProto.UINT8, TensorProto.INT64, TensorProto.DOUBLE, TensorProto.DOUBLE, TensorProto.INT32,
               TensorProto.INT64, TensorProto.INT32)


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


def _set_output(ctx, k: int, elem: int, dims) -> None:
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


def _pool_inference(op_type: str):
    def infer(ctx) -> None:
        ins = []
        for k in range(ctx.get_num_inputs()):
            tp = ctx.get_input_type(k)
            ins.append(None if tp is None else (tp.tensor_type.elem_type, _dims_of(tp)))
        if op_type in POOL_OPS:
            _set_output(ctx, 0, *pool_rule(ins))
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
        _set_output(ctx, 0, *pool_map_rule(op_type, ins, attrs))

    return infer


def _grid_inference(ctx) -> None:
    # the new grids' sizes are known once the op is evaluated (luisaml folds it); ranks here
    for k, (elem, rank) in enumerate(zip(BUNDLE_ELEM, (1, 1, 2, 2, 1, 1, 1))):
        _set_output(ctx, k, elem, [None] * rank)


def _pool_schemas() -> list[defs.OpSchema]:
    S = defs.OpSchema
    f64 = [("T_f64", *_TYPE_CONSTRAINTS["T_f64"])]
    out = []
    for name, attrs in ((POOL_MAP, [S.Attribute("pool_size", S.AttrType.INTS, "pool size, one or per axis"),
                                    S.Attribute("stride", onnx.helper.make_attribute("stride", [0]),
                                                "stride, one or per axis; 0 = pool_size")]),
                        (REFINE_MAP, [S.Attribute("subdiv_factor", S.AttrType.INTS, "refinement factor")])):
        types = list(_BUNDLE_TYPES) * 2
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
                   type_constraints=[("T", *_TYPE_CONSTRAINTS["T"])])
        schema.set_type_and_shape_inference_function(_pool_inference(name))
        out.append(schema)
    return out


def _grid_op_schema(spec: GridOpSpec) -> defs.OpSchema:
    S = defs.OpSchema
    opt = S.FormalParameterOption.Optional
    ins = [S.FormalParameter(n, t, "", param_option=opt) if o else S.FormalParameter(n, t, "")
           for n, t, o in spec.inputs]
    out_types = [t.replace("T_f64", "tensor(double)") for t in _BUNDLE_TYPES]
    outs = [S.FormalParameter(n, t, "GridBatch bundle of the new grids") for n, t in zip(BUNDLE, out_types)]
    used = {t for _, t, _ in spec.inputs}
    constraints = [(k, v[0], v[1]) for k, v in _TYPE_CONSTRAINTS.items() if k in used]
    kinds = {"INTS": S.AttrType.INTS, "INT": S.AttrType.INT}
    attrs = [S.Attribute(n, kinds[kind], "") if default is None
             else S.Attribute(n, onnx.helper.make_attribute(n, default), "") for n, kind, default in spec.attributes]
    schema = S(spec.name, DOMAIN, VERSION, doc=spec.doc, inputs=ins, outputs=outs, type_constraints=constraints,
               attributes=attrs)
    schema.set_type_and_shape_inference_function(_grid_inference)
    return schema


def register_pooling_and_topology() -> None:
    """Register the pooling and topology schemas with onnx.defs (once per process)."""
    for schema in _pool_schemas() + [_grid_op_schema(s) for s in _GRID_OPS]:
        if not defs.has(schema.name, DOMAIN):
            defs.register_schema(schema)


register_pooling_and_topology()


# ---- rays through the grid: outputs sized at run time (operators/fvdb/ray.py) ---------------------

VOXELS_ALONG_RAYS = "VoxelsAlongRays"
SEGMENTS_ALONG_RAYS = "SegmentsAlongRays"
_RAYS = (("ray_origins", "T"), ("ray_directions", "T"))
RAY_ROWS = "ray_hits"  # the symbolic first dimension of the outputs sized at run time
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
    ins = [S.FormalParameter(n, t, "GridBatch bundle") for n, t in zip(BUNDLE, _BUNDLE_TYPES)]
    for name, jtype in spec.jagged:
        for part, t in zip(JAGGED, _JAGGED_TYPES):
            ins.append(S.FormalParameter(f"{name}_{part}", t or jtype, f"JaggedTensor {name}"))
    types = {"voxels": "tensor(int32)", "times": "T", "segments": "T", "samples": "T", "joffsets": "tensor(int64)",
             "jidx": "tensor(int32)", "jlidx": "tensor(int32)", "hit": "tensor(bool)"}
    outs = [S.FormalParameter(n, types[n], "the result JaggedTensor's " + n) for n in RAY_OUTPUTS[op_type]]
    attrs = [S.Attribute(n, S.AttrType.FLOAT, doc, required=True) if n in RAY_REQUIRED
             else S.Attribute(n, onnx.helper.make_attribute(n, default), doc) for n, doc, default in spec.attributes]
    attrs.append(S.Attribute("eps", onnx.helper.make_attribute("eps", 0.0), "drop hits shorter than this (time)"))
    schema = S(op_type, DOMAIN, VERSION, doc=spec.doc, inputs=ins, outputs=outs,
               type_constraints=[(k, *_TYPE_CONSTRAINTS[k]) for k in ("T", "T_f64")], attributes=attrs)

    def infer(ctx) -> None:
        ins_ = []
        for k in range(ctx.get_num_inputs()):
            tp = ctx.get_input_type(k)
            ins_.append(None if tp is None else (tp.tensor_type.elem_type, _dims_of(tp)))
        flags = {}
        for name in ("return_ijk", "return_midpoints"):
            a = ctx.get_attribute(name)
            if a is not None:
                flags[name] = a.i
        for k, (elem, dims) in enumerate(ray_rule(op_type, ins_, flags)):
            _set_output(ctx, k, elem, dims)

    schema.set_type_and_shape_inference_function(infer)
    return schema


def register_rays() -> None:
    """Register the ray ops' schemas with onnx.defs (once per process)."""
    for op_type in RAY_OUTPUTS:
        if not defs.has(op_type, DOMAIN):
            defs.register_schema(_ray_schema(op_type))


register_rays()


# ---- sparse to dense (operators/fvdb/dense.py) ----------------------------------------------------

INJECT_TO_DENSE = "InjectToDense"
# the output layouts: fVDB's inject_to_dense_cmajor [B, C, X, Y, Z]; fVDB's write_to_dense_czyx
# [B, C, Z, Y, X] (spconv's dense() order); BEV [B, C*Z, Y, X], channel c*Z + z: the CZYX tensor with
# C and Z merged, as CenterPoint's and VoxelNeXt's HeightCompression views spconv's dense [N, C, D, H, W]
DENSE_LAYOUTS = ("CXYZ", "CZYX", "BEV")
OPS[INJECT_TO_DENSE] = OpSpec(
    INJECT_TO_DENSE,
    "fVDB inject_to_dense_cmajor (GridBatch.write_to_dense_cmajor, ops/InjectToDense.cu): the voxel features of "
    "each grid b written into a dense box of grid_size cells whose lowest cell is ijk min_coord[b]; the cells of "
    "inactive voxels are 0, and voxels outside the box are dropped. data: the voxel data JaggedTensor, jdata "
    "[N, C] in the grids' index order (N the batch's active voxels). Output float [B, C, X, Y, Z] (layout CXYZ), "
    "[B, C, Z, Y, X] (CZYX, fVDB's write_to_dense_czyx) or [B, C*Z, Y, X] with channel c*Z + z (BEV: the CZYX "
    "tensor with its channel and z axes merged, the bird's-eye view CenterPoint's detection head reads).",
    (("data", "T"),), "dense",
    (("min_coord", "the box's lowest ijk: 3 ints (every grid) or 3*B (grid b's at 3b); required", None),
     ("grid_size", "the box's cells along x, y, z: 3 positive ints; required", None),
     ("layout", "CXYZ (fVDB's cmajor), CZYX or BEV", "CXYZ")))


def inject_to_dense_rule(inputs: list, attrs: dict) -> tuple[int, list | None]:
    """Return (elem_type, dims) of InjectToDense's output from its inputs' (elem_type, dims) and the
    attributes grid_size and layout. Raises ValueError on a bad signature or attribute."""
    names = OPS[INJECT_TO_DENSE].input_names()
    if len(inputs) != len(names):
        raise ValueError(f"fvdb.{INJECT_TO_DENSE} takes {len(names)} inputs ({', '.join(names)}), got {len(inputs)}")
    size = [int(v) for v in attrs.get("grid_size", ())]
    if len(size) != 3 or min(size) < 1:
        raise ValueError(f"grid_size must be 3 positive integers (x, y, z), got {size}")
    layout = attrs.get("layout", "CXYZ")
    if layout not in DENSE_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(DENSE_LAYOUTS)}, got {layout!r}")
    offsets, data = inputs[BUNDLE.index("grid_byte_offsets")], inputs[len(BUNDLE)]
    elem = data[0] if data is not None else TensorProto.FLOAT
    grids = None if offsets is None or offsets[1] is None else offsets[1][0]
    channels = None if data is None or data[1] is None or len(data[1]) != 2 else data[1][1]
    if not isinstance(grids, int) or not isinstance(channels, int):
        return elem, None
    x, y, z = size
    return elem, {"CXYZ": [grids, channels, x, y, z], "CZYX": [grids, channels, z, y, x],
                  "BEV": [grids, channels * z, y, x]}[layout]


def _inject_to_dense_schema() -> defs.OpSchema:
    S = defs.OpSchema
    spec = OPS[INJECT_TO_DENSE]
    ins = [S.FormalParameter(n, t, "GridBatch bundle") for n, t in zip(BUNDLE, _BUNDLE_TYPES)]
    ins += [S.FormalParameter(f"data_{part}", t or "T", "JaggedTensor data") for part, t in zip(JAGGED, _JAGGED_TYPES)]
    outs = [S.FormalParameter(spec.output, "T", "the dense tensor")]
    docs = {n: doc for n, doc, _ in spec.attributes}
    attrs = [S.Attribute("min_coord", S.AttrType.INTS, docs["min_coord"]),
             S.Attribute("grid_size", S.AttrType.INTS, docs["grid_size"]),
             S.Attribute("layout", onnx.helper.make_attribute("layout", "CXYZ"), docs["layout"])]
    schema = S(INJECT_TO_DENSE, DOMAIN, VERSION, doc=spec.doc, inputs=ins, outputs=outs, attributes=attrs,
               type_constraints=[(k, *_TYPE_CONSTRAINTS[k]) for k in ("T", "T_f64")])

    def infer(ctx) -> None:
        ins_ = []
        for k in range(ctx.get_num_inputs()):
            tp = ctx.get_input_type(k)
            ins_.append(None if tp is None else (tp.tensor_type.elem_type, _dims_of(tp)))
        attrs_ = {}
        a = ctx.get_attribute("grid_size")
        if a is not None:
            attrs_["grid_size"] = list(a.ints)
        a = ctx.get_attribute("layout")
        if a is not None:
            attrs_["layout"] = a.s.decode()
        try:
            _set_output(ctx, 0, *inject_to_dense_rule(ins_, attrs_))
        except ValueError:
            pass  # (left untyped: luisaml's operator check names the node and what is wrong)

    schema.set_type_and_shape_inference_function(infer)
    return schema


def register_dense() -> None:
    """Register InjectToDense's schema with onnx.defs (once per process)."""
    if not defs.has(INJECT_TO_DENSE, DOMAIN):
        defs.register_schema(_inject_to_dense_schema())


register_dense()
