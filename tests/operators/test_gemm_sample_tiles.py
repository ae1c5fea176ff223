"""Gemm and MatMul layers that run one row a sample (an MLP run per sample) with wide constant weights:
a work item computes two samples' rows, reading each row of the prepacked weights once for both
(Dense.samples_per_item). Against onnxruntime, for odd and even batches (the last sample of an odd
batch has no partner), a batch of one, an epilogue that reads another per-sample tensor (a residual
Add, bound at each row's own sample), and the layers that keep one sample a work item."""
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from util import assert_matches_ort, graph_model, rand, stage_of


def _residual_mlp(k: int = 130, width: int = 144):
    """x [N, k] -> Gemm k->width, Relu -> Gemm width->width + residual, Relu -> MatMul width->20 (narrow)."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((width, k)) / np.sqrt(k)).astype(np.float32)
    w2 = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    w3 = (rng.standard_normal((width, 20)) / np.sqrt(width)).astype(np.float32)
    b = rng.standard_normal(width).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b"], ["h1"], name="wide1", transB=1),
             helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
             helper.make_node("Gemm", ["r1", "w2", "b"], ["h2"], name="wide2", transB=1),
             helper.make_node("Add", ["h2", "r1"], ["s"], name="residual"),
             helper.make_node("Relu", ["s"], ["r2"], name="relu2"),
             helper.make_node("MatMul", ["r2", "w3"], ["y"], name="narrow")]
    return graph_model(nodes, {"x": rand((3, k))}, {"w1": w1, "w2": w2, "w3": w3, "b": b}, batch="N")


@pytest.mark.parametrize("batch", [1, 2, 7, 64])
def test_two_samples_a_work_item_equal_onnxruntime(batch):
    model = _residual_mlp()
    net, _ = assert_matches_ort(model, {"x": rand((batch, 130), seed=batch)}, rtol=1e-5, atol=1e-5)
    wide = [stage_of(net, n) for n in ("wide1", "wide2")]
    assert all(st is not None and st.samples == 2 for st in wide)
    assert stage_of(net, "narrow").samples == 1  # N = 20: no tile across samples
    # the same network again for another batch size: per sample, no recompile
    assert_matches_ort(model, {"x": rand((5, 130), seed=11)}, rtol=1e-5, atol=1e-5)


def test_forward_per_sample_is_unchanged(tmp_path):
    """The per-sample @luisa.func (embedded in a user kernel) does not take the stage form: it still
    exists and the network still runs per sample for any batch."""
    model = _residual_mlp()
    net, _ = assert_matches_ort(model, {"x": rand((3, 130), seed=4)}, rtol=1e-5, atol=1e-5)
    assert net.forward is not None


def test_saved_and_loaded_bit_for_bit(tmp_path):
    """A built artifact runs the two-sample kernels as compiled: the same outputs to the bit."""
    import luisaml
    from util import export_batched, torch_mlp

    net = luisaml.compile(export_batched(torch_mlp([130, 160, 150, 3]), 130, tmp_path / "m.onnx"))
    assert [st.samples for st in net.plan.schedule.stages] == [2, 2, 1]
    net.save(tmp_path / "m.lml")
    x = rand((7, 130), seed=3)
    np.testing.assert_array_equal(luisaml.load(tmp_path / "m.lml").run({"x": x})["y"], net.run({"x": x})["y"])
