"""The LuisaML JSON model format: MessageToJson of the ModelProto, with enum names as strings
and `data_offsets` into a weight blob in place of `raw_data`."""
from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import onnx
from google.protobuf import json_format

from .. import dtypes
from ..model import ModelError, shape_str
from .weights import WeightSource, slice_range

DEFAULT_OPSET = 21  # what the C++ runtime assumes when opset_import is absent


def _elem_type(value: Any, where: str) -> int:
    """Return an element type given as an enum name, a number, or a numeric string."""
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value.lstrip("-").isdigit():
            return int(value)
        try:
            return onnx.TensorProto.DataType.Value(value)
        except ValueError:
            raise ModelError(f"{where}: unknown element type '{value}'") from None
    raise ModelError(f"{where}: element type must be a name or a number, not {value!r}")


def _fix_types(obj: Any, where: str) -> None:
    """Turn string enum names of int32 fields (elem_type, data_type) into numbers, in place."""
    if isinstance(obj, dict):
        for key in ("elem_type", "data_type"):
            if key in obj:
                obj[key] = _elem_type(obj[key], f"{where} {obj.get('name', '')}".strip())
        for k, v in obj.items():
            _fix_types(v, f"{where}.{k}" if k in ("graph", "g") else where)
    elif isinstance(obj, list):
        for v in obj:
            _fix_types(v, where)


def _pop_offsets(graph: dict, out: dict[str, tuple[int, int, dict]]) -> None:
    """Remove `data_offsets` from initializers (recursively in subgraphs), recording them."""
    for init in graph.get("initializer", []):
        if "data_offsets" in init:
            offs = init.pop("data_offsets")
            if not (isinstance(offs, list) and len(offs) == 2):
                raise ModelError(f"initializer '{init.get('name')}': data_offsets must be [start, end], got {offs!r}")
            out[init.get("name", "")] = (int(offs[0]), int(offs[1]), init)
    for node in graph.get("node", []):
        for a in node.get("attribute", []):
            for g in ([a["g"]] if "g" in a else []) + a.get("graphs", []):
                _pop_offsets(g, out)


def _tensor_bytes(init: dict, name: str) -> int:
    dt = dtypes.SUPPORTED.get(init.get("data_type", 0))
    if dt is None:
        raise ModelError(f"initializer '{name}': element type {dtypes.onnx_name(init.get('data_type', 0))} is not supported")
    dims = [int(d) for d in init.get("dims", [])]
    return int(np.prod(dims, dtype=np.int64)) * dt.numpy.itemsize


def parse_json_model(text: str | bytes, weights: WeightSource | None, origin: str = "model") -> onnx.ModelProto:
    """Return the ModelProto of a LuisaML JSON model, initializer data taken from `weights`."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelError(f"{origin}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("graph"), dict):
        raise ModelError(f"{origin}: a LuisaML JSON model is an object with a 'graph' object")
    graph = doc["graph"]
    for key in ("node",):
        if key not in graph:
            raise ModelError(f"{origin}: graph has no '{key}' list")
    offsets: dict[str, tuple[int, int, dict]] = {}
    _pop_offsets(graph, offsets)
    _fix_types(doc, origin)
    for name, (start, end, init) in offsets.items():
        nbytes = _tensor_bytes(init, name)
        if weights is not None and weights.is_safetensors and name in weights.tensors:
            continue  # bound by name below
        if weights is None:
            raise ModelError(f"initializer '{name}': has data_offsets [{start}, {end}] but no weights were given")
        init["raw_data"] = base64.b64encode(slice_range(weights, name, start, end, nbytes)).decode()
    doc.pop("metadata_props", None)
    proto = onnx.ModelProto()
    try:
        json_format.ParseDict(doc, proto)
    except json_format.ParseError as e:
        raise ModelError(f"{origin}: not a valid ONNX model in JSON form: {e}") from e
    if not proto.opset_import:
        proto.opset_import.add(domain="", version=DEFAULT_OPSET)
    if weights is not None and weights.is_safetensors:
        by_name = {n: v for n, v in offsets.items() if n in weights.tensors}
        for t in _all_initializers(proto.graph):
            if t.name in by_name:
                _fill_from_array(t, weights.tensors[t.name], weights.origin)
    return proto


def _all_initializers(g: onnx.GraphProto):
    yield from g.initializer
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _all_initializers(sub)


def _fill_from_array(t: onnx.TensorProto, arr: np.ndarray, origin: str) -> None:
    """Set a TensorProto's raw_data from an array, checking dtype and shape against its header."""
    dt = dtypes.SUPPORTED.get(t.data_type)
    dims = tuple(int(d) for d in t.dims)
    if dt is None or arr.dtype != dt.numpy or tuple(arr.shape) != dims:
        want = f"{dtypes.onnx_name(t.data_type).lower()}{shape_str(dims)}"
        raise ModelError(f"initializer '{t.name}': {origin} holds {arr.dtype}{shape_str(arr.shape)}, expected {want}")
    t.raw_data = np.ascontiguousarray(arr).tobytes()
    t.ClearField("float_data")
    t.ClearField("int32_data")
    t.ClearField("int64_data")


def to_json_model(proto: onnx.ModelProto, weights: str = "blob") -> tuple[dict, bytes]:
    """Return (LuisaML JSON document, weight bytes) for a ModelProto, as the C++ exporter writes
    them: initializers of the main graph get `data_offsets` into the weights, which are either a
    header-less blob of the name-sorted tensors (weights="blob") or a safetensors file
    (weights="safetensors", offsets relative to its data section)."""
    from google.protobuf.json_format import MessageToDict

    doc = MessageToDict(proto, preserving_proto_field_name=True)
    doc.pop("metadata_props", None)
    inits = sorted(proto.graph.initializer, key=lambda t: t.name)
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in inits}
    if weights == "safetensors":
        from safetensors.numpy import save

        raw = save({k: np.ascontiguousarray(v) for k, v in arrays.items()})
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        offsets = {k: header[k]["data_offsets"] for k in arrays}
    elif weights == "blob":
        parts, offsets, pos = [], {}, 0
        for k, v in arrays.items():
            b = np.ascontiguousarray(v).tobytes()
            offsets[k] = [pos, pos + len(b)]
            parts.append(b)
            pos += len(b)
        raw = b"".join(parts)
    else:
        raise ValueError(f"weights must be 'blob' or 'safetensors', not {weights!r}")
    for init in doc["graph"].get("initializer", []):
        for key in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "data_location"):
            init.pop(key, None)
        init["data_offsets"] = offsets[init["name"]]
    _name_types(doc)
    return doc, raw


def _name_types(obj) -> None:
    """Write elem_type/data_type as enum names, as the C++ exporter does."""
    if isinstance(obj, dict):
        for key in ("elem_type", "data_type"):
            if isinstance(obj.get(key), int):
                obj[key] = onnx.TensorProto.DataType.Name(obj[key])
        for v in obj.values():
            _name_types(v)
    elif isinstance(obj, list):
        for v in obj:
            _name_types(v)
