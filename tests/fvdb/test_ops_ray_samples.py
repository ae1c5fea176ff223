"""fvdb.UniformRaySamples and RaysIntersectVoxels (operators/fvdb/ray.py over shaders/hdda.py) against the
numpy reference written from fVDB's SampleRaysUniform.cu and GridBatch.rays_intersect_voxels
(fvdb_reference.py): two grids from the project's builder and one from warp, rays from outside and inside,
per-ray [t_min, t_max], axis-aligned rays, rays that miss, an empty grid, a single voxel, NaN and infinite
rays and spans, cone angle 0 and > 0, include_end_segments and return_midpoints on and off.

How results are compared: integers (sample counts, jidx, jlidx, hit masks) exactly; times within 1e-5
relative (or 1e-5 absolute near t = 0). The reference walks in float64 and the kernel in float32, so a
decision that lies within ~5e-5 of its threshold (a grid point at a segment's end, a voxel crossed for ~0
time) may go either way: the reference marks such rays, they are left out of the comparison, and each
test asserts that most rays are compared. The samples' own grid (t_min + k * dt) is float32 arithmetic in
both, in the same order."""
import numpy as np
import pytest

import luisaml
from luisaml.errors import LuisamlError
from luisaml.fvdb import GridBatch, JaggedTensor

from fvdb_reference import (StalledRay, bundle_feeds, fvdb_model, ray_node, rays_intersect_voxels,
                            uniform_ray_samples)

RTOL = ATOL = 1e-5
# (name, attributes): the configurations every test runs, in one network
CONFIGS = [
    ("cut", dict(include_end_segments=1, return_midpoints=0)),
    ("cutmid", dict(include_end_segments=1, return_midpoints=1)),
    ("whole", dict(include_end_segments=0, return_midpoints=0)),
    ("wholemid", dict(include_end_segments=0, return_midpoints=1)),
    ("cone", dict(include_end_segments=1, return_midpoints=0, cone_angle=0.02)),
    ("conewhole", dict(include_end_segments=0, return_midpoints=1, cone_angle=0.05)),
]


def _outs(name):
    return [f"{name}_samples", f"{name}_joffsets", f"{name}_jidx", f"{name}_jlidx"]


def _nodes(step, eps, configs=CONFIGS):
    nodes = [ray_node("UniformRaySamples", _outs(name), step_size=step, eps=eps, **attrs) for name, attrs in configs]
    return nodes + [ray_node("RaysIntersectVoxels", ["hit"], eps=eps)]


def _run(gb, origins, directions, t_min, t_max, nodes):
    feeds = bundle_feeds(gb, ray_origins=origins, ray_directions=directions, t_min=t_min, t_max=t_max)
    return luisaml.compile(fvdb_model(nodes, feeds), batch_axis=None).run(feeds)


def _spans(origins: JaggedTensor, values):
    """t_min, t_max as JaggedTensors laid out as the rays."""
    return [JaggedTensor(np.asarray(v, np.float32), origins.joffsets, origins.jidx, origins.jlidx) for v in values]


def _check(out, name, gb, origins, directions, t_min, t_max, step, eps, attrs, min_sure=0.8):
    """Compare one configuration's outputs with the reference, ray by ray; return the rows compared."""
    ref, unsure = uniform_ray_samples(gb, origins, directions, t_min.jdata, t_max.jdata, step, eps=eps,
                                      cone_angle=attrs.get("cone_angle", 0.0),
                                      include_end_segments=bool(attrs["include_end_segments"]),
                                      return_midpoints=bool(attrs["return_midpoints"]))
    samples, joff, jidx, jlidx = (out[k] for k in _outs(name))
    R = len(ref)
    assert joff.shape == (R + 1,) and joff[0] == 0 and (np.diff(joff) >= 0).all()
    counts = np.diff(joff)
    np.testing.assert_array_equal(jidx, np.repeat(np.arange(R, dtype=np.int32), counts))
    b = origins.jidx if origins.jidx.size else np.zeros(R, np.int32)
    np.testing.assert_array_equal(jlidx, np.stack([b, np.arange(R) - origins.joffsets[b]], 1))
    assert samples.shape[1:] == (() if attrs["return_midpoints"] else (2,))
    sure = [r for r in range(R) if not unsure[r]]
    assert len(sure) >= min_sure * R, f"{name}: only {len(sure)} of {R} rays are away from ties"
    rows = 0
    for r in sure:
        got = samples[joff[r]:joff[r + 1]]
        want = np.array(ref[r], np.float64).reshape((-1,) + got.shape[1:])
        assert len(got) == len(want), f"{name}: ray {r} has {len(got)} samples, the reference {len(want)}"
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{name}: ray {r}")
        rows += len(got)
    return rows


