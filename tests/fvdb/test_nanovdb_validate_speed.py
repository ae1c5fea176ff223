"""The host's per-grid validation, vectorised over whole node levels (luisaml.fvdb.nanovdb_read: read_grids;
nanovdb_query: require_fvdb_index_grid, reached per bound bundle through operators/fvdb/common.py bundle_grids).

Two halves:
- valid grids (the builder's, warp's OnIndex and Index grids, empty grids, single voxels, value tiles
  at every level): what the reader derives equals a plain reference that walks the bytes one node
  at a time with struct and Python ints;
- damaged grids: one mutation per check that the vectorised code restructured (child pointers,
  parents, masks, tile indices, leaf bboxes, prefix sums, value offsets, fVDB's index ranges),
  refused with a NanoVDBError whose message names the offender.

Run as a script, it times read_grids and bundle_grids on the benchmark's 200k-voxel shell:
    python tests/fvdb/test_nanovdb_validate_speed.py
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from luisaml.fvdb import (
    GridBatch,
    NanoVDBError,
    active_voxels,
    build_grid,
    concat_grids,
    dense_ijk,
    ijk_to_value,
    leaf_origins,
    read_grids,
    require_fvdb_index_grid,
)
from luisaml.fvdb import layout as L
from luisaml.fvdb import nanovdb as nv
from luisaml.fvdb import nanovdb_query as nq
from luisaml.fvdb import nanovdb_read as nr

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------
# the reference: one node at a time
# ------------------------------------------------------------------------------------------------


def _set_bits(data: bytes, pos: int, nbytes: int) -> list[int]:
    """Return the set bits (ascending) of the little-endian bit mask of nbytes at pos."""
    m = int.from_bytes(data[pos : pos + nbytes], "little")
    out = []
    while m:
        low = m & -m
        out.append(low.bit_length() - 1)
        m ^= low
    return out


def _child_origin(origin: tuple, slot: int, log2dim: int, child_log2: int) -> tuple[int, int, int]:
    """Return the origin of the child in table slot of a node at origin (slot = x << 2d | y << d | z)."""
    m = (1 << log2dim) - 1
    xyz = ((slot >> (2 * log2dim)) & m, (slot >> log2dim) & m, slot & m)
    return tuple(o + (x << child_log2) for o, x in zip(origin, xyz))


def _s32(u: int) -> int:
    return u - (1 << 32) if u >= 1 << 31 else u


def reference_tree(data: bytes, grid: int) -> dict:
    """Walk the valid grid at byte grid of data node by node; return what the reader derives.

    leaf_origins and leaf_counts are in leaf order; values maps each indexed leaf voxel's ijk to
    its getValue (OnIndex: offset + the active voxels before it; Index: offset + slot)."""
    tree = grid + L.GRID_DATA_SIZE
    off_leaf, _off_lower, _off_upper, off_root = struct.unpack_from("<4q", data, tree)
    n_leaf = struct.unpack_from("<I", data, tree + L.TREE_OFF_NODE_COUNT)[0]
    (grid_type,) = struct.unpack_from("<I", data, grid + L.GRID_OFF_GRID_TYPE)
    root = tree + off_root
    (table_size,) = struct.unpack_from("<I", data, root + L.ROOT_OFF_TABLE_SIZE)
    origins: dict[int, tuple[int, int, int]] = {}  # leaf byte position -> origin
    active_tiles = 0
    for t in range(table_size):
        tile = root + L.ROOT_DATA_SIZE + L.ROOT_TILE_SIZE * t
        key, child = struct.unpack_from("<Qq", data, tile)
        (state,) = struct.unpack_from("<I", data, tile + L.TILE_OFF_STATE)
        if child == 0:
            active_tiles += state != 0
            continue
        upper = root + child
        # key = (u32(k) >> 12) | (u32(j) >> 12) << 21 | (u32(i) >> 12) << 42
        upper_origin = tuple(_s32(((key >> s) & 0xFFFFF) << 12) for s in (42, 21, 0))
        upper_children = _set_bits(data, upper + L.UPPER_OFF_CHILD_MASK, L.UPPER_TABLE_COUNT // 8)
        upper_values = _set_bits(data, upper + L.UPPER_OFF_VALUE_MASK, L.UPPER_TABLE_COUNT // 8)
        active_tiles += len(set(upper_values) - set(upper_children))
        for slot in upper_children:
            (rel,) = struct.unpack_from("<q", data, upper + L.UPPER_OFF_TABLE + 8 * slot)
            lower = upper + rel
            lower_origin = _child_origin(upper_origin, slot, L.UPPER_LOG2DIM, L.LOWER_TOTAL_LOG2)
            lower_children = _set_bits(data, lower + L.LOWER_OFF_CHILD_MASK, L.LOWER_TABLE_COUNT // 8)
            lower_values = _set_bits(data, lower + L.LOWER_OFF_VALUE_MASK, L.LOWER_TABLE_COUNT // 8)
            active_tiles += len(set(lower_values) - set(lower_children))
            for lslot in lower_children:
                (rel,) = struct.unpack_from("<q", data, lower + L.LOWER_OFF_TABLE + 8 * lslot)
                origins[lower + rel] = _child_origin(lower_origin, lslot, L.LOWER_LOG2DIM, L.LEAF_TOTAL_LOG2)
    assert len(origins) == n_leaf
    leaf_origins_, leaf_counts, values = [], [], {}
    for n in range(n_leaf):
        leaf = tree + off_leaf + L.LEAF_NODE_SIZE * n
        origin = origins[leaf]
        leaf_origins_.append(origin)
        (offset,) = struct.unpack_from("<Q", data, leaf + L.LEAF_OFF_OFFSET)
        on = _set_bits(data, leaf + L.LEAF_OFF_VALUE_MASK, 64)
        leaf_counts.append(len(on))
        for rank, slot in enumerate(on):
            ijk = _child_origin(origin, slot, L.LEAF_LOG2DIM, 0)
            values[ijk] = offset + (rank if grid_type == L.GRID_TYPE_ON_INDEX else slot)
    return {"leaf_origins": leaf_origins_, "leaf_counts": leaf_counts, "active_tiles": active_tiles,
            "values": values}


def reference_fvdb_ok(data: bytes, grid: int) -> bool:
    """Return whether the grid's leaves index its active voxels exactly 1..N (fVDB's contract)."""
    ref = reference_tree(data, grid)
    (voxel_count,) = struct.unpack_from("<Q", data, grid + L.GRID_DATA_SIZE + L.TREE_OFF_VOXEL_COUNT)
    (value_count,) = struct.unpack_from("<Q", data, grid + L.GRID_OFF_DATA1)
    (grid_type,) = struct.unpack_from("<I", data, grid + L.GRID_OFF_GRID_TYPE)
    return (
        grid_type == L.GRID_TYPE_ON_INDEX
        and ref["active_tiles"] == 0
        and sum(ref["leaf_counts"]) == voxel_count
        and value_count == voxel_count + 1
        and sorted(ref["values"].values()) == list(range(1, voxel_count + 1))
    )


def assert_matches_reference(data: bytes) -> None:
    """Check every grid read_grids finds in data against the node-by-node reference."""
    for g in read_grids(data):
        ref = reference_tree(data, g.offset)
        got_origins = leaf_origins(g)
        assert got_origins.dtype == np.int32 and got_origins.shape == (g.leaf_count, 3)
        assert got_origins.tolist() == [list(o) for o in ref["leaf_origins"]]
        counts = nq._leaf_counts(g)
        assert counts.dtype == np.int64 and counts.tolist() == ref["leaf_counts"]
        headers = {"offset": g.offset, "grid_size": g.grid_size, "grid_type": g.grid_type,
                   "value_count": g.value_count, "node_offsets": g.tree.node_offsets,
                   "node_counts": g.tree.node_counts, "blind_metadata_offset": g.blind_metadata_offset,
                   "blind_metadata_count": g.blind_metadata_count}
        walk = nr.walk_tree(g.buffer, "grid", headers)
        assert walk.leaf_counts.tolist() == ref["leaf_counts"]
        assert g.leaf_voxel_count == sum(ref["leaf_counts"])
        assert g.active_tile_count == ref["active_tiles"]
        if ref["values"]:
            ijk = np.array(list(ref["values"]), np.int32)
            value, active = ijk_to_value(g, ijk)
            assert active.all() and value.tolist() == list(ref["values"].values())
        fvdb_ok = reference_fvdb_ok(data, g.offset)
        if fvdb_ok:
            require_fvdb_index_grid(g)
            by_index = sorted(ref["values"], key=ref["values"].get)
            assert active_voxels(g).tolist() == [list(v) for v in by_index]
        else:
            with pytest.raises(NanoVDBError):
                require_fvdb_index_grid(g)


# ------------------------------------------------------------------------------------------------
# valid grids: the vectorised reader equals the reference
# ------------------------------------------------------------------------------------------------


def _shell(radius: float, center: int = 0) -> np.ndarray:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_fvdb import shell_voxels
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return shell_voxels(radius, center)


def _scattered(seed: int) -> np.ndarray:
    """Voxels around the origin (negative coordinates too), far ones in other root tiles, tile corners."""
    rng = np.random.default_rng(seed)
    near = rng.integers(-200, 200, (1500, 3))
    far = rng.integers(-20000, 20000, (40, 3))
    corners = [[-4097, 0, 0], [4096, 4095, -1], [-1, -4096, 8191], [0, 0, 0], [7, 7, 7], [-(2**31), 2**31 - 1, 0]]
    return np.concatenate([near, far, corners]).astype(np.int32)


BUILT = {
    "empty": lambda: build_grid(np.zeros((0, 3), np.int32)),
    "single voxel at 0": lambda: build_grid(np.zeros((1, 3), np.int32)),
    "single negative voxel": lambda: build_grid(np.array([[-1, -4097, 2**31 - 1]], np.int32)),
    "single voxel, last leaf slot": lambda: build_grid(np.array([[7, 7, 7]], np.int32)),
    "full leaf": lambda: build_grid(dense_ijk((8, 8, 8))),
    "dense block": lambda: build_grid(dense_ijk((20, 17, 9), (-5, -3, 120))),
    "shell": lambda: build_grid(_shell(14.0, 60), 0.1, (1.0, 2.0, 3.0)),
    "scattered": lambda: build_grid(_scattered(0), 0.5, (-1.0, 0.0, 2.0), name="scattered"),
    "several grids, one empty": lambda: concat_grids(
        [build_grid(_scattered(1)), build_grid(np.zeros((0, 3), np.int32)), build_grid(dense_ijk((3, 3, 3)))]
    ),
}


@pytest.mark.parametrize("case", sorted(BUILT))
def test_builder_grids_match_reference(case):
    assert_matches_reference(BUILT[case]())


def test_warp_grids_match_reference(warp_ref, random_voxels):
    rng = np.random.default_rng(5)
    on_index = warp_ref.volume_bytes(warp_ref.volume_from_ijk(random_voxels(rng, 800, 60), 0.25, (1, 2, 3)))
    tiles = np.concatenate([rng.integers(-64, 64, (12, 3)), [[5000, -5000, 0], [-4100, 8, 3]]]).astype(np.int32)
    index = warp_ref.volume_bytes(warp_ref.volume_from_tiles(tiles))
    single = warp_ref.volume_bytes(warp_ref.volume_from_ijk(np.array([[-3, 4, -5]], np.int32)))
    for data in (on_index, index, single, on_index + index + single):
        assert_matches_reference(data)
    assert read_grids(index)[0].grid_type == L.GRID_TYPE_INDEX


def _lower(data: bytes, n: int = 0) -> int:
    return read_grids(data)[0].lower_offset + L.LOWER_NODE_SIZE * n


def _upper(data: bytes, n: int = 0) -> int:
    return read_grids(data)[0].upper_offset + L.UPPER_NODE_SIZE * n


def _leaf(data: bytes, n: int = 0) -> int:
    return read_grids(data)[0].leaf_offset + L.LEAF_NODE_SIZE * n


def _patch(data: bytes, pos: int, fmt: str, *values) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, pos, *values)
    return bytes(out)


def _free_slot(data: bytes, node: int, off_child: int, off_value: int, count: int) -> int:
    """Return the last table slot of node that is neither a child nor a value tile."""
    used = set(_set_bits(data, node + off_child, count // 8)) | set(_set_bits(data, node + off_value, count // 8))
    return max(set(range(count)) - used)


def _with_value_tile(data: bytes, level: str, value: int) -> tuple[bytes, int]:
    """Return data with one active value tile (index value) added to the first node of level, and its slot."""
    if level == "lower":
        node, off_v, off_c, off_t, count = (
            _lower(data), L.LOWER_OFF_VALUE_MASK, L.LOWER_OFF_CHILD_MASK, L.LOWER_OFF_TABLE, L.LOWER_TABLE_COUNT)
    else:
        node, off_v, off_c, off_t, count = (
            _upper(data), L.UPPER_OFF_VALUE_MASK, L.UPPER_OFF_CHILD_MASK, L.UPPER_OFF_TABLE, L.UPPER_TABLE_COUNT)
    slot = _free_slot(data, node, off_c, off_v, count)
    word_pos = node + off_v + 8 * (slot >> 6)
    (word,) = struct.unpack_from("<Q", data, word_pos)
    out = _patch(data, word_pos, "<Q", word | (1 << (slot & 63)))
    return _patch(out, node + off_t + 8 * slot, "<Q", value), slot


def _empty_with_root_tile(state: int, value: int) -> bytes:
    """Return an empty grid given one root value tile (its table grown by 32 bytes, the grid with it)."""
    data = bytearray(build_grid(np.zeros((0, 3), np.int32)))
    data += bytes(L.ROOT_TILE_SIZE)
    struct.pack_into("<Q", data, L.GRID_OFF_GRID_SIZE, len(data))
    root = L.GRID_DATA_SIZE + L.TREE_DATA_SIZE
    struct.pack_into("<I", data, root + L.ROOT_OFF_TABLE_SIZE, 1)
    tile = root + L.ROOT_DATA_SIZE
    struct.pack_into("<QqIIQ", data, tile, 0, 0, state, 0, value)
    return bytes(data)


SMALL = build_grid(np.concatenate([
    np.random.default_rng(3).integers(0, 300, (400, 3)),  # 8+ lower nodes in one upper node
    [[5000, 5000, 5000], [100, 100, 9000]],  # other root tiles, after the first (its nodes come first)
]).astype(np.int32))


@pytest.mark.parametrize("level", ["lower", "upper"])
def test_active_value_tiles_are_counted(level):
    # An Index grid may hold active tiles (an index into the value array): the reader accepts them,
    # counts them like the reference, and only fVDB's contract refuses them.
    data, _ = _with_value_tile(SMALL, level, 1)
    assert read_grids(data)[0].active_tile_count == 1
    assert_matches_reference(data)
    with pytest.raises(NanoVDBError, match="grid has 1 active tiles; fVDB grids index leaf voxels only"):
        require_fvdb_index_grid(read_grids(data)[0])


def test_root_value_tiles_are_counted():
    for state, active in ((1, 1), (0, 0)):
        data = _empty_with_root_tile(state, 0)
        (g,) = read_grids(data)
        assert (g.root_tile_count, g.active_tile_count) == (1, active)
        assert_matches_reference(data)


def test_leaf_ranges_out_of_leaf_order_still_tile():
    # Two leaves with the same voxel count swap their value ranges: the ranges still tile 1..N, so
    # fVDB's check accepts the grid (it sorts the ranges), and lookups follow the swapped offsets.
    g = read_grids(SMALL)[0]
    counts = nq._leaf_counts(g).tolist()
    a = 0
    b = next(i for i in range(1, len(counts)) if counts[i] == counts[a])
    pa, pb = _leaf(SMALL, a) + L.LEAF_OFF_OFFSET, _leaf(SMALL, b) + L.LEAF_OFF_OFFSET
    (oa,), (ob,) = struct.unpack_from("<Q", SMALL, pa), struct.unpack_from("<Q", SMALL, pb)
    data = _patch(_patch(SMALL, pa, "<Q", ob), pb, "<Q", oa)
    assert_matches_reference(data)
    require_fvdb_index_grid(read_grids(data)[0])


def test_bundle_grids_match_reference():
    from luisaml.operators.fvdb.common import Meta, bundle_grids, grid_metadata

    sets = [_shell(9.0, 40), np.zeros((1, 3), np.int32), _scattered(2), dense_ijk((4, 5, 6), (-2, -2, -2))]
    gb = GridBatch.from_ijk(sets, voxel_sizes=0.5, origins=0.0)
    bundle = gb.bundle()
    grids = bundle_grids(*bundle[:6])
    blob = bytes(np.asarray(bundle[0]))
    refs = [reference_tree(blob, g.offset) for g in grids]
    assert [g.voxel_count for g in grids] == [sum(r["leaf_counts"]) for r in refs]
    assert [g.leaf_count for g in grids] == [len(r["leaf_counts"]) for r in refs]
    meta = grid_metadata(*bundle[:6])
    np.testing.assert_array_equal(meta[:, Meta.VOXEL_COUNT], [sum(r["leaf_counts"]) for r in refs])
    np.testing.assert_array_equal(meta[:, Meta.VOXEL_OFFSET], np.cumsum([0] + [g.voxel_count for g in grids])[:-1])


# ------------------------------------------------------------------------------------------------
# the vectorised pieces against their plain forms
# ------------------------------------------------------------------------------------------------


def test_set_bits_equals_unpacked_nonzero():
    rng = np.random.default_rng(0)
    for rows, words, density in ((0, 8, 0.5), (3, 64, 0.0), (5, 64, 0.01), (4, 8, 0.5), (2, 512, 1.0), (7, 8, 0.97)):
        bits = rng.random((rows, 64 * words)) < density
        packed = np.packbits(bits, axis=1, bitorder="little").view("<u8")
        row, bit = nv.set_bits(packed)
        want_row, want_bit = np.nonzero(bits)
        np.testing.assert_array_equal(row, want_row)
        np.testing.assert_array_equal(bit, want_bit)
    top = np.array([[1 << 63, 0, (1 << 63) | 1]], np.uint64)  # the top bit of a word
    np.testing.assert_array_equal(nv.set_bits(top)[1], [63, 128, 191])


def test_in_node_order_equals_scatter():
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 300):
        idx = rng.permutation(n)
        values = rng.integers(-(2**31), 2**31, (n, 3)).astype(np.int32)
        want = np.zeros((n, 3), np.int32)
        want[idx] = values
        got = nr._in_node_order(idx, values)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)


def test_packed_prefix_word_equals_running_popcounts():
    rng = np.random.default_rng(2)
    masks = np.packbits(rng.random((500, 512)) < rng.random((500, 1)), axis=1, bitorder="little").view("<u8")
    masks[0], masks[1] = 0, np.uint64(2**64 - 1)
    counts = nv.popcount64(masks)
    packed = (counts @ nr._PREFIX_WEIGHTS).view(np.uint64)
    running = np.cumsum(counts[:, :7], axis=1)
    fields = (packed[:, None] >> (np.uint64(9) * np.arange(7, dtype=np.uint64))) & np.uint64(511)
    np.testing.assert_array_equal(fields.astype(np.int64), running)
    assert (packed >> np.uint64(63) == 0).all()
    np.testing.assert_array_equal(counts @ nv.ROW_SUM, counts.sum(axis=1))


def test_records_refuse_a_range_outside_the_buffer():
    buf = np.zeros(100, np.uint8)
    assert nv.records(buf, 4, 3, 32).shape == (3, 32)
    assert nv.records(buf, 10**9, 0, 32).shape == (0, 32)
    for begin, count in ((10, 3), (-32, 1), (0, 4)):
        with pytest.raises(NanoVDBError, match="run outside the 100-byte buffer"):
            nv.records(buf, begin, count, 32)


# ------------------------------------------------------------------------------------------------
# damaged grids: one mutation per restructured check, still refused
# ------------------------------------------------------------------------------------------------


def _child_entry(data: bytes, level: str, n: int = 0, k: int = 0) -> tuple[int, int]:
    """Return (byte position, value) of the k-th child-table entry of node n of level."""
    if level == "lower":
        node, off_c, off_t, count = _lower(data, n), L.LOWER_OFF_CHILD_MASK, L.LOWER_OFF_TABLE, L.LOWER_TABLE_COUNT
    else:
        node, off_c, off_t, count = _upper(data, n), L.UPPER_OFF_CHILD_MASK, L.UPPER_OFF_TABLE, L.UPPER_TABLE_COUNT
    slot = _set_bits(data, node + off_c, count // 8)[k]
    pos = node + off_t + 8 * slot
    return pos, struct.unpack_from("<q", data, pos)[0]


def _move_entry(level: str, delta: int, k: int = 0):
    def mutate(data):
        pos, value = _child_entry(data, level, 0, k)
        return _patch(data, pos, "<q", value + delta)
    return mutate


def _share_child(level: str):
    """Entry 1 of node 0 of level points at entry 0's child (entries are offsets from their node)."""
    def mutate(data):
        _, v0 = _child_entry(data, level, 0, 0)
        pos1, _ = _child_entry(data, level, 0, 1)
        return _patch(data, pos1, "<q", v0)
    return mutate


