"""One compiled network, any grid: a model whose grid bundle and voxel data have dynamic sizes (the byte
blob, the leaf and list indices, the voxel data's rows) compiles once, and runs on grids of different
sizes bound at run time, against the numpy reference of fVDB's semantics; what cannot be served by one
network (an output sized by the grid) is a compile error naming the tensor."""
import numpy as np
import onnx
import pytest
from onnx import helper

import luisaml
from luisaml.errors import LuisamlError
from luisaml.fvdb import GridBatch, JaggedTensor
from luisaml.opsets import fvdb as schema

from conftest import assert_floats_equal
from fvdb_reference import bundle_feeds, fvdb_model, fvdb_node, points_in_grid, sample_trilinear

# the inputs whose first dimension an exporter leaves dynamic when the grid changes between calls
DYNAMIC = ("grid_blob", "leaf_batch_indices", "list_indices", "data_jdata")


def _grid(seed: int, n: int, radius: float) -> GridBatch:
    rng = np.random.default_rng(seed)
    p = rng.normal(size=(n, 3))
    ijk = np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * radius).astype(np.int32)
    return GridBatch.from_ijk([ijk], voxel_sizes=[[0.1, 0.1, 0.1]], origins=[[0.05, -0.02, 0.0]])


def _points(gb: GridBatch, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vox = gb.ijk.jdata
    near = vox[rng.integers(0, len(vox), n)] + rng.uniform(-0.7, 0.7, (n, 3))
    return (near * gb.voxel_sizes[0] + gb.origins[0]).astype(np.float32)


def _dynamic(model: onnx.ModelProto, names, symbol: str | None = None) -> onnx.ModelProto:
    """Make the first dimension of the named inputs dynamic (a symbol, or unnamed)."""
    for vi in model.graph.input:
        if vi.name in names:
            d = vi.type.tensor_type.shape.dim[0]
            d.Clear()
            if symbol:
                d.dim_param = f"{symbol}_{vi.name}"
    return model


def _model(gb: GridBatch, channels: int, unnamed: bool = False) -> onnx.ModelProto:
    x = _points(gb, 10, 0)
    data = np.zeros((gb.total_voxels, channels), np.float32)
    feeds = bundle_feeds(gb, points=x, data=data)
    nodes = [fvdb_node("SampleTrilinear", "features"), fvdb_node("PointsInGrid", "inside")]
    m = fvdb_model(nodes, feeds, batched=("points_jdata",))
    return _dynamic(m, DYNAMIC, None if unnamed else "rows")


@pytest.mark.parametrize("unnamed", [False, True])
def test_one_network_samples_grids_of_different_sizes(unnamed):
    first = _grid(1, 400, 6.0)
    net = luisaml.compile(_model(first, channels=5, unnamed=unnamed))
    specs = {s.name: s for s in net.plan.inputs}
    assert all(specs[n].rows is not None for n in DYNAMIC)
    for gb, seed in ((first, 1), (_grid(2, 3000, 15.0), 2), (_grid(3, 40, 2.0), 3), (first, 4)):
        rng = np.random.default_rng(seed)
        data = rng.standard_normal((gb.total_voxels, 5)).astype(np.float32)
        x = _points(gb, 257, seed)
        out = net.run(bundle_feeds(gb, points=x, data=data))
        pts = JaggedTensor.from_list([x])
        np.testing.assert_allclose(out["features"], sample_trilinear(gb, pts, data), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out["inside"], points_in_grid(gb, pts))
        assert out["inside"].any() and not out["inside"].all()


def test_voxel_data_that_does_not_match_the_grid_is_refused_when_bound():
    gb = _grid(1, 400, 6.0)
    net = luisaml.compile(_model(gb, channels=3))
    feeds = bundle_feeds(gb, points=_points(gb, 8, 0), data=np.zeros((gb.total_voxels + 1, 3), np.float32))
    with pytest.raises(LuisamlError, match=r"voxel data has \d+ rows"):
        net.run(feeds)
    feeds["data_jdata"] = np.zeros((gb.total_voxels, 4), np.float32)  # the channels are fixed
    with pytest.raises(LuisamlError, match="data_jdata.*any number of rows"):
        net.run(feeds)


def test_an_op_with_grid_sized_outputs_keeps_its_grid_static():
    """SplatTrilinear writes a row per voxel: its grid cannot be bound at run time (yet), so a dynamic
    grid_blob stays an error that names it and says how to fix it."""
    gb = _grid(1, 400, 6.0)
    feeds = bundle_feeds(gb, points=_points(gb, 10, 0), values=np.zeros((10, 2), np.float32))
    m = fvdb_model([fvdb_node("SplatTrilinear", "splat", total_voxels=gb.total_voxels)], feeds,
                   batched=("points_jdata", "values_jdata"))
    m = _dynamic(m, ("grid_blob", "leaf_batch_indices"), "rows")
    with pytest.raises(LuisamlError, match=r"'grid_blob' \[rows_grid_blob\].*input_shapes"):
        luisaml.compile(m)


def test_a_shape_that_depends_on_bound_rows_is_named():
    """The probe that changes only the bound rows finds every tensor whose shape follows them (the check
    behind the operators' opt-in: none of today's fvdb ops has one)."""
    from luisaml.passes.infer import _check_bound_rows, infer_shapes

    def model(rows):
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [rows, 4])
        y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="act")], "g", [x], [y])
        return infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))

    with pytest.raises(LuisamlError, match=r"tensor 'y' \(output of node 'act' \(Relu\)\): its shape depends on the rows"):
        _check_bound_rows(model(8), model(13), {"x": "V"})
    _check_bound_rows(model(8), model(8), {"x": "V"})  # the same rows: nothing to say


