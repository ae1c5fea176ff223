"""Size limits: what a model may make luisaml allocate, checked before the memory is committed.

Kernels index every buffer with 32-bit signed integers, so no tensor (over the whole batch) may
hold more than 2**31 - 1 elements and the weight blob may not exceed 2 GiB; those bounds are
fixed. The others are defaults a caller may tighten or widen with `luisaml.compile(...,
limits=luisaml.Limits(...))`."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import LimitError

INDEX_LIMIT = 2**31 - 1  # the largest element count (or byte offset) a kernel can index
GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Bounds on what a model may make luisaml allocate (bytes unless named otherwise)."""

    # a constant computed on the host while folding (ConstantOfShape, Range, Tile of constants)
    fold_bytes: int = 256 * MiB
    # all the model's constants together (the weight blob the kernel reads)
    weight_bytes: int = 2 * GiB
    # one tensor over the whole batch (a device buffer): inputs, outputs, intermediates
    tensor_bytes: int = 16 * GiB
    # the bytes a NanoVDB grid or a compressed .nvdb claims before they are read
    grid_bytes: int = 4 * GiB
    # nesting of a LuisaML JSON model (objects and lists)
    json_depth: int = 100

    def check_elements(self, what: str, count: int, itemsize: int = 4) -> None:
        """Raise LimitError naming `what` if `count` elements exceed 32-bit indexing or tensor_bytes."""
        if count > INDEX_LIMIT:
            raise LimitError(
                f"{what} has {count:,} elements; kernels index with 32-bit integers, so a tensor may hold "
                f"at most {INDEX_LIMIT:,} (use a smaller batch or split the model)"
            )
        if count * itemsize > self.tensor_bytes:
            raise LimitError(
                f"{what} needs {_size(count * itemsize)}, more than the limit of {_size(self.tensor_bytes)} "
                "(luisaml.Limits.tensor_bytes)"
            )

    def check_bytes(self, what: str, nbytes: int, limit_name: str) -> None:
        """Raise LimitError naming `what` if nbytes exceed the limit called limit_name."""
        limit = getattr(self, limit_name)
        if nbytes > limit:
            raise LimitError(f"{what} needs {_size(nbytes)}, more than the limit of {_size(limit)} (luisaml.Limits.{limit_name})")


def _size(n: int) -> str:
    for unit, k in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} bytes"


DEFAULT = Limits()
