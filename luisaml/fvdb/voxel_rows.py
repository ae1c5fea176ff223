"""Batched tensors whose rows are a grid's voxels, fewer than the batch: the coarse levels of a sparse
network over grids bound at run time.

Over such grids the voxels are the batch (operators/fvdb/kernel_map.py, conv.py): the finest grid's
voxels are the samples, and a map to a coarser grid has a row per sample too, rows past the coarse
grid's voxels missing (-1). A tensor at a coarse level so holds its V voxels in rows 0..V-1 and padding
after them, which no map ever names. What the runtime must know is which graph inputs and outputs
hold which grid's voxels: an input must have exactly that many rows (it then defines the batch), an
output is cut to them.

The levels are found by linking names that share rows: each node that spans the batch says what
its output and inputs hold (`VoxelBatch.row_links`: a map's rows are its output grid's voxels, the
rows its indices name are its input grid's; a convolution's output rows are its map's), and any
other node's batched inputs and outputs share rows sample for sample. A grid is named by its
bundle's batch_offsets tensor (GRID + its name), whose last element is its voxel count. Two grids
linked to one tensor must have as many voxels (checked when they are bound).

Rejected: a symbol of rows per grid carried through every shape (NOTES.md, "Grids of any size for
sparse convolution"): every pass, the allocator and the runtime would carry a second kind of size;
the batch already carries one run-time size everywhere, and padding costs only the coarse levels'
idle rows. Splatting outputs keep static grids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from .op_mixins import VoxelBatch

# link targets that are not tensors (their NUL keeps them apart from any tensor name):
GRID = "\0grid:"  # the voxels of the grid whose batch_offsets tensor follows
INDICES = "\0indices:"  # the rows the indices of the map tensor that follows name (its input grid's voxels)


@dataclass(frozen=True)
class VoxelRows:
    """Graph inputs and outputs that hold the voxels of the grids whose batch_offsets are `grids`."""

    grids: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def find(plan) -> list[VoxelRows]:
    """Return the groups of the plan's batched graph inputs and outputs that hold a grid's voxels."""
    parent: dict[str, str] = {}

    def root(a: str) -> str:
        parent.setdefault(a, a)
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def link(a: str, b: str) -> None:
        parent[root(a)] = root(b)

    spans = False
    for node, op in plan.ops:
        links = op.row_links() if isinstance(op, VoxelBatch) else None
        if links is not None:
            spans = True
            for a, b in links:
                link(a, b)
            continue
        batched = [t.name for t in list(op.inputs) + list(op.outputs) if t is not None and t.batched]
        for a, b in zip(batched, batched[1:]):
            link(a, b)
    if not spans:
        return []
    members: dict[str, list[str]] = {}
    for name in list(parent):
        members.setdefault(root(name), []).append(name)
    inputs = {s.name for s in plan.inputs if s.batched}
    outputs = {s.name for s in plan.outputs if s.batched}
    groups = []
    for names in members.values():
        grids = tuple(sorted(n[len(GRID):] for n in names if n.startswith(GRID)))
        if grids:
            groups.append(VoxelRows(grids, tuple(sorted(inputs & set(names))), tuple(sorted(outputs & set(names)))))
    return groups


def rows_at_run(groups: list[VoxelRows], values, n: int) -> dict[str, int]:
    """Check a run's grids against its batch n and its inputs; return {output: rows to keep}.

    values(name) returns the array bound to (or constant of) a batch_offsets tensor."""
    keep: dict[str, int] = {}
    for g in groups:
        counts = {name: int(np.asarray(values(name)).reshape(-1)[-1]) for name in g.grids}
        voxels = next(iter(counts.values()))
        if any(c != voxels for c in counts.values()):
            raise InputError(f"grids {', '.join(repr(k) for k in counts)} (by their batch_offsets) hold the same "
                             f"tensors' rows but have {', '.join(str(c) for c in counts.values())} voxels")
        for name in g.inputs:
            if voxels != n:
                raise InputError(f"input '{name}' has {n} rows, but it holds the voxels of the grid of "
                                 f"'{g.grids[0]}', which has {voxels}")
        if voxels > n:
            raise InputError(f"the grid of '{g.grids[0]}' has {voxels} voxels, more than the batch ({n}: the rows of "
                             "the features over the finest grid)")
        for name in g.outputs:
            keep[name] = voxels
    return keep
