"""The schedule (luisaml/schedule.py): stages and their fusion, the pooled buffers across stages
(never two live tensors in one buffer, over random graphs), a graph whose batch moves, and
random graphs against onnxruntime."""
from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from util import ort_run, stage_of

import luisaml
from luisaml import planning, schedule
from luisaml.runtime import analyze

F = TensorProto.FLOAT
W = 8  # features per sample of the random graphs


def _random_graph(seed: int) -> onnx.ModelProto:
    """A random DAG over [N, 8] tensors: maps, MatMuls with constant weights, softmax rows,
    transposes of [N, 2, 4] views, concats and splits, reductions kept 2-D."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    tensors, nodes, inits = ["x"], [], []

    def pick():
        return rng.choice(tensors[-6:])

    def new(name_hint: str) -> str:
        name = f"{name_hint}{len(nodes)}"
        tensors.append(name)
        return name

    for k in range(rng.randint(3, 14)):
        op = rng.choice(["Add", "Mul", "Relu", "Sigmoid", "MatMul", "MatMul", "Softmax", "Transpose",
                         "Concat", "ReduceSum", "Tanh", "Sub"])
        a = pick()
        if op in ("Add", "Mul", "Sub"):
            b = pick()
            nodes.append(helper.make_node(op, [a, b], [new(op)], name=f"n{k}"))
        elif op == "MatMul":
            w = f"w{k}"
            inits.append(numpy_helper.from_array(nrng.standard_normal((W, W)).astype(np.float32) / 3, w))
            nodes.append(helper.make_node(op, [a, w], [new(op)], name=f"n{k}"))
        elif op == "Softmax":
            nodes.append(helper.make_node(op, [a], [new(op)], axis=-1, name=f"n{k}"))
        elif op == "Transpose":  # [N, 8] -> [N, 2, 4] -> [N, 4, 2] -> [N, 8]
            s1, s2 = f"s{k}a", f"s{k}b"
            inits += [numpy_helper.from_array(np.array([-1, 2, 4], np.int64), s1),
                      numpy_helper.from_array(np.array([-1, W], np.int64), s2)]
            r, t = f"r{k}", f"t{k}"
            nodes += [helper.make_node("Reshape", [a, s1], [r], name=f"n{k}r"),
                      helper.make_node("Transpose", [r], [t], perm=[0, 2, 1], name=f"n{k}"),
                      helper.make_node("Reshape", [t, s2], [new("T")], name=f"n{k}s")]
        elif op == "Concat":  # halves of two tensors
            b = pick()
            h1, h2 = f"h{k}a", f"h{k}b"
            nodes += [helper.make_node("Split", [a], [h1, f"h{k}c"], axis=1, num_outputs=2, name=f"n{k}p"),
                      helper.make_node("Split", [b], [f"h{k}d", h2], axis=1, num_outputs=2, name=f"n{k}q"),
                      helper.make_node("Concat", [h1, h2], [new("C")], axis=1, name=f"n{k}")]
        elif op == "ReduceSum":
            ax = f"ax{k}"
            inits.append(numpy_helper.from_array(np.array([1], np.int64), ax))
            r = f"rs{k}"
            nodes += [helper.make_node("ReduceSum", [a, ax], [r], keepdims=1, name=f"n{k}"),
                      helper.make_node("Sub", [a, r], [new("D")], name=f"n{k}d")]
        else:
            nodes.append(helper.make_node(op, [a], [new(op)], name=f"n{k}"))
    outs = list(dict.fromkeys([tensors[-1], rng.choice(tensors[1:])]))
    g = helper.make_graph(nodes, f"random{seed}", [helper.make_tensor_value_info("x", F, ["N", W])],
                          [helper.make_tensor_value_info(o, F, ["N", W]) for o in outs], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("seed", range(120))
def test_no_two_live_tensors_share_a_buffer(seed):
    """Over random graphs: the stages' pooled buffers never hold two live tensors at once, every
    node lands in a stage (or is computed inline), and pooling never costs more than a buffer per
    tensor."""
    plan = analyze(_random_graph(seed))
    sched = plan.schedule
    schedule.check(sched, plan.main)
    placed = {n.name for st in sched.stages for n, _ in st.nodes + st.epilogue}
    inline = {n.name for n, _, _ in sched.virtual.values()}
    for node, op in plan.ops:
        if not (op.view and node.outputs[0] in plan.views):
            assert node.name in placed or node.name in inline, f"{node.describe()} is in no stage"
    assert sched.buffers.bytes_pooled <= sched.buffers.bytes_unpooled


@pytest.mark.parametrize("seed", [0, 3, 7, 11])
def test_random_graphs_match_onnxruntime(seed):
    model = _random_graph(seed)
    net = luisaml.compile(model)
    for n in (1, 5):
        x = np.random.default_rng(n).standard_normal((n, W)).astype(np.float32)
        got, want = net.run({"x": x}), ort_run(model, {"x": x})
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=2e-5, atol=2e-6, err_msg=f"seed {seed} {name}")


def test_elementwise_chains_fuse_into_the_producer_and_inline_into_readers():
    """MatMul -> Add(bias) -> Relu is one stage (the epilogue); Transpose -> Neg read by a second
    MatMul is computed inline where it is read (cheap enough to recompute for each of the reads
    a MatMul makes): no buffer holds either."""
    rng = np.random.default_rng(0)
    inits = {"w1": rng.standard_normal((8, 8)).astype(np.float32), "b1": rng.standard_normal(8).astype(np.float32),
             "w2": rng.standard_normal((4, 4)).astype(np.float32)}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="bias"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu"),
        helper.make_node("Reshape", ["r1", "shape"], ["v"], name="view"),
        helper.make_node("Transpose", ["v"], ["t"], perm=[0, 2, 1], name="tr"),
        helper.make_node("Neg", ["t"], ["s"], name="sig"),
        helper.make_node("MatMul", ["s", "w2"], ["y"], name="mm2"),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 8])],
                          [helper.make_tensor_value_info("y", F, ["N", 2, 4])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()]
                          + [numpy_helper.from_array(np.array([-1, 4, 2], np.int64), "shape")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    net = luisaml.compile(model)
    st1 = stage_of(net, "mm1")
    assert [n.name for n, _ in st1.epilogue] == ["bias", "relu"] and st1.out == "r1"
    st2 = stage_of(net, "mm2")
    assert st2.index == st1.index + 1 and st2.domain in ("element", "items")
    assert stage_of(net, "tr") is st2 and stage_of(net, "sig") is st2  # computed where mm2 reads them
    pooled = {m for slot in net.plan.schedule.buffers.slots for m in slot.members}
    assert pooled == {"r1"}, net.plan.schedule.describe()
    x = rng.standard_normal((6, 8)).astype(np.float32)
    np.testing.assert_allclose(net.run({"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-6)


def _convnext_blocks(blocks: int = 2, c: int = 8, hw: int = 9) -> onnx.ModelProto:
    """ConvNeXt's residual stream: per block a depthwise 7 x 7 Conv, a permute to NHWC, a MatMul over
    the channels (its MLP), a permute back to NCHW added to the block's input; a last depthwise
    Conv reads the sum."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for b in range(blocks + 1):
        inits += [numpy_helper.from_array(rng.standard_normal((c, 1, 7, 7)).astype(np.float32) * 0.2, f"dw{b}"),
                  numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), f"db{b}")]
        out = "y" if b == blocks else f"d{b}"
        nodes.append(helper.make_node("Conv", [prev, f"dw{b}", f"db{b}"], [out], group=c, pads=[3] * 4, name=f"dw{b}"))
        if b == blocks:
            break
        inits.append(numpy_helper.from_array(rng.standard_normal((c, c)).astype(np.float32) * 0.3, f"w{b}"))
        nodes += [helper.make_node("Transpose", [f"d{b}"], [f"p{b}"], perm=[0, 2, 3, 1], name=f"nhwc{b}"),
                  helper.make_node("MatMul", [f"p{b}", f"w{b}"], [f"m{b}"], name=f"mlp{b}"),
                  helper.make_node("Transpose", [f"m{b}"], [f"q{b}"], perm=[0, 3, 1, 2], name=f"nchw{b}"),
                  helper.make_node("Add", [prev, f"q{b}"], [f"r{b}"], name=f"res{b}")]
        prev = f"r{b}"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", c, hw, hw])],
                          [helper.make_tensor_value_info("y", F, ["N", c, hw, hw])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _arithmetic_only(cost: int, loads: set[str], ordered: bool) -> bool:
    """The rule before loads and their order counted: arithmetic alone."""
    return cost <= schedule.CHEAP_FOR_MULTI_READ


def test_a_transposed_residual_chain_is_not_inlined_into_a_depthwise_conv(monkeypatch):
    """ConvNeXt's residual Adds read the block input and an NHWC -> NCHW Transpose: inlined into
    the next depthwise Conv, each of its 49 taps would load both tensors, one of them a row apart
    from its neighbour's. The schedule stores each sum and the Convs read one stored tensor in
    order; the arithmetic-only rule inlined them. Storing
    a sum computes the same float operations: the outputs are bit-identical, and match onnxruntime."""
    model = _convnext_blocks()
    net = luisaml.compile(model, backend="cpu")
    sched = net.plan.schedule
    convs = [st for st in sched.stages if st.root[0].op_type == "Conv"]
    assert len(convs) == 3 and all(not st.inlined for st in convs), sched.describe()
    assert not {"r0", "r1"} & set(sched.virtual), sched.describe()
    assert "q0" in sched.virtual and "q1" in sched.virtual  # read once, by the Add: still inline
    x = np.random.default_rng(1).standard_normal((2, 8, 9, 9)).astype(np.float32)
    got = net.run({"x": x})["y"]
    np.testing.assert_allclose(got, ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(schedule, "_multi_read_inlines", _arithmetic_only)
    old = luisaml.compile(model, backend="cpu")
    assert any("Add 'res0'" in s for st in old.plan.schedule.stages for s in st.inlined), old.plan.schedule.describe()
    np.testing.assert_array_equal(got, old.run({"x": x})["y"])


def test_a_cheap_ordered_producer_still_inlines_into_a_conv():
    """What a buffer would not read better stays inline in a Conv's taps: an Add of a constant and
    a Relu of the graph input (one tensor, in order), and SE's channel gate, whose per-channel
    scales are a smaller operand broadcast over the positions (they stay in cache), not a second
    tensor loaded at each tap."""
    rng = np.random.default_rng(0)
    c = 8
    inits = [numpy_helper.from_array(rng.standard_normal((c, 1, 1)).astype(np.float32), "bias"),
             numpy_helper.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((c, c, 1, 1)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Add", ["x", "bias"], ["a"], name="shift"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w1"], ["h"], group=c, pads=[1] * 4, name="dw"),
             helper.make_node("GlobalAveragePool", ["h"], ["g"], name="squeeze"),
             helper.make_node("Sigmoid", ["g"], ["s"], name="gate"),
             helper.make_node("Mul", ["h", "s"], ["e"], name="excite"),
             helper.make_node("Conv", ["e", "w2"], ["y"], name="pw")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", c, 6, 6])],
                          [helper.make_tensor_value_info("y", F, ["N", c, 6, 6])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    net = luisaml.compile(model, backend="cpu")
    assert stage_of(net, "shift") is stage_of(net, "relu") is stage_of(net, "dw")
    assert stage_of(net, "excite") is stage_of(net, "pw"), net.plan.schedule.describe()
    x = rng.standard_normal((3, c, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(net.run({"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_transformer_encoder_with_a_moving_batch_axis(tmp_path):
    """torch's batch-first TransformerEncoder moves the batch to axis 1 inside attention: it
    compiles with the defaults, runs as stages at each batch size, and matches onnxruntime."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True, dropout=0.0)
    m = torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False).eval()
    path = tmp_path / "tfm.onnx"
    torch.onnx.export(m, (torch.randn(3, 5, 16),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "B"}, "y": {0: "B"}}, dynamo=False, opset_version=17)
    net = luisaml.compile(str(path))
    assert isinstance(net, luisaml.PerBatchNetwork) and "Transpose" in net.why
    with pytest.raises(luisaml.UsageError, match="no per-sample `forward`"):
        net.forward
    assert all(st.domain != "sample" for st in net.plan.schedule.stages)
    for n in (2, 4):
        x = np.random.default_rng(n).standard_normal((n, 5, 16)).astype(np.float32)
        np.testing.assert_allclose(net.run({"x": x})["y"], ort_run(onnx.load(str(path)), {"x": x})["y"],
                                   rtol=1e-4, atol=1e-5)


def test_nested_concats_inline_within_bounds():
    """Six nested Concats, each also read by a Relu (DenseNet's pattern): inlined as the budget
    allows, the index arithmetic of the remaps would repeat the reader's index geometrically (20 MB
    of source before the emission's length check); the schedule materialises what grows too long,
    the source stays small, and the result equals onnxruntime's."""
    nodes, prev = [], "x"
    for k in range(6):
        nodes += [helper.make_node("Relu", [prev], [f"r{k}"], name=f"relu{k}"),
                  helper.make_node("Concat", [prev, f"r{k}"], [f"c{k}"], axis=1, name=f"cat{k}")]
        prev = f"c{k}"
    nodes.append(helper.make_node("Transpose", [prev], ["y"], perm=[0, 2, 3, 1], name="tr"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 2, 4, 4])],
                          [helper.make_tensor_value_info("y", F, ["N", 4, 4, 128])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    net = luisaml.compile(model)
    assert len(net.plan.source) < 100_000, len(net.plan.source)
    assert set(net.plan.schedule.virtual) != {f"c{k}" for k in range(5)} | {f"r{k}" for k in range(6)}
    x = np.random.default_rng(0).standard_normal((3, 2, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(net.run({"x": x})["y"], ort_run(model, {"x": x})["y"])


def test_a_network_of_many_stages_builds_and_runs():
    """300 stages in the CPU backend's one merged kernel: selected by two levels of flat ifs, never
    an elif chain that LuisaCompute's AST conversion aborts on past about a hundred levels (the
    process died on DenseNet-121's 300 stages)."""
    nodes, prev = [], "x"
    for k in range(300):
        nodes.append(helper.make_node("Softmax", [prev], [f"s{k}"], axis=1, name=f"softmax{k}"))
        prev = f"s{k}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 3])],
                          [helper.make_tensor_value_info("y", F, ["N", 3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    net = luisaml.compile(model)
    assert len(net.plan.schedule.stages) >= 250, len(net.plan.schedule.stages)
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_allclose(net.run({"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-6)


def test_a_root_with_an_epilogue_is_not_deferred_past_readers_of_its_other_outputs():
    """TopK's values run through an epilogue (Mul) that ends late in the graph, while its indices
    are read earlier (Tile, ReduceSum): the root may not move to the epilogue's end, or the
    ReduceSum stage reads the indices before TopK writes them (the fuzz's graph 0:1299: zeros)."""
    I64 = TensorProto.INT64
    nodes = [
        helper.make_node("TopK", ["x", "k"], ["vals", "idx"], axis=-1, name="topk"),
        helper.make_node("Tile", ["idx", "reps"], ["tiled"], name="tile"),
        helper.make_node("ReduceSum", ["tiled", "axes"], ["s"], keepdims=0, name="sum"),
        helper.make_node("Mul", ["vals", "c"], ["y"], name="mul"),
    ]
    inits = [numpy_helper.from_array(np.array([4], np.int64), "k"),
             numpy_helper.from_array(np.array([1, 1, 2], np.int64), "reps"),
             numpy_helper.from_array(np.array([2], np.int64), "axes"),
             numpy_helper.from_array(np.array(1.5, np.float32), "c")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 8, 4])],
                          [helper.make_tensor_value_info("s", I64, ["N", 8]),
                           helper.make_tensor_value_info("y", F, ["N", 8, 4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(1).standard_normal((3, 8, 4)).astype(np.float32)
    got, want = luisaml.compile(model).run({"x": x}), ort_run(model, {"x": x})
    np.testing.assert_array_equal(got["s"], want["s"])
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6)


# ---- the GPU's cooperative blocks (operators/tiled.py), planned here without a GPU ---------------


def _conv_chain(c_out2: int, size: int) -> onnx.ModelProto:
    """Conv 3->32 (3x3, pad 1) + Relu, then Conv 32->c_out2 (3x3, stride 2), batch N."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((32, 3, 3, 3), dtype=np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal((c_out2, 32, 3, 3), dtype=np.float32), "W2")]
    nodes = [helper.make_node("Conv", ["x", "W1"], ["a"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "W2"], ["y"], strides=[2, 2])]
    out = (size - 3) // 2 + 1
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c_out2, out, out])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_blocks_are_planned_for_large_products_only():
    """With blocks on (what compile() asks for on CUDA), a convolution whose implicit GEMM fills
    its tiles runs as a blocks stage (dispatch = blocks x threads per sample, the Relu in its
    epilogue), one that would leave most of a tile empty keeps the items form; the CPU backend's
    default plan has no blocks at all (it cannot compile shared memory)."""
    from luisaml.operators import tiled

    plan, _, _ = planning.plan_for(_conv_chain(64, 32), "m", planning.CompileOptions(blocks=True, merge_stages=False).resolve("cpu"))
    first, second = plan.schedule.stages
    assert first.domain == "blocks" and [n.op_type for n, _ in first.epilogue] == ["Relu"]
    t = tiled.choose(32 * 32, 32, 27, 1, m_fast=True)
    assert (first.items, first.threads) == (t.blocks, t.threads)
    assert first.dispatch(5) == 5 * t.blocks * t.threads
    assert "set_block_size" in plan.source and "sync_block()" in plan.source
    assert second.domain == "blocks"  # 15 x 15 positions x 64 channels

    small, _, _ = planning.plan_for(_conv_chain(8, 12), "m", planning.CompileOptions(blocks=True, merge_stages=False).resolve("cpu"))
    assert [st.domain for st in small.schedule.stages] == ["blocks", "items"]  # 8 channels: under MIN_SIDE

    cpu, _, _ = planning.plan_for(_conv_chain(64, 32), "m", planning.CompileOptions().resolve("cpu"))
    assert {st.domain for st in cpu.schedule.stages} == {"items"} and "sync_block" not in cpu.source


def test_row_reductions_take_a_warp_per_row_with_blocks():
    """With blocks on (CUDA), LayerNorm and Softmax rows of at least rows.MIN_LENGTH run a warp per row
    (blocks of ROWS_PER_BLOCK warps, the last one guarded), their sums combined with the warp
    reductions the module imports; shorter rows and the CPU backend's plan keep a thread per row."""
    from luisaml.operators import rows

    F = TensorProto.FLOAT

    def model(length: int) -> onnx.ModelProto:
        nodes = [helper.make_node("LayerNormalization", ["x", "g"], ["n"], axis=-1),
                 helper.make_node("Softmax", ["n"], ["y"], axis=-1)]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 6, length])],
                              [helper.make_tensor_value_info("y", F, ["N", 6, length])],
                              [numpy_helper.from_array(np.ones(length, np.float32), "g")])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    plan, _, _ = planning.plan_for(model(100), "m", planning.CompileOptions(blocks=True, merge_stages=False).resolve("cpu"))
    assert [(st.domain, st.items, st.threads) for st in plan.schedule.stages] == \
        [("blocks", 2, rows.ROWS_PER_BLOCK * rows.WARP)] * 2  # 6 rows a sample: 2 blocks, the second half empty
    assert "warp_active_sum(" in plan.source and "warp_active_max(" in plan.source
    assert f"< {6}:" in plan.source  # the row guard
    short, _, _ = planning.plan_for(model(rows.MIN_LENGTH - 1), "m", planning.CompileOptions(blocks=True).resolve("cpu"))
    assert {st.domain for st in short.schedule.stages} == {"items"}
    cpu, _, _ = planning.plan_for(model(100), "m", planning.CompileOptions().resolve("cpu"))
    assert {st.domain for st in cpu.schedule.stages} == {"items"} and "warp_active" not in cpu.source
