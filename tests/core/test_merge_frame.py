"""The CPU backend's merged kernel leaves out a stage whose local arrays pass MERGE_LOCAL_BYTES (a
kernel of its own), so no other stage's threads pay for its frame (issue 27, item 5)."""

import numpy as np
from onnx import TensorProto, helper

from util import assert_matches_ort

from luisaml import emission


def test_local_bytes_counts_declared_arrays():
    body = "    a1 = Arr_float_1728()\n    b2 = Arr_half_100()\n    x = a1[3]\n"
    assert emission.local_bytes(body) == 1728 * 4 + 100 * 2


def _model():
    """y = Relu(x) over 3000 elements, and z = If(c): x2 + 1 (3000 floats in a local array of the
    branch) else x2 - 1: the If runs whole, its branch's tensor a local array of 12 KB."""
    n = 3000
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    then = helper.make_graph([helper.make_node("Add", ["x2", "one"], ["t1"]), helper.make_node("Mul", ["t1", "t1"], ["t"])],
                             "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [n])], [one])
    other = helper.make_graph([helper.make_node("Sub", ["x2", "one"], ["e1"]), helper.make_node("Mul", ["e1", "e1"], ["e"])],
                              "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, [n])], [one])
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("If", ["c"], ["z"], then_branch=then, else_branch=other)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n]),
                                        helper.make_tensor_value_info("x2", TensorProto.FLOAT, [n]),
                                        helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n]),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, [n])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), n


def test_a_stage_with_big_local_arrays_is_a_kernel_of_its_own(tmp_path):
    model, n = _model()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(n).astype(np.float32), "x2": rng.standard_normal(n).astype(np.float32),
             "c": np.array(True)}
    net, _ = assert_matches_ort(model, feeds, batch_axis=None)
    plan = net.plan
    big = [k for k in plan.kernels if k != "stages"]
    assert big and "stages" in plan.kernels and not plan.merged_stages
    assert emission.local_bytes(plan.source.split("def stages(", 1)[1].split("\ndef ", 1)[0]) <= emission.MERGE_LOCAL_BYTES
    feeds["c"] = np.array(False)
    assert_matches_ort(model, feeds, batch_axis=None)
    import luisaml

    loaded = luisaml.load(net.save(tmp_path / "frame.lml"))  # (the artifact keeps which kernel a stage launches)
    assert loaded.plan.stage_kernels == plan.stage_kernels
    np.testing.assert_array_equal(loaded.run(feeds)["z"], net.run(feeds)["z"])
