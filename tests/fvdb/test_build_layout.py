"""The device grid build's layout on the device (operators/fvdb/build_layout.py, shaders/grid_write.py
gb_layout; benchmarks/NOTES.md "The grid's layout on the device"): one thread lays the grids out from
their summaries as the host builder does (builder.grid_layout, the outside reference), flags 2 GiB and
more, and says whether the blob fits its capacity; a GridBatchFromPoints built as a stage equals the
host builder's bundle in both forms (the switch GridLayout.LAYOUT_ON_DEVICE), waiting once a run on the
device's layout and twice on the host's; a blob past its first capacity runs again and is not cut; what
the device flags raises at the run's end naming the node."""

from types import SimpleNamespace

import luisa
import numpy as np
import pytest

import luisaml
from luisaml import counts
from luisaml.errors import RunError
from luisaml.fvdb import layout as L
from luisaml.fvdb.builder import HEADER_SIZE, grid_layout
from luisaml.operators.fvdb.build_layout import ONE_VOXEL_BYTES, GridLayout
from luisaml.operators.fvdb.topology import TRANSFORM_WORDS, DeviceGridBuild
from luisaml.shaders import grid_layout as G
from luisaml.shaders.grid_write import gb_layout

from test_grid_build_device import assert_same_bundle, host_bundle, model

CTR, SUMMARY = 0, G.C_WORDS


@luisa.func
def layout_kernel(s, layout: int, grids: int, limit: int):
    gb_layout(s, CTR, SUMMARY, layout, grids, limit)


