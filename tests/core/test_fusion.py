"""The fused MLP kernel (luisaml/rewrites/mlp.py, operators/mlp.py, shaders/mlp.py.j2) on the CPU
backend: recognition of dense chains with any elementwise activations, the emulated kernel
against torch (fp32 and fp16 mode, several tilings and batch tails), what inspect reports, and the
errors that name why a graph is not fused."""
from __future__ import annotations

import io
import subprocess
import sys
from contextlib import redirect_stdout

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from util import export_batched, ort_run, torch_mlp

import luisaml
from luisaml import cli
from luisaml.operators import mlp as mlp_mod
from luisaml.model import Node
from luisaml.storage import Tensor
from luisaml.runtime import analyze


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _matmul_add_model(k=12, n=8, out=3, seed=0) -> onnx.ModelProto:
    """MatMul + Add (bias first, then second) + LeakyRelu, as exporters without Gemm write it."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W1"),
        numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((n, out)).astype(np.float32), "W2"),
        numpy_helper.from_array(rng.standard_normal((1, out)).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h0"]),
        helper.make_node("Add", ["b1", "h0"], ["h1"]),
        helper.make_node("LeakyRelu", ["h1"], ["h2"], alpha=0.2),
        helper.make_node("MatMul", ["h2", "W2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["y"]),
    ]
    g = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Exported MLPs: (module, path) by name; odd widths exercise padded rows and outputs."""
    d = tmp_path_factory.mktemp("fusion")
    specs = {
        "relu-32-32x3-4": ([32, 32, 32, 32, 4], torch.nn.ReLU),
        "tanh-63-20x2-3": ([63, 20, 20, 3], torch.nn.Tanh),
        "sigmoid-16-24-5": ([16, 24, 5], torch.nn.Sigmoid),
    }
    return {name: (m := torch_mlp(w, act, seed=len(w)), export_batched(m, w[0], d / f"{name}.onnx")) for name, (w, act) in specs.items()}


def test_recognises_gemm_chains_and_reports_the_plan(models):
    _, path = models["relu-32-32x3-4"]
    plan = analyze(path, fuse="gpu")
    f = plan.fused
    assert [l.act.label for l in f.layers] == ["Relu", "Relu", "Relu", "none"]
    assert (f.K0, [l.N for l in f.layers]) == (32, [32, 32, 32, 4])
    assert plan.fusion_note.startswith("fused MLP 32-32-32-32-4 (Relu,Relu,Relu,none), fp32: tile of")
    assert "def stage_0(x_x, y_y, weights, tile_counter, n: int)" in plan.source and "sync_block()" in plan.source
    assert [st.domain for st in plan.schedule.stages] == ["fused"]
    # without fusion the note still says what CUDA would run, and the kernel is the per-sample one
    off = analyze(path)
    assert off.fused is None and off.fusion_note.startswith("fusable (used on the CUDA backend): fused MLP")
    assert "sync_block" not in off.source


def test_inspect_prints_the_chosen_algorithm(models):
    _, path = models["tanh-63-20x2-3"]
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["inspect", path]) == 0
    line = next(ln for ln in buf.getvalue().splitlines() if ln.startswith("batch kernel: "))
    assert "fused MLP 63-20-20-3 (Tanh,Tanh,none)" in line and "register tiles" in line


def test_plans_per_shape():
    """Wider layers get smaller tiles of samples; weights that do not fit are staged or global."""
    notes = {}
    for w in (32, 64, 128, 256):
        x, y = Tensor("x", luisaml.dtypes.FLOAT, (1, 32), True), Tensor("y", luisaml.dtypes.FLOAT, (1, 4), True)
        none = mlp_mod.Activation
        mlp = mlp_mod.FusedMLP(Node("f", "FusedMLP", "luisaml", ["x"], ["y"]), x, y, [
            mlp_mod.Layer(np.zeros((32, w), np.float32), np.zeros(w, np.float32), none()),
            mlp_mod.Layer(np.zeros((w, w), np.float32), np.zeros(w, np.float32), none()),
            mlp_mod.Layer(np.zeros((w, 4), np.float32), np.zeros(4, np.float32), none()),
        ], [], []).plan("gpu")
        assert mlp.shared_bytes <= mlp_mod.SHARED_LIMIT
        assert all(l.S * l.O <= mlp_mod.MAX_ACC for l in mlp.layers)
        notes[w] = (mlp.T, mlp.weights, mlp.layers[-1].G)
    assert notes[32] == (256, "resident", 2) and notes[64][:2] == (128, "staged")
    assert notes[128][:2] == (64, "global") and notes[256][:2] == (32, "global")


