"""A device grid build leaves out the radix passes the host knows do nothing (luisaml/fvdb/radix_passes.py):
the passes it calls idle are idle in the grid the host's builder makes of the same input (its leaves'
root tiles and grids, read with numpy), over clouds in one root tile, across tiles, across 256 tiles
(a pass of a tile's second byte), far from the origin, in several grids; and the device builds that
leave them out launch fewer kernels and give the host builder's bundle, byte for byte, for points
(GridBatchFromPoints and its nearest voxels) and for the ConvGrid of the grid a step built."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import luisaml
from luisaml import counts
from luisaml.fvdb import layout as L
from luisaml.fvdb import radix_passes as RP
from luisaml.fvdb import topology as T
from luisaml.fvdb.nanovdb import record_field, records
from luisaml.opsets import fvdb as schema

from fvdb_reference import ELEM
from test_grid_build_device import host_bundle

FINE = [f"fine_{n}" for n in schema.BUNDLE]
NEW = [f"new_{n}" for n in schema.BUNDLE]


def clouds() -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(name, points [N, 3] float32, joffsets, voxel sizes [B, 3], origins [B, 3])."""
    rng = np.random.default_rng(3)
    one = lambda n, c, s: (rng.normal(0, s, (n, 3)) + c).astype(np.float32)  # noqa: E731
    h1, o1 = np.full((1, 3), 0.5), np.zeros((1, 3))
    out = [("inside one tile", one(400, (100.0, 100.0, 100.0), 20.0), h1, o1),
           ("across the origin", one(400, 0.0, 30.0), h1, o1),  # two tiles an axis
           ("far, across 300 tiles in x", np.concatenate([one(200, (-3e5, 0, 0), 5.0), one(200, (3e5, 0, 0), 5.0)]),
            h1, o1),
           ("far from the origin", one(300, (8e6, -8e6, 4e6), 3.0), h1, o1)]
    pts = np.concatenate([one(300, 0.0, 5.0), one(200, (2500.0, 0, 0), 5.0)])
    out.append(("two grids", pts, np.array([[0.5, 0.5, 0.5], [0.25, 0.5, 1.0]]), np.array([[0, 0, 0], [1.0, -2.0, 0.5]])))
    offsets = [np.array([0, len(p)] if len(h) == 1 else [0, 300, len(p)], np.int64) for _, p, h, _ in out]
    return [(name, p, off, h, o) for (name, p, h, o), off in zip(out, offsets)]


def true_idle(bundle) -> frozenset[int]:
    """The passes idle in a built bundle: its leaves' root tiles' spans per axis and its grids'."""
    blob, offsets, counts_ = bundle[0], bundle[1], np.diff(bundle[5])
    from luisaml.fvdb.nanovdb_read import read_built_grids

    grids = {g.offset: g for g in read_built_grids(blob)}
    tiles = np.concatenate([record_field(records(g.buffer, g.leaf_offset, g.leaf_count, L.LEAF_NODE_SIZE),
                                         L.LEAF_OFF_BBOX_MIN, np.dtype("<i4"), 3).astype(np.int64) >> 12
                            for g in (grids[int(o)] for o in offsets) if g.leaf_count])
    span = tiles.max(0) - tiles.min(0)
    used = np.flatnonzero(counts_)
    return RP._idle((int(span[2]), int(span[1]), int(span[0]), int(used[-1] - used[0])))


def test_passes_and_key_bits_are_the_shaders():
    from luisaml.shaders import grid_layout as G

    assert (RP.PASSES, RP.SLOT_BITS) == (G.PASSES, G.SLOT_BITS)
    # the widest key: 27 slot bits, 20 bits a tile axis (int32 voxels >> 12), 10 of the grid (1,024 grids)
    assert RP.passes((2 ** 20 - 1,) * 3 + (1023,)) == G.PASSES and 32 * G.KEY_WORDS >= 27 + 3 * 20 + 10
    assert RP.passes((0, 0, 0, 0)) == 4 and RP.passes((1, 1, 1, 0)) == 4 and RP.passes((1, 1, 1, 1)) == 4
    assert RP.passes((1, 1, 3, 1)) == 4 and RP.passes((1, 1, 4, 1)) == 5  # (32 bits, then 33)
    assert RP._idle((0, 0, 0, 0)) == set(range(4, G.PASSES))


