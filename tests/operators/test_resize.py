"""Resize and Upsample against onnxruntime: every mode with every coordinate transform, nearest
rounding modes, cubic parameters, antialiasing, axes, keep_aspect_ratio_policy, crop-and-resize
with extrapolation, sizes, float16 and integers; several nodes per model (one kernel)."""

import numpy as np
import pytest
from onnx import helper

from util import assert_matches_ort, graph_model, rand, stage_of
from stage_forms import assert_per_batch, assert_stage_forms

import luisaml

F32 = np.float32
TRANSFORMS = ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel", "half_pixel_symmetric"]


def _resize_nodes(specs, x="x"):
    """Return (nodes, initializers): one Resize per (name, scales or None, sizes or None, attrs)."""
    nodes, inits = [], {}
    for name, scales, sizes, attrs in specs:
        ins = [x, ""]
        if scales is not None:
            inits[f"{name}_s"] = np.array(scales, F32)
            ins.append(f"{name}_s")
        if sizes is not None:
            inits[f"{name}_z"] = np.array(sizes, np.int64)
            ins += ["", f"{name}_z"]
        nodes.append(helper.make_node("Resize", ins, [name], name=name, **attrs))
    return nodes, inits


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_modes_and_transforms(mode):
    """Up- and downsampling by scales (whole output lengths: onnxruntime and ONNX's reference
    agree there) with each coordinate transform, on a 4-d and a 3-d input."""
    x4, x3 = rand((2, 3, 5, 6), seed=1), rand((2, 4, 9), seed=2)
    specs = []
    for k, t in enumerate(TRANSFORMS):
        specs.append((f"up{k}", [1, 1, 2.0, 1.5], None, dict(mode=mode, coordinate_transformation_mode=t)))
        specs.append((f"down{k}", [1, 1, 0.6, 0.5], None, dict(mode=mode, coordinate_transformation_mode=t)))
    nodes, inits = _resize_nodes(specs, "x4")
    more, inits3 = _resize_nodes([(f"r3_{k}", [1, 1, s], None, dict(mode=mode, coordinate_transformation_mode=t))
                                  for k, (t, s) in enumerate(zip(TRANSFORMS, [1.5, 0.34, 2 / 3, 3.0, 0.75]))], "x3")
    if mode == "cubic":  # onnxruntime runs cubic on 2-d and 4-d inputs only: 3-d against ONNX's reference
        _matches_reference(graph_model(more, {"x3": x3}, inits3, opset=19), {"x3": x3})
        more, inits3, x3 = [], {}, None
    feeds = {"x4": x4, **({"x3": x3} if x3 is not None else {})}
    model = graph_model(nodes + more, feeds, {**inits, **inits3}, opset=19)
    assert_matches_ort(model, feeds, batch_axis=None, rtol=1e-5, atol=1e-5)


def _matches_reference(model, feeds):
    from onnx.reference import ReferenceEvaluator

    got = luisaml.compile(model, batch_axis=None).run(feeds)
    ref = ReferenceEvaluator(model)
    for name, want in zip(ref.output_names, ref.run(None, feeds)):
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_nearest_modes_and_sizes():
    x = rand((1, 2, 7, 5), seed=3)
    specs = []
    for k, nm in enumerate(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]):
        for j, t in enumerate(["half_pixel", "asymmetric", "align_corners"]):
            specs.append((f"n{k}{j}", None, [1, 2, 12, 8], dict(mode="nearest", nearest_mode=nm, coordinate_transformation_mode=t)))
            specs.append((f"d{k}{j}", None, [1, 2, 4, 3], dict(mode="nearest", nearest_mode=nm, coordinate_transformation_mode=t)))
    nodes, inits = _resize_nodes(specs)
    model = graph_model(nodes, {"x": x}, inits, opset=19)
    assert_matches_ort(model, {"x": x}, batch_axis=None)


