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