@pytest.mark.parametrize("op_type", ["GridBatchFromPoints", "GridBatchFromNearestVoxelsToPoints", "GridBatchFromIJK"])
def test_the_passes_called_idle_are_idle_in_the_grid_built(op_type):
    seen = set()
    for name, pts, offsets, h, o in clouds():
        jdata = np.floor(pts.astype(np.float64) / h[0]).astype(np.int32) if op_type == "GridBatchFromIJK" else pts
        arrays = [jdata, offsets, np.zeros(0, np.int32), np.zeros((0, 1), np.int32), h, o]
        idle = RP.idle_passes(op_type, {}, arrays, False)
        assert idle <= true_idle(host_bundle(op_type, jdata, offsets, h, o)), name
        seen.add(idle)
        if name in ("inside one tile", "across the origin"):  # (27 + 0 and 27 + 3 bits)
            assert idle == set(range(4, RP.PASSES))
        if name == "far, across 300 tiles in x":  # (27 + 1 + 1 + 9 or 10 bits: a fifth byte)
            assert idle == set(range(5, RP.PASSES))
        if name == "two grids":  # (27 + 1 + 1 + 1 + 1 bits)
            assert idle == set(range(4, RP.PASSES))
    assert len(seen) >= 2
    # no bound: nothing left out
    bad = np.array([[0, 0, np.nan]], np.float32)
    if op_type != "GridBatchFromIJK":
        assert RP.idle_passes(op_type, {}, [bad, np.array([0, 1], np.int64), None, None, None, None], False) == set()


def points_model(op_type: str, then_conv: bool):
    """op_type over jdata of any count (its bundle the outputs), and ConvGrid 3/2 of that grid."""
    elem = TensorProto.INT32 if op_type == "GridBatchFromIJK" else TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("jdata", elem, ["N", 3]),
           helper.make_tensor_value_info("joffsets", TensorProto.INT64, ["B1"]),
           helper.make_tensor_value_info("voxel_sizes", TensorProto.DOUBLE, ["B", 3]),
           helper.make_tensor_value_info("origins", TensorProto.DOUBLE, ["B", 3])]
    init = [helper.make_tensor("jidx", TensorProto.INT32, [0], []), helper.make_tensor("jlidx", TensorProto.INT32, [0, 1], [])]
    nodes = [helper.make_node(op_type, ["jdata", "joffsets", "jidx", "jlidx", "voxel_sizes", "origins"], FINE,
                              name="build", domain=schema.DOMAIN)]
    outs = FINE
    if then_conv:
        nodes.append(helper.make_node("ConvGrid", FINE, NEW, name="conv", domain=schema.DOMAIN, kernel_size=[3, 3, 3],
                                      stride=[2, 2, 2]))
        outs = NEW
    dims = [1, 1, 2, 2, 1, 1, 1]
    types = ["uint8", "int64", "float64", "float64", "int32", "int64", "int32"]
    vis = [helper.make_tensor_value_info(n, ELEM[np.dtype(t)], [None] * d) for n, t, d in zip(outs, types, dims)]
    return helper.make_model(helper.make_graph(nodes, "g", ins, vis, init),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


@pytest.mark.parametrize("op_type,then_conv", [("GridBatchFromPoints", False), ("GridBatchFromNearestVoxelsToPoints", False),
                                               ("GridBatchFromPoints", True)])
def test_device_builds_leave_the_idle_passes_out_and_build_the_same_bytes(op_type, then_conv, monkeypatch):
    m = points_model(op_type, then_conv)
    device = luisaml.compile(m, batch_axis=None, grid_build="device")
    host = luisaml.compile(m, batch_axis=None, grid_build="host")
    outs = NEW if then_conv else FINE
    for name, pts, offsets, h, o in clouds():
        feeds = {"jdata": pts, "joffsets": offsets, "voxel_sizes": h, "origins": o}
        want = host.run(feeds)
        if not then_conv:  # (the host network's own builder against the library's)
            for a, b in zip([want[n] for n in outs], host_bundle(op_type, pts, offsets, h, o)):
                np.testing.assert_array_equal(a, b)
        device.run(feeds)  # (a new capacity's first run launches every stage: it builds them)
        launches = []
        for idle in (True, False):
            if not idle:  # every pass launched, as before
                monkeypatch.setattr(RP, "idle_passes", lambda *a: frozenset())
            for step in device.plan.host_steps.steps:  # (the same bytes built again, not given back)
                step._last = None
                for latest in step._latest.values():
                    latest.value = None
            with counts.measure() as c:
                got = device.run(feeds)
            launches.append(c.launches)
            for n in outs:
                assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, (name, n)
                np.testing.assert_array_equal(got[n], want[n], err_msg=f"{name}: {n}")
        monkeypatch.undo()
        assert launches[0] < launches[1], name


def _bound_of_every_point(arrays):
    """_from_points' bound as first written: every point's float64 voxel position, then min and max."""
    jdata, offsets = np.asarray(arrays[0]), np.asarray(arrays[1]).reshape(-1)
    grids = len(offsets) - 1
    h = T.per_grid(1.0 if arrays[4] is None else arrays[4], grids, "voxel_sizes", True)
    o = T.per_grid(0.0 if arrays[5] is None else arrays[5], grids, "origins", False)
    grid_of = np.repeat(np.arange(grids), np.diff(offsets))
    with np.errstate(all="ignore"):
        v = (jdata.astype(np.float64) - o[grid_of]) / h[grid_of]
        lo, hi = v.min(0), v.max(0)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()) or max(np.abs(lo).max(), np.abs(hi).max()) > RP._LIMIT:
        return None
    slack = 2 + np.maximum(np.abs(lo), np.abs(hi)) * 2.0 ** -20
    return np.floor(lo - slack).astype(np.int64), np.ceil(hi + slack).astype(np.int64), grids


