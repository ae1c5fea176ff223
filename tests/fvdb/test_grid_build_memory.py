"""Device bytes of the device grid builds (issue 28: the detector's peak memory, benchmarks/NOTES.md). A
device build's network is compiled per node and power of two of its source (host_steps.DeviceBuilds)
and kept for the process; their kernel-only buffers (the int scratch, ~1,880 bytes a source voxel for
a 3/2 ConvGrid: 8 candidate keys, the taps that can divide, where all 27 taps took ~6,340) come from one
luisaml.pool.SharedBuffers, so the process holds the largest build's, not every capacity's: a
detector's frames of 30k and 62k voxels held 280 and 559 MB side by side before the 8 keys."""
import gc

import numpy as np
from onnx import helper

import luisaml
from luisaml import counts
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_grids  # noqa: F401 (registers the grid ops' schemas for inference)
from luisaml.pool import BufferPool, SharedBuffers

from fvdb_reference import ELEM
from test_grids_bound_at_run_time import _grid

GROWING = ("grid_blob", "leaf_batch_indices", "list_indices")


def _held() -> int:
    gc.collect()
    return counts.snapshot().held_bytes


def test_shared_buffers_hold_the_largest_need_and_release_what_they_replace():
    luisaml.device.init("cpu")
    shared = SharedBuffers()
    a, b = BufferPool(), BufferPool()
    a.share(shared)
    b.share(shared)
    base = _held()
    x = a.pooled("scratch_int", "int", 1000)
    assert b.pooled("scratch_int", "int", 500) is x  # the smaller need: the same buffer
    assert _held() - base == 4000
    kept = a._regions_of(object(), 1, "scratch", lambda: [a.pooled("scratch_int", "int", 1000)])
    assert kept == [x] and a._regions
    y = b.pooled("scratch_int", "int", 3000)  # a larger one replaces it, never both held
    assert y is not x and y.size == 3000 and not a._regions  # (a's kept lists dropped with it)
    del x, kept
    assert _held() - base == 12000
    assert a.pooled("scratch_int", "int", 1000) is y and shared.nbytes() == 12000
    assert a.pooled("buf_float_0", "float", 10) is not y  # other identifiers: other buffers
    assert not a.held and not b.held  # (nothing kernel-only in the pools' own)


