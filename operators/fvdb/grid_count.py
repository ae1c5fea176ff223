"""Grid batches of any count: the grid count of a bundle bound at run time (several sweeps or frames
a batch), checked against the blob's grids when it is bound.

The per-point and ray ops (GridOp.any_count) take a bundle whose grid_byte_offsets [G], voxel_sizes [G, 3],
origins [G, 3], batch_offsets [G+1] and every JaggedTensor's joffsets [G+1] have a dynamic first
dimension: rows bound at run time (luisaml/fvdb/op_mixins.py, BoundRows; the offsets' extra row is
BoundRows.extra_rows), probed at one grid count and compiled once. Nothing the kernels compute
depends on G: each point finds its grid through its jidx and the metadata table (G rows, derived
when the grid is bound: `grid_metadata_counted`), and the guard `0 <= b < G` reads G from a derived
int32 [1] (`grid_count`), never a literal. A ray op's own table (ray.ray_metadata) has G rows too,
and its layout check takes G from the rays' joffsets (checked against the blob here first).

The same holds beyond the per-point ops. A kernel map (and the pooling maps: kernel_map.py) finds a
voxel's grid by a loop up to G read from a derived int32 of both bundles' counts (`paired_grid_count`:
grid b pairs with grid b). InjectToDense's [G, C, ...] box is an output sized at run time (dense.py:
its G read back). A topology op over such a bundle is a host step (luisaml/fvdb/host_steps.py) that
checks the count inputs against the blob first (`check_blob_count`) and gives the new bundle the
source's count symbols. The splats keep a fixed count (their rows are the batch's voxels).

When bound, the count is the blob's: G is the number of grids in grid_blob (as a GridBatch holds
them, back to back), and every count input must say the same (an InputError naming the input, its
rows and the blob's count), before the bundle's own checks (common.bundle_grids) run.

Rejected: compiling per grid count (PerShapeNetwork's way: a build per count, and fVDB's nodes carry
no shape the specialisation could fix); a grid count padded to a capacity (MAX_GRIDS_PER_BATCH
metadata rows a run, and a blob with fewer grids would still need the count at run time).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from luisaml.errors import InputError

# the bundle's inputs whose first dimension is the grid count (batch_offsets: one more), by position
COUNT_INPUTS = ("grid_byte_offsets", "voxel_sizes", "origins", "batch_offsets")
PLUS_ONE = ("batch_offsets",)


def grid_count(grid_byte_offsets) -> np.ndarray:
    """Return the grid count G (int32 [1]) of a bundle whose count is bound at run time: the rows of
    grid_byte_offsets (checked against the blob by grid_metadata_counted)."""
    return np.array([np.shape(grid_byte_offsets)[0]], np.int32)


def paired_grid_count(grid_byte_offsets, other_offsets, *, inputs: tuple[str, str]) -> np.ndarray:
    """Return the grid count G (int32 [1]) of a node over two bundles whose counts are bound at run
    time (a kernel map's input and output grids: grid b of one pairs with grid b of the other): the
    rows of both grid_byte_offsets, which must agree (each checked against its own blob by
    grid_metadata_counted). inputs: the graph names of the two grid_byte_offsets."""
    a, b = (int(np.shape(x)[0]) for x in (grid_byte_offsets, other_offsets))
    if a != b:
        raise InputError(f"input '{inputs[1]}' has {b} rows, but '{inputs[0]}' has {a}: the node pairs grid b of "
                         "one bundle with grid b of the other, so both bundles must hold as many grids")
    return np.array([a], np.int32)


def check_blob_count(inputs: tuple[str, ...], grid_blob, grid_byte_offsets, voxel_sizes, origins,
                     batch_offsets) -> None:
    """Check a bundle whose grid count is bound at run time against its blob's grids, where no
    metadata is derived (a topology op's host step: luisaml/fvdb/host_steps.py); inputs: the graph
    names of grid_blob, then of the count inputs (COUNT_INPUTS' order)."""
    from luisaml.fvdb.nanovdb import as_byte_buffer
    from luisaml.fvdb.nanovdb_read import read_grids

    count = len(read_grids(as_byte_buffer(np.asarray(grid_blob))))
    count_checker(inputs, (grid_byte_offsets, voxel_sizes, origins, batch_offsets))(count)


def count_checker(inputs: tuple[str, ...], arrays: tuple) -> Callable[[int], None]:
    """Return the check common.bundle_grids runs with the blob's grid count: every count input has G
    rows (the offsets G+1). inputs: the graph names of grid_blob, then of each array in `arrays`
    (grid_byte_offsets, voxel_sizes, origins, batch_offsets, then each joffsets)."""
    blob, names = inputs[0], inputs[1:]
    extras = [1 if k >= len(COUNT_INPUTS) or COUNT_INPUTS[k] in PLUS_ONE else 0 for k in range(len(names))]

    def check(count: int) -> None:
        for name, a, extra in zip(names, arrays, extras):
            rows = int(np.shape(a)[0]) if np.ndim(a) else None
            if rows != count + extra:
                raise InputError(f"input '{name}' has {rows} rows, but grid_blob '{blob}' holds {count} grid(s): "
                                 f"expected {count + extra} ({'one per grid' if not extra else 'the grid count + 1'})")

    return check


def grid_metadata_counted(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets,
                          *rest, inputs: tuple[str, ...], voxel_data: bool = False,
                          expect_voxels: int | None = None) -> np.ndarray:
    """common.grid_metadata of a bundle whose grid count is bound at run time: the count inputs (the
    bundle's, then rest: each JaggedTensor's joffsets, and the voxel data last when voxel_data) checked
    against the blob's grids first. inputs: the graph names of grid_blob, the count inputs, the joffsets."""
    from .common import grid_metadata  # (common imports this module)

    joffsets = rest[:len(rest) - 1] if voxel_data else rest
    if voxel_data:
        expect_voxels = int(np.shape(rest[-1])[0])
    arrays = (grid_byte_offsets, voxel_sizes, origins, batch_offsets) + tuple(joffsets)
    return grid_metadata(grid_blob, grid_byte_offsets, voxel_sizes, origins, leaf_batch_indices, batch_offsets,
                         expect_voxels, check_count=count_checker(inputs, arrays))
