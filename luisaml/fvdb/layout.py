"""Byte layout of NanoVDB (ABI 32) OnIndex grids and .nvdb files.

Every number here is a struct size or a field offset from NanoVDB.h / PNanoVDB.h, as summarised in
shared/reference/nanovdb-onindex.md. Offsets are relative to the start of the struct they belong to.
The layout is little-endian throughout.
"""

from __future__ import annotations

from ..errors import LimitError, ModelError

# --- magic numbers (first 8 bytes, little-endian) -------------------------------------------------
MAGIC_NUMB = 0x304244566F6E614E  # "NanoVDB0": legacy grids (<= 32.6) and legacy file headers
MAGIC_GRID = 0x314244566F6E614E  # "NanoVDB1": grids since 32.7 (and mData2 of 32.6 grids)
MAGIC_FILE = 0x324244566F6E614E  # "NanoVDB2": .nvdb file segment headers
GRID_MAGICS = (MAGIC_NUMB, MAGIC_GRID)
FILE_MAGICS = (MAGIC_NUMB, MAGIC_FILE)

# --- version -------------------------------------------------------------------------------------
ABI_MAJOR = 32
# The version luisaml stamps into grids it writes: NanoVDB 32.9.2, the one fVDB main builds against.
# Only the major number (the ABI) matters to readers.
WRITE_VERSION = (32, 9, 2)


def pack_version(major: int, minor: int, patch: int) -> int:
    """Return NanoVDB's packed u32 version: major<<21 | minor<<10 | patch."""
    return (major << 21) | (minor << 10) | patch


def unpack_version(version: int) -> tuple[int, int, int]:
    """Return (major, minor, patch) of a packed NanoVDB version."""
    return version >> 21, (version >> 10) & 0x7FF, version & 0x3FF


# --- enums ---------------------------------------------------------------------------------------
GRID_TYPE_INDEX = 19  # ValueIndex: every value of a leaf (active or not) has an index
GRID_TYPE_ON_INDEX = 20  # ValueOnIndex: only active values have an index (fVDB's grids)
GRID_TYPE_NAMES = {GRID_TYPE_INDEX: "Index", GRID_TYPE_ON_INDEX: "OnIndex"}

GRID_CLASS_UNKNOWN = 0
GRID_CLASS_INDEX = 8  # IndexGrid: what NanoVDB builders and warp write, and what fVDB loads as
GRID_CLASS_TENSOR = 9  # TensorGrid: what fVDB's save_nanovdb writes
# NanoVDB's isValid(GridType, GridClass) accepts an index grid type with exactly these classes.
INDEX_GRID_CLASSES = (GRID_CLASS_UNKNOWN, GRID_CLASS_INDEX, GRID_CLASS_TENSOR)

FLAG_HAS_LONG_GRID_NAME = 1 << 0
FLAG_HAS_BBOX = 1 << 1
FLAG_HAS_MIN_MAX = 1 << 2
FLAG_HAS_AVERAGE = 1 << 3
FLAG_HAS_STD_DEVIATION = 1 << 4
FLAG_IS_BREADTH_FIRST = 1 << 5

# Disabled checksum: NanoVDB treats all 64 bits set as "no checksum".
CHECKSUM_DISABLED = 0xFFFFFFFFFFFFFFFF

DATA_ALIGNMENT = 32  # NANOVDB_DATA_ALIGNMENT: buffer start, every struct size and every grid size

# --- struct sizes --------------------------------------------------------------------------------
GRID_DATA_SIZE = 672
TREE_DATA_SIZE = 64
ROOT_DATA_SIZE = 96
ROOT_TILE_SIZE = 32
UPPER_NODE_SIZE = 270400
LOWER_NODE_SIZE = 33856
LEAF_NODE_SIZE = 96
BLIND_METADATA_SIZE = 288
GRID_NAME_SIZE = 256
BLIND_NAME_SIZE = 256
# An empty grid is just the three headers.
MIN_GRID_SIZE = GRID_DATA_SIZE + TREE_DATA_SIZE + ROOT_DATA_SIZE

# --- GridData field offsets ----------------------------------------------------------------------
GRID_OFF_MAGIC = 0
GRID_OFF_CHECKSUM = 8
GRID_OFF_VERSION = 16
GRID_OFF_FLAGS = 20
GRID_OFF_GRID_INDEX = 24
GRID_OFF_GRID_COUNT = 28
GRID_OFF_GRID_SIZE = 32
GRID_OFF_GRID_NAME = 40
GRID_OFF_MAP = 296
GRID_OFF_MAP_MATF = 296
GRID_OFF_MAP_INVMATF = 332
GRID_OFF_MAP_VECF = 368
GRID_OFF_MAP_TAPERF = 380
GRID_OFF_MAP_MATD = 384
GRID_OFF_MAP_INVMATD = 456
GRID_OFF_MAP_VECD = 528
GRID_OFF_MAP_TAPERD = 552
GRID_OFF_WORLD_BBOX = 560
GRID_OFF_VOXEL_SIZE = 608
GRID_OFF_GRID_CLASS = 632
GRID_OFF_GRID_TYPE = 636
GRID_OFF_BLIND_METADATA_OFFSET = 640
GRID_OFF_BLIND_METADATA_COUNT = 648
GRID_OFF_DATA0 = 652
GRID_OFF_DATA1 = 656  # index grids: number of indexed values, background included
GRID_OFF_DATA2 = 664

# --- TreeData (at GRID_DATA_SIZE) ----------------------------------------------------------------
TREE_OFF_NODE_OFFSET = 0  # int64[4]: leaf, lower, upper, root; relative to TreeData
TREE_OFF_NODE_COUNT = 32  # u32[3]: leaf, lower, upper
TREE_OFF_TILE_COUNT = 44  # u32[3]: active tiles at lower, upper, root
TREE_OFF_VOXEL_COUNT = 56  # u64