@pytest.mark.parametrize("name", ["relu-32-32x3-4", "tanh-63-20x2-3", "sigmoid-16-24-5"])
def test_emulated_kernel_matches_torch(models, name):
    module, path = models[name]
    net = luisaml.compile(path, fuse=True)
    assert net.plan.fused is not None and net.plan.fused.mode == "emulated"
    k = net.inputs[0].kernel_shape[1]
    for n in (1, 37, 300):  # tails of the 16-sample tile
        x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        got = net.run({"x": x})["y"]
        assert got.shape == want.shape and got.dtype == np.float32
        assert _rel(got, want) < 1e-5, f"{name} batch {n}"


@pytest.mark.parametrize("vector", [False, True])
def test_gpu_tiling_in_emulation(models, vector):
    """The CUDA plan's tile (T=128 samples, 128 threads, split-K output layer), with scalar or
    float4 accumulators, computes the same."""
    module, path = models["tanh-63-20x2-3"]
    net = luisaml.compile(path, fuse=True, mlp=luisaml.MLPConfig(T=128, NT=128, vector_acc=vector))
    assert net.plan.fused.T == 128 and net.plan.fused.layers[-1].G > 1
    assert net.plan.fused.vector_acc == vector
    x = np.random.default_rng(5).standard_normal((300, 63)).astype(np.float32)
    with torch.no_grad():
        assert _rel(net.run({"x": x})["y"], module(torch.from_numpy(x)).numpy()) < 1e-5


def test_matmul_add_leaky_relu_chain():
    model = _matmul_add_model()
    net = luisaml.compile(model, fuse=True)
    assert net.plan.fused is not None and [l.act.label for l in net.plan.fused.layers] == ["LeakyRelu", "none"]
    x = np.random.default_rng(2).standard_normal((50, 12)).astype(np.float32)
    want = ort_run(_matmul_add_model(), {"x": x})["y"]
    assert _rel(net.run({"x": x})["y"], want) < 1e-5


@pytest.mark.parametrize("name", ["relu-32-32x3-4", "tanh-63-20x2-3"])
def test_fp16_mode(models, name):
    module, path = models[name]
    net = luisaml.compile(path, precision="fp16")  # fp16 is the fused kernel, emulated on the CPU
    assert net.plan.fused.precision == "fp16" and "fp16" in net.plan.fusion_note
    k = net.inputs[0].kernel_shape[1]
    x = np.random.default_rng(3).standard_normal((70, k)).astype(np.float16)
    y = net.run({"x": x})["y"]
    assert y.dtype == np.float16
    with torch.no_grad():
        want = module(torch.from_numpy(x.astype(np.float32))).numpy()
    assert _rel(y, want) < 3e-3  # half inputs and outputs, float arithmetic
    with pytest.raises(TypeError, match="expected dtype float16, got float32"):
        net.run({"x": x.astype(np.float32)})


