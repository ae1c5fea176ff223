"""The topology nodes (CoarsenedGrid, RefinedGrid, DilatedGrid, PrunedGrid, ConvGrid, ConvTransposeGrid)
and the grid constructors (GridBatchFromIJK, GridBatchFromPoints, GridBatchFromNearestVoxelsToPoints)
against the numpy reference of fVDB's section-3 conventions (fvdb_reference: loops over voxel sets):
folded at compile time over constant inputs, the new bundle equals the builder's bundle of the
reference voxels byte for byte, its voxels those of the reference and of warp's own builder, and a
grid query compiled over it answers as the reference grid; over two grids in a batch with negative
coordinates, a single voxel and an empty grid. Over grids bound at run time a topology node runs on
the host when a run binds them (test_host_steps.py); GridBatchFromIJK / GridBatchFromPoints over
inputs of fixed size build on the device (test_grid_build_device.py)."""
import io

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import luisaml
from luisaml.errors import ModelError
from luisaml.fvdb import GridBatch, nanovdb_order
from luisaml.fvdb import torch_ops as F
from luisaml.fvdb.nanovdb_query import active_voxels
from luisaml.model import Node
from luisaml.operators.fvdb.topology import evaluate_grid_op
from luisaml.opsets import fvdb as schema

import fvdb_reference as R
from fvdb_reference import bundle_feeds, fvdb_model


def batches():
    rng = np.random.default_rng(31)
    two = GridBatch.from_ijk([rng.integers(-12, 9, (300, 3)).astype(np.int32),
                              np.concatenate([rng.integers(100, 104, (20, 3)), [[-4097, 5, 0]]]).astype(np.int32)],
                             voxel_sizes=[(0.1, 0.2, 0.3), (1.0, 1.0, 1.0)], origins=[(0.5, -1, 2), (0, 0, 0)])
    one = GridBatch.from_ijk([np.array([[-5, 7, -1000]], np.int32)], voxel_sizes=0.25, origins=(1, 2, 3))
    empty = GridBatch.from_ijk([np.zeros((0, 3), np.int32), np.array([[1, 2, 3]], np.int32)])
    return {"two": two, "one": one, "empty": empty}


BATCHES = batches()


def reference(op_type, gb: GridBatch, rng):
    """Return (attrs, extra inputs, voxel sets, voxel sizes, origins) of op_type on gb by the reference."""
    h, o = gb.voxel_sizes, gb.origins
    if op_type == "CoarsenedGrid":
        return {"coarsening_factor": [2, 3, 1]}, {}, *R.coarsened_grid(gb, (2, 3, 1))
    if op_type == "RefinedGrid":
        mask = rng.random(gb.total_voxels) < 0.6
        return {"subdiv_factor": [2, 2, 3]}, {"mask": mask}, *R.refined_grid(gb, (2, 2, 3), mask)
    if op_type == "DilatedGrid":
        return {"dilation": 2}, {}, R.dilated_grid(gb, 2), h, o
    if op_type == "PrunedGrid":
        mask = rng.random(gb.total_voxels) < 0.5
        sets = [{v for v, row in R._rows(gb, b).items() if mask[row]} for b in range(gb.grid_count)]
        return {}, {"mask": mask}, sets, h, o
    if op_type == "ConvGrid":
        return {"kernel_size": [3, 3, 3], "stride": [2, 2, 2]}, {}, R.conv_grid(gb, 3, 2), h * 2, o
    return {"kernel_size": [2, 2, 2], "stride": [2, 2, 2]}, {}, R.conv_grid(gb, 2, 2, transposed=True), h / 2, o


def expected_batch(sets, h, o) -> GridBatch:
    """The builder's batch of the reference voxel sets."""
    return GridBatch.from_ijk([np.array(sorted(s), np.int32).reshape(-1, 3) for s in sets], h, o)


def assert_same_bundle(got, want: GridBatch, sets):
    """Byte for byte the builder's bundle of the reference voxels, and voxel for voxel the sets."""
    got = [np.asarray(a) for a in got]
    for name, g, w in zip(schema.BUNDLE, got, want.bundle()):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=name)
    batch = GridBatch.from_buffer(got[0])
    for b, s in enumerate(sets):
        assert {tuple(int(u) for u in v) for v in batch.ijk.unbind()[b]} == s


TOPOLOGY = ["CoarsenedGrid", "RefinedGrid", "DilatedGrid", "PrunedGrid", "ConvGrid", "ConvTransposeGrid"]


def _compile_query(nodes, feeds, constants, query: np.ndarray, grids: int):
    """Compile nodes -> IJKToIndex over the bundle named new_*, return its indices of query (all in grid 0
    and then each grid: a JaggedTensor with one copy of the query per grid)."""
    outs = [f"new_{n}" for n in schema.BUNDLE]
    idx = helper.make_node("IJKToIndex", outs + [f"ijk_{p}" for p in schema.JAGGED], ["index"], name="idx",
                           domain=schema.DOMAIN, cumulative=1)
    q = {"ijk_jdata": np.tile(query, (grids, 1)), "ijk_joffsets": np.arange(grids + 1, dtype=np.int64) * len(query),
         "ijk_jidx": (np.repeat(np.arange(grids, dtype=np.int32), len(query)) if grids > 1 else np.zeros(0, np.int32)),
         "ijk_jlidx": np.zeros((0, 1), np.int32)}
    m = fvdb_model(nodes + [idx], {**feeds, **q}, constants=constants, outputs=["index"])
    net = luisaml.compile(m, batch_axis=None)
    assert [n.op_type for n, _ in net.plan.ops] == ["IJKToIndex"]  # the topology node folded
    return net.run(q)["index"]


