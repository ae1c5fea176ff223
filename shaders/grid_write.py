"""The last stage of a grid built on the device (grid_build.py's pipeline, step 5): the grids laid
out back to back (by the host's read-back step, or on the device by one thread: gb_layout), the blob
zeroed, the headers written (on the device's layout by a thread a grid, gb_write_header, the world
bbox's doubles through f64.py; on the host's, copied from the host's upload), and every leaf, lower
node and upper node writes its own bytes and the table entry its parent holds; a thread per
child-mask word writes the masks (a node's children are a run sorted by slot, so a word's are found
by a binary search and are at most 32)."""
import luisa
from luisa.types import uint  # noqa: F401

from .f64 import f64_add, f64_bits, f64_const, f64_hi, f64_lo, f64_mul_i32
from .grid_layout import (C_ERROR, C_LEAVES, C_LOWERS, C_UPPERS, DOUBLE_ONE_HI, ERR_BYTES, ERR_LEAVES, FLAG_HAS_BBOX,
                          FLAG_IS_BREADTH_FIRST, FLOAT_ONE, G_LEAF, G_LEAF_START, G_LOWER, G_LOWER_START, G_OFFSET,
                          G_ROOT, G_TILES, G_UPPER, G_UPPER_START, G_VOXEL_START, G_WORDS, GRID_CLASS_INDEX,
                          GRID_DATA_SIZE, GRID_TYPE_ON_INDEX, H_BYTES, H_ROOM, H_ROWS, H_VOXELS, H_WORDS,
                          LEAF_FLAGS_WORD, LEAF_NODE_SIZE, LOWER_NODE_SIZE, MAGIC_HI, MAGIC_LO, OFF_BLIND_METADATA_OFFSET,
                          OFF_DATA1, OFF_GRID_CLASS, OFF_GRID_SIZE, OFF_MAP_INVMATD, OFF_MAP_INVMATF, OFF_MAP_MATD,
                          OFF_MAP_MATF, OFF_MAP_TAPERD, OFF_MAP_TAPERF, OFF_MAP_VECD, OFF_MAP_VECF, OFF_VOXEL_SIZE,
                          OFF_WORLD_BBOX, ROOT_OFF_TABLE_SIZE, SCAN, S_BBOX, S_LEAVES, S_LOWERS, S_TRANSFORM, S_UPPERS,
                          S_VOXELS, S_WORDS, T_H, T_H_F, T_INV, T_INV_F, T_O, T_O_F, TREE_DATA_SIZE, UPPER_NODE_SIZE,
                          VERSION)
# the readers' offsets, from the reading library
from .nanovdb import (LEAF_OFF_OFFSET, LEAF_OFF_PREFIX_SUM, LEAF_OFF_VALUE_MASK, LOWER_OFF_CHILD_MASK, LOWER_OFF_TABLE,
                      ROOT_DATA_SIZE, ROOT_TILE_SIZE, UPPER_OFF_CHILD_MASK, UPPER_OFF_TABLE)

INT32_MAX = 2147483647


@luisa.func
def gb_add_nodes(at, count, size):
    """at + count * size, or -1 where that passes INT32_MAX (at, count >= 0): checked before the
    product, which would wrap first."""
    out = -1
    if at >= 0 and count <= (INT32_MAX - at) // size:
        out = at + count * size
    return out


