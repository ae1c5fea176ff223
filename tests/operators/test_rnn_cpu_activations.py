"""The recurrent steps' float4 activations (operators/rnn_stages.py: tanh as a rational function,
sigmoid through it, NaN kept) against onnxruntime: RNN, GRU (both linear_before_reset) and LSTM with
constant weights and 8 units (the float4 path), on X with NaN, +inf, -inf and pre-activations far
past the rational's range, and on plain random data over both directions; the LSTM's gemv in two
passes of two gates (rnn_step.Step.gate_passes, 3 rows or more a thread) with every optional input;
its activations as a loop over each row's units (Step.gate_loop) bit-identical to the float4 form."""

import numpy as np
from onnx import helper

from test_nan import TOL, assert_all_match_ort
from test_rnn import case, merge
from util import graph_model, switched

import luisaml

NAN, INF = float("nan"), float("inf")
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _model(x, cells, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    I, H = x.shape[2], 8
    nodes, inits = [], {}
    for k, (op, attrs) in enumerate(cells):
        g = GATES[op]
        inits[f"w{k}"] = (scale * rng.uniform(-1, 1, (1, g * H, I))).astype(np.float32)
        inits[f"r{k}"] = rng.uniform(-0.7, 0.7, (1, g * H, H)).astype(np.float32)
        outs = [f"y{k}", f"h{k}"] + ([f"c{k}"] if op == "LSTM" else [])
        nodes.append(helper.make_node(op, ["x", f"w{k}", f"r{k}"], outs, name=outs[0], hidden_size=H, **attrs))
    return graph_model(nodes, {"x": x}, inits, opset=22)


CELLS = [("RNN", {}), ("GRU", {}), ("GRU", {"linear_before_reset": 1}), ("LSTM", {})]


def test_nan_inf_and_saturation():
    x = np.random.default_rng(3).uniform(-1, 1, (5, 4, 3)).astype(np.float32)
    x[1, 0, 0], x[0, 1, 1], x[2, 2, 2] = NAN, INF, -INF
    model = _model(x, CELLS)
    net = luisaml.compile(model, batch_axis=None)
    assert "isnan(" in net.plan.source  # the float4 path ran
    assert_all_match_ort(model, {"x": x}, TOL[np.float32])
    # weights 40x: pre-activations of +-100 and more, where tanh and sigmoid saturate
    x = np.random.default_rng(4).uniform(-1, 1, (5, 4, 3)).astype(np.float32)
    assert_all_match_ort(_model(x, CELLS, seed=1, scale=40.0), {"x": x}, TOL[np.float32])


def test_bidirectional_random():
    nodes, feeds = merge(*(case(op, k, S=6, B=5, I=7, H=8, direction="bidirectional", use=("B", "initial_h"), seed=k)
                           for k, op in enumerate(("GRU", "LSTM", "RNN"))))
    inits = {k: v for k, v in feeds.items() if k[0] in "WRB"}
    feeds = {k: v for k, v in feeds.items() if k not in inits}
    model = graph_model(nodes, feeds, inits, opset=22)
    assert "isnan(" in luisaml.compile(model, batch_axis=None).plan.source
    assert_all_match_ort(model, feeds, TOL[np.float32])


def test_lstm_gate_passes_every_input():
    # 6 rows: a row group of 4 and a ragged one of 2 (clamped rows); 12 units: 3 float4s a row; both
    # directions, sequence lengths 1..5, initial states, biases and peepholes, every output
    node, feeds = case("LSTM", 0, S=5, B=6, I=7, H=12, direction="bidirectional",
                       use=("B", "sequence_lens", "initial_h", "initial_c", "P"), seed=11)
    inits = {k: v for k, v in feeds.items() if k[0] in "WRBP" and not k.startswith("sequence")}
    feeds = {k: v for k, v in feeds.items() if k not in inits}
    model = graph_model([node], feeds, inits, opset=22)
    from luisaml.operators import rnn_step

    passes, loops = [], []
    weights = rnn_step.Step.weights

    def spy(self):
        weights(self)
        if len(self.units) > 1:  # the gemv's tiles (gate_acts' steps are one unit each)
            passes.append(self.gate_passes)
            loops.append(rnn_step.GATE_LOOP and self.quads)

    rnn_step.Step.weights = spy
    try:
        net = luisaml.compile(model, batch_axis=None)
    finally:
        rnn_step.Step.weights = weights
    assert passes and all(passes) and all(loops)  # the two-pass gemv ran, the activations a loop over units
    assert "isnan(" in net.plan.source
    assert_all_match_ort(model, feeds, TOL[np.float32])


def test_lstm_gate_loop_bit_identical():
    # the activations a loop over each row's units (rnn_step.GATE_LOOP) against the float4 tile's:
    # the same operations a lane in the same order, every output equal bit for bit (ragged rows,
    # sequence lengths, peepholes, initial states; input_forget; batch first)
    from luisaml.operators import rnn_step

    for attrs in ({}, {"input_forget": 1}, {"layout": 1}):
        node, feeds = case("LSTM", 0, S=5, B=6, I=7, H=12, direction="bidirectional",
                           use=("B", "sequence_lens", "initial_h", "initial_c", "P"), seed=5, **attrs)
        inits = {k: v for k, v in feeds.items() if k[0] in "WRBP" and not k.startswith("sequence")}
        feeds = {k: v for k, v in feeds.items() if k not in inits}
        model = graph_model([node], feeds, inits, opset=22)
        outs = {}
        for on in (False, True):
            with switched(rnn_step, GATE_LOOP=on):
                outs[on] = luisaml.compile(model, batch_axis=None).run(feeds)
        assert outs[True].keys() == outs[False].keys()
        for k in outs[False]:
            assert np.array_equal(outs[True][k], outs[False][k], equal_nan=True), k
