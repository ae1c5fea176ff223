"""Lookups over a validated NanoVDB grid (nanovdb_read.py): fVDB's contract for an index grid
(:func:`require_fvdb_index_grid`), the leaves' origins and the active voxels in index order.

:func:`ijk_to_index` is the host-side reference lookup: it walks the actual bytes the way NanoVDB's
``ReadAccessor`` / PNanoVDB do (root tiles by linear scan, upper node, lower node, leaf, popcount
prefix sums) and returns fVDB's index (``getValue - 1``, or -1 where the voxel is inactive).
"""

from __future__ import annotations

import numpy as np

from . import layout as L
from .layout import NanoVDBError
from .nanovdb import (I64, ROW_SUM, U32, U64, NanoGrid, as_ijk, gather, leaf_slot, lower_slot, popcount64,
                      record_field, records, root_keys, set_bits, slot_offsets, upper_slot)
from .nanovdb_read import walk_tree


def require_fvdb_index_grid(grid: NanoGrid, where: str = "grid") -> None:
    """Raise unless grid is an OnIndex grid whose active voxels are indexed exactly 1..N (fVDB's contract)."""
    if grid.grid_type != L.GRID_TYPE_ON_INDEX:
        raise NanoVDBError(
            f"{where}: grid type is {L.GRID_TYPE_NAMES[grid.grid_type]} ({grid.grid_type}), "
            f"fVDB grids must be OnIndex ({L.GRID_TYPE_ON_INDEX})"
        )
    if grid.active_tile_count:
        raise NanoVDBError(
            f"{where}: grid has {grid.active_tile_count} active tiles; fVDB grids index leaf voxels only"
        )
    if grid.leaf_voxel_count != grid.voxel_count:
        raise NanoVDBError(
            f"{where}: TreeData voxel count is {grid.voxel_count} but the leaves hold "
            f"{grid.leaf_voxel_count} active voxels"
        )
    # Grids built with stats reserve extra indices; features indexed by getValue-1 would then overflow.
    if grid.value_count != grid.voxel_count + 1:
        raise NanoVDBError(
            f"{where}: value count (mData1) is {grid.value_count}, expected voxel count + 1 = {grid.voxel_count + 1} "
            "(grid was built with stats or tile values; rebuild it without them)"
        )
    leaves = _leaf_records(grid)
    offsets = record_field(leaves, L.LEAF_OFF_OFFSET, U64)[:, 0].astype(np.int64)
    counts = _leaf_counts(grid)
    starts, sizes = offsets[counts > 0], counts[counts > 0]
    # Builders write the ranges in leaf order; sort only when they are not (a stable sort of
    # non-decreasing starts is the identity, so the check below sees the same arrays either way).
    if (starts[1:] < starts[:-1]).any():
        order = np.argsort(starts, kind="stable")
        starts, sizes = starts[order], sizes[order]
    if len(starts) and (starts[0] != 1 or (starts[1:] != starts[:-1] + sizes[:-1]).any()):
        raise NanoVDBError(
            f"{where}: leaf value ranges do not tile the indices 1..{grid.voxel_count} without gaps or overlaps"
        )


def _leaf_records(grid: NanoGrid) -> np.ndarray:
    """Return the [leaf_count, LEAF_NODE_SIZE] uint8 rows of a validated grid's leaves (a view)."""
    return records(grid.buffer, grid.leaf_offset, grid.leaf_count, L.LEAF_NODE_SIZE)


def _leaf_counts(grid: NanoGrid) -> np.ndarray:
    """Return the number of active voxels of each leaf (int64 [leaf_count])."""
    words = record_field(_leaf_records(grid), L.LEAF_OFF_VALUE_MASK, U64, 8)
    return popcount64(words) @ ROW_SUM


