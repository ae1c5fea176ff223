"""One neighbour map per grid pair and kernel geometry (issue 28 item 6): a model whose layers each
build their own kernel map (and coarse grid) compiles with the equal ones merged before the grid steps
are cut out (passes/cleanup.merge_equal_nodes), `inspect` lists the maps with the convolutions reading
each, and the outputs are bit-identical to the model compiled without merging (and equal torch's)."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import luisaml
from luisaml import report
from luisaml.fvdb import torch_ops as F
from luisaml.passes import cleanup
from util import example_module


@pytest.fixture(scope="module")
def example():
    with example_module("lidar_detector.py") as module:
        yield module


class EveryLayerItsMap(torch.nn.Module):
    """Each layer builds its own map, as a model written layer by layer does; the coarse grid twice."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.a, self.b = F.SparseConv3d(4, c, 3), F.SparseConv3d(c, c, 3)
        self.down, self.c = F.SparseConv3d(c, c, 3), F.SparseConv3d(c, c, 3)

    def forward(self, x, *fine):
        h = torch.relu(self.a(x, F.sparse_conv_kernel_map(fine, fine, 3)))
        h = torch.relu(self.b(h, F.sparse_conv_kernel_map(fine, fine, 3)))
        h = torch.relu(self.down(h, F.sparse_conv_kernel_map(fine, F.conv_grid(fine, 3, 2), 3, 2)))
        coarse = F.conv_grid(fine, 3, 2)
        return self.c(h, F.sparse_conv_kernel_map(coarse, coarse, 3))


def test_layers_over_one_grid_pair_share_one_map_bit_identical(example, monkeypatch):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = EveryLayerItsMap().eval()
    fine, x = example.voxelize(example.lidar_frame(600, rng, 5.0), 0.4)
    proto = example.export(model, x, fine, "voxel_features", ["y"])
    ops = [n.op_type for n in proto.graph.node if n.domain == "fvdb"]
    assert ops.count("SparseConvKernelMap") == 4 and ops.count("ConvGrid") == 2  # as exported: one a layer

    net = luisaml.compile(proto)
    rep = report.from_plan(net.plan)
    maps = rep["neighbour_maps"]
    assert len(maps) == 3 and sorted(len(m["convolutions"]) for m in maps) == [1, 1, 2]
    assert sum("ConvGrid" in line for line in rep["host_steps"]) == 1  # one coarse grid built, not two
    text = report.text(rep)
    assert "neighbour maps: 3, read by 4 sparse convolutions" in text

    monkeypatch.setattr(cleanup, "merge_equal_nodes", lambda proto, pure: 0)
    unmerged = luisaml.compile(proto)
    assert len(report.from_plan(unmerged.plan)["neighbour_maps"]) == 4
    for points in (600, 900):
        fine, x = example.voxelize(example.lidar_frame(points, rng, 5.0), 0.4)
        feeds = example.feeds("voxel_features", x, fine)
        got, want = net.run(feeds)["y"], unmerged.run(feeds)["y"]
        assert np.array_equal(got, want)
        with torch.no_grad():
            ref = model(x, *fine).numpy()
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


def _pure_model():
    """a -> P(a) twice (equal), Q of each (equal after the first merge), R(a) with other attributes,
    a Relu (not pure) twice; one P's output also a graph output."""
    def P(i, o, k=1):
        return helper.make_node("P", [i], [o], domain="d", k=k)
    nodes = [P("a", "p1"), P("a", "p2"), helper.make_node("Q", ["p1"], ["q1"], domain="d"),
             helper.make_node("Q", ["p2"], ["q2"], domain="d"), P("a", "r", k=2), P("a", "kept_out"),
             helper.make_node("Relu", ["q1"], ["s1"]), helper.make_node("Relu", ["q2"], ["s2"]),
             helper.make_node("Add", ["s1", "s2"], ["y"])]
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2])  # noqa: E731
    g = helper.make_graph(nodes, "g", [vi("a")], [vi("y"), vi("r"), vi("kept_out")], value_info=[vi("q2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("d", 1)])


def test_merge_equal_nodes_merges_chains_and_keeps_graph_outputs_and_impure_nodes():
    m = _pure_model()
    removed = cleanup.merge_equal_nodes(m, lambda n: n.domain == "d")
    names = [(n.op_type, list(n.input), list(n.output)) for n in m.graph.node]
    assert removed == 2  # p2 and q2
    assert ("P", ["a"], ["p2"]) not in names and ("Q", ["p2"], ["q2"]) not in names
    assert ("Relu", ["q1"], ["s2"]) in names  # the impure Relu twice, its input renamed
    assert ("P", ["a"], ["r"]) in names and ("P", ["a"], ["kept_out"]) in names
    assert [vi.name for vi in m.graph.value_info] == []  # q2's shape went with it
    onnx.checker.check_model(m)