def _check_all(out, gb, origins, directions, t_min, t_max, step, eps, configs=CONFIGS, min_sure=0.8):
    rows = {name: _check(out, name, gb, origins, directions, t_min, t_max, step, eps, attrs, min_sure)
            for name, attrs in configs}
    np.testing.assert_array_equal(out["hit"], rays_intersect_voxels(gb, origins, directions, eps=eps))
    return rows


def _random_rays(gb: GridBatch, n: int, rng):
    """Per grid: rays from a box around its voxels (a third inside it) towards random active voxels, some in
    any direction; per-ray spans: from 0, from before the origin, from partway; to infinity or partway."""
    from luisaml.fvdb.nanovdb_query import active_voxels

    origins, directions, lo_t, hi_t = [], [], [], []
    for b, g in enumerate(gb.grids):
        vox = active_voxels(g)
        h, o = gb.voxel_sizes[b], gb.origins[b]
        lo, hi = np.percentile(vox, 1, axis=0) - 4, np.percentile(vox, 99, axis=0) + 4  # (not the far voxels)
        start = rng.uniform(lo, hi, (n, 3))
        centre = (lo + hi) / 2
        outside = rng.random(n) > 0.3
        start[outside] = centre + (start[outside] - centre) * 3
        d = vox[rng.integers(0, len(vox), n)] + rng.uniform(-0.5, 0.5, (n, 3)) - start
        d[: n // 8] = rng.normal(size=(n // 8, 3))
        d /= np.linalg.norm(d, axis=1, keepdims=True)  # unit world directions: t is a world distance
        origins.append((start * h + o).astype(np.float32))
        directions.append(d.astype(np.float32))
        span = np.abs(hi - lo).max() * h.max() * 4
        t0 = np.where(rng.random(n) < 0.3, 0.0, rng.uniform(-0.2, 0.6, n) * span)
        t1 = np.where(rng.random(n) < 0.5, np.inf, t0 + rng.uniform(0.1, 1.0, n) * span)
        lo_t.append(t0)
        hi_t.append(t1)
    jo, jd = JaggedTensor.from_list(origins), JaggedTensor.from_list(directions)
    return (jo, jd, *_spans(jo, [np.concatenate(lo_t), np.concatenate(hi_t)]))


@pytest.fixture(scope="module")
def two_grids():
    rng = np.random.default_rng(21)
    p = rng.normal(size=(2000, 3))
    shell = np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * 10 + [-3, 5, -8]).astype(np.int32)
    far = np.array([[-4100, 3, 2], [4100, -5, 7]], np.int32)
    blobs = rng.integers(-9, 9, (300, 3)).astype(np.int32)
    return GridBatch.from_ijk([np.concatenate([shell, far]), blobs], voxel_sizes=[[0.5, 0.5, 0.5], [0.1, 0.2, 0.15]],
                              origins=[[1.0, -2.0, 0.5], [-0.3, 0.2, 0.05]])


def test_samples_and_hits_equal_the_reference_on_two_grids(two_grids):
    gb = two_grids
    rays = _random_rays(gb, 60, np.random.default_rng(1))
    step, eps = 0.1337, 1e-3  # eps: a ray grazing a voxel edge may touch a diagonal neighbour for ~0 time
    out = _run(gb, *rays, _nodes(step, eps))
    rows = _check_all(out, gb, *rays, step, eps)
    assert min(rows.values()) > 100, rows  # the rays do sample
    assert 10 < out["hit"].sum() < len(out["hit"])  # some hit, some miss


