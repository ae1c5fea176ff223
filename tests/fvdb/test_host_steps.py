"""Grid ops over grids bound at run time, run on the host (luisaml/fvdb/host_steps.py, grid_build="host"; the
device's form in test_topology_device.py): one compiled network
builds each topology op's grid from whatever grid a run binds. The new bundle equals, byte for byte,
the builder's bundle of fvdb_reference's voxel sets (loops over voxel sets, fVDB's section-3
conventions); a query compiled over it answers as the reference grid; and a sparse U-Net that makes
its coarse level inside the model equals torch on point clouds of different sizes."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import luisaml
from luisaml.errors import InputError, InputNameError, LuisamlError, ModelError, UsageError
from luisaml.fvdb import GridBatch
from luisaml.opsets import fvdb as schema

from fvdb_reference import ELEM
from test_ops_topology import BATCHES, TOPOLOGY, assert_same_bundle, expected_batch, reference, _query

GROWING = ("grid_blob", "leaf_batch_indices", "list_indices")
QUERY = 64  # query voxels a grid (the reference sets' voxels and neighbours, padded)


def grid_inputs(prefix: str, gb: GridBatch) -> list:
    """The bundle's graph inputs, its growing parts of any size."""
    return [helper.make_tensor_value_info(f"{prefix}{n}", ELEM[a.dtype],
                                          [f"{prefix}{n} rows"] + list(a.shape[1:]) if n in GROWING else list(a.shape))
            for n, a in zip(schema.BUNDLE, gb.bundle())]


