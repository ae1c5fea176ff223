"""GridBatchFromIJK, GridBatchFromPoints and GridBatchFromNearestVoxelsToPoints built on the device
(operators/fvdb/topology.py DeviceGridBuild, shaders/grid_build.py) over ijk and points bound at run
time, against the host builder (GridBatch.from_ijk / from_points, topology.from_nearest_voxels: what
folding at compile time gives): the seven bundle arrays equal, the blob byte for byte, over several
sizes, two grids and an empty one in a batch, no voxels at all, a single voxel, duplicates, negative
coordinates, the int32 extremes and voxels spread over many root tiles, transforms bound at run time;
one compiled network runs on several point sets, and its bundle feeds a second network; what the
device flags is a RunError naming the node. On CUDA (LUISAML_BACKEND=cuda) the same tests run there:
every array here is integer or bytes except the voxel sizes and origins, which are their float32
values on either backend.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import luisaml
from luisaml.errors import RunError
from luisaml.fvdb import GridBatch
from luisaml.fvdb import topology as T
from luisaml.fvdb.nanovdb_query import active_voxels
from luisaml.opsets import fvdb as schema

from fvdb_reference import fvdb_model

OUTS = [f"new_{n}" for n in schema.BUNDLE]


def model(op_type: str, jdata: np.ndarray, offsets, voxel_sizes=None, origins=None):
    """Return (model, feeds): jdata and joffsets graph inputs, jidx / jlidx empty constants (the device
    path reads the grids off joffsets, as the host's JaggedTensor does), voxel sizes / origins constants."""
    feeds = {"jdata": jdata, "joffsets": np.asarray(offsets, np.int64), "jidx": np.zeros(0, np.int32),
             "jlidx": np.zeros((0, 1), np.int32)}
    names, constants = ["jdata", "joffsets", "jidx", "jlidx"], ["jidx", "jlidx"]
    if voxel_sizes is not None:
        feeds.update(voxel_sizes=np.asarray(voxel_sizes, np.float64), origins=np.asarray(origins, np.float64))
        names += ["voxel_sizes", "origins"]
        constants += ["voxel_sizes", "origins"]
    node = helper.make_node(op_type, names, OUTS, name="build", domain=schema.DOMAIN)
    half = jdata.dtype == np.float16
    m = fvdb_model([node], {**feeds, "jdata": jdata.astype(np.float32) if half else jdata}, constants=constants)
    if half:  # (fvdb_model types float32 and float64 inputs)
        next(i for i in m.graph.input if i.name == "jdata").type.tensor_type.elem_type = TensorProto.FLOAT16
    return m, {"jdata": jdata, "joffsets": feeds["joffsets"]}


def host_bundle(op_type: str, jdata: np.ndarray, offsets, voxel_sizes=1.0, origins=0.0):
    """The host builder's bundle of the same grids."""
    parts = np.split(jdata, np.asarray(offsets)[1:-1])
    if op_type == "GridBatchFromNearestVoxelsToPoints":
        h = T.per_grid(voxel_sizes, len(parts), "voxel_sizes", True)
        o = T.per_grid(origins, len(parts), "origins", False)
        return T.to_batch(T.from_nearest_voxels(parts, h, o), h, o).bundle()
    build = GridBatch.from_ijk if op_type == "GridBatchFromIJK" else GridBatch.from_points
    return build(parts, voxel_sizes, origins).bundle()


def assert_same_bundle(got: dict, want, float32_exact: bool = True) -> None:
    for k, name in enumerate(schema.BUNDLE):
        g, w = got[OUTS[k]], want[k]
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, g.dtype, w.shape, w.dtype)
        if name in ("voxel_sizes", "origins") and not float32_exact:
            # float64 lives in 32 bits inside kernels: the constants' float32 values (the blob's
            # map holds the exact doubles)
            np.testing.assert_array_equal(g, w.astype(np.float32).astype(np.float64), err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


def run_both(op_type, jdata, offsets, voxel_sizes=None, origins=None, float32_exact=True):
    m, feeds = model(op_type, jdata, offsets, voxel_sizes, origins)
    net = luisaml.compile(m, batch_axis=None)
    assert [n.op_type for n, _ in net.plan.ops] == [op_type]  # built on the device, not folded
    got = net.run(feeds)
    want = host_bundle(op_type, jdata, offsets, 1.0 if voxel_sizes is None else voxel_sizes,
                       0.0 if origins is None else origins)
    assert_same_bundle(got, want, float32_exact)
    return net, got


def test_ijk_two_grids_negative_and_duplicates_equal_the_host_bundle():
    rng = np.random.default_rng(1)
    a = rng.integers(-40, 30, (700, 3))
    b = np.concatenate([rng.integers(-3, 3, (60, 3)), [[-4097, 5, 0], [4096, -1, 8191]] * 3])
    ijk = np.concatenate([a, a[:100], b]).astype(np.int32)  # duplicates inside a grid
    run_both("GridBatchFromIJK", ijk, [0, 800, len(ijk)])


def test_ijk_int64_one_voxel_an_empty_grid_and_many_root_tiles():
    rng = np.random.default_rng(2)
    wide = rng.integers(-1_000_000, 1_000_000, (60, 3))  # a root tile each, all three levels sparse
    extremes = [[2**31 - 1, -(2**31), 0], [0, 0, 2**31 - 1], [-(2**31)] * 3]  # (int64 in, int32 inside)
    ijk = np.concatenate([[[-7, 3, -1_000]], wide, extremes]).astype(np.int64)
    run_both("GridBatchFromIJK", ijk, [0, 1, 1, len(ijk) - 1, len(ijk)])


def test_points_with_per_grid_transforms_equal_the_host_bundle():
    rng = np.random.default_rng(3)
    pts = np.concatenate([rng.normal(0, 3, (900, 3)), rng.uniform(-50, 50, (300, 3))]).astype(np.float32)
    # half-way points, where float32 x + 0.5 would round up but fVDB's double round does not
    pts[:4] = [[0.49999997, -0.5, 2.5], [-2.5, 0.5, -0.49999997], [1.5, -1.5, 7.5], [0, 0, 0]]
    h = np.array([[0.5, 0.25, 1.0], [2.0, 2.0, 0.125]])  # float32-exact: the outputs equal the host's
    o = np.array([[0.0, -1.5, 3.25], [100.0, 0.5, -8.0]])
    run_both("GridBatchFromPoints", pts, [0, 900, 1200], h, o)


def test_nearest_voxels_to_points_equal_the_host_bundle():
    rng = np.random.default_rng(8)
    pts = np.concatenate([rng.normal(0, 4, (300, 3)), rng.uniform(-600, 600, (40, 3)),
                          [[-0.0, 7.0, -8.0], [2.999, -3.001, 0.5]]]).astype(np.float32)
    run_both("GridBatchFromNearestVoxelsToPoints", pts, [0, 100, 100, len(pts)], [[0.5, 0.5, 0.5], [1.0, 2.0, 4.0],
             [0.25, 0.25, 1.0]], [[0.0, 0.0, 0.0], [-1.0, 3.5, 0.25], [8.0, -8.0, 0.0]])


def test_points_with_inexact_voxel_sizes_keep_the_exact_doubles_in_the_blob():
    pts = np.random.default_rng(4).uniform(-1, 1, (500, 3)).astype(np.float32)
    run_both("GridBatchFromPoints", pts, [0, 500], [0.1, 0.07, 0.3], [0.01, -0.2, 0.0], float32_exact=False)


def test_float16_points_and_default_transform():
    pts = np.random.default_rng(5).uniform(-20, 20, (256, 3)).astype(np.float16)
    run_both("GridBatchFromPoints", pts, [0, 256])


def test_one_network_runs_on_two_point_sets():
    rng = np.random.default_rng(6)
    first = rng.uniform(-10, 10, (600, 3)).astype(np.float32)
    second = np.repeat(rng.uniform(-200, 200, (150, 3)), 4, axis=0).astype(np.float32)  # another size, duplicates
    m, feeds = model("GridBatchFromPoints", first, [0, 200, 600], 0.5, [1.0, 2.0, 3.0])
    net = luisaml.compile(m, batch_axis=None)
    for pts, offsets in ((first, [0, 200, 600]), (second, [0, 600, 600]), (first, [0, 0, 600])):
        got = net.run({"jdata": pts, "joffsets": np.asarray(offsets, np.int64)})
        assert_same_bundle(got, host_bundle("GridBatchFromPoints", pts, offsets, 0.5, [1.0, 2.0, 3.0]))
        gb = GridBatch.from_buffer(got["new_grid_blob"])  # a valid batch the host reads back
        assert [g.voxel_count for g in gb.grids] == list(np.diff(got["new_batch_offsets"]))


def test_single_voxel_and_a_batch_of_empty_grids():
    run_both("GridBatchFromIJK", np.array([[5, -6, 7]], np.int32), [0, 1])
    net, got = run_both("GridBatchFromIJK", np.array([[1, 2, 3]], np.int32), [0, 0, 1, 1])
    assert len(got["new_leaf_batch_indices"]) == 1


def test_voxel_order_is_nanovdb_order():
    ijk = np.random.default_rng(7).integers(-300, 300, (1000, 3)).astype(np.int32)
    _, got = run_both("GridBatchFromIJK", ijk, [0, 1000])
    from luisaml.fvdb import nanovdb_order

    np.testing.assert_array_equal(active_voxels(GridBatch.from_buffer(got["new_grid_blob"]).grids[0]),
                                  nanovdb_order(ijk))


def test_what_the_device_flags_is_a_run_error_naming_the_node():
    pts = np.zeros((4, 3), np.float32)
    m, feeds = model("GridBatchFromPoints", pts, [0, 4])
    net = luisaml.compile(m, batch_axis=None)
    with pytest.raises(RunError, match=r"node 'build' \(fvdb::GridBatchFromPoints\): joffsets must rise from 0 to 4"):
        net.run({"jdata": pts, "joffsets": np.array([0, 3], np.int64)})
    bad = pts.copy()
    bad[2, 1] = np.nan
    with pytest.raises(RunError, match="not finite or do not fit int32"):
        net.run({"jdata": bad, "joffsets": np.array([0, 4], np.int64)})
    bad[2, 1] = 3e9
    with pytest.raises(RunError, match="not finite or do not fit int32"):
        net.run({"jdata": bad, "joffsets": np.array([0, 4], np.int64)})
    got = net.run({"jdata": pts, "joffsets": np.array([0, 4], np.int64)})  # and it still runs after
    assert_same_bundle(got, host_bundle("GridBatchFromPoints", pts, [0, 4]))


def test_float64_points_are_built_on_the_host_only():
    pts = np.zeros((4, 3), np.float64)
    m, _ = model("GridBatchFromPoints", pts, [0, 4])
    with pytest.raises(luisaml.CompileError, match=r"node 'build' \(fvdb::GridBatchFromPoints\): points_jdata "
                                                   r"'jdata' is float64"):
        luisaml.compile(m, batch_axis=None)


def test_voxel_sizes_and_origins_bound_at_run_time():
    """The transforms may be graph inputs too: the headers get their exact doubles (they travel as
    float64 bits through the summary the host reads back), the kernels their float32 values."""
    pts = np.random.default_rng(10).uniform(-3, 3, (400, 3)).astype(np.float32)
    feeds = {"jdata": pts, "joffsets": np.array([0, 150, 400], np.int64), "jidx": np.zeros(0, np.int32),
             "jlidx": np.zeros((0, 1), np.int32), "voxel_sizes": np.full((2, 3), 0.5), "origins": np.zeros((2, 3))}
    node = helper.make_node("GridBatchFromPoints", list(feeds), OUTS, name="build", domain=schema.DOMAIN)
    net = luisaml.compile(fvdb_model([node], feeds, constants=["jidx", "jlidx"]), batch_axis=None)
    run = {k: feeds[k] for k in ("jdata", "joffsets", "voxel_sizes", "origins")}
    for h, o in (([[0.5, 0.5, 0.5], [0.25, 1.0, 2.0]], [[0.0, 0.0, 0.0], [1.5, -2.0, 0.125]]),
                 ([[0.1, 0.2, 0.3], [0.07, 0.07, 0.07]], [[0.01, 0.0, -0.3], [0.0, 0.0, 0.0]])):
        got = net.run({**run, "voxel_sizes": np.array(h), "origins": np.array(o)})
        want = host_bundle("GridBatchFromPoints", pts, [0, 150, 400], h, o)
        assert_same_bundle(got, want, float32_exact=False)
        assert GridBatch.from_buffer(got["new_grid_blob"]).voxel_sizes.tolist() == h  # the exact doubles
    with pytest.raises(luisaml.errors.InputError, match="voxel size must be positive"):
        net.run({**run, "voxel_sizes": np.full((2, 3), -1.0)})


def test_no_voxels_at_all_gives_empty_grids():
    run_both("GridBatchFromIJK", np.zeros((0, 3), np.int32), [0, 0, 0])


def test_the_built_bundle_feeds_another_compiled_network():
    """A pipeline: one network builds a grid from points, a second (compiled once for grids of any size,
    test_grids_bound_at_run_time.py) queries it; its answers equal those over the host-built grid and
    the reference's, for two point sets."""
    from fvdb_reference import bundle_feeds, fvdb_node, points_in_grid
    from luisaml.fvdb import JaggedTensor

    rng = np.random.default_rng(9)
    h, o = [[0.25, 0.25, 0.25]], [[0.5, -1.0, 0.0]]
    first = rng.normal(0, 2, (800, 3)).astype(np.float32)
    build, feeds = model("GridBatchFromPoints", first, [0, 800], h, o)
    builder = luisaml.compile(build, batch_axis=None)
    gb0 = GridBatch.from_points([first], h, o)
    query = rng.normal(0, 2, (300, 3)).astype(np.float32)
    m = fvdb_model([fvdb_node("PointsInGrid", "inside")], bundle_feeds(gb0, points=query), batched=("points_jdata",))
    for vi in m.graph.input:  # the grid's sizes are bound at run time
        if vi.name in ("grid_blob", "leaf_batch_indices", "list_indices"):
            vi.type.tensor_type.shape.dim[0].Clear()
            vi.type.tensor_type.shape.dim[0].dim_param = f"rows_{vi.name}"
    reader = luisaml.compile(m)
    for pts in (first, rng.uniform(-3, 3, (800, 3)).astype(np.float32)):
        built = builder.run({"jdata": pts, "joffsets": np.array([0, 800], np.int64)})
        gb = GridBatch.from_points([pts], h, o)
        qfeeds = {k: v for k, v in bundle_feeds(gb, points=query).items() if k.startswith("points_")}
        got = reader.run({**qfeeds, **{n: built[f"new_{n}"] for n in schema.BUNDLE}})["inside"]
        want = reader.run(bundle_feeds(gb, points=query))["inside"]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, points_in_grid(gb, JaggedTensor.from_list([query])))
        assert got.any() and not got.all()
