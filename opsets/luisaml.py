"""The `luisaml` operator domain (version 1): detection ops ONNX has no standard form of, their
schemas and their registration with onnx.defs (so that onnx's checker and shape inference accept
luisaml.* nodes). The kernels are in operators/detection.py; README's "The luisaml domain" section
documents them for users.

RotatedNMS(boxes, scores) -> kept
    boxes: float [N, 5] (x, y, dx, dy, heading) or [N, 7] (x, y, z, dx, dy, dz, heading; z and dz
    unused), scores: float [N]. kept: int64 [K], the indices of the kept boxes in descending score
    order (equal scores: the lower index first). Greedy NMS over the bird's-eye view as OpenPCDet's
    `nms_gpu` defines it: a box is dropped when its IoU with a kept box of higher score is above
    iou_threshold; the IoU is the area of the intersection of the two rotated rectangles (each
    rotated counter-clockwise by its heading about its centre, OpenPCDet's current
    `rotate_around_center`) over max(area_a + area_b - intersection, 1e-8) (`iou_bev`).
    Attributes: iou_threshold (float, required); max_output (int, default -1: no limit): at most
    this many indices, the first in score order (OpenPCDet's post_max_size).

CircleNMS(centers, scores) -> kept
    centers: float [N, D >= 2] (columns 0 and 1 are x, y; CenterPoint passes its [N, 3] dets),
    scores: float [N]. kept: int64 [K] in descending score order (equal scores: the lower index
    first). CenterPoint's `circle_nms`: a box is dropped when its squared centre distance to a kept
    box of higher score is <= min_radius**2 (computed in float32, the threshold rounded to float32).
    Attributes: min_radius (float, required); max_output (int, default -1: no limit;
    CenterPoint's post_max_size slices the kept list the same way).

Both output a count known only at run time (luisaml/dynamic.py): their output is a graph output.

onnx is imported only by the registration below (luisaml/loaders calls register before it reads a
model), so that operators/detection.py can read the names here in a process without onnx: loading a
.lml artifact imports every shipped operator and must not import onnx (tests/test_artifact.py).
"""
from __future__ import annotations

DOMAIN = "luisaml"
VERSION = 1

ROTATED_NMS = "RotatedNMS"
CIRCLE_NMS = "CircleNMS"
KEPT = "kept"  # the symbolic dimension of the outputs sized at run time

DOCS = {
    ROTATED_NMS: "Greedy NMS of rotated bird's-eye-view boxes (OpenPCDet nms_gpu / boxes_iou_bev): int64 kept "
                 "indices in descending score order.",
    CIRCLE_NMS: "Greedy NMS by centre distance (CenterPoint circle_nms): int64 kept indices in descending score "
                "order.",
}
FIRST = {ROTATED_NMS: ("boxes", "[N, 5] (x, y, dx, dy, heading) or [N, 7] (x, y, z, dx, dy, dz, heading)"),
         CIRCLE_NMS: ("centers", "[N, D >= 2]: x, y in columns 0 and 1")}
THRESHOLD = {ROTATED_NMS: ("iou_threshold", "drop a box whose BEV IoU with a kept box is above this"),
             CIRCLE_NMS: ("min_radius", "drop a box whose centre is within this distance (<=) of a kept box")}


def _schema(op_type: str):
    import onnx
    from onnx import TensorProto, defs

    S = defs.OpSchema
    first, first_doc = FIRST[op_type]
    thr, thr_doc = THRESHOLD[op_type]
    ins = [S.FormalParameter(first, "tensor(float)", first_doc),
           S.FormalParameter("scores", "tensor(float)", "[N]")]
    outs = [S.FormalParameter(KEPT, "tensor(int64)", "[K] indices of the kept boxes, in descending score order")]
    attrs = [S.Attribute(thr, S.AttrType.FLOAT, thr_doc, required=True),
             S.Attribute("max_output", onnx.helper.make_attribute("max_output", -1),
                         "keep at most this many (the first in score order); -1: no limit")]
    schema = S(op_type, DOMAIN, VERSION, doc=DOCS[op_type], inputs=ins, outputs=outs, attributes=attrs)

    def infer(ctx) -> None:
        out = onnx.TypeProto()
        out.tensor_type.elem_type = TensorProto.INT64
        out.tensor_type.shape.dim.add().dim_param = KEPT
        ctx.set_output_type(0, out)

    schema.set_type_and_shape_inference_function(infer)
    return schema


def register() -> None:
    """Register the domain's schemas with onnx.defs (once per process)."""
    import onnx.reference  # noqa: F401  (see opsets/fvdb.py register: its schema table first)
    from onnx import defs

    for op_type in (ROTATED_NMS, CIRCLE_NMS):
        if not defs.has(op_type, DOMAIN):
            defs.register_schema(_schema(op_type))
