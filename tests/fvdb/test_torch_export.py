"""luisaml.fvdb.torch_ops: the torch functions equal the numpy reference of fVDB's semantics, their
gradients are fVDB's (samplers <-> splats, transforms scale), and torch.onnx.export turns them into
fvdb.* nodes that luisaml compiles into one kernel with the surrounding network."""
import io

import numpy as np
import onnx
import pytest
import torch

import luisaml
from luisaml.fvdb import GridBatch, JaggedTensor
from luisaml.fvdb import interop
from luisaml.fvdb import torch_ops as F
from luisaml.opsets import fvdb as schema

from conftest import assert_floats_equal
from fvdb_reference import (
    lookup,
    points_in_grid,
    sample_bezier,
    sample_trilinear,
    splat_bezier,
    splat_trilinear,
    voxel_to_world,
    world_to_voxel,
)


@pytest.fixture(scope="module")
def scene():
    rng = np.random.default_rng(41)
    box = np.stack(np.meshgrid(*[np.arange(-6, 6)] * 3, indexing="ij"), -1).reshape(-1, 3)
    gb = GridBatch.from_ijk([box[rng.random(len(box)) < 0.75].astype(np.int32),
                             rng.integers(-15, 15, (500, 3)).astype(np.int32)],
                            voxel_sizes=[[0.2, 0.2, 0.2], [0.4, 0.3, 0.5]], origins=[[0.05, 0, -0.1], [1, 0, 0]])
    pts = JaggedTensor.from_list([rng.uniform(-1.4, 1.4, (300, 3)).astype(np.float32),
                                  (rng.uniform(-5, 5, (200, 3)) + [1, 0, 0]).astype(np.float32)])
    data = rng.uniform(-1, 1, (gb.total_voxels, 3)).astype(np.float32)
    return gb, pts, data


