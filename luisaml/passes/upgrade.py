"""Opset upgrade: old models are converted once with onnx.version_converter."""
from __future__ import annotations

import warnings

import onnx

# Operators implement opset >= 13 semantics (axes as inputs, ...); older models are upgraded.
MIN_OPSET = 13
TARGET_OPSET = 17


def default_opset(proto: onnx.ModelProto) -> int:
    """Return the model's ai.onnx opset version (0 if it imports none)."""
    return max((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), default=0)


def upgrade_opset(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Return the model converted to TARGET_OPSET when its ai.onnx opset is below MIN_OPSET."""
    version = default_opset(proto)
    if version == 0 or version >= MIN_OPSET:
        return proto
    try:
        converted = onnx.version_converter.convert_version(proto, TARGET_OPSET)
    except Exception as e:  # the converter raises RuntimeError/IndexError for ops it cannot map
        warnings.warn(f"luisaml: could not upgrade opset {version} to {TARGET_OPSET} ({e}); using it as is")
        return proto
    if version < 11:
        _keep_resize10_coordinates(proto, converted)
    _keep_hardmax_coercion(converted)
    return converted


def _keep_hardmax_coercion(converted: onnx.ModelProto) -> None:
    """Hardmax before opset 13 works on the input coerced to 2-d at `axis` (default 1); opset 13
    takes one axis. onnx's converter rewrites Softmax and LogSoftmax for that but leaves Hardmax as
    it is: rewrite it the same way (Flatten at axis, Hardmax on the last axis, Reshape back)."""
    from onnx import helper

    nodes = []
    for n in converted.graph.node:
        if n.op_type != "Hardmax" or n.domain not in ("", "ai.onnx"):
            nodes.append(n)
            continue
        axis = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "axis"), 1)
        x, y = n.input[0], n.output[0]
        shape, flat, hard = f"{y}__shape", f"{y}__flat", f"{y}__hardmax"
        nodes += [helper.make_node("Shape", [x], [shape], name=f"{n.name}__shape"),
                  helper.make_node("Flatten", [x], [flat], axis=axis, name=f"{n.name}__flatten"),
                  helper.make_node("Hardmax", [flat], [hard], axis=-1, name=n.name),
                  helper.make_node("Reshape", [hard, shape], [y], name=f"{n.name}__reshape")]
    del converted.graph.node[:]
    converted.graph.node.extend(nodes)


def _keep_resize10_coordinates(original: onnx.ModelProto, converted: onnx.ModelProto) -> None:
    """onnx's converter turns Upsample and Resize-10 into a Resize with the default half_pixel
    coordinates; give it back their asymmetric ones, and their nearest rounding (down when
    upsampling, up when every resized axis shrinks, as onnxruntime's opset-10 kernel does)."""
    from onnx import helper, numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    old = {n.output[0]: n for n in original.graph.node if n.op_type in ("Upsample", "Resize") and n.output}
    for node in converted.graph.node:
        src = old.get(node.output[0]) if node.op_type == "Resize" and node.output else None
        if src is None:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in src.attribute}
        scales = attrs.get("scales", inits.get(src.input[1]) if len(src.input) > 1 else None)
        resized = [float(s) for s in (scales if scales is not None else []) if float(s) != 1.0]
        shrink = bool(resized) and all(s < 1.0 for s in resized)
        keep = [a for a in node.attribute if a.name not in ("coordinate_transformation_mode", "nearest_mode")]
        del node.attribute[:]
        node.attribute.extend(keep)
        node.attribute.append(helper.make_attribute("coordinate_transformation_mode", "asymmetric"))
        node.attribute.append(helper.make_attribute("nearest_mode", "ceil" if shrink else "floor"))
