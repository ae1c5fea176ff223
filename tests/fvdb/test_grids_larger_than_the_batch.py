"""A grid made inside a sparse network may hold more voxels than the grid it was made from: fVDB's
conv grid (kernel 3, stride 2) touches up to 8 coarse cells of each isolated fine voxel, a dilating
stride-1 one up to 27 (scattered LiDAR voxels). Over grids bound at run time the voxels are the batch,
so such a run's batch is its largest grid's voxels: the features over the finest grid are padded with
zero rows past its voxels, which no map names, and every output comes back cut to its grid's voxels
(luisaml/fvdb/voxel_rows.py). One compiled network serves frames whose conv grid is larger or smaller
than the fine grid; checked against the torch module (luisaml.fvdb.torch_ops, fVDB's semantics) and the
conv grid's voxels against the numpy reference (fvdb_reference.conv_grid)."""
import io

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import luisaml
from luisaml.errors import LuisamlError
from luisaml.fvdb import GridBatch
from luisaml.fvdb import torch_ops as F
from luisaml.opsets import fvdb as schema

import fvdb_reference as ref

GROWING = ("grid_blob", "leaf_batch_indices", "list_indices")  # the bundle parts that grow with the grid
NAMES = ["x"] + [f"fine_{n}" for n in schema.BUNDLE]


class Down(torch.nn.Module):
    """A conv over the fine grid, a kernel-3 conv onto its conv grid (stride 2, or a dilating stride 1),
    a conv there; returns the fine level's features and the conv grid's two."""

    def __init__(self, stride: int):
        super().__init__()
        self.stride = stride
        self.conv_in, self.down, self.conv_out = F.SparseConv3d(3, 4, 3), F.SparseConv3d(4, 5, 3, stride), \
            F.SparseConv3d(5, 2, 3)

    def forward(self, x, *fine):
        coarse = F.conv_grid(fine, 3, self.stride)
        f = torch.relu(self.conv_in(x, F.sparse_conv_kernel_map(fine, fine, 3)))
        h = torch.relu(self.down(f, F.sparse_conv_kernel_map(fine, coarse, 3, self.stride)))
        return f, h, self.conv_out(h, F.sparse_conv_kernel_map(coarse, coarse, 3))


def scattered(seed: int, n: int) -> np.ndarray:
    """n voxels far apart at odd coordinates: each touches 8 cells of the stride-2 conv grid."""
    rng = np.random.default_rng(seed)
    cells = rng.choice(16 ** 3, n, replace=False)
    return (np.stack(np.unravel_index(cells, (16,) * 3), 1) - 8) * 6 + 1


def solid(seed: int, side: int) -> np.ndarray:
    """A filled box of side^3 voxels at an offset: its stride-2 conv grid has fewer voxels."""
    r = np.arange(side)
    return np.stack(np.meshgrid(r, r, r, indexing="ij"), -1).reshape(-1, 3) + seed


def bundle(ijk: np.ndarray) -> tuple:
    return F.bundle_tensors(GridBatch.from_ijk([ijk.astype(np.int32)]))


def feeds(x: torch.Tensor, fine: tuple) -> dict:
    return {"x": x.numpy(), **{f"fine_{n}": t.numpy() for n, t in zip(schema.BUNDLE, fine)}}


def export(model: torch.nn.Module, fine: tuple) -> onnx.ModelProto:
    buf = io.BytesIO()
    dynamic = {"x": {0: "V"}, **{f"fine_{n}": {0: f"fine_{n}_rows"} for n in GROWING}}
    F.export_onnx(model, (torch.zeros(int(fine[5][-1]), 3), *fine), buf, input_names=NAMES,
                  output_names=["f", "h", "y"], dynamic_axes=dynamic)
    return onnx.load_from_string(buf.getvalue())


def assert_close(got, want):
    want = np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max(initial=0)), 1e-30)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert float(np.abs(got - want).max(initial=0)) / scale <= 1e-5


@pytest.fixture(scope="module", params=[2, 1], ids=["stride2", "dilating"])
def down(request):
    torch.manual_seed(request.param)
    model = Down(request.param).eval()
    return model, luisaml.compile(export(model, bundle(scattered(0, 6))))


