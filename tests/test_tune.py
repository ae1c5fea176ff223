"""compile(tune=...) on the CPU backend (luisaml/tune.py, luisaml/tune_cache.py): a tuned network
against onnxruntime, the second compile measuring nothing, a corrupt or hostile cache entry ignored,
a candidate computing something else never chosen, and tune=False never touching the tuning cache."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import conv_relu, float_model, ort_run, tuning_root  # noqa: F401 (tuning_root: a fixture)

import luisaml
from luisaml import tune, tune_cache

RTOL = 1e-5


def _model():
    """Conv (16 -> 24 channels, 3x3, 12x12) -> Relu -> Flatten -> MatMul (3456 -> 40) over a batch."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 16, 3, 3)).astype(np.float32) * 0.2
    b = rng.standard_normal(24).astype(np.float32)
    g = rng.standard_normal((24 * 12 * 12, 40)).astype(np.float32) * 0.02
    nodes = conv_relu("r") + [helper.make_node("Flatten", ["r"], ["f"], name="flat"),
                              helper.make_node("MatMul", ["f", "g"], ["y"], name="fc")]
    return float_model(nodes, {"x": ["N", 16, 12, 12]}, {"y": ["N", 40]}, {"w": w, "b": b, "g": g})


def _feeds():
    return {"x": np.random.default_rng(2).standard_normal((3, 16, 12, 12)).astype(np.float32)}


def _check(net, model):
    feeds = _feeds()
    got, want = net.run(feeds)["y"], ort_run(model, feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()))


def test_tuned_matches_onnxruntime_and_second_compile_measures_nothing(tuning_root):
    model = _model()
    net = luisaml.compile(model, backend="cpu", tune="fast")
    rec = net.plan.tuning
    assert rec.mode == "fast" and rec.measured == 2, rec
    assert {t.node for t in rec.nodes} == {"conv", "fc"}
    assert all(t.source == "measured" and t.candidates >= 2 for t in rec.nodes)
    _check(net, model)
    files = sorted(p.name for p in (tuning_root / "tuning").iterdir())
    assert len(files) == 2
    again = luisaml.compile(model, backend="cpu", tune="fast")
    assert again.plan.tuning.measured == 0
    assert [t.source for t in again.plan.tuning.nodes] == ["cache", "cache"]
    assert [t.choice for t in again.plan.tuning.nodes] == [t.choice for t in rec.nodes]
    assert again.plan.source == net.plan.source
    _check(again, model)


def test_a_chosen_schedule_runs_and_shows_in_the_report(tuning_root, monkeypatch):
    """A search that finds a non-rule tile faster (timings given) builds the plan with it: the
    network still matches onnxruntime, the node's note says tuned, the report lists the choice."""
    from luisaml import report

    def fake(job, plan, opts, batch, make_network, mode):
        return [1.0] + [0.5 if c == len(job.candidates) - 1 else 2.0 for c in range(1, len(job.candidates))], set()

    model = _model()
    monkeypatch.setattr(tune, "measure_job", fake)
    net = luisaml.compile(model, backend="cpu", tune="full")
    picked = {t.node: t for t in net.plan.tuning.nodes}
    assert all(t.choice != t.rule for t in picked.values())
    _check(net, model)
    rep = report.from_plan(net.plan)
    assert "(tuned)" in next(d["note"] for d in rep["nodes"] if d["name"] == "conv")
    assert {d["node"] for d in rep["tuning"]["nodes"]} == {"conv", "fc"}
    assert "tuned schedules" in report.text(rep)