def _conv_grid_model(feeds: dict):
    ins = [helper.make_tensor_value_info(n, ELEM[a.dtype], [f"{n} rows"] + list(a.shape[1:]) if n in GROWING
                                         else list(a.shape)) for n, a in feeds.items()]
    new = [f"new_{n}" for n in schema.BUNDLE]
    node = helper.make_node("ConvGrid", list(schema.BUNDLE), new, name="topo", domain=schema.DOMAIN,
                            kernel_size=[3, 3, 3], stride=[2, 2, 2])
    outs = [helper.make_tensor_value_info(n, ELEM[a.dtype], [None] * a.ndim) for n, a in zip(new, feeds.values())]
    return helper.make_model(helper.make_graph([node], "g", ins, outs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


def _kernel_only(net) -> dict:
    """id -> bytes of the kernel-only buffers (stage slots, scratch) a device build's network runs with."""
    n = 1  # (a device build has no batch)
    bufs = net.pool.scratch(net.plan, n) + (net.pool.stage_buffers(net.plan, n) if net.plan.schedule else [])
    return {id(b): int(b.bytesize) for b in bufs}


def _need(net) -> int:
    """The bytes of kernel-only buffers a device build's plan asks for (scratch, stage slots; no batch)."""
    plan = net.plan
    slots = plan.schedule.buffers.slots if plan.schedule is not None else []
    return sum(4 * size for size in plan.kernel_scratch.values()) + sum(s.size * s.itemsize for s in slots)


def test_device_builds_of_two_capacities_hold_one_scratch(monkeypatch):
    """A ConvGrid built on the device over a grid of 600 voxels (the 1,024 bucket), then one of 3,000 (the
    4,096 bucket): two networks, each bundle the host's; their kernel-only buffers are the same ones,
    as large as the larger build's need, and the bytes held past the first build grow by the larger
    build's scratch less the smaller's (plus its inputs and outputs), not by all of it. (A store of its
    own: a larger build of an earlier test in the process, e.g. 27 keys at 2^16, would hold more.)"""
    from luisaml import runtime
    from luisaml.fvdb import host_steps

    monkeypatch.setattr(runtime, "GRID_BUILD_BUFFERS", SharedBuffers())
    monkeypatch.setattr(host_steps.DeviceBuilds, "_shared", {})
    small, large = (dict(zip(schema.BUNDLE, _grid(seed, n, r).bundle())) for seed, n, r in ((1, 600, 9.0), (2, 3000, 20.0)))
    net = luisaml.compile(_conv_grid_model(small), batch_axis=None, grid_build="device")
    host = luisaml.compile(_conv_grid_model(small), batch_axis=None, grid_build="host")
    base = _held()
    got_small = net.run(small)
    after_small = _held()
    got_large = net.run(large)
    after_large = _held()
    for got, feeds in ((got_small, small), (got_large, large)):
        want = host.run(feeds)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k
    builds = list(net.plan.host_steps.device.networks.values())
    assert len(builds) == 2  # (two buckets)
    need = [_need(b) for b in builds]
    ids = [set(_kernel_only(b)) for b in builds]
    assert ids[0] == ids[1], "the two capacities' kernel-only buffers must be the same ones"
    assert sum(_kernel_only(builds[0]).values()) == max(need) > 2 * min(need)
    io = sum(int(b.bytesize) for b in builds[1].pool.held.values())
    io += builds[1].pool.weights(builds[1].plan).bytesize + 4096  # (its weight blob; its state's words)
    # the larger's scratch replaces the smaller's: held grows by their difference (and the large build's
    # inputs, outputs, weights and state; the main network's buffers are the small grid's size class)
    grew = after_large - after_small
    assert max(need) - 2 * min(need) <= grew <= max(need) - min(need) + io + (after_small - base), \
        (grew, need, io, after_small - base)
    net.run(small)  # the small bucket again: nothing new
    assert _held() <= after_large


def test_a_3_2_conv_grid_build_holds_8_keys_of_scratch_a_source_voxel(monkeypatch):
    """Issue 28: a 3/2 ConvGrid's source voxel can reach ceil(3/2)^3 = 8 new voxels, so its device build's
    scratch holds 8 candidate keys a source voxel of capacity (~1,880 bytes at 1,024), not the kernel's 27
    taps (~6,340 bytes); 2/2 one key, 5/2 27, 3/1 27. The bundle is the host builder's."""
    from luisaml.operators.fvdb.build_scratch import Scratch
    from luisaml.operators.fvdb.topology_device import DeviceTopology

    for k, s, keys in ((3, 2, 8), (2, 2, 1), (5, 2, 27), (4, 2, 8), (3, 1, 27), (2, 3, 1)):
        assert DeviceTopology.keys_for("ConvGrid", {"kernel_size": [k] * 3, "stride": [s] * 3}, 1024) == 1024 * keys
    from luisaml.fvdb import host_steps

    monkeypatch.setattr(host_steps.DeviceBuilds, "_shared", {})  # (its own network: its plan's scratch)
    feeds = dict(zip(schema.BUNDLE, _grid(1, 600, 9.0).bundle()))
    net = luisaml.compile(_conv_grid_model(feeds), batch_axis=None, grid_build="device")
    got, want = net.run(feeds), luisaml.compile(_conv_grid_model(feeds), batch_axis=None, grid_build="host").run(feeds)
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
    (key, build), = net.plan.host_steps.device.networks.items()
    assert key[1] == 1024 and build.plan.kernel_scratch == {"int": Scratch(8 * 1024, 1).words}
    # (8 keys of ~59 words, the regions of the hash, the sort and the ranked leaves sharing words, and the table)
    assert 1_860 <= _need(build) / 1024 <= 1_900, _need(build) / 1024