def test_a_dynamic_input_an_operator_cannot_take_stays_an_error():
    """Rows bound at run time only where the reader reads by index: a Relu over such an input is refused
    as before, naming the input and what to do."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["V", 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["V", 4])
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(LuisamlError, match="input_shapes"):
        luisaml.compile(m, batch_axis=None)


def test_a_torch_module_exported_with_dynamic_grid_sizes(tmp_path):
    """The proposal's export: the grid and its features are inputs with dynamic axes; compiled once, the
    network equals the torch functions on two grids of different sizes."""
    import torch

    from luisaml.fvdb import torch_ops as F

    class Field(torch.nn.Module):
        def forward(self, x, *bundle_and_data):
            bundle, data = bundle_and_data[:7], bundle_and_data[7]
            offsets = bundle[5]  # one grid: the points' and the data's joffsets have its shape [2]
            empty, lidx = torch.zeros(0, dtype=torch.int32), torch.zeros((0, 1), dtype=torch.int32)
            feats = F.sample_trilinear(bundle, (x, offsets, empty, lidx), (data, offsets, empty, lidx))
            return torch.relu(feats).sum(1, keepdim=True), F.points_in_grid(bundle, (x, offsets, empty, lidx))

    def inputs(gb, seed):
        rng = np.random.default_rng(seed)
        data = torch.from_numpy(rng.standard_normal((gb.total_voxels, 6)).astype(np.float32))
        return (torch.from_numpy(_points(gb, 300, seed)), *F.bundle_tensors(gb), data)

    first, second = _grid(1, 400, 6.0), _grid(2, 2500, 14.0)
    names = ["x", *schema.BUNDLE, "data"]
    dynamic = {"x": {0: "N"}, "grid_blob": {0: "G"}, "leaf_batch_indices": {0: "L"}, "list_indices": {0: "M"},
               "data": {0: "V"}, "y": {0: "N"}, "inside": {0: "N"}}
    path = tmp_path / "field.onnx"
    F.export_onnx(Field(), inputs(first, 0), str(path), input_names=names, output_names=["y", "inside"],
                  dynamic_axes=dynamic)
    net = luisaml.compile(str(path))
    for gb, seed in ((first, 1), (second, 2)):
        args = inputs(gb, seed)
        with torch.no_grad():
            want_y, want_inside = Field()(*args)
        out = net.run({n: a.numpy() for n, a in zip(names, args)})
        np.testing.assert_allclose(out["y"], want_y.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out["inside"], want_inside.numpy())


def test_a_bundle_that_does_not_hold_together_is_refused_when_bound():
    """The grid is checked when it is bound (its size is not known before): another grid's leaves, a
    blob cut short, an offset that is no grid's start; each a clear error, and the network still runs a
    good grid afterwards."""
    gb, other = _grid(1, 400, 6.0), _grid(2, 2500, 14.0)
    net = luisaml.compile(_model(gb, channels=2))
    data = np.zeros((gb.total_voxels, 2), np.float32)
    good = bundle_feeds(gb, points=_points(gb, 8, 0), data=data)
    cases = {"leaf_batch_indices": other.bundle()[4], "grid_blob": good["grid_blob"][: len(good["grid_blob"]) // 2],
             "grid_byte_offsets": good["grid_byte_offsets"] + 8}
    for name, value in cases.items():
        with pytest.raises(LuisamlError):
            net.run({**good, name: value})
    out = net.run(good)
    np.testing.assert_array_equal(out["inside"], points_in_grid(gb, JaggedTensor.from_list([good["points_jdata"]])))


def test_index_transform_and_ray_ops_over_grids_bound_at_run_time():
    """The other ops that take a grid of any size: IJKToIndex, CoordsInGrid and WorldToVoxel per point,
    SegmentsAlongRays per ray; one network, two grids of different sizes, against the reference."""
    from fvdb_reference import lookup, ray_node, segments_along_rays, world_to_voxel

    seg_outs = ["segments", "seg_joffsets", "seg_jidx", "seg_jlidx"]

    def feeds_for(gb, seed):
        rng = np.random.default_rng(seed)
        vox = gb.ijk.jdata
        ijk = (vox[rng.integers(0, len(vox), 64)] + rng.integers(-1, 2, (64, 3))).astype(np.int32)
        x = _points(gb, 64, seed)
        centre = gb.voxel_to_world(vox).mean(0)
        o = np.repeat((centre + [0.0, 0.0, -3.0])[None], 32, 0).astype(np.float32)
        d = (gb.voxel_to_world(vox[rng.integers(0, len(vox), 32)]) - o).astype(np.float32)
        return ijk, x, o, d, bundle_feeds(gb, ijk=ijk, points=x, ray_origins=o, ray_directions=d)

    first, second = _grid(1, 400, 6.0), _grid(2, 2500, 14.0)
    *_, feeds = feeds_for(first, 0)
    nodes = [fvdb_node("IJKToIndex", "index", cumulative=1), fvdb_node("CoordsInGrid", "active"),
             fvdb_node("WorldToVoxel", "xv"), ray_node("SegmentsAlongRays", seg_outs, eps=1e-3)]
    m = fvdb_model(nodes, feeds, batched=("ijk_jdata", "points_jdata"), outputs=["index", "active", "xv"] + seg_outs)
    net = luisaml.compile(_dynamic(m, ("grid_blob", "leaf_batch_indices", "list_indices"), "rows"))
    for gb, seed in ((first, 1), (second, 2)):
        ijk, x, o, d, feeds = feeds_for(gb, seed)
        out = net.run(feeds)
        want = lookup(gb, ijk, np.zeros(len(ijk), np.int32))
        np.testing.assert_array_equal(out["index"], want)
        np.testing.assert_array_equal(out["active"], want >= 0)
        assert_floats_equal(out["xv"], world_to_voxel(gb, JaggedTensor.from_list([x])))
        ref = segments_along_rays(gb, JaggedTensor.from_list([o]), JaggedTensor.from_list([d]), eps=1e-3)
        assert sum(map(len, ref)) > 10
        np.testing.assert_array_equal(np.diff(out["seg_joffsets"]), [len(r) for r in ref])
        np.testing.assert_allclose(out["segments"], np.array([s for r in ref for s in r]).reshape(-1, 2),
                                   rtol=2e-5, atol=2e-5)
