"""Winograd convolution (operators/winograd.py) against onnxruntime on the CPU backend, where
`winograd=` forces the form CUDA takes by default: F(2x2) and F(4x4), outputs that are not whole
tiles, pads of 1, none or uneven, with and without bias, BatchNorm folded, the residual Add and
Relu as the output stage's epilogue, per sample and at a fixed batch; and the rule of which Conv
nodes take it. The transforms are also checked against a float64 direct convolution in numpy.

The form rounds more than the direct sum (its transforms' coefficients reach 8 for F(4x4)): the
tolerance is the error measured in float32 numpy for these shapes, ~2e-6 of the output's largest
value per layer for m = 4 (tests of the direct form keep 1e-5 / 1e-6)."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from util import ort_run

import luisaml
from luisaml.operators import winograd
from luisaml.runtime import analyze

TOL = {2: 1e-5, 4: 3e-5}  # of max |y|: float32 rounding of the transforms, with margin


def _model(C, K, H, W, pads=(1, 1, 1, 1), bias=True, residual=True, batch="N", n=2, seed=0, stride=1):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, C, 3, 3)) * np.sqrt(2 / (9 * C))).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(K).astype(np.float32), "b"))
        ins.append("b")
    nodes = [helper.make_node("Conv", ins, ["c"], kernel_shape=[3, 3], pads=list(pads),
                              strides=[stride, stride], name="conv")]
    ho, wo = (H + pads[0] + pads[2] - 3) // stride + 1, (W + pads[1] + pads[3] - 3) // stride + 1
    out = "c"
    if residual:  # Relu(conv + r): the output stage's epilogue
        nodes += [helper.make_node("Add", ["c", "r"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
        out = "y"
    graph_in = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, C, H, W])]
    if residual:
        graph_in.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [batch, K, ho, wo]))
    g = helper.make_graph(nodes, "wino", graph_in, [helper.make_tensor_value_info(out, TensorProto.FLOAT, [batch, K, ho, wo])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    feeds = {"x": rng.standard_normal((n, C, H, W)).astype(np.float32)}
    if residual:
        feeds["r"] = rng.standard_normal((n, K, ho, wo)).astype(np.float32)
    return m, feeds, out


def _check(model, feeds, out, m, **kw):
    net = luisaml.compile(model, backend="cpu", winograd=m, **kw)
    assert net.plan.winograd == ["conv"], net.plan.winograd
    types = [n.op_type for n, _ in net.plan.ops]
    assert {"WinogradInput", "WinogradProduct", "WinogradOutput"} <= set(types), types
    got = net.run(feeds)[out]
    want = ort_run(model, feeds)[out]
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[m] * scale)
    return net


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("C,K,H,W,pads", [
    (16, 16, 8, 8, (1, 1, 1, 1)),  # whole tiles
    (16, 24, 7, 10, (1, 1, 1, 1)),  # ragged tiles both ways (ResNet's 7 x 7)
    (20, 16, 9, 6, (0, 0, 0, 0)),  # no padding
    (16, 16, 6, 9, (2, 0, 1, 1)),  # uneven pads
    (17, 33, 1, 1, (1, 1, 1, 1)),  # one output, most of the patch padding; odd channel counts
    (16, 16, 3, 2, (0, 1, 0, 1)),  # one output row: the tile mostly past the output
])
def test_matches_onnxruntime(m, C, K, H, W, pads):
    model, feeds, out = _model(C, K, H, W, pads)
    _check(model, feeds, out, m)


def test_no_bias_no_epilogue_fixed_batch():
    model, feeds, out = _model(16, 16, 10, 10, bias=False, residual=False, batch=3, n=3)
    _check(model, feeds, out, 4, batch_axis=None)


def test_epilogue_is_fused():
    """The residual Add and Relu run in the output stage's store, not stages of their own."""
    model, feeds, out = _model(16, 16, 8, 8)
    net = _check(model, feeds, out, 4)
    stages = net.plan.schedule.stages
    assert len(stages) == 3, [s.describe() for s in stages]
    assert [n.op_type for n, _ in stages[2].epilogue] == ["Add", "Relu"]


