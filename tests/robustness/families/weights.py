"""Weights: damaged or mismatched weight files next to a model whose initializers have no data.

Four pairings: an .onnx model or a LuisaML .json model, each with a safetensors file or a
header-less blob. The damage: flipped header or data bytes, a wrong header length, truncation,
tensors missing, renamed, retyped or reshaped, overlapping or out-of-range data_offsets, a header
that is not UTF-8 or nests too deep. The reference comes from outside luisaml: the safetensors
library's reading of the damaged file (when it refuses, luisaml must refuse; when it reads, the
tensors it reads must fit the model and give onnxruntime's outputs), and for blobs the offsets
sliced here. An error must name the weights file or the tensor.
"""
from __future__ import annotations

import json
import struct

import numpy as np

from ..harness import FAIL_HARNESS, Case, Fail, MustFail, recipe
from ..models import (
    MLP_WEIGHTS,
    ReferenceRejected,
    blob_bytes,
    dataless,
    json_model_doc,
    mlp,
    ort_outputs,
    safetensors_bytes,
    with_weights,
)
from .common import Expect, run_and_judge

PAIRINGS = ("onnx_st", "json_st", "json_blob", "onnx_blob")
X = np.random.default_rng(0).uniform(-2, 2, (3, 4)).astype(np.float32)
NAMES = tuple(sorted(MLP_WEIGHTS))


def _split(raw: bytes) -> tuple[int, dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: dict | bytes, data: bytes) -> bytes:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


def st_damage(kind: str, seed: int) -> bytes:
    """Return a damaged safetensors file of the MLP's weights."""
    rng = np.random.default_rng([seed, len(kind)])
    w = dict(MLP_WEIGHTS)
    raw = safetensors_bytes(w)
    n, header, data = _split(raw)
    b = bytearray(raw)
    if kind == "header_flip":
        i = 8 + int(rng.integers(n))
        b[i] ^= int(rng.integers(1, 256))
        return bytes(b)
    if kind == "data_flip":
        i = 8 + n + int(rng.integers(len(data)))
        b[i] ^= int(rng.integers(1, 256))
        return bytes(b)
    if kind == "truncate":
        return bytes(b[: int(rng.integers(1, len(b)))])
    if kind.startswith("header_len_"):
        value = {"header_len_plus1": n + 1, "header_len_minus1": n - 1, "header_len_zero": 0,
                 "header_len_2p63": 2**63, "header_len_max": 2**64 - 1, "header_len_file": len(b)}[kind]
        return struct.pack("<Q", value) + bytes(b[8:])
    if kind == "missing_tensor":
        w.pop("W2")
        return safetensors_bytes(w)
    if kind == "extra_tensor":
        w["extra"] = np.ones(3, np.float32)
        return safetensors_bytes(w)
    if kind == "renamed_tensor":
        w["W2x"] = w.pop("W2")
        return safetensors_bytes(w)
    if kind.startswith("dtype_"):
        w["W1"] = w["W1"].astype({"dtype_f16": np.float16, "dtype_f64": np.float64, "dtype_i32": np.int32,
                                  "dtype_bool": np.bool_}[kind])
        return safetensors_bytes(w)
    if kind == "shape_transposed":
        w["W1"] = np.ascontiguousarray(w["W1"].T)
        return safetensors_bytes(w)
    if kind == "shape_flat":
        w["W1"] = w["W1"].reshape(-1)
        return safetensors_bytes(w)
    if kind == "offsets_overlap":
        header["B1"]["data_offsets"] = [header["W1"]["data_offsets"][0], header["W1"]["data_offsets"][0] + 32]
        return _join(header, data)
    if kind == "offsets_swapped":
        header["B1"]["data_offsets"], header["B2"]["data_offsets"] = header["B2"]["data_offsets"], header["B1"]["data_offsets"]
        return _join(header, data)
    if kind == "offsets_past_end":
        a, _ = header["W2"]["data_offsets"]
        header["W2"]["data_offsets"] = [a + 10**6, a + 10**6 + 96]
        return _join(header, data)
    if kind == "offsets_huge":
        header["W2"]["data_offsets"] = [2**63, 2**63 + 96]
        return _join(header, data)
    if kind == "offsets_negative":
        header["W2"]["data_offsets"] = [-96, 0]
        return _join(header, data)
    if kind == "shape_huge":
        header["W2"]["shape"] = [2**32, 2**32]
        return _join(header, data)
    if kind == "header_not_utf8":
        return _join(json.dumps(header).encode().replace(b'"W1"', b'"W\xff1"'), data)
    if kind == "header_deep_json":
        deep = "[" * 100_000 + "]" * 100_000
        return _join(('{"__metadata__": ' + deep + ", " + json.dumps(header)[1:]).encode(), data)
    if kind == "header_duplicate_key":
        text = json.dumps(header)
        return _join(("{" + '"W2": ' + json.dumps(header["W1"]) + ", " + text[1:]).encode(), data)
    if kind == "header_metadata_weird":
        header["__metadata__"] = {"format": "pt", "\u2028": "x" * 1000}
        return _join(header, data)
    if kind == "empty":
        return b""
    if kind == "eight_zeros":
        return bytes(8)
    raise Fail(FAIL_HARNESS, f"unknown damage {kind!r}")


