"""Building NanoVDB OnIndex grids on the device (LuisaCompute DSL): the stages of
GridBatchFromIJK / GridBatchFromPoints over inputs bound at run time, and of the topology ops over
grids bound at run time (operators/fvdb/topology.py and topology_device.py emit one call of these
per stage and own the order; luisaml/dynamic.py the read-back between).

Everything lives in the node's int scratch (`s`, Operator.scratch) at word offsets the operator
computes (`GridBuildLayout`), plus the output blob (a ByteBuffer written with 32-bit stores). No
shared memory and no barriers (the CPU backend compiles neither): every stage is one plain
parallel loop, and its sequential loops run over bounded counts (a chunk, a leaf's mask words, the
grids before a point's for its binary search).

The pipeline, for N voxel keys (b, i, j, k) of B grids:

1. leaves, deduplicated by a hash table: a point claims an empty slot with a compare-and-swap of
   its index + 1, or finds its leaf's slot by comparing its key with the owner point's (whose key
   an earlier stage wrote: no half-written key is ever read); leaf ids are the owners' ranks (a
   prefix sum over points, whose first stage also folds the points' root tiles and grids into their
   ranges: the leaves'), so the id order is deterministic; then one stage: voxel bits OR into the
   leaf's mask (zeroed by the hash stage), an owner writes its leaf's key and sort key;
2. the distinct leaves sorted into NanoVDB's order by an LSD radix sort of 8-bit digits (a chunk
   of CHUNK leaves per thread: a digit histogram per chunk (the first pass's counted as the leaves'
   keys are written, a later pass's by the scatter before it), a prefix sum's up stages over (digit, chunk), a
   stable scatter per chunk) of a key packed from the 27 bits upper slot << 12 | lower slot, then root
   tile k, j, i and the grid, each relative to its minimum over the leaves in the bits its span takes
   (only the key's bytes are sorted: see PASSES);
3. in that order, runs of leaves with the same lower (upper) node key are the lower (upper) nodes:
   flags and prefix sums give every leaf its lower and upper id and its first voxel index;
4. every leaf folds its bbox into its lower node's, upper node's and grid's (atomic min / max);
   per grid a summary row (counts, ranges, bbox) that the host reads back;
5. after the read-back (the host lays out the grids and writes their 832-byte headers with the
   project's builder: luisaml/fvdb/builder.py grid_header), the blob is zeroed and every leaf,
   lower node, upper node and root tile writes its own bytes and the table entry its parent holds;
   a child-mask word is one thread's (a node's children are a run sorted by slot: a binary search
   finds the word's at most 32). That stage is grid_write.py; the words every stage and the
   operators agree on (scratch counters, layout and summary rows, sizes) are grid_layout.py.

Prefix sums are exclusive, in place, over chunks of SCAN words per thread, level by level (a
chunk's total goes one level up, to a last level of at most SCAN words), so no thread runs more than
SCAN sequential steps. A sum is its up stages alone: no stage scans its last level or adds chunk bases
down. Each reader adds its word's chunk sums of every level above it and sums the last level's words
before its own (gb_upper_sums, gb_prefix, grid_write.py; the total: gb_total), at most SCAN - 1 words
the same for every thread: the radix histograms' scatter (gb_scatter), gb_leaf_id for the leaf ids,
gb_sum_at for the voxel, lower and upper ids. The radix pass number that the shared pass kernels read
is two counter words (topology.py), each written by a stage none of whose threads reads it.
"""
import luisa
from luisa.builtin import bitwise_cast
from luisa.types import uint  # noqa: F401

from .grid_layout import (C_ERROR, C_LEAVES, C_LOWERS, C_MAX, C_MIN, C_UPPERS, C_WORDS, C_ZERO, CHUNK, ERR_COORDS,
                          HASH_EMPTY, KEY_WORDS, S_BBOX, S_LEAVES, S_LOWERS, S_TRANSFORM, S_UPPERS, S_VOXELS, S_WORDS,
                          SCAN, SLOT_BITS)
