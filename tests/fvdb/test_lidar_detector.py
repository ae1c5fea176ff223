"""A tiny run of examples/lidar_detector.py: points -> voxels -> sparse backbone (one strided layer) ->
fvdb.InjectToDense BEV -> 2-D head -> TopK -> box decoding -> luisaml.CircleNMS, compiled once (as two
networks split at the dense step) and run over frames of different point counts; the boxes, scores and
labels equal the torch module's (voxelized by torch_ops on the host) in count and order, with the
voxelization inside network A (points in: fvdb GridBatchFromPoints and SplatNearest) or on the host.
The whole detector as one ONNX is refused, naming the dense step and why."""
import numpy as np
import pytest

from util import example_module


@pytest.fixture(scope="module")
def example():
    with example_module("lidar_detector.py") as module:
        yield module


@pytest.mark.parametrize("voxelize", ["device", "host"])
def test_detector_boxes_equal_torch_over_frames_of_different_sizes(example, voxelize):
    r = example.main(example.Settings(points=700, frames=3, channels=4, radius=5.0, candidates=10,
                                      voxelize=voxelize), verbose=False)
    frames = r["frames"]
    assert len({f["points"] for f in frames}) == 3 and len({f["voxels"] for f in frames}) == 3
    for f in frames:
        assert f["coarse_voxels"] < f["voxels"]  # the strided layer's grid
        assert f["distinct_candidate_scores"] == f["candidates"]  # no ties: the order is defined
        assert 0 < f["detections"] < f["candidates"]  # boxes come out, and NMS suppresses some
        assert f["detections_luisaml"] == f["detections"] and f["same_kept"] and f["same_labels"]
        assert f["max_abs_diff_boxes"] <= 1e-4 and f["max_abs_diff_scores"] <= 1e-6
        # (device: the voxel means summed by atomics in another order than torch's index_add: float rounding)
        assert f["max_abs_diff_features"] <= 1e-5
        if r["backend"] == "cpu":  # (the coarse grid built on the host: no grid build's read-back)
            assert f["syncs"] == 2  # one wait a network a frame: the counts and the outputs at each run's end
    exported = set(r["one_network_ops"])
    assert {"fvdb.InjectToDense", "fvdb.SparseConv3d", "fvdb.ConvGrid", "luisaml.CircleNMS"} <= exported
    # one network of it all: refused at the dense step, saying why; the .lml refusals name the grid step
    assert "InjectToDense" in r["one_network"] and "follows the batch axis" in r["one_network"]
    step = "GridBatchFromPoints" if voxelize == "device" else "ConvGrid"  # (the first grid step each runs)
    assert all(step in m for m in r["save_messages"].values())


def test_network_b_takes_network_as_grids_each_built_once_a_frame(example, monkeypatch):
    """B builds the fine grid from the points and the coarse grid from it as A does, under other node and
    tensor names: each step is served by A's result of the same bytes (host_steps.py), so a frame builds
    each grid once; the detections equal torch's."""
    import torch

    from luisaml.fvdb import host_steps

    built = []
    real = host_steps.on_host
    monkeypatch.setattr(host_steps, "on_host", lambda node, *a: (built.append(node.op_type), real(node, *a))[1])
    cfg = example.Settings(points=700, channels=4, radius=5.0, candidates=10)
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    backbone, head = example.Backbone(cfg).eval(), example.Head(cfg).eval()
    frames = [example.lidar_frame(n, rng, cfg.radius) for n in (700, 500)]
    nets = example.compile_networks(cfg, backbone, head, frames[0], grid_build="host")
    for points in frames * 2:
        built.clear()
        out, _ = nets.run(points)
        assert built == ["GridBatchFromPoints", "ConvGrid"]
        fine, x = example.voxelize(points, cfg.voxel_size)
        with torch.no_grad():
            want = [t.numpy() for t in head(backbone(x, *fine), *fine)]
        np.testing.assert_array_equal(out["kept"], want[3])
        np.testing.assert_allclose(out["boxes"], want[0], rtol=1e-5, atol=1e-5)
