"""The zoo's wav2vec2 conv encoder (benchmarks/zoo_models.py AudioEncoder, 32 channels over 400 samples so
that the emulator's Python threads finish) exported as bench_zoo.py does, its CUDA plan under tensor cores
(the mma tiles' FP32 bodies) run in tests/gpu_emulator.py against torch: the first layer's Conv direct
(conv_tiles.direct) and the GroupNorm's affine and GELU the norm's epilogue through its Reshape
(schedule._epilogue), then the tiles, the LayerNorm and the projection (benchmarks/NOTES.md, "wav2vec2's
first layer on CUDA")."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from gpu_emulator import run_plan
from util import plan_of

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_wav2vec2_encoder_cuda_plan_matches_torch(tmp_path):
    import bench_zoo
    import zoo_models

    torch.manual_seed(0)
    m = zoo_models.randomize_norms(zoo_models.AudioEncoder(c=32)).eval()
    x = torch.randn(2, 400)
    bench_zoo.export(m, {"x": x}, tmp_path / "m.onnx")
    plan = plan_of(onnx.load(str(tmp_path / "m.onnx")), "cuda", batch_axis=0, tensor_cores=True)
    first, norm = plan.schedule.stages[:2]
    assert first.domain == "items" and first.root[0].op_type == "Conv", plan.schedule.describe()
    assert norm.root[0].op_type == "InstanceNormalization" and len(norm.epilogue) == 8, plan.schedule.describe()
    with torch.no_grad():
        want = m(x).numpy()
    np.testing.assert_allclose(run_plan(plan, {"x": x.numpy()})["y"], want, rtol=1e-5, atol=1e-5)
