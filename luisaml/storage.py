"""Where a tensor lives inside the kernel, and how a load or a store of one element is written.

Operators never write a place directly: they ask a Tensor's storage for the DSL of element `i`,
so one operator template serves weights in the blob, inputs in a buffer, intermediates in
registers and constants folded into the code."""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .dtypes import DType
from .errors import CompileError


def literal(value, dtype: DType) -> str:
    """Return the DSL literal of one value of `dtype`."""
    if dtype.is_bool:
        return "True" if bool(value) else "False"
    if dtype.dsl in ("float", "half"):
        v = float(np.float32(value)) if dtype.dsl == "float" else float(np.float16(value))
        if math.isnan(v):
            text = "quiet_nan()"  # not a literal: LuisaCompute's CUDA codegen aborts on a NaN literal
        elif math.isinf(v):
            text = "INF" if v > 0 else "(-INF)"
        else:
            text = repr(v)
            if v < 0:
                text = f"({text})"
        return text if dtype.dsl == "float" else f"half({text})"
    v = int(value)
    lo, hi = (0, 2**32 - 1) if dtype.dsl == "uint" else (-(2**31), 2**31 - 1)
    if not lo <= v <= hi:
        # the DSL's literal conversion aborts the process on such a value: refuse it here
        raise CompileError(
            f"{dtype.name.lower()} value {v} does not fit the kernel's 32-bit integers (range {lo}..{hi})"
        )
    if dtype.dsl == "uint":
        return f"uint({v})"
    return f"({v})" if v < 0 else str(v)


def add_index(offset: int | str, i: str) -> str:
    """Return the DSL of `offset + i`, leaving out a zero offset."""
    if offset in (0, "0"):
        return i
    if i == "0":
        return str(offset)
    return f"{offset} + {i}"


def byte_load(buffer: str, address: str) -> str:
    """Return the DSL of the byte at `address` of a ByteBuffer, read with an aligned 32-bit load."""
    a = address if address.replace("_", "").isalnum() else f"({address})"
    return f"(({buffer}.read(uint, ({a} // 4) * 4) >> uint(({a} % 4) * 8)) & uint(255))"


class Storage:
    """Base: renders loads and stores of element `i` (a DSL int expression)."""

    writable = False

    def load(self, i: str) -> str:
        raise NotImplementedError

    def byte_address(self) -> tuple[str, str]:
        """Return (ByteBuffer name, byte offset expression) of element 0, for word-wise readers."""
        raise TypeError(f"{type(self).__name__} storage is not byte-addressable")

    def store(self, i: str, value: str) -> str:
        raise TypeError(f"{type(self).__name__} storage is read-only")

    def store_parts(self, i: str, value: str, at: str | None = None) -> tuple[list[str], str]:
        """Return (the statements computing what a store of value at i writes, the store itself):
        the same as store, in two parts, for a tile that writes only after all it reads; `at`: the
        same element as i, another expression of it for the write (Dense's row bases)."""
        return [], self.store(i if at is None else at, value)

    def atomic_add(self, i: str, value: str) -> str:
        """Return the DSL expression adding value to element i atomically (it yields the old value)."""
        raise TypeError(f"{type(self).__name__} storage has no atomic operations")


@dataclass
class Local(Storage):
    """A local array (a register slot of the allocator, or an array parameter)."""

    array: str
    offset: int = 0
    writable = True

    def load(self, i: str) -> str:
        return f"{self.array}[{add_index(self.offset, i)}]"

    def store(self, i: str, value: str) -> str:
        return f"{self.array}[{add_index(self.offset, i)}] = {value}"


@dataclass
class Buffer(Storage):
    """A typed device buffer; `base` is this sample's first element (a DSL expression); `held`: "half" for a
    float tensor whose buffer holds halves (precision="fp16"'s input, output and activations where the layers
    run as stages: Plan.half_io, Plan.half_activations), read as float and stored rounded to half."""

    buffer: str
    base: str = "0"
    held: str = field(default="", kw_only=True)
    writable = True

    def load(self, i: str) -> str:
        read = f"{self.buffer}.read({add_index(self.base, i)})"
        return f"float({read})" if self.held else read

    def store(self, i: str, value: str) -> str:
        return f"{self.buffer}.write({add_index(self.base, i)}, {f'{self.held}({value})' if self.held else value})"

    def atomic_add(self, i: str, value: str) -> str:
        if self.held:
            raise CompileError(f"no atomic add into '{self.buffer}', held as {self.held}")
        return f"{self.buffer}.atomic_fetch_add({add_index(self.base, i)}, {value})"