@pytest.mark.parametrize("grids", [1, 3, 40])  # (40: past _FEW_GRIDS, one reduceat)
def test_the_points_bound_is_every_points_float64_bound(grids):
    """The bound from each grid's extreme points (radix_passes._from_points) is, bit for bit, the bound of
    every point's float64 position: clouds far and near, ragged grids, empty grids, a NaN or an infinity
    among the points (no bound), more points than a row of the wide view and fewer."""
    rng = np.random.default_rng(grids)
    for trial in range(60):
        n = int(rng.integers(1, 700)) if trial % 3 else int(rng.integers(1, 40))
        cuts = np.sort(rng.integers(0, n + 1, grids - 1))
        offsets = np.concatenate([[0], cuts, [n]]).astype(np.int64)
        scale = 10.0 ** int(rng.integers(-2, 7))
        pts = (rng.standard_normal((n, 3)) * scale + rng.standard_normal(3) * 3 * scale).astype(np.float32)
        if trial % 5 == 0:
            pts[rng.integers(0, n), rng.integers(0, 3)] = [np.nan, np.inf, -np.inf][trial % 3]
        arrays = [pts, offsets, None, None, rng.uniform(0.01, 3.0, (grids, 3)), rng.standard_normal((grids, 3)) * scale]
        want, got = _bound_of_every_point(arrays), RP._from_points("GridBatchFromPoints", arrays)
        assert (want is None) == (got is None), trial
        if want is not None:
            for a, b in zip(want, got):
                np.testing.assert_array_equal(a, b, err_msg=str(trial))


