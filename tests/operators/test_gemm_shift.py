"""The CPU tiles of a product whose B is not a constant with a last row or column block shifted to
end at M or N (Dense.shift_last, operators/gemm.py): no clamped row or column, and where N is not a
multiple of 8 each row's writes at a `min(...)` row base, so that clang vectorises the tile
(attention's Q K^T over 197 tokens). Against onnxruntime, and bit for bit against the clamped
tiles (each output's sum over k in the same order); which products take it is read from the source."""
import math
import re

import numpy as np
import pytest
from onnx import helper
from util import graph_model, ort_run, switched

import luisaml
from luisaml.operators.gemm import Dense


def _stage_source(net, node: str) -> str:
    """Return the text of the `if stage == k:` section whose stage runs `node` (its root)."""
    stages = net.plan.schedule.stages
    k = next(i for i, st in enumerate(stages) if any(n.name == node for n, _ in st.nodes[:1]))
    parts = re.split(r"\n\s*if stage == (\d+):\n", net.plan.source)
    return dict(zip(parts[1::2], parts[2::2]))[str(k)]


def _takes_shift(text: str, M: int, N: int) -> tuple[bool, bool, bool]:
    """Return (rows shifted, columns shifted, row bases) as the stage's source shows them."""
    rows = any(M - int(r) == int(last) for r, last in re.findall(r"min\(rb\w* \* (\d+), (\d+)\)", text))
    cols = any(N - int(o) == int(last) for o, last in re.findall(r"min\(cb\w* \* (\d+), (\d+)\)", text))
    return rows, cols, re.search(r"\byb\w* = min\(", text) is not None


