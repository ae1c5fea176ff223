"""Sparse convolution over grids bound at run time: one compiled network, any grid. The grid bundle's
dynamic inputs are bound when the network runs; the voxels are the batch (the features [V, C] have a
dynamic first dimension), so the kernel map has a row per voxel, built on the device from each
voxel's index, and every layer over it (SparseConv3d, BatchNormalization, Relu, Add) runs a voxel
a sample; a coarser level (a U-Net's) keeps a row per sample, its voxels first. Checked against the
numpy reference of fVDB's section-5 semantics (fvdb_reference.sparse_conv3d) on grids of different
sizes, and against torch for exported modules (a residual block, examples/sparse_unet.py's U-Net)."""
import io

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

import luisaml
from luisaml.errors import LuisamlError
from luisaml.fvdb import GridBatch
from luisaml.fvdb import torch_ops as F
from luisaml.opsets import fvdb as schema

from fvdb_reference import sparse_conv3d

DYNAMIC = ("grid_blob", "leaf_batch_indices", "list_indices")  # what changes size with the grid
ELEM = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.uint8): onnx.TensorProto.UINT8,
        np.dtype(np.int32): onnx.TensorProto.INT32, np.dtype(np.int64): onnx.TensorProto.INT64,
        np.dtype(np.float64): onnx.TensorProto.DOUBLE}


