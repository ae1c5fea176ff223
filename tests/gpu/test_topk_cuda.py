"""TopK's long-line forms on the CUDA backend against onnxruntime: the chunks and merge
(operators/topk_chunks.py) and the block per line (operators/topk_block.py,
LUISAML_TOPK=block): the detector head's shape (one line of 80,000, k = 64), a line of 200,000 (k = 100), 8
lines of 20,000, lines along a middle axis, ragged lines, k the whole line, int64, batched samples,
largest and smallest, with ties, NaN, +-inf (and, in the chunked form, -0 and subnormals, which fast
math would flush); values and indices exactly. Each asserts the form its stages took. Where NaNs go
differs between onnxruntime releases (1.32, the test extra's, ranks NaN above every number, as torch
does; the lent machine's older one ranked it below): the order is checked against a numpy reference
of 1.32's rule, and against the onnxruntime at hand where it agrees.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_topk_cuda.py -q"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import cuda_only, ort_run

import luisaml

pytestmark = cuda_only()


def _model(shape, axis: int, k: int, largest: int, elem=TensorProto.FLOAT):
    out = list(shape)
    out[axis] = k
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, list(shape))],
                          [helper.make_tensor_value_info("v", elem, out),
                           helper.make_tensor_value_info("i", TensorProto.INT64, out)],
                          [numpy_helper.from_array(np.array([k], np.int64), "k")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    return m


def _reference(x: np.ndarray, axis: int, k: int, largest: int) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime 1.32's TopK in numpy: NaN above every number (first when largest, never among the
    smallest before the numbers run out), equal values by index (-0 equal to +0)."""
    xs = np.moveaxis(x, axis, -1)
    nan = np.isnan(xs)
    finite = np.where(nan, 0, xs)
    keys = (-finite, ~nan) if largest else (finite, nan)  # lexsort: the last key first, stable
    order = np.lexsort(keys, axis=-1)[..., :k]
    return (np.moveaxis(np.take_along_axis(xs, order, -1), -1, axis), np.moveaxis(order, -1, axis).astype(np.int64))


def _data(shape, seed: int, ties: bool, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.integers(-20, 21, shape) if ties else rng.standard_normal(shape)).astype(dtype)
    if dtype == np.float32:
        flat = x.reshape(-1)
        for value, count in ((np.nan, 7), (np.inf, 5), (-np.inf, 5)):
            flat[rng.choice(flat.size, count, replace=False)] = value
    return x


def _check(model, x, axis, k, largest, stages):
    net = luisaml.compile(model, batch_axis=None)
    assert net.backend == "cuda" and [st.domain for st in net.plan.schedule.stages] == stages
    got, (v, i) = net.run({"x": x}), _reference(x, axis, k, largest)
    np.testing.assert_array_equal(got["i"], i)
    np.testing.assert_array_equal(got["v"], v)
    want = ort_run(model, {"x": x})
    if np.array_equal(want["i"], i):  # (an older onnxruntime ranks NaN otherwise: see the docstring)
        np.testing.assert_array_equal(got["v"], want["v"])


@pytest.mark.parametrize("form", ["chunks", "block"])
@pytest.mark.parametrize("shape,axis,k,largest,ties", [
    ((1, 80000), -1, 64, 1, False),  # the detector head's line
    ((1, 80000), -1, 64, 0, True),
    ((3, 5000, 2), 1, 10, 1, True),  # 6 lines a stride of 2 apart
    ((2, 1100), -1, 33, 0, False),  # ragged, one warp a line
    ((8, 20000), -1, 32, 1, True),
])
def test_topk_forms_equal_onnxruntime(shape, axis, k, largest, ties, form, monkeypatch):
    monkeypatch.setenv("LUISAML_TOPK", form)
    x = _data(shape, k, ties)
    _check(_model(shape, axis, k, largest), x, axis, k, largest, ["blocks", "blocks"] if form == "chunks" else ["blocks"])


@pytest.mark.parametrize("shape,k,largest", [
    ((1, 200000), 100, 1),
    ((1, 80000), 64, 1),
    ((1, 80000), 64, 0),
    ((2, 3000), 3000, 1),  # k the whole line
    ((1, 1024), 1, 0),
])
def test_chunks_with_zeros_and_subnormals(shape, k, largest):
    """The chunked form ranks values by their bits: -0 ties +0 (by index), subnormals between them
    and the numbers, all among the first picks (the numbers 1 to 20 beyond them, ties)."""
    rng = np.random.default_rng(k)
    x = (rng.integers(1, 21, shape) * (-1 if largest else 1)).astype(np.float32)
    flat = x.reshape(-1)
    for value, count in ((-0.0, 9), (0.0, 9), (1e-45, 4), (-1e-45, 4), (1e-40, 4), (-1e-40, 4), (np.nan, 3)):
        flat[rng.choice(flat.size, count, replace=False)] = value
    _check(_model(shape, -1, k, largest), x, -1, k, largest, ["blocks", "blocks"])


def test_chunks_int64_and_batched():
    shape = (1, 50000)
    x = _data(shape, 3, True, np.int64)
    want = _reference(x, -1, 64, 1)
    net = luisaml.compile(_model(shape, -1, 64, 1, TensorProto.INT64), batch_axis=None)
    got = net.run({"x": x})
    np.testing.assert_array_equal(got["i"], want[1])
    np.testing.assert_array_equal(got["v"], want[0])
    model = _model(("N", 2, 3000), -1, 20, 1)
    x = _data((3, 2, 3000), 4, True)
    net = luisaml.compile(model)
    assert [(st.domain, st.batched) for st in net.plan.schedule.stages] == [("blocks", True)] * 2
    got, (v, i) = net.run({"x": x}), _reference(x, -1, 20, 1)
    np.testing.assert_array_equal(got["i"], i)
    np.testing.assert_array_equal(got["v"], v)
