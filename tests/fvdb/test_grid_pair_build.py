"""A GridBatchFromPoints and the ConvGrid of its grid, both steps of a network that builds its grids on the
device, build in ONE network run (luisaml/fvdb/host_steps.py, DeviceBuilds.run_pair: the points' node and
a second one that appends each point's voxel's ConvGrid candidates, operators/fvdb/topology.py
CONV_OF_POINTS): one host synchronisation and one run for both grids where there were two (luisaml.counts),
the host builder's bytes for both bundles, a blob past its capacity built again with room, never cut (the
points' node's end-of-run words copied before the ConvGrid's stages reuse the scratch: launch.py
`_end_sources`), and errors that name the points' node."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import luisaml
from luisaml import counts
from luisaml.errors import RunError
from luisaml.fvdb import host_steps
from luisaml.opsets import fvdb as schema

from fvdb_reference import ELEM
from test_radix_passes import clouds

FINE = [f"fine_{n}" for n in schema.BUNDLE]
NEW = [f"new_{n}" for n in schema.BUNDLE]


def pair_model():
    """GridBatchFromPoints over jdata of any count, and ConvGrid 3/2 of that grid: both bundles outputs."""
    ins = [helper.make_tensor_value_info("jdata", TensorProto.FLOAT, ["N", 3]),
           helper.make_tensor_value_info("joffsets", TensorProto.INT64, ["B1"]),
           helper.make_tensor_value_info("voxel_sizes", TensorProto.DOUBLE, ["B", 3]),
           helper.make_tensor_value_info("origins", TensorProto.DOUBLE, ["B", 3])]
    init = [helper.make_tensor("jidx", TensorProto.INT32, [0], []), helper.make_tensor("jlidx", TensorProto.INT32, [0, 1], [])]
    nodes = [helper.make_node("GridBatchFromPoints", ["jdata", "joffsets", "jidx", "jlidx", "voxel_sizes", "origins"], FINE,
                              name="points", domain=schema.DOMAIN),
             helper.make_node("ConvGrid", FINE, NEW, name="conv", domain=schema.DOMAIN, kernel_size=[3, 3, 3],
                              stride=[2, 2, 2])]
    dims = [1, 1, 2, 2, 1, 1, 1]
    types = ["uint8", "int64", "float64", "float64", "int32", "int64", "int32"]
    vis = [helper.make_tensor_value_info(n, ELEM[np.dtype(t)], [None] * d)
           for names in (FINE, NEW) for n, t, d in zip(names, types, dims)]
    return helper.make_model(helper.make_graph(nodes, "g", ins, vis, init),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


@pytest.fixture(scope="module")
def nets():
    m = pair_model()
    return luisaml.compile(m, batch_axis=None, grid_build="device"), luisaml.compile(m, batch_axis=None, grid_build="host")


def _forget(net) -> None:
    """The network's steps forget their last results (theirs and their ops' in the process): the next run builds."""
    for step in net.plan.host_steps.steps:
        step._last = None
        for latest in step._latest.values():
            latest.value = None


def _feeds(pts, offsets, h, o) -> dict:
    return {"jdata": pts, "joffsets": offsets, "voxel_sizes": h, "origins": o}


def _runs(monkeypatch) -> list:
    """The device builds' network runs from here on, as the names of their nodes."""
    runs = []
    real = host_steps.DeviceBuilds._run_net

    def counted(self, node, net, *args):
        runs.append([n.name for n, _ in net.plan.ops])
        return real(self, node, net, *args)
    monkeypatch.setattr(host_steps.DeviceBuilds, "_run_net", counted)
    return runs


@pytest.mark.parametrize("case", [c[0] for c in clouds()])
def test_both_grids_build_in_one_run_and_one_wait_with_the_host_builders_bytes(nets, case, monkeypatch):
    device, host = nets
    name, pts, offsets, h, o = next(c for c in clouds() if c[0] == case)
    feeds = _feeds(pts, offsets, h, o)
    want = host.run(feeds)
    device.run(feeds)  # (the bucket's first run builds its kernels)
    _forget(device)
    runs = _runs(monkeypatch)
    with counts.measure() as c:
        got = device.run(feeds)
    assert runs == [["points", "conv"]], runs  # one network run, both nodes in it
    assert c.syncs == 1, c  # one wait for both grids (two before: a wait a build)
    for n in FINE + NEW:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, (name, n)
        np.testing.assert_array_equal(got[n], want[n], err_msg=f"{name}: {n}")


