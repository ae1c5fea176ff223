"""The rows-kept rewrite (luisaml/rewrites/rows_kept.py, issue 28 item 6): a 1 x 1 Conv whose regression channels
a graph reads only through a Gather at TopK's cells computes them at those cells only, bit for bit what every
cell gives (compile(rows_kept=False) on the same backend) and close to onnxruntime; a 3 x 3 Conv, a kept channel
read elsewhere or a Gather of another axis is left as it was; a bad index behaves as the original graph's."""
import numpy as np
import pytest
from onnx import helper

import luisaml
from util import assert_close_to_ort, assert_same_bits, graph_model, plan_of

CLS, REG = 2, 8


def head(C=32, H=20, W=24, K=16, kernel=1, pre=None, post=None, extra=None, gather_axis=1, seed=0,
         idx_input=False, reg_first=False, CLS=CLS, split_first=False):
    """A CenterPoint-like head: Conv (C -> CLS + REG channels) over x [1, C, H, W], the leading axis dropped
    (Gather of index 0), the class channels' sigmoid TopK over every cell, the regression channels flattened
    and gathered at the TopK cells (or at the indices input `idx` where idx_input). pre: elementwise nodes on
    the Conv's output before the split ([op, scalar] pairs); post: on the regression channels after the slice;
    extra: more nodes (they may read 'g' or 'reg'); reg_first: the regression channels first; split_first: the
    channels sliced along axis 1 of the Conv's output, each branch then dropping the leading axis (a Squeeze)."""
    rng = np.random.default_rng(seed)
    M = CLS + REG
    w = (rng.standard_normal((M, C, kernel, kernel)) / np.sqrt(C)).astype(np.float32)
    b = rng.standard_normal(M).astype(np.float32)
    inits = {"w": w, "b": b, "zero": np.array(0, np.int64), "k": np.array([K], np.int64),
             "flat": np.array([-1], np.int64), "reg_shape": np.array([REG, H * W], np.int64),
             "cls_lo": np.array([REG if reg_first else 0], np.int64),
             "cls_hi": np.array([M if reg_first else CLS], np.int64),
             "reg_lo": np.array([0 if reg_first else CLS], np.int64),
             "reg_hi": np.array([REG if reg_first else M], np.int64), "ax0": np.array([0], np.int64)}
    pad = (kernel - 1) // 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y0"], pads=[pad] * 4, name="conv")]
    cur = "y0"
    for k, (op, v) in enumerate(pre or []):
        inits[f"pre{k}"] = np.array(v, np.float32)
        nodes.append(helper.make_node(op, [cur, f"pre{k}"], [f"pre{k}_out"], name=f"pre{k}"))
        cur = f"pre{k}_out"
    if split_first:
        inits["ax1"] = np.array([1], np.int64)
        nodes += [helper.make_node("Slice", [cur, "cls_lo", "cls_hi", "ax1"], ["heat4"], name="cls"),
                  helper.make_node("Squeeze", ["heat4", "ax0"], ["heat_maps"], name="cls_squeeze"),
                  helper.make_node("Slice", [cur, "reg_lo", "reg_hi", "ax1"], ["reg4"], name="reg"),
                  helper.make_node("Squeeze", ["reg4", "ax0"], ["reg"], name="reg_squeeze")]
    else:
        nodes += [helper.make_node("Gather", [cur, "zero"], ["g"], axis=0, name="squeeze"),
                  helper.make_node("Slice", ["g", "cls_lo", "cls_hi", "ax0"], ["heat_maps"], name="cls"),
                  helper.make_node("Slice", ["g", "reg_lo", "reg_hi", "ax0"], ["reg"], name="reg")]
    nodes += [helper.make_node("Sigmoid", ["heat_maps"], ["heat"], name="sigmoid"),
              helper.make_node("Reshape", ["heat", "flat"], ["heat_flat"], name="heat_flat"),
              helper.make_node("TopK", ["heat_flat", "k"], ["scores", "index"], name="topk"),
              helper.make_node("Mod", ["index", "cells"], ["cell"], name="cell")]
    inits["cells"] = np.array(H * W, np.int64)
    cur = "reg"
    for k, (op, v) in enumerate(post or []):
        if v is None:
            nodes.append(helper.make_node(op, [cur], [f"post{k}_out"], name=f"post{k}"))
        else:
            inits[f"post{k}"] = np.array(v, np.float32)
            nodes.append(helper.make_node(op, [cur, f"post{k}"], [f"post{k}_out"], name=f"post{k}"))
        cur = f"post{k}_out"
    nodes += [helper.make_node("Reshape", [cur, "reg_shape"], ["reg_flat"], name="reg_flat"),
              helper.make_node("Gather", ["reg_flat", "idx" if idx_input else "cell"], ["boxes"], axis=gather_axis,
                               name="at_cells")]
    nodes += extra or []
    inputs = {"x": rng.standard_normal((1, C, H, W)).astype(np.float32)}
    if idx_input:
        inputs["idx"] = np.arange(K, dtype=np.int64)
    outputs = ["scores", "boxes"] + [o for n in extra or [] for o in n.output]
    return graph_model(nodes, inputs, inits, outputs=outputs), inputs


