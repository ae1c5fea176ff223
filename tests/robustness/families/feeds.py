"""Feeds: what a caller passes to run(): wrong names, element types, ranks, shapes and batch
sizes; odd but valid arrays (empty batch, strided, reversed, read-only, torch); int64 values past
32 bits; and indices out of range for Gather / GatherElements / ScatterElements, which must become
a luisaml error at run() naming the node (never an out-of-bounds read or a silent clamp).

Each fault goes through three ways of running: net.run(feeds), NetworkInstance.set_input +
forward, and net(**feeds). Valid feeds must give onnxruntime's outputs.
"""
from __future__ import annotations

import numpy as np
from onnx import helper

from .. import actions
from ..harness import FAIL_HARNESS, Case, Fail, MustFail, attempt, judge, recipe
from ..models import BOOL, I64, F, ReferenceRejected, make_model, ort_outputs, save, vi

RNG = np.random.default_rng(0)
X = RNG.uniform(-2, 2, (3, 4)).astype(np.float32)
TABLE = RNG.uniform(-1, 1, (5, 3)).astype(np.float32)
W = RNG.uniform(-1, 1, (4, 3)).astype(np.float32)


def base(name: str):
    """Return (model, valid feeds, compile options) of a base model."""
    if name == "mlp":
        nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="relu")]
        return make_model(nodes, [vi("x", F, ["N", 4])], [vi("y", F, ["N", 3])], {"W": W}), {"x": X}, {}
    if name == "two":
        m = make_model([helper.make_node("Add", ["a", "b"], ["y"], name="add")], [vi("a", F, ["N", 4]), vi("b", F, ["N", 4])],
                       [vi("y", F, ["N", 4])])
        return m, {"a": X, "b": -X}, {}
    if name == "gather":
        m = make_model([helper.make_node("Gather", ["table", "idx"], ["y"], name="gather_rows", axis=0)],
                       [vi("idx", I64, ["N", 2])], [vi("y", F, ["N", 2, 3])], {"table": TABLE})
        return m, {"idx": np.array([[0, 4], [1, 2], [3, 3]], np.int64)}, {}
    if name == "gather_elements":
        m = make_model([helper.make_node("GatherElements", ["x", "idx"], ["y"], name="gather_el", axis=1)],
                       [vi("x", F, ["N", 4]), vi("idx", I64, ["N", 4])], [vi("y", F, ["N", 4])])
        return m, {"x": X, "idx": np.array([[0, 1, 2, 3], [3, 2, 1, 0], [1, 1, 1, 1]], np.int64)}, {}
    if name == "scatter_elements":
        m = make_model([helper.make_node("ScatterElements", ["x", "idx", "upd"], ["y"], name="scatter_el", axis=1)],
                       [vi("x", F, ["N", 4]), vi("idx", I64, ["N", 2]), vi("upd", F, ["N", 2])], [vi("y", F, ["N", 4])])
        return m, {"x": X, "idx": np.array([[0, 3], [1, 2], [2, 0]], np.int64), "upd": X[:, :2].copy()}, {}
    if name == "bool":
        m = make_model([helper.make_node("Where", ["m", "x", "zero"], ["y"], name="where")],
                       [vi("m", BOOL, ["N", 4]), vi("x", F, ["N", 4])], [vi("y", F, ["N", 4])],
                       {"zero": np.array(0, np.float32)})
        return m, {"m": X > 0, "x": X}, {}
    if name == "static":
        m = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [vi("x", F, [3, 4])], [vi("y", F, [3, 4])])
        return m, {"x": X}, {"batch_axis": None}
    raise Fail(FAIL_HARNESS, f"unknown base {name!r}")


_DTYPES = {"float64": np.float64, "float16": np.float16, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
           "bool": np.bool_, "complex64": np.complex64, "object": object, "str": np.str_, "datetime": "datetime64[s]"}


