"""fvdb.SparseConv3d over grids bound at run time (voxels as the batch) in its GPU form: cooperative
blocks whose tile rows are 64 consecutive samples (a "grouped" blocks stage: ceil(n / 64) groups, the
batch an argument of the kernel), against tests/fvdb's numpy reference and the torch modules of
examples/sparse_unet.py. Batches smaller than a tile, not a multiple of it, one voxel, two grids, a
coarse level whose rows past its voxels are padding, transposed maps, and the BatchNorm + Relu + Add
epilogue.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_sparse_conv_any_grid_cuda.py -q"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from util import cuda_only, example_module

import luisaml

pytestmark = cuda_only()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fvdb"))
import test_sparse_conv_any_grid as A  # noqa: E402


def _grouped(net) -> list:
    return [st for st in net.plan.schedule.stages if st.domain == "blocks" and st.samples > 1]


@pytest.mark.parametrize("C, grids", [(32, 1), (64, 2)])
def test_a_residual_block_over_grids_of_any_size(C, grids):
    rng = np.random.default_rng(C)
    m, p = A.block_model(C, 3, rng, grids)
    net = luisaml.compile(m)
    assert len(_grouped(net)) == 2  # both convolutions
    sizes = []
    for gb in (A.sphere(1, 400, 6.0, grids), A.sphere(2, 2500, 14.0, grids), A.sphere(3, 30, 2.0, grids),
               A.sphere(4, 1, 1.0, grids)):
        x = rng.standard_normal((gb.total_voxels, C)).astype(np.float32)
        out = net.run({**A.grid_feeds(gb, "in_", "out_"), "x": x})["y"]
        A.assert_close(out, A.reference_block(gb, x.astype(np.float64), p))
        sizes.append(gb.total_voxels)
    assert min(sizes) < 64 and max(sizes) > 64 and any(s % 64 for s in sizes)


def test_a_unet_that_coarsens_its_grid_in_blocks_equals_torch():
    """FineGridUNet with 16 channels: its convolutions at both levels, the stride-2 down and the
    transposed up take the grouped blocks form; torch CUDA tensors in (the zero-copy path)."""
    with example_module("sparse_unet.py") as ex:
        torch.manual_seed(0)
        model = ex.FineGridUNet(ex.sphere_points(8, np.random.default_rng(0)), 0.1, 4, 16, 3).eval()
        fine, _ = ex.grid_pair(ex.sphere_points(400, np.random.default_rng(1)), 0.1)
        net = luisaml.compile(ex.export_fine_grid_unet(model, torch.zeros(int(fine[5][-1]), 4), fine))
        assert len(_grouped(net)) >= 5
        for points, seed in ((3000, 2), (700, 3), (40, 4)):
            fine, coarse = ex.grid_pair(ex.sphere_points(points, np.random.default_rng(seed)), 0.1)
            x = torch.randn(int(fine[5][-1]), 4)
            with torch.no_grad():
                want = model(x, *fine).numpy()
            feeds = {k: torch.from_numpy(v).cuda() for k, v in ex.fine_feeds(x, fine).items()}
            got = net.run(feeds)["out"].cpu().numpy()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_layers_of_different_widths_share_pooled_buffers():
    """16 -> 64 -> 16 -> 16 -> 16 channels: a narrow layer's features land in a buffer slot sized for
    the wide one, so a sample's rows lie the slot's size apart; the grouped tile reads and writes
    each row at its own sample (the kernel map's rows, the gathered features and the store)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(7)
    widths = [16, 64, 16, 16, 16]
    p = {}
    nodes, cur = [A.kmap_node(3)], "x"
    for i, (c, k) in enumerate(zip(widths, widths[1:])):
        p[f"w{i}"] = (rng.standard_normal((k, c, 3, 3, 3)) / np.sqrt(c * 27)).astype(np.float32)
        p[f"b{i}"] = rng.standard_normal(k).astype(np.float32)
        nodes += [helper.make_node(A.schema.SPARSE_CONV, [cur, "kmap", f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}",
                                   domain=A.schema.DOMAIN), helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        cur = f"r{i}"
    example = A.sphere(0, 50, 3.0)
    feeds = {**A.grid_feeds(example, "in_", "out_"), "x": np.zeros((example.total_voxels, 16), np.float32)}
    g = helper.make_graph(nodes, "widths", A.typed_inputs(feeds),
                          [helper.make_tensor_value_info(cur, A.onnx.TensorProto.FLOAT, ["V", 16])],
                          [numpy_helper.from_array(v, k) for k, v in p.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(A.schema.DOMAIN, 1)])
    net = luisaml.compile(m)
    assert len(_grouped(net)) == 4
    sizes = {t: slot.size for slot in net.plan.schedule.buffers.slots for t in slot.members}
    assert any(sizes[t.name] > t.numel for t in net.plan.tensors.values() if t.name in sizes and t.batched)
    for gb in (A.sphere(1, 400, 6.0), A.sphere(2, 2500, 14.0)):
        x = rng.standard_normal((gb.total_voxels, 16)).astype(np.float32)
        want = x.astype(np.float64)
        for i in range(len(widths) - 1):
            want = np.maximum(A.sparse_conv3d(gb, want, gb, p[f"w{i}"].astype(np.float64),
                                              p[f"b{i}"].astype(np.float64)), 0)
        A.assert_close(net.run({**A.grid_feeds(gb, "in_", "out_"), "x": x})[cur], want)
