"""Einsum and Det against onnxruntime (Einsum also against numpy for what onnxruntime rejects)."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand
from stage_forms import assert_per_batch, assert_stage_forms

import luisaml

# (equation, operand shapes)
EQUATIONS = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij->ji", [(3, 4)]),
    ("ii->i", [(4, 4)]),
    ("ii", [(4, 4)]),
    ("i,i", [(5,), (5,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij->", [(3, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 2)]),
    ("...ij,...jk", [(2, 1, 3, 4), (3, 4, 2)]),  # ellipses broadcast (onnx's inference gives up: numpy only)
    ("bid,bjd->bij", [(2, 3, 4), (2, 5, 4)]),
    ("ijk,jl,k->il", [(2, 3, 4), (3, 2), (4,)]),
    ("b...i->b...", [(2, 3, 4)]),
    ("bii->bi", [(2, 3, 3)]),
]


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_einsum(dtype):
    feeds, nodes = {}, []
    for k, (eq, shapes) in enumerate(EQUATIONS):
        names = []
        for j, s in enumerate(shapes):
            feeds[f"x{k}_{j}"] = rand(s, dtype, seed=10 * k + j, low=-3, high=3)
            names.append(f"x{k}_{j}")
        nodes.append(helper.make_node("Einsum", names, [f"y{k}"], equation=eq))
    model = graph_model(nodes, feeds, opset=12)
    net = luisaml.compile(model, batch_axis=None)
    got = net.run(feeds)
    for k, (eq, shapes) in enumerate(EQUATIONS):
        want = np.einsum(eq, *[feeds[f"x{k}_{j}"] for j in range(len(shapes))])
        np.testing.assert_allclose(got[f"y{k}"], want, rtol=1e-5, atol=1e-5, err_msg=eq)
    keep = [n for n in nodes if n.attribute[0].s != b"...ij,...jk"]
    used = {i for n in keep for i in n.input}
    ort_feeds = {k: v for k, v in feeds.items() if k in used}
    assert_matches_ort(graph_model(keep, ort_feeds, opset=12), ort_feeds, batch_axis=None, rtol=1e-5, atol=1e-5)


def test_einsum_half_and_batch():
    a, b = rand((3, 2, 4), np.float16, seed=1), rand((4, 5), np.float16, seed=2)
    model = graph_model([helper.make_node("Einsum", ["a", "b"], ["y"], equation="nij,jk->nik")], {"a": a, "b": b}, opset=12)
    assert_matches_ort(model, {"a": a, "b": b}, batch_axis=None, rtol=2e-3, atol=2e-3)
    a, b = rand((3, 2, 4), seed=3), rand((4, 5), seed=4)
    model = graph_model([helper.make_node("Einsum", ["a", "b"], ["y"], equation="nij,jk->nik")], {"a": a}, {"b": b},
                        opset=12, batch="N")
    assert_matches_ort(model, {"a": a}, batch_axis=0)
    # the batch label off the output's first axis mixes samples: compiled per batch size
    bad = graph_model([helper.make_node("Einsum", ["a", "b"], ["y"], name="es", equation="nij,jk->ikn")], {"a": a},
                      {"b": b}, opset=12, batch="N")
    assert_per_batch(bad, lambda n: {"a": rand((n, 2, 4), seed=n)}, "es", sizes=(3, 4))


def test_einsum_errors_name_the_node():
    a = rand((3, 4))
    model = graph_model([helper.make_node("Einsum", ["a", "a"], ["y"], equation="ij,jk->ik", name="mm")], {"a": a}, opset=12)
    with pytest.raises((luisaml.CompileError, luisaml.model.ModelError), match="mm|Einsum"):
        luisaml.compile(model, batch_axis=None)


def test_det():
    x = rand((2, 3, 4, 4), seed=5)
    x[0, 0] = [[1, 2, 3, 4], [2, 4, 6, 8], [0, 1, 0, 1], [1, 0, 1, 0]]  # singular
    x[0, 1] = [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]]  # needs pivoting
    feeds = {"x": x, "m1": rand((1, 1), seed=6), "m2": rand((5, 2, 2), seed=7), "m5": rand((5, 5), seed=8)}
    nodes = [helper.make_node("Det", [k], [f"d{k}"]) for k in feeds]
    assert_matches_ort(graph_model(nodes, feeds, opset=11), feeds, batch_axis=None, rtol=1e-5, atol=1e-5)


def test_stage_forms():
    """Einsum (contractions, a transpose, a diagonal, a broadcast ellipsis) and Det one thread per
    output element in a batched model, at two batch sizes."""
    nodes = [helper.make_node("Einsum", ["a", "b"], ["mm"], name="mm", equation="nij,jk->nik"),
             helper.make_node("Einsum", ["a", "c"], ["bmm"], name="bmm", equation="nij,njk->nki"),
             helper.make_node("Einsum", ["c"], ["tr"], name="tr", equation="nkk->nk"),
             helper.make_node("Einsum", ["a", "e"], ["ell"], name="ell", equation="...j,j->..."),
             helper.make_node("Det", ["c"], ["det"], name="det")]
    model = graph_model(nodes, {"a": rand((2, 3, 4)), "c": rand((2, 4, 4))}, {"b": rand((4, 5), seed=1), "e": rand((4,), seed=2)},
                        opset=12, batch="N")
    assert_stage_forms(model, lambda n: {"a": rand((n, 3, 4), seed=n), "c": rand((n, 4, 4), seed=n + 1)},
                       ["mm", "bmm", "tr", "ell", "det"], atol=1e-5)
