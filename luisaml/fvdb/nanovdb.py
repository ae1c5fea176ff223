"""Read, validate and query NanoVDB OnIndex grids held in a byte buffer (pure numpy).

A buffer holds one or more grids back to back (each starts at the previous one's offset plus its
``mGridSize``). :func:`read_grids` parses and validates every grid before anything else touches it:
every offset and count that a later traversal follows is checked against the buffer, so a bad blob
fails here with a :class:`NanoVDBError` naming the field, the expected and the actual value, and
never as an out-of-bounds read later (on the host or in a shader that trusts the same bytes).
A new grid is checked each time a bundle is bound, so the checks are vectorised per node level: a
level (all leaves, all lower nodes, ...) is one [nodes, bytes] view of the buffer (:func:`_records`),
its fields strided views of that, its masks uint64 words, and each check one array expression over
the level; no Python loop runs per node.

:func:`ijk_to_index` is the host-side reference lookup: it walks the actual bytes the way NanoVDB's
``ReadAccessor`` / PNanoVDB do (root tiles by linear scan, upper node, lower node, leaf, popcount
prefix sums) and returns fVDB's index (``getValue - 1``, or -1 where the voxel is inactive).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from ..limits import DEFAULT, Limits
from . import layout as L
from .layout import GridLimitError, NanoVDBError

_U64 = np.dtype("<u8")
_I64 = np.dtype("<i8")
_U32 = np.dtype("<u4")
_I32 = np.dtype("<i4")
# Bits a root key can have: u32(coord) >> 12 is 20 bits, placed at bit 0 (k), 21 (j) and 42 (i).
_KEY_BITS = 0xFFFFF | (0xFFFFF << 21) | (0xFFFFF << 42)
# A leaf's per-word popcounts (int64 [N, 8]) times _ROW_SUM is its active count. numpy's sum along
# a short last axis is several times slower than this product, which is exact for integers.
_ROW_SUM = np.ones(8, np.int64)
# Times _PREFIX_WEIGHTS, the same popcounts give the leaf's expected prefix-sum word: word w's count
# belongs to every running total f >= w (f < 7), each a 9-bit field at bit 9f.
_PREFIX_WEIGHTS = np.array([sum(1 << (9 * f) for f in range(w, 7)) for w in range(8)], np.int64)
_PREFIX_BITS = (1 << 63) - 1  # the seven fields


# ------------------------------------------------------------------------------------------------
# plain data
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class GridMap:
    """NanoVDB's affine index->world map (double-precision part): ``world = matrix @ ijk + translation``."""

    matrix: np.ndarray  # (3, 3) float64, row-major
    inverse: np.ndarray  # (3, 3) float64
    translation: np.ndarray  # (3,) float64; fVDB's origin = applyMap(0) = translation

    def index_to_world(self, ijk: np.ndarray) -> np.ndarray:
        """Return world positions (float64 [N,3]) of index-space points ijk [N,3]."""
        return np.asarray(ijk, np.float64) @ self.matrix.T + self.translation

    def world_to_index(self, xyz: np.ndarray) -> np.ndarray:
        """Return index-space positions (float64 [N,3]) of world points xyz [N,3]."""
        return (np.asarray(xyz, np.float64) - self.translation) @ self.inverse.T


@dataclass(frozen=True)
class TreeInfo:
    """The TreeData header as stored."""

    node_offsets: tuple[int, int, int, int]  # leaf, lower, upper, root; bytes from TreeData start
    node_counts: tuple[int, int, int]  # leaf, lower, upper
    tile_counts: tuple[int, int, int]  # as written (warp writes node counts here; not relied on)
    voxel_count: int