def both(model, feeds, **kw):
    """Return (rewritten network, its outputs, the network compiled with rows_kept=False, its outputs)."""
    on = luisaml.compile(model, batch_axis=None, backend="cpu", **kw)
    off = luisaml.compile(model, batch_axis=None, backend="cpu", rows_kept=False, **kw)
    return on, on.run(feeds), off, off.run(feeds)


def convs(net) -> list[tuple[str, str, tuple]]:
    """The plan's Conv and RowsKeptConv nodes and their output shapes."""
    return [(n.op_type, n.name, tuple(op.output().shape)) for n, op in net.plan.main.ops
            if n.op_type in ("Conv", "RowsKeptConv")]


@pytest.mark.parametrize("case", [
    dict(),  # the detector's head
    dict(post=[("Mul", 2.0), ("Add", 0.5)]),  # maps after the slice (x * 2 + 0.5)
    dict(post=[("Exp", None)], pre=[("Mul", 0.75)]),  # a map before the split too (the side channels' as well)
    dict(C=37, H=17, W=31, K=40, reg_first=True),  # odd sizes, the regression channels first
    # sliced on axis 1 of the Conv's output, squeezed after; the side channels after the kept ones
    dict(split_first=True, reg_first=True, pre=[("Add", -0.25)], post=[("Sigmoid", None)]),
])
def test_regression_channels_are_computed_at_the_gathered_rows_only_bit_for_bit(case):
    model, feeds = head(**case)
    on, got, off, want = both(model, feeds)
    K, H, W = case.get("K", 16), case.get("H", 20), case.get("W", 24)
    assert on.plan.rows_kept == [f"Conv 'conv': {REG} of {CLS + REG} output channels evaluated at {K} gathered rows, "
                                 f"not {H * W:,} (Gather 'at_cells'); the other {CLS} over every row"]
    # the full Conv keeps the class channels; the regression channels' Conv runs over K rows
    assert convs(on) == [("Conv", "conv", (1, CLS, H, W)), ("RowsKeptConv", "conv/rows_kept", (REG, K))]
    assert convs(off) == [("Conv", "conv", (1, CLS + REG, H, W))] and off.plan.rows_kept == []
    assert_same_bits(got, want)
    assert_close_to_ort(got, model, feeds)


def test_inspect_names_the_rewrite_and_its_rows():
    from luisaml.report import build, text

    model, _ = head()
    rep = build(model, batch_axis=None)
    assert rep["rows_kept"] and any("rows kept: Conv 'conv': 8 of 10 output channels evaluated at 16 gathered rows, not 480" in line
               for line in text(rep).splitlines())


@pytest.mark.parametrize("name, case", [
    ("3x3", dict(kernel=3)),  # a window: a row's output reads its neighbours
    # a regression channel also read over every cell (an output of the regression maps' channel 0)
    ("read elsewhere", dict(extra=[helper.make_node("Slice", ["g", "one_lo", "one_hi", "ax0"], ["also"], name="also")])),
    ("path output", dict(extra=[helper.make_node("Identity", ["reg_flat"], ["reg_out"], name="reg_out")])),
    ("channel axis", dict(gather_axis=0, idx_input=True, K=4)),  # the Gather picks channels, not rows
])
def test_no_rewrite_where_it_would_not_keep_the_result(name, case):
    model, feeds = head(**case)
    if name == "read elsewhere":
        from onnx import numpy_helper

        model.graph.initializer.extend([numpy_helper.from_array(np.array([CLS], np.int64), "one_lo"),
                                        numpy_helper.from_array(np.array([CLS + 1], np.int64), "one_hi")])
    on, got, off, want = both(model, feeds)
    assert on.plan.rows_kept == [] and convs(on) == convs(off)
    assert_same_bits(got, want)


