"""Grid batches of any count (issue 28, item 2): a model exported with the grid count dynamic (the
bundle's grid_byte_offsets, voxel_sizes, origins and batch_offsets, and the JaggedTensors' joffsets,
a symbolic first dimension as the fVDB proposal exports them) compiles once and runs over batches of
1, 2 and 3 grids, equal to the torch functions (luisaml.fvdb.torch_ops) on each; a count input that
disagrees with the blob's grids is an InputError naming it; a static-count export compiles as before."""
import numpy as np
import onnx
import pytest
import torch

import luisaml
from luisaml.errors import InputError, LuisamlError
from luisaml.fvdb import GridBatch
from luisaml.fvdb import torch_ops as F
from luisaml.opsets import fvdb as schema

from conftest import assert_floats_equal
from fvdb_reference import bundle_feeds, fvdb_model, fvdb_node, points_in_grid

NAMES = ["x", "x_joffsets", "x_jidx", "ijk", "ijk_joffsets", "ijk_jidx", *schema.BUNDLE, "data"]
OUTPUTS = ["tri", "bez", "inside", "index", "xv"]
COUNT = {"grid_byte_offsets": "G", "voxel_sizes": "G", "origins": "G", "batch_offsets": "G1", "x_joffsets": "G1",
         "ijk_joffsets": "G1"}
ANY_SIZE = {"x": "N", "x_jidx": "N", "ijk": "N", "ijk_jidx": "N", "grid_blob": "nbytes", "leaf_batch_indices": "L",
            "list_indices": "M", "data": "V", **{o: "N" for o in OUTPUTS}}


class Field(torch.nn.Module):
    """The per-point ops over a batch of grids: both samplers, a point query, cumulative indices of
    integer coordinates and the world-to-voxel transform."""

    def forward(self, x, x_joffsets, x_jidx, ijk, ijk_joffsets, ijk_jidx, *bundle_and_data):
        bundle, data = bundle_and_data[:7], bundle_and_data[7]
        lidx, empty = torch.zeros((0, 1), dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
        pts, vox = (x, x_joffsets, x_jidx, lidx), (data, bundle[5], empty, lidx)
        return (F.sample_trilinear(bundle, pts, vox), F.sample_bezier(bundle, pts, vox),
                F.points_in_grid(bundle, pts), F.ijk_to_index(bundle, (ijk, ijk_joffsets, ijk_jidx, lidx), True),
                F.world_to_voxel(bundle, pts))


def _grids(count: int, seed: int) -> GridBatch:
    """count grids of different voxel counts, voxel sizes and origins."""
    rng = np.random.default_rng(seed)
    ijk = []
    for b in range(count):
        p = rng.normal(size=(int(rng.integers(150, 600)), 3))
        ijk.append(np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * (3.0 + 2.5 * b)).astype(np.int32))
    return GridBatch.from_ijk(ijk, voxel_sizes=[[0.1 + 0.03 * b] * 3 for b in range(count)],
                              origins=[[0.02 * b, -0.05, 0.01 * b] for b in range(count)])


def _jagged(parts: list[np.ndarray]) -> tuple[torch.Tensor, ...]:
    """(jdata, joffsets, jidx) with a grid id per element (also for one grid: the network's jidx follows
    the points)."""
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    jidx = np.repeat(np.arange(len(parts), dtype=np.int32), np.diff(offsets))
    return torch.from_numpy(np.concatenate(parts)), torch.from_numpy(offsets), torch.from_numpy(jidx)


def _inputs(gb: GridBatch, seed: int) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(seed)
    xs, ijks = [], []
    for b, v in enumerate(gb.ijk.unbind()):
        n = int(rng.integers(40, 90))  # (the points and the coordinates are both the batch: as many of each)
        near = v[rng.integers(0, len(v), n)] + rng.uniform(-0.8, 0.8, (n, 3))
        xs.append((near * gb.voxel_sizes[b] + gb.origins[b]).astype(np.float32))
        ijks.append((v[rng.integers(0, len(v), n)] + rng.integers(-1, 2, (n, 3))).astype(np.int32))
    data = torch.from_numpy(rng.standard_normal((gb.total_voxels, 3)).astype(np.float32))
    return (*_jagged(xs), *_jagged(ijks), *F.bundle_tensors(gb), data)