# (a generated module imports every stage's function from here: use_helper(name, "grid_build"))
from .grid_write import (gb_child_words, gb_header_word, gb_layout, gb_prefix, gb_sum_at, gb_total,  # noqa: F401
                         gb_upper_sums, gb_write_header, gb_write_leaf, gb_write_lower, gb_write_upper, gb_zero_blob)


@luisa.func
def gb_error(s, ctr, code):
    """Record error `code` unless an earlier one is recorded."""
    _old = s.atomic_compare_exchange(ctr + C_ERROR, 0, code)


# ---- prefix sums ------------------------------------------------------------------------------


@luisa.func
def gb_scan_up(s, src, dst, n, c):
    """Chunk c of the n words at src: exclusive running sums in place, the chunk's total to dst[c]."""
    first = c * SCAN
    if first < n:
        last = min(first + SCAN, n)
        acc = 0
        for e in range(first, last):
            v = s.read(src + e)
            s.write(src + e, acc)
            acc += v
        s.write(dst + c, acc)


# ---- keys, hash, leaves -----------------------------------------------------------------------


@luisa.func
def gb_clear(s, owner, cap, ctr, grid_first, grid_box, grids, t):
    """Empty hash slot t; thread 0 resets the counters and ranges, the first B threads the grids' leaf
    ranges and bboxes."""
    if t < cap:
        s.write(owner + t, HASH_EMPTY)
    if t < grids:
        s.write(grid_first + 2 * t, 0)
        s.write(grid_first + 2 * t + 1, 0)
        gb_box_init(s, grid_box + 6 * t)
    if t == 0:
        for w in range(0, C_WORDS):
            s.write(ctr + w, 0)
        for a in range(0, 4):
            s.write(ctr + C_MIN + a, 2147483647)
            s.write(ctr + C_MAX + a, -2147483647 - 1)


@luisa.func
def gb_zero(s, ctr):
    """0.0 read from memory: p * scale + gb_zero() + translate rounds the product on its own even
    where the backend contracts a * b + c into a fused multiply-add (CUDA), as numpy does."""
    return bitwise_cast(float, s.read(ctr + C_ZERO))


@luisa.func
def gb_float(bits):
    """The float32 whose bits are the int `bits` (the transforms' table)."""
    return bitwise_cast(float, bits)


@luisa.func
def gb_round(x):
    """floor(x + 0.5) of a float32 x as double arithmetic gives it (fVDB's round, NanoVDB's
    Vec3::round adds a double 0.5): x - floor(x) is exact, so no float32 rounding of x + 0.5."""
    r = floor(x)
    return r + select(0.0, 1.0, x - r >= 0.5)


@luisa.func
def gb_store_voxel(s, vox, ctr, p, b, x, y, z):
    """Point p's voxel (b, round(x, y, z)); a voxel that is not finite or outside int32 is an error."""
    rx = gb_round(x)
    ry = gb_round(y)
    rz = gb_round(z)
    ok = (rx >= -2147483648.0) and (rx < 2147483648.0) and (ry >= -2147483648.0) and (ry < 2147483648.0)
    ok = ok and (rz >= -2147483648.0) and (rz < 2147483648.0)  # (false for NaN)
    i = 0
    j = 0
    k = 0
    if ok:
        i = int(rx)
        j = int(ry)
        k = int(rz)
    else:
        gb_error(s, ctr, ERR_COORDS)
    s.write(vox + 4 * p, b)
    s.write(vox + 4 * p + 1, i)
    s.write(vox + 4 * p + 2, j)
    s.write(vox + 4 * p + 3, k)


@luisa.func
def gb_store_corner(s, vox, ctr, q, b, x, y, z, corner):
    """Key q: corner (di, dj, dk) = bits 2, 1, 0 of `corner` of the voxel floor(x, y, z) (fVDB's
    nearest voxels to a point); a floor that is not finite or outside int32 is an error."""
    fx = floor(x)
    fy = floor(y)
    fz = floor(z)
    # the corner + 1 must fit too: float32 below 2^31 is at most 2^31 - 128
    ok = (fx >= -2147483648.0) and (fx < 2147483648.0) and (fy >= -2147483648.0) and (fy < 2147483648.0)
    ok = ok and (fz >= -2147483648.0) and (fz < 2147483648.0)  # (false for NaN)
    i = 0
    j = 0
    k = 0
    if ok:
        i = int(fx) + ((corner >> 2) & 1)
        j = int(fy) + ((corner >> 1) & 1)
        k = int(fz) + (corner & 1)
    else:
        gb_error(s, ctr, ERR_COORDS)
    s.write(vox + 4 * q, b)
    s.write(vox + 4 * q + 1, i)
    s.write(vox + 4 * q + 2, j)
    s.write(vox + 4 * q + 3, k)