def test_which_convs():
    """Only 3x3, stride 1, one group, 16+ channels; CPU 'auto' keeps the direct form."""
    model, _, _ = _model(16, 16, 8, 8)
    assert analyze(model, target="cpu").winograd == []
    assert analyze(model, target="cuda").winograd == ["conv"]
    assert analyze(model, target="cuda", winograd=False).winograd == []
    small, _, _ = _model(8, 16, 8, 8)
    assert analyze(small, target="cuda").winograd == []
    strided, _, _ = _model(16, 16, 8, 8, stride=2)
    assert analyze(strided, target="cuda").winograd == []
    with pytest.raises(luisaml.UsageError, match="winograd"):
        analyze(model, target="cuda", winograd=3)


@pytest.mark.parametrize("m", [2, 4])
def test_transforms_exact(m):
    """A^T [(G g G^T) * (B^T d B)] A equals the direct 3x3 correlation of a patch (float64)."""
    bt, g, at = winograd.transforms(m)
    rng = np.random.default_rng(m)
    d, k = rng.standard_normal((m + 2, m + 2)), rng.standard_normal((3, 3))
    y = at @ ((g @ k @ g.T) * (bt @ d @ bt.T)) @ at.T
    direct = np.array([[np.sum(d[i:i + 3, j:j + 3] * k) for j in range(m)] for i in range(m)])
    np.testing.assert_allclose(y, direct, rtol=1e-12, atol=1e-12)


forward = X = Y = None


def _user_kernel():
    import luisa

    @luisa.func
    def user_kernel(xs, ys, weights):  # one sample a thread through the network's `forward`
        i = dispatch_id().x
        x = X()
        for k in range(16 * 6 * 6):
            x[k] = xs.read(i * 576 + k)
        y = Y()
        forward(x, y, weights)
        for k in range(16 * 6 * 6):
            ys.write(i * 576 + k, y[k])

    return user_kernel


def test_forward_runs_the_direct_form():
    """`forward` (a thread a sample, for a user's kernel) of a network whose stages take the Winograd
    form runs the direct convolution (WinogradOutput.forward; the other two emit nothing): a user
    kernel calling it gets onnxruntime's result."""
    import luisa

    global forward, X, Y
    model, feeds, out = _model(16, 16, 6, 6, residual=False)
    net = luisaml.compile(model, backend="cpu", winograd=4)
    assert net.plan.winograd == ["conv"]
    forward, X, Y = net.forward, net.input_type("x"), net.output_type(out)
    x = feeds["x"]
    bx, by = luisa.Buffer.from_array(x.reshape(-1)), luisa.Buffer(x.size, float)
    _user_kernel()(bx, by, net.weights, dispatch_size=len(x))
    got = by.numpy().reshape(x.shape)
    np.testing.assert_allclose(got, ort_run(model, feeds)[out], rtol=1e-5, atol=1e-5)


def test_transform_stages_share_kernels(tmp_path):
    """With a kernel a stage (CUDA's plan), the input transforms of all layers are one kernel and the
    output transforms another, launched with the stage's index (Operator.shared_kernel): the network
    still equals onnxruntime, also loaded back from an artifact."""
    from luisaml import planning, runtime

    model, feeds, out = _chain2()
    opts = planning.CompileOptions(merge_stages=False, winograd=4).resolve("cpu")
    plan, _, _ = planning.plan_for(model, "chain", opts)
    assert plan.winograd == ["conv0", "conv1", "conv2"]
    kinds = [k for k in plan.kernels if k.startswith("shared_")]
    assert kinds == ["shared_winograd_input", "shared_winograd_output"]
    assert len(plan.kernels) == len(plan.schedule.stages) - 4  # 9 stages: 3 + 3 products + 2 shared kernels
    net = runtime._network(plan, "cpu")
    got = net.run(feeds)[out]
    want = ort_run(model, feeds)[out]
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[4] * float(np.abs(want).max()))
    loaded = luisaml.load(net.save(tmp_path / "chain.lml"))
    assert loaded.plan.stage_kernels == plan.stage_kernels
    np.testing.assert_array_equal(loaded.run(feeds)[out], got)


def _chain2():
    rng = np.random.default_rng(5)
    nodes, inits, cur = [], [], "x"
    for i, (c, k) in enumerate([(16, 16), (16, 24), (24, 16)]):
        w = (rng.standard_normal((k, c, 3, 3)) * np.sqrt(2 / (9 * c))).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Conv", [cur, f"w{i}"], [f"c{i}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        cur = f"r{i}"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16, 7, 7])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, ["N", 16, 7, 7])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m, {"x": rng.standard_normal((3, 16, 7, 7)).astype(np.float32)}, cur