def test_a_users_grid_is_walked_once_its_idle_passes_left_out_and_the_walk_forgotten(monkeypatch):
    """A topology op built on the device over a grid the user binds (writeable arrays: never remembered as
    checked) walks it once before the build (DeviceBuilds._build), bounds the radix passes from its leaves
    and leaves the idle ones out (fewer launches, the host builder's bytes); the walk is known to the
    build's network alone, during the build: after the run the arrays are unknown again, so the user's
    write of a byte into the same arrays is walked and raises (a stale walk would have let it through)."""
    from luisaml.errors import InputError
    from luisaml.fvdb import GridBatch, checked
    from luisaml.operators.fvdb import common

    from test_topology_device import op_model

    rng = np.random.default_rng(7)
    grid = GridBatch.from_ijk([rng.integers(-40, 40, (600, 3)).astype(np.int32) + 300], 0.5, 0.0)
    attrs = {"kernel_size": [3, 3, 3], "stride": [1, 1, 1]}
    model = op_model("ConvGrid", attrs, grid, False)
    device = luisaml.compile(model, batch_axis=None, grid_build="device")
    want = luisaml.compile(model, batch_axis=None, grid_build="host").run(dict(zip(schema.BUNDLE, grid.bundle())))
    walks = []
    real = common.read_grids
    monkeypatch.setattr(common, "read_grids", lambda blob, **k: walks.append(1) or real(blob, **k))
    launches = []
    for idle in (True, False):
        if not idle:
            monkeypatch.setattr(RP, "idle_passes", lambda *a: frozenset())
        bundle = [np.array(a) for a in grid.bundle()]  # (writeable: the user's; new arrays, so no cache answers)
        device.run(dict(zip(schema.BUNDLE, bundle)))  # (a first run of a network launches every stage)
        for step in device.plan.host_steps.steps:
            step._last = None
            for latest in step._latest.values():
                latest.value = None
        walks.clear()
        with counts.measure() as c:
            got = device.run(dict(zip(schema.BUNDLE, bundle)))
        launches.append(c.launches)
        for n in NEW:
            np.testing.assert_array_equal(got[n], want[n], err_msg=n)
        assert checked.known(bundle[:6]) is None and not checked._WALKED
        if idle:
            assert len(walks) == 1  # (the build's walk; its network's metadata took it)
    assert launches[0] < launches[1], launches
    monkeypatch.undo()
    pos = L.GRID_DATA_SIZE + L.TREE_OFF_VOXEL_COUNT  # (the user writes into the same array: one voxel more)
    bundle[0][pos:pos + 8] = np.frombuffer(np.uint64(int(bundle[0][pos:pos + 8].view(np.uint64)[0]) + 1).tobytes(), np.uint8)
    with pytest.raises(InputError, match="voxel count"):
        device.run(dict(zip(schema.BUNDLE, bundle)))


def _forget_steps(net) -> None:
    """The network's host steps forget their last results: the next run builds again."""
    for step in net.plan.host_steps.steps:
        step._last = None
        for latest in step._latest.values():
            latest.value = None