def attention(t: int, heads: int, d: int, batch: bool = False, epilogue: bool = False):
    """torch's attention core over one qkv projection ([t, 3, heads, d] -> Q, K, V; K^T scaled), Q K^T
    (with `epilogue`, BERT's Div and Add of a mask after it), Softmax, attn V."""
    s = np.float32(1 / math.sqrt(math.sqrt(d)))
    lead = [0] if batch else []
    perm = [len(lead) + p for p in (1, 2, 0, 3)]
    kt = [len(lead) + p for p in (0, 2, 1)]
    nodes = [helper.make_node("Transpose", ["qkv"], ["p"], perm=lead + perm),
             helper.make_node("Split", ["p"], ["q3", "k3", "v3"], axis=len(lead), num_outputs=3),
             helper.make_node("Squeeze", ["q3", "ax"], ["q"]), helper.make_node("Squeeze", ["k3", "ax"], ["k"]),
             helper.make_node("Squeeze", ["v3", "ax"], ["v"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=lead + kt),
             helper.make_node("Mul", ["kt", "s"], ["ks"]), helper.make_node("MatMul", ["q", "ks"], ["qk"], name="qk")]
    inputs = {"qkv": np.zeros(([2] if batch else []) + [t, 3, heads, d], np.float32)}
    scores = "qk"
    if epilogue:
        nodes += [helper.make_node("Div", ["qk", "c"], ["qd"]), helper.make_node("Add", ["qd", "mask"], ["qm"])]
        inputs["mask"] = np.zeros(([2] if batch else []) + [1, 1, t], np.float32)
        scores = "qm"
    nodes += [helper.make_node("Softmax", [scores], ["a"], axis=-1), helper.make_node("MatMul", ["a", "v"], ["y"], name="av")]
    inits = {"s": s, "ax": np.array([len(lead)], np.int64), "c": np.float32(1.5)}
    return graph_model(nodes, inputs, inits, batch="N" if batch else None)


def _feeds(model, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value or 2 for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("t,heads,d", [(37, 3, 16), (197, 1, 20), (21, 2, 24)])
def test_attention_last_blocks_shifted(t, heads, d):
    """Q K^T ([t, d] x [d, t] per head, B = K^T read through the inline Transpose): t rows and columns
    ragged (37 = 4 x 8 + 5: 8 x 8 tiles, t not a multiple of 8), the last blocks shifted, row bases; k ragged (d = 20); attn V (N = d) takes row bases where d is not a multiple of 8; the outputs
    bit-equal to the clamped tiles' and close to onnxruntime's."""
    model = attention(t, heads, d)
    feeds = _feeds(model)
    with switched(Dense, shift_last=False):
        old = luisaml.compile(model, batch_axis=None)
    net = luisaml.compile(model, batch_axis=None)
    assert _takes_shift(_stage_source(net, "qk"), t, t) == (True, True, True)
    assert re.search(r"\bm\w* = m\w* \+ 7\b", _stage_source(net, "qk"))  # 8 rows a tile (UNALIGNED_ROWS)
    assert _takes_shift(_stage_source(old, "qk"), t, t) == (False, False, False)
    assert _takes_shift(_stage_source(net, "av"), t, d)[2] is (d % 8 != 0)
    got = net.run(feeds)["y"]
    np.testing.assert_array_equal(got, old.run(feeds)["y"])
    np.testing.assert_allclose(got, ort_run(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def test_attention_batched_with_epilogue():
    """A batch of 2 samples and BERT's Div and Add of a per-sample mask fused after Q K^T (its
    epilogue reads another buffer than it writes: the duplicated columns rewrite the same values)."""
    model = attention(37, 2, 16, batch=True, epilogue=True)
    feeds = _feeds(model, seed=3)
    with switched(Dense, shift_last=False):
        old = luisaml.compile(model)
    net = luisaml.compile(model)
    assert _takes_shift(_stage_source(net, "qk"), 37, 37) == (True, True, True)
    got = net.run(feeds)["y"]
    np.testing.assert_array_equal(got, old.run(feeds)["y"])
    np.testing.assert_allclose(got, ort_run(model, feeds)["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ta,tb", [(0, 1), (1, 0), (1, 1)])
def test_gemm_transposed_operands(ta, tb):
    """Gemm over two inputs (B not a constant) with transA / transB and a bias: M = 13 and N = 29
    ragged, both shifted; bit-equal to the clamped tiles, close to onnxruntime."""
    M, K, N = 13, 19, 29
    a = np.zeros((K, M) if ta else (M, K), np.float32)
    b = np.zeros((N, K) if tb else (K, N), np.float32)
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], name="g", transA=ta, transB=tb, alpha=0.5)
    model = graph_model([node], {"a": a, "b": b}, {"c": np.linspace(-1, 1, N).astype(np.float32)})
    feeds = _feeds(model, seed=ta * 2 + tb)
    with switched(Dense, shift_last=False):
        old = luisaml.compile(model, batch_axis=None)
    net = luisaml.compile(model, batch_axis=None)
    assert _takes_shift(_stage_source(net, "g"), M, N) == (True, True, True)
    got = net.run(feeds)["y"]
    np.testing.assert_array_equal(got, old.run(feeds)["y"])
    np.testing.assert_allclose(got, ort_run(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def test_not_taken():
    """A constant B (prepacked panels) and an epilogue run in place over its output (the GELU loop: a
    column computed twice would take GELU twice) keep the clamped tiles; a product narrower than a
    block (N = 5 < 8) shifts its rows only; all correct."""
    x = np.zeros((13, 16), np.float32)
    w = np.random.default_rng(0).standard_normal((16, 29)).astype(np.float32)
    const = graph_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], {"x": x}, {"w": w})
    narrow = graph_model([helper.make_node("MatMul", ["x", "b"], ["y"], name="mm")], {"x": x, "b": np.zeros((16, 5), np.float32)})
    gelu = graph_model([helper.make_node("MatMul", ["x", "b"], ["h"], name="mm"),
                        helper.make_node("Add", ["h", "bias"], ["z"]), helper.make_node("Gelu", ["z"], ["y"])],
                       {"x": x, "b": np.zeros((16, 29), np.float32)}, {"bias": w[0]}, opset=20)
    for model, N, takes in ((const, 29, (False, False, False)), (narrow, 5, (True, False, True)),
                            (gelu, 29, (False, False, False))):
        net = luisaml.compile(model, batch_axis=None)
        assert _takes_shift(_stage_source(net, "mm"), 13, N) == takes
        feeds = _feeds(model)
        np.testing.assert_allclose(net.run(feeds)["y"], ort_run(model, feeds)["y"], rtol=1e-4, atol=1e-5)
