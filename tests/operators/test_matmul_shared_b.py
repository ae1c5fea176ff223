"""A MatMul whose B is one matrix for every batch entry of A (a Linear over [..., M, K]) is one
product of all A's rows: ConvNeXt's channels-last MLP over [H, W, C] and a sequence-first
attention's projection over [T, B, D] (nn.MultiheadAttention's export) had M = 14, 7 or the batch
size a product, under tiled.MIN_SIDE, and ran the CUDA items form at ~1 TFLOP/s (ConvNeXt-T
89.9 ms, BERT 40.0 ms on the H100: benchmarks/NOTES.md, "Two networks 10x behind torch").
Outputs against onnxruntime on the CPU backend (the folded items form), and the CUDA plan's form."""
import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand

from luisaml.runtime import analyze


def _stage(plan, node):
    return next(st for st in plan.schedule.stages if node in [n.name for n, _ in st.nodes])


def _channels_last(hw=14, k=64, n=96):
    """x [N, hw, hw, k] -> MatMul [k, n] + bias -> Relu (a ConvNeXt block's first Linear)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Add", ["h", "b"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    inits = {"w": rand((k, n), seed=2, low=-0.2, high=0.2), "b": rand((n,), seed=3)}
    return graph_model(nodes, {"x": rand((2, hw, hw, k))}, inits, batch="N")


@pytest.mark.parametrize("batch", [1, 3])
def test_channels_last_linear_equals_onnxruntime(batch):
    assert_matches_ort(_channels_last(), {"x": rand((batch, 14, 14, 64), seed=batch)}, rtol=1e-5, atol=1e-5)


def test_channels_last_linear_is_one_tiled_product_on_cuda():
    st = _stage(analyze(_channels_last(), target="cuda"), "fc")
    assert st.domain == "blocks", st.describe()
    assert st.root[1].M == 14 * 14 and st.root[1].nbatch == 1


def _sequence_first(t=12, d=32, n=48):
    """ids-free sketch of the MHA export: x [N, t, d] -> Transpose to [t, N, d] -> MatMul [d, n] + bias
    -> Transpose back to [N, t, n]: the batch is a middle dimension of the product's A."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("MatMul", ["xt", "w"], ["h"], name="proj"),
             helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Transpose", ["a"], ["y"], perm=[1, 0, 2])]
    inits = {"w": rand((d, n), seed=4, low=-0.3, high=0.3), "b": rand((n,), seed=5)}
    return graph_model(nodes, {"x": rand((2, t, d))}, inits, batch="N")


@pytest.mark.parametrize("batch", [2, 5])
def test_sequence_first_projection_equals_onnxruntime(batch):
    assert_matches_ort(_sequence_first(), {"x": rand((batch, 12, 32), seed=batch)}, rtol=1e-5, atol=1e-5)


def test_sequence_first_projection_is_one_tiled_product_on_cuda():
    st = _stage(analyze(_sequence_first(), target="cuda"), "proj")  # planned at batch 2
    assert st.domain == "blocks", st.describe()
    assert st.root[1].M == 12 * 2 and st.root[1].nbatch == 1


@pytest.mark.parametrize("b_shape,a_shape", [
    ((1, 1, 16, 24), (3, 5, 7, 16)),  # B's batch dimensions all 1: one product of 105 rows
    ((5, 16, 24), (3, 5, 7, 16)),  # a B per entry: stays batched
    ((5, 16, 24), (3, 1, 7, 16)),  # A broadcast over B's entries: stays batched
    ((16,), (3, 5, 7, 16)),  # a vector B: N = 1, dropped from the output
])
def test_batched_products_equal_onnxruntime(b_shape, a_shape):
    nodes = [helper.make_node("MatMul", ["a", "w"], ["y"])]
    model = graph_model(nodes, {"a": rand(a_shape, seed=1)}, {"w": rand(b_shape, seed=2)})
    assert_matches_ort(model, {"a": rand(a_shape, seed=1)}, batch_axis=None, rtol=1e-5, atol=1e-5)
