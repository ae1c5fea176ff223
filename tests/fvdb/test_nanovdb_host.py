"""NanoVDB OnIndex grids on the host: reader, lookup, builder and .nvdb files, checked against warp-lang."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from luisaml.fvdb import (
    GridBatch,
    NanoVDBError,
    active_voxels,
    build_dense_grid,
    build_grid,
    build_grid_from_points,
    concat_grids,
    dense_ijk,
    encode_nvdb,
    ijk_to_index,
    nanovdb_order,
    points_to_ijk,
    read_grid,
    read_grids,
    read_nvdb,
    require_fvdb_index_grid,
    write_nvdb,
    write_raw,
)
from luisaml.errors import LimitError
from luisaml.fvdb import layout as L
from luisaml.fvdb.layout import GridLimitError
from luisaml.fvdb.nvdb_io import string_hash
from luisaml.limits import Limits

# Bytes where our builder and warp's legitimately differ: the version stamp, and TreeData's
# mTileCount, which warp fills with node counts and NanoVDB's own builders leave at 0.
VERSION_BYTES = slice(L.GRID_OFF_VERSION, L.GRID_OFF_VERSION + 4)
TILE_COUNT_BYTES = slice(
    L.GRID_DATA_SIZE + L.TREE_OFF_TILE_COUNT, L.GRID_DATA_SIZE + L.TREE_OFF_TILE_COUNT + 12
)


def unique_voxels(ijk: np.ndarray) -> np.ndarray:
    return np.unique(np.asarray(ijk, np.int32), axis=0)


# ------------------------------------------------------------------------------------------------
# grids written by warp, read by us
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed, voxel_size, translation",
    [(0, 1.0, (0, 0, 0)), (1, 0.5, (1, -2, 3)), (2, 0.125, (-7.5, 0.25, 100))],
)
def test_warp_onindex_grid_lookups_match(
    warp_ref, random_voxels, probes_around, seed, voxel_size, translation
):
    rng = np.random.default_rng(seed)
    ijk = random_voxels(rng)
    vol = warp_ref.volume_from_ijk(ijk, voxel_size, translation)
    (grid,) = read_grids(warp_ref.volume_bytes(vol))

    voxels = unique_voxels(ijk)
    assert grid.grid_type == L.GRID_TYPE_ON_INDEX
    assert grid.voxel_count == len(voxels) == grid.leaf_voxel_count
    assert grid.root_tile_count >= 8, "the voxel set should spread over several root tiles"
    require_fvdb_index_grid(grid)

    probes = probes_around(voxels, rng)
    ours = ijk_to_index(grid, probes)
    np.testing.assert_array_equal(ours, warp_ref.lookup_index(vol, probes))
    assert (ours >= 0).sum() >= len(voxels) and (ours < 0).any()

    # Enumerated voxels come out in index order: warp's index of row n is n.
    enumerated = active_voxels(grid)
    np.testing.assert_array_equal(warp_ref.lookup_index(vol, enumerated), np.arange(len(voxels)))
    np.testing.assert_array_equal(unique_voxels(enumerated), voxels)

    np.testing.assert_allclose(grid.voxel_size, voxel_size)
    np.testing.assert_allclose(grid.origin, translation)
    np.testing.assert_allclose(
        grid.map.index_to_world(voxels[:5]), voxels[:5] * voxel_size + np.array(translation)
    )
    np.testing.assert_allclose(grid.map.world_to_index(grid.map.index_to_world(voxels[:5])), voxels[:5])


def test_warp_index_grid_lookups_match(warp_ref, probes_around):
    rng = np.random.default_rng(7)
    tiles = np.concatenate([rng.integers(-64, 64, (20, 3)), [[5000, -5000, 0], [-4100, 8, 3]]]).astype(
        np.int32
    )
    vol = warp_ref.volume_from_tiles(tiles)
    (grid,) = read_grids(warp_ref.volume_bytes(vol))
    assert grid.grid_type == L.GRID_TYPE_INDEX
    probes = probes_around(tiles, rng)
    np.testing.assert_array_equal(ijk_to_index(grid, probes), warp_ref.lookup_index(vol, probes))
    with pytest.raises(NanoVDBError, match="must be OnIndex"):
        GridBatch.from_nanovdb(warp_ref.volume_bytes(vol))


def test_concatenated_warp_grids(warp_ref, random_voxels, probes_around):
    rng = np.random.default_rng(3)
    sets = [
        random_voxels(rng, 500, 50),
        random_voxels(rng, 50, 5, 1000),
        rng.integers(0, 8, (10, 3)).astype(np.int32),
    ]
    vols = [warp_ref.volume_from_ijk(s, 0.1 * (b + 1), (b, 2 * b, -b)) for b, s in enumerate(sets)]
    blob = b"".join(warp_ref.volume_bytes(v) for v in vols)  # naive concatenation: every header says 0 of 1

    grids = read_grids(blob)
    assert len(grids) == 3
    assert [g.offset for g in grids] == list(np.cumsum([0] + [g.grid_size for g in grids[:-1]]))
    for s, v, g in zip(sets, vols, grids):
        probes = probes_around(unique_voxels(s), rng, 500)
        np.testing.assert_array_equal(ijk_to_index(g, probes), warp_ref.lookup_index(v, probes))

    batch = GridBatch.from_nanovdb(blob)
    assert [g.grid_index for g in batch.grids] == [0, 1, 2]
    assert [g.grid_count for g in batch.grids] == [3, 3, 3]
    np.testing.assert_allclose(batch.voxel_sizes[:, 0], [0.1, 0.2, 0.3])
    np.testing.assert_allclose(batch.origins, [[0, 0, 0], [1, 2, -1], [2, 4, -2]])
    np.testing.assert_array_equal(batch.batch_offsets, np.cumsum([0] + [len(unique_voxels(s)) for s in sets]))
    for s, v, g in zip(sets, vols, batch.grids):
        probes = probes_around(unique_voxels(s), rng, 200)
        np.testing.assert_array_equal(ijk_to_index(g, probes), warp_ref.lookup_index(v, probes))


def test_warp_nvdb_files_read(warp_ref, tmp_path, random_voxels):
    vol = warp_ref.volume_from_ijk(random_voxels(np.random.default_rng(4), 300, 30), 0.5, (1, 2, 3))
    raw = warp_ref.volume_bytes(vol)
    for codec in ("none", "zip"):
        path = tmp_path / f"warp_{codec}.nvdb"
        vol.save_to_nvdb(str(path), codec=codec)  # legacy NanoVDB0 header stamped 32.3.3
        (grid,) = read_nvdb(path)
        assert grid.data() == raw
        batch = GridBatch.from_nanovdb(path)
        np.testing.assert_allclose(batch.voxel_sizes, [[0.5, 0.5, 0.5]])
        np.testing.assert_allclose(batch.origins, [[1, 2, 3]])


# ------------------------------------------------------------------------------------------------
# grids built by us, read by warp
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 5])
def test_builder_bytes_equal_warp_builder(warp_ref, random_voxels, seed):
    ijk = random_voxels(np.random.default_rng(seed))
    ours = np.frombuffer(build_grid(ijk, 0.25, (1, -2, 3)), np.uint8).copy()
    theirs = np.frombuffer(
        warp_ref.volume_bytes(warp_ref.volume_from_ijk(ijk, 0.25, (1, -2, 3))), np.uint8
    ).copy()
    assert len(ours) == len(theirs)
    for part in (VERSION_BYTES, TILE_COUNT_BYTES):
        ours[part] = theirs[part] = 0
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("codec", ["none", "zip"])
def test_built_grid_loads_in_warp(warp_ref, random_voxels, probes_around, codec):
    rng = np.random.default_rng(11)
    ijk = np.concatenate([random_voxels(rng), random_voxels(rng, 100, 10)])  # with duplicates
    voxels = nanovdb_order(ijk)
    blob = build_grid(ijk, voxel_size=(0.5, 0.25, 2.0), origin=(-1, 0.5, 3), name="luisaml grid")
    vol = warp_ref.load_nvdb(encode_nvdb(blob, codec))
    grid = read_grid(blob)

    assert vol.get_voxel_count() == len(voxels) == grid.voxel_count
    np.testing.assert_array_equal(warp_ref.lookup_index(vol, voxels), np.arange(len(voxels)))
    probes = probes_around(voxels, rng)
    np.testing.assert_array_equal(warp_ref.lookup_index(vol, probes), ijk_to_index(grid, probes))
    np.testing.assert_allclose(vol.get_voxel_size(), (0.5, 0.25, 2.0))
    info = vol.get_grid_info()
    np.testing.assert_allclose(info.translation, (-1, 0.5, 3))
    assert info.type_str == "onindex" or "index" in info.type_str.lower()
    assert grid.name == "luisaml grid"


def test_built_multi_grid_file_loads_in_warp(warp_ref, random_voxels, probes_around, tmp_path):
    rng = np.random.default_rng(12)
    sets = [random_voxels(rng, 300, 20), dense_ijk((5, 6, 7), (-3, -3, -3)), random_voxels(rng, 10, 3)]
    blob = concat_grids([build_grid(s, 0.1 * (b + 1)) for b, s in enumerate(sets)])
    path = write_nvdb(tmp_path / "multi.nvdb", blob, codec="zip")
    vol = warp_ref.load_nvdb(path.read_bytes())
    grids = read_grids(blob)
    for b, (s, g) in enumerate(zip(sets, grids)):
        assert vol is not None, f"warp found only {b} grids"
        assert (g.grid_index, g.grid_count) == (b, 3)
        probes = probes_around(unique_voxels(s), rng, 300)
        np.testing.assert_array_equal(warp_ref.lookup_index(vol, probes), ijk_to_index(g, probes))
        vol = vol.load_next_grid()
    assert vol is None

    # warp re-saves the multi-grid buffer; we read back the same grids.
    first = warp_ref.load_nvdb(path.read_bytes())
    first.save_to_nvdb(str(tmp_path / "resaved.nvdb"), codec="zip")
    assert [g.data() for g in read_nvdb(tmp_path / "resaved.nvdb")] == [g.data() for g in grids]


def test_empty_grid(warp_ref):
    blob = build_grid(np.zeros((0, 3), np.int32))
    assert len(blob) == L.MIN_GRID_SIZE
    grid = read_grid(blob)
    assert (grid.voxel_count, grid.leaf_count, grid.root_tile_count, grid.value_count) == (0, 0, 0, 1)
    np.testing.assert_array_equal(ijk_to_index(grid, [[0, 0, 0], [5, -5, 5]]), [-1, -1])
    assert active_voxels(grid).shape == (0, 3)
    assert warp_ref.load_nvdb(encode_nvdb(blob)).get_voxel_count() == 0


# ------------------------------------------------------------------------------------------------
# construction rules (fVDB's conventions)
# ------------------------------------------------------------------------------------------------


def test_voxel_order_is_hierarchical_x_major():
    ijk = np.array(
        [
            [0, 0, 1],
            [0, 1, 0],
            [1, 0, 0],
            [8, 0, 0],
            [0, 0, 8],
            [-1, 0, 0],
            [4096, 0, 0],
            [0, -4096, 0],
            [128, 0, 0],
        ]
    )
    order = nanovdb_order(np.concatenate([ijk, ijk[::-1]]))
    # Root tiles by signed (i>>12, j>>12, k>>12), then upper slot, lower slot, leaf slot (x-major).
    expected = [
        [-1, 0, 0],
        [0, -4096, 0],
        [0, 0, 1],
        [0, 1, 0],
        [1, 0, 0],
        [0, 0, 8],
        [8, 0, 0],
        [128, 0, 0],
        [4096, 0, 0],
    ]
    np.testing.assert_array_equal(order, expected)
    grid = read_grid(build_grid(ijk))
    np.testing.assert_array_equal(ijk_to_index(grid, expected), np.arange(len(expected)))
    np.testing.assert_array_equal(active_voxels(grid), expected)


def test_points_round_to_voxel_centres():
    # origin is the world centre of voxel (0,0,0): voxel ijk spans origin + (ijk +- 1/2) h, and a point on
    # the boundary goes up (round = floor(x + 1/2)).
    h, origin = 0.5, np.array([1.0, -1.0, 0.0])
    pts = origin + h * np.array([[0.0, 0.0, 0.0], [0.49, -0.49, 0.5], [-0.5, 0.51, -0.51], [2.0, -3.2, 7.7]])
    expected = [[0, 0, 0], [0, 0, 1], [0, 1, -1], [2, -3, 8]]
    np.testing.assert_array_equal(points_to_ijk(pts, h, origin), expected)
    np.testing.assert_array_equal(points_to_ijk(pts.astype(np.float32), h, origin), expected)
    grid = read_grid(build_grid_from_points(pts, h, origin))
    assert grid.voxel_count == 4
    assert (ijk_to_index(grid, points_to_ijk(pts, h, origin)) >= 0).all()
    with pytest.raises(ValueError, match="not finite"):
        points_to_ijk(np.array([[np.nan, 0, 0]]))


def test_dense_grid():
    mask = np.zeros((3, 4, 5), bool)
    mask[1, :, 2] = True
    full = read_grid(build_dense_grid((3, 4, 5), (-2, 0, 7), 0.1))
    masked = read_grid(build_dense_grid((3, 4, 5), (-2, 0, 7), 0.1, mask=mask))
    assert full.voxel_count == 60 and masked.voxel_count == 4
    box = np.stack(
        np.meshgrid(np.arange(-2, 1), np.arange(0, 4), np.arange(7, 12), indexing="ij"), -1
    ).reshape(-1, 3)
    np.testing.assert_array_equal(unique_voxels(active_voxels(full)), unique_voxels(box))
    np.testing.assert_array_equal(unique_voxels(active_voxels(masked)), [[-1, j, 9] for j in range(4)])
    np.testing.assert_array_equal(full.root_bbox, [[-2, 0, 7], [0, 3, 11]])


# ------------------------------------------------------------------------------------------------
# .nvdb files
# ------------------------------------------------------------------------------------------------


def test_nvdb_round_trip(tmp_path):
    rng = np.random.default_rng(21)
    blob = concat_grids([build_grid(rng.integers(-50, 50, (400, 3)), 0.3, name=f"g{b}") for b in range(3)])
    for codec in ("none", "zip"):
        path = write_nvdb(tmp_path / f"{codec}.nvdb", blob, codec)
        assert path.read_bytes()[:8] == b"NanoVDB2"
        assert b"".join(g.data() for g in read_nvdb(path)) == blob
        assert [g.name for g in read_nvdb(path.read_bytes())] == ["g0", "g1", "g2"]
    raw = write_raw(tmp_path / "raw.nvdb", blob)
    assert raw.read_bytes() == blob and read_nvdb(raw)[2].data() == read_grids(blob)[2].data()
    # Two segments (two files back to back) read as one buffer, renumbered.
    two = encode_nvdb(blob, "zip") + encode_nvdb(blob, "none")
    grids = read_nvdb(two)
    assert [(g.grid_index, g.grid_count) for g in grids] == [(i, 6) for i in range(6)]


def test_legacy_32_6_magic():
    # NanoVDB 32.6 grids carry "NanoVDB0" in mMagic and "NanoVDB1" in mData2; files may start "NanoVDB0" too.
    blob = build_grid([[1, 2, 3], [-9, 0, 9]])
    legacy = patch(patch(blob, L.GRID_OFF_MAGIC, "<Q", L.MAGIC_NUMB), L.GRID_OFF_DATA2, "<Q", L.MAGIC_GRID)
    for source in (legacy, patch(encode_nvdb(legacy), 0, "<Q", L.MAGIC_NUMB)):
        (grid,) = read_nvdb(source)
        np.testing.assert_array_equal(ijk_to_index(grid, [[-9, 0, 9], [1, 2, 3], [0, 0, 0]]), [0, 1, -1])


def test_file_metadata_fields():
    blob = build_grid([[1, 2, 3], [4000, 5, 6]], 0.5, (1, 1, 1), name="ab")
    data = encode_nvdb(blob)
    magic, version, count, codec = struct.unpack_from("<QIHH", data)
    assert (magic, count, codec) == (L.MAGIC_FILE, 1, 0) and version >> 21 == 32
    grid_size, file_size, key, voxels, gtype, gclass = struct.unpack_from("<QQQQII", data, 16)
    assert (grid_size, file_size, voxels, gtype, gclass) == (len(blob), len(blob), 2, 20, 8)
    assert key == string_hash("ab") == 97 * 67 + 98
    assert struct.unpack_from("<6i", data, 16 + L.FILE_META_OFF_INDEX_BBOX) == (1, 2, 3, 4000, 5, 6)
    assert struct.unpack_from("<4I", data, 16 + L.FILE_META_OFF_NODE_COUNT) == (2, 2, 1, 1)
    assert data[16 + 176 : 16 + 176 + 3] == b"ab\0"


# ------------------------------------------------------------------------------------------------
# malformed input
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_blob() -> bytes:
    rng = np.random.default_rng(31)
    return build_grid(np.concatenate([rng.integers(0, 40, (300, 3)), [[5000, 0, 0], [-9, -9, -9]]]))


def patch(blob: bytes, pos: int, fmt: str, *values) -> bytes:
    out = bytearray(blob)
    struct.pack_into(fmt, out, pos, *values)
    return bytes(out)


def tree_field(blob: bytes, fmt: str, off: int):
    return struct.unpack_from(fmt, blob, L.GRID_DATA_SIZE + off)


def _first_leaf(blob: bytes) -> int:
    return L.GRID_DATA_SIZE + tree_field(blob, "<q", 0)[0]


def _first_upper(blob: bytes) -> int:
    return L.GRID_DATA_SIZE + tree_field(blob, "<q", 16)[0]


def _first_child_slot(blob: bytes, node: int, off_cmask: int) -> int:
    words = np.frombuffer(blob, "<u8", 512, node + off_cmask)
    w = int(np.flatnonzero(words)[0])
    return 64 * w + int(np.log2(float(int(words[w]) & -int(words[w]))))


def _root_tile(blob: bytes, n: int) -> int:
    return L.GRID_DATA_SIZE + tree_field(blob, "<q", 24)[0] + L.ROOT_DATA_SIZE + L.ROOT_TILE_SIZE * n


MALFORMED = {
    "truncated header": (lambda b: b[:500], "truncated: GridData\\+TreeData need 736 bytes, only 500"),
    "truncated body": (lambda b: b[:-96], "truncated: grid size is \\d+ bytes but only \\d+ remain"),
    "wrong magic": (
        lambda b: b"NotNanoV" + b[8:],
        "bad magic NotNanoV \\(0x566f6e614e746f4e\\), expected NanoVDB1 or NanoVDB0",
    ),
    "file magic": (
        lambda b: b"NanoVDB2" + b[8:],
        "bad magic NanoVDB2 .*a .nvdb file header: read it with read_nvdb",
    ),
    "wrong type": (
        lambda b: patch(b, L.GRID_OFF_GRID_TYPE, "<I", 1),
        "grid type is 1, expected OnIndex \\(20\\) or Index \\(19\\)",
    ),
    "wrong class": (lambda b: patch(b, L.GRID_OFF_GRID_CLASS, "<I", 1), "grid class is 1, expected"),
    "wrong ABI": (
        lambda b: patch(b, L.GRID_OFF_VERSION, "<I", L.pack_version(31, 0, 0)),
        "has ABI 31, expected ABI 32",
    ),
    "misaligned size": (lambda b: patch(b, L.GRID_OFF_GRID_SIZE, "<Q", len(b) - 8), "not a multiple of 32"),
    "not breadth-first": (lambda b: patch(b, L.GRID_OFF_FLAGS, "<I", 2), "lack IsBreadthFirst"),
    "name without NUL": (lambda b: b[:40] + b"a" * 256 + b[296:], "grid name is not NUL-terminated"),
    "leaf offset outside": (
        lambda b: patch(b, L.GRID_DATA_SIZE, "<q", 10**9),
        "leaf node array \\(\\d+ x 96 B\\) spans .* outside the grid",
    ),
    "leaf offset misaligned": (
        lambda b: patch(b, L.GRID_DATA_SIZE, "<q", tree_field(b, "<q", 0)[0] + 8),
        "not 32-byte aligned",
    ),
    "lower count too big": (
        lambda b: patch(b, L.GRID_DATA_SIZE + L.TREE_OFF_NODE_COUNT + 4, "<I", 1000),
        "lower node array .* outside",
    ),
    "root table too big": (
        lambda b: patch(b, L.GRID_DATA_SIZE + L.TREE_DATA_SIZE + L.ROOT_OFF_TABLE_SIZE, "<I", 10**6),
        "root table size 1000000",
    ),
    "root offset zero": (lambda b: patch(b, L.GRID_DATA_SIZE + 24, "<q", 0), "root node offset is 0"),
    "tile child mid-node": (
        lambda b: patch(
            b,
            _root_tile(b, 0) + L.TILE_OFF_CHILD,
            "<q",
            struct.unpack_from("<q", b, _root_tile(b, 0) + 8)[0] + 32,
        ),
        "root tile child #0 points at buffer byte \\d+, which is not the start of one of the 3 upper nodes",
    ),
    "duplicate tile keys": (
        lambda b: patch(b, _root_tile(b, 1), "<Q", struct.unpack_from("<Q", b, _root_tile(b, 0))[0]),
        "duplicate tile keys",
    ),
    "tile key junk bits": (
        lambda b: patch(
            b, _root_tile(b, 0), "<Q", struct.unpack_from("<Q", b, _root_tile(b, 0))[0] | (1 << 20)
        ),
        "root tile key 0x[0-9a-f]{16} has bits outside its three 20-bit coordinate fields",
    ),
    "upper child entry": (
        lambda b: patch(
            b,
            _first_upper(b)
            + L.UPPER_OFF_TABLE
            + 8 * _first_child_slot(b, _first_upper(b), L.UPPER_OFF_CHILD_MASK),
            "<q",
            10**12,
        ),
        "upper child-table entry #0 points at buffer byte",
    ),
    "orphan leaf": (
        lambda b: patch(
            b,
            _first_upper(b)
            + L.UPPER_OFF_CHILD_MASK
            + 8 * (_first_child_slot(b, _first_upper(b), L.UPPER_OFF_CHILD_MASK) >> 6),
            "<Q",
            0,
        ),
        "lower node \\d+ is not reachable from the root",
    ),
    "active tile out of range": (
        lambda b: patch(
            patch(b, _first_upper(b) + L.UPPER_OFF_VALUE_MASK + 8 * 511, "<Q", 1 << 62),
            _first_upper(b) + L.UPPER_OFF_TABLE + 8 * 32766,
            "<Q",
            10**9,
        ),
        "active upper tile \\(node 0, slot 32766\\) has index 1000000000, expected < value count",
    ),
    "leaf offset beyond values": (
        lambda b: patch(b, _first_leaf(b) + L.LEAF_OFF_OFFSET, "<Q", 10**6),
        "leaf 0 indexes values \\[1000000, .*beyond",
    ),
    "leaf offset zero": (
        lambda b: patch(b, _first_leaf(b) + L.LEAF_OFF_OFFSET, "<Q", 0),
        "leaf 0 has value offset 0",
    ),
    "prefix sum": (
        lambda b: patch(b, _first_leaf(b) + L.LEAF_OFF_PREFIX_SUM, "<Q", 0x1FF),
        "leaf 0 prefix sums",
    ),
    "leaf bbox": (
        lambda b: patch(b, _first_leaf(b), "<i", struct.unpack_from("<i", b, _first_leaf(b))[0] + 8),
        "leaf 0 has bbox min",
    ),
    "blind metadata count": (
        lambda b: patch(b, L.GRID_OFF_BLIND_METADATA_OFFSET, "<qI", len(b) - 288, 5),
        "5 blind metadata records",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_grid_rejected(small_blob, case):
    mutate, message = MALFORMED[case]
    read_grids(small_blob)  # the unmodified blob is fine
    with pytest.raises(NanoVDBError, match=message):
        read_grids(mutate(small_blob))


def test_malformed_buffers_rejected(small_blob):
    with pytest.raises(NanoVDBError, match="empty buffer"):
        read_grids(b"")
    with pytest.raises(NanoVDBError, match="grid #1 at byte \\d+: truncated"):
        read_grids(small_blob + b"\0" * 100)
    with pytest.raises(NanoVDBError, match="not 32-byte aligned"):
        read_grid(b"\0" * 8 + small_blob, offset=8)
    with pytest.raises(NanoVDBError, match="dtype uint8"):
        read_grids(np.zeros(1000, np.int32))


def test_malformed_files_rejected(small_blob):
    good = encode_nvdb(small_blob, "zip")
    assert read_nvdb(good)[0].data() == small_blob
    with pytest.raises(NanoVDBError, match="truncated: ZIP chunk"):
        read_nvdb(good[:-10])
    with pytest.raises(NanoVDBError, match="grid #0 (ZIP data is corrupt|decompresses to)"):
        read_nvdb(good[:-200] + b"\xff" * 200)
    with pytest.raises(NanoVDBError, match="codec blosc"):
        read_nvdb(patch(good, 14, "<H", L.CODEC_BLOSC))
    # FileMetaData claims a smaller grid than the compressed payload holds.
    with pytest.raises(NanoVDBError, match="decompresses to more than the 4096 bytes FileMetaData says"):
        read_nvdb(patch(good, 16, "<Q", 4096))
    plain = encode_nvdb(small_blob)
    with pytest.raises(NanoVDBError, match="truncated: grid #0 needs"):
        read_nvdb(plain[:-1000])
    with pytest.raises(NanoVDBError, match="has version 31.0.0, expected ABI 32"):
        read_nvdb(patch(plain, 8, "<I", L.pack_version(31, 0, 0)) + b"")


def test_random_corruption_never_reads_out_of_bounds(small_blob):
    # Flip bits in the bytes that matter (headers, tiles, masks, tables, leaves): every outcome is
    # either a NanoVDBError or a grid whose lookups and enumeration run cleanly.
    rng = np.random.default_rng(41)
    base = np.frombuffer(small_blob, np.uint8)
    hot = np.union1d(np.arange(L.MIN_GRID_SIZE + 64), np.flatnonzero(base))
    probes = np.concatenate([rng.integers(-64, 5100, (200, 3)), active_voxels(read_grid(small_blob))]).astype(
        np.int32
    )
    accepted = 0
    for _ in range(300):
        data = base.copy()
        for pos in rng.choice(hot, size=rng.integers(1, 4)):
            data[pos] ^= np.uint8(1 << rng.integers(0, 8))
        try:
            grids = read_grids(data)
        except NanoVDBError:
            continue
        accepted += 1
        for g in grids:
            idx = ijk_to_index(g, probes)
            assert (idx >= -1).all() and (idx < g.value_count).all()
            if not g.active_tile_count:
                active_voxels(g)
    assert 0 < accepted < 300  # most corruptions are caught, some leave a consistent tree


# ------------------------------------------------------------------------------------------------
# sizes a file or buffer claims
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["none", "zip"])
def test_file_claiming_a_huge_grid(small_blob, codec):
    """A FileMetaData grid size of 2**64-1 used to end in an OverflowError (ZIP) before anything was read."""
    data = patch(encode_nvdb(small_blob, codec), L.FILE_HEADER_SIZE + L.FILE_META_OFF_GRID_SIZE, "<Q", 2**64 - 1)
    with pytest.raises(GridLimitError, match=r"FileMetaData #0 at byte 16 gives grid size 18446744073709551615, more "
                                             r"than the limit of \d+ bytes \(luisaml.Limits.grid_bytes\)"):
        read_nvdb(data)
    # one class for both kinds of caller
    assert issubclass(GridLimitError, NanoVDBError) and issubclass(GridLimitError, LimitError)


def test_zip_chunk_that_cannot_inflate_to_the_claimed_size(small_blob):
    good = encode_nvdb(small_blob, "zip")
    claimed = 1 << 30  # under the default limit, far beyond what the small chunk can hold
    with pytest.raises(NanoVDBError, match=r"FileMetaData gives grid #0 1073741824 bytes, more than its \d+-byte ZIP "
                                           r"chunk can inflate to"):
        read_nvdb(patch(good, L.FILE_HEADER_SIZE + L.FILE_META_OFF_GRID_SIZE, "<Q", claimed))


def test_file_grid_size_below_the_headers(small_blob):
    data = patch(encode_nvdb(small_blob), L.FILE_HEADER_SIZE + L.FILE_META_OFF_GRID_SIZE, "<Q", 64)
    with pytest.raises(NanoVDBError, match=r"FileMetaData #0 at byte 16 gives grid size 64, smaller than the 832 bytes"):
        read_nvdb(data)


def test_grid_name_size_past_the_end(small_blob):
    data = patch(encode_nvdb(small_blob), L.FILE_HEADER_SIZE + L.FILE_META_OFF_NAME_SIZE, "<I", 2**32 - 1)
    with pytest.raises(NanoVDBError, match=r"grid name #0 \(4294967295 bytes\) runs past the end of the file"):
        read_nvdb(data)


@pytest.mark.parametrize("codec", ["none", "zip"])
def test_grid_bytes_limit(small_blob, tmp_path, codec):
    """Limits.grid_bytes bounds each grid and all the grids of a file together, before they are inflated."""
    size = len(small_blob)
    data = encode_nvdb([small_blob, small_blob], codec)
    assert len(read_nvdb(data, limits=Limits(grid_bytes=2 * size))) == 2
    with pytest.raises(GridLimitError, match=rf"FileMetaData #0 at byte 16 gives grid size {size}, more than the limit "
                                             rf"of {size - 1} bytes"):
        read_nvdb(data, limits=Limits(grid_bytes=size - 1))
    with pytest.raises(GridLimitError, match=rf"FileMetaData #1 .* gives grid size {size}, which with the grids before "
                                             rf"it exceeds the limit of {2 * size - 1} bytes"):
        read_nvdb(data, limits=Limits(grid_bytes=2 * size - 1))
    with pytest.raises(GridLimitError, match=rf"NanoVDB grid #0 at byte 0: grid size is {size} bytes, more than the limit"):
        read_grids(small_blob, limits=Limits(grid_bytes=size - 1))
    path = write_nvdb(tmp_path / "g.nvdb", small_blob, codec)
    with pytest.raises(GridLimitError, match=r"file '.*g\.nvdb': \d+ bytes, more than the limit of 100"):
        read_nvdb(path, limits=Limits(grid_bytes=100))


def test_grid_offset_outside_the_buffer(small_blob):
    for offset in (-32, len(small_blob)):
        with pytest.raises(NanoVDBError, match=rf"offset {offset} is outside the {len(small_blob)}-byte buffer"):
            read_grid(small_blob, offset=offset)


def test_random_file_corruption_is_always_a_nanovdb_error(small_blob):
    # Flip bytes of the file header and FileMetaData of ZIP and plain files: every outcome is a
    # NanoVDBError (LimitError included) or grids equal to the original.
    rng = np.random.default_rng(43)
    for codec in ("none", "zip"):
        good = np.frombuffer(encode_nvdb(small_blob, codec), np.uint8)
        for _ in range(200):
            data = good.copy()
            for pos in rng.integers(0, L.FILE_HEADER_SIZE + L.FILE_METADATA_SIZE, size=rng.integers(1, 4)):
                data[pos] = rng.integers(0, 256)
            try:
                grids = read_nvdb(data.tobytes())
            except NanoVDBError:
                continue
            # what survives is the grid itself: the header bytes hit were ones the reader ignores
            assert [g.data() for g in grids] == [small_blob]
