"""RNN, GRU and LSTM against onnxruntime on random data: forward, reverse and bidirectional with
sequence_lens and initial states, peepholes, clip, input_forget, linear_before_reset, every
activation with alpha/beta, half, opset 7, layout 1 (onnxruntime has only layout 0: its
reference is the layout-0 model on transposed data) and per-sample execution with layout 1."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from util import assert_matches_ort, graph_model, ort_run, rand, value_info

import luisaml

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
ROLES = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
STATE = ("initial_h", "initial_c")


def case(op, k, S=4, B=3, I=5, H=6, direction="forward", layout=0, use=(), seed=0, outputs=("Y", "Y_h", "Y_c"), **attrs):
    """Return (node, feeds): op node k on random X, W, R and the optional inputs in `use`."""
    D = 2 if direction == "bidirectional" else 1
    G = GATES[op]
    state = (D, B, H) if layout == 0 else (B, D, H)
    arrays = {
        "X": rand((S, B, I) if layout == 0 else (B, S, I), seed=seed),
        "W": rand((D, G * H, I), seed=seed + 1, low=-1, high=1),
        "R": rand((D, G * H, H), seed=seed + 2, low=-0.7, high=0.7),
        "B": rand((D, 2 * G * H), seed=seed + 3),
        # every length from 1 to S occurs (and S itself)
        "sequence_lens": (S - np.arange(B) % S).astype(np.int32),
        "initial_h": rand(state, seed=seed + 4),
        "initial_c": rand(state, seed=seed + 5),
        "P": rand((D, 3 * H), seed=seed + 6),
    }
    roles = ROLES[:8] if op == "LSTM" else ROLES[:6]
    names = [f"{role}{k}" if role in ("X", "W", "R") or role in use else "" for role in roles]
    while names[-1] == "":
        names.pop()
    outs = [f"{o}{k}" if o else "" for o in (outputs if op == "LSTM" else outputs[:2])]
    node = helper.make_node(op, names, outs, name=f"{op}_{k}", hidden_size=H, direction=direction, **attrs)
    if layout:
        node.attribute.append(helper.make_attribute("layout", layout))
    return node, {n: arrays[n[:-len(str(k))]] for n in names if n}


def as_layout0(nodes, feeds):
    """Return (nodes, feeds) of the same computation in layout 0 (what onnxruntime runs)."""
    out = []
    for node in nodes:
        n = helper.make_node(node.op_type, node.input, node.output, name=node.name)
        n.attribute.extend(a for a in node.attribute if a.name != "layout")
        out.append(n)
    moved = {n for node in nodes for n in (list(node.input[:1]) + list(node.input[5:7]))}
    return out, {k: (v.swapaxes(0, 1).copy() if k in moved else v) for k, v in feeds.items()}


def from_layout0(name: str, v: np.ndarray) -> np.ndarray:
    """Return a layout-0 output (Y [S, D, B, H] or a state [D, B, H]) in layout 1."""
    return v.transpose(2, 0, 1, 3) if v.ndim == 4 else v.swapaxes(0, 1)


def assert_layout1_matches(nodes, feeds, opset=22, rtol=1e-5, atol=1e-6, batch=None, run_feeds=None, **compile_kw):
    """Compile the layout-1 nodes, run, and compare with onnxruntime on the layout-0 model."""
    m = graph_model(nodes, feeds, opset=opset, batch=batch)
    net = luisaml.compile(m, **compile_kw)
    for f in run_feeds or [feeds]:
        got = net.run(f)
        nodes0, f0 = as_layout0(nodes, f)
        want = ort_run(graph_model(nodes0, f0, opset=opset), f0)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], from_layout0(name, w), rtol=rtol, atol=atol, err_msg=name)
    return net


def merge(*cases):
    nodes, feeds = [], {}
    for node, f in cases:
        nodes.append(node)
        feeds.update(f)
    return nodes, feeds


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_directions(op):
    """Forward with every optional input (LSTM: peepholes), reverse with sequence lengths (padding
    steps give zeros, the state stops at the last valid step), bidirectional with initial states,
    and one with no optional input at all."""
    every = ("B", "sequence_lens", "initial_h", "initial_c", "P")
    nodes, feeds = merge(
        case(op, 0, use=every, seed=1),
        case(op, 1, direction="reverse", use=("B", "sequence_lens"), seed=2),
        case(op, 2, direction="bidirectional", use=every, seed=3),
        case(op, 3, S=2, B=1, I=3, H=4, direction="bidirectional", seed=4),
    )
    assert_matches_ort(graph_model(nodes, feeds, opset=22), feeds, batch_axis=None)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_layout1(op):
    """layout 1 ([batch, seq, ...]): bidirectional with sequence lengths and initial states."""
    every = ("B", "sequence_lens", "initial_h", "initial_c", "P")
    nodes, feeds = merge(case(op, 0, layout=1, direction="bidirectional", use=every, seed=5),
                         case(op, 1, layout=1, direction="reverse", use=("B",), seed=6, outputs=("", "Y_h", "Y_c")))
    assert_layout1_matches(nodes, feeds, batch_axis=None)


def test_activations():
    """Every activation of the attribute, with alpha/beta consumed in order by the activations that
    take them (defaults where the list runs out), and clip on the gates' inputs."""
    nodes, feeds = merge(
        case("RNN", 0, direction="bidirectional", use=("B",), activations=["LeakyRelu", "ThresholdedRelu"], activation_alpha=[0.3, 0.25]),
        case("RNN", 1, use=("B",), activations=["Elu"]),
        case("RNN", 2, use=("B", "initial_h"), activations=["Softplus"], clip=0.8),
        case("GRU", 3, direction="bidirectional", use=("B",), activations=["HardSigmoid", "ScaledTanh", "Sigmoid", "Softsign"],
             activation_alpha=[0.3, 0.8], activation_beta=[0.45, 1.3]),
        case("GRU", 4, use=("B",), activations=["Affine", "Relu"], activation_alpha=[0.4], activation_beta=[0.3], clip=1.5),
        case("LSTM", 5, use=("B", "P", "initial_c"), activations=["HardSigmoid", "Elu", "ScaledTanh"], activation_alpha=[0.25, 0.6, 0.9],
             activation_beta=[0.4, 1.1]),
        case("LSTM", 6, direction="bidirectional", use=("B", "P"), clip=0.5,
             activations=["Sigmoid", "Tanh", "Softsign", "Sigmoid", "LeakyRelu", "Tanh"]),
    )
    assert_matches_ort(graph_model(nodes, feeds, opset=22), feeds, batch_axis=None, rtol=1e-5, atol=1e-5)


