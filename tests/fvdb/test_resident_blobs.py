"""A grid built on the device is bound to its readers by a copy on the device, not uploaded again (issue 28
item 3, luisaml/resident.py): a detector-like chain (GridBatchFromPoints of a new cloud every run, the
ConvGrid 3/2 of that grid, a query of both) uploads no blob after its first run, and gives the bytes and
answers of the same network built on the host; an array whose build's buffer was written since (another
network's build of the same op in between) is uploaded, not copied from the overwritten buffer."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import luisaml
from luisa import globalvars

from luisaml import luisa_compat, resident
from luisaml.dynamic import download
from luisaml.fvdb import GridBatch
from luisaml.opsets import fvdb as schema
from luisaml.opsets import fvdb_grids  # noqa: F401 (registers the grid ops' schemas for inference)

QUERY = 64
EMPTY = {"jidx": np.zeros(0, np.int32), "jlidx": np.zeros((0, 1), np.int32)}


def chain_model():
    """Points (any number) -> GridBatchFromPoints 'fine' -> ConvGrid 3/2 'coarse'; IJKToIndex of the query
    voxels in each grid (both blobs read by the kernels), the coarse bundle an output too."""
    pts, q = [f"p_{p}" for p in schema.JAGGED], [f"q_{p}" for p in schema.JAGGED]
    fine, coarse = [f"f_{n}" for n in schema.BUNDLE], [f"c_{n}" for n in schema.BUNDLE]
    nodes = [helper.make_node("GridBatchFromPoints", pts + ["", ""], fine, name="fine", domain=schema.DOMAIN),
             helper.make_node("ConvGrid", fine, coarse, name="coarse", domain=schema.DOMAIN, kernel_size=[3, 3, 3],
                              stride=[2, 2, 2]),
             helper.make_node("IJKToIndex", fine + q, ["fine_index"], name="fi", domain=schema.DOMAIN, cumulative=1),
             helper.make_node("IJKToIndex", coarse + q, ["coarse_index"], name="ci", domain=schema.DOMAIN, cumulative=1)]
    rest = [("joffsets", TensorProto.INT64, [2]), ("jidx", TensorProto.INT32, [0]), ("jlidx", TensorProto.INT32, [0, 1])]
    ins = [helper.make_tensor_value_info(f"{j}_{n}", t, d)
           for j, data in (("p", (TensorProto.FLOAT, ["N", 3])), ("q", (TensorProto.INT32, [QUERY, 3])))
           for n, t, d in [("jdata", *data)] + rest]
    outs = [helper.make_tensor_value_info(n, TensorProto.INT64, [QUERY]) for n in ("fine_index", "coarse_index")]
    outs.append(helper.make_tensor_value_info("c_grid_blob", TensorProto.UINT8, [None]))
    g = helper.make_graph(nodes, "g", ins, outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


def feeds(seed: int, n: int) -> dict:
    rng = np.random.default_rng(seed)
    pts = rng.normal(0, 4, (n, 3)).astype(np.float32)
    qv = np.concatenate([np.floor(pts[:QUERY // 2] + 0.5).astype(np.int32), rng.integers(-4, 4, (QUERY // 2, 3)).astype(np.int32)])
    return {"p_jdata": pts, "p_joffsets": np.array([0, n]), **{f"p_{k}": v for k, v in EMPTY.items()},
            "q_jdata": qv, "q_joffsets": np.array([0, QUERY]), **{f"q_{k}": v for k, v in EMPTY.items()}}


@pytest.fixture
def uploads(monkeypatch):
    """The byte inputs' uploads from the host (bytes each), however the buffer is made or refilled."""
    seen: list[int] = []
    real_new, real_refill = luisa_compat.byte_buffer, luisa_compat.refill_byte_buffer

    def new(data):
        seen.append(np.asarray(data).nbytes if isinstance(data, np.ndarray) else len(data))
        return real_new(data)

    def refill(buf, data):
        seen.append(data.nbytes)
        return real_refill(buf, data)

    monkeypatch.setattr(luisa_compat, "byte_buffer", new)
    monkeypatch.setattr(luisa_compat, "refill_byte_buffer", refill)
    return seen


