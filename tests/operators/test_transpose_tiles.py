"""A Transpose stored by a stage of its own on the CPU, whose permutation moves the innermost axis,
copies in tiles of the two axes that swap (operators/indexing.py, Transpose.emit_item): an items
stage whose ragged last tiles overlap the ones before. Bit-identical to numpy and onnxruntime for
2-D, 3-D and 4-D permutations, over a batch, for an inline input, int and bool tensors; permutations
that keep the innermost axis keep the element stage, and so does every Transpose planned for CUDA."""
import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of


def _transpose_model(shape, perm, batch=None, dtype=np.float32, relu=False):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="r")] if relu else []
    nodes.append(helper.make_node("Transpose", ["r" if relu else "x"], ["y"], name="t", perm=list(perm)))
    return graph_model(nodes, {"x": rand(shape, dtype=dtype)}, batch=batch)


CASES = [
    ((37, 19), (1, 0)),  # ragged on both axes
    ((3, 5), (1, 0)),  # tiles smaller than TILE
    ((8, 16), (1, 0)),  # one tile
    ((32, 48), (1, 0)),  # whole tiles
    ((5, 24, 17), (0, 2, 1)),  # a token-mixing transpose
    ((3, 5, 7), (2, 0, 1)),
    ((6, 4, 9), (1, 2, 0)),
    ((2, 16, 9, 10), (0, 2, 3, 1)),  # NCHW -> NHWC
    ((2, 9, 10, 16), (0, 3, 1, 2)),  # NHWC -> NCHW
    ((4, 3, 5, 6), (3, 2, 1, 0)),  # other axes outside the tile
    ((3, 10, 4, 11), (2, 3, 0, 1)),
]


@pytest.mark.parametrize("shape,perm", CASES)
def test_tiles_equal_numpy_and_onnxruntime(shape, perm):
    x = rand(shape, seed=1)
    net, got = assert_matches_ort(_transpose_model(shape, perm), {"x": x}, rtol=0, atol=0, batch_axis=None)
    np.testing.assert_array_equal(got["y"], np.transpose(x, perm))
    st = stage_of(net, "t")
    assert st.domain == "items", net.plan.schedule.describe()


@pytest.mark.parametrize("shape,perm", [((5, 24, 17), (0, 2, 1)), ((4, 16, 9, 10), (0, 2, 3, 1)), ((2, 3, 20, 9), (0, 3, 2, 1))])
def test_tiles_over_a_batch(shape, perm):
    """A batched items stage: each sample's tiles at its own base, batches of 1 and 3 with one net."""
    model = _transpose_model((1,) + shape[1:], perm, batch="N")
    for n, seed in ((3, 2), (1, 3)):
        x = rand((n,) + shape[1:], seed=seed)
        net, got = assert_matches_ort(model, {"x": x}, rtol=0, atol=0)
        np.testing.assert_array_equal(got["y"], np.transpose(x, perm))
    st = stage_of(net, "t")
    assert st.domain == "items" and st.batched


def test_tiles_of_an_inline_input_ints_and_bools():
    x = rand((2, 13, 21), seed=4)
    net, got = assert_matches_ort(_transpose_model(x.shape, (0, 2, 1), relu=True), {"x": x}, rtol=0, atol=0,
                                  batch_axis=None)
    np.testing.assert_array_equal(got["y"], np.transpose(np.maximum(x, 0), (0, 2, 1)))
    assert stage_of(net, "t").domain == "items" and stage_of(net, "r") is stage_of(net, "t")
    xi = rand((11, 9), dtype=np.int32, seed=5)
    net, got = assert_matches_ort(_transpose_model(xi.shape, (1, 0), dtype=np.int32), {"x": xi}, batch_axis=None)
    np.testing.assert_array_equal(got["y"], xi.T)
    assert stage_of(net, "t").domain == "items"
    xb = rand((3, 7, 18), dtype=np.bool_, seed=6)
    net, got = assert_matches_ort(_transpose_model(xb.shape, (0, 2, 1), dtype=np.bool_), {"x": xb}, batch_axis=None)
    np.testing.assert_array_equal(got["y"], np.transpose(xb, (0, 2, 1)))
    assert stage_of(net, "t").domain == "items"


def test_a_transpose_read_by_a_matmul_and_an_add():
    """A stored Transpose that a many-read reader (a MatMul) and an Add read: the tile's buffer."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], name="t", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["t", "t"], ["a"], name="add")]
    x = rand((2, 24, 20), seed=6)
    model = graph_model(nodes, {"x": x}, {"w": rand((24, 12), seed=7)}, outputs=["m", "a", "t"])
    net, got = assert_matches_ort(model, {"x": x}, rtol=1e-5, atol=1e-5, batch_axis=None)
    np.testing.assert_array_equal(got["t"], np.transpose(x, (0, 2, 1)))
    assert stage_of(net, "t").domain == "items"


@pytest.mark.parametrize("perm", [(1, 0, 2), (0, 1, 2)])
def test_the_innermost_axis_kept_keeps_the_element_stage(perm):
    x = rand((4, 6, 10), seed=8)
    net, got = assert_matches_ort(_transpose_model(x.shape, perm), {"x": x}, rtol=0, atol=0, batch_axis=None)
    st = stage_of(net, "t")
    assert st.domain == "element", net.plan.schedule.describe()


def test_cuda_plans_keep_the_element_stage():
    """Planned for CUDA (no device needed), a Transpose that moves the innermost axis takes no CPU
    tiles: shared-memory tiles (luisaml/across.py), or with that switch off an element stage."""
    from luisaml import across
    from luisaml.planning import CompileOptions, plan_for

    plan, _, _ = plan_for(_transpose_model((2, 16, 9, 10), (0, 2, 3, 1)), "m",
                          CompileOptions(batch_axis=None).resolve("cuda"))
    (st,) = [s for s in plan.schedule.stages if s.nodes[0][0].name == "t"]
    assert st.domain == "blocks" and isinstance(st.across, across.ElementTile)
    try:
        across.ACROSS = False
        plan, _, _ = plan_for(_transpose_model((2, 16, 9, 10), (0, 2, 3, 1)), "m",
                              CompileOptions(batch_axis=None).resolve("cuda"))
    finally:
        across.ACROSS = True
    (st,) = [s for s in plan.schedule.stages if s.nodes[0][0].name == "t"]
    assert st.domain == "element" and st.elements == 1
    plan, _, _ = plan_for(_transpose_model((2, 16, 9, 10), (0, 2, 3, 1)), "m",
                          CompileOptions(batch_axis=None).resolve("cpu"))
    (st,) = [s for s in plan.schedule.stages if s.nodes[0][0].name == "t"]
    assert st.domain == "items"
