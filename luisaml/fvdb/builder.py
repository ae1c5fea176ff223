"""Build NanoVDB OnIndex grids from voxel coordinates, points or dense boxes (pure numpy).

The output matches what NanoVDB's builders (``tools::cuda::voxelsToGrid`` used by fVDB,
``createNanoGrid(..., 0u, false, false)``, warp's host builder) write: breadth-first nodes, root
tiles in signed ``(i>>12, j>>12, k>>12)`` order, nodes and voxels in NanoVDB's hierarchical x-major
order, no tiles, no stats, indices 1..N (``mData1 = N + 1``). The linear index of a voxel is thus a
pure function of the voxel set, the same one fVDB and warp produce.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np

from . import layout as L
from .layout import NanoVDBError
from .nanovdb import NanoGrid, as_byte_buffer, as_ijk, leaf_slot, lower_slot, upper_slot
from .nanovdb_read import read_grids

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_DBL_MAX = float(np.finfo(np.float64).max)


def as_vec3(value: float | Iterable[float], what: str) -> np.ndarray:
    """Return a scalar or 3-vector as a float64 (3,) array."""
    arr = np.asarray(value, np.float64)
    if arr.ndim == 0:
        arr = np.full(3, float(arr))
    if arr.shape != (3,):
        raise ValueError(f"{what} must be a scalar or have 3 components, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} must be finite, got {arr.tolist()}")
    return arr


def as_voxel_size(value: float | Iterable[float]) -> np.ndarray:
    """Return a voxel size as float64 (3,), rejecting zero or negative components."""
    arr = as_vec3(value, "voxel size")
    if (arr <= 0).any():
        raise ValueError(f"voxel size must be positive, got {arr.tolist()}")
    return arr


# ------------------------------------------------------------------------------------------------
# voxel sets
# ------------------------------------------------------------------------------------------------


def _order_keys(ijk: np.ndarray) -> np.ndarray:
    """Return uint64 keys sorting ijk in NanoVDB order: tile rank<<36 | upper<<21 | lower<<9 | voxel."""
    # Root tiles sort by signed (i>>12, j>>12, k>>12); each part fits 20 bits after a 2^19 offset.
    t = (ijk.astype(np.int64) >> 12) + (1 << 19)
    tile_key = (t[:, 0] << 40) | (t[:, 1] << 20) | t[:, 2]
    _, tile_rank = np.unique(tile_key, return_inverse=True)
    local = (upper_slot(ijk) << 21) | (lower_slot(ijk) << 9) | leaf_slot(ijk)
    return ((tile_rank.reshape(-1).astype(np.int64) << 36) | local).astype(np.uint64)


def nanovdb_order(ijk: np.ndarray) -> np.ndarray:
    """Return the distinct voxels of ijk (int32 [M,3]) sorted in NanoVDB's linear index order."""
    ijk = as_ijk(ijk)
    if len(ijk) == 0:
        return ijk
    _, first = np.unique(_order_keys(ijk), return_index=True)
    return ijk[first]


def points_to_ijk(
    points: np.ndarray, voxel_size: float | Iterable[float] = 1.0, origin: float | Iterable[float] = 0.0
) -> np.ndarray:
    """Return the voxel (int32 [N,3]) each world point falls in, as fVDB's from_points computes it."""
    pts = np.asarray(points)
    if pts.size == 0:
        return np.zeros((0, 3), np.int32)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise ValueError(f"points must have shape [N, 3], got {pts.shape}")
    if not np.issubdtype(pts.dtype, np.floating):
        raise TypeError(f"points must be floating point, got dtype {pts.dtype}")
    h = as_voxel_size(voxel_size)
    o = as_vec3(origin, "origin")
    # fVDB: x = p * (1/h) + (-o/h), scale and translation computed in double and cast to the math
    # type of the points (float for half/float, double for double), then round() = floor(x + 0.5)
    # in double (NanoVDB's Vec3<T>::round adds a double 0.5).
    math_t = np.float64 if pts.dtype == np.float64 else np.float32
    scale = (1.0 / h).astype(math_t)
    translate = (-o / h).astype(math_t)
    x = pts.astype(math_t) * scale + translate
    r = np.floor(x.astype(np.float64) + 0.5)
    if not np.isfinite(r).all() or r.min() < _INT32_MIN or r.max() > _INT32_MAX:
        raise ValueError("points map to voxel coordinates that are not finite or do not fit int32")
    return r.astype(np.int32)


