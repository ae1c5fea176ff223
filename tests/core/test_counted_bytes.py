"""Counted outputs of their own totals, bytes among them (luisaml/dynamic.py; benchmarks/NOTES.md "The
grid's layout on the device", step (a)): a toy phased op with two run-time sized outputs, a ByteBuffer
written word-wise and int rows, each sized by its own total (a ScratchTotal naming its output). Both
start with room for one row, so the first run passes both capacities: the kernels' guards skip the
writes past them, the true totals come back in the run's state, and the run is repeated with room for
them; the bytes and rows equal a numpy reference, never cut. An end-of-run host step (HostRead at_end,
benchmarks/NOTES.md "The grid's layout on the device" step (b)) reads its words in the run's one wait
and raises what they say (a device grid build's flagged errors), naming its node."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import luisaml
from luisaml import counts, dynamic
from luisaml.errors import RunError
from luisaml.dynamic import HostRead, HostResult, Phase, ScratchTotal
from luisaml.storage import Buffer

SCRATCH = Buffer("scratch_int", "0")  # word 0: the blob's bytes, word 1: the rows


@luisaml.register("PackWords", domain="test.counted", since=1)
class PackWords(luisaml.Operator):
    """For each x[i] > 0: x[i] uint32 words i * 1000 + j (j < x[i]) appended to the byte output 0, and i
    appended to the int32 output 1; each output's size is its own total."""

    runtime_sized = (0, 1)

    @classmethod
    def infer(cls, node, inputs):
        return [(TensorProto.UINT8, (0,)), (TensorProto.INT32, (0,))]

    def scratch(self):
        return {"int": 2}

    def phases(self):
        return [Phase("count bytes", 1, self._count_bytes, readback=ScratchTotal(0, output=0)),
                Phase("count rows", 1, self._count_rows, readback=ScratchTotal(1, output=1)),
                Phase("fill", 1, self._fill)]

    def _walk(self, ctx, on_positive) -> None:
        x = self.input(0)
        i = ctx.fresh("i")
        ctx.line(f"for {i} in range({x.numel}):")
        with ctx.indent():
            v = ctx.let(x.load(i), "v")
            ctx.line(f"if {v} > 0:")
            with ctx.indent():
                on_positive(i, v)

    def _count(self, ctx, word: int, step) -> None:
        acc = ctx.fresh("acc")
        ctx.line(f"{acc} = 0")
        self._walk(ctx, lambda i, v: ctx.line(f"{acc} += {step(v)}"))
        ctx.line(SCRATCH.store(str(word), acc))

    def _count_bytes(self, ctx, item) -> None:
        self._count(ctx, 0, lambda v: f"4 * {v}")

    def _count_rows(self, ctx, item) -> None:
        self._count(ctx, 1, lambda v: "1")

    def _fill(self, ctx, item) -> None:
        blob, rows = self.outputs[0], self.output(1)  # (the blob may be left out: "" as its name)
        at, r = ctx.fresh("at"), ctx.fresh("r")
        ctx.line(f"{at} = 0")
        ctx.line(f"{r} = 0")

        def put(i, v):
            j = ctx.fresh("j")
            ctx.line(f"for {j} in range({v}):")
            with ctx.indent():
                if blob is not None:
                    ctx.line(blob.storage.write_word(at, f"uint({i} * 1000 + {j})"))
                ctx.line(f"{at} += 4")
            ctx.store(rows, r, i)
            ctx.line(f"{r} += 1")

        self._walk(ctx, put)


@luisaml.register("PackChecked", domain="test.counted", since=1)
class PackChecked(PackWords):
    """PackWords checked by its host at the run's end: more than MOST rows (the total the scratch's word 1
    holds) is a RunError naming the node."""

    MOST = 20

    def phases(self):
        *counts_, fill = super().phases()
        return counts_ + [Phase(fill.name, 1, fill.emit, readback=HostRead(0, 2, self._end, at_end=True))]

    def _end(self, words):
        if words[1] > self.MOST:
            raise RunError(f"{self.node.describe()}: {int(words[1])} rows, at most {self.MOST}")
        return HostResult()


def _model(n: int, op: str = "PackWords", outputs=("blob", "rows")):
    node = helper.make_node(op, ["x"], list(outputs), name="Pack_0", domain="test.counted")
    types = {"blob": TensorProto.UINT8, "rows": TensorProto.INT32}
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.INT32, [n])],
                          [helper.make_tensor_value_info(o, types[o], [o.upper()]) for o in outputs if o])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("test.counted", 1)])


