"""Host synchronisations of fVDB networks per run (issue 28 item 3, luisaml/counts.py): a new grid's blob
is uploaded in the run's command list, not waited for; a grid built as a stage of the network (laid
out on the device, its headers patched by the host) waits once, at the end; a network
whose every output is built by host steps launches nothing and waits for nothing; the rays' run-time
sized outputs, counted on the device, are repeated when they pass their capacity and equal the roomy run."""
import numpy as np
import pytest
from onnx import helper

import luisaml
from luisaml import counts
from luisaml.fvdb import GridBatch, JaggedTensor
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_grids  # noqa: F401 (registers the grid ops' schemas for inference)

from fvdb_reference import bundle_feeds, fvdb_model, fvdb_node, points_in_grid, ray_node
from test_grids_bound_at_run_time import DYNAMIC, _dynamic, _grid, _points

OUTS = ["grid_blob", "grid_byte_offsets", "voxel_sizes", "origins", "leaf_batch_indices", "batch_offsets",
        "list_indices"]
H = 1.0 / 128


def test_a_new_grid_each_run_waits_once():
    """The blob of a grid bound at run time changes every run: its upload joins the launches, one wait."""
    first = _grid(1, 400, 6.0)
    x = _points(first, 10, 0)
    m = _dynamic(fvdb_model([fvdb_node("PointsInGrid", "inside")], bundle_feeds(first, points=x),
                            batched=("points_jdata",)), DYNAMIC[:3], "rows")
    net = luisaml.compile(m)
    for k, gb in enumerate((first, _grid(2, 900, 9.0), _grid(3, 60, 3.0), first)):
        x = _points(gb, 64, k)
        with counts.measure() as c:
            out = net.run(bundle_feeds(gb, points=x))
        np.testing.assert_array_equal(out["inside"], points_in_grid(gb, JaggedTensor.from_list([x])))
        assert c.syncs == 1 and c.launches >= 1, c