def test_a_candidate_computing_something_else_is_never_chosen(tuning_root, monkeypatch):
    """A Conv strip schedule made to add 1 to every output, and timed as the fastest, is rejected."""
    from luisaml.operators import conv as conv_ops

    wrong = {}
    # the straight-line tiles, whose values `finished` makes (the channel tiles store through a loop)
    monkeypatch.setattr(conv_ops.Conv, "epilogue_loop", "gelu")

    real_schedules = conv_ops.Conv.schedules

    def schedules(self, blocks, wide):
        out = real_schedules(self, blocks, wide)
        if len(out) > 1:
            wrong["choice"] = out[1]
        return out

    real_finished = conv_ops.finished

    def finished(ctx, acc, y):
        done = real_finished(ctx, acc, y)
        if wrong.get("active"):
            done = [[ctx.let(f"{v} + 1.0", "bad") for v in row] for row in done]
        return done

    real_emit_conv = conv_ops.Conv.emit_item

    def emit_wrong(self, ctx, item):
        wrong["active"] = self.schedule is not None and self.schedule == wrong.get("choice")
        try:
            real_emit_conv(self, ctx, item)
        finally:
            wrong["active"] = False

    monkeypatch.setattr(conv_ops.Conv, "schedules", schedules)
    monkeypatch.setattr(conv_ops, "finished", finished)
    monkeypatch.setattr(conv_ops.Conv, "emit_item", emit_wrong)
    real_measure = tune.measure_job
    seen = {}

    def measure(job, plan, opts, batch, make_network, mode):
        times, rejected = real_measure(job, plan, opts, batch, make_network, mode)
        seen[job.nodes[0][0].name] = (times, rejected)
        if job.nodes[0][0].name == "conv":  # the wrong candidate the fastest by far
            times = [t if c != 1 else 1e-6 for c, t in enumerate(times)]
        return times, rejected

    monkeypatch.setattr(tune, "measure_job", measure)
    model = _model()
    net = luisaml.compile(model, backend="cpu", tune="fast")
    # the patches reached the Conv class the compile used (a second copy of the operators' modules
    # registered its own classes once: tests/core/test_registry.py)
    assert "choice" in wrong, "the patched Conv.schedules never ran: the registry holds another Conv class"
    assert seen["conv"][1] == {1}, seen
    conv = next(t for t in net.plan.tuning.nodes if t.node == "conv")
    assert conv.choice != wrong["choice"] and conv.rejected == 1
    stored = [json.loads(p.read_text()) for p in (tuning_root / "tuning").iterdir()]
    assert all(e["choice"] != wrong["choice"] for e in stored)
    _check(net, model)


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"format": 1, "key": {}, "choice": {"form": "items"}, "ms": [1.0], "rule_ms": 1.0}),  # another key
    None,  # the right key, a hostile choice
    "[" * 100000,  # deep nesting
    "x" * (tune_cache.MAX_ENTRY_BYTES + 1),
])
def test_a_corrupt_or_hostile_entry_is_ignored(tuning_root, caplog, content):
    model = _model()
    first = luisaml.compile(model, backend="cpu", tune="fast")
    entries = sorted((tuning_root / "tuning").iterdir())
    for p in entries:
        if content is None:
            data = json.loads(p.read_text())
            data["choice"] = {"form": "items", "P": "__import__('os').system('false')", "O": 1 << 40}
            p.write_text(json.dumps(data))
        else:
            p.write_text(content)
    with caplog.at_level("WARNING", logger="luisaml"):
        net = luisaml.compile(model, backend="cpu", tune="fast")
    assert "tuning cache entry" in caplog.text
    assert net.plan.tuning.measured == 2  # measured again, and written again soundly
    assert all(tune_cache.load(json.loads(p.read_text())["key"]) is not None for p in entries)
    assert [t.rule for t in net.plan.tuning.nodes] == [t.rule for t in first.plan.tuning.nodes]
    _check(net, model)


def test_a_cached_choice_outside_the_candidates_is_measured_again(tuning_root, caplog):
    model = _model()
    luisaml.compile(model, backend="cpu", tune="fast")
    for p in (tuning_root / "tuning").iterdir():
        data = json.loads(p.read_text())
        data["choice"] = {"form": "items", "P": 8, "O": 3, "R": 3}  # sound data, not a candidate
        p.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="luisaml"):
        net = luisaml.compile(model, backend="cpu", tune="fast")
    assert "not one of its candidates" in caplog.text
    assert net.plan.tuning.measured == 2


def test_tune_false_never_touches_the_tuning_cache(tuning_root, monkeypatch):
    def untouchable(*a, **k):
        raise AssertionError("the tuning cache was used")

    for name in ("load", "store", "folder"):
        monkeypatch.setattr(tune_cache, name, untouchable)
    monkeypatch.setattr(tune, "search", untouchable)
    net = luisaml.compile(_model(), backend="cpu")
    assert net.plan.tuning is None
    assert not (tuning_root / "tuning").exists()
    _check(net, _model())