def test_a_grid_built_by_warp(warp_ref):
    rng = np.random.default_rng(3)
    p = rng.normal(size=(3000, 3))
    ijk = np.unique(np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * 30).astype(np.int32), axis=0)
    gb = GridBatch.from_buffer(warp_ref.volume_bytes(warp_ref.volume_from_ijk(ijk, voxel_size=0.1)))
    rays = _random_rays(gb, 60, rng)
    configs = [CONFIGS[0], CONFIGS[3], CONFIGS[4]]
    out = _run(gb, *rays, _nodes(0.05, 1e-3, configs))
    rows = _check_all(out, gb, *rays, 0.05, 1e-3, configs)
    assert min(rows.values()) > 50, rows


def test_axis_aligned_rays_with_eps_zero():
    """Rays along +x, -y, +z through voxel centres of a block with holes, starting outside it; the step and
    the spans keep grid points away from voxel faces, so every ray is compared."""
    ijk = np.array([[i, j, k] for i in range(-3, 5) for j in range(-2, 3) for k in range(0, 4)
                    if (i * 7 + j * 3 + k) % 5], np.int32)
    gb = GridBatch.from_ijk([ijk], voxel_sizes=[[0.5, 0.25, 1.0]], origins=[[0.1, -0.2, 0.3]])
    h, o = gb.voxel_sizes[0], gb.origins[0]
    origins, directions = [], []
    for v in ijk[::5]:
        for axis, sign in ((0, 1), (1, -1), (2, 1)):
            start = v.astype(np.float64).copy()
            start[axis] = -10 if sign > 0 else 10
            d = np.zeros(3)
            d[axis] = sign
            origins.append(start * h + o)
            directions.append(d)
    n = len(origins)
    jo = JaggedTensor.from_list([np.array(origins, np.float32)])
    jd = JaggedTensor.from_list([np.array(directions, np.float32)])
    t_min = np.where(np.arange(n) % 3 == 0, 0.0, 0.3 + 0.011 * np.arange(n))
    t_max = np.where(np.arange(n) % 4 == 0, 9.77, np.inf)
    spans = _spans(jo, [t_min, t_max])
    out = _run(gb, jo, jd, *spans, _nodes(0.1713, 0.0))
    rows = _check_all(out, gb, jo, jd, *spans, 0.1713, 0.0, min_sure=0.95)
    assert min(rows.values()) > 200, rows
    assert out["hit"].all()


def test_rays_that_miss_an_empty_grid_and_a_single_voxel():
    """By hand: voxel (2, -3, 5) of a grid of h = 0.25 spans [0.375, 0.625) in x (dual: [2, 3) * h + origin
    - h/2); a ray from x = 0 along +x crosses it for t in [0.375, 0.625]."""
    gb = GridBatch.from_ijk([np.zeros((0, 3), np.int32), np.array([[2, -3, 5]], np.int32)],
                            voxel_sizes=[[1.0, 1.0, 1.0], [0.25, 0.25, 0.25]], origins=[[0.0, 0.0, 0.0]] * 2)
    c = np.array([2, -3, 5]) * 0.25
    o1 = np.array([[0, c[1], c[2]], [0, c[1], c[2]], c + 5, [0, c[1], c[2]], c], np.float32)
    d1 = np.array([[1, 0, 0], [1, 0, 0], [1, 1, 1], [-1, 0, 0], [0, 0, 0]], np.float32)  # hit, hit, miss, away, zero
    jo = JaggedTensor.from_list([np.array([[0, 0, 0], [3, 3, 3]], np.float32), o1])
    jd = JaggedTensor.from_list([np.array([[1, 0, 0], [0, 1, 0]], np.float32), d1])
    spans = _spans(jo, [[0, 0, 0, 0.45, 0, 0, 0], [np.inf, np.inf, np.inf, np.inf, np.inf, np.inf, np.inf]])
    out = _run(gb, jo, jd, *spans, _nodes(0.1, 0.0))
    _check_all(out, gb, jo, jd, *spans, 0.1, 0.0, min_sure=0.8)  # ray 3 starts on a grid point: checked below
    np.testing.assert_array_equal(out["hit"], [False, False, True, True, False, False, False])
    # step 0.1 from t_min 0: grid points 0.4, 0.5, 0.6 cut [0.375, 0.625] (float32 sums of 0.1)
    cut = out["cut_samples"][out["cut_joffsets"][2]:out["cut_joffsets"][3]]
    np.testing.assert_allclose(cut, [[0.375, 0.4], [0.4, 0.5], [0.5, 0.6], [0.6, 0.625]], rtol=1e-6)
    whole = out["whole_samples"][out["whole_joffsets"][2]:out["whole_joffsets"][3]]
    np.testing.assert_allclose(whole, [[0.4, 0.5], [0.5, 0.6]], rtol=1e-6)  # midpoints 0.45, 0.55 inside
    # from t_min = 0.45 the grid is 0.45 + 0.1 k: the voxel is [0.45, 0.625] of the ray
    cut = out["cut_samples"][out["cut_joffsets"][3]:out["cut_joffsets"][4]]
    np.testing.assert_allclose(cut, [[0.45, 0.55], [0.55, 0.625]], rtol=1e-6)


