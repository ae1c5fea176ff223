"""luisaml/dispatch.py's Launcher against luisa-python's own launch (func.__call__): the same kernel
over the same buffers and scalars writes the same words, shared arguments typed once and reused
across launches of several kernels, and a tail argument of its own per launch."""
import numpy as np
import pytest

import luisaml
from luisaml.dispatch import Launcher


@pytest.fixture(scope="module")
def kernels():
    luisaml.device.init("auto")
    import luisa

    @luisa.func
    def write(out, src, scale, k):
        i = dispatch_id().x
        out.write(i, src.read(i) * scale + k)

    @luisa.func
    def add(out, src, scale, k):
        i = dispatch_id().x
        out.write(i, out.read(i) + src.read(i) + scale * k)

    return luisa, write, add


def test_launcher_writes_what_the_kernels_own_call_writes(kernels):
    luisa, write, add = kernels
    src = luisa.Buffer.from_array(np.arange(64, dtype=np.int32))
    ours, theirs = luisa.Buffer(64, int), luisa.Buffer(64, int)
    launch = Launcher([ours, src, 3])
    for k in range(3):  # (the same shared arguments, a different kernel and tail each time)
        launch(write if k == 0 else add, (k + 5,), 64 - 8 * k)
    for k in range(3):
        (write if k == 0 else add)(theirs, src, 3, k + 5, dispatch_size=64 - 8 * k)
    got, want = np.zeros(64, np.int32), np.zeros(64, np.int32)
    ours.copy_to(got)
    theirs.copy_to(want)
    luisa.synchronize()
    expect = np.arange(64) * 3 + 5  # numpy's own sum of the same three launches
    expect[:56] += np.arange(56) + 3 * 6
    expect[:48] += np.arange(48) + 3 * 7
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, expect)
