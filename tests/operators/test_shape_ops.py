"""Shape and indexing operators against onnxruntime: Transpose, Slice, Concat, Split, Gather,
the views (Reshape/Flatten/Squeeze/Unsqueeze), Expand, Shape, Constant, ConstantOfShape; and the
per-sample (batch) rules for them."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from util import assert_matches_ort, graph_model, rand, single_node_model, stage_of
from stage_forms import assert_per_batch, assert_stage_forms

import luisaml

I64 = np.int64


def _ints(*v):
    return np.array(v, dtype=I64)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16])
def test_transpose(dtype):
    x3, x4, x1 = rand((2, 3, 4), dtype, seed=1), rand((2, 3, 4, 5), dtype, seed=2), rand((5,), dtype, seed=3)
    perms = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]]
    nodes = [helper.make_node("Transpose", ["x3"], [f"p{''.join(map(str, p))}"], perm=p) for p in perms]
    nodes += [
        helper.make_node("Transpose", ["x3"], ["default3"]),
        helper.make_node("Transpose", ["x4"], ["p3102"], perm=[3, 1, 0, 2]),
        helper.make_node("Transpose", ["x4"], ["p0132"], perm=[0, 1, 3, 2]),
        helper.make_node("Transpose", ["x4"], ["default4"]),
        helper.make_node("Transpose", ["x1"], ["default1"]),
    ]
    feeds = {"x3": x3, "x4": x4, "x1": x1}
    assert_matches_ort(graph_model(nodes, feeds), feeds, batch_axis=None)


# (starts, ends, axes or None, steps or None) on x of shape (4, 5, 6)
SLICES = [
    ([1], [3], [0], None),
    ([0, 1], [4, -1], None, None),
    ([-3], [100], [-1], None),  # negative start, end clamped
    ([-100], [2], [1], None),  # start clamped
    ([5], [0], [2], [-1]),  # negative step
    ([-1], [-100], [2], [-2]),  # to the front, step -2
    ([9], [-9], [1], [-1]),  # start clamped to dim-1 for a negative step
    ([0, 0, 0], [4, 5, 6], [0, 1, 2], [2, 2, 3]),
    ([1, 2], [2**62, -1], [2, 0], [2, 1]),
    ([-10], [-20], [2], [-1]),  # ONNX clamps start to 0: one element (numpy would give none)
    ([3], [3], [1], None),  # empty
    ([0], [2**63 - 1], [0], None),
]


def test_slice():
    x = rand((4, 5, 6), seed=4)
    nodes, inits = [], {}
    for k, (s, e, a, st) in enumerate(SLICES):
        inits[f"s{k}"], inits[f"e{k}"] = _ints(*s), _ints(*e)
        ins = [ "x", f"s{k}", f"e{k}"]
        if a is not None or st is not None:
            inits[f"a{k}"] = _ints(*(a if a is not None else range(len(s))))
            ins.append(f"a{k}")
        if st is not None:
            inits[f"t{k}"] = _ints(*st)
            ins.append(f"t{k}")
        nodes.append(helper.make_node("Slice", ins, [f"y{k}"], name=f"slice{k}"))
    model = graph_model(nodes, {"x": x}, inits, opset=13)
    _, got = assert_matches_ort(model, {"x": x}, batch_axis=None)
    assert got["y9"].shape == (4, 5, 1) and got["y10"].size == 0


def test_slice_int_and_opset1_attributes():
    x = rand((3, 7), np.int32, seed=5, low=-50, high=50)
    m = single_node_model("Slice", {"x": x}, opset=1, starts=[1, -5], ends=[3, 100], axes=[0, 1])
    got = luisaml.compile(m, batch_axis=None).run({"x": x})["y"]
    np.testing.assert_array_equal(got, x[1:3, -5:])
    m = single_node_model("Slice", {"x": x}, initializers={"s": _ints(6), "e": _ints(-8), "a": _ints(1), "t": _ints(-3)})
    assert_matches_ort(m, {"x": x}, batch_axis=None)


def test_slice_needs_constant_starts():
    """Runtime starts: the output shape is unknown, and the error names the Slice node."""
    x, s = rand((4,)), _ints(1)
    m = single_node_model("Slice", {"x": x, "s": s}, initializers={"e": _ints(3)})
    with pytest.raises(luisaml.ModelError, match="Slice_0"):
        luisaml.compile(m, batch_axis=None)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_concat(dtype):
    a, b, c = rand((2, 3, 4), dtype, seed=1), rand((2, 1, 4), dtype, seed=2), rand((2, 2, 4), dtype, seed=3)
    d, e = rand((3, 3, 4), dtype, seed=4), rand((2, 3, 2), dtype, seed=5)
    nodes = [
        helper.make_node("Concat", ["a", "b", "c"], ["ax1"], axis=1),
        helper.make_node("Concat", ["a", "d"], ["ax0"], axis=0),
        helper.make_node("Concat", ["a", "e", "a"], ["ax_last"], axis=-1),
        helper.make_node("Concat", ["b"], ["single"], axis=1),
    ]
    feeds = {"a": a, "b": b, "c": c, "d": d, "e": e}
    assert_matches_ort(graph_model(nodes, feeds), feeds, batch_axis=None)


def test_concat_with_constant():
    x, w = rand((3, 2), seed=1), rand((3, 4), seed=2)
    m = single_node_model("Concat", {"x": x}, initializers={"w": w}, axis=1)
    assert_matches_ort(m, {"x": x}, batch_axis=None)


def test_split_versions():
    x = rand((6, 7), seed=6)
    cases = [
        (11, dict(axis=1, split=[2, 4, 1]), None, 3),
        (11, dict(axis=0), None, 3),  # equal parts
        (13, dict(axis=-1), _ints(3, 4), 2),  # split as an input
        (18, dict(axis=1, num_outputs=3), None, 3),  # uneven: 3, 3, 1
        (18, dict(axis=0, num_outputs=2), None, 2),
    ]
    for opset, attrs, split, n in cases:
        outs = [f"y{k}" for k in range(n)]
        inits = {"split": split} if split is not None else {}
        node = helper.make_node("Split", ["x"] + (["split"] if split is not None else []), outs, **attrs)
        m = graph_model([node], {"x": x}, inits, opset=opset)
        _, got = assert_matches_ort(m, {"x": x}, batch_axis=None)
        assert len(got) == n


def test_gather_constant_indices():
    x = rand((4, 5, 3), seed=7)
    cases = {
        "scalar0": (np.array(2, I64), 0),  # drops the axis
        "scalar_neg": (np.array(-1, I64), 1),
        "vec": (_ints(4, 0, -2, 1), 1),
        "pattern": (_ints(0, 1, 2), 2),  # an arithmetic sequence: computed, not stored
        "mat": (np.array([[3, -4], [0, 2], [1, 1]], I64), 0),
        "last": (np.array([[2, 0]], np.int32), -1),
    }
    nodes, inits = [], {}
    for name, (idx, axis) in cases.items():
        inits[f"i_{name}"] = idx
        nodes.append(helper.make_node("Gather", ["x", f"i_{name}"], [name], axis=axis))
    assert_matches_ort(graph_model(nodes, {"x": x}, inits), {"x": x}, batch_axis=None)


@pytest.mark.parametrize("idx_dtype", [np.int64, np.int32])
def test_gather_runtime_indices(idx_dtype):
    x = rand((4, 5, 3), np.float32, seed=8)
    i0 = np.array([[3, -4], [0, -1]], idx_dtype)
    i1 = np.array([4, -5, 2, -1, 0, 0], idx_dtype)
    i2 = np.array(-3, idx_dtype)
    nodes = [
        helper.make_node("Gather", ["x", "i0"], ["ax0"], axis=0),
        helper.make_node("Gather", ["x", "i1"], ["ax1"], axis=1),
        helper.make_node("Gather", ["x", "i2"], ["ax2"], axis=2),
    ]
    feeds = {"x": x, "i0": i0, "i1": i1, "i2": i2}
    assert_matches_ort(graph_model(nodes, feeds), feeds, batch_axis=None)


def test_gather_constant_index_out_of_range():
    m = single_node_model("Gather", {"x": rand((4, 3))}, initializers={"i": _ints(1, 4)})
    with pytest.raises(luisaml.CompileError, match=r"index \[4\] is out of range for axis 0 of size 4"):
        luisaml.compile(m, batch_axis=None)


def test_views_inside_and_as_outputs():
    """Reshape/Flatten/Squeeze/Unsqueeze both between nodes (shared storage) and as outputs (copies)."""
    x = rand((2, 3, 4), seed=9)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Reshape", ["r", "shape"], ["rs"]),
        helper.make_node("Neg", ["rs"], ["neg_rs"]),
        helper.make_node("Flatten", ["r"], ["flat"], axis=2),
        helper.make_node("Unsqueeze", ["r", "ax_u"], ["unsq"]),
        helper.make_node("Squeeze", ["unsq", "ax_u"], ["sq"]),
        helper.make_node("Abs", ["sq"], ["abs_sq"]),
        helper.make_node("Reshape", ["x", "shape0"], ["rs0"]),  # 0 copies a dimension
    ]
    inits = {"shape": _ints(4, -1), "ax_u": _ints(0, 3), "shape0": _ints(0, 12)}
    assert_matches_ort(graph_model(nodes, {"x": x}, inits), {"x": x}, batch_axis=None)


def test_expand():
    x, y = rand((3, 1), seed=10), rand((4,), np.int32, seed=11)
    nodes = [helper.make_node("Expand", ["x", "s1"], ["e1"]), helper.make_node("Expand", ["y", "s2"], ["e2"])]
    inits = {"s1": _ints(2, 3, 5), "s2": _ints(3, 1)}
    assert_matches_ort(graph_model(nodes, {"x": x, "y": y}, inits), {"x": x, "y": y}, batch_axis=None)


def test_shape_and_constants_as_outputs():
    """Shape (folded to a constant), Constant with every value attribute, ConstantOfShape."""
    x = rand((2, 3, 4), seed=12)
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Shape", ["x"], ["shape_1_3"], start=1, end=-0 + 3),
        helper.make_node("Shape", ["x"], ["shape_neg"], start=-2),
        helper.make_node("Constant", [], ["c_tensor"], value=numpy_helper.from_array(rand((2, 3), seed=13))),
        helper.make_node("Constant", [], ["c_int_tensor"], value=numpy_helper.from_array(np.array([5, -2, 9], np.int32))),
        helper.make_node("Constant", [], ["c_float"], value_float=1.5),
        helper.make_node("Constant", [], ["c_floats"], value_floats=[1.0, -2.5, 3.25]),
        helper.make_node("Constant", [], ["c_int"], value_int=-7),
        helper.make_node("Constant", [], ["c_ints"], value_ints=[4, 6, 8, 10]),
        helper.make_node("ConstantOfShape", ["cs_shape"], ["filled"],
                         value=numpy_helper.from_array(np.array([2.5], np.float32))),
        helper.make_node("ConstantOfShape", ["cs_shape"], ["zeros"]),
        helper.make_node("ConstantOfShape", ["cs_shape"], ["ints"], value=numpy_helper.from_array(np.array([-3], I64))),
        helper.make_node("Relu", ["x"], ["relu"]),
    ]
    model = graph_model(nodes, {"x": x}, {"cs_shape": _ints(2, 3)})
    assert_matches_ort(model, {"x": x}, batch_axis=None)


def test_constant_of_shape_runtime_shape():
    """ConstantOfShape whose shape input comes from Shape(x): per sample in batch mode."""
    x = rand((2, 3), seed=14)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["c"], value=numpy_helper.from_array(np.array([7], np.int32))),
        helper.make_node("Cast", ["c"], ["cf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "cf"], ["y"]),
    ]
    model = graph_model(nodes, {"x": x}, batch="N")
    for n in (1, 4):
        feeds = {"x": rand((n, 3), seed=n)}
        net, _ = assert_matches_ort(model, feeds, batch_axis=0)
        assert net.batch_symbol == "N"


def test_flatten_pattern_per_sample():
    """torch's x.view(x.size(0), -1): Shape -> Gather -> Unsqueeze -> Concat -> Reshape, batched."""
    x = rand((2, 3, 4), seed=15)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["flat"]),
        helper.make_node("Sigmoid", ["flat"], ["y"]),
    ]
    inits = {"zero": np.array(0, I64), "ax0": _ints(0), "minus1": _ints(-1)}
    model = graph_model(nodes, {"x": x}, inits, batch="N")
    for n in (1, 3):
        feeds = {"x": rand((n, 3, 4), seed=n)}
        net, _ = assert_matches_ort(model, feeds, batch_axis=0)
        assert net.batch_symbol == "N"


