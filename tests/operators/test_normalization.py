"""The normalizations against onnxruntime on random data of several shapes: BatchNormalization
(inference and training mode), InstanceNormalization, LayerNormalization (axes, epsilon, Mean and
InvStdDev outputs, broadcast Scale/B), GroupNormalization (opset 18 and 21), RMSNormalization,
LpNormalization, MeanVarianceNormalization, LRN; half inputs; per-sample execution; the parallel
stages each one runs in (a work item per group, a thread per element for LRN, BatchNormalization
inline or fused after a Conv); and the per-batch compile of a normalization across the batch axis."""

import numpy as np
import pytest
from onnx import helper

from test_conv import model
from test_reduce import assert_compiles_per_batch, assert_runs_in_parallel
from util import assert_matches_ort, ort_run, rand, stage_of

import luisaml

F32 = {"rtol": 1e-5, "atol": 1e-5}


def node(op, name, ins, outs=None, **attrs):
    return helper.make_node(op, ins, outs or [name], name=name, **attrs)


def positive(shape, seed):
    return rand(shape, seed=seed, low=0.5, high=2.0)


def test_batch_and_instance_normalization():
    x4, x2, x3 = rand((2, 3, 4, 5), seed=1), rand((4, 3), seed=2), rand((2, 3, 7), seed=3)
    s, b, mean, var = rand((3,), seed=4), rand((3,), seed=5), rand((3,), seed=6), positive((3,), 7)
    feeds = {"x4": x4, "x2": x2, "x3": x3, "s": s, "b": b, "mean": mean, "var": var}
    nodes = [
        node("BatchNormalization", "bn4", ["x4", "s", "b", "mean", "var"]),
        node("BatchNormalization", "bn2", ["x2", "s", "b", "mean", "var"], epsilon=0.1),
        node("BatchNormalization", "bn3", ["x3", "s", "b", "mean", "var"], epsilon=1e-3),
        node("InstanceNormalization", "in4", ["x4", "s", "b"]),
        node("InstanceNormalization", "in3", ["x3", "s", "b"], epsilon=0.01),
    ]
    assert_matches_ort(model(nodes, feeds), feeds, batch_axis=None, **F32)


def test_batch_normalization_training_mode():
    x = rand((3, 2, 4, 3), seed=1)
    s, b, mean, var = rand((2,), seed=2), rand((2,), seed=3), rand((2,), seed=4), positive((2,), 5)
    feeds = {"x": x, "s": s, "b": b, "mean": mean, "var": var}
    nodes = [
        node("BatchNormalization", "bn", ["x", "s", "b", "mean", "var"], ["y", "rmean", "rvar"], training_mode=1, momentum=0.7),
    ]
    assert_matches_ort(model(nodes, feeds, opset=15), feeds, batch_axis=None, **F32)


def test_layer_and_rms_normalization():
    x = rand((2, 3, 4, 5), seed=1)
    s_last, b_last = rand((5,), seed=2), rand((5,), seed=3)
    s_45, b_bc = rand((4, 5), seed=4), rand((1, 5), seed=5)
    s_all = rand((2, 3, 4, 5), seed=6)
    feeds = {"x": x, "s_last": s_last, "b_last": b_last, "s_45": s_45, "b_bc": b_bc, "s_all": s_all}
    nodes = [
        node("LayerNormalization", "ln", ["x", "s_last", "b_last"], ["ln", "ln_mean", "ln_inv"]),
        node("LayerNormalization", "ln_axis2", ["x", "s_45", "b_bc"], ["ln_axis2", "", "ln2_inv"], axis=2, epsilon=0.1),
        node("LayerNormalization", "ln_axis0", ["x", "s_all"], ["ln_axis0", "ln0_mean"], axis=-4),
        node("LayerNormalization", "ln_nob", ["x", "s_45"], axis=-2),
    ]
    assert_matches_ort(model(nodes, feeds, opset=17), feeds, batch_axis=None, **F32)
    feeds = {"x": x, "s_last": s_last, "s_45": s_45}
    nodes = [
        node("RMSNormalization", "rms", ["x", "s_last"]),
        node("RMSNormalization", "rms_axis2", ["x", "s_45"], axis=2, epsilon=0.5),
    ]
    m = model(nodes, feeds, opset=23)
    want = {"rms": _rms(x, s_last, -1, 1e-5), "rms_axis2": _rms(x, s_45, 2, 0.5)}
    got = luisaml.compile(m, batch_axis=None).run(feeds)
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-5, err_msg=k)