def fault(kind: str, feeds: dict, first: str):
    """Return (feeds, offender, valid) for one fault applied to the first input; valid is True
    (must work), False (must be refused) or None (either, judged by the reference when it works)."""
    x = feeds[first]
    f = dict(feeds)
    if kind == "unknown_name":
        f["zz_unknown"] = x
        return f, "zz_unknown", False
    if kind == "missing":
        del f[first]
        return f, first, False
    if kind == "renamed":
        f[first.upper() + "_renamed"] = f.pop(first)
        return f, (first, first.upper() + "_renamed"), False
    if kind in _DTYPES:
        if np.dtype(_DTYPES[kind]) == x.dtype:
            return f, first, True
        f[first] = x.astype(str) if kind == "str" else x.astype(_DTYPES[kind])
        return f, first, False
    if kind == "list":
        f[first] = x.tolist()
        return f, first, None
    if kind == "scalar":
        f[first] = 1.0
        return f, first, False
    if kind == "none":
        f[first] = None
        return f, first, False
    valid = True
    if kind == "rank_low":
        f[first], valid = x.reshape(-1), False
    elif kind == "rank_high":
        f[first], valid = x[..., None], False
    elif kind == "inner_shape":
        f[first], valid = np.concatenate([x, x], axis=-1), False
    elif kind == "zero_d":
        f[first], valid = x.reshape(-1)[0].copy(), False
    elif kind == "empty_batch":
        f = {k: v[:0] for k, v in feeds.items()}
    elif kind == "strided":
        f[first] = np.repeat(x, 2, axis=-1)[..., ::2]
    elif kind == "reversed":
        f = {k: np.ascontiguousarray(v[::-1])[::-1] for k, v in feeds.items()}
    elif kind == "fortran":
        f[first] = np.asfortranarray(x)
    elif kind == "readonly":
        y = x.copy()
        y.flags.writeable = False
        f[first] = y
    elif kind == "big_batch":
        f = {k: np.tile(v, (20_000,) + (1,) * (v.ndim - 1)) for k, v in feeds.items()}
    elif kind == "huge_batch_view":
        # 2**31 elements that take no memory: the size check must come before any copy
        rows = 2**31 // max(1, x[:1].size) + 1
        f = {k: np.broadcast_to(v[:1], (rows,) + v.shape[1:]) for k, v in feeds.items()}
        valid = False
    elif kind == "batch_mismatch":
        f[first], valid = np.concatenate([x, x]), len(feeds) == 1
    else:
        raise Fail(FAIL_HARNESS, f"unknown fault {kind!r}")
    return f, first, valid


FAULTS = ("unknown_name", "missing", "renamed", "float64", "float16", "int32", "int64", "uint8", "bool", "complex64",
          "object", "str", "datetime", "list", "scalar", "none", "rank_low", "rank_high", "inner_shape", "zero_d",
          "empty_batch", "strided", "reversed", "fortran", "readonly", "big_batch", "huge_batch_view", "batch_mismatch")
BASES = ("mlp", "two", "gather", "bool", "static")
WAYS = ("run", "instance", "call")


def execute(net, feeds, way: str):
    """Run the compiled network one way and return its outputs by name."""
    import luisaml

    if way == "run":
        return net.run(feeds)
    if way == "call":
        out = net(**feeds)
        return dict(zip(net.output_names, out if isinstance(out, tuple) else (out,)))
    inst = luisaml.NetworkInstance(net)
    for k, v in feeds.items():
        inst.set_input(k, v)
    return inst.forward()


def ort_reference(model, feeds):
    def compute():
        try:
            return ort_outputs(model, {k: np.ascontiguousarray(v) for k, v in feeds.items()})
        except ReferenceRejected as e:
            raise Fail(FAIL_HARNESS, f"onnxruntime rejects valid feeds: {e}") from None

    return compute


def compile_base(ctx, model, options):
    """Compile a base model (it is valid: any failure is luisaml's) and return the network."""
    import luisaml

    path = save(model, ctx.path("model.onnx"))
    a = attempt(luisaml.compile, path, **options)
    judge(a, error_ok=False, what="compiling the base model")
    actions.check_source(a.value.source)
    return a.value


@recipe("feeds.fault")
def feed_fault(ctx, base_name: str, kind: str, way: str) -> None:
    model, feeds, options = base(base_name)
    net = compile_base(ctx, model, options)
    bad, offender, valid = fault(kind, feeds, next(iter(feeds)))
    a = attempt(execute, net, bad, way)
    if valid is False:
        judge(a, offender=offender, reference=MustFail(f"feeds with fault {kind}"), what=way)
    else:
        # a list is judged against the array it was made from
        ref = ort_reference(model, feeds if kind == "list" else bad)
        judge(a, offender=offender, reference=ref, error_ok=valid is None, what=way)


# indices a kernel would read or write out of bounds with: each must be a luisaml error at run()
INDEX_FAULTS = {
    "gather": {"past_end": [5, 0], "negative_past": [-6, 0], "huge": [2**31 - 1, 0], "negative_ok": [-1, -5]},
    "gather_elements": {"past_end": [4, 0, 0, 0], "negative_past": [-5, 0, 0, 0], "negative_ok": [-1, -4, 0, 1]},
    "scatter_elements": {"past_end": [4, 0], "negative_past": [0, -5], "negative_ok": [-1, -4]},
}
NODE = {"gather": "gather_rows", "gather_elements": "gather_el", "scatter_elements": "scatter_el"}


