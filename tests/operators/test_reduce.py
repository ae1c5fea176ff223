"""Reductions and ArgMax/ArgMin against onnxruntime: axes as attribute (opset 13) and as input
(opset 18, ReduceSum 13), keepdims, noop_with_empty_axes, negative axes, float/half/int, the
batch rules, and the parallel stages they run in (with CumSum and Hardmax)."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, ort_run, rand, single_node_model, stage_of

import luisaml

# (axes or None, keepdims); None: every axis
AXES = [([1], 1), ([-1], 0), ([0, 2], 1), ([2, 0], 0), (None, 0), (None, 1), ([0, 1, 2], 1)]
FLOAT_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
             "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]


def _data(op, dtype, shape=(3, 4, 5), seed=0):
    if op in ("ReduceLogSum", "ReduceL2") or dtype == np.float16 and op == "ReduceProd":
        return rand(shape, dtype, seed=seed, low=0.2, high=2.0)
    if op == "ReduceProd":
        return rand(shape, dtype, seed=seed, low=0.5, high=1.5) * np.where(rand(shape, seed=seed + 1) > 0, 1, -1).astype(dtype)
    return rand(shape, dtype, seed=seed)


def _reduce_model(op, x, opset, axes_as_input):
    nodes, inits = [], {}
    for k, (axes, keep) in enumerate(AXES):
        ins, attrs = ["x"], {"keepdims": keep}
        if axes is not None:
            if axes_as_input:
                inits[f"axes{k}"] = np.array(axes, np.int64)
                ins.append(f"axes{k}")
            else:
                attrs["axes"] = axes
        nodes.append(helper.make_node(op, ins, [f"y{k}"], name=f"{op}_{k}", **attrs))
    return graph_model(nodes, {"x": x}, inits, opset=opset)


@pytest.mark.parametrize("op", FLOAT_OPS)
def test_reduce_float_axes_attribute(op):
    """axes as an attribute: opset 13 (ReduceSum: opset 11, upgraded to an axes input on loading)."""
    x = _data(op, np.float32)
    opset = 11 if op == "ReduceSum" else 13
    assert_matches_ort(_reduce_model(op, x, opset, axes_as_input=False), {"x": x}, batch_axis=None, rtol=2e-5)


@pytest.mark.parametrize("op", FLOAT_OPS)
def test_reduce_float_axes_input(op):
    x = _data(op, np.float32, shape=(2, 3, 6), seed=3)
    assert_matches_ort(_reduce_model(op, x, 18, axes_as_input=True), {"x": x}, batch_axis=None, rtol=2e-5)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceSumSquare"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_reduce_int(op, dtype):
    x = rand((3, 4, 5), dtype, seed=4, low=-9, high=9) if op != "ReduceProd" else rand((3, 4, 5), dtype, seed=4, low=-1, high=0)
    assert_matches_ort(_reduce_model(op, x, 18, axes_as_input=True), {"x": x}, batch_axis=None)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceLogSumExp"])
def test_reduce_half(op):
    x = _data(op, np.float16, seed=5)
    # accumulated in float, rounded to half once
    assert_matches_ort(_reduce_model(op, x, 18, axes_as_input=True), {"x": x}, batch_axis=None, rtol=1e-3, atol=1e-3)


def test_reduce_empty_axes_input():
    """An empty axes input reduces everything, or nothing with noop_with_empty_axes=1; a missing
    one reduces everything."""
    x = rand((3, 4), seed=6)
    empty = np.zeros((0,), np.int64)
    nodes = [
        helper.make_node("ReduceSum", ["x", "empty"], ["all"], keepdims=0),
        helper.make_node("ReduceSum", ["x", "empty"], ["noop"], noop_with_empty_axes=1),
        helper.make_node("ReduceMax", ["x"], ["missing"], keepdims=1),
        helper.make_node("ReduceMean", ["x", "empty"], ["noop_mean"], noop_with_empty_axes=1),
    ]
    assert_matches_ort(graph_model(nodes, {"x": x}, {"empty": empty}, opset=18), {"x": x}, batch_axis=None)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16])
def test_argmax_argmin(dtype):
    x = rand((3, 4, 5), np.int32, seed=7, low=-3, high=3).astype(dtype)  # small ints: many ties
    nodes = []
    for op in ("ArgMax", "ArgMin"):
        for axis in (0, 1, -1):
            for keep in (0, 1):
                for last in (0, 1):
                    nodes.append(helper.make_node(op, ["x"], [f"{op}_{axis}_{keep}_{last}"], axis=axis, keepdims=keep,
                                                  select_last_index=last))
    _, got = assert_matches_ort(graph_model(nodes, {"x": x}, opset=13), {"x": x}, batch_axis=None)
    assert all(v.dtype == np.int64 for v in got.values())


@pytest.mark.parametrize("schedule", ["stages", "per-sample"])
def test_reduce_per_sample(schedule):
    """Batch mode: ReduceMean over the last axis with keepdims, ReduceSum (axes input) over axis 1,
    ArgMax over axis -1, CumSum, Hardmax; batches of several sizes, as parallel stages and as the
    per-sample function (each node's whole form)."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1], keepdims=1),
        helper.make_node("ReduceSum", ["x", "ax1"], ["sum"], keepdims=0),
        helper.make_node("ArgMax", ["x"], ["arg"], axis=-1, keepdims=0),
        helper.make_node("Sub", ["x", "mean"], ["centred"]),
        helper.make_node("CumSum", ["centred", "ax1"], ["cum"], reverse=1),
        helper.make_node("Hardmax", ["x"], ["hard"], axis=1),
    ]
    model = graph_model(nodes, {"x": rand((2, 3, 5))}, {"ax1": np.array([1], np.int64)}, opset=13, batch="N")
    for n in (1, 6):
        net, _ = assert_matches_ort(model, {"x": rand((n, 3, 5), seed=n)}, schedule=schedule)
        assert net.batch_symbol == "N"


