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


def test_passes_and_fields_are_the_shaders():
    from luisaml.shaders import grid_layout as G

    assert RP.PASSES == G.PASSES
    # passes 0-3 the slot key's bytes, then 3 a tile axis (k, j, i), then 2 of the grid
    assert [RP._field_shift(p) for p in range(RP.PASSES)] == [(0, 0), (0, 8), (0, 16), (0, 24)] + [
        (f, s) for f in (1, 2, 3) for s in (0, 8, 16)] + [(4, 0), (4, 8)]


@pytest.mark.parametrize("op_type", ["GridBatchFromPoints", "GridBatchFromNearestVoxelsToPoints", "GridBatchFromIJK"])
def test_the_passes_called_idle_are_idle_in_the_grid_built(op_type):
    seen = set()
    for name, pts, offsets, h, o in clouds():
        jdata = np.floor(pts.astype(np.float64) / h[0]).astype(np.int32) if op_type == "GridBatchFromIJK" else pts
        arrays = [jdata, offsets, np.zeros(0, np.int32), np.zeros((0, 1), np.int32), h, o]
        idle = RP.idle_passes(op_type, {}, arrays, False)
        assert idle <= true_idle(host_bundle(op_type, jdata, offsets, h, o)), name
        seen.add(idle)
        if name == "inside one tile":
            assert idle == {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14}
        if name == "across the origin":
            assert idle == {5, 6, 8, 9, 11, 12, 13, 14}
        if name == "far, across 300 tiles in x":
            assert 11 not in idle and 12 in idle  # (the i tile's second byte sorted)
        if name == "two grids":
            assert 13 not in idle and 14 in idle
    assert len(seen) >= 4
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