@luisa.func
def gb_layout(s, ctr, summary, layout, grids, limit):
    """One thread: the grids back to back from the summaries (builder.grid_layout's offsets, as the
    host's read-back step lays them out), their rows at layout + H_ROWS, the head words (the blob's
    words, all voxels, its bytes, whether they fit `limit`, the blob's capacity in bytes). Bytes past
    INT32_MAX raise ERR_BYTES and leave the blob empty: the write stages read H_ROOM and write nothing;
    summaries whose leaves are not the hash's raise ERR_LEAVES (the host read them back to check)."""
    offset = 0
    leaf = 0
    lower = 0
    upper = 0
    voxel = 0
    for b in range(0, grids):
        row = summary + S_WORDS * b
        nl = s.read(row + S_LEAVES)
        nlo = s.read(row + S_LOWERS)
        nup = s.read(row + S_UPPERS)
        tree = gb_add_nodes(offset, 1, GRID_DATA_SIZE)
        up = gb_add_nodes(gb_add_nodes(tree, 1, TREE_DATA_SIZE + ROOT_DATA_SIZE), nup, ROOT_TILE_SIZE)
        lo = gb_add_nodes(up, nup, UPPER_NODE_SIZE)
        lf = gb_add_nodes(lo, nlo, LOWER_NODE_SIZE)
        end = gb_add_nodes(lf, nl, LEAF_NODE_SIZE)
        g = layout + H_ROWS + G_WORDS * b
        if offset >= 0:
            s.write(g + G_OFFSET, offset)
            s.write(g + G_ROOT, tree + TREE_DATA_SIZE)
            s.write(g + G_TILES, tree + TREE_DATA_SIZE + ROOT_DATA_SIZE)
            s.write(g + G_UPPER, up)
            s.write(g + G_LOWER, lo)
            s.write(g + G_LEAF, lf)
            s.write(g + G_LEAF_START, leaf)
            s.write(g + G_LOWER_START, lower)
            s.write(g + G_UPPER_START, upper)
            s.write(g + G_VOXEL_START, voxel)
        offset = end  # (-1 once past INT32_MAX: it stays so)
        leaf += nl
        lower += nlo
        upper += nup
        voxel += s.read(row + S_VOXELS)
    if leaf != s.read(ctr + C_LEAVES):
        _old = s.atomic_compare_exchange(ctr + C_ERROR, 0, ERR_LEAVES)
    room = 0
    if offset < 0:
        _old = s.atomic_compare_exchange(ctr + C_ERROR, 0, ERR_BYTES)  # (grid_build.gb_error's, which imports us)
        offset = 0
    elif offset <= limit:
        room = 1
    s.write(layout + H_WORDS, (offset // 4) * room)
    s.write(layout + H_VOXELS, voxel)
    s.write(layout + H_BYTES, offset)
    s.write(layout + H_ROOM, room)


@luisa.func
def gb_zero_blob(blob, words, stride, t):
    """Thread t zeroes words t, t + stride, ... of the blob."""
    w = t
    while w < words:
        blob.write(w * 4, uint(0))
        w += stride


@luisa.func
def gb_header_word(s, blob, layout, headers, grids, t):
    """Word t % 208 of grid t // 208's 832-byte header (GridData, TreeData, RootData), from the host."""
    if t < grids * 208:
        b = t // 208
        blob.write(s.read(layout + G_WORDS * b + G_OFFSET) + 4 * (t % 208), s.read(headers + t))


@luisa.func
def gb_write_bits(blob, at, x):
    """A 64-bit word (a ulong: a double's bits) at byte `at`."""
    blob.write(at, f64_lo(x))
    blob.write(at + 4, f64_hi(x))


@luisa.func
def gb_world_corner(s, t, i, a):
    """numpy's fl(fl(i * h) + o) on axis a, the grid's voxel size h and origin o from its transforms row t."""
    h = f64_bits(s.read(t + T_H + 2 * a), s.read(t + T_H + 2 * a + 1))
    o = f64_bits(s.read(t + T_O + 2 * a), s.read(t + T_O + 2 * a + 1))
    return f64_add(f64_mul_i32(i, h), o)


@luisa.func
def gb_write_header(s, blob, layout, summary, b, grids):
    """Grid b of `grids`: its 832-byte header (GridData, TreeData, RootData less its tiles) as
    builder._write_header writes it for the grid's summary row (counts, bbox), its layout row (offsets)
    and its transforms row (the map's floats and doubles, copied from what the host derived from h and o;
    the world bbox of the index bbox [min, max + 1], numpy's doubles through f64.py), numbered b of
    `grids` as concat_grids numbers them, with no name. Over the zeroed blob: its zero bytes are not
    written again. An empty grid has NanoVDB's empty bboxes and no HAS_BBOX flag."""
    g = layout + G_WORDS * b
    row = summary + S_WORDS * b
    t = row + S_TRANSFORM
    at = s.read(g + G_OFFSET)
    tree = at + GRID_DATA_SIZE
    root = tree + TREE_DATA_SIZE
    nl = s.read(row + S_LEAVES)
    nlo = s.read(row + S_LOWERS)
    nup = s.read(row + S_UPPERS)
    n = s.read(row + S_VOXELS)
    size = s.read(g + G_LEAF) + LEAF_NODE_SIZE * nl - at
    # GridData: magic, checksum disabled, version, flags, index and count, size
    blob.write(at, MAGIC_LO)
    blob.write(at + 4, MAGIC_HI)
    blob.write(at + 8, -1)
    blob.write(at + 12, -1)
    blob.write(at + 16, VERSION)
    flags = FLAG_IS_BREADTH_FIRST
    if n > 0:
        flags = flags | FLAG_HAS_BBOX
    blob.write(at + 20, flags)
    blob.write(at + 24, b)
    blob.write(at + 28, grids)
    blob.write(at + OFF_GRID_SIZE, size)
    # the map: diag(h), diag(1/h), o as floats then doubles, tapers 1; the voxel size
    for a in range(0, 3):
        blob.write(at + OFF_MAP_MATF + 16 * a, s.read(t + T_H_F + a))
        blob.write(at + OFF_MAP_INVMATF + 16 * a, s.read(t + T_INV_F + a))
        blob.write(at + OFF_MAP_VECF + 4 * a, s.read(t + T_O_F + a))
        for w in range(0, 2):
            blob.write(at + OFF_MAP_MATD + 32 * a + 4 * w, s.read(t + T_H + 2 * a + w))
            blob.write(at + OFF_MAP_INVMATD + 32 * a + 4 * w, s.read(t + T_INV + 2 * a + w))
            blob.write(at + OFF_MAP_VECD + 8 * a + 4 * w, s.read(t + T_O + 2 * a + w))
            blob.write(at + OFF_VOXEL_SIZE + 8 * a + 4 * w, s.read(t + T_H + 2 * a + w))
    blob.write(at + OFF_MAP_TAPERF, FLOAT_ONE)
    blob.write(at + OFF_MAP_TAPERD + 4, DOUBLE_ONE_HI)
    # the world bbox of [min, max + 1]; NanoVDB's empty one (min +DBL_MAX, max -DBL_MAX) when empty
    for a in range(0, 3):
        lo = f64_const(-1, 2146435071)  # DBL_MAX, 0x7fefffffffffffff
        hi = f64_const(-1, -1048577)  # -DBL_MAX, 0xffefffffffffffff
        if n > 0:
            lo = gb_world_corner(s, t, s.read(row + S_BBOX + a), a)
            # (max + 1 in int32, wrapping at INT32_MAX as the builder's int32 array does)
            hi = gb_world_corner(s, t, int(uint(s.read(row + S_BBOX + 3 + a)) + uint(1)), a)
        gb_write_bits(blob, at + OFF_WORLD_BBOX + 8 * a, lo)
        gb_write_bits(blob, at + OFF_WORLD_BBOX + 24 + 8 * a, hi)
    blob.write(at + OFF_GRID_CLASS, GRID_CLASS_INDEX)
    blob.write(at + OFF_GRID_CLASS + 4, GRID_TYPE_ON_INDEX)
    blob.write(at + OFF_BLIND_METADATA_OFFSET, size)
    blob.write(at + OFF_DATA1, n + 1)
    # TreeData: node offsets from TreeData (0 for an empty level), counts, voxels
    if nl > 0:
        blob.write(tree, s.read(g + G_LEAF) - tree)
    if nlo > 0:
        blob.write(tree + 8, s.read(g + G_LOWER) - tree)
    if nup > 0:
        blob.write(tree + 16, s.read(g + G_UPPER) - tree)
    blob.write(tree + 24, TREE_DATA_SIZE)
    blob.write(tree + 32, nl)
    blob.write(tree + 36, nlo)
    blob.write(tree + 40, nup)
    blob.write(tree + 56, n)
    # RootData: the index bbox (NanoVDB's empty one: +INT32_MAX, INT32_MIN), its tiles
    for a in range(0, 3):
        lo_i = 2147483647
        hi_i = -2147483647 - 1
        if n > 0:
            lo_i = s.read(row + S_BBOX + a)
            hi_i = s.read(row + S_BBOX + 3 + a)
        blob.write(root + 4 * a, lo_i)
        blob.write(root + 12 + 4 * a, hi_i)
    blob.write(root + ROOT_OFF_TABLE_SIZE, nup)


@luisa.func
def gb_write_u64(blob, at, lo):
    """A non-negative 64-bit value below 2^31 at byte `at`."""
    blob.write(at, lo)
    blob.write(at + 4, 0)


@luisa.func
def gb_upper_sums(s, levels, k):
    """What the upper levels of a prefix sum add to its word k: the sum has no top-level or down-sweep
    stage (topology.py _scan), so its readers make every addition. Level j's base is table word levels +
    j - 1 (build_scratch.Scratch: 0 past the sum's last level), for j = 1 .. 7; each level below the last
    holds exclusive sums within its SCAN-word chunks (its word k // SCAN^j added), the last (at most SCAN
    words: its chunks' totals, as the last up stage wrote them) is summed here over its words before k's."""
    v = 0
    i = k
    cur = 0
    for j in range(0, 7):
        base = s.read(levels + j)
        if base != 0:
            if cur != 0:
                v += s.read(cur + i)
            cur = base
            i = i // SCAN
    if cur != 0:
        for w in range(0, i):
            v += s.read(cur + w)
    return v


@luisa.func
def gb_prefix(s, words, aux, i):
    """Word i (below the n words summed) of the exclusive prefix sum over the words at `words`: its
    word plus its upper levels' (gb_upper_sums, their bases from table word aux); a sum of one level (at
    most SCAN words, no up stage) is its words before i, summed here."""
    v = 0
    if s.read(aux) == 0:
        for w in range(0, i):
            v += s.read(words + w)
    else:
        v = s.read(words + i) + gb_upper_sums(s, aux, i)
    return v


@luisa.func
def gb_total(s, words, aux, n):
    """The total of the n words the prefix sum at `words` ran over: its last level's ceil(n / SCAN^levels)
    words (at most SCAN), summed."""
    cur = words
    m = n
    for j in range(0, 7):
        base = s.read(aux + j)
        if base != 0:
            cur = base
            m = (m + SCAN - 1) // SCAN
    v = 0
    for w in range(0, m):
        v += s.read(cur + w)
    return v


@luisa.func
def gb_sum_at(s, words, aux, n, i):
    """Word i (0 <= i <= n) of an exclusive prefix sum over n words whose readers make its additions
    (topology.py _scan): gb_prefix below n, the total (gb_total) at n."""
    v = 0
    if i < n:
        v = gb_prefix(s, words, aux, i)
    else:
        v = gb_total(s, words, aux, n)
    return v


@luisa.func
def gb_write_leaf(s, blob, ctr, layout, skey, mask, order, counts, counts_aux, new_lower, lower_aux, leaf_box, r):
    """Sorted leaf r: its 96 bytes and its parent's table entry."""
    n = s.read(ctr + C_LEAVES)
    if r < n:
        b = s.read(skey + 4 * r)
        g = layout + G_WORDS * b
        pos = s.read(g + G_LEAF) + LEAF_NODE_SIZE * (r - s.read(g + G_LEAF_START))
        for a in range(0, 3):
            blob.write(pos + 4 * a, s.read(leaf_box + 6 * r + a))
        dif = 0
        for a in range(0, 3):
            dif = dif | ((s.read(leaf_box + 6 * r + 3 + a) - s.read(leaf_box + 6 * r + a)) << (8 * a))
        blob.write(pos + 12, dif | LEAF_FLAGS_WORD)
        id = s.read(order + r)
        lo = uint(0)
        hi = uint(0)
        acc = uint(0)
        for w in range(0, 16):
            word = s.read(mask + 16 * id + w)
            blob.write(pos + LEAF_OFF_VALUE_MASK + 4 * w, word)
            acc += uint(popcount(uint(word)))
            if (w & 1) == 1 and w < 15:
                f = w >> 1  # field f = popcount of 64-bit words 0..f, at bit 9f
                sh = 9 * f
                if sh + 9 <= 32:
                    lo = lo | (acc << uint(sh))
                elif sh >= 32:
                    hi = hi | (acc << uint(sh - 32))
                else:
                    lo = lo | (acc << uint(sh))
                    hi = hi | (acc >> uint(32 - sh))
        gb_write_u64(blob, pos + LEAF_OFF_OFFSET, 1 + gb_sum_at(s, counts, counts_aux, n, r) - s.read(g + G_VOXEL_START))
        blob.write(pos + LEAF_OFF_PREFIX_SUM, lo)
        blob.write(pos + LEAF_OFF_PREFIX_SUM + 4, hi)
        low = gb_sum_at(s, new_lower, lower_aux, n, r + 1) - 1
        lower_pos = s.read(g + G_LOWER) + LOWER_NODE_SIZE * (low - s.read(g + G_LOWER_START))
        slot = ((s.read(skey + 4 * r + 1) & 15) << 8) | ((s.read(skey + 4 * r + 2) & 15) << 4) | (
            s.read(skey + 4 * r + 3) & 15)
        gb_write_u64(blob, lower_pos + LOWER_OFF_TABLE + 8 * slot, pos - lower_pos)


@luisa.func
def gb_write_lower(s, blob, ctr, layout, skey, lower_first, new_upper, upper_aux, lower_box, l):
    """Lower node l: bbox and its parent's table entry (gb_child_words writes its child mask)."""
    if l < s.read(ctr + C_LOWERS):
        first = s.read(lower_first + l)
        b = s.read(skey + 4 * first)
        g = layout + G_WORDS * b
        pos = s.read(g + G_LOWER) + LOWER_NODE_SIZE * (l - s.read(g + G_LOWER_START))
        for a in range(0, 6):
            blob.write(pos + 4 * a, s.read(lower_box + 6 * l + a))
        up = gb_sum_at(s, new_upper, upper_aux, s.read(ctr + C_LEAVES), first + 1) - 1
        upper_pos = s.read(g + G_UPPER) + UPPER_NODE_SIZE * (up - s.read(g + G_UPPER_START))
        li = s.read(skey + 4 * first + 1)
        lj = s.read(skey + 4 * first + 2)
        lk = s.read(skey + 4 * first + 3)
        uslot = (((li >> 4) & 31) << 10) | (((lj >> 4) & 31) << 5) | ((lk >> 4) & 31)
        gb_write_u64(blob, upper_pos + UPPER_OFF_TABLE + 8 * uslot, pos - upper_pos)


@luisa.func
def gb_write_upper(s, blob, ctr, layout, skey, upper_first, upper_box, u):
    """Upper node u: bbox and its root tile (gb_child_words writes its child mask)."""
    if u < s.read(ctr + C_UPPERS):
        first = s.read(upper_first + u)
        b = s.read(skey + 4 * first)
        g = layout + G_WORDS * b
        local = u - s.read(g + G_UPPER_START)
        pos = s.read(g + G_UPPER) + UPPER_NODE_SIZE * local
        for a in range(0, 6):
            blob.write(pos + 4 * a, s.read(upper_box + 6 * u + a))
        # the root tile: key = (u32(k) >> 12) | (u32(j) >> 12) << 21 | (u32(i) >> 12) << 42
        ti = uint(s.read(skey + 4 * first + 1) >> 9) & uint(1048575)
        tj = uint(s.read(skey + 4 * first + 2) >> 9) & uint(1048575)
        tk = uint(s.read(skey + 4 * first + 3) >> 9) & uint(1048575)
        tile = s.read(g + G_TILES) + 32 * local
        blob.write(tile, tk | (tj << uint(21)))
        blob.write(tile + 4, (tj >> uint(11)) | (ti << uint(10)))
        gb_write_u64(blob, tile + 8, pos - s.read(g + G_ROOT))


@luisa.func
def gb_lower_slot(s, skey, r):
    return (((s.read(skey + 4 * r + 1) & 15) << 8) | ((s.read(skey + 4 * r + 2) & 15) << 4)
            | (s.read(skey + 4 * r + 3) & 15))


@luisa.func
def gb_upper_slot(s, skey, r):
    return ((((s.read(skey + 4 * r + 1) >> 4) & 31) << 10) | (((s.read(skey + 4 * r + 2) >> 4) & 31) << 5)
            | ((s.read(skey + 4 * r + 3) >> 4) & 31))


@luisa.func
def gb_child_words(s, blob, ctr, layout, skey, lower_first, upper_lower, stride, t):
    """Thread t writes child-mask words t, t + stride, ... of all nodes: the 128 words of each lower
    node, then the 1024 of each upper. A node's children are sorted by slot, so word w's children are a
    run found by binary search (the first with slot >= 32 w) and are at most 32."""
    lowers = s.read(ctr + C_LOWERS)
    total = lowers * 128 + s.read(ctr + C_UPPERS) * 1024
    x = t
    while x < total:
        upper = x >= lowers * 128
        node = x // 128
        w = x % 128
        if upper:
            node = (x - lowers * 128) // 1024
            w = (x - lowers * 128) % 1024
        lo = s.read(lower_first + node)  # children: leaves of a lower node, lower nodes of an upper
        hi = s.read(lower_first + node + 1)
        if upper:
            lo = s.read(upper_lower + node)
            hi = s.read(upper_lower + node + 1)
        end = hi
        while lo < hi:  # the first child with slot >= 32 w
            mid = (lo + hi) // 2
            slot = 0
            if upper:
                slot = gb_upper_slot(s, skey, s.read(lower_first + mid))
            else:
                slot = gb_lower_slot(s, skey, mid)
            if slot < 32 * w:
                lo = mid + 1
            else:
                hi = mid
        bits = uint(0)
        c = lo
        more = c < end
        while more:
            slot = 0
            if upper:
                slot = gb_upper_slot(s, skey, s.read(lower_first + c))
            else:
                slot = gb_lower_slot(s, skey, c)
            if (slot >> 5) == w:
                bits = bits | (uint(1) << uint(slot & 31))
                c += 1
                more = c < end
            else:
                more = False
        if bits != uint(0):
            r = s.read(lower_first + node)  # (the node's first leaf: its grid)
            if upper:
                r = s.read(lower_first + s.read(upper_lower + node))
            g = layout + G_WORDS * s.read(skey + 4 * r)
            at = s.read(g + G_LOWER) + LOWER_NODE_SIZE * (node - s.read(g + G_LOWER_START)) + LOWER_OFF_CHILD_MASK
            if upper:
                at = s.read(g + G_UPPER) + UPPER_NODE_SIZE * (node - s.read(g + G_UPPER_START)) + UPPER_OFF_CHILD_MASK
            blob.write(at + 4 * w, bits)
        x += stride
