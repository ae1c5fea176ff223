"""fvdb.SparseConvKernelMap and fvdb.SparseConv3d against the numpy reference of fVDB's section-5
semantics (fvdb_reference.sparse_conv3d, loops over ijk dictionaries), itself checked against torch's
dense conv3d / conv_transpose3d: kernel sizes 1, 2, 3, 5, strides 1 and 2, transposed, over
surface-like grids of the host builder, a single voxel and empty grids; the kernel map built on the
device (grids bound at run time) and folded on the host (constant grids); one map feeding several
layers with their BatchNormalization and Relu fused; the torch functions and their export."""
import io

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import luisaml
from luisaml.fvdb import GridBatch
from luisaml.fvdb import torch_ops as F
from luisaml.fvdb.sparse_conv import conv_grid_ijk, conv_transpose_grid_ijk
from luisaml.opsets import fvdb as schema

from fvdb_reference import fvdb_model, sparse_conv3d


def shell(center, radius: float, rng, keep: float = 0.9) -> np.ndarray:
    """Return the voxels (int32 [N, 3]) of a sphere shell around center, a few dropped at random."""
    r = int(np.ceil(radius)) + 1
    box = np.stack(np.meshgrid(*[np.arange(-r, r + 1)] * 3, indexing="ij"), -1).reshape(-1, 3)
    d = np.linalg.norm(box, axis=1)
    ijk = box[(np.abs(d - radius) < 0.75) & (rng.random(len(box)) < keep)]
    return (ijk + np.asarray(center)).astype(np.int32)


def assert_close(got, want, what=""):
    """Floats within 1e-5 relative (of the largest magnitude: sums in another order round differently)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    err = float(np.abs(got - want).max(initial=0.0)) / scale
    assert err <= 1e-5, f"{what}: relative error {err:.3g}"


@pytest.fixture(scope="module")
def grids():
    rng = np.random.default_rng(7)
    # two surface-like grids in one batch: a shell across negative coordinates and several leaves,
    # and a smaller shell with a sprinkle of isolated voxels
    a = shell((-3, 5, -9), 9.5, rng)
    b = np.concatenate([shell((20, -4, 0), 5.0, rng), rng.integers(-30, 30, (40, 3))]).astype(np.int32)
    return rng, GridBatch.from_ijk([a, b], voxel_sizes=[0.1, 0.2], origins=[(0, 0, 0), (1, 2, 3)])


def _kernel_map_node(K, S, transposed, out: GridBatch, name="kmap"):
    return helper.make_node(schema.KERNEL_MAP, schema.kernel_map_input_names(), [name], name=name,
                            domain=schema.DOMAIN, kernel_size=list(np.broadcast_to(K, 3)), stride=[S],
                            transposed=int(transposed), output_voxels=out.total_voxels)


def _pair_feeds(g_in: GridBatch, g_out: GridBatch) -> dict:
    feeds = {f"in_{n}": a for n, a in zip(schema.BUNDLE, g_in.bundle())}
    feeds.update({f"out_{n}": a for n, a in zip(schema.BUNDLE, g_out.bundle())})
    return feeds


def run_conv(g_in, g_out, x, w, bias, S=1, transposed=False, grids_constant=False, check_map=True):
    """Compile KernelMap -> SparseConv3d over (g_in, g_out) and return the conv's output; also check
    the map against the host's when the grids are bound at run time (built on the device)."""
    feeds = {**_pair_feeds(g_in, g_out), "x": x}
    K = w.shape[2:]
    conv_in = ["x", "kmap", "w"] + (["b"] if bias is not None else [])
    nodes = [_kernel_map_node(K, S, transposed, g_out), helper.make_node(schema.SPARSE_CONV, conv_in, ["y"],
                                                                          name="conv", domain=schema.DOMAIN)]
    consts = {"w": w} if bias is None else {"w": w, "b": bias}
    grid_names = [n for n in feeds if n != "x"]
    outputs = ["y"] if grids_constant else ["y", "kmap"]
    m = fvdb_model(nodes, {**feeds, **consts}, constants=tuple(consts) + (tuple(grid_names) if grids_constant else ()),
                   outputs=outputs)
    net = luisaml.compile(m, batch_axis=None)
    ops = [n.op_type for n, _ in net.plan.ops]
    assert ops == ([schema.SPARSE_CONV] if grids_constant else [schema.KERNEL_MAP, schema.SPARSE_CONV])
    out = net.run({k: v for k, v in feeds.items() if not (grids_constant and k in grid_names)})
    if not grids_constant and check_map:
        want = F.sparse_conv_kernel_map(F.bundle_tensors(g_in), F.bundle_tensors(g_out), K, S, transposed).numpy()
        np.testing.assert_array_equal(out["kmap"], want)
    return out["y"]