def _reference(x: np.ndarray) -> dict[str, np.ndarray]:
    words = [np.arange(v, dtype=np.uint32) + np.uint32(i * 1000) for i, v in enumerate(x) if v > 0]
    blob = np.concatenate(words).view(np.uint8) if words else np.zeros(0, np.uint8)
    return {"blob": blob, "rows": np.flatnonzero(x > 0).astype(np.int32)}


@pytest.fixture
def one_row(monkeypatch):
    monkeypatch.setattr(dynamic, "FIRST_CAPACITY_ROWS", 1)


def test_two_totals_one_of_bytes_run_again_past_their_capacities_and_cut_nothing(one_row):
    n = 40
    net = luisaml.compile(_model(n), batch_axis=None)
    assert net.plan.counted == ["blob", "rows"]
    assert [(rb.outputs, rb.counted) for rb in net.plan.readbacks] == [(["blob"], True), (["rows"], True)]
    assert "write_word" not in net.source and "if (" in net.source  # (the guards are inline DSL)
    x = np.random.default_rng(0).integers(-3, 6, n).astype(np.int32)
    want = _reference(x)
    stages = sum(1 for st in net.plan.schedule.stages if st.dispatch(1))
    with counts.measure() as c:
        got = net.run({"x": x})
    assert net.launcher.reruns == 1 and c.syncs == 2 and c.launches == 2 * stages
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes(), name
    assert net.launcher.capacity["blob"] >= want["blob"].size and net.launcher.capacity["rows"] >= want["rows"].size
    with counts.measure() as c:  # room for them now: one wait
        again = net.run({"x": x})
    assert c.syncs == 1 and net.launcher.reruns == 1
    for name in want:
        assert again[name].tobytes() == want[name].tobytes(), name
    more = np.full(n, 7, np.int32)  # more bytes than the bucket: a second repeat, still exact
    got = net.run({"x": more})
    assert net.launcher.reruns == 2
    for name, value in _reference(more).items():
        assert got[name].tobytes() == value.tobytes(), name
    empty = np.zeros(n, np.int32)
    got = net.run({"x": empty})
    assert got["blob"].size == 0 and got["rows"].size == 0


def test_an_end_of_run_step_reads_its_words_in_the_one_wait_and_raises_what_they_say(one_row):
    n = 40
    net = luisaml.compile(_model(n, "PackChecked"), batch_axis=None)
    assert [(rb.counted, rb.at_end) for rb in net.plan.readbacks] == [(True, False), (True, False), (False, True)]
    rng = np.random.default_rng(1)
    for k, x in enumerate((rng.integers(-3, 6, n), rng.integers(-3, 9, n), np.zeros(n), rng.integers(-1, 3, n))):
        x = np.minimum(x, 1).astype(np.int32)
        x[x > 0] = np.arange(1, int((x > 0).sum()) + 1)  # (words 1, 2, ...: the blob passes its capacity)
        x[np.flatnonzero(x > 0)[PackChecked.MOST:]] = 0  # (at most MOST rows)
        before = net.launcher.reruns
        with counts.measure() as c:
            got = net.run({"x": x})
        assert c.syncs == 1 + net.launcher.reruns - before  # (a run past its capacities repeated first)
        for name, value in _reference(x).items():
            assert got[name].tobytes() == value.tobytes(), (k, name)
    assert net.launcher.reruns >= 2
    x = np.ones(n, np.int32)  # (40 rows: the end step's words say so)
    with pytest.raises(RunError, match="node 'Pack_0'.*40 rows, at most 20"):
        net.run({"x": x})


def test_past_what_the_last_run_downloaded_a_second_wait_reads_the_rest(monkeypatch):
    """A counted output whose capacity passes its last run's rows (and an eighth) by more than SPARE_BYTES
    (0 here) is downloaded up to those before the wait; a run with more rows reads the rest after it (a
    wait more, no re-run)."""
    from luisaml import launch

    monkeypatch.setattr(launch, "SPARE_BYTES", 0)
    n = 40
    net = luisaml.compile(_model(n), batch_axis=None)  # (first capacities: 256 rows each)
    small, large = np.zeros(n, np.int32), np.zeros(n, np.int32)
    small[:3], large[:30] = 1, 2  # 12 bytes and 3 rows, then 240 bytes and 30 rows: both within 256
    for x, waits in ((small, 1), (small, 1), (large, 2), (large, 1), (small, 1)):
        before = net.launcher.late_reads
        with counts.measure() as c:
            got = net.run({"x": x})
        assert c.syncs == waits and net.launcher.late_reads == before + waits - 1 and net.launcher.reruns == 0
        for name, value in _reference(x).items():
            assert got[name].tobytes() == value.tobytes(), name