# ---- batch mode ------------------------------------------------------------------------------


def test_batch_concat_gather_slice_split():
    """Per sample: Concat axis 1, Gather from a shared table with batched indices, a Slice over the
    whole batch axis and axis 1, Split axis 1, Transpose keeping axis 0."""
    table = rand((10, 4), seed=16)
    nodes = [
        helper.make_node("Concat", ["a", "b"], ["cat"], axis=1),
        helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),
        helper.make_node("Slice", ["cat", "s", "e", "ax"], ["sl"]),
        helper.make_node("Split", ["cat"], ["p0", "p1"], axis=1, num_outputs=2),
        helper.make_node("Transpose", ["emb"], ["embT"], perm=[0, 2, 1]),
    ]
    inits = {"table": table, "s": _ints(0, 1), "e": _ints(2**63 - 1, 4), "ax": _ints(0, 1)}
    a, b, ids = rand((2, 3)), rand((2, 5), seed=1), rand((2, 6), I64, seed=2, low=0, high=6)
    model = graph_model(nodes, {"a": a, "b": b, "ids": ids}, inits, batch="N")
    for n in (1, 5):
        feeds = {"a": rand((n, 3), seed=n), "b": rand((n, 5), seed=n + 1),
                 "ids": np.random.default_rng(n).integers(-10, 10, size=(n, 6)).astype(I64)}
        net, _ = assert_matches_ort(model, feeds)
        assert net.batch_symbol == "N"