def _clear_last_child_bit(data: bytes) -> bytes:
    node = _lower(data)
    slot = _set_bits(data, node + L.LOWER_OFF_CHILD_MASK, L.LOWER_TABLE_COUNT // 8)[-1]
    pos = node + L.LOWER_OFF_CHILD_MASK + 8 * (slot >> 6)
    (word,) = struct.unpack_from("<Q", data, pos)
    return _patch(data, pos, "<Q", word & ~(1 << (slot & 63)))


def _extra_child_bit(data: bytes) -> bytes:
    # A child bit at a free slot: its table entry is 0, a pointer to the lower node itself.
    node = _lower(data)
    slot = _free_slot(data, node, L.LOWER_OFF_CHILD_MASK, L.LOWER_OFF_VALUE_MASK, L.LOWER_TABLE_COUNT)
    pos = node + L.LOWER_OFF_CHILD_MASK + 8 * (slot >> 6)
    (word,) = struct.unpack_from("<Q", data, pos)
    return _patch(data, pos, "<Q", word | (1 << (slot & 63)))


def _leaf_field(fmt: str, off: int, fn, n: int = 0):
    def mutate(data):
        pos = _leaf(data, n) + off
        (v,) = struct.unpack_from(fmt, data, pos)
        return _patch(data, pos, fmt, fn(v))
    return mutate


def _root_child(delta: int):
    def mutate(data):
        g = read_grids(data)[0]
        pos = g.root_offset + L.ROOT_DATA_SIZE + L.TILE_OFF_CHILD
        (v,) = struct.unpack_from("<q", data, pos)
        return _patch(data, pos, "<q", v + delta)
    return mutate


N_LEAF = read_grids(SMALL)[0].leaf_count
N_LOWER = read_grids(SMALL)[0].lower_count

DAMAGED = {
    "lower entry mid-leaf": (
        _move_entry("lower", 8),
        f"lower child-table entry #0 points at buffer byte \\d+, which is not the start of one of the {N_LEAF} leaf",
    ),
    "lower entry one byte off": (_move_entry("lower", 1, k=3), "lower child-table entry #3 points at buffer byte"),
    "lower entry past the last leaf": (_move_entry("lower", 96 * 10**6), "lower child-table entry #0 points at"),
    "lower entry far before": (_move_entry("lower", -(2**62)), "lower child-table entry #0 points at"),
    "upper entry mid-node": (
        _move_entry("upper", 32),
        f"upper child-table entry #0 points at buffer byte \\d+, which is not the start of one of the {N_LOWER} lower",
    ),
    "upper entry past the last lower": (_move_entry("upper", L.LOWER_NODE_SIZE * 1000), "upper child-table entry #0"),
    "root tile child mid-node": (_root_child(8), "root tile child #0 points at buffer byte"),
    "two lower entries, one leaf": (_share_child("lower"), "leaf node 0 is the child of more than one parent"),
    "two upper entries, one lower node": (
        _share_child("upper"), "lower node 0 is the child of more than one parent"
    ),
    "child bit cleared": (_clear_last_child_bit, "leaf node \\d+ is not reachable from the root \\(1 of"),
    "child bit at a free slot": (_extra_child_bit, "lower child-table entry #\\d+ points at buffer byte"),
    "active lower tile index = value count": (
        lambda d: _with_value_tile(d, "lower", read_grids(d)[0].value_count)[0],
        "active lower tile \\(node 0, slot \\d+\\) has index \\d+, expected < value count",
    ),
    "active upper tile index 2^64-1": (
        lambda d: _with_value_tile(d, "upper", 2**64 - 1)[0],
        "active upper tile \\(node 0, slot \\d+\\) has index 18446744073709551615, expected < value count",
    ),
    "leaf bbox min in the next block": (
        _leaf_field("<i", L.LEAF_OFF_BBOX_MIN + 8, lambda v: v + 8, n=5),
        "leaf 5 has bbox min \\[-?\\d+, -?\\d+, -?\\d+\\], outside the 8\\^3 block at",
    ),
    "prefix field 0 off by one": (
        _leaf_field("<Q", L.LEAF_OFF_PREFIX_SUM, lambda v: v ^ 1, n=2),
        "leaf 2 prefix sums \\[\\d+(, \\d+){6}\\] do not match its value mask popcounts \\[\\d+(, \\d+){6}\\]",
    ),
    "prefix field 6 changed": (
        _leaf_field("<Q", L.LEAF_OFF_PREFIX_SUM, lambda v: v ^ (1 << 62)), "leaf 0 prefix sums",
    ),
    "value mask word 0 bit flipped": (
        _leaf_field("<Q", L.LEAF_OFF_VALUE_MASK, lambda v: v ^ (1 << 40), n=1), "leaf 1 prefix sums",
    ),
    "leaf value offset 0": (_leaf_field("<Q", L.LEAF_OFF_OFFSET, lambda v: 0, n=3), "leaf 3 has value offset 0"),
    "leaf value offset 2^64-1": (
        _leaf_field("<Q", L.LEAF_OFF_OFFSET, lambda v: 2**64 - 1, n=4),
        "leaf 4 indexes values \\[18446744073709551615, \\d+\\), beyond the grid's value count",
    ),
    "last leaf one value too far": (
        _leaf_field("<Q", L.LEAF_OFF_OFFSET, lambda v: v + 1, n=N_LEAF - 1),
        f"leaf {N_LEAF - 1} indexes values .* beyond the grid's value count",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_grid_refused(case):
    mutate, message = DAMAGED[case]
    data = mutate(SMALL)
    assert data != SMALL
    with pytest.raises(NanoVDBError, match=message):
        read_grids(data)
    with pytest.raises(NanoVDBError, match=message):  # and as a bound bundle, whose blob holds it
        gb = GridBatch.from_ijk([np.zeros((1, 3), np.int32)])
        from luisaml.operators.fvdb.common import bundle_grids

        b = gb.bundle()
        bundle_grids(np.frombuffer(data, np.uint8), b[1], b[2], b[3], b[4], b[5])


def test_active_root_tile_index_out_of_range_refused():
    read_grids(_empty_with_root_tile(1, 0))
    read_grids(_empty_with_root_tile(0, 2**64 - 1))  # an inactive tile's value is not an index
    with pytest.raises(NanoVDBError, match="an active root tile has an index >= the value count 1"):
        read_grids(_empty_with_root_tile(1, 1))


def test_offset_near_2_63_is_compared_exactly():
    # The value-range check used to add in float64, which rounds above 2^53: with 2^60 values a leaf
    # at offset 2^60 - 1 holding k >= 2 voxels ends past the value count, yet offset + k rounded back
    # to 2^60. Exact uint64 arithmetic refuses it.
    g = read_grids(SMALL)[0]
    counts = nq._leaf_counts(g)
    n = int(np.flatnonzero((counts >= 2) & (counts < 128))[0])
    data = _patch(SMALL, L.GRID_OFF_DATA1, "<Q", 2**60)
    data = _patch(data, _leaf(SMALL, n) + L.LEAF_OFF_OFFSET, "<Q", 2**60 - 1)
    assert float(2**60 - 1) + int(counts[n]) == float(2**60)  # what float64 saw
    with pytest.raises(NanoVDBError, match=f"leaf {n} indexes values \\[{2**60 - 1}, {2**60 - 1 + int(counts[n])}\\)"):
        read_grids(data)
    # ending exactly at the value count is fine (the reader accepts it; fVDB's contract does not)
    ok = _patch(data, _leaf(SMALL, n) + L.LEAF_OFF_OFFSET, "<Q", 2**60 - int(counts[n]))
    with pytest.raises(NanoVDBError, match="value count \\(mData1\\) is 1152921504606846976"):
        require_fvdb_index_grid(read_grids(ok)[0])


def test_prefix_bit_63_is_outside_the_fields():
    # The seven 9-bit fields fill bits 0..62; bit 63 was never compared, and is not now.
    data = _leaf_field("<Q", L.LEAF_OFF_PREFIX_SUM, lambda v: v | (1 << 63))(SMALL)
    require_fvdb_index_grid(read_grids(data)[0])


def test_fvdb_contract_refusals_on_leaf_data():
    g = read_grids(SMALL)[0]
    counts = nq._leaf_counts(g).tolist()
    # A voxel added in the last mask word (no prefix field covers it): the tree is consistent, but
    # the leaves now hold one voxel more than TreeData says.
    last = _leaf(SMALL, 0) + L.LEAF_OFF_VALUE_MASK + 56
    (word,) = struct.unpack_from("<Q", SMALL, last)
    free = next(b for b in range(64) if not word >> b & 1)
    data = _patch(SMALL, last, "<Q", word | (1 << free))
    (g2,) = read_grids(data)
    assert g2.leaf_voxel_count == g.voxel_count + 1
    with pytest.raises(NanoVDBError, match="TreeData voxel count is \\d+ but the leaves hold \\d+ active voxels"):
        require_fvdb_index_grid(g2)
    # Ranges that overlap, leave a gap, or are swapped between leaves of different sizes.
    b = next(i for i in range(1, len(counts)) if counts[i] != counts[0])
    pa, pb = _leaf(SMALL, 0) + L.LEAF_OFF_OFFSET, _leaf(SMALL, b) + L.LEAF_OFF_OFFSET
    (oa,), (ob,) = struct.unpack_from("<Q", SMALL, pa), struct.unpack_from("<Q", SMALL, pb)
    for damaged in (
        _patch(SMALL, pb, "<Q", oa),  # two leaves share a range
        _patch(SMALL, pa, "<Q", oa + 1),  # index 1 unused
        _patch(_patch(SMALL, pa, "<Q", ob), pb, "<Q", oa),
    ):
        with pytest.raises(NanoVDBError, match="leaf value ranges do not tile the indices 1\\.\\.\\d+"):
            require_fvdb_index_grid(read_grids(damaged)[0])


# ------------------------------------------------------------------------------------------------
# timing (python tests/fvdb/test_nanovdb_validate_speed.py)
# ------------------------------------------------------------------------------------------------


def main() -> None:
    import statistics
    import time

    from luisaml.operators.fvdb.common import bundle_grids

    def median_ms(fn, runs: int = 50) -> float:
        fn()
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    for radius in (32.0, 126.0):  # bench_fvdb's shell: 126 is its ~200k-voxel GPU size
        gb = GridBatch.from_ijk([_shell(radius, 256)], voxel_sizes=0.01, origins=0.0)
        bundle = gb.bundle()[:6]
        read_ms = median_ms(lambda b=bundle: read_grids(b[0]))
        bundle_ms = median_ms(lambda b=bundle: bundle_grids(*b))
        print(f"shell radius {radius:g}: {gb.total_voxels} voxels, {gb.total_leaves} leaves: "
              f"read_grids {read_ms:.3f} ms, bundle_grids {bundle_ms:.3f} ms (median of 50)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