def _weights(rng, c_out, c_in, K):
    return (rng.standard_normal((c_out, c_in) + tuple(np.broadcast_to(K, 3))).astype(np.float32),
            rng.standard_normal(c_out).astype(np.float32))


# ---- the reference against torch's dense convolutions ------------------------------------------------


def dense_reference(g_in: GridBatch, x, g_out: GridBatch, w, bias, S, transposed):
    """torch conv3d / conv_transpose3d on a dense volume holding grid 0's features (zeros elsewhere),
    read at grid 0's output voxels: section 5's relation is a cross-correlation with offset P."""
    K = np.array(w.shape[2:])
    P = (K - 1) // 2
    vin, vout = g_in.ijk.unbind()[0].astype(np.int64), g_out.ijk.unbind()[0].astype(np.int64)
    lo = (vin.min(0) // S) * S  # a multiple of S: the strided grid lines up with the output voxels
    dims = vin.max(0) - lo + 1
    vol = torch.zeros((1, x.shape[1], *dims), dtype=torch.float64)
    vol[0, :, vin[:, 0] - lo[0], vin[:, 1] - lo[1], vin[:, 2] - lo[2]] = torch.from_numpy(x[: len(vin)].T).double()
    wt = torch.from_numpy(w).double()
    if transposed:  # out[S*c + t - P] += W_t in[c]: conv_transpose3d's own relation, no flip
        y = torch.nn.functional.conv_transpose3d(vol, wt.transpose(0, 1), stride=S)[0]
        at = vout - (lo * S - P)
    else:  # out[c] = sum_t W_t in[S*c + t - P]: pad P before, K - 1 - P after, then a plain conv3d
        pad = [int(v) for a in (2, 1, 0) for v in (P[a] + S * 4, K[a] - 1 - P[a] + S * 4)]
        y = torch.nn.functional.conv3d(torch.nn.functional.pad(vol, pad), wt, stride=S)[0]
        at = vout - (lo - S * 4) // S
    inside = ((at >= 0) & (at < np.array(y.shape[1:]))).all(1)
    out = np.zeros((len(vout), w.shape[0]))
    out[inside] = y[:, at[inside, 0], at[inside, 1], at[inside, 2]].T.numpy()
    return out + bias


@pytest.mark.parametrize("K, S, transposed", [(3, 1, False), (2, 1, False), (5, 1, True), (3, 2, False),
                                              (2, 2, True)])
def test_the_reference_is_torchs_dense_convolution(grids, K, S, transposed):
    rng, gb = grids
    single = GridBatch.from_ijk([gb.ijk.unbind()[0]])
    fine, coarse = single, GridBatch.from_ijk([conv_grid_ijk(single.ijk.jdata, K, S)])
    g_in, g_out = (coarse, fine) if transposed else (fine, coarse)
    x = rng.standard_normal((g_in.total_voxels, 3))
    w, b = _weights(rng, 4, 3, K)
    want = dense_reference(g_in, x, g_out, w.astype(np.float64), b, S, transposed)
    got = sparse_conv3d(g_in, x, g_out, w, b, S, transposed)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-10)


# ---- the compiled ops --------------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_stride_1_on_one_grid(grids, K, transposed):
    rng, gb = grids
    x = rng.standard_normal((gb.total_voxels, 4)).astype(np.float32)
    w, b = _weights(rng, 6, 4, K)
    assert_close(run_conv(gb, gb, x, w, b, transposed=transposed), sparse_conv3d(gb, x, gb, w, b, 1, transposed),
                 f"K={K} transposed={transposed}")