def sphere(seed: int, n: int, radius: float, grids: int = 1) -> GridBatch:
    """A batch of `grids` surface-like grids: voxels of n points near a sphere of that radius each."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(grids):
        p = rng.normal(size=(n, 3))
        out.append((np.round(p / np.linalg.norm(p, axis=1, keepdims=True) * radius * (1 + 0.3 * b))
                    + 5 * b).astype(np.int32))
    return GridBatch.from_ijk(out, voxel_sizes=[0.1] * grids, origins=[(0.0, 0.0, 0.0)] * grids)


def grid_feeds(gb: GridBatch, *prefixes: str) -> dict:
    return {f"{p}{n}": a for p in prefixes for n, a in zip(schema.BUNDLE, gb.bundle())}


def typed_inputs(feeds: dict, batch: tuple = ("x",)) -> list:
    """Graph inputs for feeds: the features' rows the symbol V, the grids' growing parts dynamic."""
    ins = []
    for name, arr in feeds.items():
        shape = list(arr.shape)
        if name in batch:
            shape[0] = "V"
        elif any(name.endswith(d) for d in DYNAMIC):
            shape[0] = f"rows_{name}"
        ins.append(helper.make_tensor_value_info(name, ELEM[arr.dtype], shape))
    return ins


def kmap_node(K, transposed=False):
    return helper.make_node(schema.KERNEL_MAP, schema.kernel_map_input_names(), ["kmap"], name="kmap",
                            domain=schema.DOMAIN, kernel_size=list(np.broadcast_to(K, 3)), stride=[1],
                            transposed=int(transposed))


def reference_block(gb, x, p):
    """relu(bn(conv2(relu(conv1(x))))) + x, in float64."""
    h = np.maximum(sparse_conv3d(gb, x, gb, p["w1"], p["b1"]), 0)
    h = sparse_conv3d(gb, h, gb, p["w2"], p["b2"])
    h = (h - p["mean"]) / np.sqrt(p["var"] + 1e-5) * p["scale"] + p["shift"]
    return np.maximum(h, 0) + x


def block_model(C: int, K: int, rng, grids: int = 1) -> tuple[onnx.ModelProto, dict]:
    """Two 3-D sparse convolutions over one map, BatchNormalization, Relu and a residual Add."""
    p = {"w1": rng.standard_normal((C, C, K, K, K)) / np.sqrt(C * K**3), "b1": rng.standard_normal(C),
         "w2": rng.standard_normal((C, C, K, K, K)) / np.sqrt(C * K**3), "b2": rng.standard_normal(C),
         "scale": rng.uniform(0.5, 2, C), "shift": rng.standard_normal(C), "mean": rng.standard_normal(C),
         "var": rng.uniform(0.5, 2, C)}
    p = {k: v.astype(np.float32) for k, v in p.items()}
    nodes = [kmap_node(K),
             helper.make_node(schema.SPARSE_CONV, ["x", "kmap", "w1", "b1"], ["c1"], name="conv1", domain=schema.DOMAIN),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node(schema.SPARSE_CONV, ["r1", "kmap", "w2", "b2"], ["c2"], name="conv2", domain=schema.DOMAIN),
             helper.make_node("BatchNormalization", ["c2", "scale", "shift", "mean", "var"], ["n2"], name="bn"),
             helper.make_node("Relu", ["n2"], ["r2"], name="relu2"),
             helper.make_node("Add", ["r2", "x"], ["y"], name="skip")]
    example = sphere(0, 50, 3.0, grids)
    feeds = {**grid_feeds(example, "in_", "out_"), "x": np.zeros((example.total_voxels, C), np.float32)}
    g = helper.make_graph(nodes, "block", typed_inputs(feeds), [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT,
                                                                                             ["V", C])],
                          [numpy_helper.from_array(v, k) for k, v in p.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    return m, {k: v.astype(np.float64) for k, v in p.items()}


def assert_close(got, want):
    scale = max(float(np.abs(want).max(initial=0)), 1e-30)
    assert got.shape == want.shape and float(np.abs(got - want).max(initial=0)) / scale <= 1e-5


@pytest.mark.parametrize("K, grids", [(3, 1), (2, 2)])
def test_one_network_convolves_grids_of_different_sizes(K, grids):
    """The number of grids in the bundle is fixed when compiling (grid_byte_offsets [B]); their sizes not."""
    rng = np.random.default_rng(K)
    C = 6
    m, p = block_model(C, K, rng, grids)
    net = luisaml.compile(m)
    assert net.plan.symbol == "V"
    ops = [n.op_type for n, _ in net.plan.ops]
    assert ops.count(schema.KERNEL_MAP) == 1 and ops.count(schema.SPARSE_CONV) == 2  # one map, two layers
    sizes = []
    for gb in (sphere(1, 400, 6.0, grids), sphere(2, 2500, 14.0, grids), sphere(3, 30, 2.0, grids),
               sphere(1, 400, 6.0, grids)):
        x = rng.standard_normal((gb.total_voxels, C)).astype(np.float32)
        out = net.run({**grid_feeds(gb, "in_", "out_"), "x": x})["y"]
        assert_close(out, reference_block(gb, x.astype(np.float64), p))
        sizes.append(gb.total_voxels)
    assert len(set(sizes)) == 3 and max(sizes) > 1000


@pytest.mark.parametrize("K, transposed", [(5, False), (1, False), (3, True), (2, True)])
def test_kernel_sizes_and_transposed_maps(K, transposed):
    """The map of a grid bound at run time equals the host's, and the convolution the reference."""
    rng = np.random.default_rng(10 + K)
    gb = sphere(4, 300, 5.0, grids=2)
    w = rng.standard_normal((3, 4, K, K, K)).astype(np.float32)
    nodes = [kmap_node(K, transposed),
             helper.make_node(schema.SPARSE_CONV, ["x", "kmap", "w"], ["y"], name="conv", domain=schema.DOMAIN)]
    feeds = {**grid_feeds(gb, "in_", "out_"), "x": np.zeros((gb.total_voxels, 4), np.float32)}
    g = helper.make_graph(nodes, "conv", typed_inputs(feeds), [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["V", 3]),
                                                               helper.make_tensor_value_info("kmap", onnx.TensorProto.INT32, None)],
                          [numpy_helper.from_array(w, "w")])
    net = luisaml.compile(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                              helper.make_opsetid(schema.DOMAIN, 1)]))
    for grid in (gb, sphere(5, 90, 3.0, grids=2)):
        feeds = {**grid_feeds(grid, "in_", "out_"), "x": rng.standard_normal((grid.total_voxels, 4)).astype(np.float32)}
        out = net.run(feeds)
        want_map = F.sparse_conv_kernel_map(F.bundle_tensors(grid), F.bundle_tensors(grid), K, 1, transposed).numpy()
        np.testing.assert_array_equal(out["kmap"], want_map)
        assert_close(out["y"], sparse_conv3d(grid, feeds["x"].astype(np.float64), grid, w.astype(np.float64), None, 1,
                                             transposed))


