"""Tensor cores through luisaml's compiler front on CUDA: the start-up self-test, then MatMul layers
(a constant B, as a model's layer has it) compiled with tensor_cores=False (tiled.py's FP32 register
tile) and "auto" (operators/tiled_mma.py's TF32 mma tiles where the self-test passed) against torch
fp32 with TF32 off and on, in the same process.

    LUISAML_BACKEND=cuda python benchmarks/bench_tensor_cores.py          # benchmarks/tc_device.sh runs it

Correctness first, against float64 on the GPU (torch): the FP32 paths within 5e-5 of the reference's
norm, the TF32 paths within 1e-2 (torch's own TF32 tolerance); a failure stops the command. Then the
four timed interleaved on the same inputs (each call synchronises), P50/P95/P99 in milliseconds and
TFLOP/s at the median. Writes benchmarks/results/tensor-cores-<gpu>.json (h200 or h100), or --out."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("luisaml") is None:
    sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))  # (run with -P on the device machine: the script's folder is not on the path)
from bench_rnn import interleaved  # noqa: E402  (the sides timed round robin, P50/P95/P99)

FP32_TOL, TF32_TOL = 5e-5, 1e-2
# (name, M, K, N): the prototype's 4096^3, a CNN's 1x1 conv as a GEMM (196 positions x batch 64, 512 -> 2048
# channels), a transformer's MLP up-projection (32 tokens... x batch 64, 768 -> 3072)
SHAPES = [("4096^3", 4096, 4096, 4096), ("cnn 1x1 conv 12544x512 x 512x2048", 196 * 64, 512, 2048),
          ("transformer mlp 2048x768 x 768x3072", 32 * 64, 768, 3072)]


def matmul_model(M: int, K: int, N: int, b: np.ndarray):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "matmul",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, [M, K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [M, N])],
                          [numpy_helper.from_array(b, "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def rel_err(got, want) -> float:
    """|got - want| / |want| in the Frobenius norm (float64)."""
    import torch

    return float(torch.linalg.norm(got.double() - want) / torch.linalg.norm(want))


def self_tests() -> dict:
    from luisaml import tensor_cores

    out = {"runtime_dir": str(tensor_cores._started_in[0]) if tensor_cores._started_in else None}
    for kind in tensor_cores.KINDS:
        t = tensor_cores.status(kind)
        out[kind] = {"live": t.live, "why": t.why, "err_rounded": t.err_rounded, "err_fp32": t.err_fp32}
        print(f"self-test {kind}: {'LIVE' if t.live else 'not live'} ({t.why}; |d - rounded| {t.err_rounded:.3g}, "
              f"|d - fp32| {t.err_fp32:.3g})", flush=True)
    return out


def run(shapes, reps: int) -> list[dict]:
    import torch

    import luisaml

    rows = []
    for name, M, K, N in shapes:
        g = torch.Generator(device="cuda").manual_seed(M + K + N)
        a = torch.randn(M, K, device="cuda", generator=g)
        b = torch.randn(K, N, device="cuda", generator=g)
        want = a.double() @ b.double()
        nets, errs, compile_s = {}, {}, {}
        for label, tc in (("luisaml_fp32", False), ("luisaml_tc", "auto")):
            t0 = time.perf_counter()
            net = luisaml.compile(matmul_model(M, K, N, b.cpu().numpy()), backend="cuda", batch_axis=None,
                                  tensor_cores=tc)
            y = net.run({"A": a})["Y"]
            torch.cuda.synchronize()
            compile_s[label] = time.perf_counter() - t0
            nets[label] = net
            errs[label] = rel_err(torch.as_tensor(y, device="cuda").reshape(M, N), want)
        mma = "mma_tf32_m16n8k8" in nets["luisaml_tc"].plan.source

        def torch_mm(tf32: bool):
            def f():
                torch.backends.cuda.matmul.allow_tf32 = tf32
                torch.matmul(a, b)
                torch.cuda.synchronize()
            return f

        for label, tf32 in (("torch_fp32", False), ("torch_tf32", True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            errs[label] = rel_err(torch.matmul(a, b), want)
        torch.backends.cuda.matmul.allow_tf32 = False
        tols = {"luisaml_fp32": FP32_TOL, "luisaml_tc": TF32_TOL if mma else FP32_TOL, "torch_fp32": FP32_TOL,
                "torch_tf32": TF32_TOL}
        bad = {k: e for k, e in errs.items() if not e <= tols[k]}
        if bad:
            raise SystemExit(f"{name}: relative error past tolerance: {bad} (tolerances {tols})")

        def ours(net):
            def f():
                net.run({"A": a})
                torch.cuda.synchronize()
            return f

        t = interleaved({"luisaml_fp32": ours(nets["luisaml_fp32"]), "luisaml_tc": ours(nets["luisaml_tc"]),
                         "torch_fp32": torch_mm(False), "torch_tf32": torch_mm(True)}, reps)
        torch.backends.cuda.matmul.allow_tf32 = False
        flop = 2.0 * M * N * K
        tflops = {k: flop / (v["p50"] * 1e-3) / 1e12 for k, v in t.items()}
        row = {"shape": name, "M": M, "K": K, "N": N, "tensor_cores_used": mma, "rel_err": errs, "ms": t,
               "tflops_p50": tflops, "compile_s": compile_s,
               "tc_speedup_vs_fp32_tile": t["luisaml_fp32"]["p50"] / t["luisaml_tc"]["p50"],
               "tc_vs_torch_tf32": t["luisaml_tc"]["p50"] / t["torch_tf32"]["p50"],
               "stage": nets["luisaml_tc"].plan.schedule.stages[0].domain}
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{k} {v['p50']:.3f} ms ({tflops[k]:.0f} TFLOP/s, err {errs[k]:.1e})"
                                      for k, v in t.items())
              + f"; mma tiles {'used' if mma else 'NOT used'}, {row['tc_speedup_vs_fp32_tile']:.2f}x the FP32 tile, "
              f"{row['tc_vs_torch_tf32']:.2f}x torch tf32's time", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="the 4096^3 GEMM only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("LUISAML_BACKEND", "cuda")
    import torch

    from luisaml import device

    device.init("cuda", tensor_cores=True)
    tests = self_tests()
    rows = run(SHAPES[:1] if args.quick else SHAPES, args.reps)
    gpu = torch.cuda.get_device_name()
    out = args.out or HERE / "results" / f"tensor-cores-{'h200' if 'H200' in gpu else 'h100' if 'H100' in gpu else 'gpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "host": platform.node(), "gpu": gpu, "torch": torch.__version__, "self_test": tests,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
