"""NanoVDB OnIndex traversal in the LuisaCompute DSL: root-tile scan, upper, lower and leaf nodes,
and the popcount prefix index, read from a ByteBuffer with 32-bit loads.

Byte offsets are those of shared/reference/nanovdb-onindex.md (luisaml/fvdb/layout.py names them).
Every function takes the grid blob and the grid's root-tile table (the absolute byte position of
its first tile and the tile count), which the host derives once per bound grid (the `fvdb`
operators' metadata, see operators/fvdb/common.py). Grids are validated on the host before any
kernel reads them (luisaml.fvdb.read_grids): every child offset stays inside the blob, and fVDB
grids have no active tiles, so a voxel is active exactly when a leaf holds it.

Offsets are 32-bit: blobs are limited to 2 GiB, so the low word of every 64-bit offset is enough.
"""
import luisa
from luisa.builtin import bitwise_cast
from luisa.types import uint  # noqa: F401

# NanoVDB struct sizes and field offsets (bytes), mirrored from luisaml/fvdb/layout.py; the tests
# check the two agree.
ROOT_DATA_SIZE = 96
ROOT_TILE_SIZE = 32
UPPER_OFF_CHILD_MASK = 4128
UPPER_OFF_TABLE = 8256
LOWER_OFF_CHILD_MASK = 544
LOWER_OFF_TABLE = 1088
LEAF_OFF_VALUE_MASK = 16
LEAF_OFF_OFFSET = 80
LEAF_OFF_PREFIX_SUM = 88
LEAF_NODE_SIZE = 96


@luisa.func
def nvdb_float(bits):
    """The float whose bit pattern is the int `bits` (metadata keeps floats in an int table)."""
    return bitwise_cast(float, bits)


@luisa.func
def nvdb_root_child(blob, tiles, tile_count, i, j, k):
    """Byte position of the upper node holding (i, j, k), or -1: NanoVDB's linear root-tile scan
    (RootData::probe) on the 64-bit key (u32(k)>>12) | (u32(j)>>12)<<21 | (u32(i)>>12)<<42."""
    ui = uint(i) >> uint(12)
    uj = uint(j) >> uint(12)
    uk = uint(k) >> uint(12)
    key_lo = uk | (uj << uint(21))
    key_hi = (uj >> uint(11)) | (ui << uint(10))
    node = -1
    t = 0
    while t < tile_count:
        p = tiles + t * ROOT_TILE_SIZE
        if blob.read(uint, p) == key_lo:
            if blob.read(uint, p + 4) == key_hi:
                child = int(blob.read(uint, p + 8))  # from the RootData start; 0 = a value tile
                if child != 0:
                    node = tiles - ROOT_DATA_SIZE + child
                break
        t += 1
    return node


@luisa.func
def nvdb_child(blob, node, mask_off, table_off, n):
    """Byte position of child n of an internal node, or -1 when slot n holds a tile."""
    r = -1
    if ((blob.read(uint, node + mask_off + (n >> 5) * 4) >> uint(n & 31)) & uint(1)) != uint(0):
        r = node + int(blob.read(uint, node + table_off + n * 8))  # from this node's start
    return r


@luisa.func
def nvdb_leaf(blob, tiles, tile_count, i, j, k):
    """Byte position of the leaf node holding (i, j, k), or -1."""
    leaf = -1
    upper = nvdb_root_child(blob, tiles, tile_count, i, j, k)
    if upper >= 0:
        n2 = (((i & 4095) >> 7) << 10) | (((j & 4095) >> 7) << 5) | ((k & 4095) >> 7)
        lower = nvdb_child(blob, upper, UPPER_OFF_CHILD_MASK, UPPER_OFF_TABLE, n2)
        if lower >= 0:
            n1 = (((i & 127) >> 3) << 8) | (((j & 127) >> 3) << 4) | ((k & 127) >> 3)
            leaf = nvdb_child(blob, lower, LOWER_OFF_CHILD_MASK, LOWER_OFF_TABLE, n1)
    return leaf


