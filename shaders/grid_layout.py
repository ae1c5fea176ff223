"""The words a grid built on the device and its operators agree on: the scratch's counter words
(`ctr`), the error codes, the layout region's head words and per-grid rows (laid out by the host or
on the device), the summary row the layout reads,
the radix sort's passes, the chunk sizes the operators size scratch by, and NanoVDB's struct sizes.
The stages are grid_build.py and grid_write.py; operators/fvdb/topology.py and topology_device.py
emit their calls."""

SCAN = 32  # words a prefix-sum thread scans
CHUNK = 16  # leaves a radix-sort thread histograms and scatters (its 256 counters zeroed first)
HASH_EMPTY = 0

# ctr words (offsets from the layout's ctr base)
C_LEAVES = 0  # distinct leaves L
C_ERROR = 1  # first error code a stage raised (0: none); the host step reports it
C_ZERO = 2  # always 0: a value the compiler cannot see through (no fused multiply-add across it)
C_MIN = 3  # 3..6: min of tile k, tile j, tile i, grid over the leaves
C_MAX = 7  # 7..10: max of the same
C_LOWERS = 11
C_UPPERS = 12
C_LATE = 14  # the radix pass running + 1, as its scatter reads it (topology.py: set by its histograms)
C_PASS = 15  # the radix pass running, as its histograms and prefix sum read it (set by the last scatter)
C_WORDS = 16

ERR_OFFSETS = 1  # joffsets do not rise from 0 to N
ERR_COORDS = 2  # a point maps to a voxel that is not finite or outside int32
ERR_BYTES = 3  # the grids take 2 GiB or more (the device's layout: 32-bit byte offsets)
ERR_LEAVES = 4  # the grid summaries' leaves differ from the hash's (gb_layout: a device build's own check)

# NanoVDB struct sizes (luisaml/fvdb/layout.py; the tests check they agree); the readers' offsets
# are the reading library's (shaders/nanovdb.py)
GRID_DATA_SIZE = 672
TREE_DATA_SIZE = 64
UPPER_NODE_SIZE = 270400
LOWER_NODE_SIZE = 33856
LEAF_NODE_SIZE = 96
LEAF_FLAGS_WORD = 2 << 24  # mFlags (byte 15) = has-bbox, above the three bbox-dif bytes

# a grid header's constant words (luisaml/fvdb/layout.py and builder._write_header; the tests check they
# agree): what grid_write.gb_write_header writes besides the grid's own numbers
MAGIC_LO = 0x6F6E614E  # "NanoVDB1" (MAGIC_GRID), low and high words
MAGIC_HI = 0x31424456
VERSION = (32 << 21) | (9 << 10) | 2  # pack_version(*WRITE_VERSION)
FLAG_HAS_BBOX = 1 << 1
FLAG_IS_BREADTH_FIRST = 1 << 5
GRID_CLASS_INDEX = 8
GRID_TYPE_ON_INDEX = 20
FLOAT_ONE = 0x3F800000  # the maps' tapers: 1.0f, and 1.0's high word
DOUBLE_ONE_HI = 0x3FF00000
# GridData's field offsets (bytes)
OFF_GRID_SIZE = 32
OFF_MAP_MATF = 296
OFF_MAP_INVMATF = 332
OFF_MAP_VECF = 368
OFF_MAP_TAPERF = 380
OFF_MAP_MATD = 384
OFF_MAP_INVMATD = 456
OFF_MAP_VECD = 528
OFF_MAP_TAPERD = 552
OFF_WORLD_BBOX = 560
OFF_VOXEL_SIZE = 608
OFF_GRID_CLASS = 632
OFF_BLIND_METADATA_OFFSET = 640
OFF_DATA1 = 656
ROOT_OFF_TABLE_SIZE = 24

# the layout region's head (words; its rows from H_ROWS): the blob's words the zeroing stage clears, all
# voxels, and, laid out on the device (grid_write.gb_layout), the blob's bytes (its counted total) and
# whether they fit the blob's capacity (else the write stages write nothing: the run is repeated)
H_WORDS = 0
H_VOXELS = 1
H_BYTES = 2
H_ROOM = 3
H_ROWS = 16

# per-grid layout row the host uploads or gb_layout writes (words)
G_OFFSET = 0  # the grid's GridData in the blob (bytes)
G_ROOT = 1  # its RootData
G_TILES = 2  # its first root tile
G_UPPER = 3  # its first upper node
G_LOWER = 4
G_LEAF = 5
G_LEAF_START = 6  # global id of its first leaf (sorted order)
G_LOWER_START = 7
G_UPPER_START = 8
G_VOXEL_START = 9  # voxels of the grids before it
G_WORDS = 16

# per-grid summary row the device writes before the read-back (words)
S_LEAVES = 0
S_LOWERS = 1
S_UPPERS = 2
S_VOXELS = 3
S_BBOX = 4  # 4..9: min i, j, k, max i, j, k
S_TRANSFORM = 16  # 16..: the grid's row of the transforms table (topology.grid_transforms; copied by the first stage)
# the table row's words, from S_TRANSFORM: voxel size and origin as float64 bits, float32 bits of fVDB's
# 1/h, -o/h and of h, o, and 1/h as float64 bits (the header's map)
T_H = 0
T_O = 6
T_INV_F = 12
T_H_F = 18
T_O_F = 21
T_INV = 24
T_WORDS = 30  # (topology.TRANSFORM_WORDS)
S_WORDS = 48

# radix sort: a leaf's key is KEY_WORDS words (little-endian) of NanoVDB's order, least significant first: the
# slot key (SLOT_BITS: upper slot << 12 | lower slot), then root tile k, j, i (up to 20 bits each) and the
# grid (up to 10 bits), each taken relative to its minimum over the leaves in as many bits as its span
# takes. The passes sort a byte each: the key's first ceil(bits / 8) bytes are the passes that run (a cloud
# inside one root tile sorts in 4, one spanning two tiles an axis in 4 too: 27 + 3 bits), the others do
# nothing; PASSES covers the widest key (27 + 3 x 20 + 10 = 97 bits).
SLOT_BITS = 27
KEY_WORDS = 4
PASSES = 13