# Nodes that mix samples across the batch axis: the compiler sees most of them in the output's
# shape (the batch dimension moved or changed), the operators the rest (an output that keeps its
# shape, like Gather's). Such a graph compiles per batch size (luisaml.PerBatchNetwork).
BATCH_AXIS_OPS = [
    ("Concat", {"axis": 0}, 2),
    ("Split", {"axis": 0, "num_outputs": 2}, 1),
    ("Gather", {"axis": 0}, 1),
    ("Transpose", {"perm": [1, 0, 2]}, 1),
    ("Slice", {}, 1),
]


@pytest.mark.parametrize("op,attrs,n_in", BATCH_AXIS_OPS, ids=[c[0] for c in BATCH_AXIS_OPS])
def test_batch_axis_ops_run_per_batch(op, attrs, n_in):
    inputs = {"x": rand((4, 4, 3)), "x2": rand((4, 4, 3), seed=1)} if n_in == 2 else {"x": rand((4, 4, 3))}
    inits = {"Gather": {"i": _ints(0, 1)}, "Slice": {"s": _ints(1), "e": _ints(3), "a": _ints(0)}}.get(op)
    outs = ["y0", "y1"] if op == "Split" else ["y"]
    node = helper.make_node(op, list(inputs) + list(inits or {}), outs, name="bad", **attrs)
    model = graph_model([node], inputs, inits, batch="N")
    assert_per_batch(model, lambda n: {k: rand((n, 4, 3), seed=n + j) for j, k in enumerate(inputs)}, "bad", sizes=(4, 6))


