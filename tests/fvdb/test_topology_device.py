"""The topology ops over grids bound at run time built on the device (grid_build="device":
luisaml/fvdb/host_steps.py DeviceBuilds, operators/fvdb/topology_device.py): one compiled network builds
each op's grid from whatever grid a run binds, and the new bundle equals, byte for byte in all seven
arrays, the builder's bundle of fvdb_reference's voxel sets (loops over voxel sets, fVDB's
section-3 conventions): over two grids with negative coordinates and a far voxel, an empty grid, a
single voxel, masks that keep nothing, grids past the first capacity bucket, and four grids a batch
whose blob passes its first capacity (one wait a build; two with the host's layout). On CUDA
(LUISAML_BACKEND=cuda) the same tests run there: the arrays are integers, bytes and the host's
doubles on either backend."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import luisaml
from luisaml.fvdb import host_steps
from luisaml.errors import InputError, RunError, UsageError
from luisaml.fvdb import GridBatch
from luisaml.opsets import fvdb as schema

import fvdb_reference as R
from fvdb_reference import ELEM
from test_host_steps import chain_model, grid_inputs, query_feeds
from test_ops_topology import BATCHES, TOPOLOGY, assert_same_bundle, expected_batch, reference

NEW = [f"new_{n}" for n in schema.BUNDLE]


def op_model(op_type: str, attrs: dict, gb: GridBatch, mask: bool):
    """op_type alone over a bound grid (and mask), its new bundle the outputs."""
    ins = grid_inputs("", gb) + ([helper.make_tensor_value_info("mask", TensorProto.BOOL, ["mask rows"])] if mask else [])
    node = helper.make_node(op_type, list(schema.BUNDLE) + (["mask"] if mask else []), NEW, name="topo",
                            domain=schema.DOMAIN, **attrs)
    outs = [helper.make_tensor_value_info(n, ELEM[a.dtype], [None] * a.ndim) for n, a in zip(NEW, gb.bundle())]
    return helper.make_model(helper.make_graph([node], "g", ins, outs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


def grids(rng) -> list[GridBatch]:
    """Two-grid batches: the reference's, one with an empty grid, one past the first bucket (1024
    voxels) with different transforms, one of a single voxel beside an empty grid."""
    big = GridBatch.from_ijk([rng.integers(-40, 40, (2500, 3)).astype(np.int32), np.array([[7, -7, 7]], np.int32)],
                             voxel_sizes=[(0.5, 0.5, 0.5), (2.0, 1.0, 1.0)], origins=[(0, 0, 0), (3, 2, 1)])
    single = GridBatch.from_ijk([np.array([[-3, 0, 5]], np.int32), np.zeros((0, 3), np.int32)])
    return [BATCHES["two"], BATCHES["empty"], big, single, BATCHES["two"]]


@pytest.mark.parametrize("op_type", TOPOLOGY)
def test_one_network_builds_each_topology_on_the_device(op_type):
    rng = np.random.default_rng(5)
    first = BATCHES["two"]
    attrs, extra, *_ = reference(op_type, first, rng)
    net = luisaml.compile(op_model(op_type, attrs, first, bool(extra)), batch_axis=None, grid_build="device")
    steps = net.plan.host_steps
    assert steps is not None and steps.device is not None and net.plan.ops == []
    for k, gb in enumerate(grids(rng)):
        attrs, extra, sets, h, o = reference(op_type, gb, np.random.default_rng(20 + k))
        got = net.run({**dict(zip(schema.BUNDLE, gb.bundle())), **extra})
        assert_same_bundle([got[n] for n in NEW], expected_batch(sets, h, o), sets)
    # a network per power of two of the source's voxels (and per pass input for the dilation)
    assert {key[1] for key in steps.device.networks} >= {1024, 4096}


@pytest.mark.parametrize("op_type,attrs", [
    ("ConvGrid", {"kernel_size": [2, 2, 2], "stride": [2, 2, 2]}),  # the kernel fits the stride: one candidate
    ("ConvGrid", {"kernel_size": [3, 1, 2], "stride": [1, 2, 1]}),
    ("ConvTransposeGrid", {"kernel_size": [3, 3, 3], "stride": [1, 1, 1]}),
    ("RefinedGrid", {"subdiv_factor": [1, 2, 1]}),  # no mask: every voxel refined
    ("DilatedGrid", {"dilation": 0}),
])
def test_the_geometries_equal_the_reference(op_type, attrs):
    gb = grids(np.random.default_rng(3))[2]
    net = luisaml.compile(op_model(op_type, attrs, gb, False), batch_axis=None, grid_build="device")
    if op_type == "ConvGrid":
        sets = R.conv_grid(gb, attrs["kernel_size"], attrs["stride"])
        h, o = gb.voxel_sizes * np.array(attrs["stride"]), gb.origins
    elif op_type == "ConvTransposeGrid":
        sets, h, o = R.conv_grid(gb, attrs["kernel_size"], attrs["stride"], transposed=True), gb.voxel_sizes, gb.origins
    elif op_type == "RefinedGrid":
        sets, h, o = R.refined_grid(gb, attrs["subdiv_factor"], None)
    else:
        sets, h, o = R.dilated_grid(gb, 0), gb.voxel_sizes, gb.origins
    got = net.run(dict(zip(schema.BUNDLE, gb.bundle())))
    assert_same_bundle([got[n] for n in NEW], expected_batch(sets, h, o), sets)


def test_four_grids_two_empty_one_wide_wait_once_a_build(monkeypatch):
    """ConvGrid 2/2 over batches of four grids, two of them empty, one spread over 8 upper nodes (a blob
    past its first capacity: the first build runs again): the reference's bundle, and one wait a build
    with the grids laid out on the device where the host's layout waited twice (the switch's A/B)."""
    from luisaml import counts
    from luisaml.operators.fvdb.topology import DeviceGridBuild

    rng = np.random.default_rng(8)

    def batch(k):
        near = rng.integers(-20, 20, (300 + 50 * k, 3)).astype(np.int32)
        wide = np.concatenate([near[:40], rng.choice([-5000, 5000], (16, 3)).astype(np.int32) + k])
        empty = np.zeros((0, 3), np.int32)
        return GridBatch.from_ijk([near, empty, wide, empty], voxel_sizes=[(0.5, 0.5, 0.5)] * 4,
                                  origins=[(1, 2, 3)] * 4)

    attrs = {"kernel_size": [2, 2, 2], "stride": [2, 2, 2]}
    for on_device, waits in ((True, 1), (False, 2)):
        monkeypatch.setattr(DeviceGridBuild, "LAYOUT_ON_DEVICE", on_device)
        monkeypatch.setattr(host_steps.DeviceBuilds, "_shared", {})  # (the switch changes the bucket's kernels)
        first = batch(0)
        net = luisaml.compile(op_model("ConvGrid", attrs, first, False), batch_axis=None, grid_build="device")
        for k in range(3):
            gb = batch(k)
            with counts.measure() as c:
                got = net.run(dict(zip(schema.BUNDLE, gb.bundle())))
            sets = R.conv_grid(gb, attrs["kernel_size"], attrs["stride"])
            assert_same_bundle([got[n] for n in NEW], expected_batch(sets, gb.voxel_sizes * 2, gb.origins), sets)
            build = next(iter(net.plan.host_steps.device.networks.values()))
            assert c.syncs == waits + (build.launcher.reruns if k == 0 else 0), (on_device, k, c)
        assert build.launcher.reruns == (1 if on_device else 0)


def test_a_chain_feeds_a_query_as_the_host_does():
    """ConvGrid then CoarsenedGrid on the device, IJKToIndex over the result: the indices of the
    reference grid, and the same as grid_build='host' gives."""
    gb = BATCHES["two"]
    B = gb.grid_count
    m = chain_model(gb)
    device = luisaml.compile(m, batch_axis=None, grid_build="device")
    host = luisaml.compile(m, batch_axis=None, grid_build="host")
    assert host.plan.host_steps.device is None
    grown = expected_batch([R.conv_grid(gb, 3, 1)[b] for b in range(B)], gb.voxel_sizes, gb.origins)
    sets, h, o = R.coarsened_grid(grown, (2, 2, 2))
    feeds, qv = query_feeds(sets, B, np.random.default_rng(0))
    feeds = {**dict(zip(schema.BUNDLE, gb.bundle())), **feeds}
    want = expected_batch(sets, h, o).ijk_to_index([qv] * B, cumulative=True).jdata
    np.testing.assert_array_equal(device.run(feeds)["index"], want)
    np.testing.assert_array_equal(host.run(feeds)["index"], want)


def test_errors_name_the_node_and_the_input():
    gb = BATCHES["two"]
    net = luisaml.compile(op_model("PrunedGrid", {}, gb, True), batch_axis=None, grid_build="device")
    with pytest.raises(InputError, match="topo.*active voxels in all, but the voxel data has 3 rows"):
        net.run({**dict(zip(schema.BUNDLE, gb.bundle())), "mask": np.ones(3, bool)})
    # refined coordinates past int32: the device flags it, the run names the node
    far = GridBatch.from_ijk([np.array([[2**30, 0, 0]], np.int32), np.array([[0, 0, 0]], np.int32)])
    net = luisaml.compile(op_model("RefinedGrid", {"subdiv_factor": [2, 2, 2]}, far, False), batch_axis=None,
                          grid_build="device")
    with pytest.raises(RunError, match="topo.*do not fit int32"):
        net.run(dict(zip(schema.BUNDLE, far.bundle())))
    with pytest.raises(UsageError, match="grid_build"):
        luisaml.compile(op_model("PrunedGrid", {}, gb, True), batch_axis=None, grid_build="gpu")


def test_the_device_network_is_not_a_host_step_and_auto_follows_the_backend():
    """The node the device builds carries voxel_capacity; split leaves it in its graph. 'auto' is the
    device on CUDA, the host's builder on the CPU backend."""
    gb = BATCHES["two"]
    m = op_model("CoarsenedGrid", {"coarsening_factor": [2, 2, 2]}, gb, False)
    net = luisaml.compile(m, batch_axis=None)
    assert (net.plan.host_steps.device is not None) == (net.backend == "cuda")
    node = host_steps.Node("topo", "CoarsenedGrid", schema.DOMAIN, list(schema.BUNDLE), NEW)
    node.attrs = {"coarsening_factor": [2, 2, 2]}
    one = host_steps._build_model(node, node.attrs, 1024, list(gb.bundle()), host_steps._BOUND_ROWS)
    assert host_steps.split(one, lambda op_type, domain: None) is None  # (no step: no operator asked)


