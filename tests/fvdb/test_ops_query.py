"""fvdb.IJKToIndex, CoordsInGrid, PointsInGrid, WorldToVoxel, VoxelToWorld against the numpy reference of
fVDB's semantics, on a two-grid batch (different voxel sizes and origins, voxels in several root
tiles), per point (batch mode) and as one instance."""
import numpy as np
import pytest

import luisaml
from luisaml.fvdb import GridBatch, JaggedTensor

from conftest import assert_floats_equal
from fvdb_reference import (
    bundle_feeds,
    fvdb_model,
    fvdb_node,
    lookup,
    points_in_grid,
    voxel_to_world,
    world_to_voxel,
)

BATCHED = ("ijk_jdata", "ijk_jidx", "points_jdata", "points_jidx")


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(7)
    vox0 = np.concatenate([rng.integers(-60, 60, (900, 3)), rng.integers(-9000, 9000, (60, 3)),
                           [[-4097, 0, 5], [4096, 4095, -1], [0, 0, 0], [7, 7, 7], [8, -8, 8]]]).astype(np.int32)
    vox1 = rng.integers(-20, 20, (400, 3)).astype(np.int32)
    gb = GridBatch.from_ijk([vox0, vox1], voxel_sizes=[[0.5, 0.25, 0.75], [0.1, 0.1, 0.1]],
                            origins=[[1.0, -2.0, 0.5], [-0.3, 0.2, 0.05]])
    probes0 = np.concatenate([vox0, vox0 + [1, 0, -1], rng.integers(-70, 70, (300, 3)),
                              [[2**31 - 1] * 3, [-(2**31)] * 3]]).astype(np.int32)
    probes1 = np.concatenate([vox1, rng.integers(-25, 25, (200, 3))]).astype(np.int32)
    ijk = JaggedTensor.from_list([probes0, probes1])
    # world points near voxel centres of each grid (jittered past the half-voxel boundaries) and at random
    pts = []
    for b, vox in enumerate((vox0, vox1)):
        centres = gb.voxel_to_world(vox[:400], b)
        jitter = rng.uniform(-0.8, 0.8, centres.shape) * gb.voxel_sizes[b]
        far = rng.uniform(-40, 40, (100, 3))
        pts.append(np.concatenate([centres + jitter, far]).astype(np.float32))
    points = JaggedTensor.from_list(pts)
    return gb, ijk, points


def _query_model(feeds, batched: bool, constants=()):
    nodes = [fvdb_node("IJKToIndex", "index"), fvdb_node("IJKToIndex", "cumulative", cumulative=1),
             fvdb_node("CoordsInGrid", "coords_in"), fvdb_node("PointsInGrid", "points_in"),
             fvdb_node("WorldToVoxel", "to_voxel"), fvdb_node("VoxelToWorld", "to_world")]
    # VoxelToWorld reads the (float) points as voxel coordinates, through its own input names
    nodes[-1].input[len(nodes[-1].input) - 4:] = ["points_jdata", "points_joffsets", "points_jidx", "points_jlidx"]
    return fvdb_model(nodes, feeds, batched=BATCHED if batched else (), constants=constants)


def _check(out, gb, ijk, points):
    b = ijk.jidx.astype(np.int64)
    glob = lookup(gb, ijk.jdata, b)
    local = np.where(glob >= 0, glob - gb.batch_offsets[b], -1)
    np.testing.assert_array_equal(out["index"], local)
    np.testing.assert_array_equal(out["cumulative"], glob)
    np.testing.assert_array_equal(out["coords_in"], glob >= 0)
    np.testing.assert_array_equal(out["points_in"], points_in_grid(gb, points))
    # the same float32 operations as fVDB's CPU path: equal to the last bit
    assert_floats_equal(out["to_voxel"], world_to_voxel(gb, points))
    assert_floats_equal(out["to_world"], voxel_to_world(gb, points))


