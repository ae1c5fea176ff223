"""The detector's voxelization on the device (examples/lidar_detector.py, --voxelize device): fvdb
GridBatchFromPoints built on the GPU (a host step's device build, CUDA's default) and fvdb.SplatNearest's
two phases (zero, atomic adds) over the voxels as the batch, against tests/fvdb's numpy reference; then
the whole detector over frames of different point counts against the torch module, both voxelizations.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_voxelize_cuda.py -q"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from util import cuda_only, example_module

pytestmark = cuda_only()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fvdb"))
import test_splat_nearest as S  # noqa: E402


def test_means_by_voxel_of_a_grid_built_on_the_gpu():
    S.test_means_by_voxel_of_a_grid_built_in_the_network_over_clouds_of_any_size()


@pytest.mark.parametrize("per_point", [True, False])
def test_sums_by_voxel_over_a_constant_grid(per_point):
    S.test_sums_by_voxel_over_a_constant_grid(S.make_scene(), per_point)


@pytest.mark.parametrize("voxelize", ["device", "host"])
def test_detector_from_points_equals_torch(voxelize):
    with example_module("lidar_detector.py") as ex:
        r = ex.main(ex.Settings(points=20_000, frames=3, radius=20.0, voxel_size=0.2, channels=16, candidates=32,
                                voxelize=voxelize), verbose=False)
    assert r["backend"] == "cuda"
    for f in r["frames"]:
        assert f["detections_luisaml"] == f["detections"] > 0 and f["same_kept"] and f["same_labels"]
        assert f["max_abs_diff_boxes"] <= 1e-4 and f["max_abs_diff_scores"] <= 1e-5
        assert f["max_abs_diff_features"] <= 1e-4
    assert np.unique([f["points"] for f in r["frames"]]).size == 3