def test_non_finite_rays_and_spans_have_no_samples_and_leave_the_others_alone(two_grids):
    gb = two_grids
    jo, jd, tmin, tmax = _random_rays(gb, 12, np.random.default_rng(9))
    o, d, t0, t1 = jo.jdata.copy(), jd.jdata.copy(), tmin.jdata.copy(), tmax.jdata.copy()
    o[0, 1], d[3, 0], d[5], o[14], d[20] = np.nan, np.inf, -np.inf, np.inf, [np.nan, 0.0, 1.0]
    t0[7], t1[9], t0[16], t0[18], t1[22] = np.nan, np.nan, -np.inf, np.inf, -np.inf
    bad = np.array([0, 3, 5, 7, 9, 14, 16, 18, 20, 22])
    broken = [JaggedTensor(a, jo.joffsets, jo.jidx, jo.jlidx) for a in (o, d, t0, t1)]
    configs = [CONFIGS[0], CONFIGS[2]]
    got = _run(gb, *broken, _nodes(0.1337, 1e-3, configs))
    clean = _run(gb, jo, jd, tmin, tmax, _nodes(0.1337, 1e-3, configs))
    good = np.setdiff1d(np.arange(len(o)), bad)
    for name, _ in configs:
        counts, want = np.diff(got[f"{name}_joffsets"]), np.diff(clean[f"{name}_joffsets"])
        assert (counts[bad] == 0).all()
        np.testing.assert_array_equal(counts[good], want[good])
        keep = np.repeat(np.isin(np.arange(len(counts)), good), want)
        np.testing.assert_array_equal(got[f"{name}_samples"], clean[f"{name}_samples"][keep])
    ref, _ = uniform_ray_samples(gb, broken[0], broken[1], t0, t1, 0.1337, eps=1e-3)
    assert all(len(ref[r]) == 0 for r in bad)  # the reference agrees
    hit_bad = np.array([0, 3, 5, 14, 20])  # NaN or infinite rays (the spans do not limit RaysIntersectVoxels)
    assert not got["hit"][hit_bad].any()
    np.testing.assert_array_equal(got["hit"][good], clean["hit"][good])


