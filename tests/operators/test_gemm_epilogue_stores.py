"""The CPU backend's Gemm and MatMul tiles write after all their epilogue's loads (operators/gemm.py,
`Dense.stores_last`): a bias Add, a residual Add read from another buffer and an activation in the
epilogue, against onnxruntime and bit-equal to the stores one after another; a chain of residual
blocks whose buffers the pool recycles, ragged column blocks (their stores stay whole under their
condition), one row a sample (two samples a work item: the second's write under its condition)
and square tiles (B computed)."""
import numpy as np
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of, switched

import luisaml
from luisaml.operators.gemm import Dense

F32 = {"rtol": 1e-5, "atol": 1e-5}


def _block(i: int, src: str, n: int) -> list:
    """MatMul by w{i}, + bias, + the block's input (a residual), Relu: the MatMul's epilogue."""
    return [helper.make_node("MatMul", [src, f"w{i}"], [f"mm{i}"], name=f"mm{i}"),
            helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"ab{i}"], name=f"bias{i}"),
            helper.make_node("Add", [f"ab{i}", src], [f"ar{i}"], name=f"res{i}"),
            helper.make_node("Relu", [f"ar{i}"], [f"h{i}"], name=f"relu{i}")]


def _stage_body(src: str, name: str) -> str:
    body = src[src.index(f"MatMul '{name}' (epilogue"):]
    return body[:body.index("if stage ==")] if "if stage ==" in body else body


def _compile_both(model, feeds, **kw):
    """Return (outputs with the stores one after another, outputs and network with stores last)."""
    with switched(Dense, stores_last=False):
        old = luisaml.compile(model, **kw).run(feeds)
    net = luisaml.compile(model, **kw)
    return old, net.run(feeds), net


def test_residual_blocks_store_after_loads():
    """Three residual blocks over [batch, 40, 37] (37 columns: a ragged column block of 20 + 17),
    each MatMul's epilogue a bias, a residual and a Relu; buffers recycled along the chain."""
    m, n = 40, 37
    nodes, inits = [], {}
    src = "x"
    for i in range(3):
        nodes += _block(i, src, n)
        inits[f"w{i}"] = rand((n, n), seed=10 + i, low=-0.3, high=0.3)
        inits[f"b{i}"] = rand((n,), seed=20 + i)
        src = f"h{i}"
    feeds = {"x": rand((3, m, n), seed=1)}
    model = graph_model(nodes, feeds, inits, batch="N", outputs=["h2"])
    net, got = assert_matches_ort(model, feeds, **F32)
    old, new, _ = _compile_both(model, feeds)
    np.testing.assert_array_equal(old["h2"], new["h2"])  # the same arithmetic, in the same order
    one = net.network_for(3) if hasattr(net, "network_for") else net
    assert [nd.name for nd, _ in stage_of(one, "mm1").epilogue] == ["bias1", "res1", "relu1"]
    lines = _stage_body(one.source, "mm1").splitlines()
    R, O, _, _ = stage_of(one, "mm1").root[1].tiles()
    assert O == 20
    # at the epilogue's level (under the k loop's last step, Dense.stores_in_loop, not deeper under a
    # column's condition): the writes of the 17 columns inside N all after the last read; the 3 past
    # N (37 = 20 + 17) keep their store whole under its condition
    last = next(k for k, t in enumerate(lines) if t.strip().startswith("if ") and t.rstrip().endswith(f"== {n - 1}:"))
    lines = lines[last + 1:]
    level = len(lines[0]) - len(lines[0].lstrip())
    top = [t for t in lines if t.strip() and len(t) - len(t.lstrip()) == level]
    writes = [k for k, t in enumerate(top) if ".write(" in t]
    reads = [k for k, t in enumerate(top) if ".read(" in t]
    assert len(writes) == R * 17 and min(writes) > max(reads), "a write before the epilogue's last load"
    assert sum(".write(" in t for t in lines) == R * 20


def test_one_row_a_sample_two_samples_an_item():
    """Gemm of one row a sample (K, N >= 128: two samples a work item) with a residual Add and a
    Relu; an odd batch, so the second sample of the last item is past the batch (its write under
    the condition, its loads from a clamped sample)."""
    k, n = 128, 130
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["g"], name="g", transB=1),
             helper.make_node("Add", ["g", "r"], ["a"], name="res"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    inits = {"w": rand((n, k), seed=2, low=-0.2, high=0.2), "c": rand((n,), seed=3)}
    feeds = {"x": rand((5, k), seed=4), "r": rand((5, n), seed=5)}
    model = graph_model(nodes, feeds, inits, batch="N")
    assert_matches_ort(model, feeds, **F32)
    old, new, net = _compile_both(model, feeds)
    np.testing.assert_array_equal(old["y"], new["y"])
    assert stage_of(net.network_for(5) if hasattr(net, "network_for") else net, "g").samples == 2


def test_square_tiles_with_a_residual():
    """Q K^T of per-sample tensors (B computed: 16 x 8 square tiles, a ragged last row block) plus a
    residual score tensor and a Relu in the epilogue."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], name="kT", perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Add", ["s", "bias"], ["sb"], name="res"),
             helper.make_node("Relu", ["sb"], ["y"], name="relu")]
    m = 53
    feeds = {"q": rand((2, 3, m, 24), seed=1), "k": rand((2, 3, m, 24), seed=2), "bias": rand((2, 3, m, m), seed=3)}
    model = graph_model(nodes, feeds, batch="N")
    assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4)
    old, new, _ = _compile_both(model, feeds)
    np.testing.assert_array_equal(old["y"], new["y"])
