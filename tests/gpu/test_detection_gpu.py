"""NonZero, NonMaxSuppression and the luisaml domain's RotatedNMS / CircleNMS on the CUDA backend
(operators/detection.py) against onnxruntime and the numpy references of tests/operators/nms_reference.py,
at sizes a detector's post-processing has (thousands of boxes, 80 classes, a million elements), and
with torch CUDA tensors in (DLPack: the outputs are fresh torch tensors of the read-back size).

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_detection_gpu.py -q"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper
from util import cuda_only, graph_model, ort_run

import luisaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operators"))
import nms_reference as ref  # noqa: E402
from test_nms import random_bev, random_boxes, random_scores  # noqa: E402

pytestmark = cuda_only()


def _same(got, want):
    for name, w in want.items():
        g = np.asarray(got[name])
        assert g.dtype == w.dtype and g.shape == w.shape, f"{name}: {g.shape} {g.dtype} != {w.shape} {w.dtype}"
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_nonzero_cuda_matches_onnxruntime():
    model = graph_model([helper.make_node("NonZero", ["x"], ["y"], name="NonZero_0")],
                        {"x": np.zeros((4, 512, 512), np.float32)}, opset=13)
    net = luisaml.compile(model, batch_axis=None)
    assert net.backend == "cuda"
    rng = np.random.default_rng(0)
    for density in (0.0, 0.01, 0.5, 1.0):
        x = np.where(rng.random((4, 512, 512)) < density, 1.0, 0.0).astype(np.float32)
        _same(net.run({"x": x}), ort_run(model, {"x": x}))


@pytest.mark.parametrize("center", [0, 1])
def test_nms_cuda_matches_onnxruntime(center):
    B, C, N = 2, 80, 1000
    node = helper.make_node("NonMaxSuppression", ["b", "s", "max", "iou", "sth"], ["sel"], name="NMS_0",
                            center_point_box=center)
    rng = np.random.default_rng(center)
    model = graph_model([node], {"b": random_boxes(rng, B, N, center), "s": random_scores(rng, B, C, N)},
                        {"max": np.array([100], np.int64), "iou": np.array([0.5], np.float32),
                         "sth": np.array([0.3], np.float32)}, opset=11)
    net = luisaml.compile(model, batch_axis=None)
    for _ in range(5):
        feeds = {"b": random_boxes(rng, B, N, center), "s": random_scores(rng, B, C, N)}
        _same(net.run(feeds), ort_run(model, feeds))


def _luisaml_model(op_type, first, shape, n, **attrs):
    node = helper.make_node(op_type, [first, "scores"], ["kept"], domain="luisaml", name=op_type, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(first, TensorProto.FLOAT, shape),
                                        helper.make_tensor_value_info("scores", TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info("kept", TensorProto.INT64, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("luisaml", 1)],
                             ir_version=10)


def test_rotated_and_circle_nms_cuda_match_the_references():
    n = 300
    rot = luisaml.compile(_luisaml_model("RotatedNMS", "boxes", [n, 7], n, iou_threshold=0.1, max_output=83),
                          batch_axis=None)
    circ = luisaml.compile(_luisaml_model("CircleNMS", "centers", [n, 3], n, min_radius=0.5), batch_axis=None)
    rng = np.random.default_rng(4)
    for _ in range(3):
        boxes = random_bev(rng, n, 7)
        boxes[:, :2] *= 4  # spread 300 boxes as densely as the CPU test's 40
        scores = rng.random(n).astype(np.float32)
        np.testing.assert_array_equal(rot.run({"boxes": boxes, "scores": scores})["kept"],
                                      ref.rotated_nms(boxes, scores, 0.1, 83, margin=1e-4))
        centers = (rng.integers(0, 80, (n, 3)) / 4).astype(np.float32)
        np.testing.assert_array_equal(circ.run({"centers": centers, "scores": scores})["kept"],
                                      ref.circle_nms(centers, scores, 0.5))


def test_torch_cuda_tensors_in_give_fresh_outputs_of_the_read_back_size():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    model = graph_model([helper.make_node("NonZero", ["x"], ["y"], name="NonZero_0")],
                        {"x": np.zeros((64, 100), np.float32)}, opset=13)
    net = luisaml.compile(model, batch_axis=None)
    rng = np.random.default_rng(1)
    outs = []
    for density in (0.1, 0.6):
        x = np.where(rng.random((64, 100)) < density, 2.0, 0.0).astype(np.float32)
        y = net.run({"x": torch.from_numpy(x).cuda()})["y"]
        assert isinstance(y, torch.Tensor) and y.is_cuda and y.shape[0] == 2
        np.testing.assert_array_equal(y.cpu().numpy(), ort_run(model, {"x": x})["y"])
        outs.append(y)
    assert outs[0].data_ptr() != outs[1].data_ptr()
