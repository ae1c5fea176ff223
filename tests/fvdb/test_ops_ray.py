"""fvdb.VoxelsAlongRays and SegmentsAlongRays (NanoVDB's hierarchical DDA in shaders/hdda.py, outputs sized
at run time by luisaml/dynamic.py) against the numpy reference's plain voxel walk, on grids from the
project's builder and warp's: two grids in a batch, negative coordinates and several root tiles, rays
from outside and inside, axis-aligned rays, rays that miss, an empty grid, a single voxel.

How results are compared: integers (hit counts, ijk, indices, jidx, jlidx) exactly; times within 2e-5 of
the ray's time scale (float32 against float64). A ray that grazes a voxel edge crosses two faces at times
equal to within float32 rounding, and the two walks may then visit either diagonal neighbour for ~0 time:
the random-ray tests run with eps = 1e-3 (hits shorter than that are dropped by both, as fVDB's eps does),
and the eps = 0 tests use rays whose crossings are far apart (axis-aligned, or chosen away from ties)."""
import numpy as np
import pytest

import luisaml
from luisaml.errors import LuisamlError, UsageError
from luisaml.fvdb import GridBatch, JaggedTensor

from fvdb_reference import bundle_feeds, fvdb_model, ray_node, segments_along_rays, voxels_along_rays

VOXEL_OUTS = ["voxels", "times", "vox_joffsets", "vox_jidx", "vox_jlidx"]
SEGMENT_OUTS = ["segments", "seg_joffsets", "seg_jidx", "seg_jlidx"]
T_TOL = 2e-5


