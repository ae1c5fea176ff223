"""GridSample against onnxruntime: every mode, padding mode and align_corners, 4-d and 5-d inputs,
grids reaching past the borders."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand

import luisaml


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
def test_grid_sample_2d(mode):
    x = rand((2, 3, 4, 5), seed=1)
    grid = rand((2, 6, 7, 2), seed=2, low=-1.3, high=1.3)  # some samples past the borders
    grid[0, 0, :4] = [[-1, -1], [1, 1], [0, 0], [0.5, -0.25]]  # corners, centre, exact halves
    nodes = []
    for pad in ("zeros", "border", "reflection"):
        for align in (0, 1):
            nodes.append(helper.make_node("GridSample", ["x", "g"], [f"{pad}{align}"], mode=mode, padding_mode=pad, align_corners=align))
    feeds = {"x": x, "g": grid}
    # cubic with border padding: onnxruntime clamps every coordinate into the image; ONNX's
    # reference (and luisaml) only those past the borders, so taps near an edge differ
    differ = [n for n in nodes if mode == "cubic" and n.output[0].startswith("border")]
    keep = [n for n in nodes if n not in differ]
    assert_matches_ort(graph_model(keep, feeds, opset=20), feeds, batch_axis=None, rtol=1e-5, atol=1e-5)
    if differ:
        from onnx.reference import ReferenceEvaluator

        model = graph_model(differ, feeds, opset=20)
        got = luisaml.compile(model, batch_axis=None).run(feeds)
        for name, want in zip([n.output[0] for n in differ], ReferenceEvaluator(model).run(None, feeds)):
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_grid_sample_opset16_names_and_3d():
    x = rand((1, 2, 3, 4), seed=3)
    grid = rand((1, 5, 2, 2), seed=4, low=-1.2, high=1.2)
    nodes = [helper.make_node("GridSample", ["x", "g"], [m], mode=m) for m in ("bilinear", "nearest", "bicubic")]
    assert_matches_ort(graph_model(nodes, {"x": x, "g": grid}, opset=16), {"x": x, "g": grid}, batch_axis=None,
                       rtol=1e-5, atol=1e-5)
    x5 = rand((1, 2, 3, 4, 3), seed=5)
    g5 = rand((1, 2, 3, 2, 3), seed=6, low=-1.2, high=1.2)
    nodes = [helper.make_node("GridSample", ["x", "g"], [f"{m}{p}"], mode=m, padding_mode=p)
             for m in ("linear", "nearest") for p in ("zeros", "border", "reflection")]
    assert_matches_ort(graph_model(nodes, {"x": x5, "g": g5}, opset=20), {"x": x5, "g": g5}, batch_axis=None,
                       rtol=1e-5, atol=1e-5)


def test_grid_sample_half_and_batch():
    x, g = rand((2, 3, 4, 4), np.float16, seed=7), rand((2, 3, 3, 2), np.float16, seed=8, low=-1, high=1)
    model = graph_model([helper.make_node("GridSample", ["x", "g"], ["y"])], {"x": x, "g": g}, opset=16)
    assert_matches_ort(model, {"x": x, "g": g}, batch_axis=None, rtol=2e-3, atol=2e-3)
    x, g = rand((3, 2, 4, 4), seed=9), rand((3, 2, 5, 2), seed=10, low=-1, high=1)
    model = graph_model([helper.make_node("GridSample", ["x", "g"], ["y"], mode="bicubic")], {"x": x, "g": g}, opset=16, batch="N")
    net, _ = assert_matches_ort(model, {"x": x, "g": g}, batch_axis=0, rtol=1e-5, atol=1e-5)
    assert net.batch_symbol == "N"


@pytest.mark.parametrize("attrs", [
    {"coordinate_transformation_mode": "half_pixel", "sampling_ratio": 2},
    {"coordinate_transformation_mode": "output_half_pixel", "sampling_ratio": 0, "spatial_scale": 0.5},
    {"coordinate_transformation_mode": "half_pixel", "mode": "max", "sampling_ratio": 3},
])
def test_roi_align(attrs):
    """RoiAlign against onnxruntime: two images, ROIs partly outside the image and one smaller than
    a pixel, average and max modes, a sampling grid sized by each ROI (sampling_ratio 0)."""
    from onnx import helper

    x = rand((2, 3, 9, 11), seed=4)
    rois = np.array([[0.5, 1.0, 7.5, 6.0], [-2.0, -1.0, 4.0, 12.0], [3.0, 3.0, 3.4, 3.2], [1.0, 0.0, 10.0, 8.5]],
                    np.float32) * (2.0 if attrs.get("spatial_scale") else 1.0)
    idx = np.array([0, 1, 1, 0], np.int64)
    node = helper.make_node("RoiAlign", ["x", "rois", "idx"], ["y"], output_height=3, output_width=4, **attrs)
    feeds = {"x": x, "rois": rois, "idx": idx}
    assert_matches_ort(graph_model([node], feeds, opset=16), feeds, batch_axis=None, rtol=1e-5, atol=1e-5)
