"""The `fvdb` domain's sparse-to-dense schema (version 1; what it shares with the rest of the domain is
in opsets/fvdb.py), registered with onnx.defs when this module is imported: InjectToDense
(operators/fvdb/dense.py).
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, defs

from .fvdb import (BUNDLE, DOMAIN, TYPE_CONSTRAINTS, VERSION, OpSpec, grid_inputs, input_types, register_schemas,
                   set_output)

INJECT_TO_DENSE = "InjectToDense"
# the output layouts: fVDB's inject_to_dense_cmajor [B, C, X, Y, Z]; fVDB's write_to_dense_czyx
# [B, C, Z, Y, X] (spconv's dense() order); BEV [B, C*Z, Y, X], channel c*Z + z: the CZYX tensor with
# C and Z merged, as CenterPoint's and VoxelNeXt's HeightCompression views spconv's dense [N, C, D, H, W]
DENSE_LAYOUTS = ("CXYZ", "CZYX", "BEV")
OPS: dict[str, OpSpec] = {INJECT_TO_DENSE: OpSpec(  # (GridOp.check reads the op's inputs here)
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
     ("layout", "CXYZ (fVDB's cmajor), CZYX or BEV", "CXYZ")))}


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
    ins = grid_inputs(spec)
    outs = [S.FormalParameter(spec.output, "T", "the dense tensor")]
    docs = {n: doc for n, doc, _ in spec.attributes}
    attrs = [S.Attribute("min_coord", S.AttrType.INTS, docs["min_coord"]),
             S.Attribute("grid_size", S.AttrType.INTS, docs["grid_size"]),
             S.Attribute("layout", onnx.helper.make_attribute("layout", "CXYZ"), docs["layout"])]
    schema = S(INJECT_TO_DENSE, DOMAIN, VERSION, doc=spec.doc, inputs=ins, outputs=outs, attributes=attrs,
               type_constraints=[(k, *TYPE_CONSTRAINTS[k]) for k in ("T", "T_f64")])

    def infer(ctx) -> None:
        ins_ = input_types(ctx)
        attrs_ = {}
        a = ctx.get_attribute("grid_size")
        if a is not None:
            attrs_["grid_size"] = list(a.ints)
        a = ctx.get_attribute("layout")
        if a is not None:
            attrs_["layout"] = a.s.decode()
        try:
            set_output(ctx, 0, *inject_to_dense_rule(ins_, attrs_))
        except ValueError:
            pass  # (left untyped: luisaml's operator check names the node and what is wrong)

    schema.set_type_and_shape_inference_function(infer)
    return schema


register_schemas([_inject_to_dense_schema()])