def test_features_that_are_not_the_grids_voxels_are_refused():
    m, _ = block_model(4, 3, np.random.default_rng(0))
    net = luisaml.compile(m)
    gb = sphere(1, 200, 5.0)
    for rows in (gb.total_voxels + 1, gb.total_voxels - 1):
        with pytest.raises(LuisamlError, match=rf"input 'x' has {rows} rows, but it holds the voxels of the grid of "
                                               rf"'(in|out)_batch_offsets', which has {gb.total_voxels}"):
            net.run({**grid_feeds(gb, "in_", "out_"), "x": np.zeros((rows, 4), np.float32)})


def test_without_a_batch_the_error_says_what_to_do():
    m, _ = block_model(4, 3, np.random.default_rng(0))
    with pytest.raises(LuisamlError, match="make the voxels the batch"):
        luisaml.compile(m, batch_axis=None, input_shapes={"x": [100, 4]})


def test_the_module_has_no_per_sample_forward_and_per_sample_is_refused():
    m, _ = block_model(4, 3, np.random.default_rng(0))
    net = luisaml.compile(m)
    assert "no per-sample forward" in net.source
    with pytest.raises(LuisamlError, match="reads other samples"):
        luisaml.compile(m, schedule="per-sample")


class Block(torch.nn.Module):
    """A residual sparse block as a user writes it: the grid bundle and the features are the inputs."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.conv2 = F.SparseConv3d(c, c, 3), F.SparseConv3d(c, c, 3)

    def forward(self, x, *grid):
        kmap = F.sparse_conv_kernel_map(grid, grid, 3)
        return torch.relu(self.conv2(torch.relu(self.conv1(x, kmap)), kmap)) + x


def test_a_torch_module_exported_with_dynamic_grids_runs_on_any_grid():
    torch.manual_seed(0)
    C = 5
    mod = Block(C).eval()
    example = sphere(0, 120, 4.0)
    names = ["x"] + [f"g_{n}" for n in schema.BUNDLE]
    dynamic = {"x": {0: "V"}, **{f"g_{n}": {0: f"rows_{n}"} for n in DYNAMIC}}
    buf = io.BytesIO()
    args = (torch.zeros(example.total_voxels, C),) + F.bundle_tensors(example)
    F.export_onnx(mod, args, buf, opset_version=17, input_names=names, output_names=["y"], dynamic_axes=dynamic)
    net = luisaml.compile(onnx.load_from_string(buf.getvalue()))
    for gb in (sphere(1, 700, 8.0), sphere(2, 60, 2.5)):
        x = torch.randn(gb.total_voxels, C)
        with torch.no_grad():
            want = mod(x, *F.bundle_tensors(gb)).numpy()
        got = net.run({"x": x.numpy(), **{f"g_{n}": a for n, a in zip(schema.BUNDLE, gb.bundle())}})["y"]
        assert_close(got, want.astype(np.float64))


def test_a_reader_that_needs_the_grids_size_is_named():
    """A node that cannot take a grid of any size keeps it fixed when compiling, and the error names
    it beside the input."""
    m, _ = block_model(4, 3, np.random.default_rng(0))
    m.graph.node.append(helper.make_node("Cast", ["in_grid_blob"], ["blob_i32"], name="peek", to=onnx.TensorProto.INT32))
    m.graph.output.append(helper.make_tensor_value_info("blob_i32", onnx.TensorProto.INT32, None))
    with pytest.raises(LuisamlError, match=r"'in_grid_blob' is \[rows_in_grid_blob\] \(read by node 'peek' "
                                           r"\(Cast\), which needs its size when compiling\)"):
        luisaml.compile(m)


def test_a_single_voxel_and_an_empty_grid():
    rng = np.random.default_rng(3)
    m, p = block_model(4, 3, rng)
    net = luisaml.compile(m)
    one = GridBatch.from_ijk([np.array([[-7, 3, 100]], np.int32)])
    empty = GridBatch.from_ijk([np.zeros((0, 3), np.int32)])
    for gb in (one, empty, one):
        x = rng.standard_normal((gb.total_voxels, 4)).astype(np.float32)
        out = net.run({**grid_feeds(gb, "in_", "out_"), "x": x})["y"]
        assert out.shape == (gb.total_voxels, 4)
        assert_close(out, reference_block(gb, x.astype(np.float64), p))


# ---- a U-Net over grids bound at run time: the coarse level has fewer voxels than the batch ----------


@pytest.fixture(scope="module")
def unet_example():
    from util import example_module

    with example_module("sparse_unet.py") as module:
        yield module


def _unet_grids(example, points: int, seed: int):
    """The fine grid of a point cloud and its stride-2 coarse level, as bundle tensors (torch_ops, eager)."""
    return example.grid_pair(example.sphere_points(points, np.random.default_rng(seed)), 0.25)


def test_a_unet_over_grids_bound_at_run_time_equals_torch(unet_example):
    """examples/sparse_unet.py's layers (convolutions at two levels, stride-2 down, max pool, transposed
    up, refine, a skip) over a fine and a coarse grid given as inputs (GridInputUNet): one network for
    every point cloud, the coarse level padded to the batch and its rows past its voxels never read."""
    torch.manual_seed(0)
    model = unet_example.GridInputUNet(unet_example.sphere_points(8, np.random.default_rng(0)), 0.25, 4, 6, 3).eval()
    fine, coarse = _unet_grids(unet_example, 400, 1)
    net = luisaml.compile(unet_example.export_grid_input_unet(model, torch.zeros(int(fine[5][-1]), 4), fine, coarse))
    assert net.plan.symbol == "voxels" and net.plan.voxel_rows
    for points, seed in ((400, 1), (1500, 2), (120, 3)):
        fine, coarse = _unet_grids(unet_example, points, seed)
        v_fine, v_coarse = int(fine[5][-1]), int(coarse[5][-1])
        assert 0 < v_coarse < v_fine
        x = torch.randn(v_fine, 4)
        with torch.no_grad():
            want = model(x, *fine, *coarse).numpy()
        feeds = unet_example.grid_feeds(x, fine, coarse)
        assert_close(net.run(feeds)["out"], want.astype(np.float64))
    # features of the coarse level's size: they must be the finest grid's voxels
    with pytest.raises(LuisamlError, match=rf"input 'features' has {v_coarse} rows, but it holds the voxels of the "
                                           rf"grid of 'fine_batch_offsets', which has {v_fine}"):
        net.run({**feeds, "features": np.zeros((v_coarse, 4), np.float32)})


def test_an_output_at_the_coarse_level_is_cut_to_its_voxels(unet_example):
    """The coarse level's tensors have a row per sample, its voxels first: an output there comes back
    with exactly the coarse grid's voxels (luisaml/fvdb/voxel_rows.py)."""

    class Down(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.down = F.SparseConv3d(4, 5, 2)

        def forward(self, x, *grids):
            fine, coarse = grids[:7], grids[7:]
            d = self.down(x, F.sparse_conv_kernel_map(fine, coarse, 2, 2))
            return d, F.pool_over_map("MaxPool", x, F.pooling_map(fine, coarse, 2))

    torch.manual_seed(1)
    model = Down().eval()
    fine, coarse = _unet_grids(unet_example, 300, 4)
    names = ["x"] + [f"fine_{n}" for n in schema.BUNDLE] + [f"coarse_{n}" for n in schema.BUNDLE]
    dynamic = {"x": {0: "V"}, **{f"{lv}_{n}": {0: f"{lv}_{n}_rows"} for lv in ("fine", "coarse") for n in DYNAMIC}}
    buf = io.BytesIO()
    F.export_onnx(model, (torch.zeros(int(fine[5][-1]), 4), *fine, *coarse), buf, input_names=names,
                  output_names=["down", "pooled"], dynamic_axes=dynamic)
    net = luisaml.compile(onnx.load_from_string(buf.getvalue()))
    for points, seed in ((300, 4), (1000, 5)):
        fine, coarse = _unet_grids(unet_example, points, seed)
        x = torch.randn(int(fine[5][-1]), 4)
        with torch.no_grad():
            want_d, want_p = (t.numpy() for t in model(x, *fine, *coarse))
        feeds = {"x": x.numpy(), **{f"fine_{n}": t.numpy() for n, t in zip(schema.BUNDLE, fine)},
                 **{f"coarse_{n}": t.numpy() for n, t in zip(schema.BUNDLE, coarse)}}
        out = net.run(feeds)
        assert out["down"].shape == out["pooled"].shape[:1] + (5,) == (int(coarse[5][-1]), 5)
        assert_close(out["down"], want_d.astype(np.float64))
        np.testing.assert_array_equal(out["pooled"], want_p)  # a max: exact, -inf where a window is empty


def test_the_batch_is_the_features_rows_when_the_grid_comes_first():
    """batch_axis='auto' takes the features' symbol, not the grid bytes' that lead the first inputs
    (passes/infer.py find_batch_symbol: a symbol only grid parts lead is not the batch)."""

    class GridFirst(Block):
        def forward(self, *args):
            return super().forward(args[7], *args[:7])

    torch.manual_seed(2)
    mod = GridFirst(3).eval()
    example = sphere(0, 80, 3.0)
    names = [f"g_{n}" for n in schema.BUNDLE] + ["x"]
    dynamic = {"x": {0: "V"}, **{f"g_{n}": {0: f"rows_{n}"} for n in DYNAMIC}}
    buf = io.BytesIO()
    F.export_onnx(mod, F.bundle_tensors(example) + (torch.zeros(example.total_voxels, 3),), buf, input_names=names,
                  output_names=["y"], dynamic_axes=dynamic)
    net = luisaml.compile(onnx.load_from_string(buf.getvalue()))
    assert net.plan.symbol == "V"
    gb = sphere(6, 500, 7.0)
    x = torch.randn(gb.total_voxels, 3)
    with torch.no_grad():
        want = mod(*F.bundle_tensors(gb), x).numpy()
    got = net.run({"x": x.numpy(), **{f"g_{n}": a for n, a in zip(schema.BUNDLE, gb.bundle())}})["y"]
    assert_close(got, want.astype(np.float64))


def test_a_bundle_with_an_empty_grid_between_two_others():
    rng = np.random.default_rng(7)
    m, p = block_model(3, 3, rng, grids=3)
    net = luisaml.compile(m)
    a, c = sphere(8, 200, 5.0).ijk.jdata, sphere(9, 300, 6.0).ijk.jdata + 40
    for middle in (np.zeros((0, 3), np.int32), np.array([[1, 2, 3]], np.int32)):
        gb = GridBatch.from_ijk([a, middle, c], voxel_sizes=[0.1] * 3, origins=[(0.0, 0.0, 0.0)] * 3)
        x = rng.standard_normal((gb.total_voxels, 3)).astype(np.float32)
        out = net.run({**grid_feeds(gb, "in_", "out_"), "x": x})["y"]
        assert_close(out, reference_block(gb, x.astype(np.float64), p))


def test_a_damaged_bundle_is_named_before_the_rows_are_compared():
    m, _ = block_model(4, 3, np.random.default_rng(0))
    net = luisaml.compile(m)
    gb = sphere(1, 200, 5.0)
    feeds = {**grid_feeds(gb, "in_", "out_"), "x": np.zeros((gb.total_voxels, 4), np.float32)}
    feeds["out_batch_offsets"] = np.array([0, gb.total_voxels + 5], np.int64)  # not the grid's count
    with pytest.raises(LuisamlError, match="batch_offsets are .* but the grids' voxel counts give"):
        net.run(feeds)


def test_torch_tensors_in_place_give_the_coarse_level_cut(unet_example, monkeypatch):
    """The zero-copy path (torch tensors on the kernels' device: CUDA tensors on CUDA; on the CPU backend
    mapped to torch's CPU tensors, as tests/fvdb/test_ray_outputs_device.py does) cuts a coarse-level
    output too. Also run on CUDA: LUISAML_BACKEND=cuda python -m pytest tests/fvdb/test_sparse_conv_any_grid.py"""
    from luisaml import zero_copy

    monkeypatch.setattr(zero_copy, "SHARED_DEVICES", {"cuda": "cuda", "cpu": "cpu"})

    class Pooled(torch.nn.Module):
        def forward(self, x, *grids):
            return F.pool_over_map("AvgPool", x, F.pooling_map(grids[:7], grids[7:], 2))

    fine, coarse = _unet_grids(unet_example, 300, 6)
    names = ["x"] + [f"fine_{n}" for n in schema.BUNDLE] + [f"coarse_{n}" for n in schema.BUNDLE]
    dynamic = {"x": {0: "V"}, **{f"{lv}_{n}": {0: f"{lv}_{n}_rows"} for lv in ("fine", "coarse") for n in DYNAMIC}}
    buf = io.BytesIO()
    F.export_onnx(Pooled(), (torch.zeros(int(fine[5][-1]), 3), *fine, *coarse), buf, input_names=names,
                  output_names=["pooled"], dynamic_axes=dynamic)
    net = luisaml.compile(onnx.load_from_string(buf.getvalue()))
    where = {"cpu": "cpu", "cuda": "cuda"}[net.backend]  # (on CUDA: torch CUDA tensors, the real case)
    fine, coarse = (tuple(t.to(where) for t in g) for g in _unet_grids(unet_example, 800, 7))
    x = torch.randn(int(fine[5][-1]), 3, device=where)
    feeds = {"x": x, **{f"fine_{n}": t for n, t in zip(schema.BUNDLE, fine)},
             **{f"coarse_{n}": t for n, t in zip(schema.BUNDLE, coarse)}}
    assert zero_copy.applies(net, feeds)
    got = net.run(feeds)["pooled"]
    assert isinstance(got, torch.Tensor) and got.shape == (int(coarse[5][-1]), 3)
    want = Pooled()(x.cpu(), *(t.cpu() for t in fine), *(t.cpu() for t in coarse))
    assert_close(got.cpu().numpy(), want.numpy().astype(np.float64))


def test_inspect_shows_the_bound_rows_by_their_symbols():
    from luisaml import report

    m, _ = block_model(4, 3, np.random.default_rng(0))
    rep = report.build(m)
    shapes = {i["name"]: i["shape"] for i in rep["inputs"]}
    assert shapes["x"] == ["V", 4] and shapes["in_grid_blob"] == ["rows_in_grid_blob"]
    assert shapes["out_leaf_batch_indices"] == ["rows_out_leaf_batch_indices"]
    assert "a voxel a sample" in report.text(rep)


def test_a_new_grid_each_run_reuses_the_device_buffers():
    """Grids whose voxel counts differ a little, bound run after run (a perception pipeline): the
    derived metadata goes into the same buffers, the pooled buffers are kept, and so are the inputs'
    and outputs' (pool.sized: the rows copied each way are a prefix of them), and every run still
    equals the reference."""
    rng = np.random.default_rng(7)
    C = 4
    m, p = block_model(C, 3, rng)
    net = luisaml.compile(m)
    grids = [sphere(s, 600, 7.0) for s in (11, 12, 11)]
    assert len({g.total_voxels for g in grids[:2]}) == 2
    buffers = []
    for gb in grids:
        x = rng.standard_normal((gb.total_voxels, C)).astype(np.float32)
        assert_close(net.run({**grid_feeds(gb, "in_", "out_"), "x": x})["y"], reference_block(gb, x.astype(np.float64), p))
        # (the objects themselves, held: a freed buffer's id could be a new one's)
        buffers.append(({k: v[1] for k, v in net.bound.derived.items()},
                        {name: b for (name, _), b in net.pool.held.items() if name.startswith(("buf_", "scratch_"))},
                        {name: b for (name, _), b in net.pool.held.items() if name.startswith(("x_", "y_"))}))
    for kind in (0, 1, 2):
        first = buffers[0][kind]
        assert first and all(later.keys() == first.keys() and all(later[k] is first[k] for k in first)
                             for later in (buffers[1][kind], buffers[2][kind]))


def counted_uploads(monkeypatch) -> list:
    """Count the byte buffers uploaded from now on (luisa_compat.byte_buffer): the list grows one a call."""
    from luisaml import luisa_compat

    uploads: list = []
    real = luisa_compat.byte_buffer
    monkeypatch.setattr(luisa_compat, "byte_buffer", lambda data: uploads.append(1) or real(data))
    return uploads


def test_one_upload_for_two_bundles_of_one_grid_and_none_for_the_same_grid_again(monkeypatch):
    """The fine and the coarse map's bundles hold the same blob: one ByteBuffer for both; the same
    grid bound again is not uploaded again; a changed byte is (and the result follows it)."""
    rng = np.random.default_rng(8)
    C = 4
    m, p = block_model(C, 3, rng)
    net = luisaml.compile(m)
    uploads = counted_uploads(monkeypatch)
    gb = sphere(13, 500, 6.0)
    x = rng.standard_normal((gb.total_voxels, C)).astype(np.float32)
    want = reference_block(gb, x.astype(np.float64), p)
    counts = []
    for _ in range(2):
        assert_close(net.run({**grid_feeds(gb, "in_", "out_"), "x": x})["y"], want)
        counts.append(len(uploads))
    assert counts == [2, 2]  # the first run: the weight blob and one grid blob; the second: nothing
    other = sphere(14, 500, 6.0)
    x2 = rng.standard_normal((other.total_voxels, C)).astype(np.float32)
    assert_close(net.run({**grid_feeds(other, "in_", "out_"), "x": x2})["y"], reference_block(other, x2.astype(np.float64), p))
    assert len(uploads) == 3


def test_alternating_grids_reuse_the_blob_buffers_no_input_holds(monkeypatch):
    """Two grids bound in turn (a new grid every frame): after the first of each, the blob goes into
    a ByteBuffer the other grid left (created once: 9 ms each on the H200), its bytes only (a smaller
    blob leaves the older one's last bytes, which no kernel reads), and every run equals the
    reference. A blob of a very different size gets a buffer of its own."""
    rng = np.random.default_rng(11)
    C = 4
    m, p = block_model(C, 3, rng)
    net = luisaml.compile(m)
    uploads = counted_uploads(monkeypatch)
    from luisaml import luisa_compat

    refills: list = []  # (the bytes each refill of a spare uploads: the blob's, never the whole buffer's)
    real = luisa_compat.upload_prefix
    monkeypatch.setattr(luisa_compat, "upload_prefix", lambda buf, a: refills.append((a.nbytes, buf.bytesize)) or real(buf, a))
    a, b, c = sphere(17, 500, 6.0), sphere(18, 520, 9.0), sphere(20, 520, 8.0)
    # (c's blob is smaller than b's: written into b's buffer, it leaves b's last bytes past it)
    assert a.grid_blob.nbytes < c.grid_blob.nbytes < b.grid_blob.nbytes
    counts = []
    for gb in (a, b, a, b, a, c, sphere(19, 5000, 20.0)):
        x = rng.standard_normal((gb.total_voxels, C)).astype(np.float32)
        assert_close(net.run({**grid_feeds(gb, "in_", "out_"), "x": x})["y"], reference_block(gb, x.astype(np.float64), p))
        counts.append(len(uploads))
    assert counts == [2, 3, 3, 3, 3, 3, 4]  # weights and a; b; then none; the large grid's blob
    assert refills == [(a.grid_blob.nbytes, a.grid_blob.nbytes), (b.grid_blob.nbytes, b.grid_blob.nbytes),
                       (a.grid_blob.nbytes, a.grid_blob.nbytes), (c.grid_blob.nbytes, b.grid_blob.nbytes)]


def zero_copy_block(monkeypatch, seed: int):
    """(the residual block's network with torch tensors on the zero-copy path: CPU tensors mapped as on
    CUDA, CUDA tensors on the CUDA backend; its parameters; feeds(gb, x, shared))."""
    from luisaml import zero_copy

    monkeypatch.setattr(zero_copy, "SHARED_DEVICES", {"cuda": "cuda", "cpu": "cpu"})
    m, p = block_model(4, 3, np.random.default_rng(seed))
    net = luisaml.compile(m)
    where = "cuda" if net.backend == "cuda" else "cpu"

    def feeds(gb, x, shared=True):
        """The bundles the same tensors (shared) or each its own copy."""
        grid = [torch.from_numpy(np.array(a)).to(where) for a in gb.bundle()]
        return {"x": torch.from_numpy(x).to(where), **{f"{lv}{n}": (t if shared else t.clone())
                                                      for lv in ("in_", "out_") for n, t in zip(schema.BUNDLE, grid)}}

    return net, p, feeds


def test_zero_copy_runs_copy_and_upload_one_grid_given_twice_once(monkeypatch):
    """On the zero-copy path (torch tensors; here CPU tensors mapped as on CUDA) the fine and the coarse
    map's bundles given as the same tensors are copied to the host and uploaded once; the same grid
    again costs neither; each run equals the reference. (On the CUDA backend: CUDA tensors.)"""
    from luisaml import zero_copy

    net, p, feeds = zero_copy_block(monkeypatch, 9)
    rng = np.random.default_rng(9)
    uploads = counted_uploads(monkeypatch)
    counts = []
    for gb in (sphere(15, 500, 6.0), sphere(15, 500, 6.0), sphere(16, 500, 6.0)):
        x = rng.standard_normal((gb.total_voxels, 4)).astype(np.float32)
        f = feeds(gb, x)
        assert zero_copy.applies(net, f)
        assert_close(net.run(f)["y"].cpu().numpy(), reference_block(gb, x.astype(np.float64), p))
        counts.append(len(uploads))
    assert counts == [2, 2, 3]  # the weight blob and one grid blob; nothing; the new grid's blob


def test_zero_copy_runs_do_not_hash_a_grid_that_changed(monkeypatch):
    """On the zero-copy path a grid whose tensors differ from the last run's is new to every cache: its
    bytes are not hashed (a token stands for their digest), and the run still equals the reference;
    its two bundles in separate memory are found equal and share one blob buffer."""
    import hashlib

    from luisaml import feeds as bound

    net, p, feeds = zero_copy_block(monkeypatch, 12)
    rng = np.random.default_rng(12)
    hashed: list = []
    real = hashlib.blake2b
    monkeypatch.setattr(bound.hashlib, "blake2b", lambda data=b"", **kw: hashed.append(len(data)) or real(data, **kw))
    for gb, shared in ((sphere(20, 500, 6.0), True), (sphere(21, 520, 6.0), True), (sphere(22, 540, 6.0), False)):
        x = rng.standard_normal((gb.total_voxels, 4)).astype(np.float32)
        assert_close(net.run(feeds(gb, x, shared))["y"].cpu().numpy(), reference_block(gb, x.astype(np.float64), p))
        assert sum(hashed) < gb.bundle()[0].nbytes  # (names and small keys only: not the blob, in chunks or whole)
        hashed.clear()
    blobs = [buf for _, buf in net.bound.byte_inputs.values()]
    assert len(blobs) == 2 and blobs[0] is blobs[1]


def test_two_bundles_of_one_grid_are_checked_once_a_run(monkeypatch):
    """The fine and the coarse map's bundles of the same grid: the host checks and lays out the blob
    once a run (the derived metadata computed by content, not by input name); two different grids
    still get a check each."""
    rng = np.random.default_rng(10)
    C = 4
    m, p = block_model(C, 3, rng)
    net = luisaml.compile(m)
    # (patched where the derived metadata's function finds it: the module the plan's function is from)
    space = next(d.compute for d in net.plan.derived if d.compute.__name__ == "grid_metadata").__globals__
    checks = []
    real = space["bundle_grids"]
    monkeypatch.setitem(space, "bundle_grids", lambda *a, **k: checks.append(1) or real(*a, **k))
    gb = sphere(17, 500, 6.0)
    x = rng.standard_normal((gb.total_voxels, C)).astype(np.float32)
    assert_close(net.run({**grid_feeds(gb, "in_", "out_"), "x": x})["y"], reference_block(gb, x.astype(np.float64), p))
    assert len(checks) == 1
    other = sphere(18, 500, 6.0)
    feeds = {**grid_feeds(gb, "in_"), **grid_feeds(other, "out_"), "x": x}
    with pytest.raises(luisaml.InputError):  # (the output grid's voxels are not the features' rows)
        net.run(feeds)
    assert len(checks) == 2  # the new output grid's check (the input grid's metadata is the last run's)
