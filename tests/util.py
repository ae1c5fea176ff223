"""Helpers for tests: build small ONNX models, run them in onnxruntime and in luisaml."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import luisaml


@contextlib.contextmanager
def switched(owner, **switches):
    """Set owner's attributes (an operator class's or a module's A/B switches) for the block, restoring
    them after: the old code path a test compares the new one with."""
    saved = {name: getattr(owner, name) for name in switches}
    try:
        for name, value in switches.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def example_module(filename: str):
    """Import examples/<filename> as a module for the duration of a test module's fixture (registered
    in sys.modules while it runs: dataclasses look their module up there)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parent.parent / "examples" / filename
    name = f"{path.stem}_example"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def cuda_only() -> list:
    """Return the pytestmark of a CUDA test module: marked gpu, skipped without a CUDA device or
    with another backend (LuisaCompute allows one backend per process)."""
    from luisaml import device

    return [pytest.mark.gpu, pytest.mark.skipif(
        os.environ.get("LUISAML_BACKEND") != "cuda" or device.cuda_device_count() == 0,
        reason="needs a CUDA device and LUISAML_BACKEND=cuda (one LuisaCompute backend per process)")]


def unsupported_node_model() -> onnx.ModelProto:
    """Return a model of one node luisaml does not know: 'mystery', acme::NotAnOp."""
    g = helper.make_graph([helper.make_node("NotAnOp", ["x"], ["y"], name="mystery", domain="acme")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)])


NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.bool_): TensorProto.BOOL,
}


def rand(shape, dtype=np.float32, seed=0, low=-2.0, high=2.0) -> np.ndarray:
    """Return random (never all-zero) data of a shape and dtype."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if dtype.kind in "iu":
        return rng.integers(int(low) - 3, int(high) + 4, size=shape).astype(dtype)
    return rng.uniform(low, high, size=shape).astype(dtype)


def value_info(name: str, dtype, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(dtype)], shape)


def _graph_inputs(inputs: dict[str, np.ndarray], batch: str | None) -> list[onnx.ValueInfoProto]:
    """Return the graph inputs typed by the arrays; with `batch`, each one's first dimension is that symbol."""
    ins = []
    for k, v in inputs.items():
        shape = list(v.shape)
        if batch and shape:
            shape[0] = batch
        ins.append(value_info(k, v.dtype, shape))
    return ins


def _untyped_outputs(names) -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in names]


def _with_inferred_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return model with its graph outputs replaced by the ones shape inference types."""
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def single_node_model(
    op_type: str,
    inputs: dict[str, np.ndarray],
    outputs: list[str] | dict[str, tuple] = ("y",),
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 18,
    domain: str = "",
    batch: str | None = None,
    **attrs,
) -> onnx.ModelProto:
    """Return a one-node model: `inputs` are graph inputs (their dtype/shape from the arrays),
    `initializers` constant inputs; outputs are typed by shape inference. With `batch`, the
    first dimension of every graph input is the symbol `batch`."""
    initializers = initializers or {}
    names = list(inputs) + list(initializers)
    node = helper.make_node(op_type, names, list(outputs), domain=domain, **attrs)
    ins, outs = _graph_inputs(inputs, batch), _untyped_outputs(outputs)
    graph = helper.make_graph(
        [node], f"{op_type.lower()}_test", ins, outs, [numpy_helper.from_array(v, k) for k, v in initializers.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(domain or "", opset)])
    return _with_inferred_outputs(model)


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return onnxruntime's outputs (CPU provider) by name."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def assert_matches_ort(model, feeds, rtol=1e-5, atol=1e-6, batch_axis="auto", **compile_kw):
    """Compile with luisaml, run, and assert every output equals onnxruntime's (dtype and shape too)."""
    net = luisaml.compile(model, batch_axis=batch_axis, **compile_kw)
    got = net.run(feeds)
    want = ort_run(model, feeds)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != onnxruntime {w.dtype}"
        assert g.shape == w.shape, f"{name}: shape {g.shape} != onnxruntime {w.shape}"
        if w.dtype.kind in "fc":
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)
    return net, got


