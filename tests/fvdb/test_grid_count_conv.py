"""Grid batches of any count (issue 28, item 2) through the ops that need the count inside their kernels:
the sparse convolution's neighbour maps (SparseConvKernelMap, PoolingMap), the topology ops (host
steps: CoarsenedGrid, RefinedGrid, DilatedGrid, PrunedGrid, ConvGrid, ConvTransposeGrid and a
GridBatchFrom*) and InjectToDense. Each model is exported with the grid count dynamic (grid_byte_offsets
[G], voxel_sizes and origins [G, 3], batch_offsets and joffsets [G+1], as the fVDB proposal exports
them), compiled once, and run over batches of 1, 2 and 3 grids, equal to the torch functions
(luisaml.fvdb.torch_ops) on each; a count input that disagrees with its blob is an InputError naming it
(operators/fvdb/grid_count.py)."""
import io

import numpy as np
import onnx
import pytest
import torch

import luisaml
from luisaml.errors import InputError, LuisamlError
from luisaml.fvdb import GridBatch
from luisaml.fvdb import torch_ops as F
from luisaml.fvdb.torch_dense import inject_to_dense
from luisaml.opsets import fvdb as schema

GRID = [f"g_{n}" for n in schema.BUNDLE]
SIZE = {"g_grid_blob": "nbytes", "g_leaf_batch_indices": "leaves", "g_list_indices": "lists"}  # any grid
COUNT = {"g_grid_byte_offsets": "G", "g_voxel_sizes": "G", "g_origins": "G", "g_batch_offsets": "G1"}


def shells(count: int, seed: int, n: int = 300) -> GridBatch:
    """count surface-like grids of different voxel counts, voxel sizes and origins."""
    rng = np.random.default_rng(seed)
    ijk = []
    for b in range(count):
        p = rng.normal(size=(n + 90 * b, 3))
        ijk.append((np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * (3.5 + 1.5 * b)) + 2 * b).astype(np.int32))
    return GridBatch.from_ijk(ijk, voxel_sizes=[[0.1 + 0.02 * b] * 3 for b in range(count)],
                              origins=[[0.01 * b, -0.02, 0.03 * b] for b in range(count)])


def export(module, args, names, outputs, dynamic) -> onnx.ModelProto:
    buf = io.BytesIO()
    F.export_onnx(module, args, buf, input_names=names, output_names=outputs,
                  dynamic_axes={k: {0: v} for k, v in dynamic.items()})
    m = onnx.load_from_string(buf.getvalue())
    dims = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in m.graph.input}
    assert all(dims[k][0] == v for k, v in dynamic.items() if k in dims)  # the count is symbolic in the export
    return m


def grid_feeds(gb: GridBatch) -> dict[str, np.ndarray]:
    return dict(zip(GRID, gb.bundle()))


def assert_close(got, want, what: str) -> None:
    scale = max(float(np.abs(want).max(initial=0)), 1e-30)
    assert got.shape == want.shape, what
    assert float(np.abs(got - want).max(initial=0)) / scale <= 1e-5, what


# ---- a sparse network: maps, SparseConv3d, a strided level on a topology op's grid, a pooling map ------


class Net(torch.nn.Module):
    """A 3x3x3 layer, a stride-2 layer onto ConvGrid's coarse grid, a 3x3x3 layer there, and a max pool
    from the fine grid to the coarse one: three SparseConvKernelMaps and a PoolingMap over a grid
    batch of any count, and a topology op (a host step) feeding them."""

    def __init__(self):
        super().__init__()
        self.c1, self.down, self.c2 = F.SparseConv3d(3, 4, 3), F.SparseConv3d(4, 5, 2), F.SparseConv3d(5, 5, 3)

    def forward(self, x, *fine):
        h = torch.relu(self.c1(x, F.sparse_conv_kernel_map(fine, fine, 3)))
        coarse = F.conv_grid(fine, 2, 2)
        d = self.down(h, F.sparse_conv_kernel_map(fine, coarse, 2, 2))
        y = torch.relu(self.c2(d, F.sparse_conv_kernel_map(coarse, coarse, 3)))
        return h, y, F.max_pool(fine, coarse, h, 2)


