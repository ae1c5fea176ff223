"""The exporter's layout nodes around a recurrent node folded into its stages (luisaml/rewrites/rnn.py):
torch's batch_first GRU / LSTM (one direction and both) run as the projection reading x and the steps
writing y, against torch, through net.run and through `forward` in a user kernel; a Y with two readers
and a chain that is not a permutation of Y's axes stay unfolded, against onnxruntime."""

import luisa
import numpy as np
import pytest
from onnx import helper

from test_rnn import case
from util import export_torch, graph_model, ort_run, torch_rnn

import luisaml

torch = pytest.importorskip("torch")


def _export(cell: str, bidirectional: bool, x, tmp_path):
    module = torch_rnn(cell, x.shape[2], bidirectional=bidirectional)
    path = export_torch(module, x, tmp_path / "rnn.onnx")
    with torch.no_grad():
        return path, module(x).numpy()


def _kinds(net):
    return [st.root[0].op_type for st in net.plan.schedule.stages]


@pytest.mark.parametrize("cell,bidirectional", [("GRU", False), ("LSTM", False), ("LSTM", True), ("GRU", True)])
def test_batch_first_folds(cell, bidirectional, tmp_path):
    x = torch.randn(3, 5, 6)
    path, want = _export(cell, bidirectional, x, tmp_path)
    net = luisaml.compile(str(path))
    assert _kinds(net) == ["RecurrentProjection", f"{cell}Steps"]  # no Transpose stage before or after
    proj = net.plan.schedule.stages[0].root[1]
    assert proj.input(0).name == "x" and proj.swapped
    np.testing.assert_allclose(np.asarray(net.run({"x": x.numpy()})["y"]), want, rtol=1e-5, atol=1e-5)


forward = X = Y = None


@luisa.func
def _user_kernel(xs, ys, weights):
    x = X()
    for k in range(90):
        x[k] = xs.read(k)
    y = Y()
    forward(x, y, weights)
    for k in range(240):
        ys.write(k, y[k])


def test_forward_stores_where_the_chain_puts_y(tmp_path):
    """`forward` (the whole form) of the folded network writes y in y's layout, as the stages do."""
    x = torch.randn(3, 5, 6)
    path, want = _export("LSTM", True, x, tmp_path)  # y: [3, 5, 16]
    net = luisaml.compile(str(path))
    assert _kinds(net) == ["RecurrentProjection", "LSTMSteps"]
    global forward, X, Y
    forward, X, Y = net.forward, net.input_type("x"), net.output_type("y")
    bx, by = luisa.Buffer.from_array(x.numpy().reshape(-1)), luisa.Buffer(240, float)
    _user_kernel(bx, by, net.weights, dispatch_size=1)
    got = np.empty(240, np.float32)
    by.copy_to(got, sync=True)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5)


def _with_after(after, outputs, op="GRU"):
    node, feeds = case(op, 0, S=4, B=3, I=5, H=8, use=("B",), outputs=("Y",))
    return graph_model([node] + after, feeds, opset=17, outputs=outputs), feeds


def test_unfolded_chains():
    """Y read twice (a Transpose and a Relu), and a chain whose order is no permutation of Y's axes (a
    Reshape splitting the units, a Transpose interleaving their halves): both keep their nodes."""
    model, feeds = _with_after([helper.make_node("Transpose", ["Y0"], ["t"], perm=[2, 0, 1, 3]),
                                helper.make_node("Relu", ["Y0"], ["r"])], ["t", "r"])
    net = luisaml.compile(model, batch_axis=None)
    assert "Transpose" in _kinds(net)
    for name, w in ort_run(model, feeds).items():
        np.testing.assert_allclose(net.run(feeds)[name], w, rtol=1e-5, atol=1e-5, err_msg=name)
    # [4, 1, 3, 8] -> [4, 3, 2, 4] -> the unit's two halves interleaved: no stride per axis of Y
    model, feeds = _with_after([helper.make_node("Reshape", ["Y0", "shape"], ["rs"]),
                                helper.make_node("Transpose", ["rs"], ["z"], perm=[0, 1, 3, 2])], ["z"])
    model.graph.initializer.append(helper.make_tensor("shape", 7, [4], [4, 3, 2, 4]))
    net = luisaml.compile(model, batch_axis=None)
    assert "Transpose" in _kinds(net)
    for name, w in ort_run(model, feeds).items():
        np.testing.assert_allclose(net.run(feeds)[name], w, rtol=1e-5, atol=1e-5, err_msg=name)
