"""compile(tune=...) on the CUDA backend (luisaml/tune.py): the cooperative blocks stages of a Gemm
and a direct Conv searched over operators/tiled.py's candidates, against onnxruntime. With "full"
every candidate tiling (16 a kernel shape, most of them tilings the rules never pick) is built and
checked against the rules' output: none may be rejected (a rejection here is an emitter bug, which
the search would otherwise hide by keeping the rules' tile). A second compile measures nothing, and
a tiling forced as the choice (the last candidate timed fastest) runs and matches onnxruntime.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_tune_cuda.py -q"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from util import conv_relu, cuda_only, float_model, ort_run, tuning_root  # noqa: F401 (tuning_root: a fixture)

import luisaml
from luisaml import tune

pytestmark = cuda_only()

RTOL = 2e-5


def _model():
    """Conv 3x3 (32 -> 64 channels, 32x32) -> Relu over a batch, and a Gemm (300 x 96 by 96 x 200)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 32, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    g = (rng.standard_normal((96, 200)) * 0.1).astype(np.float32)
    nodes = conv_relu("y") + [helper.make_node("Gemm", ["a", "g"], ["z"], name="gemm")]
    return float_model(nodes, {"x": [4, 32, 32, 32], "a": [300, 96]}, {"y": [4, 64, 32, 32], "z": [300, 200]},
                       {"w": w, "b": b, "g": g})


def _check(net, model):
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 32, 32, 32)).astype(np.float32),
             "a": rng.standard_normal((300, 96)).astype(np.float32)}
    got, want = net.run(feeds), ort_run(model, feeds)
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=RTOL, atol=RTOL * float(np.abs(w).max()), err_msg=k)


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_every_blocks_candidate_matches_and_the_second_compile_measures_nothing(tuning_root, mode):
    model = _model()
    net = luisaml.compile(model, backend="cuda", batch_axis=None, winograd=False, tune=mode)
    assert [st.domain for st in net.plan.schedule.stages].count("blocks") == 2
    rec = net.plan.tuning
    assert rec.measured == 2 and {t.node for t in rec.nodes} == {"conv", "gemm"}
    assert all(t.form == "blocks" and t.rejected == 0 for t in rec.nodes), [t.describe() for t in rec.nodes]
    most = 4 if mode == "fast" else 16
    assert all(2 <= t.candidates <= most for t in rec.nodes), [t.describe() for t in rec.nodes]
    _check(net, model)
    again = luisaml.compile(model, backend="cuda", batch_axis=None, winograd=False, tune=mode)
    assert again.plan.tuning.measured == 0
    _check(again, model)


def test_a_forced_tiling_runs_and_matches(tuning_root, monkeypatch):
    measure = tune.measure_job

    def last_fastest(job, plan, opts, batch, make_network, mode):
        times, rejected = measure(job, plan, opts, batch, make_network, mode)
        assert not rejected
        return [1.0] * (len(times) - 1) + [0.5], rejected

    monkeypatch.setattr(tune, "measure_job", last_fastest)
    model = _model()
    net = luisaml.compile(model, backend="cuda", batch_axis=None, winograd=False, tune="full")
    assert all(t.choice != t.rule for t in net.plan.tuning.nodes)
    assert all("(tuned)" in op.describe_block() for node, op in net.plan.ops if node.name in ("conv", "gemm"))
    _check(net, model)
