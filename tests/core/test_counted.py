"""Counted execution (issue 28 item 3, luisaml/dynamic.py): a run-time sized output's count stays on the
device, its buffer starts at a capacity, and a run whose count passes it is repeated with a larger one —
never cut. The knob here is the first capacity (dynamic.FIRST_CAPACITY_ROWS, or a network's
`launcher.capacity`): set to one row, every run that has more rows overflows first; the results must equal
onnxruntime's and a roomy network's bit for bit, and the counts show the repeat (two waits, twice the
launches) and, once the capacity has grown, one wait again."""
import numpy as np
import pytest
from onnx import helper

import luisaml
from luisaml import counts, dynamic

from util import graph_model, ort_run


@pytest.fixture
def one_row(monkeypatch):
    """Counted outputs start with room for one row."""
    monkeypatch.setattr(dynamic, "FIRST_CAPACITY_ROWS", 1)


def _nonzero_model():
    nodes = [helper.make_node("NonZero", ["a"], ["ya"], name="NonZero_a"),
             helper.make_node("NonZero", ["b"], ["yb"], name="NonZero_b")]
    return graph_model(nodes, {"a": np.zeros((9, 31), np.float32), "b": np.zeros((4, 5), np.int32)}, opset=13)


def _nonzero_feeds(rng, density):
    a = np.where(rng.random((9, 31)) < density, rng.standard_normal((9, 31)), 0).astype(np.float32)
    b = np.where(rng.random((4, 5)) < density, rng.integers(1, 9, (4, 5)), 0).astype(np.int32)
    return {"a": a, "b": b}


def test_a_count_past_the_capacity_runs_again_and_cuts_nothing(one_row):
    model = _nonzero_model()
    net = luisaml.compile(model, batch_axis=None)
    assert net.plan.counted == ["ya", "yb"] and all(rb.counted for rb in net.plan.readbacks)
    feeds = _nonzero_feeds(np.random.default_rng(0), 0.6)
    stages = sum(1 for st in net.plan.schedule.stages if st.dispatch(1))
    with counts.measure() as c:
        got = net.run(feeds)
    want = ort_run(model, feeds)
    for name in want:
        assert got[name].shape == want[name].shape and np.array_equal(got[name], want[name]), name
    assert net.launcher.reruns == 1  # both outputs overflowed in the first pass: one repeat for both
    assert c.syncs == 2 and c.launches == 2 * stages
    assert net.launcher.capacity["ya"] >= want["ya"].shape[1] and net.launcher.capacity["yb"] >= want["yb"].shape[1]
    with counts.measure() as c:  # the capacity grew: the next run of as many rows waits once
        again = net.run(feeds)
    assert c.syncs == 1 and c.launches == stages and net.launcher.reruns == 1
    for name in want:
        assert np.array_equal(again[name], want[name]), name


def test_results_equal_a_roomy_network_bit_for_bit(one_row, monkeypatch):
    model = _nonzero_model()
    tight = luisaml.compile(model, batch_axis=None)
    rng = np.random.default_rng(1)
    runs = [_nonzero_feeds(rng, d) for d in (0.0, 0.9, 0.1, 1.0, 0.02)]  # up, down, up: the capacity moves
    got = [tight.run(f) for f in runs]
    monkeypatch.setattr(dynamic, "FIRST_CAPACITY_ROWS", 1024)  # (more than twice any count here)
    roomy = luisaml.compile(model, batch_axis=None)
    for f, g in zip(runs, got):
        r = roomy.run(f)
        for name in r:
            assert g[name].dtype == r[name].dtype and g[name].shape == r[name].shape
            assert g[name].tobytes() == r[name].tobytes(), name
    assert roomy.launcher.reruns == 0 and tight.launcher.reruns >= 2


def test_nms_past_its_capacity_equals_onnxruntime(one_row):
    rng = np.random.default_rng(2)
    B, C, N = 2, 3, 17
    boxes = (rng.integers(0, 16, (B, N, 4)) / 4.0).astype(np.float32)
    scores = (rng.integers(0, 8, (B, C, N)) / 8.0).astype(np.float32)
    node = helper.make_node("NonMaxSuppression", ["b", "s", "max", "iou"], ["sel"], name="NMS_0")
    model = graph_model([node], {"b": boxes, "s": scores},
                        {"max": np.array([5], np.int64), "iou": np.array([0.5], np.float32)}, opset=11)
    net = luisaml.compile(model, batch_axis=None)
    got, want = net.run({"b": boxes, "s": scores}), ort_run(model, {"b": boxes, "s": scores})
    assert len(want["sel"]) > 1 and net.launcher.reruns == 1
    assert got["sel"].shape == want["sel"].shape and np.array_equal(got["sel"], want["sel"])


