"""The tensor-core route on CUDA (luisaml/tensor_cores.py, operators/tiled_mma.py): the device runs in
the front's runtime directory, the start-up self-test finds TF32 and FP16 mma live, and Gemm and
MatMul compiled with tensor_cores="auto" run as mma tiles within TF32's tolerance of float64 numpy
(1e-2 of the norm, torch's; typically ~1e-3), while tensor_cores=False keeps the FP32 tile's 2e-5.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_tensor_cores_cuda.py -q"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import cuda_only

import luisaml
from luisaml import tensor_cores

pytestmark = cuda_only()

TF32_TOL, FP32_TOL = 1e-2, 2e-5


@pytest.fixture(autouse=True, scope="module")
def _front_device():
    """The device starts in the front's directory only when asked first (a process whose device
    another test started plainly runs the FP32 tiles): run this file in a process of its own."""
    if luisaml.device.current() is not None and not tensor_cores._started_in:
        pytest.skip("the CUDA device was started without tensor_cores=True in this process")
    luisaml.device.init("cuda", tensor_cores=True)


def test_device_runs_in_the_front_directory():
    assert tensor_cores._started_in and tensor_cores._started_in[0] is not None, \
        "the CUDA device did not start in the tensor-core runtime directory (the log says why)"
    d = tensor_cores._started_in[0]
    assert (d / "luisa_nvrtc").is_file() and not (d / "luisa_nvrtc").is_symlink()
    assert tensor_cores.check_front(d / "luisa_nvrtc") is None


@pytest.mark.parametrize("kind", tensor_cores.KINDS)
def test_self_test_is_live(kind):
    t = tensor_cores.status(kind)
    assert t.live, t


def _rel(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def _gemm(M, K, N, ta, tb, bias, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    c = rng.standard_normal(N).astype(np.float32)
    inits = {"B": b} | ({"C": c} if bias else {})
    node = helper.make_node("Gemm", ["A", "B"] + (["C"] if bias else []), ["Y"], transA=ta, transB=tb, alpha=0.5)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a.shape))],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [M, N])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    want = 0.5 * ((a.T if ta else a).astype(np.float64) @ (b.T if tb else b)) + (c if bias else 0)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {"A": a}, want


def _batched_matmul(nb, M, K, N, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((nb, M, K)).astype(np.float32)
    b = rng.standard_normal((nb, K, N)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a.shape)),
                           helper.make_tensor_value_info("B", TensorProto.FLOAT, list(b.shape))],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [nb, M, N])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {"A": a, "B": b}, \
        a.astype(np.float64) @ b.astype(np.float64)


CASES = [
    ("gemm whole tiles", lambda: _gemm(256, 128, 256, 0, 0, False, 1)),
    ("gemm ragged, bias, ragged k", lambda: _gemm(300, 200, 200, 0, 0, True, 2)),
    ("gemm transposed", lambda: _gemm(192, 72, 96, 1, 1, True, 3)),
    ("batched matmul, run-time B", lambda: _batched_matmul(3, 128, 96, 160, 4)),
    ("large", lambda: _gemm(1024, 1024, 1024, 0, 0, False, 5)),
]


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_mma_gemm_matches_numpy(name, make):
    model, feeds, want = make()
    tc = luisaml.compile(model, batch_axis=None, tensor_cores="auto")
    fp32 = luisaml.compile(model, batch_axis=None, tensor_cores=False)
    assert "mma_tf32_m16n8k8" in tc.plan.source and "mma_tf32" not in fp32.plan.source
    assert [st.domain for st in tc.plan.schedule.stages].count("blocks") == 1
    got_tc, got_fp32 = tc.run(feeds)["Y"], fp32.run(feeds)["Y"]
    e_tc, e_fp32 = _rel(got_tc, want), _rel(got_fp32, want)
    assert e_fp32 <= FP32_TOL, e_fp32
    assert e_tc <= TF32_TOL, e_tc
    # TF32 rounds: the mma answer is not the FP32 one (a tile that ran the FP32 body would be)
    assert e_tc > 10 * e_fp32, (e_tc, e_fp32)
