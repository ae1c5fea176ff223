"""The last stage of a grid built on the device (grid_build.py's pipeline, step 5): after the
host's read-back and layout, the blob is zeroed, the host's headers copied in, and every leaf,
lower node and upper node writes its own bytes and the table entry its parent holds; a thread per
child-mask word writes the masks (a node's children are a run sorted by slot, so a word's are found
by a binary search and are at most 32)."""
import luisa
from luisa.types import uint  # noqa: F401

from .grid_layout import (C_LEAVES, C_LOWERS, C_UPPERS, G_LEAF, G_LEAF_START, G_LOWER, G_LOWER_START, G_OFFSET,
                          G_ROOT, G_TILES, G_UPPER, G_UPPER_START, G_VOXEL_START, G_WORDS, LEAF_FLAGS_WORD,
                          LEAF_NODE_SIZE, LOWER_NODE_SIZE, UPPER_NODE_SIZE)
# the readers' offsets, from the reading library
from .nanovdb import (LEAF_OFF_OFFSET, LEAF_OFF_PREFIX_SUM, LEAF_OFF_VALUE_MASK, LOWER_OFF_CHILD_MASK, LOWER_OFF_TABLE,
                      UPPER_OFF_CHILD_MASK, UPPER_OFF_TABLE)


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
def gb_write_u64(blob, at, lo):
    """A non-negative 64-bit value below 2^31 at byte `at`."""
    blob.write(at, lo)
    blob.write(at + 4, 0)


@luisa.func
def gb_write_leaf(s, blob, ctr, layout, skey, mask, order, counts, new_lower, leaf_box, r):
    """Sorted leaf r: its 96 bytes and its parent's table entry."""
    if r < s.read(ctr + C_LEAVES):
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
        gb_write_u64(blob, pos + LEAF_OFF_OFFSET, 1 + s.read(counts + r) - s.read(g + G_VOXEL_START))
        blob.write(pos + LEAF_OFF_PREFIX_SUM, lo)
        blob.write(pos + LEAF_OFF_PREFIX_SUM + 4, hi)
        low = s.read(new_lower + r + 1) - 1
        lower_pos = s.read(g + G_LOWER) + LOWER_NODE_SIZE * (low - s.read(g + G_LOWER_START))
        slot = ((s.read(skey + 4 * r + 1) & 15) << 8) | ((s.read(skey + 4 * r + 2) & 15) << 4) | (
            s.read(skey + 4 * r + 3) & 15)
        gb_write_u64(blob, lower_pos + LOWER_OFF_TABLE + 8 * slot, pos - lower_pos)


@luisa.func
def gb_write_lower(s, blob, ctr, layout, skey, lower_first, new_upper, lower_box, l):
    """Lower node l: bbox and its parent's table entry (gb_child_words writes its child mask)."""
    if l < s.read(ctr + C_LOWERS):
        first = s.read(lower_first + l)
        b = s.read(skey + 4 * first)
        g = layout + G_WORDS * b
        pos = s.read(g + G_LOWER) + LOWER_NODE_SIZE * (l - s.read(g + G_LOWER_START))
        for a in range(0, 6):
            blob.write(pos + 4 * a, s.read(lower_box + 6 * l + a))
        up = s.read(new_upper + first + 1) - 1
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
