"""NonMaxSuppression (operators/detection.py) against onnxruntime on hundreds of seeded random box sets,
and the luisaml domain's RotatedNMS / CircleNMS against the numpy references of nms_reference.py
(OpenPCDet's nms_gpu / boxes_iou_bev, CenterPoint's circle_nms).

Each compiled model is one structural variant (box format, which inputs are given and how); the box
sets go through `net.run`. Coordinates are multiples of 1/4 on small grids, so many pairs have an
IoU exactly at the threshold (0.25, 0.5: exact in float32), scores come from a few values (ties),
some boxes have zero width or height, and format 0's corners come in either order."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import luisaml

import nms_reference as ref
from util import graph_model, ort_run

SHAPES = [(1, 1, 6), (2, 3, 17), (3, 2, 40)]  # (B, C, N) of the nodes of one model


def random_boxes(rng, B, N, center):
    """[B, N, 4] boxes on a 1/4 grid: format 0 [y1, x1, y2, x2] with corners swapped at random, or
    format 1 [xc, yc, w, h]; about one in ten has zero width or height."""
    lo = rng.integers(0, 16, (B, N, 2)) / 4.0
    size = rng.integers(1, 12, (B, N, 2)) / 4.0
    size[rng.random((B, N, 2)) < 0.05] = 0.0
    if center:
        return np.concatenate([lo + size / 2, size], -1).astype(np.float32)
    y1, x1 = lo[..., 0], lo[..., 1]
    y2, x2 = y1 + size[..., 0], x1 + size[..., 1]
    swap_y, swap_x = rng.random((B, N)) < 0.3, rng.random((B, N)) < 0.3
    y1, y2 = np.where(swap_y, y2, y1), np.where(swap_y, y1, y2)
    x1, x2 = np.where(swap_x, x2, x1), np.where(swap_x, x1, x2)
    return np.stack([y1, x1, y2, x2], -1).astype(np.float32)


def random_scores(rng, B, C, N):
    """Scores from eight values: many ties within a class."""
    return (rng.integers(0, 8, (B, C, N)) / 8.0).astype(np.float32)


def nms_model(center: int, given: str, constants: dict | None = None):
    """One NonMaxSuppression node per SHAPES entry. given: which optional inputs the nodes take
    ("" none, "m" max_output_boxes_per_class, "mi" and iou_threshold, "mis" and score_threshold);
    constants: those that are initializers (shared by the nodes), the rest graph inputs."""
    constants = constants or {}
    nodes, inputs = [], {}
    optional = [("max", "m", np.int64), ("iou", "i", np.float32), ("sth", "s", np.float32)]
    for k, (B, C, N) in enumerate(SHAPES):
        names = [f"boxes{k}", f"scores{k}"]
        inputs[f"boxes{k}"] = np.zeros((B, N, 4), np.float32)
        inputs[f"scores{k}"] = np.zeros((B, C, N), np.float32)
        for name, key, dtype in optional:
            if key in given:
                names.append(name)
                if name not in constants:
                    inputs[name] = np.zeros([1], dtype)
        nodes.append(helper.make_node("NonMaxSuppression", names, [f"sel{k}"], name=f"NMS_{k}",
                                      center_point_box=center))
    return graph_model(nodes, inputs, constants, opset=11)


def assert_same_selection(net, model, feeds, what=""):
    got, want = net.run(feeds), ort_run(model, feeds)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == np.int64 and g.shape == w.shape, f"{what}{name}: {g.shape} {g.dtype} != onnxruntime {w.shape}"
        np.testing.assert_array_equal(g, w, err_msg=f"{what}{name}")
    return sum(len(w) for w in want.values())


def box_feeds(rng, center, extra):
    feeds = dict(extra)
    for k, (B, C, N) in enumerate(SHAPES):
        feeds[f"boxes{k}"] = random_boxes(rng, B, N, center)
        feeds[f"scores{k}"] = random_scores(rng, B, C, N)
    return feeds


@pytest.mark.parametrize("center", [0, 1], ids=["corners", "center"])
def test_nms_with_thresholds_as_graph_inputs(center):
    """max_output_boxes_per_class 0, 1, 3, large; iou_threshold 0, 0.25, 0.5 (exact IoUs on the grid),
    0.7, 1; score_threshold below every score, between, above: graph inputs read at run time."""
    model = nms_model(center, "mis")
    net = luisaml.compile(model, batch_axis=None)
    rng = np.random.default_rng(center)
    selected = 0
    for run in range(80):
        extra = {"max": np.array([[0, 1, 3, 1000][run % 4]], np.int64),
                 "iou": np.array([[0.0, 0.25, 0.5, 0.7, 1.0][run % 5]], np.float32),
                 "sth": np.array([[-1.0, 0.3, 0.5, 2.0][(run // 4) % 4]], np.float32)}
        selected += assert_same_selection(net, model, box_feeds(rng, center, extra), f"run {run}: ")
    assert selected > 500  # the sets select boxes (not all empty)


@pytest.mark.parametrize("center,given,constants", [
    (0, "mi", {"max": np.array([4], np.int64), "iou": np.array([0.5], np.float32)}),
    (1, "mis", {"max": np.array([1000], np.int64), "iou": np.array([0.25], np.float32),
                "sth": np.array([0.25], np.float32)}),
    (0, "m", {"max": np.array([2], np.int64)}),  # iou_threshold absent: 0 (any overlap suppresses)
    (0, "", {}),  # max_output_boxes_per_class absent: 0, no output
], ids=["corners-no-score-threshold", "center-all-constant", "no-iou-threshold", "no-max"])
def test_nms_with_constant_and_absent_inputs(center, given, constants):
    model = nms_model(center, given, constants)
    net = luisaml.compile(model, batch_axis=None)
    rng = np.random.default_rng(10 + len(given))
    for run in range(40):
        assert_same_selection(net, model, box_feeds(rng, center, {}), f"run {run}: ")


def test_nms_iou_exactly_at_the_threshold_is_not_suppressed():
    """IoU 0.5 and 0.25 exactly (float32): onnxruntime suppresses only above the threshold; equal
    scores keep the lower index; a zero-area box suppresses nothing and is never suppressed."""
    boxes = np.array([[[0, 0, 2, 2], [0, 0, 2, 1], [2, 2, 0, 0], [0, 0, 1, 1], [1, 1, 1, 3]]], np.float32)
    scores = np.array([[[0.9, 0.8, 0.9, 0.7, 0.95]]], np.float32)
    node = helper.make_node("NonMaxSuppression", ["b", "s", "max", "iou"], ["sel"], name="NMS_0")
    model = graph_model([node], {"b": boxes, "s": scores, "iou": np.zeros([1], np.float32)},
                        {"max": np.array([10], np.int64)}, opset=11)
    net = luisaml.compile(model, batch_axis=None)
    for iou in (0.25, 0.5, 0.2499, 0.4999, 0.9999):
        feeds = {"b": boxes, "s": scores, "iou": np.array([iou], np.float32)}
        assert_same_selection(net, model, feeds, f"iou {iou}: ")


def test_nms_of_a_batched_input_compiles_per_batch():
    """Boxes and scores following the batch: the selection spans the batch (its first column), so the
    network compiles per batch size; no per-sample `forward`."""
    node = helper.make_node("NonMaxSuppression", ["b", "s", "max", "iou"], ["sel"], name="NMS_0")
    rng = np.random.default_rng(5)
    model = graph_model([node], {"b": random_boxes(rng, 2, 9, 0), "s": random_scores(rng, 2, 2, 9)},
                        {"max": np.array([3], np.int64), "iou": np.array([0.25], np.float32)}, opset=11, batch="N")
    net = luisaml.compile(model, batch_axis=0)
    for n in (2, 3):
        assert_same_selection(net, model, {"b": random_boxes(rng, n, 9, 0), "s": random_scores(rng, n, 2, 9)})
    with pytest.raises(luisaml.UsageError, match="'NMS_0'"):
        net.forward  # noqa: B018


def test_ssdlite_style_postprocessing_matches_onnxruntime():
    """ReduceMax over classes -> TopK of the anchors -> Gather of their boxes and scores ->
    NonMaxSuppression, as an SSDLite export ends, against onnxruntime. The selected boxes themselves
    (a Gather of the selection) need a node that reads an output sized at run time, which is
    refused with the node named: the host gathers them from the graph's outputs here."""
    A, C, K = 60, 4, 20
    nodes = [
        helper.make_node("ReduceMax", ["scores"], ["best"], axes=[0], keepdims=0),
        helper.make_node("TopK", ["best", "k"], ["top", "idx"], axis=0),
        helper.make_node("Gather", ["boxes", "idx"], ["cand"], axis=0),
        helper.make_node("Gather", ["scores", "idx"], ["cand_scores"], axis=1),
        helper.make_node("Unsqueeze", ["cand", "zero"], ["cand3"]),
        helper.make_node("Unsqueeze", ["cand_scores", "zero"], ["cand_scores3"]),
        helper.make_node("NonMaxSuppression", ["cand3", "cand_scores3", "max", "iou", "sth"], ["sel"], name="nms"),
    ]
    rng = np.random.default_rng(11)

    def feeds():
        return {"boxes": random_boxes(rng, 1, A, 0)[0], "scores": rng.random((C, A)).astype(np.float32)}

    consts = {"k": np.array([K], np.int64), "zero": np.array([0], np.int64), "max": np.array([5], np.int64),
              "iou": np.array([0.45], np.float32), "sth": np.array([0.3], np.float32)}
    model = graph_model(nodes, feeds(), consts, opset=13, outputs=["cand", "sel"])
    net = luisaml.compile(model, batch_axis=None)
    for run in range(20):
        f = feeds()
        got, want = net.run(f), ort_run(model, f)
        np.testing.assert_array_equal(got["cand"], want["cand"])
        np.testing.assert_array_equal(got["sel"], want["sel"])
        np.testing.assert_array_equal(got["cand"][got["sel"][:, 2]], want["cand"][want["sel"][:, 2]])
    reader = nodes + [helper.make_node("Gather", ["sel", "two"], ["box_index"], axis=1, name="pick")]
    bad = graph_model(reader, feeds(), {**consts, "two": np.array(2, np.int64)}, opset=13, outputs=["box_index"])
    with pytest.raises(luisaml.LuisamlError, match="pick.*'sel'"):
        luisaml.compile(bad, batch_axis=None)