# --- RootData<OnIndex> ---------------------------------------------------------------------------
ROOT_OFF_BBOX = 0  # i32[6]: min, max (inclusive)
ROOT_OFF_TABLE_SIZE = 24  # u32
ROOT_OFF_BACKGROUND = 32  # u64
ROOT_OFF_MINIMUM = 40
ROOT_OFF_MAXIMUM = 48
ROOT_OFF_AVERAGE = 56
ROOT_OFF_STDDEV = 64

TILE_OFF_KEY = 0  # u64
TILE_OFF_CHILD = 8  # int64, byte offset from the RootData start; 0 = value tile
TILE_OFF_STATE = 16  # u32
TILE_OFF_VALUE = 24  # u64

# --- internal nodes (value type u64 for index grids) ---------------------------------------------
NODE_OFF_BBOX = 0
NODE_OFF_FLAGS = 24

UPPER_LOG2DIM = 5
UPPER_TABLE_COUNT = 1 << (3 * UPPER_LOG2DIM)  # 32768
UPPER_OFF_VALUE_MASK = 32
UPPER_OFF_CHILD_MASK = 4128
UPPER_OFF_MINIMUM = 8224
UPPER_OFF_MAXIMUM = 8232
UPPER_OFF_AVERAGE = 8240
UPPER_OFF_STDDEV = 8248
UPPER_OFF_TABLE = 8256

LOWER_LOG2DIM = 4
LOWER_TABLE_COUNT = 1 << (3 * LOWER_LOG2DIM)  # 4096
LOWER_OFF_VALUE_MASK = 32
LOWER_OFF_CHILD_MASK = 544
LOWER_OFF_MINIMUM = 1056
LOWER_OFF_MAXIMUM = 1064
LOWER_OFF_AVERAGE = 1072
LOWER_OFF_STDDEV = 1080
LOWER_OFF_TABLE = 1088

# --- LeafData<ValueOnIndex> / <ValueIndex> -------------------------------------------------------
LEAF_LOG2DIM = 3
LEAF_VALUE_COUNT = 1 << (3 * LEAF_LOG2DIM)  # 512
LEAF_OFF_BBOX_MIN = 0  # i32[3]
LEAF_OFF_BBOX_DIF = 12  # u8[3]
LEAF_OFF_FLAGS = 15  # u8
LEAF_OFF_VALUE_MASK = 16  # u64[8]
LEAF_OFF_OFFSET = 80  # u64: index of the first value
LEAF_OFF_PREFIX_SUM = 88  # u64: 7 x 9-bit fields, field f = popcount(words[0..f])
LEAF_FLAG_HAS_BBOX = 1 << 1

# Coordinate spans of the nodes: a root tile / upper node covers 4096^3, a lower node 128^3, a leaf 8^3.
UPPER_TOTAL_LOG2 = 12
LOWER_TOTAL_LOG2 = 7
LEAF_TOTAL_LOG2 = 3

# --- GridBlindMetaData ---------------------------------------------------------------------------
BLIND_OFF_DATA_OFFSET = 0  # int64, relative to this record
BLIND_OFF_VALUE_COUNT = 8  # u64
BLIND_OFF_VALUE_SIZE = 16  # u32
BLIND_OFF_SEMANTIC = 20
BLIND_OFF_DATA_CLASS = 24
BLIND_OFF_DATA_TYPE = 28
BLIND_OFF_NAME = 32  # char[256]

# --- .nvdb files ---------------------------------------------------------------------------------
FILE_HEADER_SIZE = 16  # u64 magic, u32 version, u16 gridCount, u16 codec
FILE_METADATA_SIZE = 176
FILE_META_OFF_GRID_SIZE = 0
FILE_META_OFF_FILE_SIZE = 8
FILE_META_OFF_NAME_KEY = 16
FILE_META_OFF_VOXEL_COUNT = 24
FILE_META_OFF_GRID_TYPE = 32
FILE_META_OFF_GRID_CLASS = 36
FILE_META_OFF_WORLD_BBOX = 40  # f64[6]
FILE_META_OFF_INDEX_BBOX = 88  # i32[6]
FILE_META_OFF_VOXEL_SIZE = 112  # f64[3]
FILE_META_OFF_NAME_SIZE = 136  # u32, NUL included
FILE_META_OFF_NODE_COUNT = 140  # u32[4]: leaf, lower, upper, 1
FILE_META_OFF_TILE_COUNT = 156  # u32[3]
FILE_META_OFF_CODEC = 168  # u16
FILE_META_OFF_PADDING = 170  # u16
FILE_META_OFF_VERSION = 172  # u32

CODEC_NONE = 0
CODEC_ZIP = 1
CODEC_BLOSC = 2
CODEC_NAMES = {CODEC_NONE: "none", CODEC_ZIP: "zip", CODEC_BLOSC: "blosc"}


class NanoVDBError(ModelError):
    """A NanoVDB buffer or file that luisaml cannot accept; the message names what is wrong."""


class GridLimitError(NanoVDBError, LimitError):
    """A NanoVDB size beyond luisaml.Limits.grid_bytes: both a NanoVDBError and a LimitError, so
    either `except` catches it."""


def magic_name(magic: int) -> str:
    """Return the 8 magic bytes as printable text (non-printable bytes escaped)."""
    raw = int(magic).to_bytes(8, "little")
    return raw.decode("ascii") if all(32 <= c < 127 for c in raw) else repr(raw)
