"""A large frozen step input whose dtype and shape no step's cache holds is not hashed (host_steps
HostSteps._digest_of, feeds.token_digest): a token stands for its bytes, kept while the array lives. The
same array bound again is served from the step's cache; another array of that shape is hashed and built
(a token taken for it would be a stale key); a writeable array is hashed as before."""
import numpy as np
import pytest

import luisaml
from luisaml import feeds
from luisaml.fvdb import GridBatch
from luisaml.fvdb import host_steps

from test_radix_passes import FINE, points_model

H = np.full((1, 3), 0.25)
O = np.zeros((1, 3))


def _cloud(n: int, seed: int, frozen: bool) -> dict:
    p = np.random.default_rng(seed).normal(0, 8.0, (n, 3)).astype(np.float32)
    f = {"jdata": p, "joffsets": np.array([0, n], np.int64), "voxel_sizes": H, "origins": O}
    if frozen:
        for a in f.values():
            a.flags.writeable = False
    return f


@pytest.fixture
def hashed(monkeypatch):
    """The sizes of the arrays feeds.bytes_digest hashes."""
    sizes = []
    real = feeds.bytes_digest
    monkeypatch.setattr(feeds, "bytes_digest", lambda a, seen: sizes.append(a.nbytes) or real(a, seen))
    return sizes


def test_a_new_frozen_cloud_is_not_hashed_and_a_cloud_of_a_seen_shape_is(hashed):
    net = luisaml.compile(points_model("GridBatchFromPoints", False), batch_axis=None, grid_build="host")
    big = host_steps.UNREAD_BYTES // 12 + 100  # (points of 12 bytes: past UNREAD_BYTES)
    a, b, other = _cloud(big, 1, True), _cloud(big, 2, True), _cloud(big + 7, 3, True)
    changed = _cloud(big, 4, True)
    # (hashed?) a: a new shape, frozen: a token; b: a's shape, which the step holds (its last run's): hashed;
    # other: another new shape; changed: a frozen array made writeable and written: hashed; a writeable cloud
    # of a new shape: hashed
    for f, hashed_too in ((a, False), (b, True), (other, False), ("changed", True), (_cloud(big + 9, 5, False), True)):
        if f == "changed":
            f = changed
            f["jdata"].flags.writeable = True
            f["jdata"][0] += 100.0
        hashed.clear()
        got = net.run(f)
        want = GridBatch.from_points([f["jdata"]], H[0], O[0]).bundle()
        for name, w in zip(FINE, want):
            np.testing.assert_array_equal(got[name], w, err_msg=name)
        assert (f["jdata"].nbytes in hashed) == hashed_too


def test_the_same_frozen_cloud_again_is_served_from_the_step(monkeypatch):
    net = luisaml.compile(points_model("GridBatchFromPoints", False), batch_axis=None, grid_build="host")
    builds = []
    real = host_steps.on_host
    monkeypatch.setattr(host_steps, "on_host", lambda *a: builds.append(1) or real(*a))
    f = _cloud(host_steps.UNREAD_BYTES // 12 + 50, 6, True)
    first = net.run(f)
    again = net.run(f)
    assert len(builds) == 1
    for name in FINE:
        np.testing.assert_array_equal(first[name], again[name])