def assert_results_match_ort(net, model, feeds, rtol=1e-5, atol=1e-6):
    """Assert net's outputs for `feeds` equal onnxruntime's (dtype and shape too)."""
    got = net.run(feeds)
    for name, w in ort_run(model, feeds).items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        if w.dtype.kind == "f":
            np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], w, err_msg=name)


def assert_runs_in_parallel(model, node, make_feeds, batches=(1, 3), **tol):
    """Compile a batched model once; assert `node` runs in an element or items stage and the
    results equal onnxruntime's at each batch size; return the network."""
    net = luisaml.compile(model)
    st = stage_of(net, node)
    assert st.domain in ("element", "items"), net.plan.schedule.describe()
    for n in batches:
        assert_results_match_ort(net, model, make_feeds(n), **tol)
    return net


def assert_compiles_per_batch(model, node, make_feeds, batches=(2, 3), **tol):
    """For a node that mixes samples: assert the results equal onnxruntime's at each batch size
    (the network compiles per batch size) and that no per-sample `forward` exists, naming it.
    batch_axis=0: an output without the batch dimension leaves "auto" no batch to find."""
    net = luisaml.compile(model, batch_axis=0)
    for n in batches:
        assert_results_match_ort(net, model, make_feeds(n), **tol)
    with pytest.raises(luisaml.UsageError, match=f"'{node}'"):
        net.forward  # noqa: B018
    return net


PARALLEL = [  # (op, opset, extra initializers, attributes)
    *((op, 18, {"axes": np.array([1], np.int64)}, {"keepdims": 1}) for op in FLOAT_OPS),
    ("ReduceMean", 18, {"axes": np.array([-1, 1], np.int64)}, {"keepdims": 0}),
    ("ReduceMax", 18, {"axes": np.array([1, 2], np.int64)}, {"keepdims": 0}),  # one reduction per sample
    ("ArgMax", 13, {}, {"axis": 2}),
    ("ArgMin", 13, {}, {"axis": 1, "select_last_index": 1, "keepdims": 0}),
    ("CumSum", 14, {"axis": np.array(1, np.int64)}, {}),
    ("CumSum", 14, {"axis": np.array(-1, np.int64)}, {"exclusive": 1, "reverse": 1}),
    ("Hardmax", 13, {}, {"axis": 1}),
]