def assert_same_bits(got: dict, want: dict) -> None:
    """Assert two runs' outputs are the same names, dtypes, shapes and bytes."""
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert got[k].tobytes() == np.ascontiguousarray(want[k]).tobytes(), f"{k}: not bit for bit"


def assert_close_to_ort(got: dict, model, feeds) -> None:
    """Assert outputs equal onnxruntime's: floats to 1e-5 (relative, and of the largest magnitude
    past 1), the rest exactly."""
    for k, w in ort_run(model, feeds).items():
        if w.dtype.kind == "f":
            np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(w).max())), err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], w, err_msg=k)


def assert_close_scaled(got, want, what: str, rtol: float = 1e-5) -> None:
    """Assert got equals want in float64 to rtol, relative and of want's largest magnitude."""
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol,
                               atol=rtol * scale, err_msg=what)


def plan_of(model, backend: str = "cuda", **options):
    """Return model's plan on `backend` ("cpu" or "cuda"), planned without a device under
    CompileOptions(**options) (the model named "m")."""
    from luisaml.planning import CompileOptions, plan_for

    return plan_for(model, "m", CompileOptions(**options).resolve(backend))[0]


def graph_model(nodes, inputs: dict[str, np.ndarray], initializers: dict[str, np.ndarray] | None = None,
                opset: int = 18, batch: str | None = None, outputs: list[str] | None = None) -> onnx.ModelProto:
    """Return a model of several nodes: `inputs` are graph inputs (dtype/shape from the arrays; with
    `batch`, their first dimension is that symbol), `initializers` constants; the outputs (default:
    every node output no node reads) are typed by shape inference."""
    initializers = initializers or {}
    read = {i for n in nodes for i in n.input}
    if outputs is None:
        outputs = [o for n in nodes for o in n.output if o and o not in read]
    ins, outs = _graph_inputs(inputs, batch), _untyped_outputs(outputs)
    inits = [numpy_helper.from_array(v, k) for k, v in initializers.items()]
    graph = helper.make_graph(list(nodes), "graph_test", ins, outs, inits)
    opsets = [helper.make_opsetid("", opset)]
    # the oldest IR version the opset allows: older onnxruntime builds reject newer IR versions
    model = helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))
    return _with_inferred_outputs(model)


def per_shape_model(op_type: str, arrays: list[dict[str, np.ndarray]], opset: int = 18, n_outputs: int = 1,
                    initializers: dict[str, np.ndarray] | None = None, **attrs):
    """Return (model, feeds): one op_type node per entry of `arrays` (its inputs, in order; names are
    suffixed with the entry's index), so one compiled kernel checks the op on several shapes.
    A None value is an absent optional input; `initializers` are shared constant inputs by name."""
    nodes, feeds = [], {}
    for k, ins in enumerate(arrays):
        names = []
        for name, v in ins.items():
            if v is None:
                names.append("")
            elif initializers and name in initializers:
                names.append(name)
            else:
                names.append(f"{name}{k}")
                feeds[f"{name}{k}"] = v
        outs = [f"out{k}" if j == 0 else f"out{k}_{j}" for j in range(n_outputs)]
        nodes.append(helper.make_node(op_type, names, outs, name=f"{op_type}_{k}", **attrs))
    return graph_model(nodes, feeds, initializers, opset=opset), feeds


def torch_mlp(widths, act=None, seed=0):
    """Return a seeded torch MLP (eval mode): Linear layers of these widths, `act` (default ReLU)
    between them."""
    import itertools

    import torch

    act = act or torch.nn.ReLU
    torch.manual_seed(seed)
    layers = []
    for a, b in itertools.pairwise(widths):
        layers += [torch.nn.Linear(a, b), act()]
    return torch.nn.Sequential(*layers[:-1]).eval()


