"""DFT and STFT against numpy's FFTs (onnxruntime runs DFT-20 too: checked as well)."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of
from stage_forms import assert_stage_forms

import luisaml

I64 = np.int64


def _complex(v):
    return np.stack([v.real, v.imag], axis=-1).astype(np.float32)


def test_dft_against_numpy():
    x = rand((2, 12, 3, 1), seed=1)
    z = rand((2, 12, 3, 2), seed=2)
    xr, zc = x[..., 0].astype(np.float64), z[..., 0] + 1j * z[..., 1]
    half = _complex(np.fft.rfft(xr, axis=1))
    feeds = {"x": x, "z": z, "h": half}
    inits = {"a1": np.array(1, I64), "a2": np.array(-2, I64), "n8": np.array(8, I64), "n16": np.array(16, I64),
             "n12": np.array(12, I64)}
    nodes = [
        helper.make_node("DFT", ["x", "", "a1"], ["fft"]),
        helper.make_node("DFT", ["z", "", "a2"], ["cfft_axis2"]),
        helper.make_node("DFT", ["z", "", "a1"], ["ifft"], inverse=1),
        helper.make_node("DFT", ["x", "", "a1"], ["rfft"], onesided=1),
        helper.make_node("DFT", ["x", "n8", "a1"], ["trunc"]),
        helper.make_node("DFT", ["z", "n16", "a1"], ["padded"]),
        helper.make_node("DFT", ["h", "n12", "a1"], ["irfft"], onesided=1, inverse=1),
    ]
    got = luisaml.compile(graph_model(nodes, feeds, inits, opset=20), batch_axis=None).run(feeds)
    want = {
        "fft": _complex(np.fft.fft(xr, axis=1)),
        "cfft_axis2": _complex(np.fft.fft(zc, axis=2)),
        "ifft": _complex(np.fft.ifft(zc, axis=1)),
        "rfft": _complex(np.fft.rfft(xr, axis=1)),
        "trunc": _complex(np.fft.fft(xr, n=8, axis=1)),
        "padded": _complex(np.fft.fft(zc, n=16, axis=1)),
        "irfft": np.fft.irfft(half[..., 0] + 1j * half[..., 1], n=12, axis=1)[..., None].astype(np.float32),
    }
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=2e-5, err_msg=name)


def test_dft_against_onnxruntime_and_opset17():
    x = rand((3, 10, 1), seed=3)
    inits = {"a": np.array(1, I64)}
    nodes = [helper.make_node("DFT", ["x", "", "a"], ["y"]), helper.make_node("DFT", ["x", "", "a"], ["r"], onesided=1)]
    assert_matches_ort(graph_model(nodes, {"x": x}, inits, opset=20), {"x": x}, batch_axis=None, rtol=1e-5, atol=2e-5)
    m17 = graph_model([helper.make_node("DFT", ["x"], ["y"], axis=1)], {"x": x}, opset=17)
    got = luisaml.compile(m17, batch_axis=None).run({"x": x})["y"]
    np.testing.assert_allclose(got, _complex(np.fft.fft(x[..., 0].astype(np.float64), axis=1)), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("onesided", [0, 1])
def test_stft(onesided):
    sig = rand((2, 40, 1), seed=4)
    win = np.hanning(8).astype(np.float32)
    feeds = {"s": sig}
    inits = {"step": np.array(5, I64), "w": win, "len": np.array(8, I64)}
    nodes = [helper.make_node("STFT", ["s", "step", "w"], ["windowed"], onesided=onesided),
             helper.make_node("STFT", ["s", "step", "", "len"], ["plain"], onesided=onesided)]
    got = luisaml.compile(graph_model(nodes, feeds, inits, opset=17), batch_axis=None).run(feeds)
    frames = np.stack([sig[:, f * 5: f * 5 + 8, 0] for f in range(7)], axis=1).astype(np.float64)
    fft = np.fft.rfft if onesided else np.fft.fft
    np.testing.assert_allclose(got["windowed"], _complex(fft(frames * win, axis=-1)), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(got["plain"], _complex(fft(frames, axis=-1)), rtol=1e-5, atol=2e-5)


def test_stage_forms():
    """DFT and STFT one work item per output bin in a batched model, at two batch sizes: DFT against
    onnxruntime (one with a Relu as its stage's epilogue), STFT against numpy."""
    inits = {"a1": np.array(1, I64), "a2": np.array(2, I64)}
    nodes = [helper.make_node("DFT", ["x", "", "a1"], ["fft"], name="fft"),
             helper.make_node("DFT", ["z", "", "a2"], ["ifft"], name="ifft", inverse=1),
             helper.make_node("DFT", ["x", "", "a1"], ["half"], name="half", onesided=1),
             helper.make_node("Relu", ["half"], ["relu"], name="relu")]
    model = graph_model(nodes, {"x": rand((2, 10, 3, 1)), "z": rand((2, 4, 6, 2))}, inits, opset=20, batch="N")
    net = assert_stage_forms(model, lambda n: {"x": rand((n, 10, 3, 1), seed=n), "z": rand((n, 4, 6, 2), seed=n + 1)},
                             ["fft", "ifft", "half"], rtol=1e-5, atol=2e-5)
    assert stage_of(net, "relu") is stage_of(net, "half") and stage_of(net, "half").domain == "items"

    inits = {"step": np.array(5, I64), "w": np.hanning(8).astype(np.float32)}
    # onesided given: onnx's shape inference takes its default for 0 (the spec and onnxruntime: 1)
    stft = helper.make_node("STFT", ["s", "step", "w"], ["y"], name="stft", onesided=1)
    model = graph_model([stft], {"s": rand((2, 40, 1))}, inits, opset=17, batch="N")
    net = luisaml.compile(model)
    assert stage_of(net, "stft").domain == "items"
    for n in (2, 5):
        sig = rand((n, 40, 1), seed=n)
        frames = np.stack([sig[:, f * 5: f * 5 + 8, 0] for f in range(7)], axis=1).astype(np.float64)
        want = _complex(np.fft.rfft(frames * inits["w"], axis=-1))
        np.testing.assert_allclose(net.run({"s": sig})["y"], want, rtol=1e-5, atol=2e-5)
