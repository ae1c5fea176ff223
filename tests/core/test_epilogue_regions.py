"""Epilogues that are regions, not chains (luisaml/schedule.py `_epilogue`, emission.epilogue_lets):
`x * f(x)` of one tensor x (SiLU, GELU in its erf and tanh forms, HardSwish, Mish written as
graphs) is the epilogue of x's producer, against onnxruntime; and an epilogue whose nodes read
their input twice grows linearly in source, where nested inline expressions grew as 2^n."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper
from util import graph_model, ort_run, stage_of

import luisaml
from luisaml.runtime import analyze

RNG = np.random.default_rng(0)
CONV_W = (RNG.standard_normal((6, 3, 3, 3)) / 4).astype(np.float32)
CONV_B = RNG.standard_normal(6).astype(np.float32)
MM_W = (RNG.standard_normal((12, 10)) / 2).astype(np.float32)


def _conv(act_nodes, out="y"):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv")] + act_nodes
    x = RNG.standard_normal((2, 3, 7, 7)).astype(np.float32) * 2
    return graph_model(nodes, {"x": x}, {"w": CONV_W, "b": CONV_B}, batch="N", outputs=[out]), {"x": x}


def _matmul(act_nodes, out="y", inits=None):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["c"], name="mm")] + act_nodes
    x = RNG.standard_normal((3, 12)).astype(np.float32)
    return graph_model(nodes, {"x": x}, {"w": MM_W, **(inits or {})}, batch="N", outputs=[out]), {"x": x}


def _f(v):
    return np.array(v, np.float32)


N = helper.make_node
SILU = [N("Sigmoid", ["c"], ["s"], name="sig"), N("Mul", ["c", "s"], ["y"], name="mul")]
# (the Mul-rooted form the brief names; torch writes Mul(x, Add(...)) then Mul(_, 0.5), tested too)
GELU_ERF = [N("Mul", ["c", "half"], ["h"], name="half_x"), N("Div", ["c", "sqrt2"], ["d"], name="div"),
            N("Erf", ["d"], ["e"], name="erf"), N("Add", ["e", "one"], ["a"], name="add"),
            N("Mul", ["h", "a"], ["y"], name="mul")]
GELU_ERF_TORCH = [N("Div", ["c", "sqrt2"], ["d"], name="div"), N("Erf", ["d"], ["e"], name="erf"),
                  N("Add", ["e", "one"], ["a"], name="add"), N("Mul", ["c", "a"], ["m"], name="mul"),
                  N("Mul", ["m", "half"], ["y"], name="half")]
GELU_TANH = [N("Pow", ["c", "three"], ["p"], name="pow"), N("Mul", ["p", "k"], ["q"], name="cubic"),
             N("Add", ["c", "q"], ["r"], name="inner"), N("Mul", ["r", "s2pi"], ["u"], name="scale"),
             N("Tanh", ["u"], ["t"], name="tanh"), N("Add", ["t", "one"], ["a"], name="add"),
             N("Mul", ["c", "a"], ["m"], name="mul"), N("Mul", ["m", "half"], ["y"], name="half")]
GELU_CONSTS = {"half": _f(0.5), "sqrt2": _f(math.sqrt(2)), "one": _f(1.0), "three": _f(3.0),
               "k": _f(0.044715), "s2pi": _f(math.sqrt(2 / math.pi))}
HARDSWISH = [N("HardSigmoid", ["c"], ["s"], alpha=1 / 6, beta=0.5, name="hsig"), N("Mul", ["c", "s"], ["y"], name="mul")]
MISH = [N("Softplus", ["c"], ["sp"], name="softplus"), N("Tanh", ["sp"], ["t"], name="tanh"),
        N("Mul", ["c", "t"], ["y"], name="mul")]


def _check(model, feeds, root: str, epilogue: list[str], rtol=1e-5, atol=1e-6):
    net = luisaml.compile(model)
    st = stage_of(net, root)
    assert [n.op_type for n, _ in st.epilogue] == epilogue, net.plan.schedule.describe()
    # one stage: the activation is no element stage of its own
    assert len(net.plan.schedule.stages) == 1, net.plan.schedule.describe()
    assert not net.plan.schedule.buffers.slots  # nothing between the root and the output is stored
    want = ort_run(model, feeds)["y"]
    np.testing.assert_allclose(net.run(feeds)["y"], want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name,act,epilogue", [
    ("silu", SILU, ["Sigmoid", "Mul"]),
    ("hardswish", HARDSWISH, ["HardSigmoid", "Mul"]),
    ("mish", MISH, ["Softplus", "Tanh", "Mul"]),
])
def test_conv_then_x_times_f_of_x_is_one_stage(name, act, epilogue):
    model, feeds = _conv(act)
    _check(model, feeds, "conv", epilogue)


@pytest.mark.parametrize("name,act,epilogue", [
    ("gelu_erf", GELU_ERF, ["Mul", "Div", "Erf", "Add", "Mul"]),
    ("gelu_erf_torch", GELU_ERF_TORCH, ["Div", "Erf", "Add", "Mul", "Mul"]),
    ("gelu_tanh", GELU_TANH, ["Pow", "Mul", "Add", "Mul", "Tanh", "Add", "Mul", "Mul"]),
    ("silu", SILU, ["Sigmoid", "Mul"]),
])
def test_matmul_then_gelu_is_one_stage(name, act, epilogue):
    model, feeds = _matmul(act, inits=GELU_CONSTS)
    _check(model, feeds, "mm", epilogue)


def test_a_region_read_outside_is_no_epilogue():
    """SiLU whose Sigmoid is also a graph output, and one whose input a second MatMul reads: the
    region has two open tensors, so the MatMul keeps no epilogue (results still match)."""
    for extra, outs in (([], ["y", "s"]), ([N("MatMul", ["c", "w2"], ["z"], name="mm2")], ["y", "z"])):
        nodes = [N("MatMul", ["x", "w"], ["c"], name="mm")] + SILU + extra
        x = RNG.standard_normal((3, 12)).astype(np.float32)
        model = graph_model(nodes, {"x": x}, {"w": MM_W, "w2": MM_W[:10, :4].copy()}, batch="N", outputs=outs)
        net = luisaml.compile(model)
        assert not stage_of(net, "mm").epilogue, net.plan.schedule.describe()
        want, got = ort_run(model, {"x": x}), net.run({"x": x})
        for o in outs:
            np.testing.assert_allclose(got[o], want[o], rtol=1e-5, atol=1e-6)


def test_a_residual_from_another_branch_stays_in_the_region():
    """y = SiLU(conv(x)) + r, r computed from the graph input after the Conv: the Add joins the
    region (its other input is outside and computed before the region ends)."""
    act = SILU[:1] + [N("Mul", ["c", "s"], ["m"], name="mul"), N("Relu", ["x"], ["r"], name="res"),
                      N("Add", ["m", "r"], ["y"], name="add")]
    w = (RNG.standard_normal((3, 3, 3, 3)) / 4).astype(np.float32)
    nodes = [N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv")] + act
    x = RNG.standard_normal((2, 3, 5, 5)).astype(np.float32)
    model = graph_model(nodes, {"x": x}, {"w": w, "b": CONV_B[:3].copy()}, batch="N", outputs=["y"])
    net = luisaml.compile(model)
    assert [n.op_type for n, _ in stage_of(net, "conv").epilogue] == ["Sigmoid", "Mul", "Add"]
    np.testing.assert_allclose(net.run({"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-6)


def _twice_chain(n: int, mixed: bool = True):
    """A MatMul, then n elementwise nodes that each read their input twice: y = h + h (the form
    that blew up: one node, one reader, its input read twice), or in turn y = h + h,
    y = Relu(h) + h (h read by two nodes), y = h * Sigmoid(h)."""
    nodes, cur = [N("MatMul", ["x", "w"], ["h0"], name="mm")], "h0"
    for i in range(n):
        nxt, form = f"h{i + 1}", i % 3 if mixed else 0
        if form == 0:
            nodes.append(N("Add", [cur, cur], [nxt], name=f"double{i}"))
        elif form == 1:
            nodes += [N("Relu", [cur], [f"r{i}"], name=f"relu{i}"), N("Add", [f"r{i}", cur], [nxt], name=f"add{i}")]
        else:
            nodes += [N("Sigmoid", [cur], [f"s{i}"], name=f"sig{i}"), N("Mul", [cur, f"s{i}"], [nxt], name=f"mul{i}")]
        cur = nxt
    x = RNG.standard_normal((4, 12)).astype(np.float32)
    return graph_model(nodes, {"x": x}, {"w": MM_W}, batch="N", outputs=[cur]), {"x": x}


@pytest.mark.parametrize("mixed", [False, True])
def test_an_epilogue_reading_its_input_twice_grows_linearly(mixed):
    """Each epilogue tensor is one variable: the generated source grows by about the same for
    every node added (before, each node that read its input twice doubled the store's
    expression: 1.4 / 7.1 / 129 s to compile 8 / 12 / 16 such nodes after a MatMul). A chain
    of 24 is one stage, its source within the same line, and matches onnxruntime."""
    sizes = {n: len(analyze(_twice_chain(n, mixed)[0]).source) for n in (0, 6, 12)}
    first, second = sizes[6] - sizes[0], sizes[12] - sizes[6]
    assert 0 < second < 1.5 * first, sizes
    model, feeds = _twice_chain(24, mixed)
    net = luisaml.compile(model)
    assert len(net.plan.schedule.stages) == 1, net.plan.schedule.describe()
    assert len(stage_of(net, "mm").epilogue) == (40 if mixed else 24)
    assert len(net.plan.source) < sizes[12] + 3 * second
    np.testing.assert_allclose(net.run(feeds)["h24"], ort_run(model, feeds)["h24"], rtol=1e-5, atol=1e-6)