ST_DAMAGE = ("header_flip", "data_flip", "truncate", "header_len_plus1", "header_len_minus1", "header_len_zero",
             "header_len_2p63", "header_len_max", "header_len_file", "missing_tensor", "extra_tensor",
             "renamed_tensor", "dtype_f16", "dtype_f64", "dtype_i32", "dtype_bool", "shape_transposed", "shape_flat",
             "offsets_overlap", "offsets_swapped", "offsets_past_end", "offsets_huge", "offsets_negative",
             "shape_huge", "header_not_utf8", "header_deep_json", "header_duplicate_key", "header_metadata_weird",
             "empty", "eight_zeros")
SEEDED = {"header_flip": 25, "data_flip": 6, "truncate": 8}


def st_reference(model, raw: bytes):
    """Return (reference, offenders) for a safetensors file: what the safetensors library reads."""
    from safetensors.numpy import load

    try:
        tensors = load(raw)
    except Exception as e:  # noqa: BLE001 - the library refuses: so must luisaml
        return MustFail(f"a weights file the safetensors library rejects ({str(e)[:120]})"), ()
    for name, want in MLP_WEIGHTS.items():
        got = tensors.get(name)
        if got is None:
            return MustFail(f"weights without tensor {name!r}"), (name,)
        if got.dtype != want.dtype or got.shape != want.shape:
            return MustFail(f"tensor {name!r} as {got.dtype}{list(got.shape)}, not {want.dtype}{list(want.shape)}"), (name,)

    def compute():
        try:
            return ort_outputs(with_weights(model, tensors), {"x": X})
        except ReferenceRejected as e:
            raise Fail(FAIL_HARNESS, f"onnxruntime rejects the undamaged model: {e}") from None

    return compute, ()


def blob_reference(model, blob: bytes, offsets: dict[str, list[int]], exact: bool):
    """Return (reference, offenders) for a header-less blob sliced by offsets (exact: the .onnx
    pairing, where the blob must be exactly the name-sorted tensors)."""
    tensors = {}
    for name, want in MLP_WEIGHTS.items():
        a, b = offsets[name]
        if not (0 <= a <= b <= len(blob)) or b - a != want.nbytes:
            return MustFail(f"tensor {name!r} at bytes [{a}, {b}) of a {len(blob)}-byte blob"), (name,)
        tensors[name] = np.frombuffer(blob[a:b], want.dtype).reshape(want.shape)
    if exact and len(blob) != sum(w.nbytes for w in MLP_WEIGHTS.values()):
        return MustFail(f"a {len(blob)}-byte blob for {sum(w.nbytes for w in MLP_WEIGHTS.values())} bytes of weights"), ()
    return (lambda: ort_outputs(with_weights(model, tensors), {"x": X})), ()