def ijk_to_value(grid: NanoGrid, ijk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (value uint64 [N], active bool [N]): NanoVDB's getValue and isActive at each ijk, read from the bytes."""
    ijk = as_ijk(ijk)
    buf = grid.buffer
    n = len(ijk)
    value = np.zeros(n, np.uint64)
    active = np.zeros(n, bool)
    if n == 0 or grid.root_tile_count == 0:
        return value, active

    # Root: NanoVDB scans the table linearly and takes the first match; a stable sort plus a
    # left search finds that same tile for every query at once.
    root = grid.root_offset
    tile_pos = root + L.ROOT_DATA_SIZE + L.ROOT_TILE_SIZE * np.arange(grid.root_tile_count, dtype=np.int64)
    tile_keys = gather(buf, tile_pos + L.TILE_OFF_KEY, U64)
    order = np.argsort(tile_keys, kind="stable")
    sorted_keys = tile_keys[order]
    keys = root_keys(ijk)
    loc = np.minimum(np.searchsorted(sorted_keys, keys), len(order) - 1)
    hit = sorted_keys[loc] == keys
    tile = tile_pos[order[loc]]
    child = np.where(hit, gather(buf, tile + L.TILE_OFF_CHILD, I64), 0)
    is_value_tile = hit & (child == 0)
    active[is_value_tile] = gather(buf, tile[is_value_tile] + L.TILE_OFF_STATE, U32) != 0
    value[is_value_tile] = gather(buf, tile[is_value_tile] + L.TILE_OFF_VALUE, U64)

    # Upper then lower node: a set child bit descends, otherwise the table holds a tile value.
    sel = np.flatnonzero(hit & (child != 0))
    node = root + child[sel]
    for slot_fn, off_vmask, off_cmask, off_table in (
        (upper_slot, L.UPPER_OFF_VALUE_MASK, L.UPPER_OFF_CHILD_MASK, L.UPPER_OFF_TABLE),
        (lower_slot, L.LOWER_OFF_VALUE_MASK, L.LOWER_OFF_CHILD_MASK, L.LOWER_OFF_TABLE),
    ):
        slot = slot_fn(ijk[sel])
        word_off = 8 * (slot >> 6)
        bit = (slot & 63).astype(np.uint64)
        has_child = ((gather(buf, node + off_cmask + word_off, U64) >> bit) & np.uint64(1)).astype(bool)
        entry = gather(buf, node + off_table + 8 * slot, U64)
        tiles = ~has_child
        tile_active = (
            gather(buf, node[tiles] + off_vmask + word_off[tiles], U64) >> bit[tiles]
        ) & np.uint64(1)
        active[sel[tiles]] = tile_active.astype(bool)
        value[sel[tiles]] = entry[tiles]
        sel = sel[has_child]
        node = node[has_child] + entry[has_child].view(np.int64)

    # Leaf: the value mask says active; OnIndex counts the active voxels before this one.
    n_slot = leaf_slot(ijk[sel])
    w = n_slot >> 6
    bit = (n_slot & 63).astype(np.uint64)
    word = gather(buf, node + L.LEAF_OFF_VALUE_MASK + 8 * w, U64)
    on = ((word >> bit) & np.uint64(1)).astype(bool)
    offset = gather(buf, node + L.LEAF_OFF_OFFSET, U64)
    if grid.grid_type == L.GRID_TYPE_ON_INDEX:
        prefix = gather(buf, node + L.LEAF_OFF_PREFIX_SUM, U64)
        # Field w-1 of the prefix sum counts the active voxels of words 0..w-1 (none when w == 0).
        shift = np.uint64(9) * (np.maximum(w, 1) - 1).astype(np.uint64)
        before = np.where(w > 0, (prefix >> shift) & np.uint64(511), np.uint64(0))
        below = popcount64(word & ((np.uint64(1) << bit) - np.uint64(1))).astype(np.uint64)
        leaf_value = np.where(on, offset + before + below, np.uint64(0))
    else:
        leaf_value = offset + n_slot.astype(np.uint64)
    active[sel] = on
    value[sel] = leaf_value
    return value, active


def ijk_to_index(grid: NanoGrid, ijk: np.ndarray) -> np.ndarray:
    """Return fVDB's index of each ijk (int64 [N]): getValue - 1 where active, -1 where inactive."""
    value, active = ijk_to_value(grid, ijk)
    return np.where(active, value.astype(np.int64) - 1, np.int64(-1))


def leaf_origins(grid: NanoGrid) -> np.ndarray:
    """Return the int32 [leaf_count, 3] origin of every leaf, in buffer order, as placed by the tree."""
    g = dict(
        offset=grid.offset,
        grid_size=grid.grid_size,
        grid_type=grid.grid_type,
        value_count=grid.value_count,
        node_offsets=grid.tree.node_offsets,
        node_counts=grid.tree.node_counts,
        blind_metadata_offset=grid.blind_metadata_offset,
        blind_metadata_count=grid.blind_metadata_count,
    )
    return walk_tree(grid.buffer, "grid", g).leaf_origins


def active_voxels(grid: NanoGrid) -> np.ndarray:
    """Return the ijk (int32 [N,3]) of the active leaf voxels, ordered by their index."""
    if grid.active_tile_count:
        raise NanoVDBError(
            f"grid has {grid.active_tile_count} active tiles; active_voxels enumerates leaf voxels only"
        )
    if grid.leaf_count == 0:
        return np.zeros((0, 3), np.int32)
    origins = leaf_origins(grid)
    leaf, slot = set_bits(record_field(_leaf_records(grid), L.LEAF_OFF_VALUE_MASK, U64, 8))
    ijk = origins[leaf] + slot_offsets(slot, L.LEAF_LOG2DIM, 0)
    value, _ = ijk_to_value(grid, ijk)
    return ijk[np.argsort(value, kind="stable")]