def test_layer_normalization_of_equal_values_is_the_bias():
    """Rows of equal values have mean that value and variance 0, so the output is the bias (numpy,
    exactly). sum / n rounds three floats near 245 to another value, which eps = 1e-5 turned into
    outputs 2e-3 off (fuzz graph 5:943); mixed rows against numpy in float64."""
    rng = np.random.default_rng(3)
    x = np.repeat(rng.uniform(-300, 300, (6, 1)), 3, axis=1).astype(np.float32)
    x[0] = 245.24873
    x[5] = [245.24873, 245.2488, 245.24866]  # (not equal: numpy's float64 statistics)
    s, b = rand((3,), seed=8), rand((3,), seed=9)
    feeds = {"x": x, "s": s, "b": b}
    got = luisaml.compile(model([node("LayerNormalization", "ln", ["x", "s", "b"])], feeds, opset=17),
                          batch_axis=None).run(feeds)["ln"]
    np.testing.assert_array_equal(got[:5], np.broadcast_to(b, (5, 3)))
    x64 = x[5].astype(np.float64)
    want = (x64 - x64.mean()) / np.sqrt(x64.var() + 1e-5) * s + b
    np.testing.assert_allclose(got[5], want, rtol=1e-4, atol=1e-4)


def _rms(x, scale, axis, eps):
    """numpy RMSNormalization (this onnxruntime has no kernel for opset 23's op)."""
    axes = tuple(range(axis % x.ndim, x.ndim))
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=axes, keepdims=True) + eps) * scale).astype(np.float32)


def test_group_normalization_opset_18_and_21():
    x = rand((2, 6, 3, 4), seed=1)
    x3 = rand((3, 4, 5), seed=2)
    sg, bg = rand((3,), seed=3), rand((3,), seed=4)  # per group (opset 18)
    sc, bc = rand((6,), seed=5), rand((6,), seed=6)  # per channel (opset 21)
    feeds18 = {"x": x, "sg": sg, "bg": bg}
    # followed by a Relu: onnx leaves GroupNormalization's output untyped, its operator types it
    nodes = [node("GroupNormalization", "gn", ["x", "sg", "bg"], ["gn_y"], num_groups=3, epsilon=1e-3), node("Relu", "relu", ["gn_y"])]
    m18 = model(nodes, feeds18, opset=18)
    assert_matches_ort(m18, feeds18, batch_axis=None, **F32)
    # opset 21: per-channel scale and bias; this onnxruntime has no kernel for it, numpy is the reference
    feeds21 = {"x": x, "sc": sc, "bc": bc, "x3": x3, "s4": sc[:4], "b4": bc[:4]}
    nodes = [
        node("GroupNormalization", "gn21", ["x", "sc", "bc"], num_groups=2),
        node("GroupNormalization", "gn21_3d", ["x3", "s4", "b4"], num_groups=4, epsilon=0.1),
    ]
    got = luisaml.compile(model(nodes, feeds21, opset=21), batch_axis=None).run(feeds21)
    np.testing.assert_allclose(got["gn21"], _group_norm(x, 2, sc, bc, 1e-5), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["gn21_3d"], _group_norm(x3, 4, sc[:4], bc[:4], 0.1), rtol=1e-5, atol=1e-5)