def _feeds(args) -> dict[str, np.ndarray]:
    return {n: a.numpy() for n, a in zip(NAMES, args)}


def _export(path, gb: GridBatch, count: dict[str, str]) -> str:
    F.export_onnx(Field(), _inputs(gb, 0), str(path), input_names=NAMES, output_names=OUTPUTS,
                  dynamic_axes={k: {0: v} for k, v in {**ANY_SIZE, **count}.items()})
    return str(path)


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """The network compiled once from the export of a 2-grid example with the grid count dynamic."""
    path = _export(tmp_path_factory.mktemp("count") / "field.onnx", _grids(2, 0), COUNT)
    dims = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            for vi in onnx.load(path).graph.input}
    assert dims["voxel_sizes"] == ["G", 3] and dims["batch_offsets"] == ["G1"]  # the count is symbolic
    return luisaml.compile(path)


def test_one_network_runs_grid_batches_of_one_two_and_three_grids(counted):
    specs = {s.name: s for s in counted.plan.inputs}
    assert all(specs[n].rows is not None for n in COUNT)  # bound at run time, not compiled per count
    seen_voxels = set()
    for count, seed in ((1, 11), (2, 12), (3, 13), (2, 14)):
        gb = _grids(count, seed)
        assert gb.grid_count == count
        seen_voxels.add(tuple(gb.num_voxels.tolist()))
        args = _inputs(gb, seed)
        out = counted.run(_feeds(args))
        with torch.no_grad():
            want = [w.numpy() for w in Field()(*args)]
        for name, w in zip(OUTPUTS, want):
            assert out[name].shape == w.shape, name
            if w.dtype == np.float32:
                assert_floats_equal(out[name], w, err_msg=f"{name} over {count} grid(s)")
            else:
                np.testing.assert_array_equal(out[name], w, err_msg=f"{name} over {count} grid(s)")
        inside = out["inside"]
        assert inside.any() and not inside.all()
        assert (out["index"] >= gb.batch_offsets[-2]).any()  # the last grid's cumulative indices are reached
        assert np.abs(out["tri"]).max() > 0
    assert len(seen_voxels) == 4


@pytest.mark.parametrize("name, bad", [
    ("voxel_sizes", lambda f: f["voxel_sizes"][:1]),
    ("origins", lambda f: np.concatenate([f["origins"], f["origins"][:1]])),
    ("batch_offsets", lambda f: f["batch_offsets"][:-1]),
    ("x_joffsets", lambda f: f["x_joffsets"][:-1]),
    ("ijk_joffsets", lambda f: np.concatenate([f["ijk_joffsets"], f["ijk_joffsets"][-1:]])),
    ("grid_byte_offsets", lambda f: np.concatenate([f["grid_byte_offsets"], f["grid_byte_offsets"][:1]])),
])
def test_a_count_input_that_disagrees_with_the_blob_is_named(counted, name, bad):
    good = _feeds(_inputs(_grids(2, 5), 5))
    rows = len(bad(good))
    want = 3 if name in ("batch_offsets", "x_joffsets", "ijk_joffsets") else 2
    with pytest.raises(InputError, match=rf"input '{name}' has {rows} rows, but grid_blob 'grid_blob' holds 2 "
                                         rf"grid\(s\): expected {want}"):
        counted.run({**good, name: bad(good)})
    out = counted.run(good)  # the network still runs a good batch afterwards
    np.testing.assert_array_equal(out["inside"], Field()(*_inputs(_grids(2, 5), 5))[2].numpy())


def test_a_blob_with_more_grids_than_the_offsets_is_named(counted):
    """The count is the blob's: a blob of three grids bound with the other inputs of two is refused,
    naming the first count input and both counts (never two of three grids read)."""
    two, three = _feeds(_inputs(_grids(2, 6), 6)), _grids(3, 6)
    with pytest.raises(InputError, match=r"input 'grid_byte_offsets' has 2 rows, but grid_blob 'grid_blob' holds 3"):
        counted.run({**two, "grid_blob": three.grid_blob, "leaf_batch_indices": three.leaf_batch_indices})