def test_the_capacity_grows_past_a_total_and_shrinks_when_runs_use_little_of_it(monkeypatch):
    monkeypatch.setattr(dynamic, "FIRST_CAPACITY_ROWS", 4)
    cap = dynamic.Capacity()
    assert cap["y"] == 4
    assert cap.settle("y", 3, lambda rows: True) is False and cap["y"] == 4
    assert cap.settle("y", 100, lambda rows: True) is True and cap["y"] == 128  # the next power of two
    assert cap.settle("y", 40, lambda rows: True) is False and cap["y"] == 128  # a third of it: kept
    assert cap.settle("y", 5, lambda rows: True) is False and cap["y"] == 16  # under a quarter: shrunk
    assert cap.settle("y", 300, lambda rows: rows <= 300) is True and cap["y"] == 300  # the bucket past the limits


def test_a_network_without_kernels_waits_for_nothing():
    """A graph whose output is its input: nothing launched, nothing to download, no wait."""
    from onnx import TensorProto

    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    m = helper.make_model(helper.make_graph([], "g", [x_info], [x_info]), opset_imports=[helper.make_opsetid("", 17)])
    net = luisaml.compile(m, batch_axis=None)
    x = np.arange(3, dtype=np.float32)
    net.run({"x": x})
    with counts.measure() as c:
        out = net.run({"x": x})
    assert np.array_equal(out["x"], x) and c.syncs == 0 and c.launches == 0


def test_a_flagged_error_comes_back_with_the_outputs():
    """The run-time check's flag is read in the run's one wait, and still raises naming the node."""
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    m = graph_model([helper.make_node("Gather", ["d", "i"], ["y"], name="Gather_0", axis=0)],
                    {"d": data, "i": np.zeros((2,), np.int64)})
    net = luisaml.compile(m, batch_axis=None)
    with counts.measure() as c:
        assert np.array_equal(net.run({"d": data, "i": np.array([3, 1], np.int64)})["y"], data[[3, 1]])
    assert c.syncs == 1
    with pytest.raises(luisaml.RunError, match="Gather_0"):
        net.run({"d": data, "i": np.array([7, 1], np.int64)})


def test_commits_every_launch_change_nothing_but_when_the_device_starts(monkeypatch):
    """launch.FLUSH_LAUNCHES commits the command list without waiting: the same bits, the same one wait."""
    from luisaml import launch

    model = _nonzero_model()
    feeds = _nonzero_feeds(np.random.default_rng(4), 0.5)
    want = luisaml.compile(model, batch_axis=None).run(feeds)
    monkeypatch.setattr(launch, "FLUSH_LAUNCHES", 1)
    net = luisaml.compile(model, batch_axis=None)
    net.run(feeds)
    with counts.measure() as c:
        got = net.run(feeds)
    assert c.syncs == 1
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


def test_net_launch_commits_its_last_launches(monkeypatch):
    """Under launch.FLUSH_LAUNCHES (CUDA's 4) net.launch commits its tail too: a caller that waits on the
    device some other way (torch.cuda.synchronize on DLPack-shared tensors) sees every stage's output, not
    a command list still pending. The stream recorded here: every launch is followed by a commit before
    the run's downloads."""
    from luisa import globalvars

    from luisaml import launch

    class Recorder:
        def __init__(self, stream):
            self._stream, self.events = stream, []

        def add(self, command):
            self.events.append(type(command).__name__)
            self._stream.add(command)

        def execute(self):
            self.events.append("execute")
            self._stream.execute()

        def __getattr__(self, name):
            if name == "add_launches":  # (launch.py then enqueues through add)
                raise AttributeError(name)
            return getattr(self._stream, name)

    model, feeds = _nonzero_model(), _nonzero_feeds(np.random.default_rng(5), 0.5)
    want = luisaml.compile(model, batch_axis=None).run(feeds)
    net = luisaml.compile(model, batch_axis=None)
    net.run(feeds)

    def recorded_run(flush: int):
        monkeypatch.setattr(launch, "FLUSH_LAUNCHES", flush)
        rec = Recorder(globalvars.vars.stream)
        monkeypatch.setattr(globalvars.vars, "stream", rec)
        try:
            got = net.run(feeds)
        finally:
            monkeypatch.setattr(globalvars.vars, "stream", rec._stream)
        return got, rec.events, [i for i, e in enumerate(rec.events) if e == "ShaderDispatchCommand"]

    _, _, launches = recorded_run(1 << 20)
    assert len(launches) >= 3
    got, events, launches = recorded_run(len(launches) - 1)  # (one launch past the last commit of the loop)
    assert events[launches[-2] + 1:launches[-1]].count("execute") == 1, events
    assert "execute" in events[launches[-1]:], events
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
