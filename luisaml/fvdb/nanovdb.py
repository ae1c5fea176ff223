"""A NanoVDB OnIndex grid on the host as data (NanoGrid: its map, tree counts and buffer) and the
numpy views every reader of its bytes shares: a level of nodes as one [nodes, bytes] view
(:func:`records`), its fields strided views of that (:func:`record_field`), bit masks as uint64 words
(:func:`set_bits`, :func:`popcount64`), and the coordinates of root keys and node slots. Reading and
validating a buffer is nanovdb_read.py; the lookups over a validated grid are nanovdb_query.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import layout as L
from .layout import NanoVDBError

U64 = np.dtype("<u8")
I64 = np.dtype("<i8")
U32 = np.dtype("<u4")
I32 = np.dtype("<i4")
# A leaf's per-word popcounts (int64 [N, 8]) times ROW_SUM is its active count. numpy's sum along
# a short last axis is several times slower than this product, which is exact for integers.
ROW_SUM = np.ones(8, np.int64)


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


def gather(buf: np.ndarray, pos: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Return values of dtype read at the absolute byte positions pos (any shape)."""
    pos = np.asarray(pos, np.int64)
    n = dtype.itemsize
    raw = buf[pos[..., None] + np.arange(n, dtype=np.int64)]
    return np.ascontiguousarray(raw).view(dtype)[..., 0]


def records(buf: np.ndarray, begin: int, count: int, stride: int) -> np.ndarray:
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


def record_field(rows: np.ndarray, offset: int, dtype: np.dtype, n: int = 1) -> np.ndarray:
    """Return the [len(rows), n] values of dtype at byte offset of every record in rows (a view)."""
    return rows[:, offset : offset + n * dtype.itemsize].view(dtype)


def set_bits(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (row, bit) of every set bit of [rows, n_words] uint64 bit masks, bit n of word n>>6 at n.

    The order is row, then bit (np.nonzero's over the unpacked bits), so the first offender an error
    names is the same. Only the non-zero words are unpacked: an internal node's masks are mostly
    zero (a lower node of a surface has a few hundred of its 4096 children), so this touches a few
    words instead of every bit. (np.nonzero of a 2-D array is several times slower than of a flat
    one, hence the flat unpack.)
    """
    row, word = np.nonzero(words)
    # '<u8' words viewed as bytes are little-endian, so bit b of byte k is bit 8k+b of the word.
    raw = np.ascontiguousarray(words[row, word], U64).view(np.uint8)
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


def slot_offsets(slot: np.ndarray, log2dim: int, child_log2: int) -> np.ndarray:
    """Return int32 [N,3] coordinate offsets of table slots inside a node (inverse of *_slot)."""
    slot = np.asarray(slot, np.int64)
    m = (1 << log2dim) - 1
    shifts = np.array([2 * log2dim, log2dim, 0], np.int64)  # x, y, z fields of the slot
    return (((slot[:, None] >> shifts) & m) << child_log2).astype(np.int32)
