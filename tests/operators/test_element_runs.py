"""Element stages on the CPU compute a run of schedule.ELEMENTS consecutive elements a thread (the
last run guarded): element counts that 16 divides and that it does not, over a batch, a
BatchNorm + Relu over a Concat (DenseNet's), a Transpose materialised, a Split's outputs, an
epilogue after an element root, against onnxruntime."""
import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of


@pytest.mark.parametrize("shape", [(3, 4, 4), (5, 7, 3), (1, 1, 5), (2, 8, 33)])
def test_element_runs_equal_onnxruntime(shape):
    c = shape[0]
    nodes = [helper.make_node("Relu", ["a"], ["ra"], name="ra"),
             helper.make_node("Sigmoid", ["b"], ["sb"], name="sb"),
             helper.make_node("Concat", ["ra", "sb"], ["cat"], name="cat", axis=1),
             helper.make_node("BatchNormalization", ["cat", "s", "bias", "m", "v"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["y"], name="y"),
             helper.make_node("Transpose", ["a"], ["t"], name="t", perm=[0, 3, 1, 2]),
             helper.make_node("Split", ["b"], ["s0", "s1"], name="split", axis=3, num_outputs=2),
             helper.make_node("ArgMax", ["a"], ["am"], name="am", axis=2),
             helper.make_node("Cast", ["am"], ["amf"], name="cast", to=1),
             helper.make_node("Exp", ["amf"], ["e"], name="exp")]
    inits = {"s": rand((2 * c,), seed=3, low=0.5, high=1.5), "bias": rand((2 * c,), seed=4),
             "m": rand((2 * c,), seed=5), "v": rand((2 * c,), seed=6, low=0.5, high=2.0)}
    feeds = {"a": rand((3, *shape), seed=1), "b": rand((3, *shape), seed=2)}
    model = graph_model(nodes, {k: v[:2] for k, v in feeds.items()}, inits, batch="N",
                        outputs=["y", "t", "s0", "s1", "e"])
    net, _ = assert_matches_ort(model, feeds, rtol=1e-5, atol=1e-5)
    st = stage_of(net, "bn")
    assert st.domain == "element" and st.elements == 16
    assert st.items == -(-int(np.prod((2 * c,) + shape[1:])) // 16)


def test_cpu_stage_kernels_take_blocks_of_32():
    """The merged CPU kernel sets its block size (codegen.CPU_BLOCK): a stage of few work items
    spreads over the cores. A stage of 3 items and one of 40 equal onnxruntime."""
    from luisaml.codegen import CPU_BLOCK

    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], name="g"),
             helper.make_node("Softmax", ["h"], ["y"], name="sm", axis=-1)]
    model = graph_model(nodes, {"x": rand((3, 8))}, {"w": rand((8, 40), seed=1)})
    net, _ = assert_matches_ort(model, {"x": rand((3, 8), seed=2)}, rtol=1e-5, atol=1e-5, batch_axis=None)
    assert f"set_block_size({CPU_BLOCK}, 1, 1)" in net.plan.source and CPU_BLOCK == 32
