"""Pad, CenterCropPad, Tile, DepthToSpace, SpaceToDepth, Trilu and Size against onnxruntime (and
ONNX's reference where onnxruntime rejects a case), several nodes per model."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand, single_node_model, stage_of
from stage_forms import assert_per_batch, assert_stage_forms

import luisaml

I64 = np.int64

# (mode, pads) on x of shape (3, 4, 5): growing, shrinking (negative: crop first) and mixed
PADS = [
    ("constant", [0, 1, 2, 1, 0, 3]),
    ("constant", [-1, 1, -2, 0, -1, 2]),
    ("reflect", [1, 2, 3, 1, 3, 2]),
    ("reflect", [0, -1, 2, 0, 2, -1]),
    ("edge", [2, 0, 1, 0, 3, 4]),
    ("edge", [0, -1, 2, 1, 2, -2]),
    ("wrap", [1, 2, 3, 2, 5, 7]),
    ("wrap", [-1, 2, -1, 0, 1, 1]),
]


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16, np.bool_])
def test_pad_modes(dtype):
    x = rand((3, 4, 5), dtype, seed=1, low=-9, high=9)
    inits, nodes = {"cv": np.array(1, dtype)}, []
    for k, (mode, pads) in enumerate(PADS):
        inits[f"p{k}"] = np.array(pads, I64)
        ins = ["x", f"p{k}", "cv"] if mode == "constant" else ["x", f"p{k}"]
        nodes.append(helper.make_node("Pad", ins, [f"y{k}"], mode=mode))
    nodes.append(helper.make_node("Pad", ["x", "p0"], ["zero_fill"]))
    assert_matches_ort(graph_model(nodes, {"x": x}, inits, opset=19), {"x": x}, batch_axis=None)


def test_pad_axes_runtime_value_and_opset2():
    x = rand((2, 3, 4), seed=2)
    v = np.array(-2.5, np.float32)
    inits = {"p": np.array([1, 1, 2, 1], I64), "ax": np.array([-1, 0], I64)}
    nodes = [helper.make_node("Pad", ["x", "p", "v", "ax"], ["y"]),
             helper.make_node("Pad", ["x", "p", "", "ax"], ["r"], mode="reflect")]
    feeds = {"x": x, "v": v}
    assert_matches_ort(graph_model(nodes, feeds, inits, opset=19), feeds, batch_axis=None)
    m2 = single_node_model("Pad", {"x": x}, opset=2, pads=[0, 1, 2, 1, 0, 1], value=0.5)
    got = luisaml.compile(m2, batch_axis=None).run({"x": x})["y"]
    np.testing.assert_array_equal(got, np.pad(x, [(0, 1), (1, 0), (2, 1)], constant_values=0.5))


def test_pad_repeats_past_the_axis_like_numpy():
    """Reflect and wrap pads longer than the axis (onnxruntime rejects reflect there): numpy.pad."""
    x = rand((3, 4), seed=3)
    inits = {"p": np.array([5, 9, 7, 6], I64)}
    nodes = [helper.make_node("Pad", ["x", "p"], [m], mode=m) for m in ("reflect", "wrap", "edge")]
    got = luisaml.compile(graph_model(nodes, {"x": x}, inits, opset=19), batch_axis=None).run({"x": x})
    for m in ("reflect", "wrap", "edge"):
        np.testing.assert_array_equal(got[m], np.pad(x, [(5, 7), (9, 6)], mode=m), err_msg=m)


def test_pad_batch_mode():
    x = rand((4, 3, 5), seed=4)
    nodes = [helper.make_node("Pad", ["x", "p"], ["y"], mode="reflect")]
    model = graph_model(nodes, {"x": x}, {"p": np.array([0, 1, 2, 0, 2, 1], I64)}, opset=19, batch="N")
    net, _ = assert_matches_ort(model, {"x": x}, batch_axis=0)
    assert net.batch_symbol == "N"
    # padding the batch axis mixes samples: compiled per batch size
    nodes = [helper.make_node("Pad", ["x", "p"], ["y"], name="pad_n", mode="reflect")]
    bad = graph_model(nodes, {"x": x}, {"p": np.array([1, 0, 0, 0, 0, 0], I64)}, opset=19, batch="N")
    assert_per_batch(bad, lambda n: {"x": rand((n, 3, 5), seed=n)}, "pad_n", sizes=(2, 4))


def test_center_crop_pad():
    from onnx.reference import ReferenceEvaluator

    x = rand((5, 6, 3), seed=5)
    inits = {"s1": np.array([3, 9, 3], I64), "s2": np.array([8, 4], I64), "s3": np.array([2, 7], I64)}
    nodes = [helper.make_node("CenterCropPad", ["x", "s1"], ["a"]),
             helper.make_node("CenterCropPad", ["x", "s2"], ["b"], axes=[0, 1]),
             helper.make_node("CenterCropPad", ["x", "s3"], ["c"], axes=[-3, -1])]
    model = graph_model(nodes, {"x": x}, inits, opset=18)
    got = luisaml.compile(model, batch_axis=None).run({"x": x})
    want = ReferenceEvaluator(model).run(None, {"x": x})
    for name, w in zip("abc", want):
        np.testing.assert_array_equal(got[name], w, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_tile(dtype):
    x3, x1 = rand((2, 3, 4), dtype, seed=6), rand((5,), dtype, seed=7)
    inits = {"r1": np.array([1, 2, 3], I64), "r2": np.array([3, 1, 1], I64), "r3": np.array([2, 2, 2], I64),
             "r4": np.array([4], I64), "r5": np.array([0, 1, 2], I64)}
    nodes = [helper.make_node("Tile", ["x3", f"r{k}"], [f"y{k}"]) for k in (1, 2, 3, 5)]
    nodes.append(helper.make_node("Tile", ["x1", "r4"], ["y4"]))
    feeds = {"x3": x3, "x1": x1}
    assert_matches_ort(graph_model(nodes, feeds, inits, opset=13), feeds, batch_axis=None)


def test_depth_space():
    x = rand((2, 8, 3, 2), seed=8)
    s = rand((1, 3, 4, 6), seed=9)
    nodes = [helper.make_node("DepthToSpace", ["x"], ["dcr"], blocksize=2),
             helper.make_node("DepthToSpace", ["x"], ["crd"], blocksize=2, mode="CRD"),
             helper.make_node("SpaceToDepth", ["s"], ["s2d"], blocksize=2)]
    feeds = {"x": x, "s": s}
    assert_matches_ort(graph_model(nodes, feeds, opset=13), feeds, batch_axis=None)
    # round trips: SpaceToDepth undoes DepthToSpace in both modes (CRD SpaceToDepth is opset 28)
    for mode in ("DCR", "CRD"):
        nodes = [helper.make_node("DepthToSpace", ["x"], ["d"], blocksize=2, mode=mode),
                 helper.make_node("SpaceToDepth", ["d"], ["back"], blocksize=2, mode=mode)]
        got = luisaml.compile(_opset(graph_model(nodes, {"x": x}, opset=13), 28), batch_axis=None).run({"x": x})
        np.testing.assert_array_equal(got["back"], x)


def _opset(model, version):
    """Return the model importing a newer opset than onnx's helper knows an IR version for."""
    import onnx

    model.opset_import[0].version = version
    model.ir_version = onnx.IR_VERSION
    return model


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_trilu(dtype):
    x, x2 = rand((2, 4, 5), dtype, seed=10, low=-9, high=9), rand((3, 3), dtype, seed=11, low=-9, high=9)
    inits = {f"k{k}": np.array(k, I64) for k in (-2, -1, 1, 3, 7)}
    nodes = []
    for upper in (0, 1):
        nodes.append(helper.make_node("Trilu", ["x"], [f"d{upper}"], upper=upper))
        nodes.append(helper.make_node("Trilu", ["x2"], [f"sq{upper}"], upper=upper))
        for k in (-2, -1, 1, 3, 7):
            nodes.append(helper.make_node("Trilu", ["x", f"k{k}"], [f"k{k}_{upper}"], upper=upper))
        nodes.append(helper.make_node("Trilu", ["x", "kr"], [f"kr{upper}"], upper=upper))  # runtime k
    feeds = {"x": x, "x2": x2, "kr": np.array(-1, I64)}
    assert_matches_ort(graph_model(nodes, feeds, inits, opset=14), feeds, batch_axis=None)


