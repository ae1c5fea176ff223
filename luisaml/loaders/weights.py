"""Weight files: a valid safetensors file, or exactly a header-less blob of the model's tensors.

A file is taken as safetensors only when its header is valid by the format's rules (header JSON,
unique keys, known dtypes, shape x itemsize equal to each tensor's byte span, spans inside the data
section, no overlaps, the data section covered without holes): `parse_safetensors` checks them on
the header alone and says which rule a file breaks. The tensors of a valid file are then read by
the `safetensors` library (a file memory-mapped through `safe_open`, bytes through `deserialize`),
which checks the file again. Anything else is held as a header-less blob, which the model must then
fit exactly (`bind_weights`, the JSON loader); a blob that started like a safetensors file but
failed those rules is reported as an invalid safetensors file, with why."""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from dataclasses import dataclass, field

import numpy as np
import safetensors

from ..errors import WeightsError
from ..limits import DEFAULT, Limits

WeightsArg = "str | os.PathLike | bytes | dict[str, np.ndarray] | None"

# The safetensors dtypes and their width in bits; None where numpy has no such type (the tensor
# is validated but cannot be bound).
SAFETENSORS_DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "?"), "U8": (8, "u1"), "I8": (8, "i1"), "U16": (16, "<u2"), "I16": (16, "<i2"),
    "U32": (32, "<u4"), "I32": (32, "<i4"), "U64": (64, "<u8"), "I64": (64, "<i8"),
    "F16": (16, "<f2"), "F32": (32, "<f4"), "F64": (64, "<f8"),
    "BF16": (16, None), "F8_E5M2": (8, None), "F8_E4M3": (8, None), "F8_E8M0": (8, None),
    "F8_E4M3FNUZ": (8, None), "F8_E5M2FNUZ": (8, None),
    "F4": (4, None), "F6_E2M3": (6, None), "F6_E3M2": (6, None), "C64": (64, None),
}
# The format caps its header at 100 MB (safetensors' MAX_HEADER_SIZE).
MAX_HEADER = 100_000_000


@dataclass
class WeightSource:
    """Tensors by name (safetensors or a dict) and/or raw bytes that offsets index into."""

    origin: str
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    # the bytes that `data_offsets` index: a raw blob (None for safetensors: its tensors go by name)
    data: bytes | None = None
    is_safetensors: bool = False
    # safetensors tensors of a dtype numpy cannot hold (BF16, F8, ...): name -> dtype
    unreadable: dict[str, str] = field(default_factory=dict)
    # for a blob: why it is not a safetensors file, and whether it looked like one (an 8-byte
    # header length that fits the file, then '{'), so a misfit can say "invalid safetensors"
    not_safetensors: str = ""
    looks_like_safetensors: bool = False

    @property
    def by_name(self) -> bool:
        """Whether tensors are found by name (safetensors, a dict) rather than by offset."""
        return self.is_safetensors or bool(self.tensors)

    def missing(self, name: str, what: str) -> WeightsError:
        """Return the error for a tensor the model needs under `name` and this source lacks."""
        if name in self.unreadable:
            return WeightsError(
                f"{what} '{name}': {self.origin} holds it as {self.unreadable[name]}, which luisaml cannot read "
                "(convert it to F32, F16, I64, I32, U8 or BOOL)"
            )
        return WeightsError(f"{what} '{name}': {self.origin} has no tensor of that name")

    def misfit(self, detail: str) -> WeightsError:
        """Return the error for a blob whose size does not fit the model exactly (detail says how)."""
        if self.looks_like_safetensors:
            return WeightsError(f"{self.origin}: invalid safetensors file: {self.not_safetensors}")
        why = f" ({self.not_safetensors})" if self.not_safetensors else ""
        return WeightsError(
            f"{self.origin} is neither a safetensors file{why} nor a header-less blob of exactly the "
            f"model's weights: {detail}"
        )