def _leaf_keys(bundle) -> tuple[np.ndarray, int]:
    """Each leaf's sort key of a built bundle as the device packs it (grid_layout.PASSES), written here
    from the leaves' origins with numpy: [L, KEY_WORDS] uint32, and the passes it takes."""
    from luisaml.fvdb.nanovdb_read import read_built_grids
    from luisaml.shaders import grid_layout as G

    grids = {g.offset: g for g in read_built_grids(bundle[0])}
    rows = [np.column_stack([np.full(g.leaf_count, b), record_field(
        records(g.buffer, g.leaf_offset, g.leaf_count, L.LEAF_NODE_SIZE), L.LEAF_OFF_BBOX_MIN, np.dtype("<i4"), 3)])
        for b, g in enumerate(grids[int(o)] for o in bundle[1]) if g.leaf_count]
    leaf = np.concatenate(rows).astype(np.int64)
    li, lj, lk = (leaf[:, 1 + a] >> 3 for a in range(3))
    slot = ((((li >> 4) & 31) << 10 | ((lj >> 4) & 31) << 5 | ((lk >> 4) & 31)) << 12
            | (li & 15) << 8 | (lj & 15) << 4 | (lk & 15))
    key, at = slot.astype(object), G.SLOT_BITS  # (Python ints: up to 97 bits)
    for v in (lk >> 9, lj >> 9, li >> 9, leaf[:, 0]):
        v = v - v.min()
        key = key + (v.astype(object) << at)
        at += int(v.max()).bit_length()
    words = np.array([[(int(k) >> (32 * w)) & 0xFFFFFFFF for w in range(G.KEY_WORDS)] for k in key], np.uint32)
    return words, -(-at // 8)


@pytest.mark.parametrize("case", ["every pass", "no pass"])
def test_keys_whose_digits_vary_in_every_pass_or_in_none_build_the_host_bytes(case):
    """Clouds at the key's two ends: spread over +-10^9 voxels an axis in two grids (a key of 27 + 3 x 19
    + 1 bits: 11 passes, each byte of the keys taking several values, so each pass moves leaves; a field
    straddling the key's words, cut, fails it), and points inside one leaf (one key: every pass's digit
    the same). The device's bytes are the host builder's; the host's bound leaves out exactly the passes
    past the key."""
    from luisaml.shaders import grid_layout as G

    rng = np.random.default_rng(11)
    if case == "every pass":
        # grid 0: every point's i, j and k one of 3 spread values (each field decides the order of leaves
        # equal in the fields above it); grid 1: one i and j, k spread (tile k decides, its bits in two
        # of the key's words); shuffled: the points' order is not the leaves' (47 upper nodes: 13 MB)
        one = np.stack([a.reshape(-1) for a in np.meshgrid(*rng.uniform(-1.0e9, 1.0e9, (3, 3)), indexing="ij")], 1)
        line = np.column_stack([np.full((20, 2), 5.0e8), rng.uniform(-1.0e9, 1.0e9, 20)])
        pts = np.concatenate([rng.permutation(one), line]).astype(np.float32)
        offsets = np.array([0, 27, 47], np.int64)
    else:
        pts = (rng.uniform(0, 3.4, (50, 3)) + 8 * 1000).astype(np.float32)  # (voxels 8000..8003: one leaf)
        offsets = np.array([0, 50], np.int64)
    h, o = np.ones((len(offsets) - 1, 3)), np.zeros((len(offsets) - 1, 3))
    want = host_bundle("GridBatchFromPoints", pts, offsets, h, o)
    words, passes = _leaf_keys(want)
    digits = [len(np.unique((words[:, p // 4] >> (8 * (p % 4))) & 255)) for p in range(passes)]
    if case == "every pass":
        assert passes == 11 and min(digits) > 1, digits
    else:
        assert len(words) == 1 and passes == 4 and max(digits) == 1
    arrays = [pts, offsets, None, None, h, o]
    assert RP.idle_passes("GridBatchFromPoints", {}, arrays, False) == set(range(passes, G.PASSES))
    net = luisaml.compile(points_model("GridBatchFromPoints", False), batch_axis=None, grid_build="device")
    feeds = {"jdata": pts, "joffsets": offsets, "voxel_sizes": h, "origins": o}
    for _ in range(2):  # (the first run launches every pass; the second leaves the idle ones out)
        got = net.run(feeds)
        _forget_steps(net)
        for n, w in zip(FINE, want):
            np.testing.assert_array_equal(got[n], w, err_msg=n)


def test_a_build_across_the_origin_launches_4_passes_and_one_write_stage():
    """A LiDAR-like cloud (two root tiles an axis: a key of 27 + 3 bits) sorts in 4 passes, each its
    prefix sum's up sweep and its scatter (the first pass's histograms are counted by the leaf stage, a
    later pass's by the scatter before it: no histograms stage): no top-level stage (the scatter sums the
    last level's words itself), no "add chunk bases" stage, no stage of the pass counters; the leaf ids'
    sum is its up stage alone (the tile ranges folded in), then one stage writes the leaves' keys, masks
    and sort keys; the voxel, lower and upper ids' sum its up stage alone; the blob's writers one stage;
    the nodes' ranges and boxes one; the grid's summary and layout one. 23 launches at this capacity, 3 a
    pass, where the same build took 36 with histograms and a top-level stage to each pass, a top level to
    each sum and leaf keys, leaf masks, tile ranges and sort keys four stages (88 with 7 passes of a stage
    more each, 5 write stages and a "next" stage a pass)."""
    net = luisaml.compile(points_model("GridBatchFromPoints", False), batch_axis=None, grid_build="device")
    name, pts, offsets, h, o = clouds()[1]
    assert name == "across the origin"
    feeds = {"jdata": pts, "joffsets": offsets, "voxel_sizes": h, "origins": o}
    net.run(feeds)
    _forget_steps(net)
    with counts.measure() as c:
        net.run(feeds)
    build = next(iter(net.plan.host_steps.device.networks.values()))
    names = [st.phase_name for st in build.plan.schedule.stages]
    per_pass = [n for n in names if n.startswith("radix pass 0: ")]
    assert not any(n.endswith(": next") or "top level" in n or "add chunk bases" in n for n in names), names
    assert names[-1].startswith("leaves, nodes")
    assert [n for n in names if n.startswith("leaf")] == ["leaf ids: sum chunks, level 0",
                                                          "leaf keys, masks and sort keys"], names
    assert not any(n in ("tile ranges", "sort keys", "leaf masks", "leaf keys") for n in names), names
    assert "node ranges and bboxes" in names and "grid summaries and layout" in names, names
    assert per_pass == ["radix pass 0: sum chunks, level 0", "radix pass 0: sum chunks, level 1",
                        "radix pass 0: scatter"], per_pass
    later = [n.replace("radix pass 3: ", "radix pass 0: ") for n in names if n.startswith("radix pass 3: ")]
    assert later == per_pass and not any("histograms" in n for n in names), names
    assert c.launches == len(names) - (RP.PASSES - 4) * len(per_pass) == 23, (c.launches, per_pass)


def _stages(build) -> list[str]:
    return [st.phase_name for st in build.plan.schedule.stages]


def test_no_prefix_sum_has_a_top_level_or_down_sweep_stage_at_any_size():
    """A ConvGrid 3/2 over 600 and 3,000 voxels (the 1,024 and 4,096 buckets: 8,192 and 32,768 keys, the
    histograms' sums of 4 levels, the leaf ids' and the node ids' of 3, the last with 32 words at 32,768)
    launches no "top level" and no "add chunk bases" stage: every reader adds each upper level's word and
    sums the last level's words before its own (gb_upper_sums, gb_prefix, gb_total), where such a build had
    a top level a sum (and before that 2 "add chunk bases" a radix pass, 1 each for the leaf ids and the
    voxel, lower and upper ids); its bytes are the host builder's."""
    from luisaml.operators.fvdb.build_scratch import scan_levels
    from luisaml.shaders import grid_layout as G
    from test_grid_build_memory import _conv_grid_model
    from test_grids_bound_at_run_time import _grid

    for n, r, bucket in ((600, 9.0, 1024), (3000, 20.0, 4096)):
        feeds = dict(zip(schema.BUNDLE, _grid(n, n, r).bundle()))
        dev = luisaml.compile(_conv_grid_model(feeds), batch_axis=None, grid_build="device")
        got, want = dev.run(feeds), luisaml.compile(_conv_grid_model(feeds), batch_axis=None, grid_build="host").run(feeds)
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (n, k)
        (key, build), = dev.plan.host_steps.device.networks.items()
        names = _stages(build)
        assert key[1] == bucket and not any("add chunk bases" in m or "top level" in m for m in names), names
        keys = 8 * bucket
        hist, ids = (scan_levels(w) for w in (256 * -(-keys // G.CHUNK), keys))
        assert (len(hist), len(ids)) == (4, 3)
        assert ids[-1] == (8 if bucket == 1024 else 32)  # (the last level's words, summed by the readers)
        # the up sweep's levels and the scatter (no histograms stage); the leaf ids' and node ids' up sweeps
        assert sum(1 for m in names if m.startswith("radix pass 0: ")) == len(hist), names
        assert sum(1 for m in names if m.startswith("radix pass 1: ")) == len(hist), names
        assert sum(1 for m in names if m.startswith("leaf ids: ")) == len(ids) - 1, names
        assert sum(1 for m in names if m.startswith("voxel, lower and upper ids: ")) == len(ids) - 1, names


@pytest.mark.parametrize("n", [1, 20, 32, 33])
def test_a_build_of_at_most_scan_keys_has_no_prefix_sum_stage(n):
    """Up to SCAN (32) keys (a network of a static point count) a prefix sum is one level of at most 32
    words that no stage scans: its readers sum the words before theirs (gb_prefix) and the total (gb_total);
    the tile ranges are then a stage of their own. 33 keys: an up stage of two chunks, a last level of 2
    words. Points in two grids across two root tiles, the host builder's bytes."""
    from luisaml.shaders import grid_layout as G

    from test_grid_build_device import model, run_both

    rng = np.random.default_rng(n)
    pts = (rng.normal(0, 8.0, (n, 3)) + [0.0, 0.0, 2048.0]).astype(np.float32)  # (two root tiles in k)
    h, o = np.array([[0.5, 0.5, 0.5], [1.0, 0.25, 0.5]]), np.array([[0, 0, 0], [1.0, -2.0, 0.5]])
    net, _ = run_both("GridBatchFromPoints", pts, [0, n // 2, n], h, o)
    names = [st.phase_name for st in net.plan.schedule.stages]
    small = n <= G.SCAN
    assert ("tile ranges" in names) == small, names
    assert sum(m.startswith("leaf ids") for m in names) == (0 if small else 1), names
    assert sum(m.startswith("voxel, lower and upper ids") for m in names) == (0 if small else 1), names


@pytest.mark.parametrize("lone", [0, 31, 32, 69])
def test_a_tile_or_grid_held_by_one_point_is_in_the_ranges(lone):
    """The root tiles' and grids' ranges (the sort key's fields) are folded from the voxel keys, SCAN a
    thread, in the leaf ids' first up stage (gb_point_ranges): a grid of one point (the first, the last)
    and a root tile of one point at each end of a thread's keys (point 31, 32, or 0 / 69) must be in them,
    or the sort keys' fields go negative and the grid's bytes differ from the host builder's."""
    rng = np.random.default_rng(lone)
    pts = rng.normal(0, 6.0, (70, 3)).astype(np.float32)
    pts[lone] = [-9000.0, 300.0, 9000.0] if lone % 2 else [9000.0, -9000.0, -300.0]  # (its own tiles)
    offsets = [0, 1, 69, 70]  # (points 0 and 69 each a grid alone)
    from test_grid_build_device import run_both

    h = np.array([[0.5, 0.5, 0.5], [1.0, 0.25, 0.5], [2.0, 2.0, 2.0]])
    net, _ = run_both("GridBatchFromPoints", pts, offsets, h, np.zeros((3, 3)))
    assert any(st.phase_name == "leaf ids: sum chunks, level 0" for st in net.plan.schedule.stages)


@pytest.mark.full
def test_a_build_at_131072_keys_equals_the_host_builder():
    """The detector's size (100k points, the 131,072-key capacity): the histograms' sums of 5 levels (4 up
    stages, a last level of 2 words), the leaf ids' and node ids' of 4 (a last level of 4 words), 4 passes;
    the host builder's bytes, and 35 launches (48 with histograms and a top-level stage to every pass, a top
    level to each sum and the four leaf stages)."""
    rng = np.random.default_rng(5)
    n = 100_000
    pts = (rng.normal(0, 1, (n, 3)) * [15.0, 15.0, 1.5] + [0.0, 0.0, -1.0]).astype(np.float32)
    offsets, h, o = np.array([0, n], np.int64), np.full((1, 3), 0.2), np.zeros((1, 3))
    want = host_bundle("GridBatchFromPoints", pts, offsets, h, o)
    net = luisaml.compile(points_model("GridBatchFromPoints", False), batch_axis=None, grid_build="device")
    feeds = {"jdata": pts, "joffsets": offsets, "voxel_sizes": h, "origins": o}
    for first in (True, False):
        with counts.measure() as c:
            got = net.run(feeds)
        _forget_steps(net)
        for k, w in zip(FINE, want):
            np.testing.assert_array_equal(got[k], w, err_msg=k)
    (key, build), = net.plan.host_steps.device.networks.items()
    assert key[1] == 131072 and c.launches == 35, (key, c.launches)
