"""Classifier heads on CUDA alone, the tiles of samples (operators/gemm.py `Dense.HEAD_MIN_WEIGHTS = 0`)
against operators/gemm_heads.py's form, over batches from 1 to 4,096, in one process: each head a
Gemm (transB, bias: nn.Linear's export) compiled once per side with tensor_cores="auto", its run's
kernel span timed (CUPTI, bench_mlp.device_times as bench_zoo's; inputs as CUDA tensors, no copy; median
of 20), checked against numpy (float64) within what TF32 allows, beside torch's nn.Linear (fp32, shipped
TF32 settings, the same timing). The heads form twice: with its k loop's loads an iteration ahead
(gemm_heads.Heads.AHEAD, the default) and where written ("written", the A/B's baseline); the two must
give the same bits.

    LUISAML_BACKEND=cuda python -P benchmarks/experiments/gemm_heads.py [--batches 1 16 4096]

Exit 1 where a side's output is off."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("luisaml") is None:
    sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))  # bench_mlp

# (K, N): ResNet-50, EfficientNet-B0, MobileNetV3-small's two, ConvNeXt-T, ResNet-18; NeRF's 256 x 256 (the tile's)
HEADS = [(2048, 1000), (1280, 1000), (576, 1024), (1024, 1000), (768, 1000), (512, 1000), (256, 256)]


def _model(K: int, N: int, rng):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    c = rng.standard_normal(N).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gemm", ["X", "W", "C"], ["Y"], transB=1)], "head",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", N])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(c, "C")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m, w, c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 16, 32, 64, 256, 1024, 4096])
    a = ap.parse_args()
    import torch

    import luisaml
    from bench_mlp import device_times
    from luisaml.operators.gemm import Dense
    from luisaml.operators.gemm_heads import Heads

    luisaml.device.init("cuda", tensor_cores=True)
    print(torch.cuda.get_device_name(), flush=True)
    rng, bad, shipped = np.random.default_rng(0), [], Dense.HEAD_MIN_WEIGHTS
    print("| K -> N | batch | tiles ms | heads, loads written ms | heads, loads ahead ms | torch ms | tiles form "
          "| heads form |\n"
          "|---|---|---|---|---|---|---|---|")
    for K, N in HEADS:
        model, w, c = _model(K, N, rng)
        nets = {}
        for side, bound, ahead in (("tiles", 0, True), ("written", shipped, False), ("heads", shipped, True)):
            Dense.HEAD_MIN_WEIGHTS, Heads.AHEAD = bound, ahead
            try:
                nets[side] = luisaml.compile(model, backend="cuda", tensor_cores="auto", fuse="off")
                st = next(s for s in nets[side].plan.schedule.stages if s.root[0].op_type == "Gemm")
                nets[side + " form"] = f"{type(st.root[1].block_tiling()).__name__}/{st.samples}"
            finally:
                Dense.HEAD_MIN_WEIGHTS, Heads.AHEAD = shipped, True
        lin = torch.nn.Linear(K, N).cuda()
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w))
            lin.bias.copy_(torch.from_numpy(c))
        for n in a.batches:
            x = rng.standard_normal((n, K)).astype(np.float32)
            want = x.astype(np.float64) @ w.T.astype(np.float64) + c
            row, xt, sync, outs = [], torch.from_numpy(x).cuda(), torch.cuda.synchronize, {}
            for side in ("tiles", "written", "heads"):
                net = nets[side]
                y = net.run({"X": xt})["Y"]
                sync()
                y = outs[side] = y.cpu().numpy() if hasattr(y, "cpu") else y
                err = float(np.abs(y - want).max() / np.abs(want).max())
                if err > 1e-2:  # (TF32's 10 bits on the tile: ~1e-3; FP32 ~1e-6)
                    bad.append(f"{K}->{N} batch {n} {side}: relative error {err:.1e}")
                row.append(float(np.median(device_times(lambda: net.run({"X": xt}), sync, 20)[0])))
            if not np.array_equal(outs["written"], outs["heads"]):
                bad.append(f"{K}->{N} batch {n}: the loads ahead changed bits")
            with torch.no_grad():
                times = device_times(lambda: lin(xt), sync, 20)[0]
            print(f"| {K} -> {N} | {n} | {row[0]:.4f} | {row[1]:.4f} | {row[2]:.4f} | {float(np.median(times)):.4f} | "
                  f"{nets['tiles form']} | {nets['heads form']} |", flush=True)
    if bad:
        print("MISMATCH:\n  " + "\n  ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