def test_the_static_count_export_compiles_as_before_and_agrees_bit_for_bit(counted, tmp_path):
    """The grid count fixed in the export: no count input bound at run time, no derived grid count in
    its code (the path as before this change), and the dynamic network's outputs on the same batch
    equal its outputs bit for bit."""
    gb = _grids(2, 7)
    static = luisaml.compile(_export(tmp_path / "static.onnx", _grids(2, 0), {}))
    specs = {s.name: s for s in static.plan.inputs}
    assert all(specs[n].rows is None and specs[n].kernel_shape[0] in (2, 3) for n in COUNT)
    assert not any(d.compute.__name__.startswith("grid_count") or d.any_rows for d in static.plan.derived)
    assert "grid_count" not in static.source and "grid_count" in counted.source
    feeds = _feeds(_inputs(gb, 7))
    a, b = static.run(feeds), counted.run(feeds)
    for name in OUTPUTS:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    with pytest.raises(InputError, match=r"x_joffsets': expected shape \[3\], got \[4\]"):  # it keeps its count
        static.run(_feeds(_inputs(_grids(3, 7), 7)))


def _onnx_model(gb: GridBatch, symbols: dict[str, str]) -> onnx.ModelProto:
    """PointsInGrid over a bundle whose named inputs' first dimension is the given symbol."""
    x = (gb.ijk.jdata[:64] * gb.voxel_sizes[0] + gb.origins[0]).astype(np.float32)
    feeds = bundle_feeds(gb, points=x)
    feeds["points_jidx"] = np.zeros(len(x), np.int32)
    m = fvdb_model([fvdb_node("PointsInGrid", "inside")], feeds, batched=("points_jdata", "points_jidx"))
    for vi in m.graph.input:
        if vi.name in symbols:
            d = vi.type.tensor_type.shape.dim[0]
            d.Clear()
            d.dim_param = symbols[vi.name]
    return m


def test_one_symbol_for_the_count_and_the_offsets():
    """An export that calls batch_offsets' and joffsets' [G+1] 'G' too: the offsets are given a symbol
    of their own (G + 1), and the network runs 1 and 3 grids against the reference."""
    sym = {n: "G" for n in ("grid_byte_offsets", "voxel_sizes", "origins", "batch_offsets", "points_joffsets")}
    sym.update(grid_blob="nbytes", leaf_batch_indices="L")
    net = luisaml.compile(_onnx_model(_grids(2, 0), sym))
    specs = {s.name: s for s in net.plan.inputs}
    assert specs["batch_offsets"].rows == specs["points_joffsets"].rows == "G + 1" and specs["origins"].rows == "G"
    from luisaml.fvdb import JaggedTensor

    for count in (1, 3):
        gb = _grids(count, 20 + count)
        parts = [(v[:40] * gb.voxel_sizes[b] + gb.origins[b] + 0.3 * gb.voxel_sizes[b]).astype(np.float32)
                 for b, v in enumerate(gb.ijk.unbind())]
        pts = JaggedTensor.from_list(parts)
        feeds = bundle_feeds(gb, points=pts)
        feeds["points_jidx"] = np.repeat(np.arange(count, dtype=np.int32), [len(p) for p in parts])
        out = net.run(feeds)
        np.testing.assert_array_equal(out["inside"], points_in_grid(gb, pts))


def test_a_count_only_partly_dynamic_is_a_compile_error_naming_both():
    sym = {"grid_byte_offsets": "G", "grid_blob": "nbytes", "leaf_batch_indices": "L"}
    with pytest.raises(LuisamlError, match=r"grid_byte_offsets 'grid_byte_offsets' \(first dimension 'G'\) has a grid "
                                           r"count bound at run time, but voxel_sizes 'voxel_sizes' \[2, 3\] has a "
                                           "fixed one"):
        luisaml.compile(_onnx_model(_grids(2, 0), sym))


def test_an_op_that_needs_the_count_when_compiled_still_refuses_it():
    """SplatTrilinear writes a row per voxel of the batch: its grid count stays static, a dynamic one
    the old error naming the inputs and the node."""
    gb = _grids(2, 0)
    feeds = bundle_feeds(gb, points=np.zeros((4, 3), np.float32), values=np.zeros((4, 2), np.float32))
    feeds["points_jidx"] = feeds["values_jidx"] = np.zeros(4, np.int32)
    m = fvdb_model([fvdb_node("SplatTrilinear", "splat", total_voxels=gb.total_voxels)], feeds,
                   batched=("points_jdata", "points_jidx", "values_jdata", "values_jidx"))
    for vi in m.graph.input:
        if vi.name in ("grid_byte_offsets", "voxel_sizes", "origins"):
            vi.type.tensor_type.shape.dim[0].dim_param = "G"
    with pytest.raises(LuisamlError, match=r"'grid_byte_offsets' (is )?\[G\].*SplatTrilinear"):
        luisaml.compile(m)


