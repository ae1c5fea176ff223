"""TopK's block per long line on the CUDA backend (operators/topk_block.py) against onnxruntime:
the detector head's shape (one line of 80,000, k = 64), lines along a middle axis, a ragged line,
largest and smallest, with ties, NaN and +-inf; values and indices exactly. Each asserts the node ran
as a blocks stage. Where NaNs go differs between onnxruntime releases (1.32, the test extra's, ranks
NaN above every number, as torch does; the lent machine's older one ranked it below): the order is
checked against a numpy reference of 1.32's rule, and against the onnxruntime at hand where it agrees.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_topk_cuda.py -q"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import cuda_only, ort_run

import luisaml

pytestmark = cuda_only()


def _model(shape, axis: int, k: int, largest: int):
    out = list(shape)
    out[axis] = k
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("v", TensorProto.FLOAT, out),
                           helper.make_tensor_value_info("i", TensorProto.INT64, out)],
                          [numpy_helper.from_array(np.array([k], np.int64), "k")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    return m


@pytest.mark.parametrize("shape,axis,k,largest,ties", [
    ((1, 80000), -1, 64, 1, False),  # the detector head's line
    ((1, 80000), -1, 64, 0, True),
    ((3, 5000, 2), 1, 10, 1, True),  # 6 lines a stride of 2 apart
    ((2, 1100), -1, 33, 0, False),  # ragged, one warp a line
])
def _reference(x: np.ndarray, axis: int, k: int, largest: int) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime 1.32's TopK in numpy: NaN above every number (first when largest, never among the
    smallest before the numbers run out), equal values by index."""
    xs = np.moveaxis(x, axis, -1)
    nan = np.isnan(xs)
    finite = np.where(nan, 0, xs)
    keys = (-finite, ~nan) if largest else (finite, nan)  # lexsort: the last key first, stable
    order = np.lexsort(keys, axis=-1)[..., :k]
    return (np.moveaxis(np.take_along_axis(xs, order, -1), -1, axis), np.moveaxis(order, -1, axis).astype(np.int64))


def test_topk_blocks_equal_onnxruntime(shape, axis, k, largest, ties):
    rng = np.random.default_rng(k)
    x = (rng.integers(-20, 21, shape) if ties else rng.standard_normal(shape)).astype(np.float32)
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, 7, replace=False)] = np.nan
    flat[rng.choice(flat.size, 5, replace=False)] = np.inf
    flat[rng.choice(flat.size, 5, replace=False)] = -np.inf
    model = _model(shape, axis, k, largest)
    net = luisaml.compile(model, batch_axis=None)
    assert net.backend == "cuda" and [st.domain for st in net.plan.schedule.stages] == ["blocks"]
    got, (v, i) = net.run({"x": x}), _reference(x, axis, k, largest)
    np.testing.assert_array_equal(got["i"], i)
    np.testing.assert_array_equal(got["v"], v)
    want = ort_run(model, {"x": x})
    if np.array_equal(want["i"], i):  # (an older onnxruntime ranks NaN otherwise: see the docstring)
        np.testing.assert_array_equal(got["v"], want["v"])