@pytest.mark.parametrize("op,opset,inits,attrs", PARALLEL, ids=[f"{p[0]}-{k}" for k, p in enumerate(PARALLEL)])
def test_runs_in_parallel_stages(op, opset, inits, attrs):
    """Batched: one thread per output element (the reductions, ArgMax/ArgMin) or per line
    (CumSum, Hardmax), the batch dispatched with them."""
    x = _data(op, np.float32, shape=(2, 4, 5), seed=9)
    m = single_node_model(op, {"x": x}, initializers=inits, opset=opset, batch="N", **attrs)
    net = assert_runs_in_parallel(m, f"{op}_0", lambda n: {"x": _data(op, np.float32, shape=(n, 4, 5), seed=n)}, rtol=2e-5)
    assert stage_of(net, f"{op}_0").domain == ("items" if op in ("CumSum", "Hardmax") else "element")


@pytest.mark.parametrize("axes", [[0], [-3], None])
def test_reduce_over_batch_axis_compiles_per_batch(axes):
    """A reduction over the batch axis mixes samples: the network compiles per batch size and
    runs it in parallel stages; it has no per-sample `forward`."""
    attrs = {"keepdims": 1} if axes is None else {"axes": axes, "keepdims": 1}
    m = single_node_model("ReduceMean", {"x": rand((2, 3, 5))}, opset=13, batch="N", **attrs)
    net = assert_compiles_per_batch(m, "ReduceMean_0", lambda n: {"x": rand((n, 3, 5), seed=n)})
    assert stage_of(net, "ReduceMean_0").domain == "element"


def test_reduce_errors():
    x = rand((2, 3))
    with pytest.raises(luisaml.CompileError, match="axes"):
        luisaml.compile(single_node_model("ReduceSum", {"x": x}, initializers={"a": np.array([1, -1], np.int64)}), batch_axis=None)
    with pytest.raises(luisaml.ModelError, match="ReduceMax_0"):  # shape inference already fails
        luisaml.compile(single_node_model("ReduceMax", {"x": x}, initializers={"a": np.array([2], np.int64)}), batch_axis=None)


def test_reduce_max_min_bool():
    """Opset 20: ReduceMax/ReduceMin of bool data are any/all."""
    x = rand((3, 4, 5), np.bool_, seed=8)
    nodes = [
        helper.make_node("ReduceMax", ["x", "ax"], ["any"], keepdims=0),
        helper.make_node("ReduceMin", ["x", "ax"], ["all"], keepdims=1),
        helper.make_node("ReduceMax", ["x"], ["any_all_axes"], keepdims=0),
    ]
    model = graph_model(nodes, {"x": x}, {"ax": np.array([0, 2], np.int64)}, opset=20)
    _, got = assert_matches_ort(model, {"x": x}, batch_axis=None)
    np.testing.assert_array_equal(got["any"], x.any(axis=(0, 2)))


@pytest.mark.parametrize("op,axes,shape", [("ReduceSum", [1], (3, 1 << 22)), ("ReduceMean", [1, 3], (2, 300, 7, 97)),
                                           ("ReduceL2", [0], (70001, 2))])
def test_long_float_sums_are_added_in_blocks(op, axes, shape):
    """A float32 sum of millions of terms, one accumulator, drifts by 1e-4 and more (and stops
    growing past 2^25 for addends under 2); luisaml adds blocks of about sqrt(n) terms: within
    float32 rounding of numpy's float64 sum, on whatever axes and strides the reduction takes."""
    x = np.random.default_rng(5).uniform(0.1, 1.0, shape).astype(np.float32)
    model = single_node_model(op, {"x": x}, initializers={"axes": np.array(axes, np.int64)}, keepdims=0)
    y = luisaml.compile(model, batch_axis=None).run({"x": x})["y"]
    xd = x.astype(np.float64)
    want = {"ReduceSum": lambda: xd.sum(tuple(axes)), "ReduceMean": lambda: xd.mean(tuple(axes)),
            "ReduceL2": lambda: np.sqrt((xd * xd).sum(tuple(axes)))}[op]()
    np.testing.assert_allclose(y, want, rtol=3e-6)
