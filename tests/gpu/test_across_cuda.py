"""Reads across on the CUDA backend (luisaml/across.py): ConvNeXt's block at its four stages' sizes
(96 x 56 x 56, 192 x 28 x 28, 384 x 14 x 14, 768 x 7 x 7) and odd ones (37 channels, 5 x 7 and
3 x 37 planes), batches of 1 and 3: the LayerNorm over a permuted NCHW tensor (tiles of 32, 16 and
8 rows through shared memory), the residual Add of a permuted NHWC tensor and LayerNorm2d's permute
back (32 x 32 shared tiles), the downsampling LayerNorm that computes the residual inline. Each
against onnxruntime, with the switch off (across.ACROSS = False: the strided reads) as the same
check of the old plan, and both outputs within float rounding of each other.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_across_cuda.py -q"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from util import cuda_only, ort_run

import luisaml
from luisaml import across

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operators"))
from test_across import _block  # noqa: E402

pytestmark = cuda_only()

RTOL = 2e-5


@pytest.mark.parametrize("c,h,w", [(96, 56, 56), (192, 28, 28), (384, 14, 14), (768, 7, 7), (37, 5, 7), (33, 3, 37)])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mixed", [False, True])
def test_block_against_onnxruntime(c, h, w, batch, mixed):
    model = _block(c, h, w, seed=c + h, mixed=mixed)
    model.ir_version = 10  # the lent machine's onnxruntime reads IR 10 at most
    x = (np.random.default_rng(c + batch).standard_normal((batch, c, h, w)) * 2 + 0.5).astype(np.float32)
    want = ort_run(model, {"x": x})
    got = {}
    for on in (True, False):
        across.ACROSS = on
        try:
            net = luisaml.compile(model)
        finally:
            across.ACROSS = True
        assert net.backend == "cuda"
        assert any(st.across is not None for st in net.plan.schedule.stages) == on
        got[on] = net.run({"x": x})
        for name, ref in want.items():
            np.testing.assert_allclose(got[on][name], ref, rtol=RTOL, atol=RTOL * np.abs(ref).max(), err_msg=name)
    for name in want:
        np.testing.assert_allclose(got[True][name], got[False][name], rtol=1e-5, atol=1e-5 * np.abs(want[name]).max())
