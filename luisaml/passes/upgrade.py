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
    return converted