NET_OUT = ["h", "y", "pooled"]


def net_model(count: dict) -> onnx.ModelProto:
    torch.manual_seed(0)
    example = shells(2, 0)
    return export(NET.eval(), (torch.zeros(example.total_voxels, 3), *F.bundle_tensors(example)), ["x"] + GRID,
                  NET_OUT, {"x": "V", **SIZE, **count})


torch.manual_seed(0)
NET = Net()


@pytest.fixture(scope="module")
def conv_net():
    """The network compiled once from the export of a 2-grid example with the grid count dynamic."""
    return luisaml.compile(net_model(COUNT))


def net_feeds(gb: GridBatch, seed: int) -> tuple[dict, torch.Tensor]:
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((gb.total_voxels, 3)).astype(np.float32))
    return {"x": x.numpy(), **grid_feeds(gb)}, x


def check_net(net, gb: GridBatch, seed: int) -> None:
    feeds, x = net_feeds(gb, seed)
    out = net.run(feeds)
    with torch.no_grad():
        want = [t.numpy() for t in NET(x, *F.bundle_tensors(gb))]
    for name, w in zip(NET_OUT, want):
        assert_close(out[name], w, f"{name} over {gb.grid_count} grid(s)")


def test_a_sparse_network_runs_grid_batches_of_one_two_and_three_grids(conv_net):
    specs = {s.name: s for s in conv_net.plan.inputs}
    assert all(specs[n].rows is not None for n in COUNT)  # bound at run time, not compiled per count
    assert any(d.compute.__name__ == "paired_grid_count" for d in conv_net.plan.derived)
    ops = [n.op_type for n, _ in conv_net.plan.ops]
    assert ops.count(schema.KERNEL_MAP) == 3 and ops.count("PoolingMap") == 1
    for count, seed in ((1, 1), (2, 2), (3, 3), (1, 4)):
        gb = shells(count, seed)
        assert gb.grid_count == count
        check_net(conv_net, gb, seed)


def test_the_static_count_network_agrees_bit_for_bit(conv_net):
    """The grid count fixed in the export compiles as before (no count bound at run time, no derived
    count), and both networks give the same bits over the same 2-grid batch."""
    static = luisaml.compile(net_model({}))
    assert not any(d.any_rows for d in static.plan.derived) and "ngrids" not in static.source
    assert "ngrids" in conv_net.source
    feeds, _ = net_feeds(shells(2, 5), 5)
    a, b = static.run(feeds), conv_net.run(feeds)
    for name in NET_OUT:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("name, bad", [
    ("g_voxel_sizes", lambda f: f["g_voxel_sizes"][:1]),
    ("g_origins", lambda f: np.concatenate([f["g_origins"], f["g_origins"][:1]])),
    ("g_batch_offsets", lambda f: f["g_batch_offsets"][:-1]),
    ("g_grid_byte_offsets", lambda f: f["g_grid_byte_offsets"][:1]),
])
def test_a_count_input_that_disagrees_with_the_blob_is_named(conv_net, name, bad):
    """The topology step (ConvGrid) reads the bundle first: its check names the input, the rows and
    the blob's grids (the maps' own checks say the same of their bundles)."""
    good, _ = net_feeds(shells(2, 6), 6)
    rows = len(bad(good))
    want = 3 if name == "g_batch_offsets" else 2
    with pytest.raises(InputError, match=rf"input '{name}' has {rows} rows, but grid_blob 'g_grid_blob' holds 2 "
                                         rf"grid\(s\): expected {want}"):
        conv_net.run({**good, name: bad(good)})
    check_net(conv_net, shells(2, 6), 6)  # the network still runs a good batch afterwards


class Pair(torch.nn.Module):
    """A layer over a map between two bundles (a_: the input grids, b_: the output grids)."""

    def __init__(self):
        super().__init__()
        self.conv = F.SparseConv3d(2, 3, 3)

    def forward(self, x, *grids):
        return self.conv(x, F.sparse_conv_kernel_map(grids[:7], grids[7:], 3))