def test_a_step_that_no_longer_advances_time_is_a_run_time_error():
    gb = GridBatch.from_ijk([np.array([[0, 0, 0]], np.int32)], voxel_sizes=[[1.0, 1.0, 1.0]], origins=[[0.0, 0.0, 0.0]])
    # the ray reaches the voxel at t = 999999.5, where a float32 time moves by 0.0625: 1e-3 adds nothing
    jo = JaggedTensor.from_list([np.array([[-1e6, 0, 0]], np.float32)])
    jd = JaggedTensor.from_list([np.array([[1, 0, 0]], np.float32)])
    spans = _spans(jo, [[0.0], [np.inf]])
    with pytest.raises(StalledRay):
        uniform_ray_samples(gb, jo, jd, spans[0].jdata, spans[1].jdata, 1e-3)
    with pytest.raises(LuisamlError, match="no longer advances"):
        _run(gb, jo, jd, *spans, [ray_node("UniformRaySamples", _outs("s"), step_size=1e-3)])


def test_a_step_the_device_flushes_to_zero_is_refused_when_compiled():
    """issue 25: step_size=1e-42 (a float32 denormal, flushed to 0 on the device) returned no samples for rays
    that cross voxels; a step below float32's smallest normal number is now a CompileError naming the node and
    the attribute; a normal step too small to advance the rays' times is still the documented run-time error."""
    from luisaml.errors import CompileError

    gb = GridBatch.from_ijk([np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0]], np.int32)], voxel_sizes=[[1.0, 1.0, 1.0]],
                            origins=[[0.0, 0.0, 0.0]])
    jo = JaggedTensor.from_list([np.tile(np.array([[-5, 0, 0]], np.float32), (8, 1))])
    jd = JaggedTensor.from_list([np.tile(np.array([[1, 0, 0]], np.float32), (8, 1))])
    spans = _spans(jo, [np.zeros(8), np.full(8, np.inf)])
    assert rays_intersect_voxels(gb, jo, jd).all()  # every ray crosses voxels: no samples would be wrong
    for step in (1e-42, 1e-39, -1e-42):
        with pytest.raises(CompileError, match=r"node 's_samples' \(fvdb::UniformRaySamples\): step_size .*(smallest normal|> 0)"):
            _run(gb, jo, jd, *spans, [ray_node("UniformRaySamples", _outs("s"), step_size=step)])
    with pytest.raises(CompileError, match="node 's_samples' .*cone_angle .* smallest normal"):
        _run(gb, jo, jd, *spans, [ray_node("UniformRaySamples", _outs("s"), step_size=0.1, cone_angle=1e-40)])
    # a normal step too small for the rays' times: the documented run-time error, where the reference stalls
    with pytest.raises(StalledRay):
        uniform_ray_samples(gb, jo, jd, spans[0].jdata, spans[1].jdata, 1e-37)
    with pytest.raises(LuisamlError, match="no longer advances"):
        _run(gb, jo, jd, *spans, [ray_node("UniformRaySamples", _outs("s"), step_size=1e-37)])


@pytest.mark.parametrize("op", ["VoxelsAlongRays", "SegmentsAlongRays", "UniformRaySamples", "RaysIntersectVoxels"])
def test_eps_inf_or_nan_is_a_compile_error_naming_the_node_and_attribute(two_grids, op):
    """issue 25: eps=inf reached the kernel's code as a literal it could not compile ("Failed to compile
    luisa.func 'stages'"); eps must be a finite float32, checked when the node is compiled."""
    from luisaml.errors import CompileError
    from luisaml.opsets import fvdb_rays as ray_schema

    rays = _random_rays(two_grids, 3, np.random.default_rng(3))
    feeds = bundle_feeds(two_grids, ray_origins=rays[0], ray_directions=rays[1], t_min=rays[2], t_max=rays[3])
    outs = [f"o_{k}" for k in ray_schema.RAY_OUTPUTS[op]]
    extra = dict(step_size=0.5) if op == "UniformRaySamples" else {}
    for eps in (float("inf"), float("nan"), -float("inf")):  # (an ONNX float attribute is a float32: 1e39 is inf)
        with pytest.raises(CompileError, match=rf"node 'o_\w+' \(fvdb::{op}\): attribute eps must be a finite "
                                               rf"float32 >= 0, got {eps!r}"):
            m = fvdb_model([ray_node(op, outs, eps=eps, **extra)], feeds)
            luisaml.compile(m, batch_axis=None)


