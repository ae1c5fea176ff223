"""Host arrays whose bytes a device buffer still holds: a device grid build's blob, downloaded at the end
of its run and frozen, is bound to the networks that read the new grid by a copy on the device from the
build's own output buffer, not uploaded again from the host (issue 28 item 3: a detector frame uploaded
its two new blobs four times, 9.8 MB, and downloaded them once, 5.5 MB; benchmarks/NOTES.md, "The
blobs' round trip").

An entry is made only by the code that froze the array right after its download (luisaml/fvdb/
host_steps.py: a grid luisaml built, read-only before anyone else sees it), never for an array the
user holds writeable: the read-only flag says the host bytes cannot have changed since (fvdb/checked.py's
contract). The device side is checked at every use: `fresh()`, the writer's own word that it has not
written the buffer since (launch.KernelLauncher.writes: any launch of its network's kernels may write its
outputs), else the entry is dropped and the array uploaded as before. An entry goes with its array (a
weak reference); it holds the buffer, so a pool that replaced the buffer meanwhile cannot free bytes
still named here.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np

from .fvdb.checked import frozen

# id(array) -> (weak reference to it, device buffer, byte offset of its first byte there, fresh())
_HELD: dict[int, tuple[Any, Any, int, Callable[[], bool]]] = {}


def remember(a: np.ndarray, buf, byte_offset: int, fresh: Callable[[], bool]) -> None:
    """Know that buf holds frozen array a's bytes from byte_offset while fresh() is true. An array that
    is not frozen, not C-contiguous, or whose bytes or offset are not whole 4-byte words (the device
    copy's unit) is not remembered."""
    if not (isinstance(a, np.ndarray) and frozen(a) and a.flags.c_contiguous) or a.nbytes % 4 or byte_offset % 4:
        return
    key = id(a)

    def forget(_ref, key=key) -> None:
        _HELD.pop(key, None)

    _HELD[key] = (weakref.ref(a, forget), buf, int(byte_offset), fresh)


def byte_offset(a: np.ndarray, whole: np.ndarray) -> int | None:
    """Return the offset of a's first byte in whole's bytes where all of a's bytes lie within whole's (a
    view of it: a contiguous slice, a reshape); None otherwise. (Also launch.KernelLauncher.resident_copy's.)"""
    at = a.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
    return at if 0 <= at and at + a.nbytes <= whole.nbytes else None


def source(a: np.ndarray) -> tuple[Any, int] | None:
    """Return (device buffer, byte offset) holding a's bytes: a itself remembered, or an array its memory
    belongs to (a view of it: a contiguous slice, a reshape), still frozen and fresh; None otherwise."""
    if not _HELD or not isinstance(a, np.ndarray) or not a.flags.c_contiguous or a.nbytes % 4 or not frozen(a):
        return None
    x = a
    while isinstance(x, np.ndarray):
        entry = _HELD.get(id(x))
        if entry is not None:
            ref, buf, offset, fresh = entry
            if ref() is not x or not fresh():
                _HELD.pop(id(x), None)
                return None
            at = byte_offset(a, x)
            if at is None or at % 4:
                return None
            return buf, offset + at
        x = x.base
    return None


def copy_bytes(src, src_offset: int, dst, dst_offset: int, size: int) -> None:
    """Enqueue the copy of size bytes from device buffer src (from src_offset) into dst (from dst_offset),
    on the device: ordered after what the stream holds before it (the writer's kernels) and before the
    launches after it."""
    from luisa import globalvars, lcapi

    if size:
        globalvars.vars.stream.add(lcapi.BufferCopyCommand.create(src.handle, dst.handle, int(src_offset),
                                                                  int(dst_offset), int(size)))