BLOB_DAMAGE = ("short1", "long1", "empty", "half", "flip", "is_safetensors")


def blob_damage(kind: str, seed: int) -> bytes:
    blob, _ = blob_bytes(MLP_WEIGHTS)
    rng = np.random.default_rng([seed, len(kind)])
    if kind == "short1":
        return blob[:-1]
    if kind == "long1":
        return blob + b"\0"
    if kind == "empty":
        return b""
    if kind == "half":
        return blob[: len(blob) // 2]
    if kind == "flip":
        b = bytearray(blob)
        b[int(rng.integers(len(b)))] ^= 0x40
        return bytes(b)
    if kind == "is_safetensors":  # a valid safetensors file of another model's tensors
        return safetensors_bytes({"other": np.ones(64, np.float32)})
    raise Fail(FAIL_HARNESS, f"unknown blob damage {kind!r}")


@recipe("weights.damage")
def damaged(ctx, pairing: str, kind: str, seed: int = 0) -> None:
    model = mlp()
    bare = dataless(model)
    safetensors = pairing.endswith("_st")
    raw = st_damage(kind, seed) if safetensors else blob_damage(kind, seed)
    wpath = ctx.path("weights.safetensors" if safetensors else "weights.bin")
    wpath.write_bytes(raw)
    if safetensors:
        reference, names = st_reference(model, raw)
    else:
        _, offsets = blob_bytes(MLP_WEIGHTS)
        reference, names = blob_reference(model, raw, offsets, exact=pairing == "onnx_blob")
    if pairing.startswith("json"):
        # the offsets the JSON model states: those of the undamaged file
        offsets = (_split(safetensors_bytes(MLP_WEIGHTS))[1] if safetensors else None)
        offsets = {k: v["data_offsets"] for k, v in offsets.items()} if safetensors else blob_bytes(MLP_WEIGHTS)[1]
        mpath = ctx.path("model.json")
        mpath.write_text(json.dumps(json_model_doc(bare, offsets)))
    else:
        mpath = ctx.path("model.onnx")
        mpath.write_bytes(bare.SerializeToString())
    expect = Expect((wpath.name, *names), _resolve(reference), rtol=1e-5, atol=1e-5)
    run_and_judge(ctx, None, {"x": X}, expect, weights=str(wpath), model_path=str(mpath), what=f"{pairing} {kind}")


def _resolve(reference):
    if isinstance(reference, MustFail):
        return reference
    from .common import _resolving

    return _resolving(reference)


_CI = {("json_st", "header_flip", 0), ("onnx_st", "missing_tensor", 0), ("json_st", "missing_tensor", 0),
       ("onnx_st", "offsets_overlap", 0), ("json_st", "offsets_overlap", 0), ("onnx_st", "empty", 0),
       ("onnx_st", "header_deep_json", 0), ("json_blob", "short1", 0)}


def cases() -> list[Case]:
    out = []
    for pairing in ("onnx_st", "json_st"):
        for kind in ST_DAMAGE:
            for seed in range(SEEDED.get(kind, 1)):
                out.append(Case(f"weights/{pairing}/{kind}/{seed}", "weights", "weights.damage",
                                dict(pairing=pairing, kind=kind, seed=seed), ci=(pairing, kind, seed) in _CI))
    for pairing in ("json_blob", "onnx_blob"):
        for kind in BLOB_DAMAGE:
            for seed in range(4 if kind == "flip" else 1):
                out.append(Case(f"weights/{pairing}/{kind}/{seed}", "weights", "weights.damage",
                                dict(pairing=pairing, kind=kind, seed=seed), ci=(pairing, kind, seed) in _CI))
    return out