def test_rays_over_grid_batches_of_one_two_and_three_grids():
    """SegmentsAlongRays with the grid count bound at run time: 24 rays spread over 1, 2 and 3 grids,
    against the numpy reference of fVDB's walk; a ray's jidx naming a grid past the blob's is named."""
    from luisaml.fvdb import JaggedTensor

    from fvdb_reference import ray_node, segments_along_rays

    outs = ["segments", "seg_joffsets", "seg_jidx", "seg_jlidx"]

    def feeds_for(gb: GridBatch, seed: int):
        rng = np.random.default_rng(seed)
        counts = np.diff(np.linspace(0, 24, gb.grid_count + 1).astype(int))
        o, d = [], []
        for b, v in enumerate(gb.ijk.unbind()):
            world = gb.voxel_to_world(v, b)
            eye = np.repeat((world.mean(0) + [0.0, 0.0, -3.0])[None], counts[b], 0)
            o.append(eye.astype(np.float32))
            d.append((world[rng.integers(0, len(v), counts[b])] - eye).astype(np.float32))
        o, d = JaggedTensor.from_list(o), JaggedTensor.from_list(d)
        x = (gb.ijk.jdata[:16] * gb.voxel_sizes[0] + gb.origins[0]).astype(np.float32)
        feeds = bundle_feeds(gb, points=x, ray_origins=o, ray_directions=d)
        feeds["points_jidx"] = np.zeros(len(x), np.int32)
        feeds["points_joffsets"] = np.array([0] + [len(x)] * gb.grid_count, np.int64)
        for name, jt in (("ray_origins", o), ("ray_directions", d)):
            feeds[f"{name}_jidx"] = np.repeat(np.arange(gb.grid_count, dtype=np.int32), np.diff(jt.joffsets))
        return o, d, feeds

    *_, feeds = feeds_for(_grids(2, 0), 0)
    m = fvdb_model([fvdb_node("PointsInGrid", "inside"), ray_node("SegmentsAlongRays", outs, eps=1e-3)], feeds,
                   batched=("points_jdata", "points_jidx"), outputs=["inside"] + outs)
    sym = {n: "G" for n in ("grid_byte_offsets", "voxel_sizes", "origins")}
    sym.update({n: "G1" for n in ("batch_offsets", "points_joffsets", "ray_origins_joffsets",
                                  "ray_directions_joffsets")}, grid_blob="nbytes", leaf_batch_indices="L")
    for vi in m.graph.input:
        if vi.name in sym:
            vi.type.tensor_type.shape.dim[0].Clear()
            vi.type.tensor_type.shape.dim[0].dim_param = sym[vi.name]
    net = luisaml.compile(m)
    for count in (1, 2, 3):
        gb = _grids(count, 30 + count)
        o, d, feeds = feeds_for(gb, count)
        out = net.run(feeds)
        ref = segments_along_rays(gb, o, d, eps=1e-3)
        assert sum(map(len, ref)) > 10
        np.testing.assert_array_equal(np.diff(out["seg_joffsets"]), [len(r) for r in ref])
        np.testing.assert_allclose(out["segments"], np.array([s for r in ref for s in r]).reshape(-1, 2),
                                   rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(out["seg_jlidx"][:, 0], feeds["ray_origins_jidx"])
    bad = {**feeds, "ray_origins_jidx": np.full_like(feeds["ray_origins_jidx"], 3)}
    with pytest.raises(InputError, match=r"input 'ray_origins_jidx' names grid 3 at ray 0"):
        net.run(bad)
    with pytest.raises(InputError, match=r"input 'ray_directions_joffsets' has 3 rows, but grid_blob 'grid_blob' "
                                         r"holds 3 grid\(s\): expected 4"):
        net.run({**feeds, "ray_directions_joffsets": feeds["ray_directions_joffsets"][:-1]})
