"""The rows-kept rewrite on the CUDA backend (luisaml/rewrites/rows_kept.py): the kept rows bit for bit what
every row gives (rows_kept=False) where it fires -- the detector's head of 10 channels (items form, B first)
and a head of 32 (tiled.py's FP32 tile, B last) -- and close to onnxruntime; on the TF32 mma tile it does not
fire. The heads are tests/core/test_rows_kept.py's.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_rows_kept_cuda.py -q"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from util import assert_close_to_ort, assert_same_bits, cuda_only

import luisaml

pytestmark = cuda_only()


def _suite():
    path = Path(__file__).resolve().parents[1] / "core" / "test_rows_kept.py"
    spec = importlib.util.spec_from_file_location("rows_kept_suite", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUITE = _suite()


@pytest.mark.parametrize("cls, order", [(2, "items"), (24, "fp32")])
@pytest.mark.parametrize("size", [(32, 32, 64), (203, 203, 64)])  # (the detector's BEV at 100k points: 203 x 203)
def test_kept_rows_bit_for_bit_on_cuda(cls, order, size):
    H, W, K = size
    model, feeds = SUITE.head(C=32, H=H, W=W, K=K, CLS=cls)
    on = luisaml.compile(model, batch_axis=None, backend="cuda", tensor_cores=False)
    off = luisaml.compile(model, batch_axis=None, backend="cuda", tensor_cores=False, rows_kept=False)
    assert [op.order for n, op in on.plan.main.ops if n.op_type == "RowsKeptConv"] == [order]
    got = on.run(feeds)
    assert_same_bits(got, off.run(feeds))
    assert_close_to_ort(got, model, feeds)


def test_not_on_the_mma_tile():
    model, _ = SUITE.head(C=32, H=64, W=64, K=64, CLS=24)
    net = luisaml.compile(model, batch_axis=None, backend="cuda", tensor_cores="auto")
    if not any(getattr(op, "tensor_cores", False) for _, op in net.plan.main.ops):
        pytest.skip("no Conv of this head took the tensor-core tile on this device (not live, or not this shape)")
    assert "not rewritten" in net.plan.rows_kept[0]