def _rays(gb: GridBatch, n: int, rng, inside: float = 0.3):
    """Return (origins, directions) JaggedTensors: per grid, rays from a box around its voxels towards
    random active voxels (some starting inside the grid), plus random directions."""
    origins, directions = [], []
    from luisaml.fvdb.nanovdb_query import active_voxels

    for b, g in enumerate(gb.grids):
        vox = active_voxels(g)
        h, o = gb.voxel_sizes[b], gb.origins[b]
        if len(vox):
            lo, hi = vox.min(0) - 4, vox.max(0) + 4
            target = vox[rng.integers(0, len(vox), n)] + rng.uniform(-0.5, 0.5, (n, 3))
        else:
            lo, hi = np.full(3, -4), np.full(3, 4)
            target = rng.uniform(-2, 2, (n, 3))
        start = rng.uniform(lo, hi, (n, 3))
        centre = (lo + hi) / 2
        outside = rng.random(n) > inside
        start[outside] = centre + (start[outside] - centre) * 3  # well outside the bounding box
        d = target - start
        d[: n // 8] = rng.normal(size=(n // 8, 3))  # and some in any direction
        origins.append((start * h + o).astype(np.float32))
        directions.append((d * h * rng.uniform(0.5, 2.0, (n, 1))).astype(np.float32))
    return JaggedTensor.from_list(origins), JaggedTensor.from_list(directions)


def _run(gb, origins, directions, nodes, outputs=None):
    feeds = bundle_feeds(gb, ray_origins=origins, ray_directions=directions)
    net = luisaml.compile(fvdb_model(nodes, feeds, outputs=outputs))
    return net, net.run(feeds)


def _check_jagged(out, prefix, counts, origins, gb):
    """joffsets from the reference's counts, jidx the ray of each row, jlidx (grid, ray in grid)."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    np.testing.assert_array_equal(out[f"{prefix}_joffsets"], offsets)
    np.testing.assert_array_equal(out[f"{prefix}_jidx"], np.repeat(np.arange(len(counts), dtype=np.int32), counts))
    b = origins.jidx if origins.jidx.size else np.zeros(len(counts), np.int32)
    np.testing.assert_array_equal(out[f"{prefix}_jlidx"], np.stack([b, np.arange(len(counts)) - origins.joffsets[b]], 1))


def _check_voxels(out, ref, origins, gb, return_ijk=True, cumulative=False):
    counts = [len(r) for r in ref]
    _check_jagged(out, "vox", counts, origins, gb)
    flat = [h for r in ref for h in r]
    times = np.array([(t0, t1) for _, t0, t1 in flat]).reshape(-1, 2)
    np.testing.assert_allclose(out["times"], times, rtol=T_TOL, atol=T_TOL)
    ijk = np.array([v for v, _, _ in flat], np.int32).reshape(-1, 3)
    if return_ijk:
        np.testing.assert_array_equal(out["voxels"], ijk)
        return
    from luisaml.fvdb import ijk_to_index

    ray_grid = (origins.jidx if origins.jidx.size else np.zeros(len(ref), np.int32)).repeat(counts)
    want = np.array([ijk_to_index(gb.grids[b], v[None])[0] + (gb.batch_offsets[b] if cumulative else 0)
                     for b, v in zip(ray_grid, ijk)], np.int32)
    np.testing.assert_array_equal(out["voxels"], want)


def _check_segments(out, ref, origins, gb):
    _check_jagged(out, "seg", [len(r) for r in ref], origins, gb)
    want = np.array([s for r in ref for s in r]).reshape(-1, 2)
    np.testing.assert_allclose(out["segments"], want, rtol=T_TOL, atol=T_TOL)


@pytest.fixture(scope="module")
def two_grids():
    rng = np.random.default_rng(12)
    # a shell and scattered voxels, negative coordinates, voxels in several root tiles
    p = rng.normal(size=(3000, 3))
    shell = np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * 14 + [-3, 5, -8]).astype(np.int32)
    far = np.array([[-4100, 3, 2], [4100, -5, 7], [-4101, 3, 2], [-4099, 3, 2]], np.int32)
    vox1 = rng.integers(-12, 12, (500, 3)).astype(np.int32)
    return GridBatch.from_ijk([np.concatenate([shell, far]), vox1], voxel_sizes=[[0.5, 0.5, 0.5], [0.1, 0.2, 0.15]],
                              origins=[[1.0, -2.0, 0.5], [-0.3, 0.2, 0.05]])


def test_voxels_and_segments_equal_the_reference_walk_on_two_grids(two_grids):
    gb = two_grids
    origins, directions = _rays(gb, 150, np.random.default_rng(1))
    nodes = [ray_node("VoxelsAlongRays", VOXEL_OUTS, eps=1e-3), ray_node("SegmentsAlongRays", SEGMENT_OUTS, eps=1e-3)]
    _, out = _run(gb, origins, directions, nodes)
    ref_v = voxels_along_rays(gb, origins, directions, eps=1e-3)
    ref_s = segments_along_rays(gb, origins, directions, eps=1e-3)
    assert sum(map(len, ref_v)) > 250 and sum(map(len, ref_s)) > 100  # the rays do hit (325 and 306 here)
    _check_voxels(out, ref_v, origins, gb)
    _check_segments(out, ref_s, origins, gb)


def _axis_rays(gb: GridBatch, b: int):
    """Rays along +x, -y and +z through voxel centres of grid b (world space), starting outside its box:
    every crossing is a whole voxel step, so eps = 0 has no ties."""
    from luisaml.fvdb.nanovdb_query import active_voxels

    vox = active_voxels(gb.grids[b])
    lo, hi = vox.min(0) - 3, vox.max(0) + 3
    h, o = gb.voxel_sizes[b], gb.origins[b]
    picks = vox[:: max(len(vox) // 8, 1)][:8]
    origins, directions = [], []
    for v in picks:
        for axis, sign in ((0, 1), (1, -1), (2, 1)):
            start = v.astype(np.float64).copy()
            start[axis] = lo[axis] if sign > 0 else hi[axis]
            d = np.zeros(3)
            d[axis] = sign * h[axis]
            origins.append(start * h + o)
            directions.append(d)
    return np.array(origins, np.float32), np.array(directions, np.float32)


def test_axis_aligned_rays_with_eps_zero_and_max_counts(two_grids):
    gb = two_grids
    per_grid = [_axis_rays(gb, b) for b in range(2)]
    origins = JaggedTensor.from_list([o for o, _ in per_grid])
    directions = JaggedTensor.from_list([d for _, d in per_grid])
    nodes = [ray_node("VoxelsAlongRays", VOXEL_OUTS), ray_node("SegmentsAlongRays", SEGMENT_OUTS)]
    _, out = _run(gb, origins, directions, nodes)
    ref_v, ref_s = voxels_along_rays(gb, origins, directions), segments_along_rays(gb, origins, directions)
    assert all(len(r) > 0 for r in ref_v)  # every ray starts outside and crosses its target voxel
    _check_voxels(out, ref_v, origins, gb)
    _check_segments(out, ref_s, origins, gb)
    # at most 2 voxels and 1 segment per ray: the first ones of each ray's walk
    nodes = [ray_node("VoxelsAlongRays", VOXEL_OUTS, max_voxels=2), ray_node("SegmentsAlongRays", SEGMENT_OUTS,
                                                                               max_segments=1)]
    _, out = _run(gb, origins, directions, nodes)
    _check_voxels(out, voxels_along_rays(gb, origins, directions, max_voxels=2), origins, gb)
    _check_segments(out, segments_along_rays(gb, origins, directions, max_segments=1), origins, gb)


@pytest.mark.parametrize("cumulative", [False, True])
def test_voxel_indices_instead_of_ijk(two_grids, cumulative):
    gb = two_grids
    origins, directions = _rays(gb, 60, np.random.default_rng(5))
    node = ray_node("VoxelsAlongRays", VOXEL_OUTS, eps=1e-3, return_ijk=0, cumulative=int(cumulative))
    _, out = _run(gb, origins, directions, [node])
    assert out["voxels"].ndim == 1
    ref = voxels_along_rays(gb, origins, directions, eps=1e-3)
    assert sum(map(len, ref)) > 50
    _check_voxels(out, ref, origins, gb, return_ijk=False, cumulative=cumulative)


def test_rays_that_miss_an_empty_grid_and_a_single_voxel():
    gb = GridBatch.from_ijk([np.zeros((0, 3), np.int32), np.array([[2, -3, 5]], np.int32)],
                            voxel_sizes=[[1.0, 1.0, 1.0], [0.25, 0.25, 0.25]], origins=[[0.0, 0.0, 0.0], [0.1, 0.0, -0.2]])
    h, o = gb.voxel_sizes[1], gb.origins[1]
    centre = np.array([2, -3, 5]) * h + o
    o1 = np.array([centre - [1, 0, 0], centre + [0, 2, 0], centre + [5, 5, 5], centre - [1, 0, 0], centre],
                  np.float32)
    d1 = np.array([[1, 0, 0], [0, -1, 0], [1, 1, 1], [-1, 0, 0], [0, 0, 0]], np.float32)  # hit, hit, miss, away, zero
    origins = JaggedTensor.from_list([np.array([[0, 0, 0], [3, 3, 3]], np.float32), o1])
    directions = JaggedTensor.from_list([np.array([[1, 0, 0], [0, 1, 0]], np.float32), d1])
    nodes = [ray_node("VoxelsAlongRays", VOXEL_OUTS), ray_node("SegmentsAlongRays", SEGMENT_OUTS)]
    _, out = _run(gb, origins, directions, nodes)
    ref_v = voxels_along_rays(gb, origins, directions)
    assert [len(r) for r in ref_v] == [0, 0, 1, 1, 0, 0, 0]  # (the reference agrees with what the rays were made for)
    _check_voxels(out, ref_v, origins, gb)
    _check_segments(out, segments_along_rays(gb, origins, directions), origins, gb)


def test_a_grid_built_by_warp(warp_ref):
    rng = np.random.default_rng(3)
    p = rng.normal(size=(4000, 3))
    ijk = np.unique(np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * 40).astype(np.int32), axis=0)
    gb = GridBatch.from_buffer(warp_ref.volume_bytes(warp_ref.volume_from_ijk(ijk, voxel_size=0.1)))
    origins, directions = _rays(gb, 200, rng)
    nodes = [ray_node("VoxelsAlongRays", VOXEL_OUTS, eps=1e-3), ray_node("SegmentsAlongRays", SEGMENT_OUTS, eps=1e-3)]
    _, out = _run(gb, origins, directions, nodes)
    ref_v = voxels_along_rays(gb, origins, directions, eps=1e-3)
    assert sum(map(len, ref_v)) > 200
    _check_voxels(out, ref_v, origins, gb)
    _check_segments(out, segments_along_rays(gb, origins, directions, eps=1e-3), origins, gb)


def test_run_time_sized_outputs_cannot_be_read_embedded_or_saved(two_grids, tmp_path):
    gb = two_grids
    origins, directions = _rays(gb, 4, np.random.default_rng(2))
    feeds = bundle_feeds(gb, ray_origins=origins, ray_directions=directions)
    from onnx import helper

    # a node reading the voxels (sized only at run time) is refused, naming the node and the input
    reader = helper.make_node("Neg", ["times"], ["neg"], name="negate")
    with pytest.raises(LuisamlError, match=r"negate.*'times'.*run time"):
        luisaml.compile(fvdb_model([ray_node("VoxelsAlongRays", VOXEL_OUTS), reader], feeds,
                                   outputs=["neg", "vox_joffsets"]))
    net = luisaml.compile(fvdb_model([ray_node("SegmentsAlongRays", SEGMENT_OUTS)], feeds))
    with pytest.raises(UsageError, match="sized at run time"):
        net.forward
    with pytest.raises(UsageError, match="sized at run time"):
        net.save(tmp_path / "rays.lml")
    # the same network runs twice with the same answer (buffers re-sized per run)
    a, b = net.run(feeds), net.run(feeds)
    for k in SEGMENT_OUTS:
        np.testing.assert_array_equal(a[k], b[k])


def test_torch_functions_walk_as_the_reference_and_export_to_the_nodes(two_grids, tmp_path):
    import torch

    from luisaml.fvdb import torch_ops as F

    gb = two_grids
    origins, directions = _rays(gb, 40, np.random.default_rng(7))
    bundle = F.bundle_tensors(gb)
    seg = F.segments_along_rays(bundle, origins, directions, eps=1e-3)
    vox = F.voxels_along_rays(bundle, origins, directions, eps=1e-3, max_voxels=5)
    out = {**{k: v.numpy() for k, v in zip(SEGMENT_OUTS, seg)}, **{k: v.numpy() for k, v in zip(VOXEL_OUTS, vox)}}
    _check_segments(out, segments_along_rays(gb, origins, directions, eps=1e-3), origins, gb)
    _check_voxels(out, voxels_along_rays(gb, origins, directions, eps=1e-3, max_voxels=5), origins, gb)

    o_parts, d_parts = F.jagged_tensors(origins), F.jagged_tensors(directions)

    class Walk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, t in enumerate(bundle + o_parts[1:]):
                self.register_buffer(f"b{k}", t)

        def forward(self, o, d):
            b = [getattr(self, f"b{k}") for k in range(len(bundle) + 3)]
            rest = tuple(b[len(bundle):])
            return F.segments_along_rays(b[:len(bundle)], (o,) + rest, (d,) + rest, eps=1e-3)

    path = tmp_path / "walk.onnx"
    F.export_onnx(Walk(), (o_parts[0], d_parts[0]), str(path), input_names=["o", "d"], output_names=SEGMENT_OUTS)
    import onnx

    assert [n.op_type for n in onnx.load(str(path)).graph.node if n.domain == "fvdb"] == ["SegmentsAlongRays"]
    got = luisaml.compile(str(path), batch_axis=None).run({"o": origins.jdata, "d": directions.jdata})
    for k in SEGMENT_OUTS:
        np.testing.assert_array_equal(got[k], out[k], err_msg=k)


def test_non_finite_rays_have_no_hits_and_leave_the_others_alone(two_grids):
    """NaN or infinite origins and directions (hostile or broken input) end their walk at once with no
    hit; every other ray's result is the one it has without them."""
    gb = two_grids
    origins, directions = _rays(gb, 12, np.random.default_rng(9))
    o, d = origins.jdata.copy(), directions.jdata.copy()
    bad = np.array([0, 3, 5, 14, 20])
    o[0, 1], d[3, 0], d[5] = np.nan, np.inf, -np.inf
    o[14] = np.inf
    d[20] = [np.nan, 0.0, 1.0]
    broken = (JaggedTensor.from_list([o[:12], o[12:]]), JaggedTensor.from_list([d[:12], d[12:]]))
    nodes = [ray_node("VoxelsAlongRays", VOXEL_OUTS, eps=1e-3), ray_node("SegmentsAlongRays", SEGMENT_OUTS, eps=1e-3)]
    _, out = _run(gb, *broken, nodes)
    _, clean = _run(gb, origins, directions, nodes)
    for prefix, rows in (("vox", ["voxels", "times"]), ("seg", ["segments"])):
        counts, want = np.diff(out[f"{prefix}_joffsets"]), np.diff(clean[f"{prefix}_joffsets"])
        assert (counts[bad] == 0).all()
        good = np.setdiff1d(np.arange(len(counts)), bad)
        np.testing.assert_array_equal(counts[good], want[good])
        for name in rows:
            keep = np.repeat(np.isin(np.arange(len(counts)), good), want)
            np.testing.assert_array_equal(out[name], clean[name][keep])


def test_inspect_shows_the_phases_and_the_run_time_rows(two_grids):
    from luisaml import report

    gb = two_grids
    origins, directions = _rays(gb, 4, np.random.default_rng(2))
    feeds = bundle_feeds(gb, ray_origins=origins, ray_directions=directions)
    rep = report.build(fvdb_model([ray_node("SegmentsAlongRays", SEGMENT_OUTS)], feeds), batch_axis=None)
    assert [st["readback"] for st in rep["stages"]] == [False, False, False, True, False]  # count, scan x3, fill
    outs = rep["nodes"][0]["outputs"]
    assert outs[0]["shape"] == ["rows of segments", 2] and outs[1]["shape"] == [len(origins.jdata) + 1]
    assert "launched as 2 command lists, the host reading a row count back between them" in report.text(rep)


def test_rays_whose_jagged_parts_disagree_are_refused_when_bound(two_grids):
    """issue 25: a jidx naming grid 3 of a one-grid batch and joffsets [0, 3] for 8 rays were accepted
    (no hits; rays outside joffsets' span): the rays' layout is checked when they are bound, an InputError
    naming the node, the input and what was expected; the same network then answers as the reference."""
    from luisaml.errors import InputError

    one = GridBatch.from_ijk([np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0]], np.int32)], voxel_sizes=[[1.0, 1.0, 1.0]], origins=[[0.0, 0.0, 0.0]])
    def with_jidx(jt):  # (a one-tensor JaggedTensor with its jidx written out: zeros)
        return JaggedTensor(jt.jdata, jt.joffsets, np.zeros(len(jt.jdata), np.int32), jt.jlidx)

    origins = with_jidx(JaggedTensor.from_list([np.tile(np.array([[-5, 0.2, 0.1]], np.float32), (8, 1))]))
    directions = with_jidx(JaggedTensor.from_list([np.tile(np.array([[1, 0, 0]], np.float32), (8, 1))]))
    feeds = bundle_feeds(one, ray_origins=origins, ray_directions=directions)
    net = luisaml.compile(fvdb_model([ray_node("SegmentsAlongRays", SEGMENT_OUTS)], feeds), batch_axis=None)
    cases = [
        (dict(ray_origins_jidx=np.full(8, 3, np.int32)), r"input 'ray_origins_jidx' names grid 3 at ray 0, but "
         r"'ray_origins_joffsets' \[0, 8\] puts that ray in grid 0 \(the batch has 1 grid\)"),
        (dict(ray_origins_joffsets=np.array([0, 3], np.int64), ray_directions_joffsets=np.array([0, 3], np.int64)),
         r"input 'ray_origins_joffsets' must rise from 0 to 8 \(the rays\) in 2 entries .*got \[0, 3\]"),
        (dict(ray_directions_joffsets=np.array([0, 3], np.int64)),
         r"input 'ray_directions_joffsets' must rise from 0 to 8 .*got \[0, 3\]"),
        (dict(ray_directions_jidx=np.array([0] * 7 + [-1], np.int32)), r"input 'ray_directions_jidx' names grid -1 "
         r"at ray 7"),
    ]
    for change, msg in cases:
        with pytest.raises(InputError, match=r"node 'segments' \(fvdb::SegmentsAlongRays\): " + msg):
            net.run({**feeds, **change})
    # two grids: jidx must follow joffsets ray by ray, and every jagged input be laid out as the origins
    origins, directions = _rays(two_grids, 4, np.random.default_rng(5))
    feeds = bundle_feeds(two_grids, ray_origins=origins, ray_directions=directions)
    net = luisaml.compile(fvdb_model([ray_node("SegmentsAlongRays", SEGMENT_OUTS, eps=1e-3)], feeds), batch_axis=None)
    swapped = origins.jidx[::-1].copy()
    with pytest.raises(InputError, match=r"input 'ray_origins_jidx' names grid 1 at ray 0, but 'ray_origins_joffsets' "
                                         r"\[0, 4, 8\] puts that ray in grid 0 \(the batch has 2 grids\)"):
        net.run({**feeds, "ray_origins_jidx": swapped})
    with pytest.raises(InputError, match=r"input 'ray_directions_joffsets' \[0, 3, 8\] differs from "
                                         r"'ray_origins_joffsets' \[0, 4, 8\]"):
        net.run({**feeds, "ray_directions_joffsets": np.array([0, 3, 8], np.int64),
                 "ray_directions_jidx": np.repeat(np.arange(2, dtype=np.int32), [3, 5])})
    out = net.run(feeds)  # and the consistent rays still answer as the reference walk
    _check_segments(out, segments_along_rays(two_grids, origins, directions, eps=1e-3), origins, two_grids)