def numpy_rnn(x, w, r, b, f):
    """Return Y of a forward RNN (layout 0, zero initial state) with activation f, in float64."""
    h = np.zeros((x.shape[1], r.shape[-1]))
    ys = []
    for xt in x.astype(np.float64):
        h = f(xt @ w[0].T + h @ r[0].T + b[0, : r.shape[-1]] + b[0, r.shape[-1]:])
        ys.append(h)
    return np.stack(ys)[:, None]


def test_activation_defaults():
    """Activations without alpha/beta take the defaults of the ONNX operators of that name, as the
    specification says (onnxruntime's ThresholdedRelu and Affine default to 0): against numpy."""
    defaults = {
        "LeakyRelu": lambda v: np.where(v >= 0, v, 0.01 * v),
        "ThresholdedRelu": lambda v: np.where(v > 1.0, v, 0.0),
        "HardSigmoid": lambda v: np.clip(0.2 * v + 0.5, 0, 1),
        "Elu": lambda v: np.where(v >= 0, v, np.exp(v) - 1),
        "Affine": lambda v: v,
    }
    nodes, feeds = merge(*(case("RNN", k, use=("B",), seed=k, activations=[name]) for k, name in enumerate(defaults)))
    got = luisaml.compile(graph_model(nodes, feeds, opset=22), batch_axis=None).run(feeds)
    for k, f in enumerate(defaults.values()):
        want = numpy_rnn(feeds[f"X{k}"], feeds[f"W{k}"], feeds[f"R{k}"], feeds[f"B{k}"], f)
        np.testing.assert_allclose(got[f"Y{k}"], want, rtol=1e-5, atol=1e-6, err_msg=list(defaults)[k])


def test_gru_linear_before_reset_and_lstm_input_forget():
    every = ("B", "sequence_lens", "initial_h", "initial_c", "P")
    nodes, feeds = merge(
        case("GRU", 0, direction="bidirectional", use=every, linear_before_reset=1),
        case("GRU", 1, use=("B",), linear_before_reset=1, clip=0.6),
        case("LSTM", 2, direction="bidirectional", use=every, input_forget=1),
        case("LSTM", 3, use=("B", "P"), input_forget=1, clip=0.7),
    )
    assert_matches_ort(graph_model(nodes, feeds, opset=22), feeds, batch_axis=None)


def test_half():
    """float16 data, computed in float: against onnxruntime on the same values in float."""
    nodes, feeds = merge(case("GRU", 0, use=("B", "initial_h")), case("LSTM", 1, direction="bidirectional", use=("B", "P")))
    half = {k: v.astype(np.float16) for k, v in feeds.items()}
    got = luisaml.compile(graph_model(nodes, half, opset=22), batch_axis=None).run(half)
    want = ort_run(graph_model(nodes, feeds, opset=22), {k: v.astype(np.float32) for k, v in half.items()})
    for name, w in want.items():
        assert got[name].dtype == np.float16
        np.testing.assert_allclose(got[name].astype(np.float32), w, rtol=2e-3, atol=2e-3, err_msg=name)