def test_batch_gather_same_shape():
    """Gather along the batch axis with one index: the output [1, 3] keeps the sample's shape, the
    operator sees that it mixes samples."""
    x, i = rand((2, 3)), _ints(0)
    model = graph_model([helper.make_node("Gather", ["x", "i"], ["y"], name="g", axis=0)], {"x": x}, {"i": i}, batch="N",
                        outputs=["y"])
    assert_per_batch(model, lambda n: {"x": rand((n, 3), seed=n)}, "g")


# ---- stages ----------------------------------------------------------------------------------


def test_stage_forms():
    """Views and Expand as graph outputs (a stage of their own) and read by another node (inline
    there), and a Constant output, in a batched model at two batch sizes."""
    x = rand((2, 3, 4), seed=20)
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["rs"], name="reshape"),
        helper.make_node("Flatten", ["x"], ["flat"], name="flatten", axis=2),
        helper.make_node("Unsqueeze", ["x", "ax_u"], ["unsq"], name="unsqueeze"),
        helper.make_node("Squeeze", ["x1", "ax_s"], ["sq"], name="squeeze"),
        helper.make_node("Expand", ["e", "s_e"], ["ex"], name="expand"),
        helper.make_node("Expand", ["e", "s_e"], ["ex2"], name="expand_inline"),
        helper.make_node("Neg", ["ex2"], ["neg_ex"], name="neg"),
        helper.make_node("Constant", [], ["c"], name="constant", value=helper.make_tensor("c", 1, [3], [1.0, -2.0, 7.5])),
    ]
    inits = {"shape": _ints(0, 4, 3), "ax_u": _ints(1, 3), "ax_s": _ints(2), "s_e": _ints(1, 4, 3)}
    model = graph_model(nodes, {"x": x, "x1": rand((2, 5, 1)), "e": rand((2, 1, 3))}, inits, batch="N")
    net = assert_stage_forms(model, lambda n: {"x": rand((n, 3, 4), seed=n), "x1": rand((n, 5, 1), seed=n + 1),
                                               "e": rand((n, 1, 3), seed=n + 2)},
                             ["reshape", "flatten", "unsqueeze", "squeeze", "expand", "expand_inline", "constant"])
    assert "Expand 'expand_inline'" in stage_of(net, "neg").inlined