def test_a_grid_of_any_size_under_the_batch_axis_suggests_batch_axis_none(two_grids):
    """issue 25: a rays-only network over a grid of any size, compiled with the default batch axis, said
    "give it static shapes" without naming batch_axis=None; with batch_axis=None it runs as the reference."""
    from luisaml.errors import CompileError

    origins, directions = _rays(two_grids, 4, np.random.default_rng(6))
    feeds = bundle_feeds(two_grids, ray_origins=origins, ray_directions=directions)
    m = fvdb_model([ray_node("SegmentsAlongRays", SEGMENT_OUTS, eps=1e-3)], feeds)
    for vi in m.graph.input:
        if vi.name in ("grid_blob", "leaf_batch_indices"):
            vi.type.tensor_type.shape.dim[0].dim_param = f"rows of {vi.name}"
    with pytest.raises(CompileError, match=r"node 'segments' \(fvdb::SegmentsAlongRays\): grid_blob 'grid_blob' .* "
                                           r"follows the batch axis .*compile with batch_axis=None to bind a grid of "
                                           r"any size at run time"):
        luisaml.compile(m)
    out = luisaml.compile(m, batch_axis=None).run(feeds)
    _check_segments(out, segments_along_rays(two_grids, origins, directions, eps=1e-3), origins, two_grids)
