"""Which GridBatch bundles need no host check when bound: those luisaml built (a host step's grid, on
the device or the host) or has checked once, known by the identity of their frozen arrays.

A bundle bound to a network is checked against its blob (operators/fvdb/common.bundle_grids: every
offset a kernel follows), ~3 ms a grid of 30k voxels. A detector binds each frame's fine and coarse
grids to network A, the fine grid to the device build of the coarse one, the coarse grid to network
B: four checks of two grids that luisaml's own builder wrote. Here a bundle is remembered with its
grids (NanoGrid: what the metadata reads) by the identity of its six arrays, each frozen (read-only,
its memory no writeable array's: `frozen`), so that the bytes cannot change while it is known; an
entry goes when one of its arrays is collected (a weak reference's callback), so an id reused by a
new array never finds it.

What is remembered: a host step's outputs, parsed by nanovdb_read.read_built_grids (headers, no tree
walk: the builder writes leaf voxels only); and a bundle that bundle_grids checked in full when all
its arrays are frozen. Never a writeable array: a grid the user binds as numpy is checked at every
new binding as before (BoundInputs keeps a network from checking equal bytes twice), and one with a
corrupted byte raises. Trust stops at the process: nothing here is saved, and a bundle from a model,
an artifact or a file is never remembered unchecked. The read-only flag is the contract: Python code
that makes a remembered array writeable, writes it and freezes it again before any binding defeats it
(as it would BoundInputs' digests); data, from a model or a file, cannot.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Sequence

import numpy as np

_KNOWN: dict[tuple[int, ...], tuple[tuple, list, int]] = {}  # ids -> (weak refs, chosen grids, blob's grid count)
# bundles of writeable arrays walked for the device build under way (`walked`): ids -> (the arrays, chosen
# grids, blob's grid count), only while that build runs
_WALKED: dict[tuple[int, ...], tuple[tuple, list, int]] = {}


def frozen(a: np.ndarray) -> bool:
    """Whether no one can write a's bytes through numpy: it and every array its memory belongs to
    read-only, the memory numpy's own or immutable bytes."""
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        if a.base is None:
            return True
        a = a.base
    return isinstance(a, bytes)


def freeze(a: np.ndarray) -> np.ndarray:
    """Return a frozen array of a's values: a itself made read-only with every array its memory belongs
    to (a device build's outputs are views of the arrays its run read back into, which nothing else
    holds: a later write to them raises rather than changing a remembered grid), or a copy where the
    memory is another object's."""
    a = np.ascontiguousarray(a)
    chain = [a]
    while isinstance(chain[-1].base, np.ndarray):
        chain.append(chain[-1].base)
    if chain[-1].base is not None and not isinstance(chain[-1].base, bytes):
        a = a.copy()
        chain = [a]
    for x in chain:
        x.flags.writeable = False
    return a


def remember(parts: Sequence[np.ndarray], grids: list, blob_grids: int) -> None:
    """Know the bundle of these six frozen arrays as checked: its grids chosen by grid_byte_offsets
    (`grids`) and the number of grids in its blob."""
    if not all(isinstance(a, np.ndarray) and frozen(a) for a in parts):
        return
    key = tuple(id(a) for a in parts)

    def forget(_ref, key=key) -> None:
        _KNOWN.pop(key, None)

    _KNOWN[key] = (tuple(weakref.ref(a, forget) for a in parts), list(grids), blob_grids)


def known(parts: Sequence) -> tuple[list, int] | None:
    """Return (the chosen grids, the blob's grid count) of a bundle remembered with these very arrays,
    still frozen; None otherwise."""
    entry = _KNOWN.get(tuple(id(a) for a in parts))
    if entry is None:
        walked_now = _WALKED.get(tuple(id(a) for a in parts)) if _WALKED else None
        if walked_now is not None and all(a is b for a, b in zip(walked_now[0], parts)):
            return walked_now[1], walked_now[2]
        return None
    refs, grids, count = entry
    if any(r() is not a for r, a in zip(refs, parts)):
        return None
    if not all(frozen(a) for a in parts):  # (an array made writeable again: checked as any other from now on)
        del _KNOWN[tuple(id(a) for a in parts)]
        return None
    return grids, count


@contextlib.contextmanager
def walked(parts: Sequence[np.ndarray], grids: list, blob_grids: int):
    """Know the bundle of these very arrays (any, writeable ones too: a grid the user binds) as checked
    while inside: a device build that walked its source bundle in full to bound the radix passes it
    leaves out (fvdb/radix_passes.py) binds those arrays to its network at once, whose metadata then
    skips the walk. Only for the build's duration: the user may write the arrays afterwards."""
    key = tuple(id(a) for a in parts)
    _WALKED[key] = (tuple(parts), list(grids), blob_grids)
    try:
        yield
    finally:
        _WALKED.pop(key, None)


def built(parts: Sequence[np.ndarray]) -> None:
    """Remember a bundle that luisaml's builder wrote (a host step's outputs, frozen): its grids read
    from the headers (nanovdb_read.read_built_grids), no tree walk."""
    from .nanovdb_read import read_built_grids

    if not all(isinstance(a, np.ndarray) and frozen(a) for a in parts):
        return
    blob, offsets = parts[0], np.asarray(parts[1]).reshape(-1)
    grids = {g.offset: g for g in read_built_grids(blob)}
    chosen = [grids.get(int(o)) for o in offsets]
    if all(g is not None for g in chosen):  # (else the full check names the offset)
        remember(parts, chosen, len(grids))