def test_channel_blocks_and_uneven_kernels(grids):
    """20 output channels (two channel blocks, the last partial), 9 input channels, a 3x2x1 kernel."""
    rng, gb = grids
    x = rng.standard_normal((gb.total_voxels, 9)).astype(np.float32)
    w, b = _weights(rng, 20, 9, (3, 2, 1))
    assert_close(run_conv(gb, gb, x, w, b), sparse_conv3d(gb, x, gb, w, b))
    assert_close(run_conv(gb, gb, x, w, None, transposed=True), sparse_conv3d(gb, x, gb, w, None, 1, True))


@pytest.mark.parametrize("K", [2, 3])
def test_stride_2_down_to_conv_grid_and_back_up(grids, K):
    """Down: fine -> fVDB's conv_grid(K, 2); up: the transposed convolution back to the fine grid."""
    rng, fine = grids
    parts = [conv_grid_ijk(v, K, 2) for v in fine.ijk.unbind()]
    coarse = GridBatch.from_ijk(parts, voxel_sizes=fine.voxel_sizes * 2, origins=fine.origins)
    x = rng.standard_normal((fine.total_voxels, 5)).astype(np.float32)
    w, b = _weights(rng, 7, 5, K)
    down = run_conv(fine, coarse, x, w, b, S=2)
    assert_close(down, sparse_conv3d(fine, x, coarse, w, b, 2))
    w2, b2 = _weights(rng, 3, 7, K)
    assert_close(run_conv(coarse, fine, down, w2, b2, S=2, transposed=True),
                 sparse_conv3d(coarse, down, fine, w2, b2, 2, True))