def topology_model(op_type: str, attrs: dict, gb: GridBatch, mask: bool) -> onnx.ModelProto:
    """op_type over a bound grid (and a bound mask), its new bundle as outputs, and IJKToIndex over it."""
    ins = grid_inputs("", gb) + ([helper.make_tensor_value_info("mask", TensorProto.BOOL, ["mask rows"])] if mask else [])
    new = [f"new_{n}" for n in schema.BUNDLE]
    topo = helper.make_node(op_type, list(schema.BUNDLE) + (["mask"] if mask else []), new, name="topo",
                            domain=schema.DOMAIN, **attrs)
    q = [f"q_{p}" for p in schema.JAGGED]
    idx = helper.make_node("IJKToIndex", new + q, ["index"], name="idx", domain=schema.DOMAIN, cumulative=1)
    B = gb.grid_count
    ins += [helper.make_tensor_value_info("q_jdata", TensorProto.INT32, [B * QUERY, 3]),
            helper.make_tensor_value_info("q_joffsets", TensorProto.INT64, [B + 1]),
            helper.make_tensor_value_info("q_jidx", TensorProto.INT32, [B * QUERY]),
            helper.make_tensor_value_info("q_jlidx", TensorProto.INT32, [0, 1])]
    outs = [helper.make_tensor_value_info("index", TensorProto.INT64, [B * QUERY]),
            helper.make_tensor_value_info("new_grid_blob", TensorProto.UINT8, ["new rows"])]
    g = helper.make_graph([topo, idx], "host_steps", ins, outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


def query_feeds(sets, B: int, rng) -> tuple[dict, np.ndarray]:
    q = _query(sets)
    q = q[rng.permutation(len(q))[:QUERY]] if len(q) >= QUERY else np.concatenate([q, np.zeros((QUERY - len(q), 3), np.int32)])
    return {"q_jdata": np.tile(q, (B, 1)), "q_joffsets": np.arange(B + 1, dtype=np.int64) * QUERY,
            "q_jidx": np.repeat(np.arange(B, dtype=np.int32), QUERY), "q_jlidx": np.zeros((0, 1), np.int32)}, q


@pytest.mark.parametrize("op_type", TOPOLOGY)
def test_one_network_builds_each_topology_over_grids_bound_at_run_time(op_type):
    """Two-grid batches of different sizes (one with an empty grid) through one compiled network."""
    first = BATCHES["two"]
    attrs, extra, *_ = reference(op_type, first, np.random.default_rng(0))
    net = luisaml.compile(topology_model(op_type, attrs, first, bool(extra)), batch_axis=None, grid_build="host")
    assert [n.op_type for n, _ in net.plan.ops] == ["IJKToIndex"] and net.plan.host_steps is not None
    assert {s.name for s in net.inputs} == set(schema.BUNDLE) | set(extra) | {f"q_{p}" for p in schema.JAGGED}
    rng = np.random.default_rng(1)
    other = GridBatch.from_ijk([rng.integers(-30, 30, (900, 3)).astype(np.int32), np.array([[7, 7, 7]], np.int32)],
                               voxel_sizes=[(0.5, 0.5, 0.5), (2.0, 1.0, 1.0)], origins=[(0, 0, 0), (3, 2, 1)])
    for k, gb in enumerate([first, BATCHES["empty"], other, first]):
        attrs, extra, sets, h, o = reference(op_type, gb, np.random.default_rng(10 + k))
        want = expected_batch(sets, h, o)
        feeds, q = query_feeds(sets, gb.grid_count, np.random.default_rng(k))
        got = net.run({**dict(zip(schema.BUNDLE, gb.bundle())), **extra, **feeds})
        np.testing.assert_array_equal(got["new_grid_blob"], want.bundle()[0])
        np.testing.assert_array_equal(got["index"], want.ijk_to_index([q] * gb.grid_count, cumulative=True).jdata)


def test_the_new_bundle_equals_the_reference_byte_for_byte():
    """Every part of the new bundle (graph outputs of a model that is the op alone)."""
    gb = BATCHES["two"]
    attrs, extra, sets, h, o = reference("ConvGrid", gb, np.random.default_rng(3))
    new = [f"new_{n}" for n in schema.BUNDLE]
    node = helper.make_node("ConvGrid", list(schema.BUNDLE), new, name="down", domain=schema.DOMAIN, **attrs)
    outs = [helper.make_tensor_value_info(n, ELEM[a.dtype], [None] * a.ndim) for n, a in zip(new, gb.bundle())]
    m = helper.make_model(helper.make_graph([node], "g", grid_inputs("", gb), outs),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    net = luisaml.compile(m, grid_build="host")  # (batch_axis 'auto': a grid passed straight out is no batch)
    assert net.plan.symbol is None
    got = net.run(dict(zip(schema.BUNDLE, gb.bundle())))
    assert_same_bundle([got[n] for n in new], expected_batch(sets, h, o), sets)
    sess = luisaml.InferenceSession(m.SerializeToString())  # onnxruntime's API over the same
    assert [a.name for a in sess.get_inputs()] == list(schema.BUNDLE)
    assert_same_bundle(sess.run(None, dict(zip(schema.BUNDLE, gb.bundle()))), expected_batch(sets, h, o), sets)


def chain_model(gb: GridBatch) -> onnx.ModelProto:
    """ConvGrid 3/1 ('conv') of the bound grid, CoarsenedGrid 2 ('coarse') of that, IJKToIndex of QUERY
    voxels a grid over the result."""
    new1, new2 = [f"a_{n}" for n in schema.BUNDLE], [f"b_{n}" for n in schema.BUNDLE]
    n1 = helper.make_node("ConvGrid", list(schema.BUNDLE), new1, name="conv", domain=schema.DOMAIN,
                          kernel_size=[3, 3, 3], stride=[1, 1, 1])
    n2 = helper.make_node("CoarsenedGrid", new1, new2, name="coarse", domain=schema.DOMAIN, coarsening_factor=[2, 2, 2])
    q = [f"q_{p}" for p in schema.JAGGED]
    idx = helper.make_node("IJKToIndex", new2 + q, ["index"], name="idx", domain=schema.DOMAIN, cumulative=1)
    B = gb.grid_count
    ins = grid_inputs("", gb) + [helper.make_tensor_value_info("q_jdata", TensorProto.INT32, [B * QUERY, 3]),
                                 helper.make_tensor_value_info("q_joffsets", TensorProto.INT64, [B + 1]),
                                 helper.make_tensor_value_info("q_jidx", TensorProto.INT32, [B * QUERY]),
                                 helper.make_tensor_value_info("q_jlidx", TensorProto.INT32, [0, 1])]
    return helper.make_model(helper.make_graph([n1, n2, idx], "g", ins,
                                               [helper.make_tensor_value_info("index", TensorProto.INT64, [B * QUERY])]),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


def test_a_chain_of_host_steps_and_the_cache(monkeypatch):
    """CoarsenedGrid of a ConvGrid's grid: the second step reads the first's output. The same grid
    bound again runs no step; one changed voxel runs both again."""
    from luisaml.fvdb import host_steps

    gb = BATCHES["two"]
    B = gb.grid_count
    net = luisaml.compile(chain_model(gb), batch_axis=None, grid_build="host")
    assert [s.node.name for s in net.plan.host_steps.steps] == ["conv", "coarse"]
    import fvdb_reference as R

    runs = []
    real = host_steps.HostStep.run

    def counted(self, values, digest, device=None, then=None):
        before = self._last
        out = real(self, values, digest, device, then)
        runs.append(self._last is not before)
        return out

    monkeypatch.setattr(host_steps.HostStep, "run", counted)
    for k, grid in enumerate([gb, gb, GridBatch.from_ijk([np.concatenate([gb.ijk.unbind()[0], [[50, 50, 50]]]),
                                                          gb.ijk.unbind()[1]], gb.voxel_sizes, gb.origins)]):
        dilated = expected_batch([R.conv_grid(grid, 3, 1)[b] for b in range(B)], grid.voxel_sizes, grid.origins)
        sets, h, o = R.coarsened_grid(dilated, (2, 2, 2))
        feeds, qv = query_feeds(sets, B, np.random.default_rng(k))
        got = net.run({**dict(zip(schema.BUNDLE, grid.bundle())), **feeds})["index"]
        np.testing.assert_array_equal(got, expected_batch(sets, h, o).ijk_to_index([qv] * B, cumulative=True).jdata)
    assert runs == [True, True, False, False, True, True]


def test_two_networks_share_a_step_while_they_live_and_leave_nothing_when_dropped(monkeypatch):
    """The same ConvGrid in two networks (other node names) over the same bytes: the second takes the
    first's result from the process's registry (host_steps._LIVE); once both networks are dropped and
    collected, the registry holds nothing of their op, and no step of theirs lives on."""
    import gc
    import weakref

    from luisaml.fvdb import host_steps

    gb = BATCHES["two"]
    feeds = dict(zip(schema.BUNDLE, gb.bundle()))

    def model(prefix: str) -> onnx.ModelProto:
        new = [f"{prefix}_{n}" for n in schema.BUNDLE]
        node = helper.make_node("ConvGrid", list(schema.BUNDLE), new, name=f"{prefix}_topo", domain=schema.DOMAIN,
                                kernel_size=[3, 3, 3], stride=[2, 2, 2])
        outs = [helper.make_tensor_value_info(n, ELEM[a.dtype], [None] * a.ndim) for n, a in zip(new, gb.bundle())]
        return helper.make_model(helper.make_graph([node], "g", grid_inputs("", gb), outs),
                                 opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])

    builds = []
    real = host_steps.on_host
    monkeypatch.setattr(host_steps, "on_host", lambda *a: builds.append(a[0].name) or real(*a))
    first, second = (luisaml.compile(model(p), batch_axis=None, grid_build="host") for p in ("a", "b"))
    one, two = first.run(feeds), second.run(feeds)
    assert builds == ["a_topo"]  # the second network built nothing
    for n in schema.BUNDLE:
        assert np.array_equal(one[f"a_{n}"], two[f"b_{n}"]), n
    steps = [net.plan.host_steps.steps[0] for net in (first, second)]
    op = steps[0]._op(None)
    assert op == steps[1]._op(None) and host_steps._LIVE[op].value is not None
    dead = [weakref.ref(s) for s in steps]
    result = weakref.ref(steps[0]._last[1]["a_grid_blob"])
    del first, second, steps, one, two
    gc.collect()
    assert op not in host_steps._LIVE
    assert all(r() is None for r in dead) and result() is None


def test_errors_name_the_input_and_the_node():
    gb = BATCHES["two"]
    attrs, extra, sets, _, _ = reference("PrunedGrid", gb, np.random.default_rng(4))
    net = luisaml.compile(topology_model("PrunedGrid", attrs, gb, True), batch_axis=None, grid_build="host")
    feeds = {**dict(zip(schema.BUNDLE, gb.bundle())), **extra, **query_feeds(sets, 2, np.random.default_rng(0))[0]}
    with pytest.raises(InputNameError, match=r"input 'new_grid_blob' is not an input: node 'topo' "
                                             r"\(fvdb::PrunedGrid\) computes it before the kernels"):
        net.run({**feeds, "new_grid_blob": np.zeros(4, np.uint8)})
    with pytest.raises(InputNameError, match=r"missing input 'mask' \(node 'topo' \(fvdb::PrunedGrid\) reads it\)"):
        net.run({k: v for k, v in feeds.items() if k != "mask"})
    with pytest.raises(InputError, match=r"input 'mask': expected dtype bool, got int32"):
        net.run({**feeds, "mask": extra["mask"].astype(np.int32)})
    with pytest.raises(LuisamlError, match=r"node 'topo' \(fvdb::PrunedGrid\): mask 'mask' must be bool "
                                           rf"\[{gb.total_voxels}\].*run on the host"):
        net.run({**feeds, "mask": extra["mask"][:-1]})
    with pytest.raises(LuisamlError, match=r"node 'topo' \(fvdb::PrunedGrid\): .*run on the host"):
        blob = gb.bundle()[0].copy()
        blob[16:24] = 0  # the magic number
        net.run({**feeds, "grid_blob": blob})
    with pytest.raises(UsageError, match=r"cannot save this network: its grid ops run as steps before the kernels \(node 'topo'"):
        net.save("/tmp/never.lml")


def test_a_grid_op_over_a_tensor_the_kernels_compute_stays_a_compile_error():
    """A mask computed by a node (not an input): the host cannot run the step before the kernels."""
    gb = BATCHES["one"]
    new = [f"new_{n}" for n in schema.BUNDLE]
    flags = helper.make_node("Greater", ["score", "zero"], ["keep"], name="keep")
    node = helper.make_node("PrunedGrid", list(schema.BUNDLE) + ["keep"], new, name="prune", domain=schema.DOMAIN)
    ins = grid_inputs("", gb) + [helper.make_tensor_value_info("score", TensorProto.FLOAT, [gb.total_voxels])]
    g = helper.make_graph([flags, node], "g", ins, [helper.make_tensor_value_info("new_batch_offsets", TensorProto.INT64, [2])],
                          [onnx.numpy_helper.from_array(np.zeros((), np.float32), "zero")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    with pytest.raises(ModelError, match=r"node 'prune' \(fvdb::PrunedGrid\): input 'keep' is computed by the "
                                         r"kernels \(node 'keep' \(Greater\)\), but the grid this node reads is bound"):
        luisaml.compile(m, batch_axis=None)


def test_a_grid_count_only_partly_dynamic_is_named():
    """The grid count may be bound at run time (tests/fvdb/test_grid_count_bound.py), but then for the
    whole bundle: grid_byte_offsets dynamic beside a fixed voxel_sizes is a compile error naming both."""
    gb = BATCHES["two"]
    ins = grid_inputs("", gb)
    ins[1] = helper.make_tensor_value_info("grid_byte_offsets", TensorProto.INT64, ["B"])
    new = [f"new_{n}" for n in schema.BUNDLE]
    node = helper.make_node("DilatedGrid", list(schema.BUNDLE), new, name="grow", domain=schema.DOMAIN)
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("new_batch_offsets", TensorProto.INT64, [None])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    with pytest.raises(ModelError, match=r"node 'grow' \(fvdb::DilatedGrid\): its input 'grid_byte_offsets' "
                                         r"\(grid_byte_offsets\) has a grid count bound at run time \[B\], but "
                                         r"'voxel_sizes' \(voxel_sizes\) a fixed one \[2, 3\]"):
        luisaml.compile(m, batch_axis=None)


# ---- a U-Net that makes its coarse level from the fine grid it is given ----------------------------


@pytest.fixture(scope="module")
def unet_example():
    from util import example_module

    with example_module("sparse_unet.py") as module:
        yield module


@pytest.mark.parametrize("grid_build", ["host", "device"])
def test_a_unet_that_coarsens_its_bound_grid_equals_torch(unet_example, grid_build):
    """examples/sparse_unet.py's FineGridUNet: the fine grid is the only grid input, the coarse level
    fVDB's conv_grid of it inside the model, built by the host's builder or on the device. One
    network for three point clouds; torch tensors in give torch tensors out; inspect names the step."""
    torch.manual_seed(0)
    ex = unet_example
    model = ex.FineGridUNet(ex.sphere_points(8, np.random.default_rng(0)), 0.25, 4, 6, 3).eval()
    fine, _ = ex.grid_pair(ex.sphere_points(400, np.random.default_rng(1)), 0.25)
    proto = ex.export_fine_grid_unet(model, torch.zeros(int(fine[5][-1]), 4), fine)
    net = luisaml.compile(proto, grid_build=grid_build)
    assert [s.node.op_type for s in net.plan.host_steps.steps] == ["ConvGrid"]
    assert (net.plan.host_steps.device is not None) == (grid_build == "device")
    assert net.plan.symbol == "voxels" and net.plan.voxel_rows
    for points, seed in ((400, 1), (1500, 2), (120, 3)):
        fine, coarse = ex.grid_pair(ex.sphere_points(points, np.random.default_rng(seed)), 0.25)
        x = torch.randn(int(fine[5][-1]), 4)
        with torch.no_grad():
            want = model(x, *fine).numpy()
        got = net.run(ex.fine_feeds(x, fine))["out"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    where = "cuda" if net.backend == "cuda" else "cpu"  # (on CUDA: the zero-copy path)
    for _ in range(2):  # (the second run: the host step's last result, the same device tensors)
        got = net.run({k: torch.from_numpy(v).to(where) for k, v in ex.fine_feeds(x, fine).items()})["out"]
        assert isinstance(got, torch.Tensor) and got.device.type == where
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    from luisaml import report

    text = report.text(report.build(proto))
    assert "run before the kernels" in text and "(fvdb::ConvGrid) on the host when its inputs change" in text
    text = report.text(report.build(proto, target="cuda"))
    assert "(fvdb::ConvGrid) on the device when its inputs change" in text


def test_torch_inputs_bound_again_are_compared_not_copied_or_hashed():
    """The steps' torch inputs: the same tensors again (or equal ones) give the last run's host copy and
    result back without a hash; a changed one is copied and the step runs again; numpy inputs are hashed."""
    gb = BATCHES["two"]
    attrs, extra, *_ = reference("ConvGrid", gb, np.random.default_rng(0))
    net = luisaml.compile(topology_model("ConvGrid", attrs, gb, False), batch_axis=None, grid_build="host")
    steps, specs = net.plan.host_steps, {s.name: s for s in net.plan.inputs}
    hashed = []

    def digest(name, a):
        hashed.append(name)
        return name.encode() + a.tobytes()

    bundle = {n: torch.from_numpy(np.array(a)) for n, a in zip(schema.BUNDLE, gb.bundle())}
    first = steps.complete(bundle, specs, digest)
    again = steps.complete({n: t.clone() for n, t in bundle.items()}, specs, digest)
    assert hashed == [] and all(again[n] is first[n] for n in steps.made)  # (the same device tensors too)
    other = BATCHES["empty"]
    changed = steps.complete({n: torch.from_numpy(np.array(a)) for n, a in zip(schema.BUNDLE, other.bundle())},
                             specs, digest)
    sets, h, o = reference("ConvGrid", other, np.random.default_rng(0))[2:]
    np.testing.assert_array_equal(changed["new_grid_blob"].numpy(), expected_batch(sets, h, o).bundle()[0])
    steps.complete(dict(zip(schema.BUNDLE, gb.bundle())), specs, digest)
    assert sorted(hashed) == sorted(schema.BUNDLE)  # numpy: each input hashed once


def test_a_grid_from_any_number_of_points_feeds_a_query():
    """GridBatchFromPoints over points of a dynamic count (the device builder needs a fixed one) whose grid
    another node reads: a host step; one network for clouds of 100 and 1,000 points, against the
    reference voxels of fVDB's round(world_to_voxel(p))."""
    import fvdb_reference as R

    names, new, q = [f"p_{p}" for p in schema.JAGGED], [f"g_{n}" for n in schema.BUNDLE], [f"q_{p}" for p in schema.JAGGED]
    build = helper.make_node("GridBatchFromPoints", names + ["", ""], new, name="build", domain=schema.DOMAIN)
    idx = helper.make_node("IJKToIndex", new + q, ["index"], name="idx", domain=schema.DOMAIN, cumulative=1)
    rest = [("joffsets", TensorProto.INT64, [2]), ("jidx", TensorProto.INT32, [0]), ("jlidx", TensorProto.INT32, [0, 1])]
    ins = [helper.make_tensor_value_info(f"{j}_{n}", t, d)
           for j, data in (("p", (TensorProto.FLOAT, ["N", 3])), ("q", (TensorProto.INT32, [QUERY, 3])))
           for n, t, d in [("jdata", *data)] + rest]
    g = helper.make_graph([build, idx], "g", ins, [helper.make_tensor_value_info("index", TensorProto.INT64, [QUERY])])
    net = luisaml.compile(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)]))
    assert [s.node.name for s in net.plan.host_steps.steps] == ["build"]
    rng = np.random.default_rng(0)
    for n in (100, 1000):
        pts = rng.normal(0, 3, (n, 3)).astype(np.float32)
        qv = rng.integers(-6, 6, (QUERY, 3)).astype(np.int32)
        empty = {"jidx": np.zeros(0, np.int32), "jlidx": np.zeros((0, 1), np.int32)}
        got = net.run({"p_jdata": pts, "p_joffsets": np.array([0, n]), **{f"p_{k}": v for k, v in empty.items()},
                       "q_jdata": qv, "q_joffsets": np.array([0, QUERY]), **{f"q_{k}": v for k, v in empty.items()}})["index"]
        voxels = np.array(sorted(R.point_voxels(pts, np.ones(3), np.zeros(3), nearest=False)), np.int32)
        np.testing.assert_array_equal(got, GridBatch.from_ijk([voxels]).ijk_to_index([qv], cumulative=True).jdata)
        assert (got >= 0).any()


def test_a_grid_the_steps_and_the_kernels_both_read_is_hashed_once_a_run(monkeypatch):
    """A ConvGrid step and a query both read the bound grid (a query reads the new grid too): over numpy
    feeds the bound grid's blob is hashed once a run, the step's digest shared with the run's binding
    (one memo)."""
    import hashlib

    from luisaml import feeds as bound

    gb = BATCHES["two"]
    attrs, extra, sets, _, _ = reference("ConvGrid", gb, np.random.default_rng(0))
    new = [f"new_{n}" for n in schema.BUNDLE]
    q = [f"q_{p}" for p in schema.JAGGED]
    topo = helper.make_node("ConvGrid", list(schema.BUNDLE), new, name="topo", domain=schema.DOMAIN, **attrs)
    # a query over the bound grid itself too: the kernels read it, so its blob is bound (and hashed) as well
    both = [helper.make_node("IJKToIndex", bundle + q, [out], name=out, domain=schema.DOMAIN, cumulative=1)
            for bundle, out in ((new, "index"), (list(schema.BUNDLE), "index_in"))]
    m = topology_model("ConvGrid", attrs, gb, False)
    del m.graph.node[:]
    m.graph.node.extend([topo] + both)
    m.graph.output.append(helper.make_tensor_value_info("index_in", TensorProto.INT64, [2 * QUERY]))
    net = luisaml.compile(m, batch_axis=None, grid_build="host")
    hashed: list = []
    real = hashlib.blake2b
    monkeypatch.setattr(bound.hashlib, "blake2b", lambda data=b"", **kw: hashed.append(len(data)) or real(data, **kw))
    # (writeable copies: GridBatch's arrays are read-only, and a frozen array's digest outlives the run that
    # made it, so an earlier test's run may have hashed this blob already: feeds.bytes_digest)
    grid = {n: np.array(a) for n, a in zip(schema.BUNDLE, gb.bundle())}
    feeds = {**grid, **query_feeds(sets, 2, np.random.default_rng(0))[0]}
    net.run(feeds)
    blob = gb.bundle()[0].nbytes
    assert blob > bound.PARALLEL_HASH_BYTES  # (hashed as a tree of 1 MiB chunks: count those)
    # one pass over the bound blob, not one for the step and one for the kernels; the new grid's blob
    # (the step's output, also bound to the kernels) not hashed at all: its digest follows from the step's
    assert hashed.count(bound.HASH_CHUNK) == blob // bound.HASH_CHUNK


@pytest.mark.parametrize("grid_build", ["host", "device"])
@pytest.mark.parametrize("op_type, attrs, want", [
    ("DilatedGrid", dict(dilation=1000), r"dilation 1000: a grid of at least 8,012,006,001 voxels .* kernels index "
                                         r"with 32-bit integers"),
    ("RefinedGrid", dict(subdiv_factor=1000), r"subdiv_factor \[1000, 1000, 1000\] of [\d,]+ voxels: a grid of at "
                                              r"least [\d,]+ voxels .*(32-bit|luisaml\.Limits\.tensor_bytes)"),
])
def test_a_grid_past_the_limits_is_a_limit_error_naming_the_node_before_any_work(op_type, attrs, want, grid_build):
    """issue 25: DilatedGrid(1000) / RefinedGrid(1000) over a grid bound at run time ran 20-60 s into numpy's
    MemoryError; the result's size is predicted from the bound grid's voxel counts first (a dilation by n holds
    at least the (2n + 1)^3 cube, a refinement by f f^3 voxels a voxel) and refused with a LimitError. The same
    network still builds a small grid as the reference does (the other tests of this file)."""
    import time

    from luisaml.errors import LimitError

    gb = BATCHES["two"]
    model = topology_model(op_type, attrs, gb, False)
    net = luisaml.compile(model, batch_axis=None, grid_build=grid_build)
    sets = reference(op_type, gb, np.random.default_rng(4))[2]  # (for the query's feeds)
    feeds = {**dict(zip(schema.BUNDLE, gb.bundle())), **query_feeds(sets, 2, np.random.default_rng(0))[0]}
    t = time.perf_counter()
    with pytest.raises(LimitError, match=rf"node 'topo' \(fvdb::{op_type}\): {want}"):
        net.run(feeds)
    assert time.perf_counter() - t < 5.0
