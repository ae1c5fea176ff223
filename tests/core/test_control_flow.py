"""If, Loop and Scan run their subgraphs inside the kernel; compared with onnxruntime."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from util import assert_matches_ort

F = TensorProto.FLOAT


def _branch(name, op, const):
    c = numpy_helper.from_array(np.array(const, np.float32), f"{name}_c")
    return helper.make_graph([helper.make_node(op, ["x", f"{name}_c"], [f"{name}_y"])], name, [],
                             [helper.make_tensor_value_info(f"{name}_y", F, [3])], [c])


@pytest.mark.parametrize("cond", [True, False])
def test_if_reads_outer_tensor(cond):
    node = helper.make_node("If", ["c"], ["y"], then_branch=_branch("then", "Add", [1, 2, 3]),
                            else_branch=_branch("else", "Mul", [-1, 0.5, 2]))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                        helper.make_tensor_value_info("x", F, [3])],
                          [helper.make_tensor_value_info("y", F, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"c": np.array(cond), "x": np.array([0.5, -1.5, 2.0], np.float32)}
    assert_matches_ort(m, feeds, batch_axis=None)


def test_if_per_sample_in_batch_mode():
    """Each thread takes its own branch: the condition is computed from the sample."""
    then_g = _branch("then", "Add", [10, 20, 30])
    else_g = _branch("else", "Sub", [1, 1, 1])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [3])],
                          [helper.make_tensor_value_info("y", F, [3])], [numpy_helper.from_array(np.float32(0), "zero")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([1.0, -0.5, 0.25], np.float32)
    for sign in (1, -1):
        assert_matches_ort(m, {"x": sign * x}, batch_axis=None)


def test_loop_carried_and_scan_outputs():
    """y = x; for i in range(M): y = y * 2 + i; scan collects y each iteration."""
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["i_f"], to=F),
         helper.make_node("Mul", ["y_in", "two"], ["y2"]),
         helper.make_node("Add", ["y2", "i_f"], ["y_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Identity", ["y_out"], ["scan"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("y_in", F, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("y_out", F, [2]),
         helper.make_tensor_value_info("scan", F, [2])],
        [numpy_helper.from_array(np.float32(2), "two")],
    )
    node = helper.make_node("Loop", ["M", "", "x"], ["y", "ys"], body=body)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F, [2])],
                          [helper.make_tensor_value_info("y", F, [2]), helper.make_tensor_value_info("ys", F, [4, 2])],
                          [numpy_helper.from_array(np.int64(4), "M")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert_matches_ort(m, {"x": np.array([1.5, -0.25], np.float32)}, batch_axis=None)


def test_loop_with_condition():
    """while sum(y) < 100: y = y * 3 (no trip count; the body's condition stops it)."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["y_in", "three"], ["y_out"]),
         helper.make_node("ReduceSum", ["y_out"], ["s"], keepdims=0),
         helper.make_node("Less", ["s", "limit"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("y_in", F, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("y_out", F, [3])],
        [numpy_helper.from_array(np.float32(3), "three"), numpy_helper.from_array(np.float32(100), "limit")],
    )
    node = helper.make_node("Loop", ["", "go", "x"], ["y"], body=body)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F, [3])],
                          [helper.make_tensor_value_info("y", F, [3])], [numpy_helper.from_array(np.array(True), "go")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert_matches_ort(m, {"x": np.array([0.5, 1.0, 0.25], np.float32)}, batch_axis=None)


def _scan_body():
    """Body of a running sum and product: states (s, p), scan input x; outputs (s + x, p * x) and
    the scan outputs s + x and x - s."""
    nodes = [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
             helper.make_node("Mul", ["p_in", "x_t"], ["p_out"]),
             helper.make_node("Identity", ["s_out"], ["y_t"]),
             helper.make_node("Sub", ["x_t", "s_in"], ["d_t"])]
    vi = lambda n: helper.make_tensor_value_info(n, F, [2])  # noqa: E731
    return helper.make_graph(nodes, "body", [vi("s_in"), vi("p_in"), vi("x_t")],
                             [vi("s_out"), vi("p_out"), vi("y_t"), vi("d_t")])


@pytest.mark.parametrize("in_axis,in_dir,out_axes,out_dirs", [
    (0, 0, [0, 0], [0, 0]),
    (1, 0, [0, 1], [0, 0]),  # scan along the second axis, stack the second output along axis 1
    (0, 1, [1, 0], [1, 0]),  # read backwards, write the first output backwards
    (-1, 0, [-1, 0], [0, 1]),  # negative axes (opset 11)
])
def test_scan_axes_and_directions(in_axis, in_dir, out_axes, out_dirs):
    x = np.random.default_rng(1).uniform(0.5, 1.5, (4, 2) if in_axis == 0 else (2, 4)).astype(np.float32)
    node = helper.make_node("Scan", ["s0", "p0", "x"], ["s", "p", "ys", "ds"], body=_scan_body(), num_scan_inputs=1,
                            scan_input_axes=[in_axis], scan_input_directions=[in_dir],
                            scan_output_axes=out_axes, scan_output_directions=out_dirs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("s0", F, [2]),
                                        helper.make_tensor_value_info("p0", F, [2]),
                                        helper.make_tensor_value_info("x", F, list(x.shape))],
                          [helper.make_tensor_value_info(n, F, None) for n in ("s", "p", "ys", "ds")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"s0": np.array([0.5, -1.0], np.float32), "p0": np.array([1.0, 2.0], np.float32), "x": x}
    assert_matches_ort(m, feeds, batch_axis=None)


def test_scan_states_that_swap():
    """A body that passes its states through crosswise: the new states must not overwrite each
    other before both are read."""
    vi = lambda n: helper.make_tensor_value_info(n, F, [3])  # noqa: E731
    body = helper.make_graph([helper.make_node("Identity", ["b_in"], ["a_out"]),
                              helper.make_node("Add", ["a_in", "x_t"], ["b_out"]),
                              helper.make_node("Identity", ["a_in"], ["y_t"])],
                             "body", [vi("a_in"), vi("b_in"), vi("x_t")], [vi("a_out"), vi("b_out"), vi("y_t")])
    node = helper.make_node("Scan", ["a0", "b0", "x"], ["a", "b", "ys"], body=body, num_scan_inputs=1)
    g = helper.make_graph([node], "g", [vi("a0"), vi("b0"), helper.make_tensor_value_info("x", F, [5, 3])],
                          [helper.make_tensor_value_info(n, F, None) for n in ("a", "b", "ys")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(2)
    feeds = {"a0": rng.standard_normal(3).astype(np.float32), "b0": rng.standard_normal(3).astype(np.float32),
             "x": rng.standard_normal((5, 3)).astype(np.float32)}
    assert_matches_ort(m, feeds, batch_axis=None)



def test_scan_per_sample_in_batch_mode():
    """Each sample scans its own sequence (axis 1 of [N, 4, 2]) with its own state, one thread per
    sample."""
    vi = lambda n, s: helper.make_tensor_value_info(n, F, s)  # noqa: E731
    body = helper.make_graph([helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
                              helper.make_node("Mul", ["s_in", "x_t"], ["y_t"])], "body",
                             [vi("s_in", ["N", 2]), vi("x_t", ["N", 2])], [vi("s_out", ["N", 2]), vi("y_t", ["N", 2])])
    node = helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=body, num_scan_inputs=1,
                            scan_input_axes=[1], scan_output_axes=[1])
    g = helper.make_graph([node], "g", [vi("s0", ["N", 2]), vi("x", ["N", 4, 2])], [vi("s", None), vi("ys", None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    for n in (1, 5):
        feeds = {"s0": rng.standard_normal((n, 2)).astype(np.float32),
                 "x": rng.standard_normal((n, 4, 2)).astype(np.float32)}
        net, _ = assert_matches_ort(m, feeds, batch_axis=0)
        assert net.plan.symbol == "N"


@pytest.mark.parametrize("cond", [True, False])
def test_if_on_a_constant_condition_is_inlined(cond):
    """An If whose condition folds to a constant becomes the branch it takes: the branch's output
    shape (which differs between the branches) is then known when compiling."""
    from luisaml.runtime import analyze

    then_g = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["t_y"], axis=0)], "then", [],
                               [helper.make_tensor_value_info("t_y", F, None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e_y"])], "else", [],
                               [helper.make_tensor_value_info("e_y", F, None)])
    nodes = [helper.make_node("Size", ["x"], ["n"]),
             helper.make_node("Greater", ["n", "two"], ["c"]) if cond else helper.make_node("Less", ["n", "two"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [3])],
                          [helper.make_tensor_value_info("y", F, None)],
                          [numpy_helper.from_array(np.array(2, np.int64), "two")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    plan = analyze(m, batch_axis=None)
    assert "If" not in {node.op_type for node, _ in plan.ops}
    x = np.array([0.5, -1.5, 2.0], np.float32)
    _, got = assert_matches_ort(m, {"x": x}, batch_axis=None)
    assert got["y"].shape == ((6,) if cond else (3,))


@pytest.mark.parametrize("c1, c2", [(True, True), (True, False), (False, True), (False, False)])
def test_nested_if_reads_the_main_graphs_input(c1, c2):
    """An If inside an If's branch reads x from two graphs out (AttributeError before)."""
    def branch(name, op, out):
        return helper.make_graph([helper.make_node(op, ["x"], [out], name=name)], name, [],
                                 [helper.make_tensor_value_info(out, F, None)])

    inner = helper.make_node("If", ["c2"], ["t"], name="inner_if", then_branch=branch("a", "Neg", "ta"),
                             else_branch=branch("b", "Abs", "tb"))
    then_g = helper.make_graph([inner], "then", [], [helper.make_tensor_value_info("t", F, None)])
    outer = helper.make_node("If", ["c1"], ["y"], name="outer_if", then_branch=then_g,
                             else_branch=branch("c", "Relu", "tc"))
    g = helper.make_graph([outer], "g", [helper.make_tensor_value_info("x", F, ["N", 3]),
                                         helper.make_tensor_value_info("c1", TensorProto.BOOL, []),
                                         helper.make_tensor_value_info("c2", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", F, ["N", 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.array([[-1, 2, -3], [4, -5, 6]], np.float32), "c1": np.array(c1), "c2": np.array(c2)}
    assert_matches_ort(m, feeds)