CONSTRUCTORS = ["GridBatchFromIJK", "GridBatchFromPoints", "GridBatchFromNearestVoxelsToPoints"]


@pytest.mark.parametrize("op_type", CONSTRUCTORS)
def test_a_grid_from_any_number_of_points_builds_on_the_device(op_type):
    """GridBatchFrom* over jdata of a dynamic count (a step: the network of the node alone counts the
    points by joffsets): two grids, clouds of 0 to 3,000 points (two capacities), voxel sizes and
    origins bound at run time that float32 does not hold; every bundle array equal to the host
    builder's, the voxel sizes and origins its doubles."""
    from test_grid_build_device import host_bundle

    ints = op_type == "GridBatchFromIJK"
    elem = TensorProto.INT32 if ints else TensorProto.FLOAT
    names = ["jdata", "joffsets", "jidx", "jlidx", "voxel_sizes", "origins"]
    ins = [helper.make_tensor_value_info("jdata", elem, ["N", 3]),
           helper.make_tensor_value_info("joffsets", TensorProto.INT64, [3]),
           helper.make_tensor_value_info("jidx", TensorProto.INT32, [0]),
           helper.make_tensor_value_info("jlidx", TensorProto.INT32, [0, 1]),
           helper.make_tensor_value_info("voxel_sizes", TensorProto.DOUBLE, [2, 3]),
           helper.make_tensor_value_info("origins", TensorProto.DOUBLE, [2, 3])]
    node = helper.make_node(op_type, names, NEW, name="build", domain=schema.DOMAIN)
    outs = [helper.make_tensor_value_info(n, ELEM[np.dtype(t)], [None] * d)
            for n, t, d in zip(NEW, ["uint8", "int64", "float64", "float64", "int32", "int64", "int32"],
                               [1, 1, 2, 2, 1, 1, 1])]
    m = helper.make_model(helper.make_graph([node], "g", ins, outs),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    net = luisaml.compile(m, batch_axis=None, grid_build="device")
    assert [s.node.name for s in net.plan.host_steps.steps] == ["build"]
    rng = np.random.default_rng(7)
    h, o = np.array([[0.1, 0.2, 0.3], [1.0, 0.5, 0.25]]), np.array([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0]])
    for n0, n1 in ((100, 37), (0, 1), (2000, 1000), (0, 0)):
        pts = rng.normal(0, 2, (n0 + n1, 3))
        jdata = np.round(pts * 3).astype(np.int32) if ints else pts.astype(np.float32)
        offsets = np.array([0, n0, n0 + n1], np.int64)
        got = net.run({"jdata": jdata, "joffsets": offsets, "jidx": np.zeros(0, np.int32),
                       "jlidx": np.zeros((0, 1), np.int32), "voxel_sizes": h, "origins": o})
        want = host_bundle(op_type, jdata, offsets, h, o)
        for k, name in enumerate(NEW):
            assert got[name].dtype == want[k].dtype and got[name].shape == want[k].shape, name
            np.testing.assert_array_equal(got[name], want[k], err_msg=name)
    assert {key[1] for key in net.plan.host_steps.device.networks} == {1024, 4096}
    with pytest.raises(InputError, match=r"node 'build' .*joffsets must be int64 \[B \+ 1\] rising from 0 to 3"):
        net.run({"jdata": np.zeros((3, 3), jdata.dtype), "joffsets": np.array([0, 2, 1], np.int64), "jidx": np.zeros(0, np.int32),
                 "jlidx": np.zeros((0, 1), np.int32), "voxel_sizes": h, "origins": o})