def test_schema_shapes_and_attribute_checks(two_grids):
    import onnx

    gb = two_grids
    rays = _random_rays(gb, 3, np.random.default_rng(2))
    feeds = bundle_feeds(gb, ray_origins=rays[0], ray_directions=rays[1], t_min=rays[2], t_max=rays[3])
    m = fvdb_model(_nodes(0.5, 0.0, CONFIGS[:2]), feeds)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in m.graph.output}
    R = len(rays[0].jdata)
    assert shapes["cut_samples"] == ["ray_hits", 2] and shapes["cutmid_samples"] == ["ray_hits"]
    assert shapes["cut_joffsets"] == [R + 1] and shapes["cut_jlidx"] == [R, 2] and shapes["hit"] == [R]
    assert {v.name: v.type.tensor_type.elem_type for v in m.graph.output}["hit"] == onnx.TensorProto.BOOL
    with pytest.raises(onnx.checker.ValidationError, match="step_size"):  # required, as in fVDB
        fvdb_model([ray_node("UniformRaySamples", _outs("s"))], feeds)
    for attrs, msg in ((dict(step_size=0.0), "step_size must be > 0"), (dict(step_size=0.1, cone_angle=-1.0),
                                                                          "cone_angle must be >= 0")):
        with pytest.raises(LuisamlError, match=msg):
            luisaml.compile(fvdb_model([ray_node("UniformRaySamples", _outs("s"), **attrs)], feeds), batch_axis=None)


def test_torch_functions_sample_as_the_reference_and_export_to_the_nodes(two_grids, tmp_path):
    import onnx
    import torch

    from luisaml.fvdb import torch_ops as F

    gb = two_grids
    jo, jd, tmin, tmax = _random_rays(gb, 30, np.random.default_rng(7))
    bundle = F.bundle_tensors(gb)
    attrs = dict(cone_angle=0.01, include_end_segments=False, return_midpoints=True)
    got = F.uniform_ray_samples(bundle, jo, jd, torch.from_numpy(tmin.jdata), torch.from_numpy(tmax.jdata), 0.2,
                                eps=1e-3, **attrs)
    hit = F.rays_intersect_voxels(bundle, jo, jd, eps=1e-3)
    out = {**dict(zip(_outs("s"), (t.numpy() for t in got))), "hit": hit.numpy()}
    attrs01 = {k: int(v) if isinstance(v, bool) else v for k, v in attrs.items()}
    _check_all(out, gb, jo, jd, tmin, tmax, 0.2, 1e-3, [("s", attrs01)])
    assert hit.dtype == torch.bool and got[0].dim() == 1

    o_parts, d_parts = F.jagged_tensors(jo), F.jagged_tensors(jd)

    class Sample(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, t in enumerate(bundle + o_parts[1:]):
                self.register_buffer(f"b{k}", t)

        def forward(self, o, d, t0, t1):
            b = [getattr(self, f"b{k}") for k in range(len(bundle) + 3)]
            rest = tuple(b[len(bundle):])
            s = F.uniform_ray_samples(b[:len(bundle)], (o,) + rest, (d,) + rest, t0, t1, 0.2, eps=1e-3, **attrs)
            return (*s, F.rays_intersect_voxels(b[:len(bundle)], (o,) + rest, (d,) + rest, eps=1e-3))

    path = tmp_path / "sample.onnx"
    names = _outs("s") + ["hit"]
    F.export_onnx(Sample(), tuple(torch.from_numpy(a) for a in (jo.jdata, jd.jdata, tmin.jdata, tmax.jdata)),
                  str(path), input_names=["o", "d", "t0", "t1"], output_names=names)
    assert [n.op_type for n in onnx.load(str(path)).graph.node if n.domain == "fvdb"] == ["UniformRaySamples",
                                                                                        "RaysIntersectVoxels"]
    exported = luisaml.compile(str(path), batch_axis=None).run(
        {"o": jo.jdata, "d": jd.jdata, "t0": tmin.jdata, "t1": tmax.jdata})
    for k in names:
        np.testing.assert_array_equal(exported[k], out[k], err_msg=k)
