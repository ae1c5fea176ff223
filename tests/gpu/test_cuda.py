"""The CUDA backend: the core issue's end-to-end models, the fused MLP kernel's plans, fp16 mode and
DLPack zero-copy with torch. Skipped without a CUDA device; run them in a process of their own
(LuisaCompute allows one backend per process):

    LUISAML_BACKEND=cuda python -m pytest tests/gpu -q

Every result is held to onnxruntime at the tolerance the CPU suite holds the CPU backend to (so the
two backends agree); where clang is installed too, the CPU backend's own outputs are computed in a
subprocess and compared directly."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from util import assert_close_scaled, cuda_only, export_batched, ort_run, torch_mlp

import luisaml
from luisaml import device

pytestmark = cuda_only()

RTOL = 1e-5


def _cpu_backend(path: str, x: np.ndarray, tmp_path) -> np.ndarray | None:
    """The CPU backend's output for x, computed in a subprocess (None without clang)."""
    if device.clang_path() is None:
        return None
    np.save(tmp_path / "x.npy", x)
    code = (
        "import numpy as np, luisaml, sys; net = luisaml.compile(sys.argv[1], backend='cpu'); "
        "np.save(sys.argv[3], net.run({'x': np.load(sys.argv[2])})['y'])"
    )
    env = dict(os.environ, LUISAML_BACKEND="cpu")
    subprocess.run([sys.executable, "-P", "-c", code, path, str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
                   check=True, env=env, timeout=600)
    return np.load(tmp_path / "y.npy")


def _core_models():
    """The end-to-end models of the core issue (tests/test_end_to_end.py)."""
    from test_end_to_end import MLP, NeRF

    torch.manual_seed(0)
    return {"mlp-32-64x3-4": (MLP([32, 64, 64, 64, 4]), 32), "nerf": (NeRF(), 3)}


@pytest.mark.parametrize("name", ["mlp-32-64x3-4", "nerf"])
def test_core_end_to_end_models_on_cuda(name, tmp_path):
    module, k = _core_models()[name]
    path = export_batched(module, k, tmp_path / f"{name}.onnx")
    x = (np.random.default_rng(1).random((1000, k), dtype=np.float32) * 2 - 1).astype(np.float32)
    want = ort_run(onnx.load(path), {"x": x})["y"]
    net = luisaml.compile(path)
    assert net.backend == "cuda"
    got = net.run({"x": x})["y"]
    assert_close_scaled(got, want, f"{name} on CUDA vs onnxruntime")
    with torch.no_grad():
        assert_close_scaled(got, module(torch.from_numpy(x)).numpy(), f"{name} on CUDA vs torch")
    plain = luisaml.compile(path, fuse=False).run({"x": x})["y"]  # the one-thread-per-sample kernel
    assert_close_scaled(got, plain, f"{name}: fused vs per-sample kernel on CUDA")
    cpu = _cpu_backend(path, x, tmp_path)
    if cpu is not None:
        assert_close_scaled(got, cpu, f"{name}: CUDA vs the CPU backend")


PLANS = {
    "default": luisaml.MLPConfig(),
    "staged": luisaml.MLPConfig(weights="staged"),
    "global": luisaml.MLPConfig(weights="global"),
    "global-prefetch": luisaml.MLPConfig(weights="global", prefetch=True),
    "kpipe": luisaml.MLPConfig(kpipe=True),
    "kpipe-staged": luisaml.MLPConfig(kpipe=True, weights="staged"),
    "vector": luisaml.MLPConfig(vector_acc=True),
    "no-split-k": luisaml.MLPConfig(split_k=False),
    "small-tile": luisaml.MLPConfig(T=32, NT=64, U=3),
}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("widths,act", [
    ([32, 32, 32, 32, 4], torch.nn.ReLU),
    ([63, 20, 20, 3], torch.nn.Tanh),  # odd widths: padded rows and outputs
    ([63, 128, 128, 5], torch.nn.Sigmoid),
])
def test_fused_plans_on_cuda(plan, widths, act, tmp_path):
    module = torch_mlp(widths, act, seed=len(widths))
    path = export_batched(module, widths[0], tmp_path / "m.onnx")
    net = luisaml.compile(path, mlp=PLANS[plan])
    assert net.plan.fusion_note.startswith("fused MLP"), net.plan.fusion_note
    for n in (1, 257, 100_003):  # tails of every tile size
        x = np.random.default_rng(n).standard_normal((n, widths[0])).astype(np.float32)
        want = ort_run(onnx.load(path), {"x": x})["y"]
        assert_close_scaled(net.run({"x": x})["y"], want, f"{plan} {widths} batch {n}")


def test_fp16_mode_on_cuda(tmp_path):
    module = torch_mlp([32, 64, 64, 64, 4])
    path = export_batched(module, 32, tmp_path / "m.onnx")
    net = luisaml.compile(path, precision="fp16")
    x = np.random.default_rng(0).standard_normal((4099, 32)).astype(np.float16)
    y = net.run({"x": x})["y"]
    assert y.dtype == np.float16 and y.shape == (4099, 4)
    with torch.no_grad():
        ref = module(torch.from_numpy(x.astype(np.float32))).numpy()
    err = np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max()
    assert err < 3e-3, f"fp16 relative error {err:.2e}"
    with pytest.raises(TypeError, match="expected dtype float16, got float32"):
        net.run({"x": x.astype(np.float32)})


@pytest.mark.parametrize("fuse", [True, False])
def test_dlpack_zero_copy_and_streams(fuse, tmp_path):
    module = torch_mlp([32, 64, 64, 4])
    path = export_batched(module, 32, tmp_path / "m.onnx")
    module.cuda()
    net = luisaml.compile(path, fuse=fuse)
    n = 1 << 20
    base = torch.randn(n, 32, device="cuda")
    for _ in range(3):
        x = base * 0.5 + 0.25  # still running on torch's stream when run() is called
        y = net.run({"x": x})["y"]
        assert y.is_cuda and y.dtype == torch.float32 and y.shape == (n, 4)
        z = y * 2  # torch reads the output right away
        with torch.no_grad():
            ref = module(x)
        torch.testing.assert_close(z, ref * 2, rtol=RTOL, atol=RTOL * float(ref.abs().max()))
    io = {s.ident for s in net.inputs + net.outputs}
    assert not [k for k in net.pool.held if k[0] in io], "torch CUDA tensors must not be copied into buffers of luisaml's own"
    with pytest.raises(ValueError, match=r"expected shape \[batch, 32\]"):
        net.run({"x": torch.zeros(4, 31, device="cuda")})


def test_dlpack_fp16(tmp_path):
    module = torch_mlp([32, 32, 4])
    path = export_batched(module, 32, tmp_path / "m.onnx")
    net = luisaml.compile(path, precision="fp16")
    x = torch.randn(3000, 32, device="cuda").half()
    y = net.run({"x": x})["y"]
    assert y.is_cuda and y.dtype == torch.float16
    with torch.no_grad():
        ref = module.cuda()(x.float())
    assert float((y.float() - ref).abs().max() / ref.abs().max()) < 3e-3


def test_compile_time_and_cache(tmp_path):
    """A model's fused kernel compiles in well under the issue's 3 s (cold) in a fresh process."""
    module = torch_mlp([32, 32, 32, 32, 4], seed=7)
    path = export_batched(module, 32, tmp_path / "m.onnx")
    code = (
        "import time, json, sys, numpy as np, luisaml; luisaml.device.init('cuda'); t = time.perf_counter(); "
        "net = luisaml.compile(sys.argv[1]); net.run({'x': np.ones((8, 32), np.float32)}); "
        "print(json.dumps(time.perf_counter() - t))"
    )
    env = dict(os.environ, LUISAML_CACHE=str(tmp_path / "cache"))
    times = [json.loads(subprocess.run([sys.executable, "-P", "-c", code, path], env=env, check=True, capture_output=True,
                                       text=True, timeout=300).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert times[0] < 3.0 and times[1] < 3.0, times


def test_nan_constants_and_fmod_compile_on_cuda():
    """A NaN constant (a literal in the kernel) and float Mod (whose helper makes NaN for b = 0):
    LuisaCompute's CUDA codegen aborts the process on a NaN literal, and folds a constant NaN
    stored in a local into one; shaders/math_lib.quiet_nan is made at run time instead (the fuzz
    found 40 aborting batches in 115 on CUDA before it)."""
    from onnx import TensorProto, helper, numpy_helper

    F = TensorProto.FLOAT
    nodes = [
        helper.make_node("Mod", ["x", "d"], ["m"], fmod=1, name="mod"),
        helper.make_node("Min", ["x", "m"], ["y"], name="min"),
        helper.make_node("Greater", ["x", "zero"], ["pos"], name="gt"),
        helper.make_node("Where", ["pos", "x", "nan"], ["z"], name="where"),
    ]
    inits = [numpy_helper.from_array(np.array([1.5, 0.0, -2.0], np.float32), "d"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array(np.nan, np.float32), "nan")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 3])],
                          [helper.make_tensor_value_info("y", F, ["N", 3]),
                           helper.make_tensor_value_info("z", F, ["N", 3])], inits)
    # IR 10: the lent machine's onnxruntime reads up to 13, the installed onnx writes its newest
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    x = np.array([[3.7, 1.0, -5.5], [np.nan, np.inf, 2.0], [-1.0, -np.inf, 0.25]], np.float32)
    got = luisaml.compile(model).run({"x": x})
    want = ort_run(model, {"x": x})
    for k in ("y", "z"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, equal_nan=True, err_msg=k)