@luisa.func
def nvdb_leaf_value(blob, leaf, i, j, k):
    """OnIndex value of (i, j, k) in a leaf: mOffset + the active voxels before it (7 x 9-bit
    prefix sums of the 64-bit mask words, then a popcount inside its word); 0 if inactive."""
    n = ((i & 7) << 6) | ((j & 7) << 3) | (k & 7)
    half_word = n >> 5  # the 32-bit half of the 64-bit mask word n >> 6
    word = blob.read(uint, leaf + LEAF_OFF_VALUE_MASK + half_word * 4)
    bit = uint(n & 31)
    value = 0
    if ((word >> bit) & uint(1)) != uint(0):
        below = int(popcount(word & ((uint(1) << bit) - uint(1))))
        if (half_word & 1) == 1:
            below += int(popcount(blob.read(uint, leaf + LEAF_OFF_VALUE_MASK + (half_word - 1) * 4)))
        w = n >> 6
        prefix = 0
        if w > 0:
            # field w-1 sits at bit 9(w-1) of the 64-bit mPrefixSum; field 3 straddles bit 32
            s = 9 * (w - 1)
            lo = blob.read(uint, leaf + LEAF_OFF_PREFIX_SUM)
            hi = blob.read(uint, leaf + LEAF_OFF_PREFIX_SUM + 4)
            bits = lo
            if s >= 32:
                bits = hi >> uint(s - 32)
            elif s > 0:
                bits = (lo >> uint(s)) | (hi << uint(32 - s))
            prefix = int(bits & uint(511))
        value = int(blob.read(uint, leaf + LEAF_OFF_OFFSET)) + prefix + below
    return value


@luisa.func
def nvdb_find_leaf(blob, first_leaf, leaf_count, value):
    """Byte position of the leaf holding OnIndex value `value` (an active voxel's 1-based index): of
    a grid's leaf_count leaves (from first_leaf, LEAF_NODE_SIZE bytes apart, in index order, so
    their mOffsets rise), the last whose mOffset is at most value (a binary search)."""
    lo = 0
    hi = leaf_count - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(blob.read(uint, first_leaf + mid * LEAF_NODE_SIZE + LEAF_OFF_OFFSET)) <= value:
            lo = mid
        else:
            hi = mid - 1
    return first_leaf + lo * LEAF_NODE_SIZE


@luisa.func
def nvdb_leaf_slot(blob, leaf, value):
    """Slot (x * 64 + y * 8 + z) of the leaf's active voxel whose OnIndex value is `value`: the bit
    of rank value - mOffset in its value mask (the inverse of nvdb_leaf_value)."""
    left = value - int(blob.read(uint, leaf + LEAF_OFF_OFFSET))
    slot = -1
    for h in range(16):
        word = blob.read(uint, leaf + LEAF_OFF_VALUE_MASK + h * 4)
        c = int(popcount(word))
        if slot < 0:
            if left < c:
                for b in range(32):
                    if slot < 0 and ((word >> uint(b)) & uint(1)) != uint(0):
                        if left == 0:
                            slot = h * 32 + b
                        left -= 1
            else:
                left -= c
    return slot


@luisa.func
def nvdb_value(blob, tiles, tile_count, i, j, k):
    """NanoVDB getValue of (i, j, k) where a leaf holds it active: the 1-based index of the voxel;
    0 (the background) where it is inactive (fVDB's index is this minus 1)."""
    value = 0
    leaf = nvdb_leaf(blob, tiles, tile_count, i, j, k)
    if leaf >= 0:
        value = nvdb_leaf_value(blob, leaf, i, j, k)
    return value


@luisa.func
def nvdb_round(x):
    """NanoVDB's Vec3<float>::round() for one component: floor(double(x) + 0.5), exactly.

    Adding 0.5 in float would round up values just below a half; comparing the exact fraction
    x - floor(x) with 0.5 gives the double-precision answer."""
    f = floor(x)
    r = int(f)
    if x - f >= 0.5:
        r += 1
    return r


@luisa.func
def bezier_weight(t):
    """fVDB's Bezier kernel (BezierInterpolationIterator::bezier): twice the quadratic B-spline,
    so the 27 weights of a point sum to 8."""
    r = 0.0
    if t >= -1.5 and t < -0.5:
        r = (t + 1.5) * (t + 1.5)
    elif t >= -0.5 and t < 0.5:
        r = -2.0 * t * t + 1.5
    elif t >= 0.5 and t < 1.5:
        r = (t - 1.5) * (t - 1.5)
    return r


@luisa.func
def nvdb_leaf_origin(blob, leaf, axis):
    """Coordinate `axis` of a leaf's origin: its mBBoxMin (the active bbox's min) with the low 3
    bits cleared."""
    return bitwise_cast(int, blob.read(uint, leaf + axis * 4)) & -8


@luisa.func
def floor_div(x, s):
    """floor(x / s) for a positive s, negative x included (whatever the backend's integer division
    rounds to)."""
    q = x // s
    if q * s > x:
        q -= 1
    return q