def _no_duplicates(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key '{dup}' appears twice")
    return out


def _entry(name, e, where: str) -> tuple[str, list[int], int, int]:
    """Return (dtype, shape, start, end) of one header entry, or raise ValueError saying what is wrong."""
    if not isinstance(e, dict):
        raise ValueError(f"{where} is {type(e).__name__}, expected an object with dtype, shape, data_offsets")
    dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"{where} has dtype {dtype!r}, expected one of {', '.join(SAFETENSORS_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{where} has shape {shape!r}, expected a list of non-negative integers")
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            and 0 <= offs[0] <= offs[1]):
        raise ValueError(f"{where} has data_offsets {offs!r}, expected [start, end] with 0 <= start <= end")
    bits = math.prod(shape) * SAFETENSORS_DTYPES[dtype][0]
    if bits % 8 or bits // 8 != offs[1] - offs[0]:
        raise ValueError(
            f"{where} is {dtype}{shape}, {bits / 8:g} bytes, but its data_offsets {offs} span {offs[1] - offs[0]}"
        )
    return dtype, shape, offs[0], offs[1]


def parse_safetensors(raw: bytes, file_size: int | None = None) -> tuple[int, dict[str, tuple[str, list[int], int, int]]]:
    """Return (header length, {name: (dtype, shape, start, end)}) of a valid safetensors file, or
    raise ValueError saying which rule of the format it breaks. `raw` is the file's bytes, or, with
    `file_size`, its first bytes (the header: the data section is checked by its size only)."""
    total = len(raw) if file_size is None else file_size
    if total < 8:
        raise ValueError(f"{total} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > total - 8:
        raise ValueError(f"its first 8 bytes give a header length of {n}, beyond the file's {total} bytes")
    if n > MAX_HEADER:
        raise ValueError(f"header length {n} exceeds the format's limit of {MAX_HEADER} bytes")
    if raw[8:9] != b"{":
        raise ValueError("its header does not start with '{'")
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"its {n}-byte header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ must map strings to strings")
    entries = {name: _entry(name, e, f"tensor '{name}'") for name, e in header.items()}
    size = total - 8 - n
    # The format requires the data section to be covered by the tensors, in order, without holes.
    pos, prev = 0, None
    for name, (_, _, start, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if end > size:
            raise ValueError(f"tensor '{name}' data_offsets [{start}, {end}] reach past the data section ({size} bytes)")
        if start < pos:
            raise ValueError(f"tensor '{name}' bytes [{start}, {end}) overlap tensor '{prev}' (which ends at {pos})")
        if start > pos:
            raise ValueError(f"data section bytes [{pos}, {start}) belong to no tensor")
        pos, prev = end, name
    if pos != size:
        raise ValueError(f"data section bytes [{pos}, {size}) belong to no tensor")
    return n, entries


def read_weights(weights, *, limits: Limits = DEFAULT) -> WeightSource | None:
    """Return the WeightSource of a path, bytes or dict; a valid safetensors file is told apart by
    content, anything else is a header-less blob the model must fit exactly."""
    if weights is None:
        return None
    if isinstance(weights, dict):
        tensors = {}
        for k, v in weights.items():
            if not isinstance(k, str):
                raise WeightsError(f"weights dict: key {k!r} is not a tensor name (str)")
            arr = np.asarray(v)
            if arr.dtype == object:
                raise WeightsError(f"weights dict: '{k}' is not a numeric array ({type(v).__name__})")
            tensors[k] = arr
        return WeightSource("weights dict", tensors)
    if isinstance(weights, (str, os.PathLike)):
        return _read_file(weights, limits)
    if not isinstance(weights, (bytes, bytearray, memoryview, np.ndarray)):
        raise TypeError(f"weights must be a path, bytes or a dict of arrays, not {type(weights).__name__}")
    try:
        raw = bytes(memoryview(weights).cast("B"))
    except (TypeError, ValueError) as e:  # a non-contiguous array, say
        raise WeightsError(f"weight bytes: cannot view as bytes: {e}") from e
    if not raw:
        raise WeightsError("weight bytes is empty (0 bytes)")
    try:
        _, entries = parse_safetensors(raw)
    except ValueError as e:
        return _blob("weight bytes", raw, e)
    with _library_reads("weight bytes"):
        views = safetensors.deserialize(raw)
    return _safetensors_source("weight bytes", entries,
                               {k: np.frombuffer(v["data"], np.dtype(SAFETENSORS_DTYPES[v["dtype"]][1])).reshape(v["shape"])
                                for k, v in views if SAFETENSORS_DTYPES[v["dtype"]][1] is not None})


def _read_file(path, limits: Limits) -> WeightSource:
    """Return the WeightSource of a weights file: its header checked alone, then its tensors read by
    the safetensors library (memory-mapped), or the whole file as a blob when it is not one."""
    origin = f"weights file '{os.fspath(path)}'"
    try:
        size = os.stat(path).st_size
        limits.check_bytes(origin, size, "weight_bytes")
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if n <= min(MAX_HEADER, size - 8):  # (a longer one fails the format's rules on its length)
                head += f.read(n)
            try:
                _, entries = parse_safetensors(head, size)
            except ValueError as e:
                f.seek(0)
                raw = f.read()
                if not raw:
                    raise WeightsError(f"{origin} is empty (0 bytes)") from None
                return _blob(origin, raw, e)
    except OSError as e:
        raise WeightsError(f"cannot read {origin}: {e.strerror}") from e
    with _library_reads(origin), safetensors.safe_open(path, framework="numpy") as st:
        tensors = {k: st.get_tensor(k) for k, e in entries.items() if SAFETENSORS_DTYPES[e[0]][1] is not None}
    return _safetensors_source(origin, entries, tensors)


def _blob(origin: str, raw: bytes, why: ValueError) -> WeightSource:
    """Return the WeightSource of bytes that are not a safetensors file (`why`)."""
    looks = len(raw) >= 10 and 2 <= struct.unpack("<Q", raw[:8])[0] <= len(raw) - 8 and raw[8:9] == b"{"
    return WeightSource(origin, data=raw, not_safetensors=str(why), looks_like_safetensors=looks)


def _safetensors_source(origin: str, entries: dict, tensors: dict[str, np.ndarray]) -> WeightSource:
    """Return the WeightSource of a safetensors file's tensors; those numpy cannot hold named as unreadable."""
    unreadable = {name: e[0] for name, e in entries.items() if name not in tensors}
    return WeightSource(origin, tensors, is_safetensors=True, unreadable=unreadable)


@contextlib.contextmanager
def _library_reads(origin: str):
    """Turn the safetensors library's refusal of a file whose header passed (a file changed since
    it was checked) into the WeightsError that names it."""
    try:
        yield
    except (safetensors.SafetensorError, OSError) as e:
        raise WeightsError(f"{origin}: invalid safetensors file: the safetensors library refuses it: {e}") from e


def slice_range(src: WeightSource, name: str, start: int, end: int, nbytes: int) -> bytes:
    """Return bytes [start, end) of the source's data, checking the range against the tensor size."""
    if src.data is None:
        raise WeightsError(f"initializer '{name}': has data_offsets but {src.origin} holds no raw data")
    if not (0 <= start <= end):
        raise WeightsError(f"initializer '{name}': data_offsets [{start}, {end}] is not a valid range")
    if end - start != nbytes:
        raise WeightsError(
            f"initializer '{name}': data_offsets [{start}, {end}] span {end - start} bytes, expected {nbytes}"
        )
    if end > len(src.data):
        raise WeightsError(
            f"initializer '{name}': data_offsets [{start}, {end}] reach past the end of {src.origin} "
            f"({len(src.data)} bytes)"
        )
    return src.data[start:end]


def check_no_overlap(ranges: list[tuple[str, int, int]], where: str) -> None:
    """Raise WeightsError naming both tensors if two non-empty byte ranges [start, end) overlap."""
    prev_name, prev_end = None, 0
    for name, start, end in sorted(((n, s, e) for n, s, e in ranges if e > s), key=lambda r: (r[1], r[2])):
        if prev_name is not None and start < prev_end:
            raise WeightsError(
                f"{where}: initializer '{name}' bytes [{start}, {end}) overlap initializer '{prev_name}' "
                f"(which ends at {prev_end}); each tensor needs bytes of its own"
            )
        if end > prev_end:
            prev_name, prev_end = name, end