def _query(sets) -> np.ndarray:
    """Every voxel of the sets and its 6 neighbours."""
    vox = np.array(sorted(set().union(*sets)) or [(0, 0, 0)], np.int64)
    steps = np.array([[0, 0, 0], [1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1]])
    return np.unique((vox[:, None] + steps).reshape(-1, 3), axis=0).astype(np.int32)


@pytest.mark.parametrize("which", ["two", "one", "empty"])
@pytest.mark.parametrize("op_type", TOPOLOGY)
def test_topology_folds_to_the_reference_grid(op_type, which):
    gb = BATCHES[which]
    rng = np.random.default_rng(10 * TOPOLOGY.index(op_type) + list(BATCHES).index(which))
    attrs, extra, sets, h, o = reference(op_type, gb, rng)
    want = expected_batch(sets, h, o)
    # the torch function runs the very evaluation the fold pass runs
    args = (F.bundle_tensors(gb),) + tuple(torch.from_numpy(v) for v in extra.values())
    fn = {"CoarsenedGrid": lambda b: F.coarsened_grid(b, (2, 3, 1)),
          "RefinedGrid": lambda b, m: F.refined_grid(b, (2, 2, 3), m),
          "DilatedGrid": lambda b: F.dilated_grid(b, 2), "PrunedGrid": F.pruned_grid,
          "ConvGrid": lambda b: F.conv_grid(b, 3, 2), "ConvTransposeGrid": lambda b: F.conv_transpose_grid(b, 2, 2)}
    assert_same_bundle(fn[op_type](*args), want, sets)
    # compiled: the node folds, and a query over the new grid answers as the reference grid does
    feeds = {**bundle_feeds(gb), **extra}
    node = helper.make_node(op_type, list(schema.BUNDLE) + list(extra), [f"new_{n}" for n in schema.BUNDLE],
                            name="topo", domain=schema.DOMAIN, **attrs)
    query = _query(sets)
    got = _compile_query([node], feeds, tuple(feeds), query, gb.grid_count).reshape(gb.grid_count, -1)
    for b, s in enumerate(sets):
        np.testing.assert_array_equal(got[b] >= 0, [tuple(v) in s for v in query.tolist()])
    np.testing.assert_array_equal(got.reshape(-1), want.ijk_to_index([query] * gb.grid_count, cumulative=True).jdata)


def _points(rng):
    return [rng.normal(0, 1.5, (200, 3)).astype(np.float32),
            np.concatenate([rng.uniform(-9, -7, (40, 3)), [[0.25, 0.5, -0.75]]]).astype(np.float32)]


@pytest.mark.parametrize("op_type", ["GridBatchFromIJK", "GridBatchFromPoints", "GridBatchFromNearestVoxelsToPoints"])
def test_constructors_fold_to_the_reference_grid(op_type):
    rng = np.random.default_rng(8)
    h, o = np.array([[0.1, 0.1, 0.2], [0.5, 0.5, 0.5]]), np.array([[0.0, 0.0, 0.0], [1.0, -2.0, 0.25]])
    if op_type == "GridBatchFromIJK":
        parts = [rng.integers(-20, 20, (300, 3)).astype(np.int32), np.array([[5, -5, 4096]] * 3, np.int32)]
        sets = [{tuple(int(u) for u in v) for v in p} for p in parts]
        fn = F.gridbatch_from_ijk
    else:
        parts = _points(rng)
        sets = [R.point_voxels(p, h[b], o[b], nearest=op_type != "GridBatchFromPoints") for b, p in enumerate(parts)]
        fn = F.gridbatch_from_points if op_type == "GridBatchFromPoints" else F.gridbatch_from_nearest_voxels_to_points
    want = expected_batch(sets, h, o)
    jagged = F.jagged_tensors([torch.from_numpy(p) for p in parts])
    assert_same_bundle(fn(jagged, torch.from_numpy(h), torch.from_numpy(o)), want, sets)
    names = [f"x_{p}" for p in schema.JAGGED]
    feeds = {**dict(zip(names, [t.numpy() for t in jagged])), "voxel_sizes": h, "origins": o}
    node = helper.make_node(op_type, names + ["voxel_sizes", "origins"], [f"new_{n}" for n in schema.BUNDLE],
                            name="build", domain=schema.DOMAIN)
    query = _query(sets)
    got = _compile_query([node], feeds, tuple(feeds), query, 2)
    np.testing.assert_array_equal(got, want.ijk_to_index([query] * 2, cumulative=True).jdata)


