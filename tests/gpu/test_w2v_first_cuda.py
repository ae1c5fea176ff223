"""wav2vec2's first layer on the CUDA backend at the zoo's sizes (issue 27; benchmarks/NOTES.md, "wav2vec2's
first layer on CUDA"): the Conv 1 -> 512, kernel 10, stride 5 runs direct (Conv's items form, not a GEMM tile:
operators/conv_tiles.DIRECT_K), and the GroupNorm(512, 512) as torch exports it (Reshape,
InstanceNormalization, Reshape, the affine Mul and Add) with the GELU after it is one stage (the affine and
the GELU the norm's epilogue through the Reshape: luisaml/schedule.py `_epilogue`). Against onnxruntime.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_w2v_first_cuda.py -q"""
from __future__ import annotations

import math

import numpy as np
from onnx import helper
from util import cuda_only, graph_model, ort_run, stage_of

import luisaml

pytestmark = cuda_only()

N = helper.make_node


def _first_layer(C: int = 512, L: int = 16000, G: int = 512, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 1, L)).astype(np.float32)
    T = (L - 10) // 5 + 1
    inits = {
        "w": (rng.standard_normal((C, 1, 10)) / np.sqrt(10)).astype(np.float32),
        "grouped": np.array([0, G, -1], np.int64), "back": np.array([0, C, T], np.int64),
        "ones": np.ones(G, np.float32), "zeros": np.zeros(G, np.float32),
        "gamma": rng.standard_normal((C, 1)).astype(np.float32), "beta": rng.standard_normal((C, 1)).astype(np.float32),
        "sqrt2": np.array(math.sqrt(2), np.float32), "one": np.array(1, np.float32), "half": np.array(0.5, np.float32),
    }
    nodes = [N("Conv", ["x", "w"], ["c"], kernel_shape=[10], strides=[5], name="conv"),
             N("Reshape", ["c", "grouped"], ["g"], name="to_groups"),
             N("InstanceNormalization", ["g", "ones", "zeros"], ["n"], epsilon=1e-5, name="norm"),
             N("Reshape", ["n", "back"], ["nb"], name="back"),
             N("Mul", ["nb", "gamma"], ["m"], name="gamma"), N("Add", ["m", "beta"], ["a"], name="beta"),
             N("Div", ["a", "sqrt2"], ["d"], name="div"), N("Erf", ["d"], ["e"], name="erf"),
             N("Add", ["e", "one"], ["p"], name="plus1"), N("Mul", ["a", "p"], ["q"], name="mul"),
             N("Mul", ["q", "half"], ["y"], name="halve")]
    model = graph_model(nodes, {"x": x}, inits, batch="N", outputs=["y"])
    model.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    return model, {"x": x}


def test_wav2vec2_first_layer_is_two_stages():
    for G in (512, 32):  # (wav2vec2's GroupNorm(512, 512), and groups of 16 channels)
        model, feeds = _first_layer(G=G, seed=G)
        net = luisaml.compile(model, tensor_cores="auto")
        sched = net.plan.schedule
        assert len(sched.stages) == 2, sched.describe()
        assert stage_of(net, "conv").domain == "items", sched.describe()
        assert [n.name for n, _ in stage_of(net, "norm").epilogue][:3] == ["back", "gamma", "beta"], sched.describe()
        np.testing.assert_allclose(net.run(feeds)["y"], ort_run(model, feeds)["y"], rtol=1e-4, atol=1e-4)