@recipe("feeds.index")
def index_fault(ctx, base_name: str, kind: str, way: str, row: int = 0) -> None:
    model, feeds, options = base(base_name)
    net = compile_base(ctx, model, options)
    idx = np.array(feeds["idx"])
    idx[row] = np.array(INDEX_FAULTS[base_name][kind], np.int64)
    bad = {**feeds, "idx": idx}
    a = attempt(execute, net, bad, way)
    if kind.endswith("_ok"):
        judge(a, reference=ort_reference(model, bad), error_ok=False, what=way)
    else:
        judge(a, offender=NODE[base_name], reference=MustFail(f"{base_name} index row {idx[row].tolist()} out of range"),
              what=way)


@recipe("feeds.api")
def api_fault(ctx, kind: str) -> None:
    """Misuse of run()'s other arguments and of NetworkInstance."""
    import luisaml

    model, feeds, options = base("mlp")
    net = compile_base(ctx, model, options)
    if kind == "unknown_output":
        judge(attempt(net.run, feeds, outputs=["nope_out"]), offender="nope_out", reference=MustFail("an unknown output"))
    elif kind == "feeds_list":
        judge(attempt(net.run, [feeds["x"]]), offender=("feeds", "dict", "mapping", "Mapping"),
              reference=MustFail("feeds as a list"))
    elif kind == "torch":
        import torch

        a = attempt(lambda: {k: v.numpy() for k, v in net.run({"x": torch.from_numpy(X.copy())}).items()})
        judge(a, reference=ort_reference(model, feeds), error_ok=False)
    elif kind == "torch_float64":
        import torch

        judge(attempt(net.run, {"x": torch.from_numpy(X.astype(np.float64))}), offender="x",
              reference=MustFail("a float64 tensor for a float input"))
    elif kind == "unbound_instance":
        judge(attempt(luisaml.NetworkInstance(net).forward), offender="x", reference=MustFail("forward with nothing bound"))
    elif kind == "instance_without_model":
        judge(attempt(luisaml.NetworkInstance().forward), offender=("model", "set_model"),
              reference=MustFail("forward without a model"))
    elif kind == "bound_output_wrong_shape":
        inst = luisaml.NetworkInstance(net)
        inst.set_input("x", X)
        a = attempt(lambda: (inst.set_output("y", np.zeros((2, 2), np.float32)), inst.forward())[1])
        judge(a, offender="y", reference=MustFail("an output bound to a [2, 2] array"))
    else:
        raise Fail(FAIL_HARNESS, f"unknown api fault {kind!r}")


API = ("unknown_output", "feeds_list", "torch", "torch_float64", "unbound_instance", "instance_without_model",
       "bound_output_wrong_shape")
_CI = {("mlp", "float64", "run"), ("two", "batch_mismatch", "run"), ("mlp", "huge_batch_view", "run"),
       ("gather", "int64", "run"), ("mlp", "empty_batch", "instance")}
_CI_INDEX = {("gather", "past_end", "run"), ("gather_elements", "past_end", "run"), ("scatter_elements", "past_end", "run")}


def cases() -> list[Case]:
    out = []
    for b in BASES:
        for kind in FAULTS:
            if b == "static" and kind in ("empty_batch", "big_batch", "batch_mismatch", "huge_batch_view"):
                continue
            for way in WAYS:
                out.append(Case(f"feeds/{b}/{kind}/{way}", "feeds", "feeds.fault", dict(base_name=b, kind=kind, way=way),
                                ci=(b, kind, way) in _CI))
    for b, kinds in INDEX_FAULTS.items():
        for kind in kinds:
            for way in WAYS:
                out.append(Case(f"feeds/index/{b}/{kind}/{way}", "feeds", "feeds.index",
                                dict(base_name=b, kind=kind, way=way), ci=(b, kind, way) in _CI_INDEX))
            # a bad index in the last sample only, not in the first thread's
            out.append(Case(f"feeds/index/{b}/{kind}/run_last_row", "feeds", "feeds.index",
                            dict(base_name=b, kind=kind, way="run", row=2)))
    out += [Case(f"feeds/api/{k}", "feeds", "feeds.api", dict(kind=k), ci=k == "unknown_output") for k in API]
    return out