@pytest.mark.parametrize("upgrade", [True, False])
def test_opset7(upgrade, monkeypatch):
    """An opset-7 model, upgraded on loading or compiled as it is."""
    if not upgrade:
        import luisaml.passes.upgrade as up

        monkeypatch.setattr(up, "MIN_OPSET", 0)
    nodes, feeds = merge(case("LSTM", 0, direction="bidirectional", use=("B", "sequence_lens", "P")),
                         case("GRU", 1, direction="reverse", use=("B", "initial_h")))
    m = graph_model(nodes, feeds, opset=7)
    net, _ = assert_matches_ort(m, feeds, batch_axis=None)
    assert net.plan.model.opset("") == (17 if upgrade else 7)


def test_per_sample_layout1():
    """One thread per batch row: layout 1 puts the batch on axis 0 of X, the states and
    sequence_lens; W, R, B are shared initializers."""
    node, f = case("LSTM", 0, S=5, B=2, layout=1, direction="bidirectional", use=("B", "sequence_lens", "initial_h", "initial_c", "P"))
    gru, g = case("GRU", 1, S=5, B=2, I=5, layout=1, use=("B", "initial_h"), seed=7)
    gru.input[0] = node.input[0]  # both read the same X
    g.pop("X1")
    shared = ("W0", "R0", "B0", "P0", "W1", "R1", "B1")
    inits = {k: v for k, v in {**f, **g}.items() if k in shared}
    feeds = {k: v for k, v in {**f, **g}.items() if k not in shared}

    def sample_feeds(n, seed):
        out = {}
        for k, v in feeds.items():
            shape = (n,) + v.shape[1:]
            out[k] = (np.arange(n, dtype=np.int32) % 5 + 1) if k.startswith("sequence_lens") else rand(shape, seed=seed + len(out))
        return out

    m = graph_model([node, gru], feeds, inits, opset=22, batch="N")
    net = luisaml.compile(m)
    assert net.batch_symbol == "N"
    for n in (1, 4):
        fn = sample_feeds(n, 10 * n)
        got = net.run(fn)
        nodes0, f0 = as_layout0([node, gru], {**fn, **inits})
        want = ort_run(graph_model(nodes0, f0, opset=22), f0)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], from_layout0(name, w), rtol=1e-5, atol=1e-6, err_msg=name)


def test_layout0_per_sample_is_an_error():
    """Layout 0 with a symbolic first dimension: per-sample execution would split the sequence."""
    node, f = case("RNN", 0, outputs=("Y",))
    x = helper.make_tensor_value_info("X0", TensorProto.FLOAT, ["T", 3, 5])
    ins = [x] + [value_info(k, v.dtype, v.shape) for k, v in f.items() if k != "X0"]
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("Y0", TensorProto.FLOAT, ["T", 1, 3, 6])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    with pytest.raises(luisaml.CompileError, match=r"node 'RNN_0' \(RNN\): X 'X0': with layout 0 its axis 0 is the sequence"):
        luisaml.compile(m)


@pytest.mark.parametrize(
    "attrs,message",
    [
        ({"activations": ["Tanh", "Swish"]}, r"activation 'Swish' is not one of affine, elu"),
        ({"activations": ["Tanh"]}, r"activations \['Tanh'\]: expected 2 \(1 per direction, 2 direction\(s\)\)"),
        ({"direction": "sideways"}, "direction 'sideways' is not forward, reverse or bidirectional"),
        ({"hidden_size": 5}, r"W 'W0' has shape \[2, 6, 5\], expected \[2, 5, 5\]"),
        ({"activations": ["ScaledTanh", "Tanh"]}, "activation 'ScaledTanh' needs values in activation_alpha and activation_beta"),
    ],
)
def test_errors(attrs, message):
    attrs = {"direction": "bidirectional", **attrs}
    node, f = case("RNN", 0, **{k: v for k, v in attrs.items() if k == "direction"})
    node = helper.make_node("RNN", node.input, ["Y0"], name="RNN_0", **{"hidden_size": 6, **attrs})
    ys = [helper.make_tensor_value_info("Y0", TensorProto.FLOAT, [4, 2, 3, 6])]
    graph = helper.make_graph([node], "g", [value_info(k, v.dtype, v.shape) for k, v in f.items()], ys)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    with pytest.raises(luisaml.CompileError, match=r"node 'RNN_0' \(RNN\): " + message):
        luisaml.compile(m, batch_axis=None)


def test_softplus_activation_keeps_its_relative_accuracy():
    """An RNN step with a Softplus activation on pre-activations from -40 to -17, where log(1 + e^x)
    in float32 is 0: held relatively to numpy's float64 softplus, as the Softplus operator is."""
    H, I = 6, 1
    x = np.ones((1, 1, I), np.float32)  # one step, one sample, one input feature
    w = np.linspace(-40, -17, H, dtype=np.float32).reshape(1, H, I)
    r = np.zeros((1, H, H), np.float32)
    node = helper.make_node("RNN", ["X", "W", "R"], ["Y"], hidden_size=H, activations=["Softplus"])
    model = graph_model([node], {"X": x}, {"W": w, "R": r}, opset=14)
    got = luisaml.compile(model, batch_axis=None).run({"X": x})["Y"].reshape(-1)
    want = np.logaddexp(0.0, w.reshape(-1).astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=0)