def test_stride_2_to_a_grid_the_user_built(grids):
    """The output grid is an input: any coarse grid works (here floor(ijk / 2), fVDB's coarsened grid)."""
    rng, fine = grids
    coarse = GridBatch.from_ijk([v // 2 for v in fine.ijk.unbind()])
    x = rng.standard_normal((fine.total_voxels, 3)).astype(np.float32)
    w, b = _weights(rng, 4, 3, 3)
    assert_close(run_conv(fine, coarse, x, w, b, S=2), sparse_conv3d(fine, x, coarse, w, b, 2))
    y = rng.standard_normal((coarse.total_voxels, 4)).astype(np.float32)
    w, b = _weights(rng, 3, 4, 2)
    assert_close(run_conv(coarse, fine, y, w, b, S=2, transposed=True), sparse_conv3d(coarse, y, fine, w, b, 2, True))


def test_transposed_grid_of_fvdb(grids):
    """Up to fVDB's conv_transpose_grid of the input, with negative coordinates and stride 2."""
    rng, gb = grids
    up = GridBatch.from_ijk([conv_transpose_grid_ijk(v, 3, 2) for v in gb.ijk.unbind()])
    x = rng.standard_normal((gb.total_voxels, 2)).astype(np.float32)
    w, b = _weights(rng, 3, 2, 3)
    assert_close(run_conv(gb, up, x, w, b, S=2, transposed=True), sparse_conv3d(gb, x, up, w, b, 2, True))


def test_grids_built_by_warp(warp_ref):
    """The same over grids warp-lang's own NanoVDB builder wrote (a shell and its stride-2 conv_grid)."""
    rng = np.random.default_rng(12)
    ijk = shell((4, -7, 30), 7.5, rng)
    fine = GridBatch.from_buffer(warp_ref.volume_bytes(warp_ref.volume_from_ijk(ijk)))
    coarse = GridBatch.from_buffer(warp_ref.volume_bytes(warp_ref.volume_from_ijk(conv_grid_ijk(ijk, 3, 2))))
    x = rng.standard_normal((fine.total_voxels, 3)).astype(np.float32)
    w, b = _weights(rng, 4, 3, 3)
    assert_close(run_conv(fine, fine, x, w, b), sparse_conv3d(fine, x, fine, w, b))
    assert_close(run_conv(fine, coarse, x, w, b, S=2), sparse_conv3d(fine, x, coarse, w, b, 2))


def test_constant_grids_fold_the_kernel_map(grids):
    rng, gb = grids
    x = rng.standard_normal((gb.total_voxels, 4)).astype(np.float32)
    w, b = _weights(rng, 5, 4, 3)
    assert_close(run_conv(gb, gb, x, w, b, grids_constant=True), sparse_conv3d(gb, x, gb, w, b))


@pytest.mark.parametrize("K", [3, 5])
def test_a_folded_map_runs_its_voxels_grouped_by_the_taps_they_read(grids, K):
    """A map known at compile time runs its output voxels in rows_by_taps' order (items that share
    taps skip the rest); each voxel's result still lands in its own row. K = 5: 125 taps, 4 words."""
    from luisaml.operators.fvdb.conv import rows_by_taps

    rng, gb = grids
    kmap = F.sparse_conv_kernel_map(F.bundle_tensors(gb), F.bundle_tensors(gb), K).numpy()
    order = rows_by_taps(kmap)
    np.testing.assert_array_equal(np.sort(order), np.arange(len(kmap)))  # a permutation
    keys = [tuple(sum(1 << b for b in range(32) if w + b < K ** 3 and kmap[o, w + b] >= 0)
                  for w in range(0, K ** 3, 32)) for o in order]
    assert keys == sorted(keys) and order.tolist() != list(range(len(kmap)))
    x = rng.standard_normal((gb.total_voxels, 6)).astype(np.float32)
    w, b = _weights(rng, 7, 6, K)
    assert_close(run_conv(gb, gb, x, w, b, grids_constant=True), sparse_conv3d(gb, x, gb, w, b))


def test_single_voxel():
    rng = np.random.default_rng(3)
    one = GridBatch.from_ijk([np.array([[-5, 7, 1000]], np.int32)])
    x = rng.standard_normal((1, 3)).astype(np.float32)
    w, b = _weights(rng, 4, 3, 3)
    got = run_conv(one, one, x, w, b)
    assert_close(got, sparse_conv3d(one, x, one, w, b))
    assert_close(got, (w[:, :, 1, 1, 1] @ x[0] + b)[None])  # only the centre tap reads a voxel


def test_empty_grids():
    rng = np.random.default_rng(4)
    empty = GridBatch.from_ijk([np.zeros((0, 3), np.int32)])
    some = GridBatch.from_ijk([rng.integers(-4, 4, (20, 3)).astype(np.int32)])
    w, b = _weights(rng, 4, 3, 3)
    x = rng.standard_normal((some.total_voxels, 3)).astype(np.float32)
    assert run_conv(some, empty, x, w, b).shape == (0, 4)
    # no input voxels: every tap is missing, the output is the bias
    got = run_conv(empty, some, np.zeros((0, 3), np.float32), w, b)
    np.testing.assert_array_equal(got, np.broadcast_to(b, (some.total_voxels, 4)))


# ---- one map, several layers, fused epilogues --------------------------------------------------------


def test_one_kernel_map_feeds_layers_with_fused_batchnorm_and_relu(grids):
    rng, gb = grids
    c = 8
    x = rng.standard_normal((gb.total_voxels, c)).astype(np.float32)
    (w1, b1), (w2, b2) = _weights(rng, c, c, 3), _weights(rng, c, c, 3)
    scale, shift, mean = (rng.standard_normal(c).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.5, 2.0, c).astype(np.float32)
    feeds = {**_pair_feeds(gb, gb), "x": x}
    consts = dict(w1=w1, b1=b1, w2=w2, b2=b2, scale=scale, shift=shift, mean=mean, var=var)
    nodes = [_kernel_map_node(3, 1, False, gb),
             helper.make_node(schema.SPARSE_CONV, ["x", "kmap", "w1", "b1"], ["h0"], name="conv1", domain="fvdb"),
             helper.make_node("BatchNormalization", ["h0", "scale", "shift", "mean", "var"], ["h1"], name="bn"),
             helper.make_node("Relu", ["h1"], ["h"], name="relu"),
             helper.make_node(schema.SPARSE_CONV, ["h", "kmap", "w2", "b2"], ["y"], name="conv2", domain="fvdb")]
    net = luisaml.compile(fvdb_model(nodes, {**feeds, **consts}, constants=tuple(consts), outputs=["y"]),
                          batch_axis=None)
    stages = net.plan.schedule.stages
    assert [st.root[0].op_type for st in stages] == [schema.KERNEL_MAP, schema.SPARSE_CONV, schema.SPARSE_CONV]
    # the BatchNormalization folds into conv1's constant weight and bias (passes/cleanup.py), the
    # Relu is conv1's epilogue
    assert [n.op_type for n, _ in stages[1].epilogue] == ["Relu"]
    assert "BatchNormalization" not in [n.op_type for n, _ in net.plan.ops]
    assert "kmap" in stages[2].reads  # the second layer reads the map the first stage built
    h = sparse_conv3d(gb, x, gb, w1, b1)
    h = np.maximum((h - mean) / np.sqrt(var.astype(np.float64) + 1e-5) * scale + shift, 0)
    assert_close(net.run(feeds)["y"], sparse_conv3d(gb, h, gb, w2, b2))


def test_kernel_maps_fed_at_run_time_are_checked(grids):
    rng, gb = grids
    x = rng.standard_normal((10, 2)).astype(np.float32)
    w, b = _weights(rng, 3, 2, 1)
    kmap = np.full((4, 1), -1, np.int32)
    m = fvdb_model([helper.make_node(schema.SPARSE_CONV, ["x", "kmap", "w", "b"], ["y"], name="conv", domain="fvdb")],
                   {"x": x, "kmap": kmap, "w": w, "b": b}, constants=("w", "b"))
    net = luisaml.compile(m, batch_axis=None)
    kmap[2, 0] = 3
    assert_close(net.run({"x": x, "kmap": kmap})["y"], np.broadcast_to(b, (4, 3)) + np.eye(4)[:, 2:3] * (w[:, :, 0, 0, 0] @ x[3]))
    kmap[1, 0] = 10
    with pytest.raises(luisaml.RunError, match=r"node 'conv' \(fvdb::SparseConv3d\): kernel_map 'kmap' holds an index "
                                               r"outside \[-1, 10\)"):
        net.run({"x": x, "kmap": kmap})


def test_shape_errors_name_the_node_and_inputs():
    x, kmap = np.zeros((5, 3), np.float32), np.zeros((4, 27), np.int32)
    w = np.zeros((2, 4, 3, 3, 3), np.float32)
    m = fvdb_model([helper.make_node(schema.SPARSE_CONV, ["x", "kmap", "w"], ["y"], name="conv", domain="fvdb")],
                   {"x": x, "kmap": kmap, "w": w}, constants=("w",))
    with pytest.raises(luisaml.CompileError, match=r"node 'conv' \(fvdb::SparseConv3d\): weight 'w' \[2, 4, 3, 3, 3\] "
                                                   r"has 4 input channels, features 'x' \[5, 3\] have 3"):
        luisaml.compile(m, batch_axis=None)


# ---- torch -------------------------------------------------------------------------------------------


def test_torch_functions_equal_the_reference(grids):
    rng, gb = grids
    coarse = GridBatch.from_ijk([conv_grid_ijk(v, 3, 2) for v in gb.ijk.unbind()])
    fine_t, coarse_t = F.bundle_tensors(gb), F.bundle_tensors(coarse)
    x = rng.standard_normal((gb.total_voxels, 4)).astype(np.float32)
    w, b = _weights(rng, 5, 4, 3)
    kmap = F.sparse_conv_kernel_map(fine_t, coarse_t, 3, 2)
    y = F.sparse_conv3d(torch.from_numpy(x), kmap, torch.from_numpy(w), torch.from_numpy(b))
    assert_close(y.detach().numpy(), sparse_conv3d(gb, x, coarse, w, b, 2))
    up = F.sparse_conv_kernel_map(coarse_t, fine_t, 3, 2, transposed=True)
    w2, _ = _weights(rng, 4, 5, 3)
    z = F.sparse_conv3d(y, up, torch.from_numpy(w2))
    assert_close(z.detach().numpy(), sparse_conv3d(coarse, y.detach().numpy(), gb, w2, None, 2, True))


def test_torch_gradients_are_those_of_torchs_dense_convolution():
    """On a dense box every voxel is active: the sparse convolution is conv3d with zero padding."""
    rng = np.random.default_rng(9)
    box = GridBatch.from_dense(1, (5, 4, 6), (-2, 0, 3))
    kmap = F.sparse_conv_kernel_map(F.bundle_tensors(box), F.bundle_tensors(box), 3)
    ijk = box.ijk.jdata - np.array([-2, 0, 3])
    x = torch.from_numpy(rng.standard_normal((box.total_voxels, 3))).requires_grad_()
    w = torch.from_numpy(rng.standard_normal((4, 3, 3, 3, 3))).requires_grad_()
    b = torch.from_numpy(rng.standard_normal(4)).requires_grad_()
    g = torch.from_numpy(rng.standard_normal((box.total_voxels, 4)))
    (F.sparse_conv3d(x, kmap, w, b) * g).sum().backward()
    xd = x.detach().clone().requires_grad_()
    wd, bd = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    vol = torch.zeros((1, 3, 5, 4, 6), dtype=torch.float64)
    vol[0, :, ijk[:, 0], ijk[:, 1], ijk[:, 2]] = xd.T
    yd = torch.nn.functional.conv3d(vol, wd, bd, padding=1)[0, :, ijk[:, 0], ijk[:, 1], ijk[:, 2]].T
    (yd * g).sum().backward()
    for got, want in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-10)


class _UNetLevel(torch.nn.Module):
    """conv -> BN -> ReLU -> conv at the fine level, one kernel map for both; down and back up."""

    def __init__(self, fine, coarse, c=6):
        super().__init__()
        self.fine, self.coarse = [F.bundle_tensors(g) for g in (fine, coarse)]
        self.conv1, self.conv2 = F.SparseConv3d(c, c, 3), F.SparseConv3d(c, c, 3)
        self.bn = torch.nn.BatchNorm1d(c)
        self.down, self.up = F.SparseConv3d(c, c, 2), F.SparseConv3d(c, c, 2, bias=False)

    def forward(self, x):
        same = F.sparse_conv_kernel_map(self.fine, self.fine, 3)
        h = self.conv2(torch.relu(self.bn(self.conv1(x, same))), same)
        d = self.down(h, F.sparse_conv_kernel_map(self.fine, self.coarse, 2, 2))
        return h + self.up(d, F.sparse_conv_kernel_map(self.coarse, self.fine, 2, 2, transposed=True))


def test_exported_torch_module_compiles_and_runs(grids):
    rng, gb = grids
    coarse = GridBatch.from_ijk([conv_grid_ijk(v, 2, 2) for v in gb.ijk.unbind()])
    torch.manual_seed(0)
    model = _UNetLevel(gb, coarse).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    x = torch.from_numpy(rng.standard_normal((gb.total_voxels, 6)).astype(np.float32))
    buf = io.BytesIO()
    F.export_onnx(model, (x,), buf, input_names=["x"], output_names=["y"])
    net = luisaml.compile(onnx.load_from_string(buf.getvalue()), batch_axis=None)
    # the grids are buffers of the module (constants): the three kernel maps fold on the host
    assert [n.op_type for n, _ in net.plan.ops].count(schema.SPARSE_CONV) == 4
    assert schema.KERNEL_MAP not in [n.op_type for n, _ in net.plan.ops]
    fused = [st for st in net.plan.schedule.stages if st.epilogue]
    assert any(n.op_type == "Relu" for st in fused for n, _ in st.epilogue)
    with torch.no_grad():
        want = model(x).numpy()
    assert_close(net.run({"x": x.numpy()})["y"], want)
