"""Weight files: a real safetensors file, or a header-less blob of name-sorted tensors."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from ..model import ModelError

WeightsArg = "str | os.PathLike | bytes | dict[str, np.ndarray] | None"


@dataclass
class WeightSource:
    """Tensors by name (safetensors or a dict) and/or raw bytes that offsets index into."""

    origin: str
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    # the bytes that `data_offsets` index: a raw blob, or a safetensors file's data section
    data: bytes | None = None
    is_safetensors: bool = False


def _safetensors_header_len(raw: bytes) -> int | None:
    """Return the header length if `raw` is a safetensors file, else None."""
    if len(raw) < 10:
        return None
    (n,) = struct.unpack("<Q", raw[:8])
    if n < 2 or 8 + n > len(raw) or raw[8:9] != b"{":
        return None
    try:
        json.loads(raw[8 : 8 + n])
    except ValueError:
        return None
    return n


def read_weights(weights) -> WeightSource | None:
    """Return the WeightSource of a path, bytes or dict; safetensors is told apart by content."""
    if weights is None:
        return None
    if isinstance(weights, dict):
        return WeightSource("dict", {k: np.asarray(v) for k, v in weights.items()})
    if isinstance(weights, (str, os.PathLike)):
        origin = os.fspath(weights)
        try:
            with open(origin, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ModelError(f"cannot read weights file '{origin}': {e.strerror}") from e
    elif isinstance(weights, (bytes, bytearray, memoryview, np.ndarray)):
        origin, raw = "weight bytes", bytes(memoryview(weights).cast("B"))
    else:
        raise TypeError(f"weights must be a path, bytes or a dict of arrays, not {type(weights).__name__}")
    n = _safetensors_header_len(raw)
    if n is None:
        return WeightSource(origin, data=raw)
    from safetensors.numpy import load

    try:
        tensors = load(raw)
    except Exception as e:
        raise ModelError(f"{origin}: not a valid safetensors file: {e}") from e
    return WeightSource(origin, tensors, data=raw[8 + n :], is_safetensors=True)


def slice_range(src: WeightSource, name: str, start: int, end: int, nbytes: int) -> bytes:
    """Return bytes [start, end) of the source's data, checking the range against the tensor size."""
    if src.data is None:
        raise ModelError(f"initializer '{name}': has data_offsets but {src.origin} holds no raw data")
    if not (0 <= start <= end):
        raise ModelError(f"initializer '{name}': data_offsets [{start}, {end}] is not a valid range")
    if end - start != nbytes:
        raise ModelError(
            f"initializer '{name}': data_offsets [{start}, {end}] span {end - start} bytes, expected {nbytes}"
        )
    if end > len(src.data):
        raise ModelError(
            f"initializer '{name}': data_offsets [{start}, {end}] reach past the end of {src.origin} "
            f"({len(src.data)} bytes)"
        )
    return src.data[start:end]