def test_kernel_build_workers_start_with_the_compile_and_are_spent_at_the_first_run(tmp_path):
    """A network of many stage kernels gets its kernel-build workers while its code is generated
    (runtime._WorkersAhead); the first run hands them their shares, then launches, and computes
    what onnxruntime does."""
    from onnx import TensorProto, helper, numpy_helper

    from luisaml import parallel_build

    rng = np.random.default_rng(3)
    nodes, inits, x = [], [], "x"
    for k in range(parallel_build.MIN_KERNELS + 1):  # a Gemm stage each (the Relu its epilogue)
        inits.append(numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32) * 0.1, f"w{k}"))
        nodes += [helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"]), helper.make_node("Relu", [f"m{k}"], [f"r{k}"])]
        x = f"r{k}"
    nodes.append(helper.make_node("Softmax", [x], ["y"], axis=-1))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    net = luisaml.compile(model, fuse=False)  # (stage kernels, not the fused MLP's one)
    assert net.build_workers is not None and len(net.build_workers.procs) >= 1
    feeds = {"x": rng.standard_normal((300, 64)).astype(np.float32)}
    got = net.run(feeds)["y"]
    assert net.build_workers is None
    np.testing.assert_allclose(got, ort_run(model, feeds)["y"], rtol=1e-4, atol=1e-6)
