"""A first check of the core path on a few operators (the operator suites go deeper)."""
import numpy as np
import pytest

from util import assert_matches_ort, rand, single_node_model


@pytest.mark.parametrize("shape", [(1, 5), (3, 4), (2, 3, 4)])
def test_relu_add(shape):
    x = rand(shape, seed=1)
    b = rand(shape[-1:], seed=2)
    m = single_node_model("Add", {"x": x, "b": b})
    assert_matches_ort(m, {"x": x, "b": b}, batch_axis=None)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm(trans_a, trans_b):
    a = rand((3, 5) if not trans_a else (5, 3), seed=3)
    b = rand((5, 4) if not trans_b else (4, 5), seed=4)
    c = rand((4,), seed=5)
    m = single_node_model("Gemm", {"a": a}, initializers={"b": b, "c": c}, transA=trans_a, transB=trans_b, alpha=0.5, beta=2.0)
    assert_matches_ort(m, {"a": a}, batch_axis=None)
