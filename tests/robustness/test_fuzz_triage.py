"""The fuzz triage's rules (fuzz_triage.py) against the evidence fuzz.localise records: a known difference
is classified, and a genuine wrong answer next to it still counts as untriaged (a rule that hid a bug would
be worse than a failing case). The evidence is computed here as the fuzz computes it (fuzz.node_evidence:
onnx.reference evaluating the node alone on each engine's inputs), on arrays made to be right or wrong."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from . import fuzz, fuzz_triage

pytestmark = pytest.mark.robustness


@pytest.fixture(autouse=True)
def _not_cuda(monkeypatch):
    monkeypatch.delenv("LUISAML_BACKEND", raising=False)  # (cuda_transcendental_accuracy reads it)


def _record(node, ours: dict, our_out, theirs: dict, their_out, kind="value") -> dict:
    """A mismatch record as localise makes it for culprit `node` (its first output)."""
    values = list(theirs.values())
    finite = [np.abs(v[np.isfinite(v)]) for v in values if v.dtype.kind == "f" and np.isfinite(v).any()]
    r = {"culprit": node.op_type, "kind": kind,
         "input_special": any(v.dtype.kind == "f" and bool((~np.isfinite(v)).any()) for v in values),
         "input_dtypes": [str(v.dtype) for v in values],
         "largest_input": max((float(f.max()) for f in finite), default=None),
         "reference_agrees": False}  # the whole graph's reference rounds upstream its own way
    r.update(fuzz.node_evidence(node, node.output[0], ours, our_out, theirs, their_out))
    return r


# ---- an ill-conditioned op after upstream rounding (fuzz graph 11:87: Tan -> Conv -> Cos of ~60) -------

COS = helper.make_node("Cos", ["x"], ["y"])
X = np.array([60.41961, 60.4188, -3.1, 1.25], np.float32)  # onnxruntime's Conv output
X_OURS = X + np.array([3e-4, -2e-4, 0, 0], np.float32)  # luisaml's: equal within the fuzz's rtol of 2e-4


def test_cos_of_inputs_rounded_differently_upstream_is_ill_conditioned():
    r = _record(COS, {"x": X_OURS}, np.cos(X_OURS), {"x": X}, np.cos(X))
    assert fuzz.difference({"y": np.cos(X_OURS)}, {"y": np.cos(X)}, ["y"])[0] == "value"  # a real mismatch
    assert r["upstream_differs"] and r["own_inputs_agree"] and r["ort_own_inputs_agree"]
    assert r["amplification"] >= fuzz_triage.AMPLIFIED
    assert fuzz_triage.classify(r) == "ill_conditioned_after_upstream_rounding"


def test_a_wrong_cos_of_those_inputs_is_untriaged():
    wrong = np.cos(X_OURS) + np.float32(1e-3)  # luisaml's Cos itself off
    r = _record(COS, {"x": X_OURS}, wrong, {"x": X}, np.cos(X))
    assert r["own_inputs_agree"] is False
    assert fuzz_triage.classify(r) is None


def test_a_cos_wrong_on_the_same_inputs_is_untriaged():
    wrong = np.cos(X) + np.float32(1e-3)  # no upstream difference to blame
    r = _record(COS, {"x": X}, wrong, {"x": X}, np.cos(X))
    assert r["upstream_differs"] is False
    assert fuzz_triage.classify(r) is None


def test_onnxruntime_wrong_on_its_own_inputs_is_not_this_class():
    r = _record(COS, {"x": X_OURS}, np.cos(X_OURS), {"x": X}, np.cos(X) + np.float32(1e-3))
    assert r["ort_own_inputs_agree"] is False
    assert fuzz_triage.classify(r) != "ill_conditioned_after_upstream_rounding"


def test_a_difference_the_node_does_not_amplify_is_untriaged():
    # Mul by a constant keeps the relative difference: right on both sides, yet not ill-conditioned
    mul = helper.make_node("Mul", ["a", "b"], ["y"])
    a, b = np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)
    ours = {"a": a * np.float32(1 + 5e-4), "b": b}  # an upstream difference beyond the tolerance
    r = _record(mul, ours, ours["a"] * b, {"a": a, "b": b}, a * b)
    assert r["upstream_differs"] and r["own_inputs_agree"] and r["ort_own_inputs_agree"]
    assert r["amplification"] < fuzz_triage.AMPLIFIED
    assert fuzz_triage.classify(r) is None


def test_a_nan_on_one_side_only_is_never_agreement():
    # _agrees once let a spurious NaN of luisaml's "agree" with any reference value
    assert fuzz._agrees(np.array([np.nan], np.float32), np.array([0.0], np.float32)) is False
    assert fuzz._agrees(np.array([0.0], np.float32), np.array([np.nan], np.float32)) is False
    assert fuzz._agrees(np.array([np.nan, 1.0], np.float32), np.array([np.nan, 1.0], np.float32)) is True


def test_a_spurious_nan_of_a_division_by_infinity_is_untriaged():
    # fuzz graph 11:130: y / ReduceL2(x) with x = -inf is 0, luisaml's fused kernel gave NaN
    div = helper.make_node("Div", ["y", "r"], ["d"])
    ins = {"y": np.array([1.267378], np.float32), "r": np.array([np.inf], np.float32)}
    r = _record(div, ins, np.array([np.nan], np.float32), ins, np.array([0.0], np.float32), kind="spurious_nan")
    r["fused_only"] = True
    assert r["own_inputs_agree"] is False and r["input_special"]
    assert fuzz_triage.classify(r) is None
    # were luisaml to follow onnx.reference where onnxruntime does not, the existing class would take it
    r2 = dict(r, reference_agrees=True)
    assert fuzz_triage.classify(r2) == "onnxruntime_differs_from_reference"


# ---- the two graphs of the seed-11 run, localised as the fuzz does (CPU backend) -----------------------


def _localised(seed: int, index: int):
    import os

    import luisaml.device

    luisaml.device.init(os.environ.get("LUISAML_BACKEND") or "cpu")
    g, why = fuzz.valid_graph(seed, index)
    assert g is not None, why
    n = max(fuzz.batch_size(seed, index - index % fuzz.BATCH), 1)
    model, feeds = fuzz.to_model([g], n)
    import luisaml

    d = fuzz.difference(luisaml.compile(model).run(feeds), fuzz.ort_run(model, feeds), g.outputs)
    return d, (fuzz.localise(g, n) if d else None)


def test_fuzz_graph_11_87_is_classified_ill_conditioned():
    d, info = _localised(11, 87)
    if d is None:
        pytest.skip("graph 11:87 matches onnxruntime now")
    assert info["culprit"] == "Cos" and info["upstream_differs"] and info["own_inputs_agree"], info
    assert fuzz_triage.classify(info) == "ill_conditioned_after_upstream_rounding", info


def test_fuzz_graph_11_130_matches_or_stays_untriaged():
    """Div(y, ReduceL2(x)) with x = -inf: onnxruntime and onnx.reference give 0; luisaml gave NaN when
    ReduceL2 was inlined into the Div (a reciprocal square root with a Newton step), fixed by
    math_lib.sqrt_f32. Should it differ again, it is a bug: untriaged, localised to the Div."""
    d, info = _localised(11, 130)
    if d is None:
        return  # matches onnxruntime (the fix)
    assert info["culprit"] == "Div" and info.get("fused_only") and info["reference_agrees"] is False, info
    assert fuzz_triage.classify(info) is None, info


def test_a_node_wrong_only_as_the_sole_output_is_localised_and_untriaged(monkeypatch):
    """localise's second pass: every node agrees with all intermediates exposed, yet one differs as the
    graph's only output (what a fused or inlined kernel does wrong). A compile that adds 1 to a lone
    float output stands in for such a bug."""
    import os

    import luisaml
    import luisaml.device

    luisaml.device.init(os.environ.get("LUISAML_BACKEND") or "cpu")
    g = next(g for g in (fuzz.valid_graph(0, i)[0] for i in range(40))
             if g is not None and len(g.nodes) >= 2 and all(len(n.output) == 1 for n in g.nodes))
    compile_ = luisaml.compile

    class Wrong:
        def __init__(self, net, name):
            self.net, self.name = net, name

        def run(self, feeds):
            out = self.net.run(feeds)
            v = np.asarray(out[self.name])
            if v.dtype.kind == "f":
                out[self.name] = v + np.float32(1)
            return out

    def compile_wrong(model, *a, **k):
        net = compile_(model, *a, **k)
        return Wrong(net, model.graph.output[0].name) if len(model.graph.output) == 1 else net

    n = 2
    want = fuzz.ort_run(*fuzz.to_model([g], n, intermediates=True))
    first_float = next((nd.name for nd in g.nodes if want[nd.output[0]].dtype.kind == "f"), None)
    assert first_float is not None, "the chosen graph has no float node output"
    monkeypatch.setattr(luisaml, "compile", compile_wrong)
    info = fuzz.localise(g, n)
    assert info.get("fused_only") and info["culprit_node"] == first_float, info
    assert info["own_inputs_agree"] is False, info
    assert fuzz_triage.classify(info) is None, info


# ---- a max pool over -inf only (fuzz graph 22:48: Conv of infinities -> GlobalMaxPool) ----------------------

GMP = helper.make_node("GlobalMaxPool", ["x"], ["y"])
X_INF = np.array([[[-np.inf, -np.inf, -np.inf], [1.0, np.inf, -np.inf]]], np.float32)


def test_a_max_pool_over_negative_infinity_only_is_known():
    ours = X_INF.max(axis=2, keepdims=True)  # -inf for the first channel
    theirs = np.where(np.isneginf(ours), np.float32(-3.4028234663852886e+38), ours)  # onnxruntime's -FLT_MAX
    kind, detail = fuzz.difference({"y": ours}, {"y": theirs}, ["y"])[:2]
    assert kind == "inf"
    r = _record(GMP, {"x": X_INF}, ours, {"x": X_INF}, theirs, kind=kind)
    r["detail"] = detail
    assert fuzz_triage.classify(r) == "maxpool_all_negative_infinity"


def test_a_max_pool_wrong_elsewhere_is_not_that_class():
    ours = X_INF.max(axis=2, keepdims=True)
    theirs = ours.copy()
    theirs[0, 1, 0] = -np.inf  # a window with finite values: no excuse
    kind, detail = fuzz.difference({"y": ours}, {"y": theirs}, ["y"])[:2]
    r = _record(GMP, {"x": X_INF}, ours, {"x": X_INF}, theirs, kind=kind)
    r["detail"] = detail
    assert fuzz_triage.classify(r) != "maxpool_all_negative_infinity"