def test_a_blob_past_its_capacity_runs_again_with_room_and_is_never_cut(nets, monkeypatch):
    """A first cloud of one leaf settles the blobs' capacities low; a cloud of many leaves and nodes in the same
    bucket (1,536 points, which no other test here takes) passes them: the pair's run is repeated
    (launcher.reruns), both grids whole."""
    device, host = nets
    rng = np.random.default_rng(5)
    h, o = np.full((1, 3), 0.5), np.zeros((1, 3))
    small = rng.uniform(0.3, 3.7, (1300, 3)).astype(np.float32)  # one leaf, one node of each level
    spread = rng.uniform(-100, 100, (1500, 3)).astype(np.float32)  # ~1,500 leaves, 8 upper nodes about the origin
    runs = _runs(monkeypatch)
    reruns = []
    for pts in (small, spread):
        _forget(device)
        feeds = _feeds(pts, np.array([0, len(pts)], np.int64), h, o)
        got = device.run(feeds)
        want = host.run(feeds)
        for n in FINE + NEW:
            np.testing.assert_array_equal(got[n], want[n], err_msg=n)
        pair = [net for key, net in device.plan.host_steps.device.networks.items()
                if isinstance(key[0], tuple) and key[1] == 1536]
        assert len(pair) == 1
        reruns.append(pair[0].launcher.reruns)
    assert reruns[1] > reruns[0], reruns
    assert runs == [["points", "conv"]] * 2, runs


def test_a_point_off_the_int32_voxels_is_an_error_naming_the_points_node(nets):
    device, _ = nets
    _forget(device)
    pts = np.zeros((10, 3), np.float32)
    pts[3] = (1e30, 0, 0)
    with pytest.raises(RunError, match="node 'points'.*not finite or do not fit int32"):
        device.run(_feeds(pts, np.array([0, 10], np.int64), np.full((1, 3), 0.5), np.zeros((1, 3))))


def test_an_error_of_the_convgrid_alone_names_the_convgrid_node_as_its_build_apart_does(nets, monkeypatch):
    """A point at voxel -2^31 fits int32 (the points' grid builds), but its ConvGrid 3/2 taps reach c + 1 - 2,
    past int32: only the pair's ConvGrid node flags it. Its error names the model's ConvGrid node and op, word
    for word as the ConvGrid built apart (PAIRS off) says."""
    device, _ = nets
    pts = np.zeros((10, 3), np.float32)
    pts[3] = (-2.0**31, 0, 0)
    feeds = _feeds(pts, np.array([0, 10], np.int64), np.full((1, 3), 1.0), np.zeros((1, 3)))
    said = []
    for pairs in (True, False):
        monkeypatch.setattr(host_steps.DeviceBuilds, "PAIRS", pairs)
        _forget(device)
        with pytest.raises(RunError) as e:
            device.run(feeds)
        said.append(str(e.value))
    assert said[0] == said[1], said
    assert said[0].startswith("node 'conv' (fvdb::ConvGrid): "), said


def test_a_conv_of_points_past_the_keys_a_build_holds_builds_the_grids_apart(nets, monkeypatch):
    """The pair's ConvGrid takes 8 keys a point (3/2: 2 candidates an axis) where a build of the grid's
    voxels takes 8 a voxel: past MAX_KEYS the two build apart, as before, with the same bytes."""
    from luisaml.operators.fvdb.topology import DeviceGridBuild

    device, host = nets
    name, pts, offsets, h, o = clouds()[1]
    feeds = _feeds(pts, offsets, h, o)
    monkeypatch.setattr(DeviceGridBuild, "MAX_KEYS", 4 * 1024)  # (the 1,024-point bucket's conv: 8,192 keys)
    _forget(device)
    runs = _runs(monkeypatch)
    got = device.run(feeds)
    want = host.run(feeds)
    assert runs[0] == ["points"] and ["points", "conv"] not in runs, runs
    for n in FINE + NEW:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)


def test_the_passes_called_idle_for_the_pair_are_idle_in_both_grids(nets):
    """radix_passes.idle_passes of a GridBatchFromPoints with CONV_OF_POINTS: its ConvGrid's (the points' bound
    through the candidates), and with both=True the passes idle in both grids, which the pair's network runs
    (each bound against the host builder's grids, their leaves read with numpy)."""
    from luisaml.fvdb import radix_passes as RP
    from test_radix_passes import true_idle

    _, host = nets
    conv = {"conv_kernel_size": [3, 3, 3], "conv_stride": [2, 2, 2]}
    seen = set()
    for name, pts, offsets, h, o in clouds():
        got = host.run(_feeds(pts, offsets, h, o))
        fine, coarse = (true_idle([got[n] for n in names]) for names in (FINE, NEW))
        arrays = [pts, offsets, np.zeros(0, np.int32), np.zeros((0, 1), np.int32), h, o]
        alone = RP.idle_passes("GridBatchFromPoints", conv, arrays, False)
        both = RP.idle_passes("GridBatchFromPoints", conv, arrays, False, True)
        assert alone <= coarse and both <= fine & coarse and both == alone & RP.idle_passes(
            "GridBatchFromPoints", {}, arrays, False), name
        seen.add(both)
    assert len(seen) >= 2 and frozenset() not in seen


