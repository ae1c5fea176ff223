"""The LuisaML JSON model format: MessageToJson of the ModelProto, with enum names as strings
and `data_offsets` into a weight blob in place of `raw_data`."""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from google.protobuf import json_format

from .. import dtypes
from ..errors import LimitError, ModelError, WeightsError
from ..limits import DEFAULT, Limits
from ..model import shape_str
from .weights import WeightSource, check_no_overlap, slice_range

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


def _check_depth(doc: Any, origin: str, limit: int) -> None:
    """Raise LimitError naming the path where objects and lists nest deeper than `limit` (the
    recursive steps after loading, and protobuf's parser, would otherwise run out of stack)."""
    stack: list[tuple[Any, int, str]] = [(doc, 1, "")]
    while stack:
        obj, depth, path = stack.pop()
        if depth > limit:
            raise LimitError(
                f"{origin}: objects and lists nest deeper than {limit} levels at '{path or '(top)'}'; "
                "raise luisaml.Limits.json_depth if the model really needs it"
            )
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for k, v in items:
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, (f"{path}.{k}" if path else k) if isinstance(k, str) else f"{path}[{k}]"))


def _want(value: Any, kind: type, where: str) -> Any:
    """Return value if it is of the JSON kind expected at `where`, else raise ModelError naming it."""
    if not isinstance(value, kind):
        names = {dict: "an object", list: "a list", str: "a string"}
        raise ModelError(f"{where}: expected {names.get(kind, kind.__name__)}, got {_json_kind(value)}")
    return value


def _json_kind(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (dict, "an object"), (list, "a list"), (str, "a string"),
                       (int, "a number"), (float, "a number")):
        if isinstance(value, kind):
            return f"{name} ({json.dumps(value)[:40]})" if kind not in (dict, list) else name
    return "null"


@dataclass
class _Offsets:
    """An initializer whose bytes come from the weights: where it is, and its data_offsets."""

    where: str
    name: str
    start: int
    end: int
    doc_string: str = ""