def test_trilu_batch_mode():
    x = rand((3, 4, 4), seed=12)
    model = graph_model([helper.make_node("Trilu", ["x"], ["y"])], {"x": x}, opset=14, batch="N")
    assert_matches_ort(model, {"x": x}, batch_axis=0)
    # a 2-d input's rows are the batch: compiled per batch size
    model = graph_model([helper.make_node("Trilu", ["x"], ["y"], name="tri")], {"x": rand((3, 4), seed=13)}, opset=14,
                        batch="N")
    assert_per_batch(model, lambda n: {"x": rand((n, 4), seed=n)}, "tri", sizes=(3, 6))


def test_size():
    x = rand((2, 3, 4), seed=14)
    nodes = [helper.make_node("Size", ["x"], ["n"]), helper.make_node("Relu", ["x"], ["r"])]
    assert_matches_ort(graph_model(nodes, {"x": x}, opset=13), {"x": x}, batch_axis=None)


def test_stage_forms():
    """Each op inline in a batched model: as a graph output (a stage of its own) and read by a Neg
    (computed where the Neg's stage reads it), at two batch sizes."""
    x = rand((2, 4, 4, 6), seed=15)
    inits = {"pc": np.array([0, 1, 2, 0, 0, 2, 1, 3], I64), "pr": np.array([0, 0, 2, 1, 0, 0, 1, 2], I64),
             "pe": np.array([0, 1, -1, 2, 0, 2, 1, -2], I64), "pw": np.array([0, 0, 5, 7, 0, 0, 3, 2], I64),
             "cv": np.array(-3.5, np.float32), "cc": np.array([3, 8], I64), "rep": np.array([1, 2, 1, 3], I64),
             "k": np.array(1, I64)}
    ops = [("Pad", ["x", "pc", "cv"], dict(mode="constant")), ("Pad", ["x", "pr"], dict(mode="reflect")),
           ("Pad", ["x", "pe"], dict(mode="edge")), ("Pad", ["x", "pw"], dict(mode="wrap")),
           ("CenterCropPad", ["x", "cc"], dict(axes=[2, 3])), ("Tile", ["x", "rep"], {}),
           ("DepthToSpace", ["x"], dict(blocksize=2)), ("DepthToSpace", ["x"], dict(blocksize=2, mode="CRD")),
           ("SpaceToDepth", ["x"], dict(blocksize=2)), ("Trilu", ["x", "k"], {}), ("Trilu", ["x"], dict(upper=0))]
    nodes, names = [], []
    for j, (op, ins, attrs) in enumerate(ops):
        nodes.append(helper.make_node(op, ins, [f"out{j}"], name=f"{op}{j}", **attrs))
        nodes.append(helper.make_node(op, ins, [f"in{j}"], name=f"{op}{j}_inline", **attrs))
        nodes.append(helper.make_node("Neg", [f"in{j}"], [f"neg{j}"], name=f"neg{j}"))
        names += [f"{op}{j}", f"{op}{j}_inline"]
    model = graph_model(nodes, {"x": x}, inits, opset=19, batch="N")
    net = assert_stage_forms(model, lambda n: {"x": rand((n, 4, 4, 6), seed=n)}, names)
    for j, (op, _, _) in enumerate(ops):
        assert f"{op} '{op}{j}_inline'" in stage_of(net, f"neg{j}").inlined