def test_a_grid_past_what_a_device_build_holds_is_built_on_the_host(monkeypatch, caplog):
    """A capacity whose candidates exceed MAX_KEYS (a dilation of a large grid: 27 a voxel) falls back
    to the host's builder with a warning naming the node; the bundle is the reference's all the same."""
    from luisaml import registry

    cls = registry.resolve("DilatedGrid", schema.DOMAIN, 1)
    monkeypatch.setattr(cls, "MAX_KEYS", 1024 * 27 - 1)  # (the first capacity, 1024 voxels, is past it)
    gb = BATCHES["two"]
    net = luisaml.compile(op_model("DilatedGrid", {"dilation": 1}, gb, False), batch_axis=None, grid_build="device")
    with caplog.at_level("WARNING", logger="luisaml"):
        got = net.run(dict(zip(schema.BUNDLE, gb.bundle())))
    assert "node 'topo' (fvdb::DilatedGrid): a grid of 1,024 voxels or points is past what a device build holds" \
        in caplog.text
    sets = R.dilated_grid(gb, 1)
    assert_same_bundle([got[n] for n in NEW], expected_batch(sets, gb.voxel_sizes, gb.origins), sets)
    assert not net.plan.host_steps.device.networks


def test_a_model_compiled_again_compiles_no_bucket_twice(monkeypatch):
    """The bucket networks are the process's: a second compile of the model (or another model with the
    same node) runs its first grid without compiling one; other limits compile their own."""
    from luisaml import runtime

    compiled = []
    real = runtime._compile_grid_step
    monkeypatch.setattr(runtime, "_compile_grid_step", lambda *a: compiled.append(a[0].graph.name) or real(*a))
    gb = BATCHES["two"]
    m = op_model("CoarsenedGrid", {"coarsening_factor": [2, 1, 2]}, gb, False)
    sets, h, o = R.coarsened_grid(gb, (2, 1, 2))
    for limits in (None, None, luisaml.Limits(fold_bytes=1 << 20)):
        net = luisaml.compile(m, batch_axis=None, grid_build="device", limits=limits)
        got = net.run(dict(zip(schema.BUNDLE, gb.bundle())))
        assert_same_bundle([got[n] for n in NEW], expected_batch(sets, h, o), sets)
    assert len(compiled) == 2