@pytest.mark.parametrize("pairs", [True, False])
def test_new_grids_built_on_the_device_are_copied_there_not_uploaded(uploads, pairs, monkeypatch):
    """Each run a new cloud: the fine blob bound to the query, the coarse blob to the query, and (the builds
    apart, DeviceBuilds.PAIRS off) the fine blob to the ConvGrid build, all copied on the device from the
    builds' buffers (before: three uploads a run); with the pair on, the ConvGrid builds beside the fine grid
    from the points in one run and takes no blob. The answers and the coarse blob equal the host builder's
    network."""
    from luisaml.fvdb import host_steps

    monkeypatch.setattr(host_steps.DeviceBuilds, "PAIRS", pairs)
    model = chain_model()
    device = luisaml.compile(model, grid_build="device")
    host = luisaml.compile(model, grid_build="host")
    steps = device.plan.host_steps
    assert [s.node.name for s in steps.steps] == ["fine", "coarse"]
    for k, n in enumerate((300, 500, 420, 300, 700)):
        f = feeds(k, n)
        before = len(uploads)
        copies = device.bound.device_copies + sum(net.bound.device_copies for net in steps.device.networks.values())
        got = device.run(f)
        sent = [b for b in uploads[before:] if b >= 4096]  # (a blob: 300 KB a grid or more; not the weights' 96 B)
        nets = list(steps.device.networks.values())
        after = device.bound.device_copies + sum(net.bound.device_copies for net in nets)
        want = host.run(f)
        for name in ("fine_index", "coarse_index", "c_grid_blob"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert (got["fine_index"][:QUERY // 2] >= 0).mean() > 0.9  # (the cloud's own voxels: round(p))
        assert sent == [], sent  # no blob from the host
        # fine and coarse -> the query; apart, fine -> the coarse build too
        assert after - copies == (2 if pairs else 3), (after, copies)


def query_model(bundle: list[np.ndarray]):
    """IJKToIndex of QUERY voxels in a grid bound at run time (its bundle's rows any)."""
    from fvdb_reference import ELEM

    growing = ("grid_blob", "leaf_batch_indices", "list_indices")
    ins = [helper.make_tensor_value_info(n, ELEM[a.dtype], [f"{n} rows"] + list(a.shape[1:]) if n in growing
                                         else list(a.shape)) for n, a in zip(schema.BUNDLE, bundle)]
    q = [f"q_{p}" for p in schema.JAGGED]
    ins += [helper.make_tensor_value_info("q_jdata", TensorProto.INT32, [QUERY, 3]),
            helper.make_tensor_value_info("q_joffsets", TensorProto.INT64, [2]),
            helper.make_tensor_value_info("q_jidx", TensorProto.INT32, [0]),
            helper.make_tensor_value_info("q_jlidx", TensorProto.INT32, [0, 1])]
    node = helper.make_node("IJKToIndex", list(schema.BUNDLE) + q, ["index"], name="idx", domain=schema.DOMAIN,
                            cumulative=1)
    g = helper.make_graph([node], "q", ins, [helper.make_tensor_value_info("index", TensorProto.INT64, [QUERY])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


def test_a_grid_whose_build_ran_again_since_is_uploaded(uploads):
    """Network X builds cloud 1's fine grid on the device; a query network Q bound to that bundle copies its
    blob from the build's buffer. Then Y (the same model: the same build networks, shared) builds cloud 2,
    writing those buffers: Q bound to cloud 1's bundle again (a fresh Q) uploads it, where a copy from the
    buffers would answer with cloud 2's grid."""
    model = chain_model()
    x, y = (luisaml.compile(model, grid_build="device") for _ in range(2))
    one, two = feeds(1, 400), feeds(2, 650)
    x.run(one)
    bundle = x.plan.host_steps.steps[0]._last[1]
    fine = [bundle[f"f_{n}"] for n in schema.BUNDLE]
    qf = {k: v for k, v in one.items() if k.startswith("q_")}
    want = GridBatch.from_buffer(np.array(fine[0])).ijk_to_index([qf["q_jdata"]], cumulative=True).jdata
    assert (want >= 0).any()
    for fresh in (True, False):
        q = luisaml.compile(query_model(fine), batch_axis=None)
        before = len(uploads)
        got = q.run({**dict(zip(schema.BUNDLE, fine)), **qf})["index"]
        sent = [b for b in uploads[before:] if b >= 4096]
        np.testing.assert_array_equal(got, want)
        if fresh:
            assert sent == [] and q.bound.device_copies == 1, (sent, q.bound.device_copies)
            # the copy is the host's bytes, byte for byte: the headers the host patched over the download
            # are in the build's buffer too (the kernels here read the metadata, not the headers' doubles)
            (_, buf), = q.bound.byte_inputs.values()
            on_device = np.zeros(fine[0].nbytes, np.uint8)
            download(buf, 0, on_device)
            globalvars.vars.stream.synchronize()
            np.testing.assert_array_equal(on_device, fine[0])
            assert resident.source(fine[0]) is not None
            y.run(two)  # (cloud 2 built in the shared build networks: their buffers written)
            assert x.plan.host_steps.device.networks.keys() == y.plan.host_steps.device.networks.keys()
        else:
            assert sent == [fine[0].nbytes] and q.bound.device_copies == 0, (sent, q.bound.device_copies)
            assert resident.source(fine[0]) is None


def test_only_frozen_contiguous_arrays_of_whole_words_are_remembered():
    """resident.remember keeps what it can vouch for: a writeable array, or one of a ragged byte count,
    is never found; a frozen one is, and its views at word offsets, while fresh() holds."""
    buf, live = object(), [True]
    a = np.arange(64, dtype=np.uint8)
    resident.remember(a, buf, 0, lambda: live[0])
    assert resident.source(a) is None  # (writeable)
    a.flags.writeable = False
    resident.remember(a, buf, 8, lambda: live[0])
    assert resident.source(a) == (buf, 8)
    assert resident.source(a[16:32]) == (buf, 24)
    assert resident.source(a[1:5]) is None and resident.source(a[:6]) is None  # (not whole words)
    live[0] = False
    assert resident.source(a) is None and resident.source(a) is None  # (stale: dropped)
    b = np.arange(6, dtype=np.uint8)
    b.flags.writeable = False
    resident.remember(b, buf, 0, lambda: True)
    assert resident.source(b) is None