def test_with_pairs_off_the_grids_build_apart_in_two_runs_and_two_waits(nets, monkeypatch):
    """DeviceBuilds.PAIRS = False (the A/B switch): the structure before, a run and a wait a grid, the same bytes."""
    device, host = nets
    name, pts, offsets, h, o = clouds()[0]
    feeds = _feeds(pts, offsets, h, o)
    monkeypatch.setattr(host_steps.DeviceBuilds, "PAIRS", False)
    device.run(feeds)  # (the separate builds' buckets built)
    _forget(device)
    runs = _runs(monkeypatch)
    with counts.measure() as c:
        got = device.run(feeds)
    want = host.run(feeds)
    assert runs == [["points"], ["conv"]] and c.syncs == 2, (runs, c)
    for n in FINE + NEW:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)


def test_candidates_past_the_conv_room_run_the_pair_again_with_every_candidates_room(nets, monkeypatch):
    """The pair's ConvGrid holds half of every candidate's keys (4 a point for 3/2) until a run has more: points
    whose voxels are odd along every axis have 8 candidates each, so that run raises KeysPastRoom at its end and
    the pair runs again with room for all (a second run and wait in that frame only), the host builder's bytes;
    the next frame takes one run."""
    device, host = nets
    rng = np.random.default_rng(9)
    h, o = np.full((1, 3), 0.5), np.zeros((1, 3))
    idx = rng.permutation(20 * 20 * 20)[:2100]
    odd = np.stack([idx // 400, idx // 20 % 20, idx % 20], 1) * 2 + 1  # distinct voxels, odd along every axis
    pts = (odd * 0.5).astype(np.float32)  # (each at its voxel's centre: round(p / h) = its odd ijk)
    assert len(np.unique(odd, axis=0)) == 2100 and (odd % 2 == 1).all()
    runs = _runs(monkeypatch)
    for k in range(2):
        _forget(device)
        feeds = _feeds(pts[:2100 - k], np.array([0, 2100 - k], np.int64), h, o)
        with counts.measure() as c:
            got = device.run(feeds)
        want = host.run(feeds)
        for n in FINE + NEW:
            np.testing.assert_array_equal(got[n], want[n], err_msg=n)
        assert (runs, c.syncs) == ([["points", "conv"]] * 2, 2) if k == 0 else ([["points", "conv"]] * 3, 1), (runs, c)
    rooms = [net.plan.ops[1][0].attrs.get("conv_keys") for key, net in device.plan.host_steps.device.networks.items()
             if isinstance(key[0], tuple) and key[1] == 2560]
    # (half of 8 x 2,560, the quarter-step bucket of 2,100 points; then the step above 16,800 keys, every one's)
    assert sorted(rooms, key=str) == [10240, None], rooms


def _voxel_points(odd: int, even: int, seed: int) -> np.ndarray:
    """Points at the centres of distinct voxels (voxel size 0.5): `odd` odd along every axis (8 ConvGrid 3/2
    candidates each), then `even` even along every axis (1 each)."""
    idx = np.random.default_rng(seed).permutation(20 * 20 * 20)[:odd + even]
    ijk = np.stack([idx // 400, idx // 20 % 20, idx % 20], 1) * 2
    ijk[:odd] += 1
    return (ijk * 0.5).astype(np.float32)


def test_a_room_grown_past_the_half_is_a_quarter_step_above_the_keys_and_shrinks_back(nets, monkeypatch):
    """Past the half room the pair runs again at the quarter step above the keys its run counted (not every
    candidate's), keeps it while frames need it, and goes back to the half room after a frame that fits it
    again: 3,000 points (the 3,072-point bucket: half room 12,288 keys), 1,600 odd and 1,400 even voxels,
    14,200 keys -> room 14,336 (every: 24,576); all even -> 3,000 keys, then the half room's network."""
    device, host = nets
    h, o = np.full((1, 3), 0.5), np.zeros((1, 3))
    rooms = []
    real = host_steps.DeviceBuilds._run_net

    def seen(self, node, net, *args):
        rooms.append(net.plan.ops[1][0].attrs.get("conv_keys") if len(net.plan.ops) == 2 else "apart")
        return real(self, node, net, *args)
    monkeypatch.setattr(host_steps.DeviceBuilds, "_run_net", seen)
    frames = [(_voxel_points(1600, 1400, 4), [12288, 14336]), (_voxel_points(1600, 1400, 5)[:2999], [14336]),
              (_voxel_points(0, 3000, 6), [14336]), (_voxel_points(0, 3000, 7)[:2999], [12288])]
    for k, (pts, want_rooms) in enumerate(frames):
        _forget(device)
        rooms.clear()
        feeds = _feeds(pts, np.array([0, len(pts)], np.int64), h, o)
        with counts.measure() as c:
            got = device.run(feeds)
        want = host.run(feeds)
        for n in FINE + NEW:
            np.testing.assert_array_equal(got[n], want[n], err_msg=f"frame {k}: {n}")
        assert (rooms, c.syncs) == (want_rooms, len(want_rooms)), (k, rooms, c)
