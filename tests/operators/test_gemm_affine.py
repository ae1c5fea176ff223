"""ix.Affine indices (luisaml/indexing.py) and the CPU GEMM tile paths built on them (operators/gemm.py):
the operands of a product whose B is not a constant read through inline Split, Transpose and Mul
at folded indices (Dense.affine_loads), and the GELU epilogue loop run in place over its output with
its bias at n0 + j (Dense.epilogue_in_place, Dense.affine_epilogue); each against onnxruntime and
bit for bit against the path it replaces (the same arithmetic in the same order)."""
import itertools
import math
import re

import numpy as np
import pytest
from onnx import helper
from util import graph_model, ort_run, stage_of, switched

import luisaml
from luisaml import indexing as ix
from luisaml.operators.gemm import Dense


def test_affine_division_folds_only_when_exact():
    """e // d and e % d fold to affine sums exactly where the terms d does not divide stay below d;
    every result, folded or not, evaluates to Python's // and % over every value of its atoms."""
    rng = np.random.default_rng(0)
    f = ix.add(ix.mul(ix.Affine.atom("bi", 3), 12608), ix.mul(ix.Affine.atom("k", 64), 197), ix.Affine.atom("n", 197))
    assert (ix.div(f, 12608), ix.mod(ix.div(f, 197), 64), ix.mod(f, 197)) == ("bi", "k", "n")
    assert "//" in ix.div(f, 64)  # n's 196 and k's 63 * 197 pass 64: kept as text
    for _ in range(60):
        bounds = {f"a{i}": int(rng.integers(1, 6)) for i in range(3)}
        e = ix.add(*(ix.mul(ix.Affine.atom(a, b), int(rng.choice([1, 2, 3, 4, 6, 8, 12]))) for a, b in bounds.items()),
                   str(int(rng.integers(0, 9))))
        d = int(rng.choice([2, 3, 4, 6, 8, 24]))
        for got_expr, op in ((ix.div(e, d), lambda v: v // d), (ix.mod(e, d), lambda v: v % d)):
            for values in itertools.product(*(range(b) for b in bounds.values())):
                env = dict(zip(bounds, values))
                assert eval(got_expr, {}, env) == op(eval(e, {}, env))


def _stage_sources(source: str) -> list[str]:
    """Return the text of each `if stage == k:` section of a generated module."""
    parts = re.split(r"\n\s*if stage == \d+:\n", source)
    return parts[1:]


def attention(t: int, heads: int, d: int):
    """The attention core as torch's exporter writes scaled_dot_product_attention over one qkv
    projection: [t, 3, heads, d] transposed to [3, heads, t, d], split, each of Q and K^T scaled,
    Q K^T, Softmax, attn V."""
    s = np.float32(1 / math.sqrt(math.sqrt(d)))
    nodes = [helper.make_node("Transpose", ["qkv"], ["p"], perm=[1, 2, 0, 3]),
             helper.make_node("Split", ["p"], ["q3", "k3", "v3"], axis=0, num_outputs=3),
             helper.make_node("Squeeze", ["q3", "zero"], ["q"]), helper.make_node("Squeeze", ["k3", "zero"], ["k"]),
             helper.make_node("Squeeze", ["v3", "zero"], ["v"]),
             helper.make_node("Mul", ["q", "s"], ["qs"]), helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("Mul", ["kt", "s"], ["ks"]), helper.make_node("MatMul", ["qs", "ks"], ["qk"], name="qk"),
             helper.make_node("Softmax", ["qk"], ["a"], axis=-1), helper.make_node("MatMul", ["a", "v"], ["y"], name="av")]
    return graph_model(nodes, {"qkv": np.zeros((t, 3, heads, d), np.float32)},
                       {"s": s, "zero": np.array([0], np.int64)})


@pytest.mark.parametrize("t,heads,d", [(37, 3, 16), (20, 2, 24)])
def test_attention_products_read_at_folded_indices(t, heads, d):
    """Q K^T and attn V over the inline Split, Transpose and Mul: no division or remainder left in
    the products' loads, the outputs bit-equal to the unfolded loads' and close to onnxruntime's
    (t = 37: a ragged last row block of 4 x 16 tiles, a ragged column block)."""
    model = attention(t, heads, d)
    x = np.random.default_rng(1).standard_normal((t, 3, heads, d)).astype(np.float32)
    with switched(Dense, affine_loads=False):
        old = luisaml.compile(model, batch_axis=None)
    net = luisaml.compile(model, batch_axis=None)
    products = [s for s in _stage_sources(net.plan.source) if "for k" in s]
    assert len(products) == 2
    for text in products:
        loop = text[text.index("for k"):]
        reads = [line for line in loop.splitlines() if ".read(" in line]
        assert reads and not any("//" in line or "%" in line for line in reads)
    assert any("//" in s for s in _stage_sources(old.plan.source) if "for k" in s)
    got = net.run({"qkv": x})["y"]
    np.testing.assert_array_equal(got, old.run({"qkv": x})["y"])
    np.testing.assert_allclose(got, ort_run(model, {"qkv": x})["y"], rtol=1e-5, atol=1e-5)


def gelu_product(batch: int, m: int, k: int, n: int):
    """MatMul with a constant B of `batch` entries ([batch, m, k] x [batch, k, n]), a bias, then GELU as
    torch exports nn.GELU (Div, Erf, Add, Mul, Mul)."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((batch, k, n)) / math.sqrt(k)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"), helper.make_node("Add", ["m", "b"], ["h"]),
             helper.make_node("Div", ["h", "r2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["p"]),
             helper.make_node("Mul", ["p", "half"], ["y"])]
    return graph_model(nodes, {"x": np.zeros((batch, m, k), np.float32)},
                       {"w": w, "b": rng.standard_normal(n).astype(np.float32), "r2": np.float32(math.sqrt(2)),
                        "one": np.float32(1), "half": np.float32(0.5)})


@pytest.mark.parametrize("batch,m,k,n", [(1, 37, 128, 150), (3, 21, 128, 128), (1, 9, 64, 45)])
def test_gelu_epilogue_in_place(batch, m, k, n):
    """The GELU epilogue loop over the tile's output in place: the finished values stored, read back
    and written once through the epilogue (m = 37, 21: a ragged last row block, whose repeated rows
    must not take the epilogue twice, in 4 x 8 tiles; n = 150, 45: a ragged last column block; batch
    3: B's entries),
    the bias read at n0 + j without `% N`; bit-equal to the local array loop and close to onnxruntime."""
    model = gelu_product(batch, m, k, n)
    x = (np.random.default_rng(3).standard_normal((batch, m, k)) * 2).astype(np.float32)
    with switched(Dense, epilogue_in_place=False, affine_epilogue=False):
        old = luisaml.compile(model, batch_axis=None)
    net = luisaml.compile(model, batch_axis=None)
    def loop_heads(source):  # each epilogue loop's first three lines
        return [part.split("\n")[1:4] for part in source.split("for j")[1:]]

    new_loops, old_loops = loop_heads(net.plan.source), loop_heads(old.plan.source)
    assert new_loops and all(".read(" in head[0] and "weights" not in head[0] for head in new_loops)
    assert all("weights.read" in head[1] and "%" not in head[1] for head in new_loops)
    assert old_loops and all(f"% {n})" in head[1] for head in old_loops)  # (the bias's index before)
    assert stage_of(net, "mm").root[1].tiles()[0] == (4 if k == 128 else 1)
    got = net.run({"x": x})["y"]
    np.testing.assert_array_equal(got, old.run({"x": x})["y"])
    want = ort_run(model, {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