def test_reshape_transpose_chain_inline_in_matmul():
    """Reshape -> Transpose -> Add -> Relu feeding a MatMul: the chain is computed inline where the
    MatMul reads it, so none of the intermediates gets a buffer."""
    x = rand((2, 3, 8), seed=21)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1], name="transpose"),
             helper.make_node("Add", ["t", "bias"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["h"], name="relu"),
             helper.make_node("MatMul", ["h", "w"], ["y"], name="matmul")]
    inits = {"shape": _ints(0, 4, 6), "bias": rand((6, 4), seed=22), "w": rand((4, 5), seed=23)}
    model = graph_model(nodes, {"x": x}, inits, batch="N")
    net = assert_stage_forms(model, lambda n: {"x": rand((n, 3, 8), seed=n)}, ["matmul"])
    st = stage_of(net, "matmul")
    for name in ("transpose", "add", "relu"):
        assert stage_of(net, name) is st, net.plan.schedule.describe()
    pooled = {m for slot in net.plan.schedule.buffers.slots for m in slot.members}
    assert not pooled & {"r", "t", "a", "h"}, net.plan.schedule.describe()


def test_shape_and_size_in_stages(monkeypatch):
    """Shape and Size when the folder leaves them (it never does for static shapes): literals,
    inline where a Mul reads them."""
    import luisaml.passes.fold as fold

    monkeypatch.setattr(fold, "NOT_FOLDED", fold.NOT_FOLDED | {"Shape", "Size"})
    nodes = [helper.make_node("Shape", ["x"], ["shape"], name="shape"),
             helper.make_node("Shape", ["x"], ["tail"], name="tail", start=1),
             helper.make_node("Mul", ["tail", "two"], ["tail2"], name="mul"),
             helper.make_node("Size", ["x"], ["size"], name="size"),
             helper.make_node("Mul", ["size", "two"], ["size2"], name="mul_size")]
    x = rand((2, 3, 4), seed=24)
    model = graph_model(nodes, {"x": x}, {"two": np.array(2, I64)})
    net = assert_stage_forms(model, lambda n: {"x": x}, ["shape", "tail", "size"], sizes=(2,), batch_axis=None)
    assert "Shape 'tail'" in stage_of(net, "mul").inlined and "Size 'size'" in stage_of(net, "mul_size").inlined