def _sphere(n: int, radius: float, center: float, rng) -> np.ndarray:
    d = rng.standard_normal((n, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return ((center + radius * d + rng.uniform(-0.5, 0.5, (n, 3))) * H).astype(np.float32)


def test_a_grid_built_as_a_stage_waits_once_at_the_end():
    """Laid out on the device (operators/fvdb/build_layout.py): its blob and leaves counted totals, its
    headers patched by the host at the end; one wait a run, where the host's layout waited twice
    (tests/fvdb/test_build_layout.py runs both forms)."""
    rng = np.random.default_rng(0)
    n = 2048
    clouds = [_sphere(n, 30.0, 64.0, rng), _sphere(n, 20.0, 60.0, rng)]
    feeds = {"points": clouds[0], "joffsets": np.array([0, n], np.int64), "jidx": np.zeros(0, np.int32),
             "jlidx": np.zeros((0, 1), np.int32), "voxel_sizes": np.full((1, 3), H), "origins": np.zeros((1, 3))}
    node = helper.make_node("GridBatchFromPoints", list(feeds), [f"new_{o}" for o in OUTS], name="build",
                            domain=schema.DOMAIN)
    net = luisaml.compile(fvdb_model([node], feeds, constants=["jidx", "jlidx", "voxel_sizes", "origins"]),
                          batch_axis=None)
    hosts = [rb for rb in net.plan.readbacks if not rb.counted]
    assert len(hosts) == 1 and hosts[0].at_end and hosts[0].step is not None  # the headers' step, at the end
    assert net.plan.counted == ["new_leaf_batch_indices", "new_grid_blob"]
    for k, pts in enumerate(clouds + clouds[:1]):
        with counts.measure() as c:
            got = net.run({"points": pts, "joffsets": feeds["joffsets"]})
        want = GridBatch.from_points([pts], H, 0.0).bundle()
        for name, w in zip(OUTS, want):
            assert np.array_equal(got[f"new_{name}"], w), name
        runs = 1 + (net.launcher.reruns if k == 0 else 0)  # (a first run past the blob's first capacity: again)
        assert c.syncs == runs
        # the state (flag, totals), the step's words, every output that has elements: in that one wait
        assert c.downloads == (2 + sum(1 for v in got.values() if v.size)) * runs


def test_a_network_of_host_steps_alone_waits_for_nothing():
    """ConvGrid over a grid bound at run time, built on the host: the network launches no kernel."""
    gb = [GridBatch.from_ijk([_grid(s, 300, r).ijk.jdata], 0.1, 0.0) for s, r in ((1, 6.0), (2, 8.0))]
    feeds = [dict(zip(schema.BUNDLE, g.bundle())) for g in gb]
    growing = ("grid_blob", "leaf_batch_indices", "list_indices")
    from fvdb_reference import ELEM

    ins = [helper.make_tensor_value_info(n, ELEM[a.dtype], [f"{n} rows"] + list(a.shape[1:]) if n in growing
                                         else list(a.shape)) for n, a in feeds[0].items()]
    new = [f"new_{n}" for n in schema.BUNDLE]
    node = helper.make_node("ConvGrid", list(schema.BUNDLE), new, name="topo", domain=schema.DOMAIN,
                            kernel_size=[2, 2, 2], stride=[2, 2, 2])
    outs = [helper.make_tensor_value_info(n, ELEM[a.dtype], [None] * a.ndim) for n, a in zip(new, feeds[0].values())]
    model = helper.make_model(helper.make_graph([node], "g", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    net = luisaml.compile(model, batch_axis=None, grid_build="host")
    for f in feeds + feeds:
        with counts.measure() as c:
            out = net.run(f)
        assert int(out["new_batch_offsets"][-1]) > 0
        # (no kernel reads the new bundle: nothing uploaded, no buffer held; it uploaded every array before)
        assert c.syncs == 0 and c.launches == 0 and c.uploads == 0 and not net.pool.held


@pytest.fixture(scope="module")
def rays():
    """Two ray ops over a shell grid (a network of two counted nodes) and rays that hit it."""
    rng = np.random.default_rng(3)
    p = rng.normal(size=(20000, 3))
    shell = np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * 10).astype(np.int32) + 20
    gb = GridBatch.from_ijk([shell], voxel_sizes=[[0.5, 0.5, 0.5]], origins=[[0.0, 0.0, 0.0]])
    n = 64
    origins = np.tile(np.array([[10.0, 10.0, -10.0]], np.float32), (n, 1))
    aim = np.stack([rng.uniform(-4, 4, n), rng.uniform(-4, 4, n), np.zeros(n)], 1)
    feeds = [bundle_feeds(gb, ray_origins=JaggedTensor.from_list([origins]),
                          ray_directions=JaggedTensor.from_list([(aim * s + [0.0, 0.0, 20.0]).astype(np.float32)]))
             for s in (0.3, 3.0)]
    nodes = [ray_node("SegmentsAlongRays", ["segments", "seg_joffsets", "seg_jidx", "seg_jlidx"], eps=1e-3),
             ray_node("VoxelsAlongRays", ["voxels", "times", "vox_joffsets", "vox_jidx", "vox_jlidx"], eps=1e-3)]
    model = fvdb_model(nodes, feeds[0])
    return model, feeds


def test_rays_past_their_capacity_run_again_on_both_paths(rays, monkeypatch):
    import torch

    from luisaml import zero_copy

    model, feeds = rays
    roomy = luisaml.compile(model)
    want = [roomy.run(f) for f in feeds]
    assert roomy.launcher.reruns == 0 and int(want[0]["vox_joffsets"][-1]) > 1
    net = luisaml.compile(model)
    assert set(net.plan.counted) == {"segments", "seg_jidx", "voxels", "times", "vox_jidx"}
    for shared in (False, True):
        if shared:  # the DLPack path on the CPU backend (tests/fvdb/test_ray_outputs_device.py)
            monkeypatch.setattr(zero_copy, "SHARED_DEVICES", {"cuda": "cuda", "cpu": "cpu"})
        for f, w in zip(feeds, want):
            for name in net.plan.counted:  # room for one row: every run overflows once
                net.launcher.capacity[name] = 1
            before = net.launcher.reruns
            got = net.run({k: torch.from_numpy(np.array(v)) for k, v in f.items()} if shared else f)
            assert net.launcher.reruns == before + 1
            for name, value in w.items():
                g = got[name].numpy() if shared else got[name]
                assert g.dtype == value.dtype and g.shape == value.shape and g.tobytes() == value.tobytes(), name


def test_two_networks_building_the_same_grid_build_it_once():
    """The same ConvGrid of the same bytes in two networks (a detector's backbone and head): the second
    network's step takes the first's result, on the device neither a build nor a wait."""
    gb = GridBatch.from_ijk([_grid(5, 500, 7.0).ijk.jdata], 0.1, 0.0)
    feeds = dict(zip(schema.BUNDLE, gb.bundle()))
    from fvdb_reference import ELEM

    growing = ("grid_blob", "leaf_batch_indices", "list_indices")
    ins = [helper.make_tensor_value_info(n, ELEM[a.dtype], [f"{n} rows"] + list(a.shape[1:]) if n in growing
                                         else list(a.shape)) for n, a in feeds.items()]

    def model(prefix: str):
        new = [f"{prefix}_{n}" for n in schema.BUNDLE]
        node = helper.make_node("ConvGrid", list(schema.BUNDLE), new, name=f"{prefix}_topo", domain=schema.DOMAIN,
                                kernel_size=[3, 3, 3], stride=[2, 2, 2])
        outs = [helper.make_tensor_value_info(n, ELEM[a.dtype], [None] * a.ndim) for n, a in zip(new, feeds.values())]
        return helper.make_model(helper.make_graph([node], "g", ins, outs),
                                 opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])

    first, second = (luisaml.compile(model(p), batch_axis=None, grid_build="device") for p in ("a", "b"))
    with counts.measure() as c1:
        one = first.run(feeds)
    with counts.measure() as c2:
        two = second.run(feeds)
    build = next(iter(first.plan.host_steps.device.networks.values()))
    assert c1.launches > 0 and c1.syncs == 1 + build.launcher.reruns  # the build's end (and a first run repeated)
    assert c2.syncs == 0 and c2.launches == 0
    want = luisaml.compile(model("a"), batch_axis=None, grid_build="host").run(feeds)
    for n in schema.BUNDLE:
        assert np.array_equal(one[f"a_{n}"], want[f"a_{n}"]) and np.array_equal(two[f"b_{n}"], want[f"a_{n}"]), n
