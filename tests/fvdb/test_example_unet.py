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
