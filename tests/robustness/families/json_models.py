"""JSON: damaged LuisaML JSON models (the C++ runtime's format: the ModelProto as JSON, element
types as names, `data_offsets` into a weight blob).

Deep nesting (a RecursionError today), text that is not JSON or not UTF-8, truncation and flipped
bytes, the wrong JSON types where objects and lists belong, bad `data_offsets`, unknown element
types, absurd dims, unknown fields. An error must name the file, or the initializer / field at
fault. Documents that still describe the model must give onnxruntime's outputs.
"""
from __future__ import annotations

import json

import numpy as np
from onnx import helper

from ..harness import Case, MustFail, recipe
from ..models import MLP_WEIGHTS, blob_bytes, dataless, json_model_doc, mlp
from .common import ORT, Expect, run_and_judge

X = np.random.default_rng(0).uniform(-2, 2, (3, 4)).astype(np.float32)


def base_doc() -> tuple[dict, bytes]:
    blob, offsets = blob_bytes(MLP_WEIGHTS)
    return json_model_doc(dataless(mlp()), offsets), blob


def _init(doc, name):
    return next(i for i in doc["graph"]["initializer"] if i["name"] == name)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# Each edit takes the base document and returns (text or bytes, expect).
def edit(key: str):
    doc, blob = base_doc()
    must = MustFail
    if key.startswith("deep_") and key != "deep_objects":
        depth = int(key.split("_")[1])
        text = json.dumps(doc)
        # a deeply nested value where an attribute list is expected
        text = text.replace('"graph": {', '"graph": {"doc_string_extra": ' + _deep(depth) + ", ", 1)
        return text, Expect(("model.json", "depth", "nest"), must(f"JSON nested {depth} deep"))
    if key == "deep_objects":
        text = json.dumps(doc).replace('"graph": {', '"graph": {"x": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + ", ", 1)
        return text, Expect(("model.json", "depth", "nest"), must("JSON objects nested 50000 deep"))
    if key == "not_json":
        return "this is not json", Expect("model.json", must("text"))
    if key == "bad_utf8":
        return json.dumps(doc).encode().replace(b'"mlp"', b'"ml\xff\xfe"'), Expect("model.json", must("bytes that are not UTF-8"))
    if key == "utf16":
        return json.dumps(doc).encode("utf-16"), Expect("model.json", ORT)
    if key == "bom":
        return b"\xef\xbb\xbf" + json.dumps(doc).encode(), Expect("model.json", ORT)
    if key == "top_list":
        return "[]", Expect("model.json", must("a JSON list"))
    if key == "top_null":
        return "null", Expect("model.json", must("JSON null"))
    if key == "graph_list":
        doc["graph"] = []
        return json.dumps(doc), Expect(("model.json", "graph"), must("a graph that is a list"))
    if key == "graph_missing":
        del doc["graph"]
        return json.dumps(doc), Expect(("model.json", "graph"), must("a model without a graph"))
    if key == "node_dict":
        doc["graph"]["node"] = {"op_type": "Relu"}
        return json.dumps(doc), Expect(("model.json", "node"), must("node as an object"))
    if key == "node_missing":
        del doc["graph"]["node"]
        return json.dumps(doc), Expect(("model.json", "node"), must("a graph without nodes"))
    if key == "initializer_not_list":
        doc["graph"]["initializer"] = {"name": "W1"}
        return json.dumps(doc), Expect(("model.json", "initializer"), must("initializer as an object"))
    if key.startswith("offsets_"):
        w = _init(doc, "W2")
        w["data_offsets"] = {
            "offsets_reversed": [w["data_offsets"][1], w["data_offsets"][0]], "offsets_negative": [-96, 0],
            "offsets_past_end": [10**6, 10**6 + 96], "offsets_float": [0.5, 96.5], "offsets_strings": ["0", "96"],
            "offsets_null": None, "offsets_three": [0, 96, 192], "offsets_huge": [2**70, 2**70 + 96],
            "offsets_wrong_span": [0, 95], "offsets_nested": [[0], [96]], "offsets_bool": [False, True],
        }[key]
        return json.dumps(doc), Expect(("W2", "data_offsets"), must(f"W2's data_offsets {w['data_offsets']!r}"))
    if key.startswith("elem_"):
        value = {"elem_unknown_name": "NOT_A_TYPE", "elem_999": 999, "elem_negative": -1, "elem_string": "STRING",
                 "elem_list": [1], "elem_float": 1.5}[key]
        doc["graph"]["input"][0]["type"]["tensor_type"]["elem_type"] = value
        return json.dumps(doc), Expect(("x", "elem_type", "model.json"), must(f"element type {value!r}"))
    if key == "init_type_string":
        _init(doc, "W1")["data_type"] = "STRING"
        return json.dumps(doc), Expect(("W1", "STRING"), must("a STRING initializer"))
    if key.startswith("dims_"):
        value = {"dims_huge_string": ["99999999999999999999", "8"], "dims_negative": [-4, 8], "dims_2p40": [2**40, 8],
                 "dims_float": [4.5, 8], "dims_text": ["four", "8"]}[key]
        _init(doc, "W1")["dims"] = value
        return json.dumps(doc), Expect(("W1", "dims", "model.json"), must(f"W1's dims {value!r}"))
    if key == "unknown_field":
        doc["graph"]["bogus_field"] = 1
        return json.dumps(doc), Expect(("bogus_field", "model.json"), ORT)
    if key == "no_opset":
        doc.pop("opset_import", None)
        return json.dumps(doc), Expect("model.json", ORT)
    if key == "no_weights":
        return json.dumps(doc), Expect(("W1", "W2", "B1", "B2", "weights"), must("offsets without weights"))
    if key == "nan_literal":  # JSON for a float attribute that is NaN (what MessageToJson writes)
        doc["graph"]["node"][2]["op_type"] = "LeakyRelu"
        doc["graph"]["node"][2]["attribute"] = [{"name": "alpha", "f": "NaN", "type": "FLOAT"}]
        ref = mlp()
        ref.graph.node[2].op_type = "LeakyRelu"
        ref.graph.node[2].attribute.append(helper.make_attribute("alpha", float("nan")))
        from .common import _resolving, ort_reference

        return json.dumps(doc), Expect(("relu", "alpha"), _resolving(ort_reference(ref, {"x": X})))
    if key == "huge_file_whitespace":
        return json.dumps(doc) + " " * (20 << 20), Expect("model.json", ORT)
    raise KeyError(key)


KEYS = ("deep_1000", "deep_100000", "deep_objects", "not_json", "bad_utf8", "utf16", "bom", "top_list", "top_null",
        "graph_list", "graph_missing", "node_dict", "node_missing", "initializer_not_list", "offsets_reversed",
        "offsets_negative", "offsets_past_end", "offsets_float", "offsets_strings", "offsets_null", "offsets_three",
        "offsets_huge", "offsets_wrong_span", "offsets_nested", "offsets_bool", "elem_unknown_name", "elem_999",
        "elem_negative", "elem_string", "elem_list", "elem_float", "init_type_string", "dims_huge_string",
        "dims_negative", "dims_2p40", "dims_float", "dims_text", "unknown_field", "no_opset", "no_weights",
        "nan_literal", "huge_file_whitespace")


@recipe("json.edit")
def edited(ctx, key: str) -> None:
    text, expect = edit(key)
    mpath = ctx.path("model.json")
    mpath.write_bytes(text if isinstance(text, bytes) else text.encode())
    _, blob = base_doc()
    wpath = ctx.path("weights.bin")
    wpath.write_bytes(blob)
    if expect.reference == ORT:  # the undamaged model is what the document still describes
        from .common import _resolving, ort_reference

        expect.reference = _resolving(ort_reference(mlp(), {"x": X}))
    weights = None if key == "no_weights" else str(wpath)
    run_and_judge(ctx, None, {"x": X}, expect, weights=weights, model_path=str(mpath), what=key)


@recipe("json.damage")
def damaged(ctx, kind: str, seed: int) -> None:
    """Truncated or byte-flipped text: when it still parses, any outcome but a bad error passes."""
    doc, blob = base_doc()
    raw = bytearray(json.dumps(doc).encode())
    rng = np.random.default_rng([seed, len(kind)])
    if kind == "truncate":
        raw = raw[: int(rng.integers(1, len(raw)))]
    else:
        for _ in range(1 if kind == "flip" else 4):
            raw[int(rng.integers(len(raw)))] = int(rng.integers(32, 127))
    mpath = ctx.path("model.json")
    mpath.write_bytes(bytes(raw))
    wpath = ctx.path("weights.bin")
    wpath.write_bytes(blob)
    try:
        parsed = json.loads(bytes(raw))
        names = _names(parsed)
        reference = None  # the damage may have changed the model itself: no reference to hold it to
    except ValueError:
        names = set()
        reference = MustFail("text that is not JSON")
    run_and_judge(ctx, None, {"x": X}, Expect(("model.json", *sorted(names)), reference), weights=str(wpath),
                  model_path=str(mpath), what=f"{kind} damage")


def _names(obj) -> set[str]:
    """Every string value of a JSON document (a damaged name may be what an error names)."""
    out: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(str(k))
            out |= _names(v)
    elif isinstance(obj, list):
        for v in obj:
            out |= _names(v)
    elif isinstance(obj, str):
        out.add(obj)
    return {s for s in out if len(s) > 1}


_CI = {"deep_100000", "bad_utf8", "offsets_past_end", "offsets_negative", "dims_2p40", "no_weights"}


def cases() -> list[Case]:
    out = [Case(f"json/{key}", "json", "json.edit", dict(key=key), ci=key in _CI) for key in KEYS]
    for kind in ("truncate", "flip", "flip4"):
        for seed in range(8):
            out.append(Case(f"json/{kind}/{seed}", "json", "json.damage", dict(kind=kind, seed=seed)))
    return out