@dataclass
class Capped(Buffer):
    """A run-time sized output's buffer allocated at a capacity (luisaml/dynamic.py, counted on the
    device): a store at or past `limit` elements (a DSL expression: a word of the run's state) is
    skipped; the runtime sees the total pass the capacity and repeats the run with a larger one."""

    limit: str = "0"

    def store(self, i: str, value: str) -> str:
        at = add_index(self.base, i)
        return f"if ({at}) < {self.limit}: {self.buffer}.write({at}, {value})"


@dataclass
class Weight(Storage):
    """A tensor in the weight blob, read from the ByteBuffer `weights` by byte offset."""

    byte_offset: int
    dtype: DType
    blob: str = "weights"

    def byte_address(self) -> tuple[str, str]:
        return self.blob, str(self.byte_offset)

    def load(self, i: str) -> str:
        size = self.dtype.itemsize
        if self.dtype.is_byte:
            return byte_load(self.blob, add_index(self.byte_offset, i))
        scaled = i if size == 1 else (f"({i}) * {size}" if not i.isdigit() else str(int(i) * size))
        if i.isdigit():
            return f"{self.blob}.read({self.dtype.dsl}, {self.byte_offset + int(i) * size})"
        return f"{self.blob}.read({self.dtype.dsl}, {add_index(self.byte_offset, scaled)})"


@dataclass
class Bytes(Storage):
    """A uint8 tensor in a ByteBuffer argument; `base` is this sample's first byte."""

    buffer: str
    base: str = "0"

    def byte_address(self) -> tuple[str, str]:
        return self.buffer, self.base

    def load(self, i: str) -> str:
        return byte_load(self.buffer, add_index(self.base, i))

    def write_word(self, address: str, value: str) -> str:
        """Return the DSL writing the 32-bit value at byte `address` (a multiple of 4) of an output
        its node writes word-wise (a run-time sized uint8 output)."""
        return f"{self.buffer}.write({add_index(self.base, address)}, {value})"


@dataclass
class CappedBytes(Bytes):
    """A run-time sized uint8 output counted at a capacity (luisaml/dynamic.py), as Capped: a word
    written at or past `limit` bytes (a word of the run's state) is skipped (the buffer holds whole
    words, so a word that starts below the limit fits)."""

    limit: str = "0"

    def write_word(self, address: str, value: str) -> str:
        at = add_index(self.base, address)
        return f"if ({at}) < {self.limit}: {self.buffer}.write({at}, {value})"


@dataclass
class Scalar(Storage):
    """A constant whose elements are all equal: a literal."""

    value: object
    dtype: DType

    def load(self, i: str) -> str:
        return literal(self.value, self.dtype)


@dataclass
class Linear(Storage):
    """A constant arithmetic progression start + step * i, computed instead of stored."""

    start: object
    step: object
    dtype: DType

    def load(self, i: str) -> str:
        if self.dtype.dsl in ("float", "half"):
            conv = f"{self.dtype.dsl}({i})"
        else:
            conv = f"({i})"  # an index like `i % 4`: `2 * i % 4` would be (2 * i) % 4
        return f"({literal(self.start, self.dtype)} + {literal(self.step, self.dtype)} * {conv})"