@luisa.func
def gb_append_voxel(s, vox, keys_at, b, i, j, k):
    """Append the voxel (b, i, j, k) after the keys counted at word keys_at (the layout table's key
    count, which the clear stage zeroed): the topology ops' candidate voxels, compacted. Their order
    varies from run to run; the grids built do not (leaves are deduplicated, then sorted)."""
    q = s.atomic_fetch_add(keys_at, 1)
    s.write(vox + 4 * q, b)
    s.write(vox + 4 * q + 1, i)
    s.write(vox + 4 * q + 2, j)
    s.write(vox + 4 * q + 3, k)


@luisa.func
def gb_same_leaf(s, vox, p, q):
    """Whether points p and q fall in the same leaf of the same grid."""
    same = s.read(vox + 4 * p) == s.read(vox + 4 * q)
    for a in range(1, 4):
        same = same and ((s.read(vox + 4 * p + a) >> 3) == (s.read(vox + 4 * q + a) >> 3))
    return same


@luisa.func
def gb_insert(s, vox, owner, slot_of, flag, mask, cap, p):
    """Find or claim point p's leaf in the hash table (open addressing, linear probing): slot_of[p]
    is the slot, flag[p] 1 where p claimed it (its owner), else 0. The table has at least twice as
    many slots as points, so a free slot is always found. Point p also zeroes leaf p's mask: the leaves
    are fewer than the keys, so every leaf's mask is zeroed before gb_leaf ORs bits into it."""
    for w in range(0, 16):
        s.write(mask + 16 * p + w, 0)
    b = s.read(vox + 4 * p)
    li = s.read(vox + 4 * p + 1) >> 3
    lj = s.read(vox + 4 * p + 2) >> 3
    lk = s.read(vox + 4 * p + 3) >> 3
    h = (uint(b) * uint(1640531527)) ^ (uint(li) * uint(73856093)) ^ (uint(lj) * uint(19349663)) ^ (
        uint(lk) * uint(83492791))
    h = h ^ (h >> uint(15))
    at = int(h & uint(cap - 1))
    found = -1
    mine = 0
    while found < 0:
        old = s.atomic_compare_exchange(owner + at, HASH_EMPTY, p + 1)
        if old == HASH_EMPTY:
            found = at
            mine = 1
        elif gb_same_leaf(s, vox, p, old - 1):
            found = at
        else:
            at = (at + 1) & (cap - 1)
    s.write(slot_of + p, found)
    s.write(flag + p, mine)


@luisa.func
def gb_leaf_id(s, ids, aux, q):
    """Owner point q's leaf id after the prefix sum over ids: its rank among the owners (gb_prefix, which
    makes the additions the sum leaves to its readers: topology.py _scan)."""
    return gb_prefix(s, ids, aux, q)