# (kernel, stride) of ConvGrid: odd and even kernels over strides 1, 2, 3 and past the kernel, anisotropic
CONV_GEOMETRIES = [((3, 3, 3), (2, 2, 2)), ((4, 4, 4), (2, 2, 2)), ((5, 5, 5), (2, 2, 2)), ((5, 5, 5), (3, 3, 3)),
                   ((3, 3, 3), (1, 1, 1)), ((2, 2, 2), (3, 3, 3)), ((1, 1, 1), (2, 2, 2)), ((3, 4, 1), (2, 3, 2)),
                   ((5, 2, 3), (2, 1, 3)), ((4, 3, 2), (3, 2, 1))]


def _taps_that_divide(cand, c: tuple[int, int, int]) -> set:
    """The candidate voxels of source voxel c as the device kernel forms them (Candidates.m, the strided axes'
    taps t = r + div * u), in numbers."""
    axes = []
    for a in range(3):
        y = c[a] * cand.scale[a] + cand.base[a]
        if cand.strided(a):
            q0, r = divmod(y, cand.div[a])
            axes.append([q0 - u for u in range(cand.m[a]) if r + cand.div[a] * u < cand.n[a]])
        else:
            xs = [y + cand.step[a] * u for u in range(cand.n[a])]
            axes.append([x // cand.div[a] for x in xs if x % cand.div[a] < cand.keep[a]])
    return {(i, j, k) for i in axes[0] for j in axes[1] for k in axes[2]}


@pytest.mark.parametrize("op_type,attrs", [("ConvGrid", {"kernel_size": list(k), "stride": list(s)})
                                           for k, s in CONV_GEOMETRIES]
                         + [("ConvTransposeGrid", {"kernel_size": [3, 2, 3], "stride": [2, 1, 2]}),
                            ("RefinedGrid", {"subdiv_factor": [2, 1, 3]}), ("DilatedGrid", {"dilation": 1}),
                            ("CoarsenedGrid", {"coarsening_factor": [2, 3, 1]}), ("PrunedGrid", {})])
def test_the_candidates_are_the_host_rules_voxels_and_no_more_keys(op_type, attrs):
    """Every form's candidates of a source voxel, over coordinates of every parity (negative too), are the
    voxels the host's rule gives (fvdb_reference), and a voxel emits at most Candidates.count keys: for
    ConvGrid prod ceil(k_a / s_a) (8 for 3/2, not the 27 taps), issue 28's scratch."""
    from luisaml.operators.fvdb.topology_device import candidates

    cand = candidates(op_type, attrs)
    rng = np.random.default_rng(11)
    for c in [tuple(int(v) for v in row) for row in rng.integers(-9, 10, (300, 3))]:
        gb = GridBatch.from_ijk([np.array([c], np.int32)])
        if op_type in ("ConvGrid", "ConvTransposeGrid"):
            want = R.conv_grid(gb, attrs["kernel_size"], attrs["stride"], transposed=op_type == "ConvTransposeGrid")[0]
        elif op_type == "RefinedGrid":
            want = R.refined_grid(gb, attrs["subdiv_factor"], None)[0][0]
        elif op_type == "DilatedGrid":
            want = R.dilated_grid(gb, 1)[0]
        elif op_type == "CoarsenedGrid":
            want = R.coarsened_grid(gb, attrs["coarsening_factor"])[0][0]
        else:
            want = {c}
        got = _taps_that_divide(cand, c)
        assert got == {tuple(int(v) for v in w) for w in want}, (c, cand)
    if op_type == "ConvGrid":
        k, s = attrs["kernel_size"], attrs["stride"]
        assert cand.count == (1 if all(a <= b for a, b in zip(k, s)) else int(np.prod([-(-a // b) for a, b in zip(k, s)])))


@pytest.mark.parametrize("kernel,stride", CONV_GEOMETRIES)
def test_conv_grids_of_many_kernels_and_strides_build_the_host_builders_bytes(kernel, stride):
    """ConvGrid built on the device over random clouds (dense enough that every parity of every axis has
    voxels; two grids, negative coordinates) is, byte for byte, the host builder's bundle: a candidate
    dropped (a tap left out of ceil(k / s)) loses voxels there."""
    rng = np.random.default_rng(sum(kernel) * 7 + sum(stride))

    def batch(k):
        a = rng.integers(-12, 12, (500 + 200 * k, 3)).astype(np.int32)
        b = rng.integers(-30, 5, (60, 3)).astype(np.int32)
        return GridBatch.from_ijk([a, b], voxel_sizes=[(0.5, 0.5, 0.5), (1.0, 2.0, 1.0)], origins=[(0, 0, 0), (1, -2, 3)])

    attrs = {"kernel_size": list(kernel), "stride": list(stride)}
    first = batch(0)
    dev = luisaml.compile(op_model("ConvGrid", attrs, first, False), batch_axis=None, grid_build="device")
    host = luisaml.compile(op_model("ConvGrid", attrs, first, False), batch_axis=None, grid_build="host")
    for k in range(2):
        feeds = dict(zip(schema.BUNDLE, batch(k).bundle()))
        got, want = dev.run(feeds), host.run(feeds)
        for n in NEW:
            assert got[n].dtype == want[n].dtype and got[n].tobytes() == want[n].tobytes(), (n, k)
