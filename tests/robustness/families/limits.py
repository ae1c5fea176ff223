"""Limits: numbers and sizes past what a kernel can hold, which must be errors before any memory
is committed (never an abort, never a silent truncation to 32 bits).

int64 lives in 32 bits inside kernels, and kernels index with 32-bit integers, so: int64
constants beyond int32 (Add(x, [2**40]), a Loop trip count of 2**32+3), tensors past 2**31
elements (a bool output [N, 2**21] at N=1025, Range(0, 3e9), a 40 MB-per-sample intermediate at
batch 1000, a 1e12-element ConstantOfShape), and the limits of luisaml.Limits (weights, folded
constants). Each case's reference is the true result where one is cheap to know (luisaml may
compute it, or refuse naming the offender), or MustFail where the true result cannot be held.
Valid uses of big numbers (Slice to INT64_MAX) must keep working.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper

from ..harness import Case, MustFail, recipe
from ..models import BOOL, I64, F, make_model, vi
from .common import ORT, Expect, run_and_judge

X = np.random.default_rng(0).uniform(0, 1, (3, 4)).astype(np.float32)
XI = np.arange(6, dtype=np.int64).reshape(3, 2)


def _i64(*v):
    return np.array(v, np.int64)


def int64_constant(value: int = 2**40, via: str = "initializer"):
    """x (int64) + a constant that does not fit 32 bits."""
    nodes = [helper.make_node("Add", ["x", "big_const"], ["y"], name="add_big")]
    inits = {}
    if via == "initializer":
        inits["big_const"] = _i64(value)
    else:
        nodes.insert(0, helper.make_node("Constant", [], ["big_const"], name="const_big",
                                         value=helper.make_tensor("v", I64, [1], [value])))
    m = make_model(nodes, [vi("x", I64, ["N", 2])], [vi("y", I64, ["N", 2])], inits, infer=False)
    return m, {"x": XI}, Expect(("big_const", "add_big", "const_big", str(value)), ORT)


def int64_feed(value: int = 2**40):
    m = make_model([helper.make_node("Add", ["x", "one"], ["y"], name="add_one")], [vi("x", I64, ["N", 2])],
                   [vi("y", I64, ["N", 2])], {"one": _i64(1)}, infer=False)
    return m, {"x": XI + value}, Expect("x", ORT)


def loop_trip(trip: int = 2**32 + 3, as_input: bool = False):
    """A Loop adding 1 per iteration `trip` times: the true result is known without running it."""
    body = helper.make_graph([helper.make_node("Add", ["acc_in", "one"], ["acc_out"], name="body_add"),
                              helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")], "body",
                             [vi("i", I64, []), vi("cond_in", BOOL, []), vi("acc_in", F, ["N", 4])],
                             [vi("cond_out", BOOL, []), vi("acc_out", F, ["N", 4])])
    loop = helper.make_node("Loop", ["trip", "", "x"], ["y"], name="long_loop", body=body)
    inputs = [vi("x", F, ["N", 4])]
    inits = {"one": np.array(1, np.float32)}
    feeds = {"x": X}
    if as_input:
        inputs.append(vi("trip", I64, []))
        feeds["trip"] = np.array(trip, np.int64)
    else:
        inits["trip"] = np.array(trip, np.int64)
    m = make_model([loop], inputs, [vi("y", F, ["N", 4])], inits, infer=False)
    want = {"y": (X.astype(np.float64) + trip).astype(np.float32)}
    return m, feeds, Expect(("long_loop", "trip", str(trip)), want, rtol=1e-6, atol=0)


def big_bool_output(n: int = 1025):
    """x bool [N,1] expanded to [N, 2**21]: at N=1025 that is 2**31 + 2**21 elements."""
    m = make_model([helper.make_node("Expand", ["x", "shape"], ["y"], name="expand_wide")], [vi("x", BOOL, ["N", 1])],
                   [vi("y", BOOL, ["N", 2**21])], {"shape": _i64(1, 2**21)}, infer=False)
    feeds = {"x": np.zeros((n, 1), bool)}
    ref = MustFail(f"a [{n}, 2**21] output (past 32-bit indexing)") if n * 2**21 > 2**31 - 1 else ORT
    return m, feeds, Expect(("y", "expand_wide"), ref)


def range_big(start=0, limit=3_000_000_000, delta=1, dtype=np.int64):
    nodes = [helper.make_node("Range", ["start", "limit", "delta"], ["r"], name="range_big"),
             helper.make_node("ReduceMax", ["r"], ["m"], name="rmax", keepdims=1),
             helper.make_node("Cast", ["m"], ["mf"], name="cast", to=F),
             helper.make_node("Add", ["x", "mf"], ["y"], name="add")]
    inits = {"start": np.array(start, dtype), "limit": np.array(limit, dtype), "delta": np.array(delta, dtype)}
    m = make_model(nodes, [vi("x", F, ["N", 4])], [vi("y", F, ["N", 4])], inits, infer=False)
    count = max(0, int(np.ceil((limit - start) / delta))) if delta else None
    top = start + (count - 1) * delta if count else None
    ref = {"y": (X + np.float32(top)).astype(np.float32)} if count else ORT
    return m, {"x": X}, Expect(("range_big", "r"), ref, rtol=1e-6, atol=1e-6)


def wide_intermediate(batch: int = 1000, width: int = 10_000_000):
    """x[N,1] -> Expand to [N, width] (40 MB a sample at 1e7) -> ReduceSum -> y[N,1]."""
    nodes = [helper.make_node("Expand", ["x", "shape"], ["wide"], name="expand_big"),
             helper.make_node("ReduceSum", ["wide", "axes"], ["y"], name="rsum", keepdims=1)]
    m = make_model(nodes, [vi("x", F, ["N", 1])], [vi("y", F, ["N", 1])],
                   {"shape": _i64(1, width), "axes": _i64(1)}, infer=False)
    x = np.random.default_rng(1).uniform(0, 1, (batch, 1)).astype(np.float32)
    # a float32 sum of 1e7 terms drifts; the point is an error or a plausible value, not rounding
    # at run() the batch size the caller chose is an offender too
    offender = ("wide", "expand_big", "rsum", f"batch {batch}", f"batch size {batch}")
    return m, {"x": x}, Expect(offender, {"y": x * np.float32(width)}, rtol=0.2, atol=1e-3)


def constant_of_shape(shape=(10**6, 10**6), value=0.0):
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"], name="cos_big",
                              value=helper.make_tensor("v", F, [1], [value])),
             helper.make_node("ReduceSum", ["big"], ["s"], name="rsum", keepdims=0),
             helper.make_node("Add", ["x", "s"], ["y"], name="add")]
    m = make_model(nodes, [vi("x", F, ["N", 4])], [vi("y", F, ["N", 4])], {"shape": _i64(*shape)}, infer=False)
    n = int(np.prod(np.array(shape, dtype=object))) if all(d >= 0 for d in shape) else None
    ref = {"y": (X + np.float32(value * n)).astype(np.float32)} if n is not None else MustFail("a negative shape")
    return m, {"x": X}, Expect(("cos_big", "big", "shape"), ref, rtol=1e-5, atol=1e-5)


def tile_huge():
    m = make_model([helper.make_node("Tile", ["x", "reps"], ["y"], name="tile_big")], [vi("x", F, ["N", 4])],
                   [vi("y", F, ["N", 2**32])], {"reps": _i64(1, 2**30)}, infer=False)
    return m, {"x": X}, Expect(("tile_big", "y"), MustFail("a Tile to 2**32 elements a sample"))


def pad_huge():
    m = make_model([helper.make_node("Pad", ["x", "pads"], ["y"], name="pad_big")], [vi("x", F, ["N", 4])],
                   [vi("y", F, None)], {"pads": _i64(0, 0, 0, 2**31)}, infer=False)
    return m, {"x": X}, Expect(("pad_big", "y", "pads"), MustFail("a Pad by 2**31"))


def onehot_huge():
    nodes = [helper.make_node("OneHot", ["idx", "depth", "vals"], ["y"], name="onehot_big")]
    m = make_model(nodes, [vi("idx", I64, ["N", 1])], [vi("y", F, None)],
                   {"depth": _i64(2**40), "vals": np.array([0, 1], np.float32)}, infer=False)
    return m, {"idx": _i64(0, 1, 2).reshape(3, 1)}, Expect(("onehot_big", "depth", "y"), MustFail("OneHot of depth 2**40"))


def resize_huge():
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], name="resize_big", mode="nearest")]
    m = make_model(nodes, [vi("x", F, ["N", 1, 2, 2])], [vi("y", F, None)],
                   {"scales": np.array([1, 1, 1e5, 1e5], np.float32)}, infer=False)
    return m, {"x": np.ones((2, 1, 2, 2), np.float32)}, Expect(("resize_big", "y"), MustFail("a Resize to 4e10 a sample"))


def input_declared_huge():
    m = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [vi("x", F, ["N", 2**40])],
                   [vi("y", F, ["N", 2**40])], infer=False)
    return m, {"x": np.zeros((1, 1), np.float32)}, Expect("x", MustFail("an input of 2**40 elements a sample"))


def per_sample_huge(batch: int = 20, width: int = 2**28):
    """A 1 GiB intermediate a sample: at batch 20 the scratch would be 20 GiB."""
    return wide_intermediate(batch, width)


def slice_to_int64_max():
    """Valid and common: Slice ends INT64_MAX (to the end) and starts INT64_MIN."""
    nodes = [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["a"], name="slice_end"),
             helper.make_node("Slice", ["a", "starts2", "ends2", "axes", "steps"], ["y"], name="slice_rev")]
    inits = {"starts": _i64(1), "ends": _i64(2**63 - 1), "axes": _i64(1), "starts2": _i64(2**63 - 1),
             "ends2": _i64(-(2**63)), "steps": _i64(-1)}
    m = make_model(nodes, [vi("x", F, ["N", 4])], ["y"], inits)
    return m, {"x": X}, Expect("slice", ORT, error_ok=False)


def gather_index_int64(value: int = 2**40):
    m = make_model([helper.make_node("Gather", ["x", "idx"], ["y"], name="gather_far", axis=1)],
                   [vi("x", F, ["N", 4])], [vi("y", F, ["N", 1])], {"idx": _i64(value)}, infer=False)
    return m, {"x": X}, Expect(("gather_far", "idx"), MustFail(f"a Gather index {value} into 4"))


def external_weights_huge(ctx_dir, gib: float = 2.5):
    """A weight in external data claiming more than luisaml.Limits.weight_bytes (a sparse file)."""
    n = int(gib * (1 << 30)) // 4
    t = onnx.TensorProto(name="W_ext", data_type=F, dims=[n], data_location=onnx.TensorProto.EXTERNAL)
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(4 * n))):
        t.external_data.add(key=k, value=v)
    m = make_model([helper.make_node("Add", ["x", "W_ext"], ["y"], name="add_ext")], [vi("x", F, ["N", n])],
                   [vi("y", F, ["N", n])], infer=False)
    m.graph.initializer.append(t)
    with open(os.path.join(ctx_dir, "w.bin"), "wb") as f:
        f.truncate(4 * n)  # sparse: no disk is used
    return m, {"x": np.zeros((1, 1), np.float32)}, Expect(("W_ext", "w.bin"), MustFail(f"{gib} GiB of weights"))


def loop_negative_trip():
    m, feeds, _ = loop_trip(-1)
    return m, feeds, Expect(("long_loop", "trip"), ORT)


FIXED = {
    "int64_const_2p40": lambda: int64_constant(2**40),
    "int64_const_2p31": lambda: int64_constant(2**31),
    "int64_const_min_minus_1": lambda: int64_constant(-(2**31) - 1),
    "int64_const_node_2p40": lambda: int64_constant(2**40, via="node"),
    "int64_feed_2p40": lambda: int64_feed(2**40),
    "int64_feed_2p31": lambda: int64_feed(2**31),
    "loop_trip_2p32_plus_3": lambda: loop_trip(2**32 + 3),
    "loop_trip_2p31": lambda: loop_trip(2**31),
    "loop_trip_2p40": lambda: loop_trip(2**40),
    "loop_trip_input_2p32_plus_3": lambda: loop_trip(2**32 + 3, as_input=True),
    "loop_trip_negative": loop_negative_trip,
    "bool_output_n1025": lambda: big_bool_output(1025),
    "bool_output_n1": lambda: big_bool_output(1),
    "range_3e9": lambda: range_big(),
    "range_3e9_float": lambda: range_big(0.0, 3e9, 1.0, np.float32),
    "range_beyond_int32_values": lambda: range_big(2**40, 2**40 + 3, 1),
    "range_delta_zero": lambda: range_big(0, 10, 0),
    "intermediate_40mb_batch1000": lambda: wide_intermediate(1000),
    "intermediate_40mb_batch2": lambda: wide_intermediate(2),
    "intermediate_1gib_batch20": per_sample_huge,
    "constant_of_shape_1e12": lambda: constant_of_shape(),
    "constant_of_shape_2p62": lambda: constant_of_shape((2**62,)),
    "constant_of_shape_overflow": lambda: constant_of_shape((2**40, 2**40)),
    "constant_of_shape_negative": lambda: constant_of_shape((-5,)),
    "tile_2p32": tile_huge,
    "pad_2p31": pad_huge,
    "onehot_depth_2p40": onehot_huge,
    "resize_scale_1e5": resize_huge,
    "input_declared_2p40": input_declared_huge,
    "slice_int64_max_ends": slice_to_int64_max,
    "gather_index_2p40": gather_index_int64,
}
_CI = {"int64_const_2p40", "loop_trip_2p32_plus_3", "bool_output_n1025", "range_3e9", "intermediate_40mb_batch1000",
       "constant_of_shape_1e12", "slice_int64_max_ends"}


@recipe("limits.fixed")
def fixed(ctx, key: str) -> None:
    model, feeds, expect = FIXED[key]()
    run_and_judge(ctx, model, feeds, expect)


@recipe("limits.external_weights")
def external_weights(ctx, gib: float) -> None:
    model, feeds, expect = external_weights_huge(ctx.dir, gib)
    run_and_judge(ctx, model, feeds, expect)


def cases() -> list[Case]:
    out = [Case(f"limits/{key}", "limits", "limits.fixed", dict(key=key), ci=key in _CI, timeout=120) for key in FIXED]
    out.append(Case("limits/external_weights_2.5gib", "limits", "limits.external_weights", dict(gib=2.5), timeout=180))
    return out
