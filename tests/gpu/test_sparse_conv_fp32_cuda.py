"""fvdb.SparseConv3d on tiled.py's FP32 tile on CUDA in each SparseConv3d.fp32_form ("early" the tile as
it was, "rows", "ahead": benchmarks/NOTES.md, "The FP32 tile's next step in flight"; "uniform", the default:
"addresses a tap, not a step"): the output within
FP32's tolerance of tests/fvdb's float64 reference, and the same bits in every form (they change which
loads run when, never a sum). A folded map and one built on the device, 64 output channels (the 64 x 64
tiles of 128 threads). The emulated run (no GPU): tests/fvdb/test_sparse_conv_fp32_tile.py.

    LUISAML_BACKEND=cuda python -m pytest tests/gpu/test_sparse_conv_fp32_cuda.py -q"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from util import cuda_only

import luisaml

pytestmark = cuda_only()

FVDB = Path(__file__).resolve().parents[1] / "fvdb"
if str(FVDB) not in sys.path:
    sys.path.insert(0, str(FVDB))  # (the suites' `from fvdb_reference import ...`)
from test_sparse_conv_mma import _grid, _layer  # noqa: E402

FP32_TOL = 1e-5


@pytest.mark.parametrize("constant", [True, False])
def test_forms_give_the_same_bits(constant, monkeypatch):
    from luisaml.operators.fvdb.conv import SparseConv3d

    m, feeds, want = _layer(_grid(), 16, 64, 3, constant)
    got = {}
    for form in ("early", "rows", "ahead", "uniform"):
        monkeypatch.setattr(SparseConv3d, "fp32_form", form)
        net = luisaml.compile(m, backend="cuda", batch_axis=None, tensor_cores=False)
        got[form] = np.asarray(net.run(feeds)["y"])
        err = np.abs(got[form] - want).max() / np.abs(want).max()
        assert err <= FP32_TOL, (form, err)
    for form in ("rows", "ahead", "uniform"):
        np.testing.assert_array_equal(got[form], got["early"])