def _offset(value: Any, where: str) -> int:
    """Return a byte offset written as an integer (or a decimal string, as int64 fields are)."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ModelError(f"{where}: expected a non-negative integer, got {_json_kind(value)}")


def _pop_offsets(graph: dict, where: str, out: list[_Offsets], mark: str) -> None:
    """Check the JSON shape of a graph's parts this loader reads, and remove `data_offsets` from
    its initializers (recursively in subgraphs), recording them and marking each initializer."""
    _want(graph.get("node", []), list, f"{where}.node")
    for k, init in enumerate(_want(graph.get("initializer", []), list, f"{where}.initializer")):
        here = f"{where}.initializer[{k}]"
        _want(init, dict, here)
        name = _want(init.get("name", ""), str, f"{here}.name")
        if "data_offsets" in init:
            offs = init.pop("data_offsets")
            at = f"{here} ('{name}') data_offsets"
            if not (isinstance(offs, list) and len(offs) == 2):
                raise ModelError(f"{at}: expected [start, end], got {_json_kind(offs)}")
            start, end = _offset(offs[0], f"{at}[0]"), _offset(offs[1], f"{at}[1]")
            if start > end:
                raise ModelError(f"{at}: [{start}, {end}] is not a valid range (start > end)")
            # ParseDict keeps doc_string; the marker finds this TensorProto again afterwards
            doc_string = init.pop("doc_string", init.pop("docString", ""))
            init["docString"] = f"{mark}{len(out)}"
            out.append(_Offsets(here, name, start, end, doc_string if isinstance(doc_string, str) else ""))
    for k, node in enumerate(graph.get("node", [])):
        here = f"{where}.node[{k}]"
        _want(node, dict, here)
        for j, a in enumerate(_want(node.get("attribute", []), list, f"{here}.attribute")):
            at = f"{here}.attribute[{j}]"
            _want(a, dict, at)
            if "g" in a:
                _pop_offsets(_want(a["g"], dict, f"{at}.g"), f"{at}.g", out, mark)
            for i, g in enumerate(_want(a.get("graphs", []), list, f"{at}.graphs")):
                _pop_offsets(_want(g, dict, f"{at}.graphs[{i}]"), f"{at}.graphs[{i}]", out, mark)


_MARK = "\0luisaml-data-offsets:"  # + a token per call, so no file can forge it


def parse_json_model(text: str | bytes, weights: WeightSource | None, origin: str = "model", *,
                     limits: Limits = DEFAULT) -> onnx.ModelProto:
    """Return the ModelProto of a LuisaML JSON model, initializer data taken from `weights`: by
    name from safetensors or a dict, by `data_offsets` from a header-less blob (which the offsets
    must then cover up to its last byte, without overlaps)."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if not raw.strip():
        raise ModelError(f"{origin}: empty file, expected a LuisaML JSON model")
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ModelError(f"{origin}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except UnicodeDecodeError as e:
        raise ModelError(f"{origin}: not a JSON text: {e}") from e
    except RecursionError:  # deeper than Python's stack allows, far beyond any json_depth
        raise LimitError(
            f"{origin}: objects and lists nest deeper than {limits.json_depth} levels "
            "(luisaml.Limits.json_depth)"
        ) from None
    _check_depth(doc, origin, limits.json_depth)
    if not isinstance(doc, dict) or not isinstance(doc.get("graph"), dict):
        raise ModelError(f"{origin}: a LuisaML JSON model is an object with a 'graph' object")
    graph = doc["graph"]
    if "node" not in graph:
        raise ModelError(f"{origin}: graph has no 'node' list")
    offsets: list[_Offsets] = []
    mark = f"{_MARK}{secrets.token_hex(8)}:"
    _pop_offsets(graph, f"{origin}: graph", offsets, mark)
    _fix_types(doc, origin)
    doc.pop("metadata_props", None)
    proto = onnx.ModelProto()
    try:
        json_format.ParseDict(doc, proto)
    except (json_format.ParseError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise ModelError(f"{origin}: not a valid ONNX model in JSON form: {e}") from e
    if not proto.opset_import:
        proto.opset_import.add(domain="", version=DEFAULT_OPSET)
    if offsets:
        _bind_offsets(proto, offsets, weights, mark)
    return proto


def _bind_offsets(proto: onnx.ModelProto, offsets: list[_Offsets], src: WeightSource | None, mark: str) -> None:
    """Fill the marked initializers from src: by name, or by data_offsets from a header-less blob."""
    marked: dict[int, onnx.TensorProto] = {}
    for t in _all_initializers(proto.graph):
        if t.doc_string.startswith(mark):
            k = int(t.doc_string[len(mark):])
            marked[k] = t
            t.doc_string = offsets[k].doc_string
    if src is None:
        o = offsets[0]
        raise WeightsError(f"initializer '{o.name}': has data_offsets [{o.start}, {o.end}] but no weights were given")
    if src.by_name:
        for k, o in enumerate(offsets):
            if o.name not in src.tensors:
                raise src.missing(o.name, "initializer")
            _fill_from_array(marked[k], src.tensors[o.name], src.origin)
        return
    # a header-less blob: the offsets must fit it exactly (a safetensors file whose header was
    # damaged would otherwise be read from the wrong place)
    end = max(o.end for o in offsets)
    if src.looks_like_safetensors and (end != len(src.data) or any(o.end - o.start != _nbytes(marked[k])
                                                                  for k, o in enumerate(offsets))):
        raise src.misfit("")
    for k, o in enumerate(offsets):
        marked[k].raw_data = slice_range(src, o.name, o.start, o.end, _nbytes(marked[k]))
        marked[k].ClearField("float_data")
        marked[k].ClearField("int32_data")
        marked[k].ClearField("int64_data")
    check_no_overlap([(o.name, o.start, o.end) for o in offsets], src.origin)
    if end != len(src.data):
        raise src.misfit(
            f"it has {len(src.data)} bytes, but the model's data_offsets end at byte {end} "
            f"(initializer '{max(offsets, key=lambda o: o.end).name}')"
        )


def _nbytes(t: onnx.TensorProto) -> int:
    """Return the byte size of an initializer as its header declares it."""
    dt = dtypes.SUPPORTED.get(t.data_type)
    if dt is None:
        raise ModelError(f"initializer '{t.name}': element type {dtypes.onnx_name(t.data_type)} is not supported")
    return math.prod(int(d) for d in t.dims) * dt.numpy.itemsize


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
        raise WeightsError(f"initializer '{t.name}': {origin} holds {arr.dtype}{shape_str(arr.shape)}, expected {want}")
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