def test_torch_functions_equal_the_reference(scene):
    gb, pts, data = scene
    bundle, p = F.bundle_tensors(gb), F.jagged_tensors(pts)
    d = F.jagged_tensors(JaggedTensor.from_data_and_offsets(data, gb.batch_offsets))
    ijk = JaggedTensor.from_list([np.floor(x).astype(np.int32) for x in
                                  (world_to_voxel(gb, pts)[:300], world_to_voxel(gb, pts)[300:])])
    glob = lookup(gb, ijk.jdata, ijk.jidx.astype(np.int64))
    np.testing.assert_array_equal(F.ijk_to_index(bundle, F.jagged_tensors(ijk), cumulative=True).numpy(), glob)
    local = np.where(glob >= 0, glob - gb.batch_offsets[ijk.jidx], -1)
    np.testing.assert_array_equal(F.ijk_to_index(bundle, F.jagged_tensors(ijk)).numpy(), local)
    np.testing.assert_array_equal(F.coords_in_grid(bundle, F.jagged_tensors(ijk)).numpy(), glob >= 0)
    np.testing.assert_array_equal(F.points_in_grid(bundle, p).numpy(), points_in_grid(gb, pts))
    np.testing.assert_array_equal(F.world_to_voxel(bundle, p).numpy(), world_to_voxel(gb, pts))
    np.testing.assert_array_equal(F.voxel_to_world(bundle, p).numpy(), voxel_to_world(gb, pts))
    np.testing.assert_array_equal(F.sample_trilinear(bundle, p, d).numpy(), sample_trilinear(gb, pts, data))
    np.testing.assert_array_equal(F.sample_bezier(bundle, p, d).numpy(), sample_bezier(gb, pts, data))
    v = F.jagged_tensors(pts.jagged_like(data[: len(pts.jdata)]))
    np.testing.assert_allclose(F.splat_trilinear(bundle, p, v).numpy(), splat_trilinear(gb, pts, v[0].numpy()),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(F.splat_bezier(bundle, p, v).numpy(), splat_bezier(gb, pts, v[0].numpy()),
                               rtol=1e-5, atol=1e-5)


def test_gradients_are_fvdbs(scene):
    gb, pts, data = scene
    bundle, p = F.bundle_tensors(gb), F.jagged_tensors(pts)
    rng = np.random.default_rng(1)
    g_out = torch.from_numpy(rng.uniform(-1, 1, (len(pts.jdata), 3)).astype(np.float32))
    for sample, splat in ((F.sample_trilinear, splat_trilinear), (F.sample_bezier, splat_bezier)):
        d = torch.from_numpy(data).requires_grad_()
        (sample(bundle, p, (d,) + F.jagged_tensors(data)[1:]) * g_out).sum().backward()
        np.testing.assert_allclose(d.grad.numpy(), splat(gb, pts, g_out.numpy()), rtol=1e-5, atol=1e-5)
    for splat, sample in ((F.splat_trilinear, sample_trilinear), (F.splat_bezier, sample_bezier)):
        v = torch.from_numpy(data[: len(pts.jdata)].copy()).requires_grad_()
        g_grid = torch.from_numpy(data[::-1].copy())
        (splat(bundle, p, (v,) + p[1:]) * g_grid).sum().backward()
        np.testing.assert_allclose(v.grad.numpy(), sample(gb, pts, g_grid.numpy()), rtol=1e-5, atol=1e-6)
    x = p[0].clone().requires_grad_()
    F.world_to_voxel(bundle, (x,) + p[1:]).backward(torch.ones(len(x), 3))
    np.testing.assert_array_equal(x.grad.numpy(), (1 / gb.voxel_sizes).astype(np.float32)[pts.jidx])


class FieldNet(torch.nn.Module):
    """Features sampled from a sparse grid, then a small MLP: the bundle and features are forward() arguments."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, *args):
        bundle, pts, feats = args[:7], args[7:11], args[11:15]
        f = torch.cat([F.sample_trilinear(bundle, pts, feats), F.sample_bezier(bundle, pts, feats)], 1)
        return self.mlp(f), F.points_in_grid(bundle, pts)


def _export(model, args, names, dynamic):
    f = io.BytesIO()
    F.export_onnx(model, args, f, input_names=names, output_names=["sdf", "inside"], dynamic_axes=dynamic)
    return onnx.load_from_string(f.getvalue())


def test_export_gives_fvdb_nodes_that_luisaml_compiles(scene):
    gb, pts, data = scene
    bundle, p = F.bundle_tensors(gb), F.jagged_tensors(pts)
    d = F.jagged_tensors(JaggedTensor.from_data_and_offsets(data, gb.batch_offsets))
    names = list(schema.BUNDLE) + [f"points_{k}" for k in schema.JAGGED] + [f"data_{k}" for k in schema.JAGGED]
    dyn = {"points_jdata": {0: "N"}, "points_jidx": {0: "N"}, "sdf": {0: "N"}, "inside": {0: "N"}}
    model = FieldNet().eval()
    m = _export(model, bundle + p + d, names, dyn)
    onnx.checker.check_model(m)
    ops = [(n.domain, n.op_type) for n in m.graph.node]
    assert ("fvdb", "SampleTrilinear") in ops and ("fvdb", "SampleBezier") in ops and ("fvdb", "PointsInGrid") in ops
    assert [i.name for i in m.graph.input][:7] == list(schema.BUNDLE)  # the bundle is graph inputs
    net = luisaml.compile(m)
    assert net.batch_symbol == "N"
    feeds = dict(zip(names, [t.numpy() for t in bundle + p + d]))
    out = net.run(feeds)
    with torch.no_grad():
        sdf, inside = model(*(bundle + p + d))
    np.testing.assert_allclose(out["sdf"], sdf.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out["inside"], inside.numpy())


class ConstGridNet(torch.nn.Module):
    """The bundle and features as buffers/parameters: they export as initializers (a constant grid)."""

    def __init__(self, gb: GridBatch, data: np.ndarray):
        super().__init__()
        for name, t in zip(schema.BUNDLE, F.bundle_tensors(gb)):
            self.register_buffer(name, t)
        self.feats = torch.nn.Parameter(torch.from_numpy(data))
        self.offsets = torch.from_numpy(gb.batch_offsets)

    def forward(self, x, jidx):
        bundle = [getattr(self, n) for n in schema.BUNDLE]
        pts = (x, self.batch_offsets, jidx, torch.zeros((0, 1), dtype=torch.int32))
        feats = (self.feats, self.batch_offsets, torch.zeros(0, dtype=torch.int32), torch.zeros((0, 1), dtype=torch.int32))
        return torch.tanh(F.sample_trilinear(bundle, pts, feats)).sum(1, keepdim=True), F.world_to_voxel(bundle, pts)


def test_export_with_the_grid_as_initializers(scene):
    gb, pts, data = scene
    model = ConstGridNet(gb, data)
    x, jidx = torch.from_numpy(pts.jdata), torch.from_numpy(pts.jidx)
    f = io.BytesIO()
    F.export_onnx(model, (x, jidx), f, input_names=["x", "jidx"], output_names=["y", "v"],
                  dynamic_axes={"x": {0: "N"}, "jidx": {0: "N"}, "y": {0: "N"}, "v": {0: "N"}})
    m = onnx.load_from_string(f.getvalue())
    assert {"grid_blob", "feats"} <= {t.name for t in m.graph.initializer}
    net = luisaml.compile(m)
    assert net.plan.derived == []  # metadata computed at compile time
    out = net.run({"x": x.numpy(), "jidx": jidx.numpy()})
    with torch.no_grad():
        y, v = model(x, jidx)
    np.testing.assert_allclose(out["y"], y.numpy(), rtol=1e-5, atol=1e-6)
    assert_floats_equal(out["v"], v.numpy())


def test_bad_arguments_are_clear_errors(scene):
    gb, pts, data = scene
    bundle = F.bundle_tensors(gb)
    with pytest.raises(ValueError, match=r"a grid bundle has 7 tensors"):
        F.world_to_voxel(bundle[:6], F.jagged_tensors(pts))
    with pytest.raises(ValueError, match=r"voxel data must be float32 \[\d+, \.\.\.\]"):
        F.sample_trilinear(bundle, F.jagged_tensors(pts), F.jagged_tensors(data[:5]))
    bad = list(bundle)
    bad[5] = bad[5] + 1
    with pytest.raises(ValueError, match=r"batch_offsets are"):
        F.world_to_voxel(bad, F.jagged_tensors(pts))


class _FakeFvdbGrid:
    """Stands in for fvdb.GridBatch: fVDB's save_nanovdb writes the grids with mVoxelSize = h and the map's
    translation = origin, which is what luisaml's writer does too."""

    def __init__(self, gb: GridBatch):
        self.gb = gb

    def save_nanovdb(self, path):
        self.gb.save(path)


class _FakeFvdbJagged:
    def __init__(self, jt: JaggedTensor):
        self.jdata, self.joffsets = torch.from_numpy(jt.jdata), torch.from_numpy(jt.joffsets)
        self.jidx, self.jlidx = torch.from_numpy(jt.jidx), torch.from_numpy(jt.jlidx.reshape(-1))


def test_fvdb_objects_convert_to_bundles(scene):
    gb, pts, _ = scene
    got = interop.grid_batch_from_fvdb(_FakeFvdbGrid(gb))
    for a, b in zip(got.bundle(), gb.bundle()):
        np.testing.assert_array_equal(a, b)
    jt = interop.jagged_from_fvdb(_FakeFvdbJagged(pts))
    for a, b in zip(jt.bundle(), pts.bundle()):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    with pytest.raises(TypeError, match=r"expected an fvdb GridBatch or Grid"):
        interop.grid_batch_from_fvdb(object())


@pytest.mark.skipif(not interop.fvdb_available(), reason="the fvdb package is not installed (it needs a CUDA build)")
def test_real_fvdb_round_trip(scene):  # pragma: no cover - needs the real package (a CUDA build)
    gb, _, _ = scene
    back = interop.grid_batch_from_fvdb(interop.grid_batch_to_fvdb(gb))
    np.testing.assert_array_equal(back.ijk.jdata, gb.ijk.jdata)
    np.testing.assert_allclose(back.voxel_sizes, gb.voxel_sizes)
