"""fvdb.SampleTrilinear and SampleBezier against the numpy reference of fVDB's semantics: corner
order, inactive corners weighing 0 with no renormalisation, Bezier weights that sum to 8; per point
and as one instance, with voxel data as an input or a constant, and composed with an MLP."""
import numpy as np
import pytest
from onnx import helper

import luisaml
from luisaml.fvdb import GridBatch, JaggedTensor

from fvdb_reference import bezier, bundle_feeds, fvdb_model, fvdb_node, sample_bezier, sample_trilinear
from conftest import assert_floats_equal

BATCHED = ("points_jdata", "points_jidx")


@pytest.fixture(scope="module")
def scene():
    rng = np.random.default_rng(11)
    # a dense-ish blob (most corners active) with holes, plus a sparse grid (many inactive corners)
    dense = np.stack(np.meshgrid(*[np.arange(-6, 6)] * 3, indexing="ij"), -1).reshape(-1, 3)
    dense = dense[rng.random(len(dense)) < 0.8]
    sparse = rng.integers(-15, 15, (500, 3))
    gb = GridBatch.from_ijk([dense.astype(np.int32), sparse.astype(np.int32)],
                            voxel_sizes=[[0.25, 0.25, 0.25], [0.5, 0.3, 0.2]], origins=[[0.1, -0.2, 0.3], [0, 0, 0]])
    pts = [rng.uniform(-1.8, 1.8, (700, 3)), rng.uniform(-4.5, 4.5, (500, 3))]
    points = JaggedTensor.from_list([p.astype(np.float32) for p in pts])
    data = rng.uniform(-1, 1, (gb.total_voxels, 4)).astype(np.float32)
    return gb, points, data


def _sample_nodes():
    return [fvdb_node("SampleTrilinear", "tri"), fvdb_node("SampleBezier", "bez")]


def _check(out, gb, points, data):
    tri, bez = sample_trilinear(gb, points, data), sample_bezier(gb, points, data)
    inside = tri.any(1).mean()
    assert 0.3 < inside < 0.95  # points inside and outside the grids
    # the same float32 operations in the same order as fVDB's CPU path: equal to the last bit
    assert_floats_equal(out["tri"], tri)
    assert_floats_equal(out["bez"], bez)


def test_samplers_per_point(scene):
    gb, points, data = scene
    feeds = bundle_feeds(gb, points=points, data=JaggedTensor.from_data_and_offsets(data, gb.batch_offsets))
    net = luisaml.compile(fvdb_model(_sample_nodes(), feeds, batched=BATCHED))
    assert net.batch_symbol == "N"
    _check(net.run(feeds), gb, points, data)


def test_samplers_as_one_instance_with_constant_data(scene):
    gb, points, data = scene
    pts = JaggedTensor.from_list([points.unbind()[0][:60], points.unbind()[1][:40]])
    feeds = bundle_feeds(gb, points=pts, data=JaggedTensor.from_data_and_offsets(data, gb.batch_offsets))
    net = luisaml.compile(fvdb_model(_sample_nodes(), feeds, constants=("data_jdata",)), batch_axis=None)
    assert "data_jdata" in net.weight_layout
    _check(net.run({k: v for k, v in feeds.items() if k != "data_jdata"}), gb, pts, data)


def test_weights_match_fvdb_conventions(scene):
    """Inside a dense box: trilinear weights sum to 1 and fVDB's Bezier weights to 8; both reproduce
    linear data (data = ijk gives back the voxel-space point, times 8 for Bezier)."""
    gb = GridBatch.from_dense(1, (12, 12, 12), (-6, -6, -6), voxel_sizes=0.5, origins=(0.25, 0, -0.25))
    rng = np.random.default_rng(5)
    pts = rng.uniform(-1.5, 1.5, (200, 3)).astype(np.float32)
    ones = np.ones((gb.total_voxels, 1), np.float32)
    ijk = gb.ijk.jdata.astype(np.float32)
    feeds = bundle_feeds(gb, points=pts, data=np.concatenate([ones, ijk], 1))
    out = luisaml.compile(fvdb_model(_sample_nodes(), feeds, batched=("points_jdata",))).run(feeds)
    np.testing.assert_allclose(out["tri"][:, 0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(out["bez"][:, 0], 8.0, rtol=1e-6)
    x = (pts - np.float32([0.25, 0, -0.25])) / np.float32(0.5)
    np.testing.assert_allclose(out["tri"][:, 1:], x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["bez"][:, 1:], 8 * x, rtol=1e-5, atol=1e-4)  # quadratic B-splines reproduce x
    t = np.linspace(-0.5, 0.49, 67, dtype=np.float32)  # the reference kernel too: 3 taps sum to 2 per axis
    np.testing.assert_allclose(bezier(t - 1) + bezier(t) + bezier(t + 1), 2.0, rtol=1e-6)


def test_sampling_feeds_an_mlp_in_one_kernel(scene):
    """features = SampleTrilinear(points); y = relu(features @ W1 + b1) @ W2: one kernel per point."""
    gb, points, data = scene
    rng = np.random.default_rng(2)
    w1, b1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (8,), (8, 1)))
    feeds = bundle_feeds(gb, points=points, data=JaggedTensor.from_data_and_offsets(data, gb.batch_offsets))
    nodes = [fvdb_node("SampleTrilinear", "f"), helper.make_node("MatMul", ["f", "w1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h1"]), helper.make_node("Relu", ["h1"], ["h"]),
             helper.make_node("MatMul", ["h", "w2"], ["y"])]
    consts = {"w1": w1, "b1": b1, "w2": w2}
    m = fvdb_model(nodes, {**feeds, **consts}, batched=BATCHED, constants=tuple(consts), outputs=["y"])
    net = luisaml.compile(m)
    f = sample_trilinear(gb, points, data)
    want = np.maximum(f @ w1 + b1, 0) @ w2
    np.testing.assert_allclose(net.run(feeds)["y"], want, rtol=1e-4, atol=1e-5)
    # the grid is read in the kernel; the network is one launch: forward, plus the stages (one
    # kernel on the CPU backend, a kernel per stage on CUDA)
    assert "nvdb_value" in net.source
    assert net.source.count("@luisa.func") == 1 + len(net.plan.kernels)


def test_voxel_data_rows_must_match_the_grid(scene):
    gb, points, data = scene
    extra = np.concatenate([data, data[:1]])  # one row too many
    feeds = bundle_feeds(gb, points=points, data=JaggedTensor.from_data_and_offsets(extra, [0, 10, len(extra)]))
    model = fvdb_model([fvdb_node("SampleTrilinear", "tri")], feeds, batched=BATCHED)
    net = luisaml.compile(model)  # the grid is bound at run time: checked when it is
    want = rf"the grids have {gb.total_voxels} active voxels in all, but the voxel data has {len(extra)} rows"
    with pytest.raises(ValueError, match=want):
        net.run(feeds)
    bundle = [n for n in feeds if not n.startswith(("points", "data"))]
    with pytest.raises(luisaml.CompileError, match=rf"node 'tri' \(fvdb::SampleTrilinear\): {want}"):
        luisaml.compile(fvdb_model([fvdb_node("SampleTrilinear", "tri")], feeds, batched=BATCHED, constants=bundle))