def test_a_conv_grid_with_more_voxels_than_the_fine_grid_equals_torch(down):
    """Frames whose conv grid has more voxels than the fine grid (scattered) and fewer or as many
    (a solid box), in turn through one network: the batch follows the largest grid."""
    model, net = down
    frames = [scattered(1, 12), solid(3, 6), scattered(2, 40), solid(-4, 9), scattered(1, 12)]
    larger = 0
    for ijk in frames:
        fine = bundle(ijk)
        V = int(fine[5][-1])
        coarse = ref.conv_grid(GridBatch.from_ijk([ijk.astype(np.int32)]), 3, model.stride)[0]
        larger += len(coarse) > V
        x = torch.randn(V, 3)
        with torch.no_grad():
            want = model(x, *fine)
        got = net.run(feeds(x, fine))
        assert got["f"].shape == (V, 4) and got["h"].shape == got["y"].shape[:1] + (5,) == (len(coarse), 5)
        for name, w in zip(("f", "h", "y"), want):
            assert_close(got[name], w.numpy())
    assert larger == (3 if model.stride == 2 else 5)  # (scattered: 8 or 27 conv-grid voxels a fine voxel)


def test_profile_runs_at_the_larger_batch(down):
    _, net = down
    fine = bundle(scattered(5, 10))
    prof = net.profile(feeds(torch.randn(int(fine[5][-1]), 3), fine), repeat=1)
    assert prof.run_ms > 0 and len(prof) >= 1


def test_features_of_another_grid_are_still_refused(down):
    _, net = down
    fine = bundle(scattered(1, 12))
    for rows in (11, 13, 96):  # (96: the conv grid's voxels are not the features' either)
        with pytest.raises(LuisamlError, match=rf"input 'x' has {rows} rows, but it holds the voxels of the grid "
                                               r"of 'fine_batch_offsets', which has 12"):
            net.run(feeds(torch.zeros(rows, 3), fine))


def test_an_output_of_no_grid_keeps_the_inputs_rows():
    """A batched input no grid's rows reach (z: a Relu of its own) has the inputs' rows; the run pads it
    with the features to the conv grid's voxels and cuts its output back."""
    torch.manual_seed(3)
    model = Down(2).eval()
    m = export(model, bundle(scattered(0, 6)))
    x_type = next(vi for vi in m.graph.input if vi.name == "x").type.tensor_type
    V = x_type.shape.dim[0].dim_param
    m.graph.input.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [V, 2]))
    m.graph.node.append(helper.make_node("Relu", ["z"], ["zr"], name="z_relu"))
    m.graph.output.append(helper.make_tensor_value_info("zr", onnx.TensorProto.FLOAT, [V, 2]))
    net = luisaml.compile(m)
    fine = bundle(scattered(4, 9))
    x, zv = torch.randn(9, 3), np.random.default_rng(0).standard_normal((9, 2)).astype(np.float32)
    got = net.run({**feeds(x, fine), "z": zv})
    with torch.no_grad():
        want = model(x, *fine)
    assert got["h"].shape[0] == 72  # the conv grid: 8 voxels a fine voxel
    np.testing.assert_array_equal(got["zr"], np.maximum(zv, 0))
    for name, w in zip(("f", "h", "y"), want):
        assert_close(got[name], w.numpy())


def test_torch_tensors_in_place_at_the_larger_batch(monkeypatch):
    """The zero-copy path (torch tensors on the kernels' device; on the CPU backend mapped to torch's CPU
    tensors, as test_sparse_conv_any_grid does) pads the features and cuts the outputs too."""
    from luisaml import zero_copy

    monkeypatch.setattr(zero_copy, "SHARED_DEVICES", {"cuda": "cuda", "cpu": "cpu"})
    torch.manual_seed(4)
    model = Down(2).eval()
    net = luisaml.compile(export(model, bundle(scattered(0, 6))))
    where = {"cpu": "cpu", "cuda": "cuda"}[net.backend]
    for ijk in (scattered(6, 15), solid(2, 5)):
        fine = bundle(ijk)
        x = torch.randn(int(fine[5][-1]), 3)
        args = {"x": x.to(where), **{f"fine_{n}": t.to(where) for n, t in zip(schema.BUNDLE, fine)}}
        assert zero_copy.applies(net, args)
        got = net.run(args)
        with torch.no_grad():
            want = model(x, *fine)
        for name, w in zip(("f", "h", "y"), want):
            assert isinstance(got[name], torch.Tensor)
            assert_close(got[name].cpu().numpy(), w.numpy())
