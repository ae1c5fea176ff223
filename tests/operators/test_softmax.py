"""Softmax and LogSoftmax against onnxruntime: every axis (opset 13), the 2-D coercion of opset
11, large inputs (the maximum is subtracted), half, per-sample execution, one work item per row in
a stage, and the per-batch compile of a softmax over the batch axis."""

import numpy as np
import pytest
from onnx import helper

from test_reduce import assert_compiles_per_batch, assert_runs_in_parallel
from util import assert_matches_ort, graph_model, rand, single_node_model, stage_of



def _all_axes_model(op, x, opset, axes):
    nodes = [helper.make_node(op, ["x"], [f"y{k}"], axis=a) for k, a in enumerate(axes)]
    nodes.append(helper.make_node(op, ["x"], ["y_default"]))
    return graph_model(nodes, {"x": x}, opset=opset)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_axes(op):
    x = rand((2, 3, 4), seed=1, low=-5, high=5)
    x[0, 0, :] += 80.0  # exp(85) overflows float: stable only with the maximum subtracted
    assert_matches_ort(_all_axes_model(op, x, 13, [0, 1, 2, -1, -2]), {"x": x}, batch_axis=None)


@pytest.fixture(params=["upgraded", "as is"])
def opset11(request, monkeypatch):
    """Old models are upgraded to opset 17 on loading; "as is" switches that off, so that the
    opset-1 operators themselves are compiled."""
    if request.param == "as is":
        import luisaml.passes.upgrade as upgrade

        monkeypatch.setattr(upgrade, "MIN_OPSET", 0)
    return request.param


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_opset11_coerces_to_2d(op, opset11):
    """Opset 11: normalised over all dims from axis on (the input seen as 2-D); default axis 1."""
    x = rand((2, 3, 4), seed=2, low=-3, high=3)
    net, _ = assert_matches_ort(_all_axes_model(op, x, 11, [0, 1, 2, -1]), {"x": x}, batch_axis=None)
    assert net.plan.model.opset("") == (11 if opset11 == "as is" else 17)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_half(op):
    x = rand((3, 7), np.float16, seed=3, low=-4, high=4)
    assert_matches_ort(_all_axes_model(op, x, 13, [0, 1]), {"x": x}, batch_axis=None, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("schedule", ["stages", "per-sample"])
def test_softmax_per_sample(schedule):
    """As parallel stages and as the per-sample function (the whole form)."""
    x = rand((2, 4, 6), seed=4)
    nodes = [
        helper.make_node("Softmax", ["x"], ["sm"], axis=-1),
        helper.make_node("LogSoftmax", ["x"], ["lsm"], axis=1),
    ]
    model = graph_model(nodes, {"x": x}, opset=13, batch="N")
    for n in (1, 5):
        net, _ = assert_matches_ort(model, {"x": rand((n, 4, 6), seed=n, low=-9, high=9)}, schedule=schedule)
        assert net.batch_symbol == "N"


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("opset,axis", [(13, -1), (13, 1), (11, 1)])
def test_softmax_runs_one_item_per_row(op, opset, axis, monkeypatch):
    """Batched: a stage runs one work item per row (opset 11: the rows of the 2-D view)."""
    import luisaml.passes.upgrade as upgrade

    monkeypatch.setattr(upgrade, "MIN_OPSET", 0)
    m = single_node_model(op, {"x": rand((2, 4, 6))}, opset=opset, batch="N", axis=axis)
    net = assert_runs_in_parallel(m, f"{op}_0", lambda n: {"x": rand((n, 4, 6), seed=n, low=-9, high=9)})
    assert stage_of(net, f"{op}_0").domain == "items"


def test_softmax_then_map_is_one_stage():
    """Each element of a row is stored once and never read back: a following elementwise map is
    applied to those stores (the epilogue of the rows' stage)."""
    nodes = [helper.make_node("LogSoftmax", ["x"], ["ls"], axis=1, name="lsm"), helper.make_node("Neg", ["ls"], ["y"], name="neg")]
    m = graph_model(nodes, {"x": rand((2, 4, 6))}, opset=13, batch="N")
    net = assert_runs_in_parallel(m, "lsm", lambda n: {"x": rand((n, 4, 6), seed=n, low=-9, high=9)})
    (st,) = net.plan.schedule.stages
    assert st.domain == "items" and [n.name for n, _ in st.epilogue] == ["neg"]


@pytest.mark.parametrize("opset,axis", [(13, 0), (13, -3), (11, 0)])
def test_softmax_over_batch_axis_compiles_per_batch(opset, axis, monkeypatch):
    """Normalising over the batch axis mixes samples: the network compiles per batch size."""
    import luisaml.passes.upgrade as upgrade

    monkeypatch.setattr(upgrade, "MIN_OPSET", 0)  # keep opset 11's 2-D coercion
    m = single_node_model("Softmax", {"x": rand((2, 4, 6))}, opset=opset, batch="N", axis=axis)
    assert_compiles_per_batch(m, "Softmax_0", lambda n: {"x": rand((n, 4, 6), seed=n)})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("n", [32, 33, 197, 1000])
def test_softmax_rows_in_lanes(op, n):
    """A contiguous row of 32 or more floats on the CPU: max and sum of exponentials in lanes, the
    exponentials through math_lib.exp_f32 (Softmax.emit_lanes): rows whose length 16 divides or
    leaves a tail, large values, -inf entries (a masked row's), a row whose entries are equal, read
    through an inline Mul and stored through an epilogue Add."""
    x = rand((2, 3, n), seed=5, low=-20, high=20)
    x[0, 0, :] += 80.0
    x[0, 1, ::3] = -np.inf
    x[1, 2, :] = 1.5
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"], name="scale"),
             helper.make_node(op, ["xs"], ["sm"], name="sm", axis=-1),
             helper.make_node("Add", ["sm", "b"], ["y"], name="add")]
    model = graph_model(nodes, {"x": x}, {"s": np.array(0.75, np.float32), "b": rand((n,), seed=6)}, opset=13,
                        batch="N")
    net, _ = assert_matches_ort(model, {"x": x}, rtol=1e-5, atol=1e-5)
    st = stage_of(net, "sm")
    assert st.domain == "items" and st.root[1].no_blocks
    assert "exp_f32" in net.plan.source


def test_softmax_lanes_nan_and_inf_rows():
    """NaN and +inf inside a row give what onnxruntime gives (a NaN row)."""
    x = rand((2, 40), seed=7)
    x[0, 5] = np.nan
    x[1, 7] = np.inf
    model = graph_model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": x}, opset=13)
    assert_matches_ort(model, {"x": x}, batch_axis=None)