@pytest.mark.parametrize("idx", [[5, -1, -480, 479, 0, 7, 7, 100], [3, 480, 2, 1, 0, 9, 8, 4], [-481, 0, 1, 2, 3, 4, 5, 6]])
def test_indices_out_of_range_or_negative_behave_as_the_original(idx):
    model, feeds = head(idx_input=True, K=8)
    feeds["idx"] = np.array(idx, np.int64)
    on, off = (luisaml.compile(model, batch_axis=None, backend="cpu", rows_kept=r) for r in (True, False))
    assert on.plan.rows_kept and not off.plan.rows_kept
    bad = any(i < -480 or i >= 480 for i in idx)
    if not bad:  # negative indices count from the end, as onnxruntime's
        got = on.run(feeds)
        assert_same_bits(got, off.run(feeds))
        assert_close_to_ort(got, model, feeds)
        return
    errors = []
    for net in (on, off):
        with pytest.raises(luisaml.RunError) as e:
            net.run(feeds)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "at_cells" in errors[0]  # the same node named, the same words
    # check_indices=False: clamped into range, the same rows either way
    on, off = (luisaml.compile(model, batch_axis=None, backend="cpu", rows_kept=r, check_indices=False)
               for r in (True, False))
    assert_same_bits(on.run(feeds), off.run(feeds))


def test_cuda_plans_rewrite_only_where_the_forms_sum_alike():
    """Planned for CUDA without a device. The detector's head (10 output channels, under tiled.MIN_SIDE) runs
    the items form, tensor cores or not: rewritten, B first. A head of 32 channels (24 left over every row)
    takes tiled.py's FP32 tile: rewritten, the kept rows summed with B last as that tile sums; on the TF32 mma
    tile it is not. A head of 16 channels takes the FP32 tile, but its 8 side channels would take the items form
    (under MIN_SIDE): not rewritten. Each note says why."""
    def kept_order(plan):
        return [op.order for n, op in plan.main.ops if n.op_type == "RowsKeptConv"]

    model, _ = head(C=32, H=32, W=32, K=64)
    for tc in (False, True):
        plan = plan_of(model, "cuda", batch_axis=None, tensor_cores=tc)
        assert plan.rows_kept and "evaluated at 64 gathered rows, not 1,024" in plan.rows_kept[0]
        assert kept_order(plan) == ["items"]
    model, _ = head(C=32, H=32, W=32, K=64, CLS=24)
    plan = plan_of(model, "cuda", batch_axis=None)
    assert "8 of 32 output channels evaluated at 64 gathered rows" in plan.rows_kept[0] and kept_order(plan) == ["fp32"]
    plan = plan_of(model, "cuda", batch_axis=None, tensor_cores=True)
    assert plan.rows_kept == ["Conv 'conv': 8 of 32 output channels read only at 64 gathered rows; not rewritten: "
                              "every row's Conv sums on the TF32 mma tile or the dot form (their own order)"]
    assert [tuple(op.output().shape) for n, op in plan.main.ops if n.op_type == "Conv"] == [(1, 32, 32, 32)]
    model, _ = head(C=32, H=32, W=32, K=64, CLS=8)
    plan = plan_of(model, "cuda", batch_axis=None)
    assert plan.rows_kept == ["Conv 'conv': 8 of 16 output channels read only at 64 gathered rows; not rewritten: "
                              "every row's Conv sums on tiled.py's FP32 tile (B last), the side channels' would sum "
                              "in the items form (B first)"] and not kept_order(plan)