def test_a_map_over_two_bundles_of_different_counts_is_named():
    """A kernel map pairs grid b of its input bundle with grid b of its output bundle: two bundles
    bound with different counts (each consistent with its own blob) are an InputError naming both."""

    torch.manual_seed(1)
    mod, example = Pair().eval(), shells(2, 0)
    names = ["x"] + [f"a_{n}" for n in schema.BUNDLE] + [f"b_{n}" for n in schema.BUNDLE]
    dynamic = {"x": "V", **{f"{p}{k[2:]}": v for p in ("a_", "b_") for k, v in {**SIZE, **COUNT}.items()}}
    net = luisaml.compile(export(mod, (torch.zeros(example.total_voxels, 2), *F.bundle_tensors(example),
                                       *F.bundle_tensors(example)), names, ["y"], dynamic))
    for count in (1, 3):  # the same grids in both bundles: a same-grid map
        gb = shells(count, 10 + count)
        x = torch.randn(gb.total_voxels, 2)
        feeds = {"x": x.numpy(), **{f"{p}{n}": a for p in ("a_", "b_") for n, a in zip(schema.BUNDLE, gb.bundle())}}
        with torch.no_grad():
            want = mod(x, *F.bundle_tensors(gb), *F.bundle_tensors(gb)).numpy()
        assert_close(net.run(feeds)["y"], want, f"{count} grid(s)")
    two, three = shells(2, 7), shells(3, 7, n=30)
    feeds = {"x": np.zeros((two.total_voxels, 2), np.float32), **{f"a_{n}": a for n, a in zip(schema.BUNDLE, two.bundle())},
             **{f"b_{n}": a for n, a in zip(schema.BUNDLE, three.bundle())}}
    with pytest.raises(InputError, match=r"input 'b_grid_byte_offsets' has 3 rows, but 'a_grid_byte_offsets' has 2"):
        net.run(feeds)


def test_device_builds_over_grid_batches_of_any_count():
    """grid_build="device" (CUDA's default): the topology step's network is compiled per power of two
    of the voxels and per grid count (its scratch and read-back are sized by the count); the main
    network, compiled once, reads whatever count the step built."""
    net = luisaml.compile(net_model(COUNT), grid_build="device")
    for count, seed in ((3, 8), (1, 9)):
        check_net(net, shells(count, seed), seed)


def test_a_count_partly_dynamic_across_a_maps_bundles_is_named():
    """The input bundle's count bound at run time and the output bundle's fixed: a kernel map pairs
    grid b with grid b, so the compile error says which is which."""
    example = shells(2, 0)
    names = ["x"] + [f"a_{n}" for n in schema.BUNDLE] + [f"b_{n}" for n in schema.BUNDLE]
    dynamic = {"x": "V", **{f"{p}{k[2:]}": v for p in ("a_", "b_") for k, v in SIZE.items()}}
    dynamic.update({f"a_{k[2:]}": v for k, v in COUNT.items()})
    m = export(Pair().eval(), (torch.zeros(example.total_voxels, 2), *F.bundle_tensors(example),
                               *F.bundle_tensors(example)), names, ["y"], dynamic)
    with pytest.raises(LuisamlError, match=r"the input bundle's grid count is bound at run time, the output bundle's "
                                           "is fixed"):
        luisaml.compile(m)


# ---- the topology ops: host steps over a grid batch of any count -------------------------------------


class Topology(torch.nn.Module):
    """Every topology op over one grid batch; their bundles are the outputs (passed out of the network)."""

    def forward(self, mask, *g):
        return (*F.coarsened_grid(g, 2), *F.refined_grid(g, 2, mask), *F.dilated_grid(g, 1), *F.pruned_grid(g, mask),
                *F.conv_grid(g, 3, 2), *F.conv_transpose_grid(g, 2, 2))


TOPOLOGY = ("coarsened", "refined", "dilated", "pruned", "conv", "conv_transpose")
TOPOLOGY_OUT = [f"{op}_{n}" for op in TOPOLOGY for n in schema.BUNDLE]


