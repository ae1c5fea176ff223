"""The element types luisaml knows: ONNX enum, numpy dtype, and how a kernel holds them.

float64 and int64 live in 32 bits: LuisaCompute has no double and luisa-python's 64-bit integer
arithmetic is mistyped, so int64 is held as int32 and float64 (opt-in) as float32; a value that does
not fit is an error at the boundary, never a silent truncation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ModelError, RangeError

# ONNX's TensorProto.DataType numbers, fixed by its spec: written out so that this module (and so
# luisaml.load of a .lml artifact) does not import onnx; tests/test_artifact.py checks them
ONNX_TYPES: dict[str, int] = {
    "UNDEFINED": 0, "FLOAT": 1, "UINT8": 2, "INT8": 3, "UINT16": 4, "INT16": 5, "INT32": 6, "INT64": 7,
    "STRING": 8, "BOOL": 9, "FLOAT16": 10, "DOUBLE": 11, "UINT32": 12, "UINT64": 13, "COMPLEX64": 14,
    "COMPLEX128": 15, "BFLOAT16": 16,
}
_ONNX_NAMES = {v: k for k, v in ONNX_TYPES.items()}


@dataclass(frozen=True)
class DType:
    """One ONNX element type and its representation inside a kernel."""

    name: str  # ONNX TensorProto name, e.g. "FLOAT"
    onnx: int  # TensorProto enum value
    numpy: np.dtype  # host dtype, exactly as ONNX says
    dsl: str  # luisa-python scalar type that holds it inside the kernel
    kernel_numpy: np.dtype  # host dtype of the kernel's buffers and blob entries

    # float64 computed in float32 is arithmetic like float (opt-in: compile(float64="float32"))
    computes_as_float: bool = False

    @property
    def is_float(self) -> bool:
        """float or float16 (or float64 computed as float32, when asked for): what generic
        arithmetic accepts."""
        return self.name in ("FLOAT", "FLOAT16") or self.computes_as_float

    @property
    def is_byte(self) -> bool:
        """uint8: held in a ByteBuffer and read with 32-bit loads."""
        return self.dsl == "ubyte"

    @property
    def is_int(self) -> bool:
        return self.dsl in ("int", "uint") and self.name != "DOUBLE"

    @property
    def is_bool(self) -> bool:
        return self.dsl == "bool"

    @property
    def itemsize(self) -> int:
        """Bytes of one element inside the kernel."""
        return self.kernel_numpy.itemsize

    def __repr__(self) -> str:
        return self.name.lower()


def _dt(name: str, np_dtype, dsl: str, kernel_np=None) -> DType:
    return DType(name, ONNX_TYPES[name], np.dtype(np_dtype), dsl, np.dtype(kernel_np or np_dtype))


# int64 lives in 32-bit registers inside a kernel: luisa-python's 64-bit integer arithmetic
# is unusable (long+long is typed uint). Every int64 that enters a kernel is range-checked on
# the host, so a value that does not fit is an error, never a silent truncation.
FLOAT = _dt("FLOAT", np.float32, "float")
FLOAT16 = _dt("FLOAT16", np.float16, "half")
INT32 = _dt("INT32", np.int32, "int")
INT64 = _dt("INT64", np.int64, "int", np.int32)
BOOL = _dt("BOOL", np.bool_, "bool")
UINT32 = _dt("UINT32", np.uint32, "uint")
# Bytes (a NanoVDB grid, say) stay packed in a ByteBuffer; operators that take them read words.
UINT8 = _dt("UINT8", np.uint8, "ubyte")
# float64 is held as float32 inside kernels. Only operators that define their arithmetic in
# float32 accept it (fVDB's transforms); generic arithmetic rejects it (is_float is False).
DOUBLE = _dt("DOUBLE", np.float64, "float", np.float32)

# The same float64, for a model compiled with float64="float32": generic operators compute it in
# float32 (about 7 significant digits), the host converts at the kernel's boundary.
DOUBLE_AS_FLOAT = DType("DOUBLE", ONNX_TYPES["DOUBLE"], np.dtype(np.float64), "float", np.dtype(np.float32), True)

SUPPORTED: dict[int, DType] = {d.onnx: d for d in (FLOAT, FLOAT16, INT32, INT64, BOOL, UINT32, UINT8, DOUBLE)}
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in SUPPORTED.values()}


class UnsupportedDType(ModelError, TypeError):
    """An element type the kernel cannot hold."""


def onnx_name(elem_type: int) -> str:
    """Return the TensorProto name of an ONNX element type number."""
    if elem_type in _ONNX_NAMES:
        return _ONNX_NAMES[elem_type]
    from onnx import TensorProto  # the newer types (float8, int4, ...)

    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"<elem_type {elem_type}>"


def from_onnx(elem_type: int) -> DType:
    """Return the DType of an ONNX element type, or raise UnsupportedDType naming it."""
    try:
        return SUPPORTED[elem_type]
    except KeyError:
        raise UnsupportedDType(
            f"element type {onnx_name(elem_type)} is not supported "
            f"(supported: {', '.join(d.name for d in SUPPORTED.values())})"
        ) from None


def from_numpy(dtype) -> DType:
    """Return the DType of a numpy dtype, or raise UnsupportedDType naming it."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise UnsupportedDType(f"numpy dtype {np.dtype(dtype)} is not supported") from None


def shape_str(shape) -> str:
    """Return a shape as '[2, B, 3]', or '[?]' for unknown rank (how messages write shapes)."""
    return "[?]" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


_F32_MAX = float(np.finfo(np.float32).max)
_I32 = np.iinfo(np.int32)  # (made once: to_kernel runs for every input of every run)


def to_kernel(array: np.ndarray, dtype: DType, what: str) -> np.ndarray:
    """Return `array` converted to the kernel's representation of `dtype`; int64 is range-checked."""
    array = np.asarray(array)
    if dtype.name == "DOUBLE":  # held as float32: a finite value that would become inf is an error
        finite = array[np.isfinite(array)] if array.size else array
        f32max = _F32_MAX
        bad = finite[np.abs(finite) > f32max]
        if bad.size:  # (values below float32's range round to 0, as float32 arithmetic would)
            raise RangeError(
                f"{what}: float64 value {float(bad.flat[0]):.6g} is beyond float32's range ({f32max:.4g}), "
                "and kernels hold float64 as float32 (LuisaCompute has no double)"
            )
    if dtype is INT64:
        info = _I32
        if array.size and (array.min() < info.min or array.max() > info.max):
            bad = array[(array < info.min) | (array > info.max)].flat[0]
            raise RangeError(
                f"{what}: int64 value {int(bad)} does not fit the kernel's 32-bit integers "
                f"(range {info.min}..{info.max})"
            )
    return np.ascontiguousarray(array, dtype=dtype.kernel_numpy)
