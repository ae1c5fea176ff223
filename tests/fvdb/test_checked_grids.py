"""Grids checked once, and the grids luisaml built not walked (luisaml/fvdb/checked.py): a host step's
bundle is frozen and read from its headers (nanovdb_read.read_built_grids), which give what the full
check gives; a network binding it, or a step reading it, walks no tree; a grid the user binds is
walked at every new binding as before, and one with a corrupted byte still raises, whether its arrays
are writeable, read-only over bytes, or remembered once and made writeable again."""
import numpy as np
import pytest

import luisaml
from luisaml.errors import InputError, LuisamlError
from luisaml.fvdb import GridBatch, checked
from luisaml.fvdb import layout as L
from luisaml.fvdb.nanovdb_read import read_built_grids, read_grids
from luisaml.operators.fvdb import common
from luisaml.opsets import fvdb as schema

from test_host_steps import BATCHES, QUERY, chain_model, expected_batch, query_feeds


def _sets(rng):
    return [rng.integers(-40, 40, (n, 3)).astype(np.int32) for n in (1, 700, 0, 2500)]


def test_a_built_grid_read_from_its_headers_is_what_the_full_check_reads():
    """Four grids (one voxel, an empty one, thousands): every field the metadata reads is the
    validating reader's, and the voxel counts numpy's distinct voxels."""
    rng = np.random.default_rng(0)
    sets = _sets(rng)
    gb = GridBatch.from_ijk(sets)
    blob = gb.bundle()[0]
    full, built = read_grids(blob), read_built_grids(blob)
    assert len(full) == len(built) == len(sets)
    for f, b, s in zip(full, built, sets):
        assert b.voxel_count == f.voxel_count == len(np.unique(s, axis=0))
        for field in ("offset", "grid_size", "tree", "root_tile_count", "value_count", "leaf_voxel_count",
                      "active_tile_count", "grid_type", "leaf_offset", "leaf_count", "root_offset"):
            assert getattr(b, field) == getattr(f, field), field
        np.testing.assert_array_equal(b.voxel_size, f.voxel_size)


def test_a_remembered_bundle_gives_the_metadata_of_a_full_check(monkeypatch):
    """grid_metadata of a frozen, built bundle (no walk) equals that of writeable copies (walked)."""
    rng = np.random.default_rng(1)
    gb = GridBatch.from_ijk(_sets(rng), voxel_sizes=0.3, origins=(1, -2, 0.5))
    parts = [checked.freeze(np.array(a)) for a in gb.bundle()[:6]]
    checked.built(parts)
    walks = []
    real = common.read_grids
    monkeypatch.setattr(common, "read_grids", lambda blob, **k: walks.append(len(blob)) or real(blob, **k))
    fast = common.grid_metadata(*parts)
    assert walks == []
    slow = common.grid_metadata(*[np.array(a) for a in parts])
    assert len(walks) == 1
    np.testing.assert_array_equal(fast, slow)


def _corrupt_voxel_count(blob: np.ndarray) -> np.ndarray:
    """A copy of blob whose first grid's TreeData voxel count is one more (its leaves disagree)."""
    bad = np.array(blob)
    pos = L.GRID_DATA_SIZE + L.TREE_OFF_VOXEL_COUNT
    count = int(bad[pos:pos + 8].view(np.uint64)[0])
    bad[pos:pos + 8] = np.frombuffer(np.uint64(count + 1).tobytes(), np.uint8)
    return bad


def test_a_remembered_bundle_made_writeable_again_is_checked_again():
    rng = np.random.default_rng(2)
    parts = [checked.freeze(np.array(a)) for a in GridBatch.from_ijk(_sets(rng)).bundle()[:6]]
    common.bundle_grids(*parts)  # (checked in full, then remembered)
    assert checked.known(parts) is not None
    blob = parts[0]
    blob.flags.writeable = True
    blob[:] = _corrupt_voxel_count(blob)
    assert checked.known(parts) is None
    with pytest.raises(LuisamlError, match="voxel count"):
        common.bundle_grids(*parts)


@pytest.fixture
def walks(monkeypatch):
    """The blobs common.bundle_grids walks in full (read_grids), by their arrays."""
    seen = []
    real = common.read_grids
    monkeypatch.setattr(common, "read_grids", lambda blob, **k: seen.append(blob) or real(blob, **k))
    return seen


@pytest.fixture
def a_fresh_process(monkeypatch):
    """The process-wide memories of grid bytes checked before, empty for the test and restored after
    it. By design a blob whose bytes were checked in this process is not walked again there: a device
    build's bucket network is shared by every network of the process (host_steps.DeviceBuilds._shared)
    and its BoundInputs check a blob once per distinct bytes; a step of another live network gives its
    result of the same bytes back (host_steps._LIVE). So after test_topology_device.py's chain (ConvGrid
    3/1 of BATCHES["two"] on the device: the same bucket network, the same bytes) the device case's
    first binding walked nothing. "A new binding walks the user's grid once" holds for a binding new
    to the process, whatever ran before in it (pytest-xdist: any test), hence a fresh process here."""
    from luisaml.fvdb import host_steps

    monkeypatch.setattr(host_steps.DeviceBuilds, "_shared", {})
    monkeypatch.setattr(host_steps, "_LIVE", type(host_steps._LIVE)())


