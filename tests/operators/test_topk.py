"""TopK in parallel stages against onnxruntime: one work item per line (both outputs), batched,
and the per-batch compile of a TopK along the batch axis. (Its semantics on every axis, k and dtype
are tested in test_scan_ops.py, NaN in test_nan.py.)"""

import numpy as np
import pytest
from onnx import helper

from test_reduce import assert_compiles_per_batch, assert_runs_in_parallel
from util import graph_model, rand, single_node_model, stage_of

TOPK = [  # (axis, k, largest, the graph outputs)
    (-1, 3, 1, ["v", "i"]),
    (1, 2, 0, ["v", "i"]),
    (2, 5, 1, ["v", "i"]),
    (1, 4, 1, ["v"]),  # the indices unused (still stored: a buffer nobody reads)
    (-1, 2, 0, ["i"]),  # the values unused
]


@pytest.mark.parametrize("axis,k,largest,outs", TOPK, ids=[f"case{k}" for k in range(len(TOPK))])
@pytest.mark.parametrize("dtype", [np.float32, np.int64], ids=["f32", "i64"])
def test_topk_runs_one_item_per_line(axis, k, largest, outs, dtype):
    """Batched: a stage runs one work item per line along the axis, storing both outputs."""
    def feeds(n):  # small integers: many ties, broken by the lower index
        return {"x": rand((n, 4, 5), dtype, seed=n, low=-3, high=3)}

    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="TopK_0", axis=axis, largest=largest)
    m = graph_model([node], feeds(2), {"k": np.array([k], np.int64)}, opset=11, batch="N", outputs=outs)
    net = assert_runs_in_parallel(m, "TopK_0", feeds)
    assert stage_of(net, "TopK_0").domain == "items"


def test_topk_along_the_batch_axis_compiles_per_batch():
    """A TopK along the batch axis mixes samples: the network compiles per batch size."""
    m = single_node_model("TopK", {"x": rand((3, 7))}, outputs=["v", "i"], initializers={"k": np.array([2], np.int64)},
                          opset=11, batch="N", axis=0)
    net = assert_compiles_per_batch(m, "TopK_0", lambda n: {"x": rand((n, 7), seed=n)})
    assert stage_of(net, "TopK_0").domain == "items"


def test_topk_indices_read_by_another_stage():
    """The indices (the second output) feed a GatherElements: they live in a buffer between the
    stages, the values nobody reads in another."""
    nodes = [helper.make_node("TopK", ["x", "k"], ["v", "i"], name="TopK_0", axis=-1),
             helper.make_node("GatherElements", ["x", "i"], ["y"], axis=-1)]
    m = graph_model(nodes, {"x": rand((2, 4, 6))}, {"k": np.array([3], np.int64)}, opset=11, batch="N", outputs=["y"])
    net = assert_runs_in_parallel(m, "TopK_0", lambda n: {"x": rand((n, 4, 6), seed=n)})
    assert stage_of(net, "TopK_0").domain == "items"