@dataclass(frozen=True, eq=False)
class NanoGrid:
    """One validated grid inside a buffer; absolute offsets below are byte positions in ``buffer``."""

    buffer: np.ndarray = field(repr=False)  # read-only uint8, the whole buffer the grid lives in
    offset: int  # byte position of this grid's GridData in buffer
    grid_size: int  # mGridSize: bytes to the next grid, blind data included
    version: tuple[int, int, int]
    flags: int
    grid_index: int
    grid_count: int
    name: str
    grid_class: int
    grid_type: int
    map: GridMap
    voxel_size: np.ndarray  # mVoxelSize, float64 (3,)
    world_bbox: np.ndarray  # float64 (2, 3) as written
    blind_metadata_offset: int  # from grid start
    blind_metadata_count: int
    value_count: int  # mData1: number of indexed values, background (index 0) included
    tree: TreeInfo
    root_bbox: np.ndarray  # int32 (2, 3), inclusive min/max of the active voxels
    root_tile_count: int  # RootData::mTableSize
    leaf_voxel_count: int  # active voxels counted in the leaf masks (validated, not trusted)
    active_tile_count: int  # active value tiles at root, upper and lower level (counted)

    @property
    def tree_offset(self) -> int:
        """Return the byte position of TreeData in buffer."""
        return self.offset + L.GRID_DATA_SIZE

    @property
    def root_offset(self) -> int:
        """Return the byte position of RootData in buffer."""
        return self.tree_offset + self.tree.node_offsets[3]

    @property
    def upper_offset(self) -> int:
        """Return the byte position of the first upper node (0 when there is none)."""
        return self.tree_offset + self.tree.node_offsets[2] if self.upper_count else 0

    @property
    def lower_offset(self) -> int:
        """Return the byte position of the first lower node (0 when there is none)."""
        return self.tree_offset + self.tree.node_offsets[1] if self.lower_count else 0

    @property
    def leaf_offset(self) -> int:
        """Return the byte position of the first leaf node (0 when there is none)."""
        return self.tree_offset + self.tree.node_offsets[0] if self.leaf_count else 0

    @property
    def leaf_count(self) -> int:
        """Return the number of leaf nodes."""
        return self.tree.node_counts[0]

    @property
    def lower_count(self) -> int:
        """Return the number of lower internal nodes."""
        return self.tree.node_counts[1]

    @property
    def upper_count(self) -> int:
        """Return the number of upper internal nodes."""
        return self.tree.node_counts[2]

    @property
    def voxel_count(self) -> int:
        """Return the active voxel count from TreeData."""
        return self.tree.voxel_count

    @property
    def origin(self) -> np.ndarray:
        """Return fVDB's origin, the world position of voxel (0,0,0)'s centre (map applied to 0)."""
        return self.map.translation.copy()

    @property
    def tree_size(self) -> int:
        """Return the grid's byte size without its blind data (what fVDB keeps when it loads)."""
        if self.blind_metadata_count == 0:
            return self.grid_size
        return self.blind_metadata_offset

    def data(self) -> bytes:
        """Return this grid's bytes (mGridSize of them, blind data included)."""
        return self.buffer[self.offset : self.offset + self.grid_size].tobytes()


# ------------------------------------------------------------------------------------------------
# byte access
# ------------------------------------------------------------------------------------------------


