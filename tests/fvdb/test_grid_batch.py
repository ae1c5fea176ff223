"""GridBatch and JaggedTensor bundles: shapes, dtypes, fVDB meanings, metadata layout, round trips."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from luisaml.fvdb import (
    MAX_GRIDS_PER_BATCH,
    GridBatch,
    JaggedTensor,
    MetaF,
    MetaI,
    NanoVDBError,
    build_grid,
    ijk_to_index,
    nanovdb_order,
    points_to_ijk,
    read_grid,
)
from luisaml.fvdb import layout as L


@pytest.fixture(scope="module")
def voxel_sets() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [
        np.concatenate([rng.integers(-100, 100, (800, 3)), [[6000, -6000, 3]]]).astype(np.int32),
        np.zeros((0, 3), np.int32),  # an empty grid in the middle
        rng.integers(0, 20, (300, 3)).astype(np.int32),
    ]


@pytest.fixture(scope="module")
def batch(voxel_sets) -> GridBatch:
    return GridBatch.from_ijk(
        voxel_sets,
        voxel_sizes=[[0.1, 0.1, 0.1], [1, 2, 3], [0.5, 0.5, 0.5]],
        origins=[[0, 0, 0], [1, 1, 1], [-3, 2, 0.25]],
    )


def test_bundle_arrays(batch, voxel_sets):
    b = batch.bundle()
    assert b._fields == (
        "grid_blob",
        "grid_byte_offsets",
        "voxel_sizes",
        "origins",
        "leaf_batch_indices",
        "batch_offsets",
        "list_indices",
    )
    dtypes = [np.uint8, np.int64, np.float64, np.float64, np.int32, np.int64, np.int32]
    assert [a.dtype for a in b] == [np.dtype(d) for d in dtypes]
    counts = [len(np.unique(s, axis=0)) for s in voxel_sets]
    sizes = [g.grid_size for g in batch.grids]
    assert b.grid_blob.shape == (sum(sizes),)
    np.testing.assert_array_equal(b.grid_byte_offsets, [0, sizes[0], sizes[0] + sizes[1]])
    assert (b.grid_byte_offsets % L.DATA_ALIGNMENT == 0).all()
    np.testing.assert_allclose(b.voxel_sizes, [[0.1] * 3, [1, 2, 3], [0.5] * 3])
    np.testing.assert_allclose(b.origins, [[0, 0, 0], [1, 1, 1], [-3, 2, 0.25]])
    np.testing.assert_array_equal(b.batch_offsets, np.cumsum([0] + counts))
    leaves = [g.leaf_count for g in batch.grids]
    np.testing.assert_array_equal(b.leaf_batch_indices, np.repeat([0, 1, 2], leaves))
    assert b.list_indices.shape == (0,)
    assert not b.grid_blob.flags.writeable
    # Every grid in the blob is where grid_byte_offsets says, numbered b of B.
    for i, off in enumerate(b.grid_byte_offsets):
        assert b.grid_blob[off : off + 8].tobytes() == b"NanoVDB1"
        assert struct.unpack_from("<II", b.grid_blob, off + L.GRID_OFF_GRID_INDEX) == (i, 3)


def test_voxels_and_indices(batch, voxel_sets):
    ijk = batch.ijk
    assert ijk.num_tensors == 3
    for s, got in zip(voxel_sets, ijk.unbind()):
        np.testing.assert_array_equal(got, nanovdb_order(s))
    idx = batch.ijk_to_index(ijk)
    for got, n in zip(idx.unbind(), batch.num_voxels):
        np.testing.assert_array_equal(got, np.arange(n))
    cum = batch.ijk_to_index(ijk, cumulative=True)
    np.testing.assert_array_equal(cum.jdata, np.arange(batch.total_voxels))
    missing = batch.ijk_to_index(
        [np.array([[1000, 0, 0]]), np.array([[0, 0, 0]]), np.array([[50, 50, 50]])], cumulative=True
    )
    np.testing.assert_array_equal(missing.jdata, [-1, -1, -1])


def test_metadata_layout(batch):
    meta = batch.metadata()
    assert meta.ints.shape == (3, len(MetaI)) and meta.ints.dtype == np.int64
    assert meta.floats.shape == (3, len(MetaF)) and meta.floats.dtype == np.float64
    blob = batch.grid_blob
    cum_voxels, cum_leaves = 0, 0
    for b, g in enumerate(batch.grids):
        row = meta.ints[b]
        assert row[MetaI.GRID_OFFSET] == g.offset and row[MetaI.GRID_SIZE] == g.grid_size
        assert row[MetaI.TREE_OFFSET] == g.offset + L.GRID_DATA_SIZE
        # Offsets point at the structures they name.
        tree = row[MetaI.TREE_OFFSET]
        assert struct.unpack_from("<Q", blob, tree + L.TREE_OFF_VOXEL_COUNT)[0] == row[MetaI.VOXEL_COUNT]
        assert (
            struct.unpack_from("<I", blob, row[MetaI.ROOT_OFFSET] + L.ROOT_OFF_TABLE_SIZE)[0]
            == row[MetaI.ROOT_TILE_COUNT]
        )
        assert row[MetaI.TILES_OFFSET] == row[MetaI.ROOT_OFFSET] + L.ROOT_DATA_SIZE
        if row[MetaI.ROOT_TILE_COUNT]:
            child = struct.unpack_from("<q", blob, row[MetaI.TILES_OFFSET] + L.TILE_OFF_CHILD)[0]
            assert row[MetaI.ROOT_OFFSET] + child == row[MetaI.UPPER_OFFSET]
        if row[MetaI.LEAF_COUNT]:
            assert struct.unpack_from("<Q", blob, row[MetaI.LEAF_OFFSET] + L.LEAF_OFF_OFFSET)[0] == 1
        else:
            assert row[MetaI.UPPER_OFFSET] == row[MetaI.LOWER_OFFSET] == row[MetaI.LEAF_OFFSET] == 0
        assert (row[MetaI.UPPER_COUNT], row[MetaI.LOWER_COUNT], row[MetaI.LEAF_COUNT]) == g.tree.node_counts[
            ::-1
        ]
        assert row[MetaI.CUM_VOXELS] == cum_voxels and row[MetaI.CUM_LEAVES] == cum_leaves
        assert row[MetaI.VALUE_COUNT] == row[MetaI.VOXEL_COUNT] + 1
        np.testing.assert_array_equal(row[MetaI.BBOX_MIN_I : MetaI.BBOX_MAX_K + 1], g.root_bbox.reshape(-1))
        cum_voxels += g.voxel_count
        cum_leaves += g.leaf_count
    f = meta.floats
    np.testing.assert_allclose(f[:, MetaF.VOXEL_SIZE_X : MetaF.VOXEL_SIZE_Z + 1], batch.voxel_sizes)
    np.testing.assert_allclose(f[:, MetaF.ORIGIN_X : MetaF.ORIGIN_Z + 1], batch.origins)
    # The stored world->voxel transform maps each voxel centre to its integer coordinate.
    for b in (0, 2):
        ijk = batch.ijk.unbind()[b][:10]
        world = batch.voxel_to_world(ijk, b)
        vox = (
            world * f[b, MetaF.W2V_SCALE_X : MetaF.W2V_SCALE_Z + 1]
            + f[b, MetaF.W2V_TRANSLATE_X : MetaF.W2V_TRANSLATE_Z + 1]
        )
        np.testing.assert_allclose(vox, ijk, atol=1e-9)
        np.testing.assert_allclose(batch.world_to_voxel(world, b), ijk, atol=1e-9)
    assert meta.total_voxels == batch.total_voxels and meta.total_leaves == batch.total_leaves
    assert meta.max_voxels == batch.num_voxels.max() and meta.max_leaves == batch.num_leaves.max()
    np.testing.assert_array_equal(meta.total_bbox, [[-100, -6000, -100], [6000, 99, 99]])


def test_save_and_load_round_trip(batch, tmp_path):
    for codec in ("none", "zip"):
        path = batch.save(tmp_path / f"batch_{codec}.nvdb", codec=codec)
        loaded = GridBatch.from_nanovdb(path)
        assert loaded.to_nanovdb() == batch.to_nanovdb()
        np.testing.assert_allclose(loaded.voxel_sizes, batch.voxel_sizes)
        np.testing.assert_allclose(loaded.origins, batch.origins)
        for a, b in zip(loaded.bundle(), batch.bundle()):
            np.testing.assert_array_equal(a, b)
    raw = GridBatch.from_nanovdb(batch.to_nanovdb())
    np.testing.assert_array_equal(raw.grid_blob, batch.grid_blob)


def test_from_points_and_dense():
    rng = np.random.default_rng(2)
    pts = [rng.normal(0, 3, (500, 3)), rng.uniform(-1, 1, (200, 3)).astype(np.float32)]
    batch = GridBatch.from_points(pts, voxel_sizes=0.25, origins=[[0, 0, 0], [0.125, 0, -0.125]])
    for b, p in enumerate(pts):
        ijk = points_to_ijk(p, 0.25, batch.origins[b])
        assert (ijk_to_index(batch.grids[b], ijk) >= 0).all()
        assert batch.num_voxels[b] == len(np.unique(ijk, axis=0))
        # Each point lies inside (or on the lower face of) its voxel's world box.
        centre = batch.voxel_to_world(ijk, b)
        assert (np.abs(p - centre) <= 0.125 + 1e-6).all()

    mask = np.ones((4, 4, 4), bool)
    mask[0] = False
    dense = GridBatch.from_dense(2, (4, 4, 4), ijk_min=(-2, -2, -2), voxel_sizes=0.5, mask=mask)
    np.testing.assert_array_equal(dense.num_voxels, [48, 48])
    np.testing.assert_array_equal(dense.ijk.unbind()[0], dense.ijk.unbind()[1])
    assert dense.ijk.jdata[:, 0].min() == -1


def test_from_ijk_accepts_array_and_jagged():
    one = GridBatch.from_ijk(np.array([[1, 2, 3], [1, 2, 3], [0, 0, 0]]), voxel_sizes=0.2)
    assert one.grid_count == 1 and one.total_voxels == 2
    jt = JaggedTensor.from_list([np.array([[0, 0, 0]]), np.array([[1, 1, 1], [2, 2, 2]])])
    two = GridBatch.from_ijk(jt)
    np.testing.assert_array_equal(two.num_voxels, [1, 2])
    np.testing.assert_allclose(two.voxel_sizes, 1.0)
    np.testing.assert_allclose(two.origins, 0.0)


def test_blind_data_is_stripped():
    # An fVDB-style saved grid: TensorGrid class plus one "fvdb_jdata" blind record after the tree.
    tree = bytearray(build_grid([[0, 0, 0], [3, 4, 5]], 0.5, grid_class=L.GRID_CLASS_TENSOR))
    payload = struct.pack("<3q", 2, 2, 4).ljust(32, b"\0")
    record = bytearray(L.BLIND_METADATA_SIZE)
    struct.pack_into("<qQI", record, 0, L.BLIND_METADATA_SIZE, 3, 8)
    record[L.BLIND_OFF_NAME : L.BLIND_OFF_NAME + 10] = b"fvdb_jdata"
    total = len(tree) + len(record) + len(payload)
    struct.pack_into("<Q", tree, L.GRID_OFF_GRID_SIZE, total)
    struct.pack_into("<qI", tree, L.GRID_OFF_BLIND_METADATA_OFFSET, len(tree), 1)
    blob = bytes(tree + record + payload)
    grid = read_grid(blob)
    assert (grid.blind_metadata_count, grid.grid_size, grid.tree_size) == (1, total, len(tree))
    batch = GridBatch.from_nanovdb(blob)
    assert batch.grids[0].grid_size == len(tree) and batch.grids[0].blind_metadata_count == 0
    assert batch.grids[0].grid_class == L.GRID_CLASS_TENSOR
    np.testing.assert_array_equal(batch.ijk.jdata, [[0, 0, 0], [3, 4, 5]])


def test_rejects_grids_fvdb_cannot_index():
    blob = bytearray(build_grid([[0, 0, 0], [1, 1, 1]]))
    struct.pack_into("<Q", blob, L.GRID_OFF_DATA1, 7)  # as if built with stats: extra indices
    read_grid(bytes(blob))  # still a valid NanoVDB grid
    with pytest.raises(NanoVDBError, match="value count \\(mData1\\) is 7, expected voxel count \\+ 1 = 3"):
        GridBatch.from_nanovdb(bytes(blob))
    empty = build_grid(np.zeros((0, 3), np.int32))
    with pytest.raises(NanoVDBError, match=f"at most {MAX_GRIDS_PER_BATCH} grids, got 1025"):
        GridBatch.from_grids([empty] * (MAX_GRIDS_PER_BATCH + 1))
    with pytest.raises(ValueError, match="voxel size must be positive"):
        GridBatch.from_ijk([np.zeros((1, 3), np.int32)], voxel_sizes=0.0)
    with pytest.raises(ValueError, match="\\[2, 3\\]"):
        GridBatch.from_ijk([np.zeros((1, 3), np.int32)] * 2, origins=np.zeros((3, 3)))


def test_features_follow_batch_offsets(batch):
    # A feature per voxel, stored in linear-index order: row batch_offsets[b] + index.
    feats = JaggedTensor.from_data_and_offsets(
        np.arange(batch.total_voxels, dtype=np.float32)[:, None], batch.batch_offsets
    )
    idx = batch.ijk_to_index(batch.ijk, cumulative=True)
    np.testing.assert_array_equal(feats.jdata[idx.jdata, 0], np.arange(batch.total_voxels))
    np.testing.assert_array_equal(feats.joffsets, batch.batch_offsets)


# ------------------------------------------------------------------------------------------------
# JaggedTensor
# ------------------------------------------------------------------------------------------------


def test_jagged_from_list():
    a, b, c = np.ones((2, 4)), np.zeros((0, 4)), np.full((3, 4), 2.0)
    jt = JaggedTensor.from_list([a, b, c])
    assert jt.jdata.shape == (5, 4)
    np.testing.assert_array_equal(jt.joffsets, [0, 2, 2, 5])
    assert jt.joffsets.dtype == np.int64 and jt.jidx.dtype == np.int32 and jt.jlidx.dtype == np.int32
    np.testing.assert_array_equal(jt.jidx, [0, 0, 2, 2, 2])
    assert jt.jlidx.shape == (0, 1) and jt.ldim == 1 and jt.lshape == [2, 0, 3]
    for x, y in zip(jt.unbind(), [a, b, c]):
        np.testing.assert_array_equal(x, y)
    bundle = jt.bundle()
    assert bundle._fields == ("jdata", "joffsets", "jidx", "jlidx")

    single = JaggedTensor.from_list([a])
    assert single.jidx.shape == (0,)  # fVDB leaves jidx empty for one tensor


def test_jagged_list_of_lists():
    x = [[np.ones((1, 2)), np.ones((2, 2))], [np.ones((3, 2))]]
    jt = JaggedTensor.from_list_of_lists(x)
    assert jt.ldim == 2 and jt.num_tensors == 3
    np.testing.assert_array_equal(jt.jlidx, [[0, 0], [0, 1], [1, 0]])
    np.testing.assert_array_equal(jt.jidx, [0, 1, 1, 2, 2, 2])
    assert jt.lshape == [[1, 2], [3]]
    assert [[t.shape for t in sub] for sub in jt.unbind()] == [[(1, 2), (2, 2)], [(3, 2)]]
    like = jt.jagged_like(np.arange(6))
    np.testing.assert_array_equal(like.joffsets, jt.joffsets)


def test_jagged_rejects_inconsistent_input():
    with pytest.raises(ValueError, match="trailing shape"):
        JaggedTensor.from_list([np.ones((2, 3)), np.ones((2, 4))])
    with pytest.raises(TypeError, match="dtype"):
        JaggedTensor.from_list([np.ones((2, 3)), np.ones((2, 3), np.int32)])
    with pytest.raises(ValueError, match="at least one tensor"):
        JaggedTensor.from_list([])
    with pytest.raises(ValueError, match="joffsets must rise from 0 to len\\(jdata\\) = 3"):
        JaggedTensor.from_data_and_offsets(np.ones(3), [0, 4])


def test_built_grids_are_read_from_their_headers(voxel_sets, monkeypatch):
    """from_ijk and from_points read the grids the builder just wrote from their headers (no tree walk),
    and give what the fully validated path gives (GridBatch.from_grids: every grid read and walked):
    the same blob bytes, bundle arrays, transforms and parsed grids; an empty grid among them."""
    from luisaml.fvdb import nanovdb_read

    rng = np.random.default_rng(5)
    sizes, origins = rng.uniform(0.1, 2.0, (3, 3)), rng.uniform(-5.0, 5.0, (3, 3))
    points = [rng.normal(0.0, 4.0, (n, 3)).astype(np.float32) for n in (700, 0, 40)]
    full = {"ijk": GridBatch.from_grids([build_grid(v, sizes[b], origins[b]) for b, v in enumerate(voxel_sets)]),
            "points": GridBatch.from_grids([build_grid(points_to_ijk(x, sizes[b], origins[b]), sizes[b], origins[b])
                                            for b, x in enumerate(points)])}
    walks = []
    real = nanovdb_read.walk_tree
    monkeypatch.setattr(nanovdb_read, "walk_tree", lambda *a, **k: walks.append(1) or real(*a, **k))
    built = {"ijk": GridBatch.from_ijk(voxel_sets, sizes, origins), "points": GridBatch.from_points(points, sizes, origins)}
    assert walks == []
    for kind, want in full.items():
        got = built[kind]
        assert not got.grid_blob.flags.writeable
        for g, w in zip(got.bundle(), want.bundle()):
            assert g.dtype == w.dtype and np.array_equal(g, w), kind
        np.testing.assert_array_equal(got.voxel_sizes, want.voxel_sizes)
        np.testing.assert_array_equal(got.origins, want.origins)
        for g, w in zip(got.grids, want.grids):
            for f in ("offset", "grid_size", "grid_index", "grid_count", "voxel_count", "leaf_voxel_count",
                      "active_tile_count", "value_count", "root_tile_count"):
                assert getattr(g, f) == getattr(w, f), (kind, f)
            np.testing.assert_array_equal(g.root_bbox, w.root_bbox)
        np.testing.assert_array_equal(got.ijk.jdata, want.ijk.jdata)