def device_layout(summary: np.ndarray, limit: int, leaves: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run gb_layout over summaries [B, 4] (leaves, lower, upper nodes, voxels) and the hash's leaf count
    (the summaries' unless given); return (ctr, head, rows)."""
    B = len(summary)
    layout = SUMMARY + G.S_WORDS * B
    words = np.zeros(layout + G.H_ROWS + G.G_WORDS * B, np.int32)
    words[CTR + G.C_LEAVES] = summary[:, 0].sum() if leaves is None else leaves
    words[SUMMARY:layout].reshape(B, G.S_WORDS)[:, :4] = summary
    buf = luisa.Buffer.from_array(words)
    layout_kernel(buf, layout, B, limit, dispatch_size=1)
    out = buf.numpy()
    return out[:G.C_WORDS], out[layout:layout + G.H_ROWS], out[layout + G.H_ROWS:].reshape(B, G.G_WORDS)


def test_layout_constants_match_the_host_layout():
    for name in ("GRID_DATA_SIZE", "TREE_DATA_SIZE", "UPPER_NODE_SIZE", "LOWER_NODE_SIZE", "LEAF_NODE_SIZE"):
        assert getattr(G, name) == getattr(L, name), name
    assert ONE_VOXEL_BYTES == grid_layout(1, 1, 1)[4] and HEADER_SIZE == GridLayout.HEADER_WORDS * 4
    # the header's constant words and field offsets (grid_write.gb_write_header)
    assert G.MAGIC_LO | (G.MAGIC_HI << 32) == L.MAGIC_GRID and G.VERSION == L.pack_version(*L.WRITE_VERSION)
    for name in ("FLAG_HAS_BBOX", "FLAG_IS_BREADTH_FIRST", "GRID_CLASS_INDEX", "GRID_TYPE_ON_INDEX", "ROOT_OFF_TABLE_SIZE"):
        assert getattr(G, name) == getattr(L, name), name
    for name in ("GRID_SIZE", "MAP_MATF", "MAP_INVMATF", "MAP_VECF", "MAP_TAPERF", "MAP_MATD", "MAP_INVMATD", "MAP_VECD",
                 "MAP_TAPERD", "WORLD_BBOX", "VOXEL_SIZE", "GRID_CLASS", "BLIND_METADATA_OFFSET", "DATA1"):
        assert getattr(G, "OFF_" + name) == getattr(L, "GRID_OFF_" + name), name
    assert L.GRID_OFF_GRID_TYPE == G.OFF_GRID_CLASS + 4
    assert (G.FLOAT_ONE, G.DOUBLE_ONE_HI) == (int(np.float32(1).view(np.uint32)), int(np.float64(1).view(np.uint64)) >> 32)
    assert G.T_WORDS == TRANSFORM_WORDS and G.S_TRANSFORM + G.T_WORDS <= G.S_WORDS


def test_the_device_lays_the_grids_out_as_the_builder_does():
    rng = np.random.default_rng(11)
    for B in (1, 3, 7):
        summary = np.zeros((B, 4), np.int32)
        for b in range(B):
            if rng.random() < 0.3:
                continue  # an empty grid: its 832 header bytes alone
            up = int(rng.integers(1, 9))
            lo = up + int(rng.integers(0, 40))
            leaves = lo + int(rng.integers(0, 500))
            summary[b] = leaves, lo, up, leaves * int(rng.integers(1, 512))
        offset, want = 0, np.zeros((B, G.G_WORDS), np.int64)
        starts = np.zeros(4, np.int64)
        for b, (nl, nlo, nup, nv) in enumerate(summary.tolist()):
            off_root, off_upper, off_lower, off_leaf, size = grid_layout(nl, nlo, nup)
            tree = offset + L.GRID_DATA_SIZE
            want[b, :6] = offset, tree + off_root, tree + off_root + L.ROOT_DATA_SIZE, tree + off_upper, \
                tree + off_lower, tree + off_leaf
            want[b, G.G_LEAF_START:G.G_VOXEL_START + 1] = starts
            starts += (nl, nlo, nup, nv)
            offset += size
        for limit, room in ((offset, 1), (offset - 4, 0), (2**31 - 1, 1)):
            ctr, head, rows = device_layout(summary, limit)
            assert ctr[G.C_ERROR] == 0
            np.testing.assert_array_equal(rows[:, :G.G_VOXEL_START + 1], want[:, :G.G_VOXEL_START + 1])
            assert head[G.H_BYTES] == offset and head[G.H_VOXELS] == summary[:, 3].sum()
            # past the capacity: no word to zero, the write stages told to write nothing
            assert head[G.H_ROOM] == room and head[G.H_WORDS] == room * offset // 4


def test_grids_of_2_gib_or_more_are_flagged_and_write_nothing():
    fits = (2**31 - 1 - grid_layout(0, 0, 0)[4]) // (L.UPPER_NODE_SIZE + L.ROOT_TILE_SIZE)
    for uppers, flagged in ((fits, False), (fits + 1, True)):
        summary = np.array([[0, 0, 0, 0], [uppers, uppers, uppers, uppers]], np.int32)
        summary[1, :2] = 0, 0  # (upper nodes alone: the bytes the reference counts are the same arithmetic)
        total = grid_layout(0, 0, 0)[4] + grid_layout(0, 0, uppers)[4]
        assert (total > 2**31 - 1) == flagged
        ctr, head, _ = device_layout(summary, 2**31 - 1)
        assert ctr[G.C_ERROR] == (G.ERR_BYTES if flagged else 0)
        assert head[G.H_BYTES] == (0 if flagged else total) and head[G.H_ROOM] == (0 if flagged else 1)


def test_summaries_whose_leaves_are_not_the_hashs_are_flagged():
    summary = np.array([[3, 1, 1, 20], [2, 1, 1, 9]], np.int32)
    assert device_layout(summary, 2**31 - 1)[0][G.C_ERROR] == 0
    assert device_layout(summary, 2**31 - 1, leaves=6)[0][G.C_ERROR] == G.ERR_LEAVES


def _stub(B: int) -> GridLayout:
    stub = GridLayout()
    stub.B, stub.N, stub.counted = B, 4, False
    stub.node = SimpleNamespace(describe=lambda: "node 'build' (fvdb::GridBatchFromPoints)")
    stub.coords_error = lambda: "coords"
    return stub


def test_the_host_step_raises_what_the_device_layout_flagged():
    words = np.zeros(G.C_WORDS + G.S_WORDS, np.int32)
    row = G.C_WORDS + G.S_TRANSFORM
    words[row:row + 6] = np.ones(3).view(np.int32)  # (voxel size 1, origin 0: the clear stage's copy)
    words[G.C_ERROR] = G.ERR_BYTES
    with pytest.raises(RunError, match=r"node 'build' .*at most 2 GiB"):
        _stub(1)._lay_out(words)
    words[G.C_ERROR] = 0
    words[G.C_WORDS + G.S_LEAVES] = 3  # the summaries' leaves against the hash's (0)
    with pytest.raises(RunError, match="summaries count 3 leaves, its hash 0"):
        _stub(1)._lay_out(words)


def _spread(n: int, rng, far: float) -> np.ndarray:
    """n points around the origin and at +-far on each axis: 8 upper nodes where far passes 4096 voxels."""
    pts = rng.normal(0, 3, (n, 3))
    pts[: n // 2] += rng.choice([-far, far], (n // 2, 3))
    return pts.astype(np.float32)


@pytest.mark.parametrize("on_device, one_thread", [(True, 16), (True, 0), (False, 16)])
def test_both_layouts_equal_the_host_builder_one_wait_against_two(monkeypatch, on_device, one_thread):
    """Four grids, two empty, on either side of the switch: the same bundle, 1 or 2 waits a run; on the
    device's layout, the summaries written by the layout's thread (up to ONE_THREAD_SUMMARIES grids: one
    stage) or a thread a grid (two stages)."""
    monkeypatch.setattr(DeviceGridBuild, "LAYOUT_ON_DEVICE", on_device)
    monkeypatch.setattr(DeviceGridBuild, "ONE_THREAD_SUMMARIES", one_thread)
    rng = np.random.default_rng(4)
    pts = _spread(600, rng, 30.0)
    offsets = [0, 0, 250, 250, 600]  # grids 0 and 2 empty
    m, feeds = model("GridBatchFromPoints", pts, offsets)
    net = luisaml.compile(m, batch_axis=None)
    names = [st.phase_name for st in net.plan.schedule.stages]
    assert ("grid summaries and layout" in names) == (on_device and one_thread >= 4), names
    assert bool(net.plan.counted) == on_device
    assert [rb.at_end for rb in net.plan.readbacks if not rb.counted] == [on_device]
    net.run(feeds)  # (the first run: a blob past its first capacity runs again)
    for k in range(3):
        jdata = _spread(600, np.random.default_rng(10 + k), 30.0)
        with counts.measure() as c:
            got = net.run({"jdata": jdata, "joffsets": feeds["joffsets"]})
        assert_same_bundle(got, host_bundle("GridBatchFromPoints", jdata, offsets))
        assert c.syncs == (1 if on_device else 2), c


def test_a_blob_past_its_first_capacity_runs_again_and_is_not_cut():
    """Grids spanning 8 upper nodes (2.4 MB each) against a first capacity of 2 x 305,216 bytes' bucket:
    the first run is repeated (two waits), the bytes are the builder's; the next runs fit (one wait)."""
    rng = np.random.default_rng(6)
    pts = _spread(400, rng, 5000.0)
    offsets = [0, 150, 400]
    m, feeds = model("GridBatchFromPoints", pts, offsets)
    net = luisaml.compile(m, batch_axis=None)
    blob = net.plan.counted[[rb.first for rb in net.plan.readbacks if rb.counted].index(2 * ONE_VOXEL_BYTES)]
    first = net.launcher.capacity[blob]
    want = host_bundle("GridBatchFromPoints", pts, offsets)
    assert len(want[0]) > first  # (past the first capacity)
    with counts.measure() as c:
        got = net.run(feeds)
    assert net.launcher.reruns == 1 and c.syncs == 2
    assert_same_bundle(got, want)
    assert net.launcher.capacity[blob] >= len(want[0])
    small = rng.normal(0, 3, (400, 3)).astype(np.float32)  # one upper node: within the capacity grown
    for jdata in (pts, small):
        with counts.measure() as c:
            got = net.run({"jdata": jdata, "joffsets": feeds["joffsets"]})
        assert c.syncs == 1 and net.launcher.reruns == 1
        assert_same_bundle(got, host_bundle("GridBatchFromPoints", jdata, offsets))


# voxel sizes and origins whose world bboxes round (0.1, 1/3, 1e-3: inexact products and sums), large and
# negative origins (cancellation against the product), per-axis sizes, and the extremes the builder takes:
# a subnormal size (subnormal products), a huge one (products past DBL_MAX: infinity), an origin of -0.0
AWKWARD = [
    ([0.1, 1 / 3, 1e-3], [1e6 + 0.1, -3e9, -0.0]),
    ([1 / 3, 1 / 3, 1 / 3], [-12345.678, 0.3, 7.1e-5]),
    ([1e-3, 0.1, 0.7], [-0.05, 0.05, 2.0 ** 40 + 0.5]),
    ([5e-324, 1e-310, 2.5e-308], [0.0, -1e-320, 3e-310]),
    ([1e308, 1.7e308, 0.75], [-1e308, 1e308, -1e300]),
]


def test_the_devices_headers_equal_the_builders_at_awkward_voxel_sizes_and_origins():
    """Every header byte written on the device (the world bbox's doubles through shaders/f64.py, the map
    from the host's derived words): the blob equals the host builder's byte for byte over five grids,
    one empty, with coordinates at the int32 extremes (max + 1 wraps as the builder's int32 does), and
    the run's only host read is the 16 counter words (nothing patched)."""
    rng = np.random.default_rng(28)
    parts = [rng.integers(-3000, 3000, (50, 3)), np.array([[2**31 - 1, -2**31, 5], [-2**31, 2**31 - 1, -7]]),
             np.zeros((0, 3)), rng.integers(-2**31, 2**31, (20, 3)), np.array([[-1, 0, 1], [1, -1, 0]])]
    ijk = np.concatenate(parts).astype(np.int32)
    offsets = np.cumsum([0] + [len(p) for p in parts])
    h, o = np.array([a for a, _ in AWKWARD]), np.array([b for _, b in AWKWARD])
    m, feeds = model("GridBatchFromIJK", ijk, offsets, h, o)
    with np.errstate(over="ignore", divide="ignore"):  # (1 / 5e-324 and the world bboxes of 1e308: inf, as the host's)
        net = luisaml.compile(m, batch_axis=None)
        want = host_bundle("GridBatchFromIJK", ijk, offsets, h, o)
        got = net.run(feeds)
    assert [(rb.count, rb.at_end) for rb in net.plan.readbacks if not rb.counted] == [(G.C_WORDS, True)]
    blob, want_blob = got["new_grid_blob"], want[0]
    assert len(blob) == len(want_blob)
    heads = [(int(b), int(b) + HEADER_SIZE) for b in want[1]]
    for b, (start, end) in enumerate(heads):  # (each header's first wrong byte named)
        bad = np.flatnonzero(blob[start:end] != want_blob[start:end])
        assert not len(bad), f"grid {b}: header bytes {bad.tolist()[:8]} differ"
    with np.errstate(over="ignore"):
        assert_same_bundle(got, want, float32_exact=False)
    world = np.frombuffer(want_blob[heads[4][0] + L.GRID_OFF_WORLD_BBOX:][:48].tobytes(), np.float64)
    assert np.isinf(world).any() and int(want[1][3]) - int(want[1][2]) == HEADER_SIZE  # (the edges are met: grid 2 empty)