@dataclass(eq=False)
class Tensor:
    """A tensor as the kernel sees it: per-sample shape (the batch dimension is 1), dtype, storage.

    Where a tensor lives differs between the functions of one module (a local array in
    `forward`, a buffer region in a stage kernel), so it is not an attribute the emission writes:
    `storage` looks the tensor up in the bindings of the emission in progress (`bind`), and falls
    back to `home`, the storage a constant has everywhere (a literal, the weight blob)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    batched: bool = False
    value: np.ndarray | None = None  # known on the host (constants)
    home: Storage | None = None
    strides: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.strides = row_major_strides(self.shape)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def storage(self) -> Storage | None:
        """The storage of this tensor in the emission in progress (see the class docstring)."""
        for table in reversed(_BINDINGS.get()):
            st = table.get(id(self))
            if st is not None:
                return st
        return self.home

    def load(self, i: str) -> str:
        st = self.storage
        if st is None:
            raise CompileError(f"internal error: tensor '{self.name}' has no storage in this function")
        return st.load(i)

    def store(self, i: str, value: str) -> str:
        st = self.storage
        if st is None:
            raise CompileError(f"internal error: tensor '{self.name}' has no storage in this function")
        return st.store(i, value)

    def store_parts(self, i: str, value: str, at: str | None = None) -> tuple[list[str], str]:
        """Return store(i, value) as (the statements before the write, the write): Storage.store_parts."""
        st = self.storage
        if st is None:
            raise CompileError(f"internal error: tensor '{self.name}' has no storage in this function")
        return st.store_parts(i, value) if at is None else st.store_parts(i, value, at)


# the binding tables of the emissions in progress, innermost last (a subgraph's over its parent's)
_BINDINGS: contextvars.ContextVar[tuple[dict[int, Storage], ...]] = contextvars.ContextVar("bindings", default=())


@contextlib.contextmanager
def bind(table: dict[Tensor, Storage]) -> Iterator[None]:
    """Give tensors these storages while the block emits (over the bindings already active)."""
    token = _BINDINGS.set(_BINDINGS.get() + ({id(t): st for t, st in table.items()},))
    try:
        yield
    finally:
        _BINDINGS.reset(token)


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Return the element strides of a C-ordered array of that shape."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def constant_storage(value: np.ndarray, dtype: DType) -> Storage | None:
    """Return a Scalar or Linear storage when a constant has that pattern, else None."""
    flat = np.asarray(value).reshape(-1)
    if dtype.is_byte:
        return None  # bytes are read word-wise from the blob
    if flat.size == 0:
        return Scalar(0, dtype)
    if np.all(flat == flat[0]) and not (dtype.is_float and np.isnan(flat[0])) or (
        dtype.is_float and np.all(np.isnan(flat))
    ):
        return Scalar(flat[0].item(), dtype)
    if flat.size >= 3 and not dtype.is_bool:
        kind = np.dtype(dtype.kernel_numpy)
        info = np.finfo(kind) if kind.kind == "f" else np.iinfo(kind)
        # most constants (weights) are no progression, which their first three values tell: the checks
        # below, made on those three only, then refuse it without casting and scanning the whole array
        # (a third of the time a ResNet-18 build, or a .lml load, spends on its constants)
        head = flat[:3]
        if head.dtype.kind == "f" and not np.all(np.isfinite(head)) or head.min() < info.min or head.max() > info.max:
            return None
        k3 = head.astype(kind).astype(np.float64)
        if k3[0] + (k3[1] - k3[0]) * 2.0 != k3[2]:
            return None
        # values past the kernel type's range make no pattern: the blob's conversion (dtypes.to_kernel)
        # refuses them by name, where a cast here would wrap an int64 into a wrong progression, or
        # overflow a float64 to inf (numpy warns)
        finite = flat[np.isfinite(flat)] if flat.dtype.kind == "f" else flat
        if finite.size and (finite.min() < info.min or finite.max() > info.max):
            return None
        kernel = flat.astype(kind)
        if not np.all(np.isfinite(kernel.astype(np.float64))):
            return None
        # exact in real arithmetic, so a fused multiply-add and separate ops give the same values
        start, step = kernel[0].astype(np.float64), kernel[1].astype(np.float64) - kernel[0].astype(np.float64)
        products = step * np.arange(flat.size, dtype=np.float64)
        rebuilt = start + products
        # products or a step past the kernel type's range are not exact: checked here, before any cast
        # (a cast past float32's range would overflow to inf, and numpy warns about it)
        lo, hi = float(info.min), float(info.max)
        in_range = lo <= step <= hi and bool(np.all((products >= lo) & (products <= hi)))
        with np.errstate(invalid="ignore"):  # (float(iinfo.max) rounds up for int64: one past its range)
            exact = in_range and np.array_equal(products.astype(kernel.dtype).astype(np.float64), products)
        if exact and np.array_equal(rebuilt, kernel.astype(np.float64)) and step == step.astype(kernel.dtype):
            return Linear(kernel[0].item(), kernel.dtype.type(step).item(), dtype)
    return None


@dataclass
class Value(Storage):
    """A one-element tensor held in a DSL variable (a loop counter, a condition)."""

    name: str

    def load(self, i: str) -> str:
        return self.name
