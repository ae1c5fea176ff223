"""The zoo's ConvTranspose, ReduceMax and MaxPool layers alone on the CPU backend, each form A/B in
one process: the reproducer of NOTES.md's "ConvTranspose tiles, long reductions and pools on the
CPU" (issue 27, items 5 and 6 of "The zoo on the CPU").

    python benchmarks/experiments/zoo_elem.py [--reps 15] [--only convt,reduce,pool,gpool]

For each layer at the zoo's --quick batch (U-Net's three up-convolutions, PointNet's max over 1,024
points, the max pools of the CIFAR CNN, LeNet, U-Net, ResNet's stem and SqueezeNet, EfficientNet's
squeeze-excitation global pools) the old form (old_form: the switch each
family keeps; for the pools a work item per output, which is what the element form's thread per
output did) and the shipped one are compiled, then run interleaved; prints the best `net.run` ms
of each (host copies included), the best stage time of each (`net.profile`: the kernel alone) and
onnxruntime's best in the same loop (intra-op spinning off)."""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_models' timing
from bench_models import interleaved  # noqa: E402

# (family, name, op, input shape [N, C, ...], attributes, weight shape or None)
LAYERS = [
    # (the zoo's quick batches: U-Net 1, PointNet 4, the CIFAR CNN 64, LeNet 256)
    ("convt", "unet up.0 128->64 16x16", "ConvTranspose", (1, 128, 16, 16), {"strides": [2, 2]}, (128, 64, 2, 2)),
    ("convt", "unet up.1 64->32 32x32", "ConvTranspose", (1, 64, 32, 32), {"strides": [2, 2]}, (64, 32, 2, 2)),
    ("convt", "unet up.2 32->16 64x64", "ConvTranspose", (1, 32, 64, 64), {"strides": [2, 2]}, (32, 16, 2, 2)),
    ("convt", "3x3 s2 p1 op1 64->32 32x32", "ConvTranspose", (1, 64, 32, 32),
     {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, (64, 32, 3, 3)),
    ("reduce", "pointnet max over 1024 points", "ReduceMax", (4, 1024, 1024), {"axes": [2], "keepdims": 0}, None),
    ("pool", "cifar maxpool 2 16x32x32", "MaxPool", (64, 16, 32, 32), {"kernel_shape": [2, 2], "strides": [2, 2]}, None),
    ("pool", "cifar maxpool 2 32x16x16", "MaxPool", (64, 32, 16, 16), {"kernel_shape": [2, 2], "strides": [2, 2]}, None),
    ("pool", "lenet maxpool 2 6x28x28", "MaxPool", (256, 6, 28, 28), {"kernel_shape": [2, 2], "strides": [2, 2]}, None),
    ("pool", "unet maxpool 2 16x128x128", "MaxPool", (1, 16, 128, 128), {"kernel_shape": [2, 2], "strides": [2, 2]}, None),
    ("pool", "resnet stem maxpool 3 s2 p1 64x56x56", "MaxPool", (1, 64, 56, 56),
     {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, None),
    ("pool", "squeezenet maxpool 3 s2 ceil 64x55x55", "MaxPool", (1, 64, 55, 55),
     {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, None),
    # EfficientNet-B0's squeeze-excitation pools at 112 x 112 images (--quick)
    ("gpool", "efficientnet SE pool 32x56x56", "GlobalAveragePool", (1, 32, 56, 56), {}, None),
    ("gpool", "efficientnet SE pool 144x28x28", "GlobalAveragePool", (1, 144, 28, 28), {}, None),
    ("gpool", "efficientnet SE pool 480x7x7", "GlobalAveragePool", (1, 480, 7, 7), {}, None),
]


def layer_model(op: str, shape, attrs, wshape, seed: int = 0):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    ins, inits = ["x"], []
    if wshape is not None:
        inits = [numpy_helper.from_array(rng.standard_normal(wshape).astype(np.float32) * 0.1, "w"),
                 numpy_helper.from_array(rng.standard_normal(wshape[1]).astype(np.float32), "b")]
        ins += ["w", "b"]
    graph = helper.make_graph([helper.make_node(op, ins, ["y"], **attrs)], op,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@contextlib.contextmanager
def old_form(family: str):
    """Compile the layer as it was before this change (the switch each family keeps for this)."""
    from luisaml.operators import conv_transpose, pool, reduce

    saved = conv_transpose.MAX_STRIDE, reduce.LANES, pool.ROW_TILE, pool.ROWS_FIRST
    if family == "convt":
        conv_transpose.MAX_STRIDE = 0
    elif family in ("reduce", "gpool"):  # (the global pools fold in the reductions' lanes)
        reduce.LANES = 1
    else:
        pool.ROW_TILE, pool.ROWS_FIRST = 1, False
    try:
        yield
    finally:
        conv_transpose.MAX_STRIDE, reduce.LANES, pool.ROW_TILE, pool.ROWS_FIRST = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", default="convt,reduce,pool,gpool")
    a = ap.parse_args(argv)
    import onnxruntime as ort

    import luisaml

    for family, name, op, shape, attrs, wshape in LAYERS:
        if family not in a.only.split(","):
            continue
        m = layer_model(op, shape, attrs, wshape)
        with old_form(family):
            old = luisaml.compile(m, backend="cpu")
        new = luisaml.compile(m, backend="cpu")
        so = ort.SessionOptions()
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        want = sess.run(None, {"x": x})[0]
        for net in (old, new):
            np.testing.assert_allclose(net.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4)
        ms = interleaved({"old": lambda: old.run({"x": x}), "new": lambda: new.run({"x": x}),
                          "ort": lambda: sess.run(None, {"x": x})}, a.reps, warmup=0)
        stage = {key: min(sum(t for _, t in net.profile({"x": x})) for _ in range(3)) for key, net in (("old", old), ("new", new))}
        print(f"{name}: run best old {min(ms['old']):.2f} / new {min(ms['new']):.2f} ms "
              f"(medians {np.median(ms['old']):.2f} / {np.median(ms['new']):.2f}), "
              f"stage old {stage['old']:.2f} / new {stage['new']:.2f} ms; onnxruntime best {min(ms['ort']):.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