@pytest.mark.parametrize("grid_build", ["host", "device"])
def test_steps_grids_are_not_walked_and_a_corrupted_user_grid_still_raises(a_fresh_process, walks, grid_build):
    """ConvGrid of the bound grid, CoarsenedGrid of that, IJKToIndex over it: a new binding walks the
    user's grid once (its first reader), never the two grids the steps built (frozen: writing raises);
    the indices equal the reference's. The user's grid with one byte changed raises, as a writeable
    array and read-only over bytes, after its good twin has been bound."""
    import fvdb_reference as R

    gb = BATCHES["two"]
    B = gb.grid_count
    net = luisaml.compile(chain_model(gb), batch_axis=None, grid_build=grid_build)
    other = GridBatch.from_ijk([np.concatenate([gb.ijk.unbind()[0], [[50, 50, 50]]]), gb.ijk.unbind()[1]],
                               gb.voxel_sizes, gb.origins)
    for k, grid in enumerate([gb, other]):
        walks.clear()
        bundle = [np.array(a) for a in grid.bundle()]  # (writeable: the user's)
        dilated = expected_batch([R.conv_grid(grid, 3, 1)[b] for b in range(B)], grid.voxel_sizes, grid.origins)
        sets, h, o = R.coarsened_grid(dilated, (2, 2, 2))
        feeds, qv = query_feeds(sets, B, np.random.default_rng(k))
        got = net.run({**dict(zip(schema.BUNDLE, bundle)), **feeds})["index"]
        np.testing.assert_array_equal(got, expected_batch(sets, h, o).ijk_to_index([qv] * B, cumulative=True).jdata)
        assert len(walks) == 1 and walks[0].tobytes() == bundle[0].tobytes()
    made = [s._last[1] for s in net.plan.host_steps.steps]
    for result in made:
        blob = next(a for name, a in result.items() if name.endswith("grid_blob"))
        with pytest.raises(ValueError):
            blob[0] = 1
    bad = _corrupt_voxel_count(gb.bundle()[0])
    rest = dict(zip(schema.BUNDLE[1:], gb.bundle()[1:]))
    feeds, _ = query_feeds(R.coarsened_grid(expected_batch([R.conv_grid(gb, 3, 1)[b] for b in range(B)],
                                                            gb.voxel_sizes, gb.origins), (2, 2, 2))[0],
                           B, np.random.default_rng(0))
    for blob in (bad, np.frombuffer(bad.tobytes(), np.uint8)):
        with pytest.raises(InputError, match="voxel count"):
            net.run({"grid_blob": blob, **rest, **feeds})


def test_the_detector_walks_no_grid_of_its_own_and_hashes_its_points_once(walks, monkeypatch):
    """The detector's frames (network A voxelizing, B after it): the fine and coarse grids are the steps',
    so no bundle is walked in a frame, where four were (fine and coarse, each bound twice); the frame's
    points, frozen by the example, are hashed by A and not again by B (feeds.bytes_digest); the kept
    boxes equal torch's."""
    import hashlib

    import torch

    from luisaml import feeds
    from util import example_module

    hashed = []
    real = hashlib.blake2b
    monkeypatch.setattr(feeds.hashlib, "blake2b", lambda data=b"", **k: hashed.append(len(memoryview(data).cast("B")))
                        or real(data, **k))

    with example_module("lidar_detector.py") as ex:
        cfg = ex.Settings(points=700, channels=4, radius=5.0, candidates=10)
        rng = np.random.default_rng(4)
        torch.manual_seed(4)
        backbone, head = ex.Backbone(cfg).eval(), ex.Head(cfg).eval()
        frames = [ex.lidar_frame(n, rng, cfg.radius) for n in (700, 450)]
        nets = ex.compile_networks(cfg, backbone, head, frames[0])
        for points in frames * 2:
            walks.clear()
            hashed.clear()
            out, _ = nets.run(points)
            assert walks == []
            assert hashed.count(len(points) * 3 * 4) == 1  # (xyz: float32 [N, 3])
            fine, x = ex.voxelize(points, cfg.voxel_size)
            with torch.no_grad():
                want = [t.numpy() for t in head(backbone(x, *fine), *fine)]
            np.testing.assert_array_equal(out["kept"], want[3])
            np.testing.assert_allclose(out["boxes"], want[0], rtol=1e-5, atol=1e-5)


def test_a_step_that_gives_its_input_back_leaves_the_users_grid_checked_and_writeable():
    """DilatedGrid of 0 on the device returns its input bundle: the step's result is a frozen copy, not
    remembered as built, so the user's arrays stay writeable and a corrupted byte raises where the
    query binds the grid (never a kernel over unchecked bytes)."""
    from test_host_steps import topology_model

    gb = BATCHES["two"]
    net = luisaml.compile(topology_model("DilatedGrid", {"dilation": 0}, gb, False), batch_axis=None,
                          grid_build="device")
    sets = [set(map(tuple, v.tolist())) for v in gb.ijk.unbind()]
    feeds, qv = query_feeds(sets, gb.grid_count, np.random.default_rng(0))
    bundle = [np.array(a) for a in gb.bundle()]
    got = net.run({**dict(zip(schema.BUNDLE, bundle)), **feeds})
    np.testing.assert_array_equal(got["new_grid_blob"], bundle[0])
    np.testing.assert_array_equal(got["index"], gb.ijk_to_index([qv] * gb.grid_count, cumulative=True).jdata)
    assert [n for n, a in zip(schema.BUNDLE, bundle) if not a.flags.writeable] == []
    bundle[0] = _corrupt_voxel_count(bundle[0])
    with pytest.raises(LuisamlError, match="voxel count"):  # (NanoVDBError, as for any grid bound to kernels)
        net.run({**dict(zip(schema.BUNDLE, bundle)), **feeds})
