"""Batched tensors whose rows are a grid's voxels, as many as the batch or fewer: the levels of a
sparse network over grids bound at run time.

Over such grids the voxels are the batch (operators/fvdb/kernel_map.py, conv.py): a map has a row
per sample, rows past its output grid's voxels missing (-1), and the indices it holds name rows of
its input grid's voxels. A tensor over a grid so holds its V voxels in rows 0..V-1 and padding after
them, which no map ever names. The run's batch is the most voxels any grid has: the features over
the finest grid in most networks, but a conv grid (ConvGrid, kernel 3 and stride 2 over scattered
LiDAR voxels: each isolated voxel touches up to 8 coarse cells; a dilating stride-1 one, up to 27)
may hold more voxels than the grid it was made from. What the runtime must know is which graph
inputs and outputs hold which grid's voxels: an input must have exactly that many rows, and is
padded with zero rows to the batch when a grid has more voxels than it; an output is cut to its
grid's voxels (an output no grid's rows reach, to the inputs' rows).

The levels are found by linking names that share rows: each node that spans the batch says what
its output and inputs hold (`VoxelBatch.row_links`: a map's rows are its output grid's voxels, the
rows its indices name are its input grid's; a convolution's output rows are its map's), and any
other node's batched inputs and outputs share rows sample for sample. A grid is named by its
bundle's batch_offsets tensor (GRID + its name), whose last element is its voxel count. Two grids
linked to one tensor must have as many voxels (checked when they are bound).

Rejected: a symbol of rows per grid carried through every shape (NOTES.md, "Grids of any size for
sparse convolution"): every pass, the allocator and the runtime would carry a second kind of size;
the batch already carries one run-time size everywhere, and padding costs only the idle rows of the
levels with fewer voxels than the largest. Splatting outputs keep static grids.
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


@dataclass(frozen=True)
class RunRows:
    """A run's batch over its grids and the rows each output keeps."""

    batch: int  # the rows every batched tensor has in this run: the inputs' rows, or the most voxels of a grid
    keep: dict[str, int]  # output -> its rows to return (its grid's voxels; an output of no grid: the inputs' rows)


def rows_at_run(groups: list[VoxelRows], values, n: int, batched_outputs: dict[str, int]) -> RunRows:
    """Check a run's grids against its inputs' n rows (their batch); return the run's batch (n, or
    more where a grid has more voxels) and the rows each batched output keeps.

    values(name) returns the array bound to (or constant of) a batch_offsets tensor; batched_outputs:
    {output: its rows a sample} of the plan's batched outputs."""
    keep: dict[str, int] = {}
    batch = n
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
        batch = max(batch, voxels)
        for name in g.outputs:
            keep[name] = voxels
    if batch > n:  # the outputs that hold no grid's voxels share the inputs' rows
        for name, rows in batched_outputs.items():
            keep.setdefault(name, n * rows)
    return RunRows(batch, keep)

