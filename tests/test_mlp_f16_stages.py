"""precision="fp16" with tensor cores on CUDA (luisaml/rewrites/mlp.py f16_stages): the MLP's layers run as
sample-row stages on the FP16 mma tile (operators/tiled_mma.py kind "f16"), not as the fused FP32 kernel;
the input and output are half in their buffers (Plan.half_io). Without a GPU: the plan's shape, and its
stage kernels run in Python (tests/gpu_emulator.py) against two references for RESULTS.md's MLPs
63-128x4-4 and 63-256x4-4 at a small batch:

- a numpy model of what the plan computes, in float64: each tile layer's operands rounded to half (the
  tile's copies), their products summed, the bias added, ReLU, the activation stored as half (Plan.
  half_activations: the next tile would round it so anyway) or float; the last layer (4 outputs: too narrow
  for the tile) in FP32 from the stored activations; the output rounded to half. The emulator sums in float64 in
  another order, so the two differ by ~1e-16 before the output's rounding: equal within one half ulp.
- torch fp16 (CPU, its Linear layers' outputs half): both are fp16 MLPs rounded at different points; each
  one's error against the float64 model is some half ulps of the output's scale, and ours is held to
  twice torch's plus one unit roundoff of half (2^-11) of that scale.

With tensor cores off, on the CPU backend, or with the A/B switch off (FP16_STAGES), the fused kernel runs
as before (its generated source unchanged: benchmarks/NOTES.md has the hashes)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from gpu_emulator import run_plan
from util import export_batched, plan_of, torch_mlp

U16 = 2.0 ** -11  # half's unit roundoff
BATCH = 100  # one group of the tile's 128 samples, partial (rows past the batch load the last sample, store nothing)


def _mlp(width: int, tmp_path):
    module = torch_mlp([63, width, width, width, width, 4])
    return module, onnx.load(export_batched(module, 63, tmp_path / f"mlp{width}.onnx"))


def _layers(module) -> list[tuple[np.ndarray, np.ndarray]]:
    """(W [in, out], b) of each Linear, float32 as the model holds them."""
    import torch

    return [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy())
            for m in module if isinstance(m, torch.nn.Linear)]


def _half(a) -> np.ndarray:
    return np.asarray(a).astype(np.float16).astype(np.float64)


def plan_model(layers, x16: np.ndarray, on_tile: int, half_activations: bool) -> np.ndarray:
    """The float64 model of the plan: the first `on_tile` layers with half operands, the rest FP32 operands,
    ReLU between (its result stored as half with half_activations), the output rounded to half."""
    h = x16.astype(np.float64)
    for i, (w, b) in enumerate(layers):
        h = (_half(h) @ _half(w) if i < on_tile else h @ w.astype(np.float64)) + b
        if i < len(layers) - 1:
            h = np.maximum(h, 0.0)
            h = _half(h) if half_activations else h
    return _half(h)


def _f16_plan(model):
    return plan_of(model, "cuda", precision="fp16", tensor_cores=True, fuse="auto")


@pytest.mark.parametrize("width,half_activations", [(128, True), (256, True), (128, False)])
def test_fp16_mlp_runs_as_stages_on_the_f16_tile(width, half_activations, tmp_path, monkeypatch):
    import torch

    import luisaml.rewrites.mlp as mlp_rewrite  # (by name: test_artifact may have imported luisaml afresh)

    monkeypatch.setattr(mlp_rewrite, "FP16_HALF_ACTIVATIONS", half_activations)
    module, model = _mlp(width, tmp_path)
    plan = _f16_plan(model)
    assert plan.fused is None and plan.half_io and "stages on the FP16 mma tile" in plan.fusion_note
    # the activations' pooled buffers: half (2 bytes an element) or float
    assert {s.dtype for s in plan.schedule.buffers.slots} == {"half" if half_activations else "float"}
    # the four wide layers on the tile; the last (4 outputs) a warp a sample (256) or items (128), in FP32
    tiles = [op.block_tiling() for st in plan.schedule.stages for _, op in st.nodes[:1] if st.domain == "blocks"]
    mma = [t for t in tiles if type(t).__name__ == "MmaTiling"]
    assert len(mma) == 4 and all(t.kind == "f16" for t in mma)
    assert "mma_tf32" not in plan.source
    x16 = (np.random.default_rng(1).standard_normal((BATCH, 63)) * 2).astype(np.float16)
    got = run_plan(plan, {"x": x16})["y"]
    layers = _layers(module)
    want = plan_model(layers, x16, on_tile=4, half_activations=half_activations)
    ulp = np.spacing(want.astype(np.float16)).astype(np.float64)
    assert (np.abs(got - want) <= ulp).all(), f"worst {np.abs(got - want).max():.3g}"

    exact = x16.astype(np.float64)
    for i, (w, b) in enumerate(layers):
        exact = exact @ w.astype(np.float64) + b
        exact = np.maximum(exact, 0.0) if i < len(layers) - 1 else exact
    with torch.no_grad():
        theirs = module.half()(torch.from_numpy(x16)).double().numpy()
    scale = np.abs(exact).max()
    ours_err, torch_err = np.abs(got - exact).max() / scale, np.abs(theirs - exact).max() / scale
    assert ours_err <= 2 * torch_err + U16, f"ours {ours_err:.3g}, torch fp16 {torch_err:.3g}"


def test_fp16_without_tensor_cores_keeps_the_fused_kernel(tmp_path):
    _, model = _mlp(128, tmp_path)
    plan = plan_of(model, "cuda", precision="fp16", tensor_cores=False, fuse="auto")
    assert plan.fused is not None and plan.fused.precision == "fp16" and not plan.half_io


def test_fp16_stages_switch_off_keeps_the_fused_kernel(tmp_path, monkeypatch):
    import luisaml.rewrites.mlp as mlp_rewrite  # (by name: test_artifact may have imported luisaml afresh)

    _, model = _mlp(128, tmp_path)
    monkeypatch.setattr(mlp_rewrite, "FP16_STAGES", False)
    plan = _f16_plan(model)
    assert plan.fused is not None and plan.fused.precision == "fp16" and not plan.half_io
    assert "mma_f16" not in plan.source


def test_fp16_on_the_cpu_backend_keeps_the_fused_kernel(tmp_path):
    """The CPU backend never takes tensor cores: precision="fp16" is the fused (emulated) kernel as before."""
    _, model = _mlp(32, tmp_path)
    plan = plan_of(model, "cpu", precision="fp16", tensor_cores="auto", fuse="auto")
    assert plan.fused is not None and plan.fused.precision == "fp16" and not plan.half_io


def test_fp16_stages_still_need_an_mlp_chain(tmp_path):
    """fp16 remains an MLP chain's precision whichever form runs it: a graph of two outputs is refused."""
    from onnx import TensorProto, helper, numpy_helper

    from luisaml.errors import CompileError

    w = numpy_helper.from_array(np.ones((8, 64), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64]),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 64])], [w])
    with pytest.raises(CompileError, match="needs an MLP chain"):
        _f16_plan(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
