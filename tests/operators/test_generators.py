"""Range, EyeLike and OneHot against onnxruntime."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from util import assert_matches_ort, graph_model, rand

import luisaml

I64 = np.int64


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_range(dtype):
    """Constant limits give the length; start and delta come from the graph's inputs at run time
    in the second node (an Add keeps the node from being folded)."""
    cases = [(0, 10, 3), (5, -7, -2), (1.5, 4.25, 0.25), (3, 3, 1), (-2, 9, 4)]
    nodes, inits, feeds = [], {}, {"z": np.zeros((), dtype)}
    for k, (s, l, d) in enumerate(cases):
        if np.dtype(dtype).kind == "i" and any(float(v) != int(v) for v in (s, l, d)):
            continue
        for name, v in (("s", s), ("l", l), ("d", d)):
            inits[f"{name}{k}"] = np.array(v, dtype)
        nodes.append(helper.make_node("Add", [f"s{k}", "z"], [f"sz{k}"]))
        nodes.append(helper.make_node("Range", [f"sz{k}", f"l{k}", f"d{k}"], [f"y{k}"]))
    model = graph_model(nodes, feeds, inits, opset=11)
    # the folder needs the start to be constant for the length: give the Range its length from the
    # constant inputs, as the node would have after folding, and keep the runtime start
    for out in model.graph.output:
        k = int(out.name[1:])
        s, l, d = cases[k]
        n = max(int(np.ceil((l - s) / d)), 0)
        del out.type.tensor_type.shape.dim[:]
        out.type.tensor_type.shape.dim.add().dim_value = n
    assert_matches_ort(model, feeds, batch_axis=None, rtol=1e-6, atol=1e-6)


def test_range_half_against_numpy():
    """float16 Range is opset 27 (no onnxruntime kernel): numpy's arange in float64, rounded."""
    import onnx

    inits = {"s": np.array(-1.5, np.float16), "l": np.array(6.0, np.float16), "d": np.array(0.375, np.float16)}
    feeds = {"z": np.zeros((), np.float16)}
    nodes = [helper.make_node("Add", ["s", "z"], ["sz"]), helper.make_node("Range", ["sz", "l", "d"], ["y"])]
    model = graph_model(nodes, feeds, inits, opset=13)
    model.opset_import[0].version = 27
    model.ir_version = onnx.IR_VERSION
    want = np.arange(-1.5, 6.0, 0.375).astype(np.float16)
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = want.size
    got = luisaml.compile(model, batch_axis=None).run(feeds)["y"]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [None, TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL])
def test_eyelike(dtype):
    x, x2 = rand((4, 6), np.int32, seed=1), rand((5, 3), np.float32, seed=2)
    attrs = {} if dtype is None else {"dtype": dtype}
    nodes = [helper.make_node("EyeLike", ["x"], [f"k{k}".replace("-", "m")], k=k, **attrs) for k in (-5, -1, 0, 2, 9)]
    nodes.append(helper.make_node("EyeLike", ["x2"], ["t"], k=-2, **attrs))
    feeds = {"x": x, "x2": x2}
    if dtype == TensorProto.BOOL:  # onnxruntime has no bool EyeLike: numpy
        got = luisaml.compile(graph_model(nodes, feeds, opset=9), batch_axis=None).run(feeds)
        for k in (-5, -1, 0, 2, 9):
            np.testing.assert_array_equal(got[f"k{k}".replace("-", "m")], np.eye(4, 6, k, dtype=bool))
        return
    assert_matches_ort(graph_model(nodes, feeds, opset=9), feeds, batch_axis=None)


def test_onehot():
    idx = np.array([[0, 3, -1], [9, -10, 2]], I64)  # 9 and -10 are out of range: rows of `off`
    fidx = np.array([1.7, -2.2, 4.0], np.float32)
    feeds = {"i": idx, "f": fidx, "v": np.array([-1.5, 2.5], np.float32)}
    inits = {"depth": np.array(5, I64), "vi": np.array([0, 7], np.int32)}
    nodes = [helper.make_node("OneHot", ["i", "depth", "v"], [f"a{a}".replace("-", "m")], axis=a) for a in (-1, 0, 1, 2, -3)]
    assert_matches_ort(graph_model(nodes, {"i": idx, "v": feeds["v"]}, inits, opset=11), {"i": idx, "v": feeds["v"]},
                       batch_axis=None)
    # float indices (truncated) with int32 values: no onnxruntime kernel for the combination
    model = graph_model([helper.make_node("OneHot", ["f", "depth", "vi"], ["fi"])], {"f": fidx}, inits, opset=11)
    got = luisaml.compile(model, batch_axis=None).run({"f": fidx})["fi"]
    want = np.zeros((3, 5), np.int32)
    want[np.arange(3), fidx.astype(np.int64) % 5] = 7
    np.testing.assert_array_equal(got, want)


