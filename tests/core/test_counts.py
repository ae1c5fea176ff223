"""Counted execution's measurements (issue 28 item 3): net.profile reports what one whole run asks of
the device — kernel launches, host synchronisations, uploads, downloads, device bytes held and their
peak (luisaml/counts.py) — and the numbers are the ones the run's structure implies: one host
synchronisation a run (the flag, the counts and every output downloaded together at its end), one more
per mid-run read-back of a host step (tests/core/test_counted.py: counts kept on the device)."""
import numpy as np
from onnx import TensorProto, helper

import luisaml
from luisaml import counts


def _model(nodes, inputs, outputs, opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_a_plain_network_launches_each_stage_and_waits_once():
    m = _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=-1)],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])])
    net = luisaml.compile(m)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    prof = net.profile({"x": x}, repeat=2)
    stages = len(net.plan.schedule.stages)
    assert len(prof) == stages and all(ms >= 0 for _, ms in prof)  # the per-stage list, as before
    c = prof.counts
    assert c.launches == stages
    assert c.syncs == 1  # the run's end, the output's download in the same wait
    # (x again: the buffer holds its bytes from the run before, so nothing is uploaded; network._upload_input)
    assert c.uploads == 0 and c.downloads == 1
    assert c.peak_bytes >= c.held_bytes >= x.nbytes * 2  # (the input's and the output's buffers at least)
    assert prof.run_ms > 0


def test_a_count_stays_on_the_device_and_costs_no_synchronisation():
    """NonZero's output size is known only on the device: its count is copied into the run's state
    after the prefix sum and read with the output at the run's end, not between segments."""
    m = _model([helper.make_node("NonZero", ["x"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 5])],
               [helper.make_tensor_value_info("y", TensorProto.INT64, [2, None])])
    net = luisaml.compile(m, batch_axis=None)
    x = np.random.default_rng(1).standard_normal((6, 5)).astype(np.float32)
    x[x < 0] = 0
    got = net.run({"x": x})["y"]
    assert np.array_equal(got, np.stack(np.nonzero(x)))
    c = net.profile({"x": x}, repeat=1).counts
    assert len(net.plan.readbacks) == 1 and net.plan.readbacks[0].counted
    assert c.syncs == 1  # the run's end: no wait between the count and the fill
    assert c.downloads == 2  # the state words (the flag, the count) and the output, in that one wait
    assert c.launches == sum(1 for st in net.plan.schedule.stages if st.dispatch(1))


def test_measure_nests_and_buffers_release_their_bytes():
    import luisa

    luisaml.device.init("cpu")
    base = counts.snapshot().held_bytes
    with counts.measure() as outer:
        with counts.measure() as inner:
            buf = counts.allocated(luisa.Buffer(1000, float))
            del buf
        assert inner.peak_bytes == base + 4000 and inner.held_bytes == base
    assert outer.peak_bytes == base + 4000 and outer.held_bytes == base


def test_inspect_profile_prints_a_whole_run(tmp_path, capsys):
    from luisaml.cli import main

    m = _model([helper.make_node("Relu", ["x"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])])
    path = tmp_path / "relu.onnx"
    path.write_bytes(m.SerializeToString())
    assert main(["inspect", str(path), "--profile"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "a whole run:" in ln)
    assert "1 launches, 1 host synchronisations" in line and "device peak" in line
