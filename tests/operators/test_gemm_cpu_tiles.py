"""The CPU backend's Gemm and MatMul tiles (operators/gemm.py) against onnxruntime and torch: constant
weights packed as column-block panels (widths of whole multiples of 1,024 columns, several column
blocks, a ragged last one, a batched B, Gemm with transB, alpha, beta and C, one row a sample), and the
square tiles of a product whose B is not a constant (attention as torch's
scaled_dot_product_attention and nn.MultiheadAttention export it: Q K^T and attn V read through
inline Split, Transpose and Mul), whose last row block is ragged (token counts that 4 does not
divide)."""
import io

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of



@pytest.mark.parametrize("m,k,n", [(20, 64, 1024), (3, 40, 2048), (33, 17, 1000), (16, 8, 36)])
def test_matmul_constant_panels_equal_onnxruntime(m, k, n):
    """[batch, m, k] x [k, n] with B constant: several column blocks, the last one ragged for n = 1000
    and 36; products with a GPU block tiling read panels, the smaller ones (3 x 2048, 16 x 36) the
    [K][columns] layout (Dense.cpu_items)."""
    w = rand((k, n), seed=1, low=-0.5, high=0.5)
    model = graph_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], {"x": rand((2, m, k))},
                        {"w": w}, batch="N")
    assert_matches_ort(model, {"x": rand((3, m, k), seed=2)}, rtol=1e-4, atol=1e-4)


def test_batched_constant_b_panels_equal_onnxruntime():
    """A constant B with its own batch entries broadcast against A's ([2, 1, m, k] x [3, k, n])."""
    w = rand((3, 24, 1024), seed=3, low=-0.5, high=0.5)
    model = graph_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], {"x": rand((2, 1, 20, 24))},
                        {"w": w}, batch=None)
    assert_matches_ort(model, {"x": rand((2, 1, 20, 24), seed=4)}, rtol=1e-4, atol=1e-4, batch_axis=None)


@pytest.mark.parametrize("rows", [1, 40])
def test_gemm_transb_bias_panels_equal_onnxruntime(rows):
    """Gemm with transB, alpha, beta and a C row: one row a sample (two samples a work item) and 40."""
    w = rand((2048, 96), seed=5, low=-0.5, high=0.5)
    c = rand((2048,), seed=6)
    node = helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="g", transB=1, alpha=0.5, beta=2.0)
    if rows == 1:
        model = graph_model([node], {"x": rand((3, 96))}, {"w": w, "c": c}, batch="N")
        feeds = {"x": rand((5, 96), seed=7)}
    else:
        model = graph_model([node], {"x": rand((rows, 96))}, {"w": w, "c": c})
        feeds = {"x": rand((rows, 96), seed=7)}
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = rows
    assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4, batch_axis="auto" if rows == 1 else None)


@pytest.mark.parametrize("m,n", [(53, 53), (64, 40), (53, 21)])
def test_matmul_both_operands_computed_square_tiles(m, n):
    """Q K^T of per-sample tensors, K transposed and both scaled inline (as the exporter writes
    attention): 4 x 16 tiles (SQUARE), or 8 rows where n is not a multiple of 8 (UNALIGNED_ROWS), a
    ragged last row block where the rows do not divide m."""
    nodes = [helper.make_node("Mul", ["q", "s"], ["qs"], name="qscale"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kT", perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["kt", "s"], ["ks"], name="kscale"),
             helper.make_node("MatMul", ["qs", "ks"], ["y"], name="qk")]
    s = np.array(0.35, np.float32)
    model = graph_model(nodes, {"q": rand((2, 3, m, 24)), "k": rand((2, 3, n, 24), seed=1)}, {"s": s}, batch="N")
    net, _ = assert_matches_ort(model, {"q": rand((2, 3, m, 24), seed=2), "k": rand((2, 3, n, 24), seed=3)},
                                rtol=1e-4, atol=1e-4)
    op = stage_of(net, "qk").root[1]
    assert op.tiles()[0] == (8 if n % 8 else 4)  # (the tile this test is about ran)


def _attention_modules():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class SDPA(nn.Module):
        """timm's ViT attention: one qkv projection, split into heads, scaled_dot_product_attention."""

        def __init__(self, d=96, h=3):
            super().__init__()
            self.h, self.qkv, self.proj = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            b, n, c = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4).unbind(0)
            return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))

    class MHA(nn.Module):
        def __init__(self, d=96, h=3):
            super().__init__()
            self.m = nn.MultiheadAttention(d, h, batch_first=True)

        def forward(self, x):
            return self.m(x, x, x, need_weights=False)[0]

    return {"sdpa": SDPA, "mha": MHA}


@pytest.mark.parametrize("kind", ["sdpa", "mha"])
@pytest.mark.parametrize("tokens", [53, 64])
def test_exported_attention_equals_onnxruntime_and_torch(kind, tokens):
    torch = pytest.importorskip("torch")
    import onnx

    torch.manual_seed(0)
    module = _attention_modules()[kind]().eval()
    x = torch.randn(2, tokens, 96)
    f = io.BytesIO()
    torch.onnx.export(module, (x,), f, input_names=["x"], output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    model = onnx.load_from_string(f.getvalue())
    feeds = {"x": x.numpy()}
    net, got = assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        np.testing.assert_allclose(got["y"], module(x).numpy(), rtol=1e-4, atol=1e-5)
    # the two products of per-sample operands took the square tiles
    squares = [st for st in net.plan.schedule.stages
               if st.domain == "items" and st.root[0].op_type == "MatMul" and st.root[1].square_tiles()]
    assert len(squares) == 2, net.plan.schedule.describe()


@pytest.mark.parametrize("m,k,n,tile", [(197, 130, 256, (4, 16)), (197, 130, 200, (4, 8)), (13, 24, 4, (8, 4)),
                                        (5, 40, 8, (4, 8)), (3, 16, 36, (2, 12)), (1, 128, 256, (1, 16))])
def test_constant_b_ragged_row_blocks_equal_onnxruntime(m, k, n, tile):
    """On the CPU the rules' tile takes all the rows it may (4 x 16 for a wide constant B, 4 x 8,
    up to 8 rows of 4 columns) whatever M is, the last row block ragged (its rows past M clamped to
    M - 1): ViT's 197 tokens, 13 rows in 8-row tiles, 5 in 4-row ones, 3 in 2-row ones; a Gemm with
    transB, bias and alpha over the same rows; M = 1 keeps one row."""
    w = rand((k, n), seed=1, low=-0.5, high=0.5)
    model = graph_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], {"x": rand((2, m, k))},
                        {"w": w}, batch="N")
    net, _ = assert_matches_ort(model, {"x": rand((3, m, k), seed=2)}, rtol=1e-4, atol=1e-4)
    assert stage_of(net, "mm").root[1].tiles()[:2] == tile
    c = rand((n,), seed=3)
    node = helper.make_node("Gemm", ["x", "wt", "c"], ["y"], name="g", transB=1, alpha=0.5)
    model = graph_model([node], {"x": rand((m, k))}, {"wt": np.ascontiguousarray(w.T), "c": c})
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = m
    net, _ = assert_matches_ort(model, {"x": rand((m, k), seed=4)}, rtol=1e-4, atol=1e-4, batch_axis=None)
    assert stage_of(net, "g").root[1].tiles()[:2] == tile
