"""A small run of examples/sparse_unet.py: a grid from a point cloud and its coarse level folded from
fvdb.GridBatchFromPoints / fvdb.ConvGrid, sparse convolutions down and up, max pool, refine and a
skip connection, exported from torch, compiled by luisaml and compared with the torch module."""
import pytest

from util import example_module


@pytest.fixture(scope="module")
def example():
    with example_module("sparse_unet.py") as module:
        yield module


def test_sparse_unet_exports_compiles_and_equals_torch(example):
    r = example.main(example.Settings(points=600, voxel_size=0.25, channels=6, repeats=1), verbose=False)
    assert r["fine_voxels"] > r["coarse_voxels"] > 0
    assert {"GridBatchFromPoints", "ConvGrid", "MaxPool", "Refine", "PoolingMap", "RefineMap"} <= set(r["onnx_ops"])
    # the grids and every map fold on the host: the network is the feature arithmetic alone
    assert not {"GridBatchFromPoints", "ConvGrid", "SparseConvKernelMap", "PoolingMap", "RefineMap"} & set(r["ops"])
    assert r["ops"].count("SparseConv3d") == 6 and "Concat" in r["ops"]
    assert r["max_rel_diff_vs_torch"] <= 1e-5


def test_any_grid_mode_serves_several_point_clouds_with_one_network(example):
    r = example.any_grid(example.Settings(points=500, voxel_size=0.2, channels=5, repeats=1), clouds=2, verbose=False)
    sizes = [c["fine_voxels"] for c in r["clouds"]]
    assert len(set(sizes)) == 2 and all(c["fine_voxels"] > c["coarse_voxels"] > 0 for c in r["clouds"])
    assert all(c["max_rel_diff_vs_torch"] <= 1e-5 for c in r["clouds"])