def dense_ijk(
    dims: Iterable[int], ijk_min: Iterable[int] = (0, 0, 0), mask: np.ndarray | None = None
) -> np.ndarray:
    """Return the voxels (int32 [N,3]) of the box ijk_min + [0, dims), optionally where mask[i,j,k] is true."""
    d = np.asarray(dims, np.int64).reshape(-1)
    lo = np.asarray(ijk_min, np.int64).reshape(-1)
    if d.shape != (3,) or lo.shape != (3,):
        raise ValueError(f"dims and ijk_min must have 3 components, got {d.tolist()} and {lo.tolist()}")
    if (d < 0).any():
        raise ValueError(f"dims must be non-negative, got {d.tolist()}")
    if (lo < _INT32_MIN).any() or (lo + d - 1 > _INT32_MAX).any():
        raise ValueError(f"box {lo.tolist()} + {d.tolist()} does not fit int32 coordinates")
    grid = np.stack(np.meshgrid(*(np.arange(n) for n in d), indexing="ij"), axis=-1).reshape(-1, 3)
    if mask is not None:
        m = np.asarray(mask, bool)
        if m.shape != tuple(d):
            raise ValueError(f"mask must have shape {tuple(d.tolist())}, got {m.shape}")
        grid = grid[m.reshape(-1)]
    return (grid + lo).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# grid construction
# ------------------------------------------------------------------------------------------------


def _group_starts(keys: np.ndarray) -> np.ndarray:
    """Return the indices where a sorted key array changes value (the first element included)."""
    return np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])


def _group_ids(keys: np.ndarray) -> np.ndarray:
    """Return, for each element of a sorted key array, the rank of its group."""
    return np.cumsum(np.r_[True, keys[1:] != keys[:-1]]) - 1


def _write_map(buf: np.ndarray, voxel_size: np.ndarray, origin: np.ndarray) -> None:
    """Write Map = diag(voxel_size) + origin (float and double parts) and mVoxelSize."""
    mat = np.diag(voxel_size)
    inv = np.diag(1.0 / voxel_size)
    struct.pack_into("<9f", buf, L.GRID_OFF_MAP_MATF, *mat.reshape(-1).astype(np.float32).tolist())
    struct.pack_into("<9f", buf, L.GRID_OFF_MAP_INVMATF, *inv.reshape(-1).astype(np.float32).tolist())
    struct.pack_into("<3f", buf, L.GRID_OFF_MAP_VECF, *origin.astype(np.float32).tolist())
    struct.pack_into("<f", buf, L.GRID_OFF_MAP_TAPERF, 1.0)
    struct.pack_into("<9d", buf, L.GRID_OFF_MAP_MATD, *mat.reshape(-1).tolist())
    struct.pack_into("<9d", buf, L.GRID_OFF_MAP_INVMATD, *inv.reshape(-1).tolist())
    struct.pack_into("<3d", buf, L.GRID_OFF_MAP_VECD, *origin.tolist())
    struct.pack_into("<d", buf, L.GRID_OFF_MAP_TAPERD, 1.0)
    struct.pack_into("<3d", buf, L.GRID_OFF_VOXEL_SIZE, *voxel_size.tolist())


def _encode_name(name: str) -> bytes:
    raw = name.encode("utf-8")
    if len(raw) >= L.GRID_NAME_SIZE or b"\0" in raw:
        raise ValueError(
            f"grid name must be under {L.GRID_NAME_SIZE} UTF-8 bytes and contain no NUL, got {len(raw)} bytes"
        )
    return raw