def as_byte_buffer(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """Return data as a read-only, C-contiguous uint8 array; mutable sources are copied so validation stays true."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise NanoVDBError(f"grid buffer must have dtype uint8, got {data.dtype}")
        if data.ndim != 1:
            raise NanoVDBError(f"grid buffer must be one-dimensional, got shape {data.shape}")
        if not data.flags.writeable and data.flags.c_contiguous:
            return data
        arr = np.array(data, np.uint8, copy=True)
        arr.flags.writeable = False
        return arr
    # bytes are immutable; anything else is snapshotted into bytes first.
    return np.frombuffer(data if isinstance(data, bytes) else bytes(data), np.uint8)


def _gather(buf: np.ndarray, pos: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Return values of dtype read at the absolute byte positions pos (any shape)."""
    pos = np.asarray(pos, np.int64)
    n = dtype.itemsize
    raw = buf[pos[..., None] + np.arange(n, dtype=np.int64)]
    return np.ascontiguousarray(raw).view(dtype)[..., 0]


def _records(buf: np.ndarray, begin: int, count: int, stride: int) -> np.ndarray:
    """Return the [count, stride] uint8 rows of count fixed-size records at begin, stride bytes apart.

    A view of buf, not a copy: the validators read one level of nodes (all leaves, all lower nodes)
    through it at once instead of gathering every byte through an index array. Callers pass only
    ranges they have checked (_check_range); a range outside buf is still refused here rather than
    silently cut short by slicing.
    """
    if count == 0:
        return np.zeros((0, stride), np.uint8)
    end = begin + count * stride
    if begin < 0 or end > len(buf):
        raise NanoVDBError(
            f"{count} records of {stride} B at buffer byte {begin} run outside the {len(buf)}-byte buffer"
        )
    return buf[begin:end].reshape(count, stride)


def _field(rows: np.ndarray, offset: int, dtype: np.dtype, n: int = 1) -> np.ndarray:
    """Return the [len(rows), n] values of dtype at byte offset of every record in rows (a view)."""
    return rows[:, offset : offset + n * dtype.itemsize].view(dtype)


def _set_bits(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (row, bit) of every set bit of [rows, n_words] uint64 bit masks, bit n of word n>>6 at n.

    The order is row, then bit (np.nonzero's over the unpacked bits), so the first offender an error
    names is the same. Only the non-zero words are unpacked: an internal node's masks are mostly
    zero (a lower node of a surface has a few hundred of its 4096 children), so this touches a few
    words instead of every bit. (np.nonzero of a 2-D array is several times slower than of a flat
    one, hence the flat unpack.)
    """
    row, word = np.nonzero(words)
    # '<u8' words viewed as bytes are little-endian, so bit b of byte k is bit 8k+b of the word.
    raw = np.ascontiguousarray(words[row, word], _U64).view(np.uint8)
    k = np.flatnonzero(np.unpackbits(raw, bitorder="little").view(bool))
    return row[k >> 6], 64 * word[k >> 6].astype(np.int64) + (k & 63)


def popcount64(x: np.ndarray) -> np.ndarray:
    """Return the number of set bits of each uint64 in x (as int64)."""
    x = np.asarray(x, np.uint64)
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.int64)
    # SWAR fallback for numpy < 2.0.
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return ((x * np.uint64(0x0101010101010101)) >> np.uint64(56)).astype(np.int64)


# ------------------------------------------------------------------------------------------------
# coordinates
# ------------------------------------------------------------------------------------------------


def as_ijk(ijk: np.ndarray | list) -> np.ndarray:
    """Return ijk as a C-contiguous int32 [N,3] array, rejecting non-integers and int32 overflow."""
    arr = np.asarray(ijk)
    if arr.size == 0:
        return np.zeros((0, 3), np.int32)
    if arr.ndim == 1 and arr.shape[0] == 3:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"ijk must have shape [N, 3], got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"ijk must be an integer array, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        info = np.iinfo(np.int32)
        if arr.min() < info.min or arr.max() > info.max:
            raise ValueError(f"ijk values must fit int32, got range [{arr.min()}, {arr.max()}]")
    return np.ascontiguousarray(arr, np.int32)


def root_keys(ijk: np.ndarray) -> np.ndarray:
    """Return NanoVDB's root tile keys (uint64) of ijk int32 [N,3].

    key = (u32(k)>>12) | (u32(j)>>12)<<21 | (u32(i)>>12)<<42; negative coordinates wrap through u32.
    """
    u = np.ascontiguousarray(ijk, np.int32).view(np.uint32).astype(np.uint64) >> np.uint64(12)
    return u[:, 2] | (u[:, 1] << np.uint64(21)) | (u[:, 0] << np.uint64(42))


def key_to_origin(keys: np.ndarray) -> np.ndarray:
    """Return the int32 [N,3] origins (multiples of 4096) of the root tiles with the given keys."""
    keys = np.asarray(keys, np.uint64)
    mask = np.uint64(0xFFFFF)
    parts = [(keys >> np.uint64(s)) & mask for s in (42, 21, 0)]
    u = np.stack(parts, axis=-1) << np.uint64(12)
    return (u & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32).reshape(-1, 3)


def upper_slot(ijk: np.ndarray) -> np.ndarray:
    """Return the upper-node table slot ((i&4095)>>7)<<10 | ((j&4095)>>7)<<5 | ((k&4095)>>7) of ijk."""
    p = (np.asarray(ijk, np.int64) & 4095) >> 7
    return (p[:, 0] << 10) | (p[:, 1] << 5) | p[:, 2]


def lower_slot(ijk: np.ndarray) -> np.ndarray:
    """Return the lower-node table slot ((i&127)>>3)<<8 | ((j&127)>>3)<<4 | ((k&127)>>3) of ijk."""
    p = (np.asarray(ijk, np.int64) & 127) >> 3
    return (p[:, 0] << 8) | (p[:, 1] << 4) | p[:, 2]


def leaf_slot(ijk: np.ndarray) -> np.ndarray:
    """Return the leaf voxel slot (i&7)<<6 | (j&7)<<3 | (k&7) of ijk (x-major)."""
    p = np.asarray(ijk, np.int64) & 7
    return (p[:, 0] << 6) | (p[:, 1] << 3) | p[:, 2]


def _slot_offsets(slot: np.ndarray, log2dim: int, child_log2: int) -> np.ndarray:
    """Return int32 [N,3] coordinate offsets of table slots inside a node (inverse of *_slot)."""
    slot = np.asarray(slot, np.int64)
    m = (1 << log2dim) - 1
    shifts = np.array([2 * log2dim, log2dim, 0], np.int64)  # x, y, z fields of the slot
    return (((slot[:, None] >> shifts) & m) << child_log2).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# validation and parsing
# ------------------------------------------------------------------------------------------------


def _fail(where: str, what: str) -> NanoVDBError:
    return NanoVDBError(f"{where}: {what}")


def _c_string(raw: np.ndarray, where: str, what: str) -> str:
    """Return the NUL-terminated string in raw, or raise if it has no NUL."""
    data = raw.tobytes()
    end = data.find(b"\0")
    if end < 0:
        raise _fail(where, f"{what} is not NUL-terminated within its {len(data)} bytes")
    return data[:end].decode("utf-8", errors="replace")


def _check_range(where: str, what: str, begin: int, count: int, stride: int, lo: int, hi: int) -> None:
    """Raise unless [begin, begin + count*stride) lies in [lo, hi) and begin is 32-byte aligned."""
    if count == 0:
        return
    if begin % L.DATA_ALIGNMENT:
        raise _fail(
            where,
            f"{what} starts at byte {begin - lo} of the grid, which is not {L.DATA_ALIGNMENT}-byte aligned",
        )
    end = begin + count * stride
    if begin < lo or end > hi:
        raise _fail(
            where,
            f"{what} ({count} x {stride} B) spans grid bytes [{begin - lo}, {end - lo}), "
            f"outside the grid's {hi - lo} bytes",
        )


@dataclass(frozen=True)
class _Level:
    """One node level located in the buffer: node i starts at begin + i*stride."""

    name: str
    begin: int
    count: int
    stride: int


def _child_index(where: str, what: str, target: np.ndarray, level: _Level) -> np.ndarray:
    """Return indices of the nodes of level that absolute byte positions target point at, or raise."""
    rel = np.asarray(target, np.int64) - level.begin
    node, into = np.divmod(rel, level.stride)
    ok = (rel >= 0) & (into == 0) & (node < level.count)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise _fail(
            where,
            f"{what} #{bad} points at buffer byte {int(target[bad])}, which is not the start of one of the "
            f"{level.count} {level.name} nodes (expected {level.begin} + n*{level.stride})",
        )
    return node


def _check_referenced_once(where: str, idx: np.ndarray, level: _Level) -> None:
    """Raise unless every node of level is referenced by exactly one parent entry."""
    counts = np.bincount(idx, minlength=level.count) if level.count else np.zeros(0, np.int64)
    if (counts > 1).any():
        raise _fail(
            where,
            f"{level.name} node {int(np.flatnonzero(counts > 1)[0])} is the child of more than one parent",
        )
    if (counts == 0).any():
        raise _fail(
            where,
            f"{level.name} node {int(np.flatnonzero(counts == 0)[0])} is not reachable from the root "
            f"({int((counts == 0).sum())} of {level.count} {level.name} nodes are orphans)",
        )


def _in_node_order(idx: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Return the rows of values (one per parent entry, entry j pointing at node idx[j]) in node order.

    idx must be a permutation of the level's nodes, which _check_referenced_once has checked: every
    node then gets exactly one row. (Taking rows through the inverse permutation is several times
    faster than numpy's row-wise scatter out[idx] = values.)
    """
    entry_of = np.empty_like(idx)
    entry_of[idx] = np.arange(len(idx))
    return np.take(values, entry_of, axis=0)


@dataclass(frozen=True)
class _Walk:
    """The tree as reached from the root."""

    leaf_origins: np.ndarray  # int32 [N0,3]
    leaf_counts: np.ndarray  # int64 [N0], active voxels per leaf
    active_tiles: int


def _internal_children(
    buf: np.ndarray,
    where: str,
    parent: _Level,
    child: _Level,
    off_value_mask: int,
    off_child_mask: int,
    off_table: int,
    table_count: int,
    value_count: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Validate one internal level; return (parent idx, slot, child idx) per child and the active tile count.

    The whole level is read as one [nodes, bytes] view: its masks as uint64 words, its table as
    uint64 entries. A set child bit's entry is a byte offset from the node to its child, checked in
    bulk against the child level; a set value bit without a child bit is an active tile whose entry
    is an index into the value array.
    """
    rows = _records(buf, parent.begin, parent.count, parent.stride)
    n_words = table_count // 64
    child_mask = _field(rows, off_child_mask, _U64, n_words)
    value_mask = _field(rows, off_value_mask, _U64, n_words)
    table = _field(rows, off_table, _U64, table_count)
    p_idx, slot = _set_bits(child_mask)
    node_pos = parent.begin + parent.stride * p_idx
    target = node_pos + table[p_idx, slot].view(_I64)
    c_idx = _child_index(where, f"{parent.name} child-table entry", target, child)
    # An active tile's table value is an index into the value array; a lookup returns it.
    t_idx, t_slot = _set_bits(value_mask & ~child_mask)
    if len(t_idx):
        tile_values = table[t_idx, t_slot]
        if (tile_values >= np.uint64(value_count)).any():
            bad = int(np.flatnonzero(tile_values >= np.uint64(value_count))[0])
            raise _fail(
                where,
                f"active {parent.name} tile (node {int(t_idx[bad])}, slot {int(t_slot[bad])}) has index "
                f"{int(tile_values[bad])}, expected < value count {value_count}",
            )
    return p_idx, slot, c_idx, len(t_idx)


def _walk_tree(buf: np.ndarray, where: str, g: dict) -> _Walk:
    """Validate the tree of a grid whose headers are parsed into g; return its node origins."""
    grid_pos = g["offset"]
    tree_pos = grid_pos + L.GRID_DATA_SIZE
    off_leaf, off_lower, off_upper, off_root = g["node_offsets"]
    n_leaf, n_lower, n_upper = g["node_counts"]
    grid_type = g["grid_type"]
    value_count = g["value_count"]

    # Tree data ends where blind metadata starts (or at the grid end when there is none).
    tree_end = grid_pos + (g["blind_metadata_offset"] if g["blind_metadata_count"] else g["grid_size"])

    if off_root < L.TREE_DATA_SIZE:
        raise _fail(where, f"root node offset is {off_root}, expected >= {L.TREE_DATA_SIZE} (after TreeData)")
    root_pos = tree_pos + off_root
    _check_range(where, "RootData", root_pos, 1, L.ROOT_DATA_SIZE, grid_pos, tree_end)
    table_size = struct.unpack_from("<I", buf, root_pos + L.ROOT_OFF_TABLE_SIZE)[0]
    tiles_pos = root_pos + L.ROOT_DATA_SIZE
    if tiles_pos + table_size * L.ROOT_TILE_SIZE > tree_end:
        raise _fail(
            where,
            f"root table size {table_size} needs {table_size * L.ROOT_TILE_SIZE} B of tiles after RootData, "
            f"but only {max(tree_end - tiles_pos, 0)} B remain before the end of the tree",
        )
    occupied = tiles_pos + table_size * L.ROOT_TILE_SIZE

    levels = []
    for name, off, count, stride in (
        ("upper", off_upper, n_upper, L.UPPER_NODE_SIZE),
        ("lower", off_lower, n_lower, L.LOWER_NODE_SIZE),
        ("leaf", off_leaf, n_leaf, L.LEAF_NODE_SIZE),
    ):
        begin = tree_pos + off
        if count:
            if off < L.TREE_DATA_SIZE:
                raise _fail(where, f"{name} node offset is {off}, expected >= {L.TREE_DATA_SIZE}")
            _check_range(where, f"{name} node array", begin, count, stride, grid_pos, tree_end)
            # Levels are breadth-first: root tiles, then upper, lower, leaf nodes, never overlapping.
            if begin < occupied:
                raise _fail(
                    where,
                    f"{name} node array starts at grid byte {begin - grid_pos}, overlapping the previous level "
                    f"which ends at grid byte {occupied - grid_pos}",
                )
            occupied = begin + count * stride
        levels.append(_Level(name, begin, count, stride))
    upper, lower, leaf = levels

    # Root tiles: keys unique (NanoVDB scans linearly, a duplicate would be unreachable), children valid.
    tiles = _records(buf, tiles_pos, table_size, L.ROOT_TILE_SIZE)
    keys = _field(tiles, L.TILE_OFF_KEY, _U64)[:, 0]
    child = _field(tiles, L.TILE_OFF_CHILD, _I64)[:, 0]
    state = _field(tiles, L.TILE_OFF_STATE, _U32)[:, 0]
    value = _field(tiles, L.TILE_OFF_VALUE, _U64)[:, 0]
    if len(np.unique(keys)) != len(keys):
        raise _fail(where, "root table holds duplicate tile keys")
    if (keys & ~np.uint64(_KEY_BITS)).any():
        bad = int(keys[np.flatnonzero(keys & ~np.uint64(_KEY_BITS))[0]])
        # No coordinate produces such a key, so its subtree could never be looked up.
        raise _fail(where, f"root tile key 0x{bad:016x} has bits outside its three 20-bit coordinate fields")
    has_child = child != 0
    u_idx = _child_index(where, "root tile child", root_pos + child[has_child], upper)
    _check_referenced_once(where, u_idx, upper)
    active_root_tiles = (~has_child) & (state != 0)
    if (value[active_root_tiles] >= np.uint64(value_count)).any():
        raise _fail(where, f"an active root tile has an index >= the value count {value_count}")
    upper_origins = _in_node_order(u_idx, key_to_origin(keys[has_child]))

    p2, s2, l_idx, tiles2 = _internal_children(
        buf,
        where,
        upper,
        lower,
        L.UPPER_OFF_VALUE_MASK,
        L.UPPER_OFF_CHILD_MASK,
        L.UPPER_OFF_TABLE,
        L.UPPER_TABLE_COUNT,
        value_count,
    )
    _check_referenced_once(where, l_idx, lower)
    lower_origins = _in_node_order(
        l_idx, np.take(upper_origins, p2, axis=0) + _slot_offsets(s2, L.UPPER_LOG2DIM, L.LOWER_TOTAL_LOG2)
    )

    p1, s1, f_idx, tiles1 = _internal_children(
        buf,
        where,
        lower,
        leaf,
        L.LOWER_OFF_VALUE_MASK,
        L.LOWER_OFF_CHILD_MASK,
        L.LOWER_OFF_TABLE,
        L.LOWER_TABLE_COUNT,
        value_count,
    )
    _check_referenced_once(where, f_idx, leaf)
    leaf_origins = _in_node_order(
        f_idx, np.take(lower_origins, p1, axis=0) + _slot_offsets(s1, L.LOWER_LOG2DIM, L.LEAF_TOTAL_LOG2)
    )

    leaf_counts = _check_leaves(buf, where, leaf, leaf_origins, grid_type, value_count)
    return _Walk(leaf_origins, leaf_counts, int(active_root_tiles.sum()) + tiles2 + tiles1)


def _check_leaves(
    buf: np.ndarray, where: str, leaf: _Level, origins: np.ndarray, grid_type: int, value_count: int
) -> np.ndarray:
    """Validate leaf bboxes, prefix sums and value offsets; return the active count per leaf."""
    if leaf.count == 0:
        return np.zeros(0, np.int64)
    rows = _records(buf, leaf.begin, leaf.count, leaf.stride)
    bbox_min = _field(rows, L.LEAF_OFF_BBOX_MIN, _I32, 3)
    if (bbox_min & ~np.int32(7) != origins).any():
        bad = int(np.flatnonzero((bbox_min & ~np.int32(7) != origins).any(axis=1))[0])
        raise _fail(
            where,
            f"leaf {bad} has bbox min {bbox_min[bad].tolist()}, outside the 8^3 block at "
            f"{origins[bad].tolist()} where the tree places it",
        )
    words = _field(rows, L.LEAF_OFF_VALUE_MASK, _U64, 8)
    offsets = _field(rows, L.LEAF_OFF_OFFSET, _U64)[:, 0]
    word_counts = popcount64(words)
    counts = word_counts @ _ROW_SUM
    if grid_type == L.GRID_TYPE_ON_INDEX:
        prefix = _field(rows, L.LEAF_OFF_PREFIX_SUM, _U64)[:, 0]
        # Field f of the prefix word (9 bits at 9f, f < 7) must be popcount(words[0..f]); those
        # running totals are at most 448 < 512, so packing them is exact and the check compares one
        # word per leaf. Bit 63 lies outside the seven fields and is not compared.
        expected_word = (word_counts @ _PREFIX_WEIGHTS).view(np.uint64)
        wrong = (prefix & np.uint64(_PREFIX_BITS)) != expected_word
        if wrong.any():
            bad = int(np.flatnonzero(wrong)[0])
            fields = [(int(prefix[bad]) >> (9 * f)) & 511 for f in range(7)]
            expected = np.cumsum(word_counts[bad, :7]).tolist()
            raise _fail(
                where,
                f"leaf {bad} prefix sums {fields} do not match its value mask popcounts {expected}",
            )
        used = counts
    else:  # ValueIndex leaves index all 512 values
        used = np.full(leaf.count, L.LEAF_VALUE_COUNT, np.int64)
    nonempty = used > 0
    if (offsets[nonempty] == 0).any():
        raise _fail(
            where,
            f"leaf {int(np.flatnonzero(nonempty & (offsets == 0))[0])} has value offset 0 (the background index)",
        )
    # offset + used > value_count, in exact uint64 arithmetic: a hostile offset near 2^64 must not
    # wrap, and float64 would round offsets above 2^53.
    used_u = used.astype(np.uint64)
    room = np.uint64(value_count) - np.minimum(used_u, np.uint64(value_count))  # value_count - used, >= 0
    past = (used_u > np.uint64(value_count)) | (offsets > room)
    if (past & nonempty).any():
        bad = int(np.flatnonzero(nonempty & past)[0])
        raise _fail(
            where,
            f"leaf {bad} indexes values [{int(offsets[bad])}, {int(offsets[bad]) + int(used[bad])}), "
            f"beyond the grid's value count {value_count}",
        )
    return counts


def _parse_headers(buf: np.ndarray, pos: int, where: str) -> dict:
    """Return the GridData and TreeData fields at pos after checking the header-level invariants."""
    avail = len(buf) - pos
    need = L.GRID_DATA_SIZE + L.TREE_DATA_SIZE
    if avail < need:
        raise _fail(
            where, f"truncated: GridData+TreeData need {need} bytes, only {avail} remain in the buffer"
        )
    if pos % L.DATA_ALIGNMENT:
        raise _fail(where, f"grid starts at byte {pos}, which is not {L.DATA_ALIGNMENT}-byte aligned")
    magic, _checksum, version, flags, grid_index, grid_count, grid_size = struct.unpack_from(
        "<QQIIIIQ", buf, pos
    )
    if magic not in L.GRID_MAGICS:
        hint = " (this is a .nvdb file header: read it with read_nvdb)" if magic == L.MAGIC_FILE else ""
        raise _fail(
            where, f"bad magic {L.magic_name(magic)} (0x{magic:016x}), expected NanoVDB1 or NanoVDB0{hint}"
        )
    major, minor, patch = L.unpack_version(version)
    if major != L.ABI_MAJOR:
        raise _fail(
            where, f"NanoVDB version {major}.{minor}.{patch} has ABI {major}, expected ABI {L.ABI_MAJOR}"
        )
    grid_class, grid_type = struct.unpack_from("<II", buf, pos + L.GRID_OFF_GRID_CLASS)
    if grid_type not in L.GRID_TYPE_NAMES:
        raise _fail(
            where,
            f"grid type is {grid_type}, expected OnIndex ({L.GRID_TYPE_ON_INDEX}) or Index ({L.GRID_TYPE_INDEX})",
        )
    if grid_class not in L.INDEX_GRID_CLASSES:
        raise _fail(
            where,
            f"grid class is {grid_class}, expected one valid for an index grid: "
            "Unknown (0), IndexGrid (8) or TensorGrid (9)",
        )
    if not flags & L.FLAG_IS_BREADTH_FIRST:
        raise _fail(
            where, f"flags 0x{flags:x} lack IsBreadthFirst (0x20); only breadth-first layouts are supported"
        )
    if grid_size < L.MIN_GRID_SIZE:
        raise _fail(
            where, f"grid size {grid_size} is smaller than the {L.MIN_GRID_SIZE} bytes of its headers"
        )
    if grid_size % L.DATA_ALIGNMENT:
        raise _fail(where, f"grid size {grid_size} is not a multiple of {L.DATA_ALIGNMENT}")
    if grid_size > avail:
        raise _fail(where, f"truncated: grid size is {grid_size} bytes but only {avail} remain in the buffer")

    name = _c_string(
        buf[pos + L.GRID_OFF_GRID_NAME : pos + L.GRID_OFF_GRID_NAME + L.GRID_NAME_SIZE], where, "grid name"
    )
    blind_off, blind_count = struct.unpack_from("<qI", buf, pos + L.GRID_OFF_BLIND_METADATA_OFFSET)
    value_count = struct.unpack_from("<Q", buf, pos + L.GRID_OFF_DATA1)[0]
    t = pos + L.GRID_DATA_SIZE
    node_offsets = struct.unpack_from("<4q", buf, t + L.TREE_OFF_NODE_OFFSET)
    node_counts = struct.unpack_from("<3I", buf, t + L.TREE_OFF_NODE_COUNT)
    tile_counts = struct.unpack_from("<3I", buf, t + L.TREE_OFF_TILE_COUNT)
    voxel_count = struct.unpack_from("<Q", buf, t + L.TREE_OFF_VOXEL_COUNT)[0]
    return dict(
        offset=pos,
        grid_size=grid_size,
        version=(major, minor, patch),
        flags=flags,
        grid_index=grid_index,
        grid_count=grid_count,
        name=name,
        grid_class=grid_class,
        grid_type=grid_type,
        blind_metadata_offset=blind_off,
        blind_metadata_count=blind_count,
        value_count=value_count,
        node_offsets=node_offsets,
        node_counts=node_counts,
        tile_counts=tile_counts,
        voxel_count=voxel_count,
    )


def _check_blind_metadata(buf: np.ndarray, where: str, g: dict) -> None:
    """Raise unless the blind metadata table and every payload it describes lie inside the grid."""
    count, off, size = g["blind_metadata_count"], g["blind_metadata_offset"], g["grid_size"]
    if count == 0:
        return
    if off < L.MIN_GRID_SIZE or off % L.DATA_ALIGNMENT:
        raise _fail(
            where,
            f"blind metadata offset {off} must be >= {L.MIN_GRID_SIZE} and {L.DATA_ALIGNMENT}-byte aligned",
        )
    if off + count * L.BLIND_METADATA_SIZE > size:
        raise _fail(where, f"{count} blind metadata records at grid byte {off} run past the grid size {size}")
    for i in range(count):
        rec = off + i * L.BLIND_METADATA_SIZE
        data_off, value_count, value_size = struct.unpack_from("<qQI", buf, g["offset"] + rec)
        start = rec + data_off
        nbytes = value_count * value_size
        if start < 0 or start > size or nbytes > size - start:
            raise _fail(
                where,
                f"blind data #{i} ({nbytes} B at grid byte {start}) lies outside the grid's {size} bytes",
            )
        name_pos = g["offset"] + rec + L.BLIND_OFF_NAME
        _c_string(buf[name_pos : name_pos + L.BLIND_NAME_SIZE], where, f"blind data #{i} name")


def _read_map(buf: np.ndarray, pos: int) -> GridMap:
    mat = np.array(struct.unpack_from("<9d", buf, pos + L.GRID_OFF_MAP_MATD)).reshape(3, 3)
    inv = np.array(struct.unpack_from("<9d", buf, pos + L.GRID_OFF_MAP_INVMATD)).reshape(3, 3)
    vec = np.array(struct.unpack_from("<3d", buf, pos + L.GRID_OFF_MAP_VECD))
    return GridMap(mat, inv, vec)


def read_grid(data: bytes | np.ndarray, offset: int = 0, where: str | None = None, *,
              limits: Limits = DEFAULT) -> NanoGrid:
    """Return the validated grid whose GridData starts at byte offset of data."""
    buf = as_byte_buffer(data)
    where = where or f"NanoVDB grid at byte {offset}"
    if not 0 <= offset < len(buf):
        raise _fail(where, f"offset {offset} is outside the {len(buf)}-byte buffer")
    g = _parse_headers(buf, offset, where)
    if g["grid_size"] > limits.grid_bytes:
        raise GridLimitError(
            f"{where}: grid size is {g['grid_size']} bytes, more than the limit of {limits.grid_bytes} "
            "(luisaml.Limits.grid_bytes)"
        )
    _check_blind_metadata(buf, where, g)
    walk = _walk_tree(buf, where, g)
    pos = offset
    root_pos = pos + L.GRID_DATA_SIZE + g["node_offsets"][3]
    return NanoGrid(
        buffer=buf,
        offset=pos,
        grid_size=g["grid_size"],
        version=g["version"],
        flags=g["flags"],
        grid_index=g["grid_index"],
        grid_count=g["grid_count"],
        name=g["name"],
        grid_class=g["grid_class"],
        grid_type=g["grid_type"],
        map=_read_map(buf, pos),
        voxel_size=np.array(struct.unpack_from("<3d", buf, pos + L.GRID_OFF_VOXEL_SIZE)),
        world_bbox=np.array(struct.unpack_from("<6d", buf, pos + L.GRID_OFF_WORLD_BBOX)).reshape(2, 3),
        blind_metadata_offset=g["blind_metadata_offset"],
        blind_metadata_count=g["blind_metadata_count"],
        value_count=g["value_count"],
        tree=TreeInfo(g["node_offsets"], g["node_counts"], g["tile_counts"], g["voxel_count"]),
        root_bbox=np.array(struct.unpack_from("<6i", buf, root_pos + L.ROOT_OFF_BBOX), np.int32).reshape(
            2, 3
        ),
        root_tile_count=struct.unpack_from("<I", buf, root_pos + L.ROOT_OFF_TABLE_SIZE)[0],
        leaf_voxel_count=int(walk.leaf_counts.sum()),
        active_tile_count=walk.active_tiles,
    )


def read_grids(data: bytes | np.ndarray, *, limits: Limits = DEFAULT) -> list[NanoGrid]:
    """Return every grid of a raw buffer of back-to-back grids (one or more), each validated."""
    buf = as_byte_buffer(data)
    if len(buf) == 0:
        raise NanoVDBError("empty buffer: expected at least one NanoVDB grid")
    grids: list[NanoGrid] = []
    pos = 0
    # Walk mGridSize to the end of the buffer, like GridHandle and warp's validator; mGridIndex and
    # mGridCount are not trusted because naive concatenation leaves them at 0 / 1 in every grid.
    while pos < len(buf):
        grid = read_grid(buf, pos, where=f"NanoVDB grid #{len(grids)} at byte {pos}", limits=limits)
        grids.append(grid)
        pos += grid.grid_size
    return grids


# ------------------------------------------------------------------------------------------------
# queries
# ------------------------------------------------------------------------------------------------


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
    offsets = _field(leaves, L.LEAF_OFF_OFFSET, _U64)[:, 0].astype(np.int64)
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
    return _records(grid.buffer, grid.leaf_offset, grid.leaf_count, L.LEAF_NODE_SIZE)


def _leaf_counts(grid: NanoGrid) -> np.ndarray:
    """Return the number of active voxels of each leaf (int64 [leaf_count])."""
    words = _field(_leaf_records(grid), L.LEAF_OFF_VALUE_MASK, _U64, 8)
    return popcount64(words) @ _ROW_SUM


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
    tile_keys = _gather(buf, tile_pos + L.TILE_OFF_KEY, _U64)
    order = np.argsort(tile_keys, kind="stable")
    sorted_keys = tile_keys[order]
    keys = root_keys(ijk)
    loc = np.minimum(np.searchsorted(sorted_keys, keys), len(order) - 1)
    hit = sorted_keys[loc] == keys
    tile = tile_pos[order[loc]]
    child = np.where(hit, _gather(buf, tile + L.TILE_OFF_CHILD, _I64), 0)
    is_value_tile = hit & (child == 0)
    active[is_value_tile] = _gather(buf, tile[is_value_tile] + L.TILE_OFF_STATE, _U32) != 0
    value[is_value_tile] = _gather(buf, tile[is_value_tile] + L.TILE_OFF_VALUE, _U64)

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
        has_child = ((_gather(buf, node + off_cmask + word_off, _U64) >> bit) & np.uint64(1)).astype(bool)
        entry = _gather(buf, node + off_table + 8 * slot, _U64)
        tiles = ~has_child
        tile_active = (
            _gather(buf, node[tiles] + off_vmask + word_off[tiles], _U64) >> bit[tiles]
        ) & np.uint64(1)
        active[sel[tiles]] = tile_active.astype(bool)
        value[sel[tiles]] = entry[tiles]
        sel = sel[has_child]
        node = node[has_child] + entry[has_child].view(np.int64)

    # Leaf: the value mask says active; OnIndex counts the active voxels before this one.
    n_slot = leaf_slot(ijk[sel])
    w = n_slot >> 6
    bit = (n_slot & 63).astype(np.uint64)
    word = _gather(buf, node + L.LEAF_OFF_VALUE_MASK + 8 * w, _U64)
    on = ((word >> bit) & np.uint64(1)).astype(bool)
    offset = _gather(buf, node + L.LEAF_OFF_OFFSET, _U64)
    if grid.grid_type == L.GRID_TYPE_ON_INDEX:
        prefix = _gather(buf, node + L.LEAF_OFF_PREFIX_SUM, _U64)
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
    return _walk_tree(grid.buffer, "grid", g).leaf_origins


def active_voxels(grid: NanoGrid) -> np.ndarray:
    """Return the ijk (int32 [N,3]) of the active leaf voxels, ordered by their index."""
    if grid.active_tile_count:
        raise NanoVDBError(
            f"grid has {grid.active_tile_count} active tiles; active_voxels enumerates leaf voxels only"
        )
    if grid.leaf_count == 0:
        return np.zeros((0, 3), np.int32)
    origins = leaf_origins(grid)
    leaf, slot = _set_bits(_field(_leaf_records(grid), L.LEAF_OFF_VALUE_MASK, _U64, 8))
    ijk = origins[leaf] + _slot_offsets(slot, L.LEAF_LOG2DIM, 0)
    value, _ = ijk_to_value(grid, ijk)
    return ijk[np.argsort(value, kind="stable")]