@pytest.fixture(scope="module")
def topology_net():
    example = shells(2, 0, n=60)
    mask = torch.from_numpy(np.arange(example.total_voxels) % 3 > 0)
    m = export(Topology(), (mask, *F.bundle_tensors(example)), ["mask"] + GRID, TOPOLOGY_OUT,
               {"mask": "V", **SIZE, **COUNT})
    return luisaml.compile(m, batch_axis=None)


def test_each_topology_op_runs_grid_batches_of_one_two_and_three_grids(topology_net):
    assert len(topology_net.plan.host_steps.steps) == len(TOPOLOGY)
    for count, seed in ((1, 1), (2, 2), (3, 3)):
        gb = shells(count, seed, n=60)
        mask = np.random.default_rng(seed).random(gb.total_voxels) < 0.6
        out = topology_net.run({"mask": mask, **grid_feeds(gb)})
        want = Topology()(torch.from_numpy(mask), *F.bundle_tensors(gb))
        for name, w in zip(TOPOLOGY_OUT, want):
            np.testing.assert_array_equal(out[name], w.numpy(), err_msg=f"{name} over {count} grid(s)")
        assert len(out["conv_grid_byte_offsets"]) == count and len(out["refined_batch_offsets"]) == count + 1


def test_a_topology_step_names_a_count_input_that_disagrees_with_the_blob(topology_net):
    gb = shells(3, 4, n=60)
    feeds = {"mask": np.ones(gb.total_voxels, bool), **grid_feeds(gb)}
    with pytest.raises(InputError, match=r"fvdb::CoarsenedGrid\): input 'g_batch_offsets' has 3 rows, but grid_blob "
                                         r"'g_grid_blob' holds 3 grid\(s\): expected 4"):
        topology_net.run({**feeds, "g_batch_offsets": feeds["g_batch_offsets"][:-1]})