def _write_internal_level(
    u64: np.ndarray,
    i32: np.ndarray,
    node_pos: np.ndarray,
    child_pos: np.ndarray,
    child_parent: np.ndarray,
    child_slot: np.ndarray,
    bbox_min: np.ndarray,
    bbox_max: np.ndarray,
    off_child_mask: int,
    off_table: int,
) -> None:
    """Write bboxes, child masks and child offsets of one internal level (nodes at node_pos)."""
    i32[(node_pos[:, None] // 4) + np.arange(3)] = bbox_min
    i32[(node_pos[:, None] // 4) + 3 + np.arange(3)] = bbox_max
    parent_pos = node_pos[child_parent]
    words = (parent_pos + off_child_mask) // 8 + (child_slot >> 6)
    np.bitwise_or.at(u64, words, np.uint64(1) << (child_slot & 63).astype(np.uint64))
    # Table entries of children hold the signed byte offset from the parent node to the child.
    u64[(parent_pos + off_table) // 8 + child_slot] = (
        (child_pos - parent_pos).astype(np.int64).view(np.uint64)
    )


def grid_layout(n_leaf: int, n_lower: int, n_upper: int) -> tuple[int, int, int, int, int]:
    """Return the breadth-first offsets (from TreeData: root, upper, lower, leaf) and mGridSize."""
    off_root = L.TREE_DATA_SIZE
    off_upper = off_root + L.ROOT_DATA_SIZE + n_upper * L.ROOT_TILE_SIZE  # one root tile per upper node
    off_lower = off_upper + n_upper * L.UPPER_NODE_SIZE
    off_leaf = off_lower + n_lower * L.LOWER_NODE_SIZE
    return off_root, off_upper, off_lower, off_leaf, L.GRID_DATA_SIZE + off_leaf + n_leaf * L.LEAF_NODE_SIZE


HEADER_SIZE = L.GRID_DATA_SIZE + L.TREE_DATA_SIZE + L.ROOT_DATA_SIZE  # what grid_header returns


def grid_header(n: int, n_leaf: int, n_lower: int, n_upper: int, bbox_min, bbox_max,
                voxel_size: float | Iterable[float] = 1.0, origin: float | Iterable[float] = 0.0,
                name: str = "", grid_class: int = L.GRID_CLASS_INDEX) -> tuple[bytes, int]:
    """Return (GridData, TreeData and RootData without its tiles: the first HEADER_SIZE bytes of the
    grid build_grid writes for n voxels in these nodes with this active bbox; its mGridSize). The
    device builder (operators/fvdb/topology.py) writes the rest of the grid around it."""
    buf = np.zeros(HEADER_SIZE, np.uint8)
    # int32, as build_grid's ijk.min / max: the world bbox's max + 1 wraps at INT32_MAX there (as NanoVDB's Coord does)
    _write_header(buf, n, n_leaf, n_lower, n_upper, np.asarray(bbox_min).astype(np.int32),
                  np.asarray(bbox_max).astype(np.int32), as_voxel_size(voxel_size), as_vec3(origin, "origin"),
                  _encode_name(name), grid_class)
    return buf.tobytes(), grid_layout(n_leaf, n_lower, n_upper)[4]


def _write_header(buf: np.ndarray, n: int, n_leaf: int, n_lower: int, n_upper: int, bbox_min: np.ndarray,
                  bbox_max: np.ndarray, h: np.ndarray, o: np.ndarray, name_raw: bytes, grid_class: int) -> None:
    """Write GridData, TreeData and RootData (not its tiles) into buf's first HEADER_SIZE bytes."""
    off_root, off_upper, off_lower, off_leaf, grid_size = grid_layout(n_leaf, n_lower, n_upper)
    n_tiles = n_upper
    tree = L.GRID_DATA_SIZE
    root = tree + off_root
    if not n:
        # NanoVDB's empty CoordBBox / Vec3dBBox: min = +max, max = -max.
        bbox_min = np.full(3, _INT32_MAX, np.int64)
        bbox_max = np.full(3, _INT32_MIN, np.int64)
    # RootData: active bbox, tile count; background and stats stay 0 (no stats).
    struct.pack_into("<6i", buf, root + L.ROOT_OFF_BBOX, *bbox_min.tolist(), *bbox_max.tolist())
    struct.pack_into("<I", buf, root + L.ROOT_OFF_TABLE_SIZE, n_tiles)

    # TreeData: node offsets (0 for an empty level), counts, no active tiles, voxel count.
    struct.pack_into(
        "<4q3I3IQ",
        buf,
        tree,
        off_leaf if n_leaf else 0,
        off_lower if n_lower else 0,
        off_upper if n_upper else 0,
        off_root,
        n_leaf,
        n_lower,
        n_upper,
        0,
        0,
        0,
        n,
    )

    # GridData.
    flags = L.FLAG_IS_BREADTH_FIRST | (L.FLAG_HAS_BBOX if n else 0)
    struct.pack_into(
        "<QQIIIIQ",
        buf,
        0,
        L.MAGIC_GRID,
        L.CHECKSUM_DISABLED,
        L.pack_version(*L.WRITE_VERSION),
        flags,
        0,
        1,
        grid_size,
    )
    buf[L.GRID_OFF_GRID_NAME : L.GRID_OFF_GRID_NAME + len(name_raw)] = np.frombuffer(name_raw, np.uint8)
    _write_map(buf, h, o)
    if n:
        # Like NanoVDB: the world bbox of the index bbox [min, max + 1].
        world = np.stack([bbox_min * h + o, (bbox_max + 1) * h + o])
    else:
        world = np.array([[_DBL_MAX] * 3, [-_DBL_MAX] * 3])
    struct.pack_into("<6d", buf, L.GRID_OFF_WORLD_BBOX, *world.reshape(-1).tolist())
    struct.pack_into(
        "<IIqIIQQ", buf, L.GRID_OFF_GRID_CLASS, grid_class, L.GRID_TYPE_ON_INDEX, grid_size, 0, 0, n + 1, 0
    )


def build_grid(
    ijk: np.ndarray,
    voxel_size: float | Iterable[float] = 1.0,
    origin: float | Iterable[float] = 0.0,
    name: str = "",
    grid_class: int = L.GRID_CLASS_INDEX,
) -> bytes:
    """Return the bytes of one OnIndex grid holding the distinct voxels of ijk (int [N,3]).

    The map is diag(voxel_size) with translation origin (fVDB's primal transform: origin is the
    world centre of voxel (0,0,0)); duplicates in ijk are merged.
    """
    h = as_voxel_size(voxel_size)
    o = as_vec3(origin, "origin")
    name_raw = _encode_name(name)
    if grid_class not in L.INDEX_GRID_CLASSES:
        raise ValueError(
            f"grid class must be one of {L.INDEX_GRID_CLASSES} for an index grid, got {grid_class}"
        )
    ijk = as_ijk(ijk)
    keys = np.zeros(0, np.uint64)
    if len(ijk):
        keys, first = np.unique(_order_keys(ijk), return_index=True)
        ijk = ijk[first]
    n = len(ijk)

    leaf_start = _group_starts(keys >> np.uint64(9)) if n else np.zeros(0, np.int64)
    lower_start = _group_starts(keys >> np.uint64(21)) if n else np.zeros(0, np.int64)
    upper_start = _group_starts(keys >> np.uint64(36)) if n else np.zeros(0, np.int64)
    n_leaf, n_lower, n_upper = len(leaf_start), len(lower_start), len(upper_start)
    n_tiles = n_upper  # every root tile has an upper-node child; no value tiles

    # Breadth-first layout; offsets below are relative to TreeData, as NanoVDB stores them.
    off_root = L.TREE_DATA_SIZE
    off_upper = off_root + L.ROOT_DATA_SIZE + n_tiles * L.ROOT_TILE_SIZE
    off_lower = off_upper + n_upper * L.UPPER_NODE_SIZE
    off_leaf = off_lower + n_lower * L.LOWER_NODE_SIZE
    grid_size = L.GRID_DATA_SIZE + off_leaf + n_leaf * L.LEAF_NODE_SIZE
    tree = L.GRID_DATA_SIZE
    root = tree + off_root

    buf = np.zeros(grid_size, np.uint8)
    u64 = buf.view("<u8")
    i32 = buf.view("<i4")

    if n:
        upper_pos = tree + off_upper + L.UPPER_NODE_SIZE * np.arange(n_upper, dtype=np.int64)
        lower_pos = tree + off_lower + L.LOWER_NODE_SIZE * np.arange(n_lower, dtype=np.int64)
        leaf_pos = tree + off_leaf + L.LEAF_NODE_SIZE * np.arange(n_leaf, dtype=np.int64)
        upper_of = _group_ids(keys >> np.uint64(36))  # per voxel
        lower_of = _group_ids(keys >> np.uint64(21))
        leaf_of = _group_ids(keys >> np.uint64(9))

        # Root tiles, one per upper node, in the same (signed) order.
        tile_pos = root + L.ROOT_DATA_SIZE + L.ROOT_TILE_SIZE * np.arange(n_tiles, dtype=np.int64)
        first_ijk = ijk[upper_start].view(np.uint32).astype(np.uint64) >> np.uint64(12)
        u64[(tile_pos + L.TILE_OFF_KEY) // 8] = (
            first_ijk[:, 2] | (first_ijk[:, 1] << np.uint64(21)) | (first_ijk[:, 0] << np.uint64(42))
        )
        u64[(tile_pos + L.TILE_OFF_CHILD) // 8] = (upper_pos - root).view(np.uint64)

        def bboxes(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return np.minimum.reduceat(ijk, starts, axis=0), np.maximum.reduceat(ijk, starts, axis=0)

        up_min, up_max = bboxes(upper_start)
        lo_min, lo_max = bboxes(lower_start)
        lf_min, lf_max = bboxes(leaf_start)
        _write_internal_level(
            u64,
            i32,
            upper_pos,
            lower_pos,
            upper_of[lower_start],
            upper_slot(ijk[lower_start]),
            up_min,
            up_max,
            L.UPPER_OFF_CHILD_MASK,
            L.UPPER_OFF_TABLE,
        )
        _write_internal_level(
            u64,
            i32,
            lower_pos,
            leaf_pos,
            lower_of[leaf_start],
            lower_slot(ijk[leaf_start]),
            lo_min,
            lo_max,
            L.LOWER_OFF_CHILD_MASK,
            L.LOWER_OFF_TABLE,
        )

        # Leaves: active bbox, value mask, first index and per-word prefix popcounts.
        i32[(leaf_pos[:, None] + L.LEAF_OFF_BBOX_MIN) // 4 + np.arange(3)] = lf_min
        buf[(leaf_pos[:, None] + L.LEAF_OFF_BBOX_DIF) + np.arange(3)] = (lf_max - lf_min).astype(np.uint8)
        buf[leaf_pos + L.LEAF_OFF_FLAGS] = L.LEAF_FLAG_HAS_BBOX
        slot = leaf_slot(ijk)
        word = slot >> 6
        np.bitwise_or.at(
            u64,
            (leaf_pos[leaf_of] + L.LEAF_OFF_VALUE_MASK) // 8 + word,
            np.uint64(1) << (slot & 63).astype(np.uint64),
        )
        per_word = np.bincount(leaf_of * 8 + word, minlength=8 * n_leaf).reshape(n_leaf, 8)
        counts = per_word.sum(axis=1)
        u64[(leaf_pos + L.LEAF_OFF_OFFSET) // 8] = (1 + np.cumsum(counts) - counts).astype(np.uint64)
        fields = np.cumsum(per_word[:, :7], axis=1).astype(np.uint64)
        u64[(leaf_pos + L.LEAF_OFF_PREFIX_SUM) // 8] = np.bitwise_or.reduce(
            fields << (np.uint64(9) * np.arange(7, dtype=np.uint64)), axis=1
        )
        bbox_min, bbox_max = ijk.min(axis=0), ijk.max(axis=0)
    else:
        # NanoVDB's empty CoordBBox / Vec3dBBox: min = +max, max = -max.
        bbox_min = np.full(3, _INT32_MAX, np.int64)
        bbox_max = np.full(3, _INT32_MIN, np.int64)

    _write_header(buf, n, n_leaf, n_lower, n_upper, bbox_min, bbox_max, h, o, name_raw, grid_class)
    return buf.tobytes()


def build_grid_from_points(
    points: np.ndarray,
    voxel_size: float | Iterable[float] = 1.0,
    origin: float | Iterable[float] = 0.0,
    name: str = "",
) -> bytes:
    """Return the bytes of one OnIndex grid of the voxels containing points (fVDB's from_points)."""
    return build_grid(points_to_ijk(points, voxel_size, origin), voxel_size, origin, name)


def build_dense_grid(
    dims: Iterable[int],
    ijk_min: Iterable[int] = (0, 0, 0),
    voxel_size: float | Iterable[float] = 1.0,
    origin: float | Iterable[float] = 0.0,
    mask: np.ndarray | None = None,
    name: str = "",
) -> bytes:
    """Return the bytes of one OnIndex grid of the box ijk_min + [0, dims) (fVDB's from_dense)."""
    return build_grid(dense_ijk(dims, ijk_min, mask), voxel_size, origin, name)


# ------------------------------------------------------------------------------------------------
# multi-grid buffers
# ------------------------------------------------------------------------------------------------


def _grid_parts(grid: bytes | bytearray | np.ndarray | NanoGrid, strip_blind_data: bool) -> list[bytearray]:
    """Return mutable copies of the grids in grid (one NanoGrid, or a raw buffer of one or more grids)."""
    grids = [grid] if isinstance(grid, NanoGrid) else read_grids(as_byte_buffer(grid))
    parts = []
    for g in grids:
        size = g.tree_size if strip_blind_data else g.grid_size
        out = bytearray(g.buffer[g.offset : g.offset + size].tobytes())
        if strip_blind_data and g.blind_metadata_count:
            # What fVDB does on load: cut the grid at its blind metadata and say there is none.
            struct.pack_into("<Q", out, L.GRID_OFF_GRID_SIZE, size)
            struct.pack_into("<qI", out, L.GRID_OFF_BLIND_METADATA_OFFSET, size, 0)
        parts.append(out)
    return parts


def concat_grids(grids: Iterable[bytes | np.ndarray | NanoGrid], strip_blind_data: bool = False) -> bytes:
    """Return one buffer of the grids back to back, renumbered like NanoVDB's mergeGrids.

    Each item is a NanoGrid or a raw buffer of one or more grids.
    """
    parts = [p for g in grids for p in _grid_parts(g, strip_blind_data)]
    if not parts:
        raise NanoVDBError("cannot concatenate zero grids")
    for index, part in enumerate(parts):
        struct.pack_into("<II", part, L.GRID_OFF_GRID_INDEX, index, len(parts))
    return b"".join(parts)
