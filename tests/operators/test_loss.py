"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss against onnxruntime: every reduction,
with and without weights and ignore_index, 2-d and 4-d scores."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand
from stage_forms import assert_per_batch, assert_stage_forms

I64 = np.int64


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
def test_losses(op):
    x2, x4 = rand((5, 4), seed=1, low=-3, high=3), rand((3, 4, 2, 3), seed=2, low=-3, high=3)
    t2 = np.random.default_rng(3).integers(0, 4, (5,)).astype(I64)
    t4 = np.random.default_rng(4).integers(0, 4, (3, 2, 3)).astype(I64)
    t2[1], t4[0, 1, 2] = 2, 2  # ignore_index 2 appears
    feeds = {"x2": x2, "x4": x4, "t2": t2, "t4": t4}
    inits = {"w": rand((4,), seed=5, low=0.2, high=2.0)}
    nodes = []
    for red in ("none", "sum", "mean"):
        for k, (x, t) in enumerate((("x2", "t2"), ("x4", "t4"))):
            outs = [f"{red}{k}"] + ([f"{red}{k}_lp"] if op == "SoftmaxCrossEntropyLoss" and red == "mean" else [])
            nodes.append(helper.make_node(op, [x, t], outs, reduction=red))
            nodes.append(helper.make_node(op, [x, t, "w"], [f"{red}{k}_w"], reduction=red))
            nodes.append(helper.make_node(op, [x, t, "w"], [f"{red}{k}_wi"], reduction=red, ignore_index=2))
            nodes.append(helper.make_node(op, [x, t], [f"{red}{k}_i"], reduction=red, ignore_index=2))
    assert_matches_ort(graph_model(nodes, feeds, inits, opset=13), feeds, batch_axis=None, rtol=1e-5, atol=1e-5)


def test_loss_half_and_batch():
    x, t = rand((4, 3), np.float16, seed=6), np.array([0, 2, 1, 2], I64)
    model = graph_model([helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["y", "lp"])], {"x": x, "t": t}, opset=13)
    assert_matches_ort(model, {"x": x, "t": t}, batch_axis=None, rtol=2e-3, atol=2e-3)
    x, t = rand((4, 3, 2), seed=7), np.random.default_rng(8).integers(0, 3, (4, 2)).astype(I64)
    nodes = [helper.make_node("NegativeLogLikelihoodLoss", ["x", "t"], ["y"], reduction="none")]
    assert_matches_ort(graph_model(nodes, {"x": x, "t": t}, opset=13, batch="N"), {"x": x, "t": t}, batch_axis=0)
    # a reduction over N, the batch axis, mixes samples: compiled per batch size
    nodes = [helper.make_node("NegativeLogLikelihoodLoss", ["x", "t"], ["y"], name="nll", reduction="mean")]
    assert_per_batch(graph_model(nodes, {"x": x, "t": t}, opset=13, batch="N"), _loss_feeds, "nll", sizes=(4, 6))


def _loss_feeds(n):
    return {"x": rand((n, 3, 2), seed=n), "t": np.random.default_rng(n).integers(0, 3, (n, 2)).astype(I64)}


def test_stage_forms():
    """Per-sample losses (reduction none) one thread per loss element in a batched model, at two
    batch sizes; with its log-probabilities too, SoftmaxCrossEntropyLoss has two outputs and runs
    one thread per sample."""
    from util import stage_of

    w = {"w": rand((3,), seed=9, low=0.2, high=2.0)}
    nodes = [helper.make_node("NegativeLogLikelihoodLoss", ["x", "t", "w"], ["nll"], name="nll", reduction="none",
                              ignore_index=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["sce"], name="sce", reduction="none"),
             helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["sce2", "lp"], name="sce2", reduction="none")]
    model = graph_model(nodes, {"x": rand((2, 3, 2)), "t": np.zeros((2, 2), I64)}, w, opset=13, batch="N")
    net = assert_stage_forms(model, _loss_feeds, ["nll", "sce"])
    assert stage_of(net, "sce2").domain == "sample"
