"""fvdb.SplatTrilinear and SplatBezier against the numpy reference of fVDB's semantics, per point (every
sample adds into the shared [V, C] output with atomics) and as one instance; and the adjoint identity
<splat(v), d> = <v, sample(d)> that makes them fVDB's sampler gradients."""
import numpy as np
import pytest

import luisaml
from luisaml.fvdb import GridBatch, JaggedTensor

from fvdb_reference import bundle_feeds, fvdb_model, fvdb_node, sample_bezier, sample_trilinear, splat_bezier, \
    splat_trilinear

BATCHED = ("points_jdata", "points_jidx", "values_jdata", "values_jidx")


@pytest.fixture(scope="module")
def scene():
    rng = np.random.default_rng(13)
    box = np.stack(np.meshgrid(*[np.arange(-5, 5)] * 3, indexing="ij"), -1).reshape(-1, 3)
    g0 = box[rng.random(len(box)) < 0.7].astype(np.int32)
    g1 = rng.integers(-12, 12, (600, 3)).astype(np.int32)
    gb = GridBatch.from_ijk([g0, g1], voxel_sizes=[[0.2, 0.2, 0.2], [0.5, 0.4, 0.3]], origins=[[0, 0.1, 0], [1, 1, 1]])
    pts = JaggedTensor.from_list([rng.uniform(-1.2, 1.2, (800, 3)).astype(np.float32),
                                  (rng.uniform(-6, 6, (600, 3)) + 1).astype(np.float32)])
    values = pts.jagged_like(rng.uniform(-1, 1, (len(pts.jdata), 3)).astype(np.float32))
    return gb, pts, values


def _nodes(gb):
    return [fvdb_node("SplatTrilinear", "tri", total_voxels=gb.total_voxels),
            fvdb_node("SplatBezier", "bez", total_voxels=gb.total_voxels)]


def _check(out, gb, pts, values):
    tri, bez = splat_trilinear(gb, pts, values.jdata), splat_bezier(gb, pts, values.jdata)
    assert out["tri"].shape == (gb.total_voxels, 3) and np.count_nonzero(tri.any(1)) > 50
    # atomics add in any order: float32 sums agree to rounding
    np.testing.assert_allclose(out["tri"], tri, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["bez"], bez, rtol=1e-5, atol=1e-4)


def test_splats_per_point_with_atomics(scene):
    gb, pts, values = scene
    feeds = bundle_feeds(gb, points=pts, values=values)
    # no output has the batch dimension, so "auto" would not find it: ask for batch axis 0
    net = luisaml.compile(fvdb_model(_nodes(gb), feeds, batched=BATCHED), batch_axis=0)
    assert net.batch_symbol == "N" and all(s.accumulated for s in net.outputs)
    assert "atomic_fetch_add" in net.source
    for _ in range(2):  # the outputs start from zero on every run
        _check(net.run(feeds), gb, pts, values)


def test_splats_as_one_instance(scene):
    gb, pts, values = scene
    small = JaggedTensor.from_list([p[:50] for p in pts.unbind()])
    vals = small.jagged_like(np.concatenate([v[:50] for v in values.unbind()]))
    feeds = bundle_feeds(gb, points=small, values=vals)
    net = luisaml.compile(fvdb_model(_nodes(gb), feeds), batch_axis=None)
    assert "atomic_fetch_add" not in net.source
    _check(net.run(feeds), gb, small, vals)


def test_splat_is_the_adjoint_of_sample(scene):
    gb, pts, values = scene
    rng = np.random.default_rng(4)
    d = rng.uniform(-1, 1, (gb.total_voxels, 3)).astype(np.float32)
    feeds = bundle_feeds(gb, points=pts, values=values)
    out = luisaml.compile(fvdb_model(_nodes(gb), feeds, batched=BATCHED), batch_axis=0).run(feeds)
    for splat, sample in (("tri", sample_trilinear), ("bez", sample_bezier)):
        lhs = np.vdot(out[splat].astype(np.float64), d)
        rhs = np.vdot(values.jdata.astype(np.float64), sample(gb, pts, d))
        assert abs(lhs - rhs) <= 1e-4 * max(1.0, abs(rhs)), (splat, lhs, rhs)


def test_total_voxels_comes_from_a_constant_batch_offsets_or_the_attribute(scene):
    gb, pts, values = scene
    feeds = bundle_feeds(gb, points=pts, values=values)
    m = fvdb_model([fvdb_node("SplatTrilinear", "tri")], feeds, batched=BATCHED, constants=("batch_offsets",))
    net = luisaml.compile(m, batch_axis=0)
    assert net.outputs[0].kernel_shape == (gb.total_voxels, 3)
    m = fvdb_model([fvdb_node("SplatTrilinear", "tri", total_voxels=5)], feeds, batched=BATCHED)
    with pytest.raises(ValueError, match=r"the grids have \d+ active voxels in all, but the voxel data has 5 rows"):
        luisaml.compile(m, batch_axis=0).run(feeds)