def test_grids_built_from_points_of_any_count():
    """GridBatchFromPoints over points whose joffsets (and voxel sizes, origins) have a dynamic count: a
    host step whose grid a PointsInGrid reads, over 1, 2 and 3 point clouds, against the torch functions."""
    from onnx import TensorProto, helper

    p, g = [f"p_{n}" for n in schema.JAGGED], [f"g_{n}" for n in schema.BUNDLE]
    build = helper.make_node("GridBatchFromPoints", p + ["voxel_sizes", "origins"], g, name="build",
                             domain=schema.DOMAIN)
    query = helper.make_node("PointsInGrid", g + p, ["inside"], name="query", domain=schema.DOMAIN)
    ins = [helper.make_tensor_value_info(n, t, d) for n, t, d in (
        ("p_jdata", TensorProto.FLOAT, ["N", 3]), ("p_joffsets", TensorProto.INT64, ["G1"]),
        ("p_jidx", TensorProto.INT32, ["N"]), ("p_jlidx", TensorProto.INT32, [0, 1]),
        ("voxel_sizes", TensorProto.DOUBLE, ["G", 3]), ("origins", TensorProto.DOUBLE, ["G", 3]))]
    outs = [helper.make_tensor_value_info("inside", TensorProto.BOOL, ["N"]),
            helper.make_tensor_value_info("g_batch_offsets", TensorProto.INT64, None)]
    model = helper.make_model(helper.make_graph([build, query], "g", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    net = luisaml.compile(model)
    assert [s.node.name for s in net.plan.host_steps.steps] == ["build"]
    for count in (1, 2, 3):
        rng = np.random.default_rng(count)
        parts = [rng.uniform(-1, 1, (int(rng.integers(50, 120)), 3)).astype(np.float32) for _ in range(count)]
        off = np.concatenate([[0], np.cumsum([len(x) for x in parts])]).astype(np.int64)
        feeds = {"p_jdata": np.concatenate(parts), "p_joffsets": off,
                 "p_jidx": np.repeat(np.arange(count, dtype=np.int32), np.diff(off)),
                 "p_jlidx": np.zeros((0, 1), np.int32), "voxel_sizes": np.array([[0.1 + 0.05 * b] * 3 for b in range(count)]),
                 "origins": rng.uniform(-0.05, 0.05, (count, 3))}
        out = net.run(feeds)
        pts = tuple(torch.from_numpy(feeds[n]) for n in p)
        grid = F.gridbatch_from_points(pts, torch.from_numpy(feeds["voxel_sizes"]), torch.from_numpy(feeds["origins"]))
        np.testing.assert_array_equal(out["g_batch_offsets"], grid[5].numpy())
        np.testing.assert_array_equal(out["inside"], F.points_in_grid(grid, pts).numpy())
        assert len(out["g_batch_offsets"]) == count + 1 and out["inside"].all()


# ---- InjectToDense: a box per grid, G boxes sized at run time -----------------------------------------


class Dense(torch.nn.Module):
    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout

    def forward(self, x, *g):
        return inject_to_dense(g, x, (-6, -5, -4), (11, 9, 8), self.layout)


@pytest.mark.parametrize("layout", ["CXYZ", "BEV"])
def test_inject_to_dense_over_grid_batches_of_one_two_and_three_grids(layout):
    example = shells(2, 0, n=80)
    m = export(Dense(layout), (torch.zeros(example.total_voxels, 3), *F.bundle_tensors(example)), ["x"] + GRID,
               ["dense"], {"x": "V", **SIZE, **COUNT})
    net = luisaml.compile(m, batch_axis=None)
    spec = next(s for s in net.plan.outputs if s.name == "dense")
    assert spec.rows is not None  # G boxes, sized at run time
    for count, seed in ((1, 1), (2, 2), (3, 3), (2, 4)):
        gb = shells(count, seed, n=80)
        x = np.random.default_rng(seed).standard_normal((gb.total_voxels, 3)).astype(np.float32)
        got = net.run({"x": x, **grid_feeds(gb)})["dense"]
        want = Dense(layout)(torch.from_numpy(x), *F.bundle_tensors(gb)).numpy()
        assert got.shape == want.shape and got.shape[0] == count
        np.testing.assert_array_equal(got, want, err_msg=f"{count} grid(s)")
        assert (got != 0).any() and (got == 0).any()
    gb = shells(2, 5, n=80)
    feeds = {"x": np.zeros((gb.total_voxels, 3), np.float32), **grid_feeds(gb)}
    with pytest.raises(InputError, match=r"input 'g_origins' has 1 rows, but grid_blob 'g_grid_blob' holds 2 grid"):
        net.run({**feeds, "g_origins": feeds["g_origins"][:1]})


def test_inject_to_dense_with_a_box_per_grid_needs_a_fixed_count():
    """min_coord of 3 ints per grid fixes the count: the compile error says so."""

    class PerGrid(torch.nn.Module):
        def forward(self, x, *g):
            return inject_to_dense(g, x, (-6, -5, -4, 0, 0, 0), (4, 4, 4))

    example = shells(2, 0, n=80)
    m = export(PerGrid(), (torch.zeros(example.total_voxels, 3), *F.bundle_tensors(example)), ["x"] + GRID,
               ["dense"], {"x": "V", **SIZE, **COUNT})
    with pytest.raises(LuisamlError, match=r"min_coord has 6 ints \(3 per grid\), but the grid count is bound at run "
                                           "time"):
        luisaml.compile(m, batch_axis=None)


def test_a_node_reading_the_box_of_a_count_bound_at_run_time_is_named():
    """The box's first dimension is the grid count, sized at run time: a 2-D layer after it in the same
    network is refused, the message saying to make the box an output (the head a network of its own)."""

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3 * 8, 4, 3, padding=1)

        def forward(self, x, *g):
            return self.conv(inject_to_dense(g, x, (-6, -5, -4), (11, 9, 8), "BEV"))

    example = shells(2, 0, n=80)
    m = export(Head().eval(), (torch.zeros(example.total_voxels, 3), *F.bundle_tensors(example)), ["x"] + GRID,
               ["heat"], {"x": "V", **SIZE, **COUNT})
    with pytest.raises(LuisamlError, match=r"\(Conv\): input '.*InjectToDense.*' has a first dimension known only at "
                                           r"run time .* make it a graph output"):
        luisaml.compile(m, batch_axis=None)