def export_batched(module, k: int, path) -> str:
    """Export a torch module of one input [batch, k] to ONNX (TorchScript exporter, opset 17), with
    a symbolic batch dimension on its input x and output y; return the path."""
    import torch

    module.eval()
    torch.onnx.export(module, (torch.randn(3, k),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return str(path)


def export_torch(module, x, path) -> str:
    """Export a torch module of one input x to ONNX (TorchScript exporter, opset 17, x's shape fixed),
    its input named x and its output y; return the path."""
    import torch

    torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"], opset_version=17, dynamo=False)
    return str(path)


def torch_rnn(cell: str, inputs: int, hidden: int = 8, layers: int = 1, bidirectional: bool = False):
    """Return torch's nn.GRU or nn.LSTM (`cell`: "GRU", "LSTM"; batch_first, eval mode), built right after
    torch.manual_seed(0), inside a module whose output is the sequence output y alone."""
    import torch

    torch.manual_seed(0)
    rnn = getattr(torch.nn, cell)(inputs, hidden, num_layers=layers, batch_first=True,
                                  bidirectional=bidirectional).eval()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = rnn

        def forward(self, x):
            return self.rnn(x)[0]

    return Net()


def split_rnn_feeds(feeds: dict) -> tuple[dict, dict]:
    """Return (inputs, initializers) of a recurrent node's feeds: its weights W, R, B and P constants."""
    inits = {k: v for k, v in feeds.items() if k[0] in "WRBP" and not k.startswith("sequence")}
    return {k: v for k, v in feeds.items() if k not in inits}, inits


def stage_of(net, node_name: str):
    """Return the schedule's stage that runs node `node_name` (as its root, in its epilogue, or
    inline where it reads it: then the first stage that does), or None without a schedule."""
    sched = net.plan.schedule
    if sched is None:
        return None
    for st in sched.stages:
        names = [n.name for n, _ in st.nodes + st.epilogue]
        if node_name in names or any(f"'{node_name}'" in s for s in st.inlined):
            return st
    raise AssertionError(f"node '{node_name}' is in no stage:\n{sched.describe()}")


# ---- compile(tune=...)'s tests (tests/test_tune.py, tests/gpu/test_tune_cuda.py) ------------------


@pytest.fixture
def tuning_root(tmp_path, monkeypatch):
    """A cache root of the test's own (its tuning/ folder empty): import it into a test module."""
    from luisaml import cache

    monkeypatch.setattr(cache, "ROOT", tmp_path)
    return tmp_path


def conv_relu(out: str) -> list:
    """Return the nodes Conv 3x3 pad 1 of input x by constants w and b ('conv'), then Relu ('relu')
    into `out`."""
    return [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
            helper.make_node("Relu", ["c"], [out], name="relu")]


def float_model(nodes, inputs: dict[str, list], outputs: dict[str, list],
                initializers: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Return the model (opset 17, IR version 10) of these nodes over float inputs and outputs of
    the shapes given (a str a symbolic dimension) and constant initializers."""
    graph = helper.make_graph(nodes, "tuned", [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in inputs.items()],
                              [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in outputs.items()],
                              [numpy_helper.from_array(v, k) for k, v in initializers.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def mark_products_f16(monkeypatch) -> None:
    """Make compile mark every product with the FP16 mma kind (operators/tiled_mma.py "f16"), whatever the
    precision: what precision="fp16" asks of an MLP's layers, for a product that is no MLP. By the module's
    name: a test before may have imported luisaml afresh (test_artifact's sys.modules purges)."""
    import luisaml.rewrites.tensor_cores as tc_rewrite

    mark = tc_rewrite.mark
    monkeypatch.setattr(tc_rewrite, "mark", lambda plan, kind="tf32": mark(plan, "f16"))