def test_constructors_default_transform_and_one_grid():
    """No voxel sizes or origins: 1 and 0 (fVDB's defaults); one tensor: an empty jidx."""
    pts = np.array([[0.4, 0.6, -0.5], [2.5, -2.5, 0.49]], np.float32)
    got = F.gridbatch_from_points(F.jagged_tensors(torch.from_numpy(pts)))
    sets = [R.point_voxels(pts, np.ones(3), np.zeros(3))]
    assert_same_bundle(got, expected_batch(sets, np.ones((1, 3)), np.zeros((1, 3))), sets)


def test_folded_grids_equal_warps_voxel_for_voxel(warp_ref):
    """warp's own builder, given the reference voxels, writes a grid with the same voxels in the same
    index order as the folded one."""
    gb = BATCHES["two"]
    for op_type in TOPOLOGY:
        attrs, extra, sets, h, o = reference(op_type, gb, np.random.default_rng(3))
        feeds = {**bundle_feeds(gb), **extra}
        node = Node("topo", op_type, schema.DOMAIN, list(feeds), [], attrs)
        got = GridBatch.from_buffer(evaluate_grid_op(node, list(feeds.values()))[0])
        for b, s in enumerate(sets):
            if not s:
                continue
            warp = warp_ref.volume_from_ijk(np.array(sorted(s), np.int32))
            warp_grid = GridBatch.from_buffer(warp_ref.volume_bytes(warp)).grids[0]
            np.testing.assert_array_equal(active_voxels(got.grids[b]), active_voxels(warp_grid), err_msg=op_type)
            np.testing.assert_array_equal(active_voxels(got.grids[b]), nanovdb_order(np.array(sorted(s))))


def test_a_mask_of_the_wrong_size_names_the_node():
    gb = BATCHES["one"]
    feeds = {**bundle_feeds(gb), "mask": np.ones(3, bool)}
    node = helper.make_node("PrunedGrid", list(schema.BUNDLE) + ["mask"], [f"new_{n}" for n in schema.BUNDLE],
                            name="prune", domain=schema.DOMAIN)
    with pytest.raises(luisaml.CompileError,
                       match=r"node 'prune' \(fvdb::PrunedGrid\): mask 'mask' must be bool \[1\]"):
        _compile_query([node], feeds, tuple(feeds), np.zeros((1, 3), np.int32), 1)


class _CoarsenAndPool(torch.nn.Module):
    def __init__(self, fine):
        super().__init__()
        self.fine = F.bundle_tensors(fine)

    def forward(self, x):
        coarse = F.coarsened_grid(self.fine, 2)
        return F.refine(coarse, self.fine, F.avg_pool(self.fine, coarse, x, 2), 2)


def test_exported_torch_module_folds_the_new_grid():
    gb = BATCHES["two"]
    model = _CoarsenAndPool(gb)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((gb.total_voxels, 3)).astype(np.float32))
    buf = io.BytesIO()
    F.export_onnx(model, (x,), buf, input_names=["x"], output_names=["y"])
    proto = onnx.load_from_string(buf.getvalue())
    assert "CoarsenedGrid" in {n.op_type for n in proto.graph.node}
    net = luisaml.compile(proto, batch_axis=None)
    assert [n.op_type for n, _ in net.plan.ops] == ["AvgPool", "Refine"]
    with torch.no_grad():
        np.testing.assert_allclose(net.run({"x": x.numpy()})["y"], model(x).numpy(), rtol=1e-5, atol=1e-6)


def test_distinct_voxels_equal_numpys_unique_rows():
    """The packed-key dedup the topology ops use returns np.unique(axis=0)'s rows in its order: over a
    span that packs, one that does not (an axis of 2^21 or more), int32's extremes and no rows."""
    from luisaml.fvdb.sparse_conv import distinct_voxels

    rng = np.random.default_rng(5)
    small = rng.integers(-40, 40, (5000, 3))
    wide = np.concatenate([small, [[2**21 + 5, 0, 0], [-(2**31), 2**31 - 1, 7]]])
    for ijk in (small, wide, np.array([[2**31 - 1, -(2**31), 0]] * 3), np.zeros((0, 3), np.int64)):
        got = distinct_voxels(ijk, "test")
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.unique(ijk.reshape(-1, 3), axis=0).astype(np.int32))
    with pytest.raises(ValueError, match="the test grid has voxels outside int32 coordinates"):
        distinct_voxels(np.array([[0, 0, 2**31]]), "test")


@pytest.mark.parametrize("K,S", [(2, 2), (1, 2), (1, 1), ((2, 1, 3), (2, 1, 3)), ((1, 2, 2), (3, 2, 4))])
def test_conv_grid_with_a_kernel_no_larger_than_its_stride_equals_the_reference(K, S):
    """conv_grid's one-candidate path (every axis K <= S) against the reference's loops over the relation."""
    from luisaml.fvdb.sparse_conv import conv_grid_ijk

    gb = BATCHES["two"]
    want = R.conv_grid(gb, K, S)
    for b, v in enumerate(gb.ijk.unbind()):
        assert {tuple(int(u) for u in row) for row in conv_grid_ijk(v, K, S)} == want[b]