def _group_norm(x, groups, scale, bias, eps):
    """numpy GroupNormalization-21: statistics per (sample, group), per-channel scale and bias."""
    n, c = x.shape[:2]
    g = x.astype(np.float64).reshape(n, groups, -1)
    y = (g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)
    shape = (1, c) + (1,) * (x.ndim - 2)
    return (y.reshape(x.shape) * scale.reshape(shape) + bias.reshape(shape)).astype(np.float32)


def test_lp_and_mean_variance_normalization():
    x = rand((2, 3, 4, 5), seed=1)
    x[0, 1, :, 2] = 0.0  # a zero vector along axis 2 normalizes to zeros
    feeds = {"x": x}
    nodes = [
        node("LpNormalization", "l2", ["x"]),
        node("LpNormalization", "l1_axis1", ["x"], axis=1, p=1),
        node("LpNormalization", "l2_axis2", ["x"], axis=2),
        node("MeanVarianceNormalization", "mvn", ["x"]),
        node("MeanVarianceNormalization", "mvn_axes", ["x"], axes=[1, 3]),
    ]
    assert_matches_ort(model(nodes, feeds), feeds, batch_axis=None, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule", ["stages", "per-sample"])
def test_half_per_sample(schedule):
    """Half data with float statistics, batched: parallel stages, and one thread per sample
    running the per-sample function (each node's whole form)."""
    x = rand((3, 4, 2, 5), np.float16, seed=1)
    s, b = rand((4,), np.float16, seed=2), rand((4,), np.float16, seed=3)
    mean, var = rand((4,), np.float16, seed=4), positive((4,), 5).astype(np.float16)
    s5, b5 = rand((5,), np.float16, seed=6), rand((5,), np.float16, seed=7)
    s2, b2 = rand((2,), np.float16, seed=8), rand((2,), np.float16, seed=9)
    feeds = {"x": x}
    inits = {"s": s, "b": b, "mean": mean, "var": var, "s5": s5, "b5": b5, "s2": s2, "b2": b2}
    nodes = [
        node("BatchNormalization", "bn", ["x", "s", "b", "mean", "var"]),
        node("InstanceNormalization", "inorm", ["x", "s", "b"]),
        node("LayerNormalization", "ln", ["x", "s5", "b5"], axis=-1),
        node("LpNormalization", "lp", ["x"], axis=1),
        node("GroupNormalization", "gn", ["x", "s2", "b2"], num_groups=2),
        node("LRN", "lrn", ["x"], size=3),
    ]
    m = model(nodes, feeds, inits, opset=18, batch="N")
    net = luisaml.compile(m, schedule=schedule)
    assert net.batch_symbol == "N"
    got = net.run(feeds)
    # the reference: onnxruntime in float, rounded to half
    m32 = model(nodes, {"x": x.astype(np.float32)}, {k: v.astype(np.float32) for k, v in inits.items()}, opset=18)
    want = ort_run(m32, {"x": x.astype(np.float32)})
    for k, w in want.items():
        assert got[k].dtype == np.float16
        np.testing.assert_allclose(got[k].astype(np.float32), w.astype(np.float16).astype(np.float32), rtol=2e-3, atol=2e-3, err_msg=k)


@pytest.mark.parametrize(
    "op,attrs,inputs",
    [
        ("LayerNormalization", {"axis": 0}, ["s_all"]),
        ("LpNormalization", {"axis": 0}, []),
        ("MeanVarianceNormalization", {"axes": [0, 2]}, []),
        ("BatchNormalization", {"training_mode": 1}, ["c", "c", "c", "c"]),
    ],
)
def test_normalizing_over_the_batch_axis_compiles_per_batch(op, attrs, inputs):
    """Statistics over the batch axis mix samples: the network compiles per batch size (a work
    item per group still) and has no per-sample `forward`."""
    inits = {"s_all": rand((3, 4), seed=2), "c": positive((3,), 3)}
    outs = ["y", "rm", "rv"] if attrs.get("training_mode") else ["y"]
    m = model([helper.make_node(op, ["x"] + inputs, outs, name="norm", **attrs)], {"x": rand((2, 3, 4), seed=1)},
              {k: inits[k] for k in set(inputs)}, opset=17, batch="N")
    net = assert_compiles_per_batch(m, "norm", lambda n: {"x": rand((n, 3, 4), seed=n)}, **F32)
    assert stage_of(net, "norm").domain == "items"


C4 = {"s": rand((4,), seed=11), "b": rand((4,), seed=12), "mean": rand((4,), seed=13), "var": positive((4,), 14),
      "s5": rand((5,), seed=15), "s35": rand((3, 5), seed=16), "b5": rand((1, 5), seed=17), "g2": rand((2,), seed=18)}
NORMS = [  # (op, opset, initializer inputs, attributes, the stage's domain)
    ("BatchNormalization", 15, ["s", "b", "mean", "var"], {"epsilon": 1e-3}, "element"),
    ("InstanceNormalization", 17, ["s", "b"], {"epsilon": 0.01}, "items"),
    ("LayerNormalization", 17, ["s5", "b5"], {}, "items"),
    ("LayerNormalization", 17, ["s35"], {"axis": 2}, "items"),
    ("GroupNormalization", 18, ["g2", "g2"], {"num_groups": 2}, "items"),
    ("LpNormalization", 17, [], {"axis": 1, "p": 1}, "items"),
    ("LpNormalization", 17, [], {"axis": -1}, "items"),
    ("MeanVarianceNormalization", 17, [], {"axes": [2, 3]}, "items"),
    ("LRN", 17, [], {"size": 3, "alpha": 0.01}, "element"),
]


@pytest.mark.parametrize("op,opset,inputs,attrs,domain", NORMS, ids=[f"{p[0]}-{k}" for k, p in enumerate(NORMS)])
def test_runs_in_parallel_stages(op, opset, inputs, attrs, domain):
    """Batched: a work item per normalized group, a thread per element for LRN and for
    BatchNormalization in inference (a per-channel map, its own stage when nothing precedes it)."""
    x = rand((2, 4, 3, 5), seed=1)
    nodes = [helper.make_node(op, ["x"] + inputs, ["y"], name="norm", **attrs)]
    m = model(nodes, {"x": x}, {k: C4[k] for k in set(inputs)}, opset=opset, batch="N")
    net = assert_runs_in_parallel(m, "norm", lambda n: {"x": rand((n, 4, 3, 5), seed=n)}, rtol=1e-4, atol=1e-5)
    assert stage_of(net, "norm").domain == domain


def test_rms_normalization_runs_one_item_per_row():
    """RMSNormalization (checked against numpy: this onnxruntime has no opset-23 kernel)."""
    s = rand((5,), seed=2)
    m = model([node("RMSNormalization", "rms", ["x", "s"])], {"x": rand((2, 3, 5))}, {"s": s}, opset=23, batch="N")
    net = luisaml.compile(m)
    assert stage_of(net, "rms").domain == "items"
    for n in (1, 3):
        x = rand((n, 3, 5), seed=n)
        np.testing.assert_allclose(net.run({"x": x})["rms"], _rms(x, s, -1, 1e-5), rtol=1e-5, atol=1e-5)


def test_layer_normalization_then_relu_is_one_stage():
    """A group's elements are stored once and never read back: the Relu after it is applied to
    those stores (the epilogue of the groups' stage); Mean, a second output, is stored too."""
    nodes = [node("LayerNormalization", "ln", ["x", "s5", "b5"], ["ln", "mean"], axis=-1), node("Relu", "relu", ["ln"])]
    m = model(nodes, {"x": rand((2, 4, 3, 5))}, {k: C4[k] for k in ("s5", "b5")}, opset=17, batch="N")
    net = assert_runs_in_parallel(m, "ln", lambda n: {"x": rand((n, 4, 3, 5), seed=n)}, rtol=1e-5, atol=1e-5)
    (st,) = net.plan.schedule.stages
    assert st.domain == "items" and [n.name for n, _ in st.epilogue] == ["relu"]


def test_conv_batchnorm_relu_is_one_stage():
    """Conv, then BatchNormalization in inference, then Relu: one stage, the Conv's. With constant
    weights the BatchNormalization folds into them (passes/cleanup.fold_batchnorm: no node left,
    Relu the epilogue); with weights fed at run time it is the epilogue's per-channel map applied
    to each element before its one store. Both against onnxruntime."""
    x = rand((2, 3, 6, 5), seed=1)
    w = rand((4, 3, 3, 3), seed=2)
    params = {"cb": rand((4,), seed=3), **{k: C4[k] for k in ("s", "b", "mean", "var")}}
    nodes = [node("Conv", "conv", ["x", "w", "cb"], pads=[1, 1, 1, 1]),
             node("BatchNormalization", "bn", ["conv", "s", "b", "mean", "var"]),
             node("Relu", "relu", ["bn"])]
    for w_fed, epilogue in ((False, ["relu"]), (True, ["bn", "relu"])):
        inits = params if w_fed else {"w": w, **params}
        m = model(nodes, {"x": x, "w": w} if w_fed else {"x": x}, inits, opset=15, batch="N")
        if w_fed:  # (model() gives every input the batch dimension; the weights have none)
            m.graph.input[1].type.tensor_type.shape.dim[0].dim_value = 4
        net = assert_runs_in_parallel(m, "conv", lambda n: {"x": rand((n, 3, 6, 5), seed=n), **({"w": w} if w_fed else {})},
                                      rtol=1e-5, atol=1e-5)
        stages = net.plan.schedule.stages
        assert len(stages) == 1, net.plan.schedule.describe()
        assert stages[0].domain in ("element", "items") and stages[0].root[0].name == "conv"
        assert [n.name for n, _ in stages[0].epilogue] == epilogue
        assert ("bn" in [n.name for n, _ in net.plan.ops]) == w_fed


def test_lrn():
    x, x1 = rand((2, 5, 3, 4), seed=1), rand((1, 4, 1, 6), seed=2)
    feeds = {"x": x, "x1": x1}
    nodes = [
        node("LRN", "lrn3", ["x"], size=3),
        node("LRN", "lrn5", ["x"], size=5, alpha=0.01, beta=0.5, bias=2.0),
        node("LRN", "lrn1", ["x1"], size=1, alpha=0.1),
        node("LRN", "lrn3b", ["x1"], size=3, beta=1.5),
    ]
    assert_matches_ort(model(nodes, feeds), feeds, batch_axis=None, rtol=1e-5, atol=1e-6)
    # an even size and a 3-D input: onnxruntime refuses both (and onnx's reference loops over N
    # instead of C), so numpy following the spec is the judge
    x3 = rand((2, 6, 5), seed=3)
    feeds = {"x": x, "x3": x3}
    m = model([node("LRN", "lrn4", ["x"], size=4, alpha=0.01, beta=0.5, bias=2.0), node("LRN", "lrn_3d", ["x3"], size=3)], feeds)
    got = luisaml.compile(m, batch_axis=None).run(feeds)
    np.testing.assert_allclose(got["lrn4"], _lrn(x, 4, 0.01, 0.5, 2.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["lrn_3d"], _lrn(x3, 3, 1e-4, 0.75, 1.0), rtol=1e-5, atol=1e-6)


def _lrn(x, size, alpha, beta, bias):
    """numpy LRN as the spec writes it: channels [c - floor((size-1)/2), c + ceil((size-1)/2)]."""
    x64, C = x.astype(np.float64), x.shape[1]
    sq = np.zeros_like(x64)
    for c in range(C):
        lo, hi = max(0, c - (size - 1) // 2), min(C - 1, c + size // 2)
        sq[:, c] = (x64[:, lo : hi + 1] ** 2).sum(axis=1)
    return (x64 / (bias + alpha / size * sq) ** beta).astype(np.float32)
