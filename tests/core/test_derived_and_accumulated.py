"""Two operator hooks: inputs derived on the host once per bound input (Operator.derived_inputs),
and outputs every sample of a batch adds into with atomics (Operator.accumulates)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import luisaml
from luisaml import dtypes
from luisaml.operator import Derived

CALLS: list[int] = []


def affine_table(x: np.ndarray, scale: float) -> np.ndarray:
    """The host derivation under test: counts its calls so the tests can see the caching."""
    CALLS.append(len(x))
    return (np.asarray(x, np.float64) * scale + 1.0).astype(np.float32)


@luisaml.register("AddDerived", domain="test.derived", since=1)
class AddDerived(luisaml.Operator):
    """y[i] = x[i] + table[i] where table = affine_table(t, scale) is derived from input 1 (shared)."""

    @classmethod
    def infer(cls, node, inputs):
        return [(TensorProto.FLOAT, inputs[0].shape)]

    def derived_inputs(self):
        t = self.input(1)
        return [Derived(affine_table, (1,), dtypes.FLOAT, t.shape, (("scale", 3.0),))]

    def forward(self, ctx):
        x, y, table = self.input(0), self.output(), self.derived[0]
        with ctx.loop(y.numel) as i:
            ctx.store(y, i, f"{x.load(i)} + {table.load(i)}")


@luisaml.register("ScatterAddTest", domain="test.derived", since=1)
class ScatterAddTest(luisaml.Operator):
    """y = zeros(size); y[idx[n]] += v[n]: every sample adds into the shared output in batch mode."""

    accumulates = (0,)

    @classmethod
    def infer(cls, node, inputs):
        return [(TensorProto.FLOAT, (int(node.attrs["size"]),))]

    def forward(self, ctx):
        idx, v, y = self.input(0), self.input(1), self.output()
        if self.cooperative(0):
            with ctx.loop(idx.numel) as n:
                ctx.line(f"{ctx.fresh('old')} = {y.storage.atomic_add(idx.load(n), v.load(n))}")
            return
        with ctx.loop(y.numel) as i:
            ctx.store(y, i, "0.0")
        with ctx.loop(idx.numel) as n:
            j = ctx.let(idx.load(n), "j")
            ctx.store(y, j, f"{y.load(j)} + {v.load(n)}")


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("test.derived", 1)])


def _add_model(table_const: np.ndarray | None):
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])]
    inits = []
    if table_const is None:
        inputs.append(helper.make_tensor_value_info("t", TensorProto.FLOAT, [4]))
    else:
        inits.append(numpy_helper.from_array(table_const, "t"))
    nodes = [helper.make_node("AddDerived", ["x", "t"], ["y"], domain="test.derived")]
    return _model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)


def test_derived_from_a_constant_is_computed_at_compile_time():
    t = np.array([0.5, -1.0, 2.0, 7.0], np.float32)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    CALLS.clear()
    net = luisaml.compile(_add_model(t))
    assert CALLS == [4] and net.plan.derived == []
    np.testing.assert_allclose(net.run({"x": x})["y"], x + t * 3.0 + 1.0, rtol=1e-6)
    assert CALLS == [4]  # running never derives again


def test_derived_from_a_graph_input_is_computed_once_per_content():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    t = rng.standard_normal(4).astype(np.float32)
    CALLS.clear()
    net = luisaml.compile(_add_model(None))
    assert CALLS == [] and [d.sources for d in net.plan.derived] == [("t",)]
    for _ in range(3):
        np.testing.assert_allclose(net.run({"x": x, "t": t})["y"], x + (t * 3.0 + 1.0), rtol=1e-6)
    assert CALLS == [4]  # same contents: derived once
    t2 = t.copy()
    t2[0] += 1.0  # changed in a copy ...
    np.testing.assert_allclose(net.run({"x": x, "t": t2})["y"], x + (t2 * 3.0 + 1.0), rtol=1e-6)
    t2[1] -= 2.0  # ... and in place: both are seen
    np.testing.assert_allclose(net.run({"x": x, "t": t2})["y"], x + (t2 * 3.0 + 1.0), rtol=1e-6)
    assert CALLS == [4, 4, 4]
    assert len(net.derived_arguments({"t": t2})) == 1  # what a user kernel passes to forward


def _scatter_model(batched: bool, extra_reader: bool = False):
    dim = "N" if batched else 7
    inputs = [helper.make_tensor_value_info("idx", TensorProto.INT32, [dim]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, [dim])]
    nodes = [helper.make_node("ScatterAddTest", ["idx", "v"], ["y"], domain="test.derived", size=5)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["y"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [5]))
    if batched:  # a per-sample output too, so the batch axis is found
        nodes.append(helper.make_node("Neg", ["v"], ["w"]))
        outputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [dim]))
    return _model(nodes, inputs, outputs)


@pytest.mark.parametrize("batched", [True, False])
def test_accumulated_output_gathers_every_sample(batched):
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 5, 7).astype(np.int32)
    v = rng.uniform(0.5, 2.0, 7).astype(np.float32)
    want = np.zeros(5, np.float32)
    np.add.at(want, idx, v)
    net = luisaml.compile(_scatter_model(batched), batch_axis="auto" if batched else None)
    assert [s.accumulated for s in net.outputs if s.name == "y"] == [batched]
    for _ in range(2):  # the buffer is zeroed before every run
        np.testing.assert_allclose(net.run({"idx": idx, "v": v})["y"], want, rtol=1e-6)
    if batched:
        assert "atomic_fetch_add" in net.source


def test_accumulated_output_read_by_another_node_compiles_per_batch():
    """Per sample, an output every sample adds into cannot be read by another node of the same
    kernel; the network then compiles with its batch fixed per run, and forward says why."""
    rng = np.random.default_rng(4)
    net = luisaml.compile(_scatter_model(True, extra_reader=True))
    with pytest.raises(luisaml.UsageError, match=r"no per-sample `forward`.*'y' gathers contributions from every sample"):
        net.forward
    for n in (7, 3):
        idx = rng.integers(0, 5, n).astype(np.int32)
        v = rng.uniform(-2.0, 2.0, n).astype(np.float32)
        want = np.zeros(5, np.float32)
        np.add.at(want, idx, v)
        got = net.run({"idx": idx, "v": v})
        np.testing.assert_allclose(got["y"], want, rtol=1e-6)
        np.testing.assert_allclose(got["r"], np.maximum(want, 0), rtol=1e-6)


@luisaml.register("TwiceOnHost", domain="test.derived", since=1)
class TwiceOnHost(luisaml.Operator):
    """y = 2 x, only ever folded on the host (a custom-domain node with constant inputs)."""

    @classmethod
    def infer(cls, node, inputs):
        return [(TensorProto.FLOAT, inputs[0].shape)]

    @classmethod
    def evaluate(cls, node, inputs):
        return [inputs[0] * 2]

    def check(self):
        raise self.error("reached the kernel: it should have been folded")


def test_custom_domain_node_with_constant_inputs_is_folded_by_evaluate():
    c = np.array([1.0, -2.0, 3.5], np.float32)
    nodes = [helper.make_node("TwiceOnHost", ["c"], ["d"], domain="test.derived"), helper.make_node("Add", ["x", "d"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], [numpy_helper.from_array(c, "c")])
    x = np.array([0.25, 0.5, 0.75], np.float32)
    net = luisaml.compile(m, batch_axis=None)
    assert [n.op_type for n, _ in net.plan.ops] == ["Add"]
    np.testing.assert_allclose(net.run({"x": x})["y"], x + 2 * c)