# ---- the luisaml domain -----------------------------------------------------------------------------

def luisaml_model(op_type, first, shape, n, **attrs):
    node = helper.make_node(op_type, [first, "scores"], ["kept"], domain="luisaml", name=op_type, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(first, TensorProto.FLOAT, shape),
                                        helper.make_tensor_value_info("scores", TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info("kept", TensorProto.INT64, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("luisaml", 1)])


def random_bev(rng, n, width):
    """[n, 7] (x, y, z, dx, dy, dz, heading) or [n, 5] BEV boxes, crowded enough to overlap; some
    exact duplicates (IoU 1) and axis-aligned ones (heading 0: edges on edges)."""
    xy = rng.uniform(0, 10, (n, 2))
    size = rng.uniform(0.5, 4, (n, 2))
    heading = rng.uniform(-np.pi, np.pi, (n, 1))
    heading[rng.random(n) < 0.2] = 0.0
    boxes = np.concatenate([xy, size, heading], 1) if width == 5 else \
        np.concatenate([xy, rng.uniform(-1, 1, (n, 1)), size, rng.uniform(1, 2, (n, 1)), heading], 1)
    dup = rng.integers(0, n, n // 8)
    boxes[dup[1:]] = boxes[dup[0]]
    return boxes.astype(np.float32)


@pytest.mark.parametrize("width,threshold,limit", [(7, 0.1, -1), (5, 0.5, 6)], ids=["7-wide", "5-wide-limited"])
def test_rotated_nms_matches_openpcdet_reference(width, threshold, limit):
    n = 40
    net = luisaml.compile(luisaml_model("RotatedNMS", "boxes", [n, width], n, iou_threshold=threshold,
                                        max_output=limit), batch_axis=None)
    rng = np.random.default_rng(width)
    for run in range(40):
        boxes = random_bev(rng, n, width)
        scores = (rng.integers(0, 10, n) / 10).astype(np.float32)
        got = net.run({"boxes": boxes, "scores": scores})["kept"]
        want = ref.rotated_nms(boxes, scores, threshold, limit, margin=1e-4)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want, err_msg=f"run {run}")


def test_rotated_iou_reference_is_the_polygon_area():
    """The reference itself against closed forms: a box against itself (IoU 1), a quarter overlap, a
    box turned by 90 degrees about a shared centre (a square's IoU 1; dx != dy: min/max)."""
    a = np.array([0, 0, 2, 2, 0.3])
    assert ref.iou_bev(a, a, 1e-4) == pytest.approx(1.0)
    assert ref.iou_bev(np.array([0, 0, 2, 2, 0]), np.array([1, 1, 2, 2, 0]), 1e-4) == pytest.approx(1 / 7)
    b = np.array([0, 0, 4, 1, 0.0])
    assert ref.iou_bev(b, b + [0, 0, 0, 0, np.pi / 2], 1e-4) == pytest.approx(1 / 7)


@pytest.mark.parametrize("limit", [-1, 5])
def test_circle_nms_matches_centerpoint_reference(limit):
    n = 50
    net = luisaml.compile(luisaml_model("CircleNMS", "centers", [n, 3], n, min_radius=1.0, max_output=limit),
                          batch_axis=None)
    rng = np.random.default_rng(20 + limit)
    for run in range(40):
        centers = (rng.integers(0, 32, (n, 3)) / 4).astype(np.float32)  # distances exactly 1 occur
        scores = (rng.integers(0, 10, n) / 10).astype(np.float32)
        got = net.run({"centers": centers, "scores": scores})["kept"]
        np.testing.assert_array_equal(got, ref.circle_nms(centers, scores, 1.0, limit), err_msg=f"run {run}")


def test_luisaml_domain_checks_name_the_node():
    bad = luisaml_model("RotatedNMS", "boxes", [8, 6], 8, iou_threshold=0.5)
    with pytest.raises(luisaml.LuisamlError, match=r"RotatedNMS.*\[N, 5\].*\[N, 7\]"):
        luisaml.compile(bad, batch_axis=None)
    # the schema is registered with onnx: strict shape inference types the output int64 [kept]
    from luisaml.opsets import luisaml as schema

    schema.register()
    m = luisaml_model("CircleNMS", "centers", [8, 2], 8, min_radius=1.0)
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("kept", TensorProto.UNDEFINED, None))
    inferred = onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
    kept = next(v for v in inferred.graph.output if v.name == "kept").type.tensor_type
    assert kept.elem_type == TensorProto.INT64 and [d.dim_param for d in kept.shape.dim] == ["kept"]
