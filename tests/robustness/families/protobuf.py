"""Protobuf: byte-level damage to .onnx files (truncation, flipped bytes, garbage, empty files) and
external data that points outside the model's folder.

The reference is what the outside tools make of the damaged bytes: when onnx cannot parse them,
luisaml must refuse with an error naming the file; when they parse, onnxruntime decides (its
outputs, or MustFail when it refuses). A flipped byte may land in any name, so an error may name
the file or any name the damaged model holds.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper

from ..harness import Case, MustFail, recipe
from ..models import BASES, F, feeds_for, make_model, names_in, vi
from .common import Expect, ort_reference, run_and_judge

DAMAGE = ("truncate", "flip", "flip4", "garbage_tail", "zero_run")


def damage(raw: bytes, kind: str, rng: np.random.Generator) -> bytes:
    """Return raw damaged one way, seeded."""
    b = bytearray(raw)
    if kind == "truncate":
        return bytes(b[: int(rng.integers(1, len(b)))])
    if kind == "flip":
        i = int(rng.integers(len(b)))
        b[i] ^= int(rng.integers(1, 256))
    elif kind == "flip4":
        for i in rng.integers(0, len(b), 4):
            b[int(i)] = int(rng.integers(0, 256))
    elif kind == "garbage_tail":
        b += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    elif kind == "zero_run":
        i, n = int(rng.integers(len(b))), int(rng.integers(1, 16))
        b[i : i + n] = bytes(len(b[i : i + n]))
    return bytes(b)


@recipe("protobuf.damage")
def damaged(ctx, base: str, kind: str, seed: int) -> None:
    model = BASES[base]()
    feeds = feeds_for(model, batch=3, seed=seed)
    if base == "if":
        feeds["c"] = np.array(seed % 2 == 1)
    raw = damage(model.SerializeToString(), kind, np.random.default_rng([seed, DAMAGE.index(kind), len(base)]))
    path = str(ctx.path("damaged.onnx"))
    with open(path, "wb") as f:
        f.write(raw)
    offenders = {"damaged.onnx"}
    try:
        parsed = onnx.load_from_string(raw)
        offenders |= names_in(parsed)
        reference = ort_reference(raw, feeds, "a damaged model onnxruntime rejects")
    except Exception as e:  # noqa: BLE001 - what onnx cannot parse, nothing should accept
        reference = MustFail(f"bytes onnx cannot parse ({type(e).__name__})")
    run_and_judge(ctx, None, feeds, Expect(tuple(sorted(offenders)), _lazy(reference), rtol=1e-4, atol=1e-4),
                  model_path=path, what=f"{kind} damage")


def _lazy(reference):
    """Expect's ORT marker means "compute it"; here the reference is already a callable or MustFail."""
    if isinstance(reference, MustFail):
        return reference
    from .common import _resolving

    return _resolving(reference)


@recipe("protobuf.bytes")
def fixed_bytes(ctx, key: str) -> None:
    """Whole files that are not models: empty, zeros, random, text, a directory, a missing path."""
    rng = np.random.default_rng(len(key))
    path = ctx.path(f"{key}.onnx")
    contents = {
        "empty": b"", "one_byte": b"\x08", "zeros_4k": bytes(4096), "random_4k": rng.bytes(4096),
        "text": b"this is not a model\n", "json_text": b'{"graph": {}}', "huge_varint": b"\x0a" + b"\xff" * 10,
        "field_length_2p62": b"\x3a" + bytes([0xFF] * 8 + [0x3F]) + b"abc",
    }
    offender = str(path.name)
    if key == "directory":
        path.mkdir()
    elif key == "missing":
        pass
    elif key == "fifo":
        os.mkfifo(path)  # opening it for reading would block forever: luisaml must not hang
    else:
        path.write_bytes(contents[key])
    x = np.zeros((2, 4), np.float32)
    run_and_judge(ctx, None, {"x": x}, Expect(offender, MustFail(f"{key} as a model")), model_path=str(path))


@recipe("protobuf.external_data")
def external_data(ctx, where: str) -> None:
    """An initializer whose external data lies outside the model's folder (or nowhere)."""
    sub = ctx.path("model_dir")
    sub.mkdir()
    secret = ctx.path("secret.bin")
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    location = {"parent": "../secret.bin", "absolute": str(secret), "missing": "nothing.bin",
                "symlink": "link.bin", "proc": "/proc/self/environ", "offset_past_end": "w.bin"}[where]
    if where == "symlink":
        os.symlink(secret, sub / "link.bin")
    if where == "offset_past_end":
        (sub / "w.bin").write_bytes(bytes(16))
    t = onnx.TensorProto(name="W_ext", data_type=F, dims=[4], data_location=onnx.TensorProto.EXTERNAL)
    entries = [("location", location)] + ([("offset", "1000"), ("length", "16")] if where == "offset_past_end" else [])
    for k, v in entries:
        t.external_data.add(key=k, value=v)
    m = make_model([helper.make_node("Add", ["x", "W_ext"], ["y"], name="add_ext")], [vi("x", F, ["N", 4])],
                   [vi("y", F, ["N", 4])], infer=False)
    m.graph.initializer.append(t)
    path = sub / "model.onnx"
    path.write_bytes(m.SerializeToString())
    run_and_judge(ctx, None, {"x": np.zeros((2, 4), np.float32)},
                  Expect(("W_ext", location, os.path.basename(location)), MustFail(f"external data at {location}")),
                  model_path=str(path))


def cases() -> list[Case]:
    out = []
    for base in BASES:
        for kind in DAMAGE:
            for seed in range(10 if kind in ("truncate", "flip") else 5):
                out.append(Case(f"protobuf/{base}/{kind}/{seed}", "protobuf", "protobuf.damage",
                                dict(base=base, kind=kind, seed=seed), ci=(seed == 0 and kind == "flip")))
    for key in ("empty", "one_byte", "zeros_4k", "random_4k", "text", "json_text", "huge_varint", "field_length_2p62",
                "directory", "missing", "fifo"):
        out.append(Case(f"protobuf/file/{key}", "protobuf", "protobuf.bytes", dict(key=key), ci=key == "empty",
                        timeout=60))
    for where in ("parent", "absolute", "missing", "symlink", "proc", "offset_past_end"):
        out.append(Case(f"protobuf/external_data/{where}", "protobuf", "protobuf.external_data", dict(where=where),
                        ci=where == "parent"))
    return out