@luisa.func
def gb_leaf(s, vox, owner, slot_of, ids, aux, lkey, mask, order, key2, ctr, hist, keys, p):
    """Point p sets its voxel's bit, x-major n = (i&7)<<6 | (j&7)<<3 | (k&7), in its leaf's mask (zeroed
    by the hash stage: gb_insert); an owner point also writes its leaf's key (b, i >> 3, j >> 3, k >> 3) and
    sort key at the leaf's id, starts the sort permutation (id at place id) and counts its key's first byte
    into the first radix pass's histograms at its chunk (zeroed by the leaf ids' first up stage:
    gb_zero_hist; the leaf count, the ids' total over the keys, from gb_total). (One stage: the ranges the
    sort key reads were folded by the stage before, gb_point_ranges, and no thread reads what another writes
    here but through atomics.)"""
    own = s.read(owner + s.read(slot_of + p)) - 1
    id = gb_leaf_id(s, ids, aux, own)
    n = ((s.read(vox + 4 * p + 1) & 7) << 6) | ((s.read(vox + 4 * p + 2) & 7) << 3) | (s.read(vox + 4 * p + 3) & 7)
    _old = s.atomic_fetch_or(mask + 16 * id + (n >> 5), 1 << (n & 31))
    if own == p:
        b = s.read(vox + 4 * p)
        li = s.read(vox + 4 * p + 1) >> 3
        lj = s.read(vox + 4 * p + 2) >> 3
        lk = s.read(vox + 4 * p + 3) >> 3
        s.write(lkey + 4 * id, b)
        s.write(lkey + 4 * id + 1, li)
        s.write(lkey + 4 * id + 2, lj)
        s.write(lkey + 4 * id + 3, lk)
        s.write(order + id, id)
        gb_sort_key(s, key2, ctr, id, b, li, lj, lk)
        chunks = (gb_total(s, ids, aux, keys) + CHUNK - 1) // CHUNK
        _n = s.atomic_fetch_add(hist + gb_digit(s, key2, id, 0) * chunks + id // CHUNK, 1)


@luisa.func
def gb_zero_hist(s, hist, keys, c):
    """Thread c zeroes the first radix pass's histogram words 512c .. 512c + 511 below 256 ceil(keys /
    CHUNK), the most a leaf count of at most `keys` takes."""
    for e in range(c * 512, min(c * 512 + 512, 256 * ((keys + CHUNK - 1) // CHUNK))):
        s.write(hist + e, 0)


@luisa.func
def gb_point_ranges(s, vox, ctr, n, c):
    """Voxel keys SCAN c.. (of n) fold their root tile (i, j, k >> 12) and grid into the ranges: the
    leaves' (a leaf's tile and grid are its points'), folded before the leaves exist."""
    first = c * SCAN
    if first < n:
        lo0 = 2147483647
        lo1 = 2147483647
        lo2 = 2147483647
        lo3 = 2147483647
        hi0 = -2147483647 - 1
        hi1 = -2147483647 - 1
        hi2 = -2147483647 - 1
        hi3 = -2147483647 - 1
        for q in range(first, min(first + SCAN, n)):
            tk = s.read(vox + 4 * q + 3) >> 12
            tj = s.read(vox + 4 * q + 2) >> 12
            ti = s.read(vox + 4 * q + 1) >> 12
            b = s.read(vox + 4 * q)
            lo0 = min(lo0, tk)
            lo1 = min(lo1, tj)
            lo2 = min(lo2, ti)
            lo3 = min(lo3, b)
            hi0 = max(hi0, tk)
            hi1 = max(hi1, tj)
            hi2 = max(hi2, ti)
            hi3 = max(hi3, b)
        _a = s.atomic_fetch_min(ctr + C_MIN, lo0)
        _b = s.atomic_fetch_min(ctr + C_MIN + 1, lo1)
        _c = s.atomic_fetch_min(ctr + C_MIN + 2, lo2)
        _d = s.atomic_fetch_min(ctr + C_MIN + 3, lo3)
        _e = s.atomic_fetch_max(ctr + C_MAX, hi0)
        _f = s.atomic_fetch_max(ctr + C_MAX + 1, hi1)
        _g = s.atomic_fetch_max(ctr + C_MAX + 2, hi2)
        _h = s.atomic_fetch_max(ctr + C_MAX + 3, hi3)


@luisa.func
def gb_key_bits(s, ctr, f):
    """The bits field f (1..4: root tile k, j, i, the grid) takes relative to its minimum over the leaves."""
    return 32 - int(clz(bitwise_cast(uint, s.read(ctr + C_MAX + f - 1) - s.read(ctr + C_MIN + f - 1))))


@luisa.func
def gb_passes(s, ctr):
    """The radix passes the leaves' keys take: a byte each of the slot key and the fields' bits."""
    bits = SLOT_BITS
    for f in range(1, 5):
        bits += gb_key_bits(s, ctr, f)
    return (bits + 7) // 8


@luisa.func
def gb_put_bits(s, key, v, at):
    """OR the bits of v (uint, below 2^21) into the key's words at bit `at` (< 96: a spill stays inside)."""
    q = at >> 5
    r = at & 31
    s.write(key + q, bitwise_cast(int, bitwise_cast(uint, s.read(key + q)) | (v << uint(r))))
    if r > 0:
        s.write(key + q + 1, bitwise_cast(int, bitwise_cast(uint, s.read(key + q + 1)) | (v >> uint(32 - r))))


@luisa.func
def gb_sort_key(s, key2, ctr, id, b, li, lj, lk):
    """Leaf id's sort key (grid_layout.PASSES) from its key (b, li, lj, lk): the slot key, then root tile k,
    j, i and the grid, each relative to its minimum in its span's bits: the order of the key is NanoVDB's,
    its length the passes'."""
    upper = (((li >> 4) & 31) << 10) | (((lj >> 4) & 31) << 5) | ((lk >> 4) & 31)
    lower = ((li & 15) << 8) | ((lj & 15) << 4) | (lk & 15)
    key = key2 + KEY_WORDS * id
    s.write(key, (upper << 12) | lower)
    for w in range(1, KEY_WORDS):
        s.write(key + w, 0)
    at = SLOT_BITS
    for f in range(1, 5):
        v = b - s.read(ctr + C_MIN + 3)
        if f == 1:
            v = (lk >> 9) - s.read(ctr + C_MIN)
        elif f == 2:
            v = (lj >> 9) - s.read(ctr + C_MIN + 1)
        elif f == 3:
            v = (li >> 9) - s.read(ctr + C_MIN + 2)
        gb_put_bits(s, key, bitwise_cast(uint, v), at)
        at += gb_key_bits(s, ctr, f)


# ---- radix sort -------------------------------------------------------------------------------
# (its passes and keys: grid_layout.PASSES)


@luisa.func
def gb_pass_active(s, ctr, p):
    """Whether radix pass p sorts a byte of the keys (the passes that do nothing are the last ones)."""
    return p < gb_passes(s, ctr)


@luisa.func
def gb_pass_source(s, ctr, order_a, order_b, p):
    """The permutation buffer pass p reads: the active passes before it alternate A and B."""
    src = order_a
    if (min(p, gb_passes(s, ctr)) & 1) == 1:
        src = order_b
    return src


@luisa.func
def gb_digit(s, key2, id, p):
    return (s.read(key2 + KEY_WORDS * id + p // 4) >> (8 * (p % 4))) & 255


@luisa.func
def gb_hist_words(s, ctr, p):
    """The counters pass p's prefix sum runs over: 256 per chunk of leaves, none for a pass that does nothing."""
    words = 0
    if gb_pass_active(s, ctr, p):
        words = 256 * ((s.read(ctr + C_LEAVES) + CHUNK - 1) // CHUNK)
    return words


@luisa.func
def gb_scatter(s, ctr, key2, src, dst, hist, nxt, levels, p, c):
    """Chunk c moves its leaves, in order, to their digit's next place (a stable counting sort). Counter
    k holds its sum within its SCAN-word chunk, and each upper level its chunk's sum within its own
    (gb_upper_sums, the level bases from table word `levels`): every addition of the prefix sum is made
    here (topology.py _scan: no top-level or down-sweep stage). Where pass p + 1 sorts, each leaf also
    counts its next digit into nxt at the chunk its new place falls in (the next pass's histograms, which
    the up sweep of this pass zeroed: atomic adds, so the counts do not depend on the threads' order)."""
    n = s.read(ctr + C_LEAVES)
    chunks = (n + CHUNK - 1) // CHUNK
    if c < chunks and gb_pass_active(s, ctr, p):
        more = gb_pass_active(s, ctr, p + 1)
        for e in range(c * CHUNK, min(c * CHUNK + CHUNK, n)):
            id = s.read(src + e)
            k = gb_digit(s, key2, id, p) * chunks + c
            pos = s.read(hist + k)
            s.write(hist + k, pos + 1)
            at = pos + gb_upper_sums(s, levels, k)
            s.write(dst + at, id)
            if more:
                _old = s.atomic_fetch_add(nxt + gb_digit(s, key2, id, p + 1) * chunks + at // CHUNK, 1)


@luisa.func
def gb_zero_chunk(s, words, n, c):
    """Words SCAN c .. SCAN c + SCAN - 1 (below n) zeroed."""
    for e in range(c * SCAN, min(c * SCAN + SCAN, n)):
        s.write(words + e, 0)


# ---- nodes in order ---------------------------------------------------------------------------


@luisa.func
def gb_rank(s, ctr, lkey, mask, order, skey, counts, new_lower, new_upper, leaf_box, r):
    """Leaf r of the sorted order: its key (skey), its voxel count, whether it starts a lower or an
    upper node (differs from leaf r - 1 there), and its active bbox (from its mask)."""
    if r < s.read(ctr + C_LEAVES):
        id = s.read(order + r)
        b = s.read(lkey + 4 * id)
        li = s.read(lkey + 4 * id + 1)
        lj = s.read(lkey + 4 * id + 2)
        lk = s.read(lkey + 4 * id + 3)
        s.write(skey + 4 * r, b)
        s.write(skey + 4 * r + 1, li)
        s.write(skey + 4 * r + 2, lj)
        s.write(skey + 4 * r + 3, lk)
        lower = 1
        upper = 1
        if r > 0:
            q = s.read(order + r - 1)
            same_b = s.read(lkey + 4 * q) == b
            pi = s.read(lkey + 4 * q + 1)
            pj = s.read(lkey + 4 * q + 2)
            pk = s.read(lkey + 4 * q + 3)
            if same_b and (pi >> 4) == (li >> 4) and (pj >> 4) == (lj >> 4) and (pk >> 4) == (lk >> 4):
                lower = 0
            if same_b and (pi >> 9) == (li >> 9) and (pj >> 9) == (lj >> 9) and (pk >> 9) == (lk >> 9):
                upper = 0
        s.write(new_lower + r, lower)
        s.write(new_upper + r, upper)
        # the mask's 16 words: word w holds voxels (i&7) = w >> 1, (j&7) = 4 (w & 1) + bit >> 3, (k&7) = bit & 7
        count = 0
        imin = 8
        imax = -1
        lo = uint(0)  # the union of the 8 x-slices, j 0..3: bit 8j + k
        hi = uint(0)  # j 4..7: bit 8(j - 4) + k
        for w in range(0, 16):
            word = uint(s.read(mask + 16 * id + w))
            count += int(popcount(word))
            if word != uint(0):
                imin = min(imin, w >> 1)
                imax = max(imax, w >> 1)
            if (w & 1) == 0:
                lo = lo | word
            else:
                hi = hi | word
        jmin = 0
        jmax = 7
        if lo == uint(0):
            jmin = 4 + int(ctz(hi)) // 8
        else:
            jmin = int(ctz(lo)) // 8
        if hi == uint(0):
            jmax = 3 - int(clz(lo)) // 8
        else:
            jmax = 7 - int(clz(hi)) // 8
        kb = lo | hi
        kb = (kb | (kb >> uint(16))) & uint(65535)
        kb = (kb | (kb >> uint(8))) & uint(255)
        kmin = int(ctz(kb))
        kmax = 31 - int(clz(kb))
        s.write(counts + r, count)
        s.write(leaf_box + 6 * r, li * 8 + imin)
        s.write(leaf_box + 6 * r + 1, lj * 8 + jmin)
        s.write(leaf_box + 6 * r + 2, lk * 8 + kmin)
        s.write(leaf_box + 6 * r + 3, li * 8 + imax)
        s.write(leaf_box + 6 * r + 4, lj * 8 + jmax)
        s.write(leaf_box + 6 * r + 5, lk * 8 + kmax)


@luisa.func
def gb_firsts(s, ctr, skey, new_lower, new_upper, lower_aux, upper_aux, lower_first, upper_first, upper_lower,
              grid_first, r):
    """After the prefix sums (new_lower[r] = lower nodes before leaf r, new_lower[L] = all of them):
    each node's first leaf, each upper node's first lower node, each grid's leaf range [first, end); the
    last leaf writes the sentinels (one past the last node). (The nodes' boxes start empty from the
    clear stage: gb_node_boxes_init.)"""
    n = s.read(ctr + C_LEAVES)
    if r < n:
        low = gb_sum_at(s, new_lower, lower_aux, n, r)
        up = gb_sum_at(s, new_upper, upper_aux, n, r)
        if r == 0 or gb_sum_at(s, new_lower, lower_aux, n, r + 1) != low:
            s.write(lower_first + low, r)
        if r == 0 or gb_sum_at(s, new_upper, upper_aux, n, r + 1) != up:
            s.write(upper_first + up, r)
            s.write(upper_lower + up, low)
        b = s.read(skey + 4 * r)
        if r == 0 or s.read(skey + 4 * (r - 1)) != b:
            s.write(grid_first + 2 * b, r)
        if r == n - 1 or s.read(skey + 4 * (r + 1)) != b:
            s.write(grid_first + 2 * b + 1, r + 1)
        if r == n - 1:
            lowers = gb_total(s, new_lower, lower_aux, n)
            uppers = gb_total(s, new_upper, upper_aux, n)
            s.write(lower_first + lowers, n)
            s.write(upper_first + uppers, n)
            s.write(upper_lower + uppers, lowers)
            s.write(ctr + C_LOWERS, lowers)
            s.write(ctr + C_UPPERS, uppers)


@luisa.func
def gb_node_boxes_init(s, lower_box, upper_box, keys, t):
    """Lower and upper node t's boxes empty (t < keys: no more nodes than keys), before any leaf folds in."""
    if t < keys:
        gb_box_init(s, lower_box + 6 * t)
        gb_box_init(s, upper_box + 6 * t)


@luisa.func
def gb_box_init(s, box):
    for a in range(0, 3):
        s.write(box + a, 2147483647)
        s.write(box + 3 + a, -2147483647 - 1)


@luisa.func
def gb_box_add(s, box, leaf_box, r):
    """Fold leaf r's bbox into box (6 words) with atomic min / max."""
    for a in range(0, 3):
        _lo = s.atomic_fetch_min(box + a, s.read(leaf_box + 6 * r + a))
        _hi = s.atomic_fetch_max(box + 3 + a, s.read(leaf_box + 6 * r + 3 + a))


@luisa.func
def gb_node_boxes(s, ctr, skey, new_lower, new_upper, lower_aux, upper_aux, leaf_box, lower_box, upper_box, grid_box,
                  r):
    """Leaf r's bbox folds into its lower node's, its upper node's and its grid's."""
    n = s.read(ctr + C_LEAVES)
    if r < n:
        gb_box_add(s, lower_box + 6 * (gb_sum_at(s, new_lower, lower_aux, n, r + 1) - 1), leaf_box, r)
        gb_box_add(s, upper_box + 6 * (gb_sum_at(s, new_upper, upper_aux, n, r + 1) - 1), leaf_box, r)
        gb_box_add(s, grid_box + 6 * s.read(skey + 4 * r), leaf_box, r)


@luisa.func
def gb_summary(s, ctr, new_lower, new_upper, counts, lower_aux, upper_aux, counts_aux, grid_first, grid_box, summary,
               b):
    """Grid b's row for the host: leaves, lower and upper nodes, voxels, bbox (zeros when empty)."""
    first = s.read(grid_first + 2 * b)
    end = s.read(grid_first + 2 * b + 1)
    row = summary + S_WORDS * b
    for w in range(0, S_TRANSFORM):
        s.write(row + w, 0)
    if end > first:
        # a grid's first leaf starts a lower and an upper node (its grid differs from the leaf before)
        s.write(row + S_LEAVES, end - first)
        n = s.read(ctr + C_LEAVES)
        s.write(row + S_LOWERS, gb_sum_at(s, new_lower, lower_aux, n, end) - gb_sum_at(s, new_lower, lower_aux, n, first))
        s.write(row + S_UPPERS, gb_sum_at(s, new_upper, upper_aux, n, end) - gb_sum_at(s, new_upper, upper_aux, n, first))
        s.write(row + S_VOXELS, gb_sum_at(s, counts, counts_aux, n, end) - gb_sum_at(s, counts, counts_aux, n, first))
        for w in range(0, 6):
            s.write(row + S_BBOX + w, s.read(grid_box + 6 * b + w))