def test_cubic_parameters_and_antialias():
    x = rand((1, 1, 9, 8), seed=4)
    specs = [
        ("a05", [1, 1, 1.7, 0.8], None, dict(mode="cubic", cubic_coeff_a=-0.5)),
        ("excl", [1, 1, 0.8, 1.7], None, dict(mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1)),
        ("exlin", [1, 1, 0.4, 0.5], None, dict(mode="linear", antialias=1, exclude_outside=1)),
        ("aa_lin", [1, 1, 0.6, 0.375], None, dict(mode="linear", antialias=1)),
        ("aa_cub", [1, 1, 0.5, 0.75], None, dict(mode="cubic", antialias=1)),
        ("aa_up", [1, 1, 2.0, 0.5], None, dict(mode="linear", antialias=1)),
        ("aa_sizes", None, [1, 1, 4, 3], dict(mode="cubic", antialias=1)),
    ]
    nodes, inits = _resize_nodes(specs)
    model = graph_model(nodes, {"x": x}, inits, opset=19)
    assert_matches_ort(model, {"x": x}, batch_axis=None, rtol=1e-5, atol=1e-5)


def test_axes_and_aspect_ratio_policies():
    x = rand((2, 3, 6, 8), seed=5)
    nodes, inits = [], {}
    for k, (axes, sizes, policy) in enumerate([([-2, -1], [9, 5], "stretch"), ([3, 2], [5, 9], "not_larger"),
                                                ([2, 3], [9, 5], "not_smaller"), ([3, 1], [3, 7], "stretch")]):
        inits[f"z{k}"] = np.array(sizes, np.int64)
        nodes.append(helper.make_node("Resize", ["x", "", "", f"z{k}"], [f"y{k}"], axes=axes, mode="linear",
                                      keep_aspect_ratio_policy=policy))
    inits["s"] = np.array([0.5, 1.5], F32)
    nodes.append(helper.make_node("Resize", ["x", "", "s"], ["ys"], axes=[3, 1], mode="nearest"))
    # onnxruntime's linear mode keeps the outer two axes of a 4-d input: y3 against the reference
    assert_matches_ort(graph_model(nodes[:3] + nodes[4:], {"x": x}, inits, opset=19), {"x": x}, batch_axis=None)
    _matches_reference(graph_model(nodes[3:4], {"x": x}, {"z3": inits["z3"]}, opset=19), {"x": x})


def test_crop_and_resize():
    x = rand((1, 2, 6, 7), seed=6)
    inits = {
        "roi": np.array([0, 0, 0.2, 0.1, 1, 1, 0.9, 0.8], F32),
        "roi_out": np.array([0, 0, -0.3, 0.4, 1, 1, 0.7, 1.3], F32),  # partly outside: extrapolated
        "roi_axes": np.array([0.1, 0.3, 1.2, 0.6], F32),
        "z": np.array([1, 2, 5, 4], np.int64),
        "z2": np.array([4, 5], np.int64),
    }
    nodes = [
        helper.make_node("Resize", ["x", "roi", "", "z"], ["lin"], mode="linear", coordinate_transformation_mode="tf_crop_and_resize"),
        helper.make_node("Resize", ["x", "roi_out", "", "z"], ["ext"], mode="linear",
                         coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-7.5),
        helper.make_node("Resize", ["x", "roi_out", "", "z"], ["near"], mode="nearest",
                         coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=3.0),
        helper.make_node("Resize", ["x", "roi_axes", "", "z2"], ["axes"], mode="linear", axes=[3, 2],
                         coordinate_transformation_mode="tf_crop_and_resize"),
    ]
    model = graph_model(nodes, {"x": x}, inits, opset=19)
    assert_matches_ort(model, {"x": x}, batch_axis=None, rtol=1e-5, atol=1e-5)
    # cubic crops that shrink: onnxruntime's cubic mode only enlarges 4-d inputs
    cubic = helper.make_node("Resize", ["x", "roi_out", "", "z"], ["cub"], mode="cubic", extrapolation_value=0.5,
                             coordinate_transformation_mode="tf_crop_and_resize")
    _matches_reference(graph_model([cubic], {"x": x}, {k: inits[k] for k in ("roi_out", "z")}, opset=19), {"x": x})