def test_not_fusable_graphs_compile_as_before_and_fp16_says_why(tmp_path):
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h) + h[:, :2]  # h has two consumers: not a chain

    path = export_batched(TwoHeads().eval(), 8, tmp_path / "two.onnx")
    net = luisaml.compile(path, fuse=True)
    assert net.plan.fused is None and net.plan.fusion_note.startswith("not fused: tensor")
    x = np.random.default_rng(0).standard_normal((9, 8)).astype(np.float32)
    assert _rel(net.run({"x": x})["y"], ort_run(onnx.load(path), {"x": x})["y"]) < 1e-5
    with pytest.raises(luisaml.CompileError, match=r"precision='fp16' needs the fused MLP kernel.*2 consumers"):
        luisaml.compile(path, precision="fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        luisaml.compile(path, precision="bf16", fuse=True)


def test_cpu_backend_still_cannot_compile_shared_memory(tmp_path):
    """Why the CPU backend runs the fused kernel emulated: luisa-python 0.3.7's CPU backend aborts on
    a kernel with shared memory. The day this test fails, emulation can give way to the real kernel."""
    src = tmp_path / "shared_kernel.py"
    src.write_text(
        "import luisa\nfrom luisa.mathtypes import *\nSh = luisa.SharedArrayType(32, float)\n"
        "@luisa.func\ndef k(buf):\n    s = Sh()\n    t = int(thread_id().x)\n    s[t] = 1.0\n"
        "    buf.write(t, s[t])\n"
        "if __name__ == '__main__':\n    luisa.init('cpu')\n    b = luisa.Buffer(32, float)\n"
        "    k(b, dispatch_size=32)\n    luisa.synchronize()\n    print('compiled')\n"
    )
    out = subprocess.run([sys.executable, str(src)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0 and "compiled" not in out.stdout


class _Sine(torch.nn.Module):
    def forward(self, x):
        return torch.sin(30.0 * x)  # SIREN's activation: a Mul by a constant, then Sin


class _Exp(torch.nn.Module):
    def forward(self, x):
        return torch.exp(-torch.abs(x))


@pytest.mark.parametrize("act", [torch.nn.Softplus, torch.nn.SiLU, _Sine, torch.nn.GELU, _Exp, torch.nn.ELU],
                         ids=["softplus", "silu", "sine", "gelu", "exp-abs", "elu"])
def test_any_elementwise_activation_is_fused(tmp_path, act):
    """Whatever elementwise nodes follow a dense layer (a chain, or SiLU's diamond x * sigmoid(x))
    become its activation in the fused kernel; the emulated kernel matches torch."""
    module = torch_mlp([5, 24, 24, 3], act, seed=7)
    path = export_batched(module, 5, tmp_path / "m.onnx")
    net = luisaml.compile(path, fuse=True)
    assert net.plan.fused is not None, net.plan.fusion_note
    assert [st.domain for st in net.plan.schedule.stages] == ["fused"]
    assert net.plan.fused.layers[0].act.label != "none" and net.plan.fused.layers[-1].act.label == "none"
    x = np.random.default_rng(11).standard_normal((45, 5)).astype(np.float32)
    with torch.no_grad():  # float64 is the reference; torch's own float32 error sets the bar
        want = module.double()(torch.from_numpy(x).double()).numpy()
        torch32 = module.float()(torch.from_numpy(x)).numpy()
    assert _rel(net.run({"x": x})["y"], want) <= max(4 * _rel(torch32, want), 2e-6)


def test_fused_forward_is_the_chain_per_sample(models, tmp_path):
    """`forward` of a fused network (for user kernels) runs the original nodes one sample at a
    time; the per-sample plan built from it equals the fused kernel's results."""
    module, path = models["sigmoid-16-24-5"]
    fused = luisaml.compile(path, fuse=True)
    plain = luisaml.compile(path, fuse=True, schedule="per-sample")
    assert "def forward(" in fused.source and plain.plan.schedule is None
    x = np.random.default_rng(1).standard_normal((33, 16)).astype(np.float32)
    assert _rel(plain.run({"x": x})["y"], fused.run({"x": x})["y"]) < 1e-6


def test_an_activation_that_repeats_its_row_runs_as_stages(tmp_path):
    """The fused kernel writes an activation as one nested expression, so x * x doubles it per
    node; a chain of 12 (2**12 copies of the row) is not fused (it compiled for 54 s before) and
    the stages it runs as match onnxruntime. SiLU's two copies stay fused (test above)."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"])]
    for i in range(12):
        nodes += [helper.make_node("Mul", [f"h{i}", f"h{i}"], [f"m{i}"]), helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"])]
    nodes.append(helper.make_node("MatMul", ["h12", "w2"], ["y"]))
    graph = helper.make_graph(
        nodes, "square_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [numpy_helper.from_array((0.3 * rng.standard_normal((16, 32))).astype(np.float32), "w1"),
         numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "w2")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    net = luisaml.compile(str(path), fuse=True)
    assert net.plan.fused is None and "repeat it 4096 times" in net.plan.fusion_note, net.plan.fusion_note
    x = rng.standard_normal((40, 16)).astype(np.float32)
    np.testing.assert_allclose(net.run({"x": x})["y"], ort_run(onnx.load(path), {"x": x})["y"], rtol=1e-5, atol=1e-5)