def test_a_graph_without_a_batch_is_tuned_at_its_shapes(tuning_root):
    rng = np.random.default_rng(3)
    g = rng.standard_normal((48, 40)).astype(np.float32)
    node = helper.make_node("Gemm", ["a", "g"], ["z"], name="gemm", transB=0)
    graph = helper.make_graph([node], "fixed", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [20, 48])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [20, 40])],
                              [numpy_helper.from_array(g, "g")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    net = luisaml.compile(model, backend="cpu", batch_axis=None, tune="fast")
    assert net.plan.tuning.measured == 1 and net.plan.tuning.nodes[0].rejected == 0
    feeds = {"a": rng.standard_normal((20, 48)).astype(np.float32)}
    np.testing.assert_allclose(net.run(feeds)["z"], ort_run(model, feeds)["z"], rtol=RTOL, atol=1e-5)


def test_every_full_candidate_computes_what_the_rules_compute(tuning_root):
    """tune="full" on the CPU: every items candidate of a Conv (a strip that does not divide the row,
    a channel block that does not divide the channels), a MatMul over a constant B and a MatMul of two
    run-time operands (ragged row blocks) matches the rules' output: none rejected."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"], name="qk")]
    graph = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["N", 37, 24]),
                                              helper.make_tensor_value_info("k", TensorProto.FLOAT, ["N", 24, 37])],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, ["N", 37, 37])])
    attn = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    attn.ir_version = 10
    for model in (_model(), attn):
        net = luisaml.compile(model, backend="cpu", tune="full")
        rec = net.plan.tuning
        assert rec.nodes and all(t.rejected == 0 and t.candidates > 4 for t in rec.nodes), \
            [t.describe() for t in rec.nodes]
    feeds = {"q": rng.standard_normal((2, 37, 24)).astype(np.float32),
             "k": rng.standard_normal((2, 24, 37)).astype(np.float32)}
    np.testing.assert_allclose(net.run(feeds)["s"], ort_run(attn, feeds)["s"], rtol=RTOL, atol=1e-5)


def test_tune_values_are_checked():
    with pytest.raises(luisaml.UsageError, match="tune must be"):
        luisaml.compile(_model(), backend="cpu", tune="fastest")
    with pytest.raises(luisaml.UsageError, match="tune must be"):
        luisaml.compile(_model(), backend="cpu", tune=True)


def test_candidate_spaces_start_with_the_rules_and_stay_in_bounds():
    from luisaml.operators import conv, gemm, tiled

    tl = tiled.choose(4096, 256, 1152, 1, m_fast=True, pipelined=True)
    for wide, most in ((False, 4), (True, 16)):
        cands = tiled.candidates(tl, wide)
        assert cands[0] == tiled.as_choice(tl) and 2 <= len(cands) <= most
        assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands)
        assert all(tiled.tuned(tl, c) is not None and tiled.as_choice(tiled.tuned(tl, c)) == c for c in cands)
    assert tiled.tuned(tl, {"form": "blocks", "BM": 256, "BN": 64, "TM": 8, "TN": 8, "BK": 8, "double": False}) is tl
    items = gemm.item_candidates(197, 64, (1, 32), True)
    assert items[0] == {"form": "items", "R": 1, "O": 32} and len(items) <= 12
    assert all(gemm.item_choice(c, 197) is not None for c in items)
    assert gemm.item_choice({"form": "items", "R": True, "O": 8}, 197) is None
    strips = conv.strip_candidates(24, (8, 8), False)
    assert strips[0] == {"form": "items", "P": 8, "O": 8} and len(strips) == 4
    assert conv.strip_choice({"form": "items", "P": 3, "O": 8}) is None


def test_inspect_tune_shows_the_chosen_schedules(tuning_root, tmp_path, capsys):
    import onnx

    from luisaml.cli import main

    path = tmp_path / "tuned.onnx"
    onnx.save(_model(), str(path))
    assert main(["inspect", str(path), "--tune", "fast", "--target", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tuned schedules (tune='fast'" in out and "node 'conv' (Conv, items)" in out