def test_align_corners_fractional_length_follows_onnx_reference():
    """align_corners with scale * length not whole: ONNX's reference divides by scale * length - 1
    (onnxruntime by the output length - 1); luisaml follows the reference, as the node tests do."""
    x = rand((1, 1, 5, 4), seed=7)
    nodes, inits = _resize_nodes([("y", [1, 1, 0.6, 1.3], None, dict(mode="linear", coordinate_transformation_mode="align_corners"))])
    _matches_reference(graph_model(nodes, {"x": x}, inits, opset=19), {"x": x})


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64])
def test_dtypes(dtype):
    x = rand((2, 1, 3, 4), dtype, seed=8, low=-50, high=50)
    specs = [("near", [1, 1, 1.5, 2.0], None, dict(mode="nearest")),
             ("nsz", None, [2, 1, 2, 3], dict(mode="nearest", coordinate_transformation_mode="asymmetric"))]
    if dtype == np.float16:
        specs += [("lin", [1, 1, 2.0, 0.75], None, dict(mode="linear")), ("cub", [1, 1, 1.5, 1.5], None, dict(mode="cubic"))]
    nodes, inits = _resize_nodes(specs)
    model = graph_model(nodes, {"x": x}, inits, opset=19)
    if dtype == np.float16:
        assert_matches_ort(model, {"x": x}, batch_axis=None, rtol=1e-3, atol=1e-2)
    else:  # onnxruntime has no integer Resize kernels but for 8-bit types: ONNX's reference
        _matches_reference(model, {"x": x})


def test_opset_11_13_and_upsample():
    x = rand((1, 2, 3, 4), seed=9)
    s = np.array([1, 1, 2.0, 1.5], F32)
    empty = np.zeros((0,), F32)
    m11 = graph_model([helper.make_node("Resize", ["x", "roi", "s"], ["y"], mode="linear",
                                        coordinate_transformation_mode="pytorch_half_pixel")],
                      {"x": x}, {"roi": empty, "s": s}, opset=11)
    assert_matches_ort(m11, {"x": x}, batch_axis=None)
    m13 = graph_model([helper.make_node("Resize", ["x", "", "", "z"], ["y"], mode="cubic")], {"x": x},
                      {"z": np.array([1, 2, 5, 7], np.int64)}, opset=13)
    assert_matches_ort(m13, {"x": x}, batch_axis=None, rtol=1e-5, atol=1e-5)
    s9 = np.array([1, 1, 2.0, 3.0], F32)
    m9 = graph_model([helper.make_node("Upsample", ["x", "s"], ["near"], mode="nearest"),
                      helper.make_node("Upsample", ["x", "s"], ["lin"], mode="linear")], {"x": x}, {"s": s9}, opset=9)
    net, got = assert_matches_ort(m9, {"x": x}, batch_axis=None)
    np.testing.assert_array_equal(got["near"], x.repeat(2, axis=2).repeat(3, axis=3))
    # Resize-10 (upgraded like Upsample): asymmetric; nearest rounds down, or up when shrinking
    s10 = np.array([1, 1, 0.5, 0.4], F32)
    m10 = graph_model([helper.make_node("Resize", ["x", "s"], ["near"], mode="nearest"),
                       helper.make_node("Resize", ["x", "s"], ["lin"], mode="linear")], {"x": x}, {"s": s10}, opset=10)
    assert_matches_ort(m10, {"x": x}, batch_axis=None)


def test_batch_mode():
    x = rand((3, 2, 4, 4), seed=10)
    nodes, inits = _resize_nodes([("y", [1, 1, 2.0, 0.5], None, dict(mode="linear"))])
    model = graph_model(nodes, {"x": x}, inits, opset=19, batch="N")
    net, _ = assert_matches_ort(model, {"x": x}, batch_axis=0)
    assert net.batch_symbol == "N"
    # resizing the batch axis mixes samples: compiled per batch size
    nodes, inits = _resize_nodes([("y", [2.0, 1, 1, 1], None, dict(mode="nearest"))])
    model = graph_model(nodes, {"x": x}, inits, opset=19, batch="N")
    assert_per_batch(model, lambda n: {"x": rand((n, 2, 4, 4), seed=n)}, "y", sizes=(3, 5))