def test_every_channel_read_at_the_rows_only_leaves_no_full_conv():
    """No Slice: every output channel is read only at the gathered rows; no Conv over every row is left."""
    rng = np.random.default_rng(3)
    C, M, H, W, K = 16, 6, 12, 10, 9
    inits = {"w": rng.standard_normal((M, C, 1, 1)).astype(np.float32), "b": rng.standard_normal(M).astype(np.float32),
             "zero": np.array(0, np.int64), "flat": np.array([M, H * W], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv"),
             helper.make_node("Gather", ["y", "zero"], ["g"], axis=0, name="squeeze"),
             helper.make_node("Reshape", ["g", "flat"], ["f"], name="flat"),
             helper.make_node("Sigmoid", ["f"], ["s"], name="sig"),
             helper.make_node("Gather", ["s", "idx"], ["out"], axis=1, name="at")]
    feeds = {"x": rng.standard_normal((1, C, H, W)).astype(np.float32),
             "idx": rng.integers(-H * W, H * W, size=(3, 3)).astype(np.int64)}
    model = graph_model(nodes, feeds, inits, outputs=["out"])
    on, got, off, want = both(model, feeds)
    assert on.plan.rows_kept == [f"Conv 'conv': {M} of {M} output channels evaluated at {K} gathered rows, not "
                                 f"{H * W} (Gather 'at'); no other channel is read"]
    assert convs(on) == [("RowsKeptConv", "conv/rows_kept", (M, 3, 3))]
    assert_same_bits(got, want)
    assert_close_to_ort(got, model, feeds)


@pytest.mark.parametrize("cls, order", [(2, "items"), (24, "fp32")])
def test_cuda_kernels_in_the_emulator_keep_every_rows_bits(cls, order):
    """The CUDA plan's kernels run in Python (tests/gpu_emulator.py: float64, each fma a * b + c): the kept rows
    summed in the order of the Conv's form -- items, B first; tiled.py's FP32 tile (32 channels), B last --
    equal every row's to the last bit of the emulation (another order differs there)."""
    from gpu_emulator import run_plan

    model, feeds = head(C=16, H=16, W=16, K=8, CLS=cls)
    on = plan_of(model, "cuda", batch_axis=None)
    off = plan_of(model, "cuda", batch_axis=None, rows_kept=False)
    assert [op.order for n, op in on.main.ops if n.op_type == "RowsKeptConv"] == [order]
    got, want = run_plan(on, feeds), run_plan(off, feeds)
    for k in want:
        assert np.array_equal(got[k], want[k]), k


def test_the_detector_head_as_exported_is_rewritten_and_gives_torchs_boxes():
    """examples/lidar_detector.py's Head exported as network B is (host voxelization, the test's tiny detector):
    its 1 x 1 Conv's 8 regression channels at the 10 TopK cells only; every output bit for bit the network
    without the rewrite's, the boxes, scores, labels and kept order torch's."""
    import torch

    from util import example_module

    with example_module("lidar_detector.py") as ex:
        cfg = ex.Settings(points=700, frames=2, channels=4, radius=5.0, candidates=10, voxelize="host")
        rng = np.random.default_rng(cfg.seed)
        torch.manual_seed(cfg.seed)
        backbone, head_module = ex.Backbone(cfg).eval(), ex.Head(cfg).eval()
        frames = [ex.lidar_frame(n, rng, cfg.radius) for n in (700, 1050)]
        fine, x = ex.voxelize(frames[0], cfg.voxel_size)
        with torch.no_grad():
            coarse = backbone(x, *fine)
        model = ex.export(head_module, coarse, fine, "coarse_features", ex.OUTPUTS)
        on = luisaml.compile(model, batch_axis=None, backend="cpu")
        off = luisaml.compile(model, batch_axis=None, backend="cpu", rows_kept=False)
        Y, X = head_module.size[1], head_module.size[0]
        assert on.plan.rows_kept == [f"Conv '/out/Conv': 8 of 10 output channels evaluated at 10 gathered rows, not "
                                     f"{X * Y} (Gather '/Gather_1'); the other 2 over every row"]
        for points in frames:
            fine, x = ex.voxelize(points, cfg.voxel_size)
            with torch.no_grad():
                feats = backbone(x, *fine)
                want = [t.numpy() for t in head_module(feats, *fine)]
            feeds = ex.feeds("coarse_features", feats, fine)
            got = on.run(feeds)
            assert_same_bits(got, off.run(feeds))
            boxes, scores, labels = ex.detections(*(got[n] for n in ex.OUTPUTS))
            want_boxes, want_scores, want_labels = ex.detections(*want)
            assert np.array_equal(got["kept"], want[3]) and np.array_equal(labels, want_labels)
            np.testing.assert_allclose(boxes, want_boxes, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-6)


FORWARD_SCRIPT = """
import sys
import luisa
import numpy as np
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from test_rows_kept import head
import luisaml

model, feeds = head(C=4, H=4, W=4, K=3)
net = luisaml.compile(model, batch_axis=None, backend="cpu")
assert net.plan.rows_kept
forward, X, S, B = net.forward, net.input_type("x"), net.output_type("scores"), net.output_type("boxes")


@luisa.func
def user_kernel(xs, scores, boxes, weights):
    x = X()
    for k in range(64):
        x[k] = xs.read(k)
    s = S()
    b = B()
    forward(x, s, b, weights)
    for k in range(3):
        scores.write(k, s[k])
    for k in range(24):
        boxes.write(k, b[k])


want = net.run(feeds)
bx = luisa.Buffer.from_array(feeds["x"].reshape(-1))
bs, bb = luisa.Buffer(3, float), luisa.Buffer(24, float)
user_kernel(bx, bs, bb, net.weights, dispatch_size=1)
np.testing.assert_allclose(bs.numpy(), want["scores"], rtol=1e-6, atol=1e-7)
np.testing.assert_allclose(bb.numpy().reshape(8, 3), want["boxes"], rtol=1e-5, atol=1e-6)
print("forward ok")
"""


def test_forward_of_a_rewritten_network_in_a_user_kernel(tmp_path):
    """`forward` (one thread runs the whole graph: RowsKeptConv.forward) called from a user kernel gives
    net.run's outputs (its Convs' window sums add in forward's own way: close, not bit for bit). In a process of
    its own: a user kernel on luisa's stream beside other tests' networks is test_embedding's business."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    script = tmp_path / "forward_in_kernel.py"  # (a file: luisa.func reads the kernel's source)
    script.write_text(FORWARD_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(here), str(here.parent)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "forward ok" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