def test_queries_per_point(batch):
    gb, ijk, points = batch
    # the same number of ijk and points, so both follow one batch axis
    n = min(len(ijk.jdata), len(points.jdata))
    ijk = JaggedTensor.from_data_and_offsets(ijk.jdata[:n], [0, np.searchsorted(ijk.jidx[:n], 1), n])
    points = JaggedTensor.from_data_and_offsets(points.jdata[:n], [0, np.searchsorted(points.jidx[:n], 1), n])
    feeds = bundle_feeds(gb, ijk=ijk, points=points)
    net = luisaml.compile(_query_model(feeds, batched=True))
    assert net.batch_symbol == "N"
    out = net.run(feeds)
    assert out["index"].dtype == np.int64 and out["coords_in"].dtype == np.bool_
    assert 500 < (out["index"] >= 0).sum() < n and 100 < out["points_in"].sum() < n  # hits and misses
    _check(out, gb, ijk, points)


def test_queries_as_one_instance_with_a_constant_grid(batch):
    gb, ijk, points = batch
    feeds = bundle_feeds(gb, ijk=ijk, points=points)
    bundle = ("grid_blob", "grid_byte_offsets", "voxel_sizes", "origins", "leaf_batch_indices", "batch_offsets",
              "list_indices")
    net = luisaml.compile(_query_model(feeds, batched=False, constants=bundle), batch_axis=None)
    assert net.plan.derived == [] and "grid_blob" in net.weight_layout  # grid and metadata in the weight blob
    out = net.run({k: v for k, v in feeds.items() if k not in bundle})
    _check(out, gb, ijk, points)


def test_int64_ijk_and_a_single_grid_without_jidx():
    rng = np.random.default_rng(3)
    vox = rng.integers(-30, 30, (300, 3)).astype(np.int32)
    gb = GridBatch.from_ijk(vox, 0.2, (0.1, 0.2, 0.3))
    probes = np.concatenate([vox, rng.integers(-35, 35, (200, 3))]).astype(np.int64)
    feeds = bundle_feeds(gb, ijk=probes)
    assert feeds["ijk_jidx"].shape == (0,)  # fVDB leaves jidx empty for one tensor
    net = luisaml.compile(fvdb_model([fvdb_node("IJKToIndex", "index")], feeds, batched=("ijk_jdata",)))
    want = lookup(gb, probes.astype(np.int32), np.zeros(len(probes), np.int64))
    np.testing.assert_array_equal(net.run(feeds)["index"], want)


def test_points_outside_every_grid_get_the_defaults(batch):
    gb, _, _ = batch
    pts = JaggedTensor.from_list([np.full((3, 3), 1e6, np.float32), np.full((2, 3), -1e6, np.float32)])
    feeds = bundle_feeds(gb, points=pts)
    feeds["points_jidx"] = np.array([0, 1, 5, -1, 1], np.int32)  # 5 and -1 name no grid
    net = luisaml.compile(fvdb_model([fvdb_node("PointsInGrid", "inside"), fvdb_node("WorldToVoxel", "x")],
                                     feeds, batched=("points_jdata", "points_jidx")))
    out = net.run(feeds)
    np.testing.assert_array_equal(out["inside"], False)
    np.testing.assert_array_equal(out["x"][[2, 3]], 0.0)


def test_bad_signatures_name_the_node(batch):
    gb, ijk, _ = batch
    feeds = bundle_feeds(gb, ijk=ijk)
    feeds["ijk_jdata"] = ijk.jdata.astype(np.float32)
    with pytest.raises(luisaml.CompileError, match=r"'bad'.*ijk_jdata 'ijk_jdata' has type float, expected INT32"):
        luisaml.compile(fvdb_model([fvdb_node("IJKToIndex", "bad")], feeds), batch_axis=None)
    feeds = bundle_feeds(gb, ijk=ijk)
    feeds["ijk_joffsets"] = np.array([0, len(ijk.jdata)], np.int64)
    with pytest.raises(luisaml.CompileError, match=r"ijk_joffsets .*has shape \[2\], expected \[3\]"):
        luisaml.compile(fvdb_model([fvdb_node("CoordsInGrid", "bad")], feeds), batch_axis=None)