def test_onehot_batch_mode():
    idx = np.array([[0, 3, 1], [2, 4, 4]], I64)
    feeds = {"i": idx}
    inits = {"depth": np.array(5, I64), "v": np.array([0, 1], np.float32)}
    model = graph_model([helper.make_node("OneHot", ["i", "depth", "v"], ["y"], axis=1)], feeds, inits, opset=11, batch="N")
    assert_matches_ort(model, feeds, batch_axis=0)


def test_stage_forms(monkeypatch):
    """The generators inline where a batched model reads them (EyeLike and a window added to a
    per-sample input, OneHot read by a Neg) or in a stage of their own (outputs; Range with a
    runtime start, whose length only a graph output can declare), at two batch
    sizes; AffineGrid whose size is the input's shape (batch-dependent) compiles per batch size."""
    import luisaml.passes.fold as fold

    from stage_forms import assert_per_batch, assert_stage_forms
    from util import stage_of

    monkeypatch.setattr(fold, "NOT_FOLDED", fold.NOT_FOLDED | {"HannWindow", "BlackmanWindow"})
    nodes = [
        helper.make_node("Expand", ["z", "s34"], ["e"], name="expand"),
        helper.make_node("EyeLike", ["e"], ["eye"], name="eye", k=1),
        helper.make_node("Add", ["x", "eye"], ["x_eye"], name="add_eye"),
        helper.make_node("EyeLike", ["e"], ["eye_out"], name="eye_out", k=-1),
        helper.make_node("OneHot", ["i", "depth", "v"], ["oh"], name="onehot"),
        helper.make_node("OneHot", ["i", "depth", "v"], ["oh1"], name="onehot1", axis=1),
        helper.make_node("Neg", ["oh1"], ["neg_oh"], name="neg_oh"),
        helper.make_node("Add", ["s0", "z"], ["sz"], name="start"),
        helper.make_node("Range", ["sz", "l", "d"], ["rng"], name="range"),
        helper.make_node("HannWindow", ["n4"], ["hann"], name="hann"),
        helper.make_node("Add", ["x4", "hann"], ["x_hann"], name="add_hann"),
        helper.make_node("BlackmanWindow", ["n4"], ["blackman"], name="blackman", periodic=0),
    ]
    inits = {"s34": np.array([3, 4], I64), "depth": np.array(5, I64), "v": np.array([-1.0, 2.0], np.float32),
             "s0": np.array(1.0, np.float32), "l": np.array(3.0, np.float32), "d": np.array(0.5, np.float32),
             "n4": np.array(4, I64)}
    inputs = {"x": rand((2, 3, 4)), "z": np.zeros((), np.float32), "i": rand((2, 3), I64), "x4": rand((2, 4))}
    model = graph_model(nodes, inputs, inits, opset=17, batch="N")
    rng = next(o for o in model.graph.output if o.name == "rng")  # the length a constant start would give
    del rng.type.tensor_type.shape.dim[:]
    rng.type.tensor_type.shape.dim.add().dim_value = 4

    def feeds(n):
        return {"x": rand((n, 3, 4), seed=n), "z": np.zeros((), np.float32), "x4": rand((n, 4), seed=n + 2),
                "i": np.random.default_rng(n).integers(-6, 6, (n, 3)).astype(I64)}

    net = assert_stage_forms(model, feeds, ["eye", "eye_out", "onehot", "onehot1", "range", "hann", "blackman"])
    for reader, node in (("add_eye", "EyeLike 'eye'"), ("neg_oh", "OneHot 'onehot1'"), ("add_hann", "HannWindow 'hann'")):
        assert node in stage_of(net, reader).inlined, net.plan.schedule.describe()

    nodes = [helper.make_node("Shape", ["x"], ["size"]), helper.make_node("AffineGrid", ["t", "size"], ["g"], name="grid"),
             helper.make_node("AffineGrid", ["t", "size"], ["g1"], name="grid1", align_corners=1),
             helper.make_node("Neg", ["g1"], ["neg_g"], name="neg_g")]
    model = graph_model(nodes, {"t": rand((2, 2, 3)), "x": rand((2, 1, 3, 4))}, opset=20, batch="N")
    net = assert_per_batch(model, lambda n: {"t": rand((n, 2, 3), seed=n), "x": rand((n, 1, 3, 4), seed=n)}, "grid")
    assert stage_of(net.network_for(5), "grid").domain == "element"
    assert "AffineGrid 'grid1'" in stage_of(net.network_for(5), "neg_g").inlined