def test_errors_name_the_node():
    x = rand((1, 1, 4, 4), seed=11)
    nodes, inits = _resize_nodes([("y", [1, 1, 2, 2], None, dict(mode="linear"))])
    model = graph_model(nodes, {"x": x, "s_in": np.ones(4, F32)}, inits, opset=19)
    model.graph.node[0].input[2] = "s_in"  # scales from a graph input: not known when compiling
    with pytest.raises(luisaml.CompileError, match="'y'.*must be a constant|shape could not be inferred"):
        luisaml.compile(model, batch_axis=None)
    xi = rand((1, 1, 4, 4), np.int32, seed=12)
    nodes, inits = _resize_nodes([("y", [1, 1, 2, 2], None, dict(mode="cubic"))])
    with pytest.raises(luisaml.CompileError, match=r"Resize.*int32, expected float"):
        luisaml.compile(graph_model(nodes, {"x": xi}, inits, opset=19), batch_axis=None)


def test_resize_stage_forms():
    """Resize in a batched model: nearest inline (read by a Neg) and as an output (a crop with
    extrapolation too), linear and cubic one thread per output element, at two batch sizes."""
    specs = [("near", [1, 1, 2.0, 1.5], None, dict(mode="nearest")),
             ("near_in", [1, 1, 0.5, 2.0], None, dict(mode="nearest", coordinate_transformation_mode="asymmetric")),
             ("lin", [1, 1, 1.5, 0.5], None, dict(mode="linear")),
             ("cub", None, [7, 3], dict(mode="cubic", coordinate_transformation_mode="align_corners", axes=[2, 3])),
             ("crop", None, [3, 7], dict(mode="nearest", coordinate_transformation_mode="tf_crop_and_resize",
                                         extrapolation_value=-1.0, axes=[2, 3]))]
    nodes, inits = _resize_nodes(specs)
    inits["crop_r"] = np.array([-0.2, 0.1, 0.9, 1.3], F32)
    nodes[-1].input[1] = "crop_r"
    nodes.append(helper.make_node("Neg", ["near_in"], ["neg"], name="neg"))
    model = graph_model(nodes, {"x": rand((2, 2, 4, 5), seed=30)}, inits, opset=19, batch="N")
    net = assert_stage_forms(model, lambda n: {"x": rand((n, 2, 4, 5), seed=n)}, [name for name, *_ in specs],
                             rtol=1e-5, atol=1e-5)
    assert "Resize 'near_in'" in stage_of(net, "neg").inlined


def test_grid_sample_and_roi_align_stage_forms():
    """GridSample (one thread per output element) in a batched model at two batch sizes; RoiAlign,
    whose batch_indices pick images across the batch, compiled per batch size and run one thread
    per output element."""
    nodes = [helper.make_node("GridSample", ["x", "g"], ["lin"], name="lin", align_corners=1),
             helper.make_node("GridSample", ["x", "g"], ["cub"], name="cub", mode="bicubic", padding_mode="reflection"),
             helper.make_node("GridSample", ["x", "g"], ["near"], name="near", mode="nearest", padding_mode="border")]
    model = graph_model(nodes, {"x": rand((2, 3, 4, 5)), "g": rand((2, 3, 2, 2))}, opset=16, batch="N")
    assert_stage_forms(model, lambda n: {"x": rand((n, 3, 4, 5), seed=n), "g": rand((n, 3, 2, 2), seed=n + 1, low=-1.2, high=1.2)},
                       ["lin", "cub", "near"], rtol=1e-5, atol=1e-5)

    node = helper.make_node("RoiAlign", ["x", "rois", "idx"], ["y"], name="roi", output_height=2, output_width=3,
                            sampling_ratio=2)
    model = graph_model([node], {"x": rand((2, 3, 7, 8)), "rois": rand((2, 4)), "idx": np.zeros(2, np.int64)},
                        opset=16, batch="N")

    def feeds(n):
        rng = np.random.default_rng(n)
        lo = rng.uniform(-1, 4, (n, 2)).astype(F32)
        return {"x": rand((n, 3, 7, 8), seed=n), "rois": np.concatenate([lo, lo + rng.uniform(0.5, 4, (n, 2)).astype(F32)], 1),
                "idx": rng.integers(0, n, n).astype(np.int64)}

    net = assert_per_batch(model, feeds, "roi", sizes=(2, 4))
    assert stage_of(net.network_for(4), "roi").domain == "element"
