"""The tensor-core tile's variants on zoo shapes (benchmarks/NOTES.md, "A faster tensor-core tile"): each
shape compiled with tensor_cores="auto" once per variant of operators/tiled_mma.py (LUISAML_MMA_TILE, read
at choose()), checked against torch in float64 first (relative Frobenius error <= 1e-2, torch's own TF32
tolerance; the mma route must be live and the plan must hold the mma tile, else exit 1), then timed as the
per-call sum of the kernels' CUPTI durations (bench_mlp.kernel_ms, torch.profiler) with torch's TF32
(cuBLAS / cuDNN) on the same inputs. Prints TFLOP/s per variant and shape (the product's 2MNK over the
median), and the tile each variant chose.

    LUISAML_BACKEND=cuda python -P benchmarks/experiments/sweep_mma.py [--variants w64,w64r,w32,w32-first]
        [--shapes gemm4k,bert,...] [--reps 20] [--budget 140] [--ptxas] [--out results/sweep-mma-<gpu>.json]

Shapes: the 4096^3 GEMM; BERT's MLP up-projection at 16 x 128 tokens; ConvNeXt-T's stage-1 MLP at batch 16
(3136 x 16 rows, 96 -> 384 and back); ResNet-50's 1 x 1 (56 x 56, 64 -> 256), 3 x 3 (28 x 28, 128 -> 128,
the direct implicit GEMM: winograd=0) and last 1 x 1 (7 x 7, 512 -> 2048: rows of several samples a tile)
Convs at batch 16, its stride-2 3 x 3 (56 -> 28, 128 channels), wav2vec2's 512-channel 1-d Convs (3 taps stride 2
over 3,199 positions, 2 taps over 199) at batch 8. The conv gather is LUISAML_CONV_GATHER's (one process, one
gather: run twice for its A/B). The batched shapes are compiled with a batch axis, as the zoo compiles them (the
products do not know the batch: no SM fill)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("luisaml") is None:
    sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))  # bench_mlp (-P: the script's folder is not on the path)

TOL = 1e-2
BATCH = 16
# name: ("matmul", batch dims, K, N, batched) or ("conv", C, K, side, kernel)
SHAPES = {
    "gemm4k": ("matmul", (4096,), 4096, 4096, False),
    "bert": ("matmul", (BATCH, 128), 768, 3072, True),
    "convnext-up": ("matmul", (BATCH, 56, 56), 96, 384, True),
    "convnext-down": ("matmul", (BATCH, 56, 56), 384, 96, True),
    "r50-1x1": ("conv", 64, 256, 56, 1),
    "r50-3x3": ("conv", 128, 128, 28, 3),
    "r50-1x1-7": ("conv", 512, 2048, 7, 1),
    # (the im2col gathers' A/B, LUISAML_CONV_GATHER "step" / "reuse": NOTES.md "The mma tile's loads are in
    # flight") ResNet-50's stride-2 3 x 3 (56 -> 28, 128 channels: direct on CUDA); wav2vec2's encoder at the
    # zoo's batch 8: ("conv1d", C, K, length, taps, stride, batch)
    "r50-3x3-s2": ("conv", 128, 128, 56, 3, 2),
    "w2v-3": ("conv1d", 512, 512, 3199, 3, 2, 8),
    "w2v-2": ("conv1d", 512, 512, 199, 2, 2, 8),
}


def model(spec, w: np.ndarray):
    """The ONNX model of one shape: a MatMul by a constant B, or a Conv (no bias) with constant weights."""
    from onnx import TensorProto, helper, numpy_helper

    if spec[0] == "matmul":
        _, dims, K, _, batched = spec
        shape = (["N"] if batched else []) + list(dims[1:] if batched else dims) + [K]
        node = helper.make_node("MatMul", ["A", "W"], ["Y"])
        out_shape = shape[:-1] + [w.shape[1]]
    elif spec[0] == "conv1d":
        _, C, K, L, k, s, _ = spec
        shape = ["N", C, L]
        node = helper.make_node("Conv", ["A", "W"], ["Y"], kernel_shape=[k], strides=[s])
        out_shape = ["N", K, (L - k) // s + 1]
    else:
        _, C, K, side, k, *stride = spec
        s = (stride or [1])[0]
        shape = ["N", C, side, side]
        node = helper.make_node("Conv", ["A", "W"], ["Y"], kernel_shape=[k, k], pads=[k // 2] * 4, strides=[s, s])
        out = (side + 2 * (k // 2) - k) // s + 1
        out_shape = ["N", K, out, out]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, out_shape)],
                          [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def operands(spec, gen):
    """(input, weights, torch's op, 2MNK) on the GPU."""
    import torch
    import torch.nn.functional as F

    if spec[0] == "matmul":
        _, dims, K, N, _ = spec
        a = torch.randn(*dims, K, device="cuda", generator=gen)
        w = torch.randn(K, N, device="cuda", generator=gen) / K ** 0.5
        return a, w, lambda x, ww: torch.matmul(x, ww), 2.0 * np.prod(dims) * K * N
    if spec[0] == "conv1d":
        _, C, K, L, k, s, n = spec
        a = torch.randn(n, C, L, device="cuda", generator=gen)
        w = torch.randn(K, C, k, device="cuda", generator=gen) / (C * k) ** 0.5
        return a, w, lambda x, ww: F.conv1d(x, ww, stride=s), 2.0 * n * ((L - k) // s + 1) * K * C * k
    _, C, K, side, k, *stride = spec
    s = (stride or [1])[0]
    out = (side + 2 * (k // 2) - k) // s + 1
    a = torch.randn(BATCH, C, side, side, device="cuda", generator=gen)
    w = torch.randn(K, C, k, k, device="cuda", generator=gen) / (C * k * k) ** 0.5
    return a, w, lambda x, ww: F.conv2d(x, ww, padding=k // 2, stride=s), 2.0 * BATCH * out * out * K * C * k * k


def tiling_of(net) -> str:
    """The describe() of the plan's mma tilings (the product's blocks stages)."""
    one = net.network_for(BATCH) if hasattr(net, "network_for") else net
    out = []
    for st in one.plan.schedule.stages:
        for _, op in st.nodes:
            tl = op.block_tiling() if st.domain == "blocks" and hasattr(op, "block_tiling") else None
            if tl is not None and getattr(tl, "mma", False):
                out.append(f"{tl.BM}x{tl.BN} tiles, {tl.threads // 32} warps of {tl.WM}x{tl.WN}")
    return "; ".join(out) or "no mma tile"


def find_ptxas() -> str | None:
    """ptxas on PATH, in a CUDA toolkit, or the one triton ships (torch's CUDA wheels bring triton)."""
    import glob
    import shutil

    found = shutil.which("ptxas") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ptxas"))), None)
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    hits = glob.glob(str(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas")) if spec and spec.origin else []
    return hits[0] if hits else None


def ptxas_counts(ptxas: str, since: float) -> str:
    """Registers and spills of the kernels LuisaCompute cached (PTX, in the front's runtime directory's
    .cache) since `since`, by ptxas -v for sm_90: best effort, "?" where none is found."""
    import re
    import subprocess
    import tempfile

    from luisaml import tensor_cores

    d = tensor_cores._started_in[0] if tensor_cores._started_in else None
    out = []
    for f in sorted((d / ".cache").rglob("*") if d and (d / ".cache").is_dir() else [], key=lambda f: f.stat().st_mtime):
        if not f.is_file() or f.stat().st_mtime < since:
            continue
        data = f.read_bytes()
        start = data.find(b".version")
        if start < 0 or b"mma.sync" not in data:
            continue
        end = data.find(b"\0", start)
        with tempfile.NamedTemporaryFile(suffix=".ptx") as t:
            t.write(data[start:end if end > 0 else len(data)])
            t.flush()
            r = subprocess.run([ptxas, "-arch=sm_90", "-v", "-o", "/dev/null", t.name], capture_output=True, text=True,
                               timeout=120)
        regs = re.findall(r"Used (\d+) registers", r.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
        out.append(f"{','.join(regs) or '?'} regs, {','.join(spills) or '?'} B spilled" if r.returncode == 0
                   else f"ptxas failed: {r.stderr.strip()[-120:]}")
    return "; ".join(out) or "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="w64,w64r,w32,w32-first")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--budget", type=float, default=140.0, help="seconds: later shapes are skipped (said) past it")
    ap.add_argument("--ptxas", action="store_true", help="registers and spills per variant (ptxas -v on the cached PTX)")
    args = ap.parse_args()
    os.environ.setdefault("LUISAML_BACKEND", "cuda")
    import torch

    import luisaml
    from bench_mlp import kernel_ms
    from luisaml import device, tensor_cores
    from luisaml.operators import tiled_mma

    device.init("cuda", tensor_cores=True)
    st = tensor_cores.status("tf32")
    print(f"self-test tf32: {'LIVE' if st.live else 'NOT LIVE'} ({st.why})", flush=True)
    if not st.live:
        return 1
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in tiled_mma.VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}: {tiled_mma.VARIANTS}")
    t_start = time.perf_counter()
    rows, failed = [], []
    torch.backends.cudnn.benchmark = True
    ptxas = find_ptxas() if args.ptxas else None
    if args.ptxas and not ptxas:
        print("(no ptxas here: registers not dumped)")
    for name in args.shapes.split(","):
        if time.perf_counter() - t_start > args.budget:
            print(f"{name}: skipped (past the {args.budget:.0f} s budget)", flush=True)
            continue
        spec = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(len(rows) + 1)
        a, w, op, flop = operands(spec, gen)
        want = op(a.double(), w.double())
        row = {"shape": name, "gflop": flop / 1e9, "tflops": {}, "rel_err": {}, "tile": {}, "compile_s": {}}
        for v in variants:
            os.environ["LUISAML_MMA_TILE"] = v
            t0, t_wall = time.perf_counter(), time.time() - 1.0
            conv = spec[0] in ("conv", "conv1d")
            net = luisaml.compile(model(spec, w.cpu().numpy()), backend="cuda", batch_axis=0 if conv or spec[4]
                                  else None, tensor_cores="auto", **({"winograd": 0} if conv else {}))
            y = torch.as_tensor(net.run({"A": a})["Y"], device="cuda")
            torch.cuda.synchronize()
            row["compile_s"][v] = round(time.perf_counter() - t0, 2)
            if ptxas:
                row.setdefault("ptxas", {})[v] = ptxas_counts(ptxas, t_wall)
            err = float(torch.linalg.norm(y.double() - want) / torch.linalg.norm(want))
            row["rel_err"][v], row["tile"][v] = err, tiling_of(net)
            if not err <= TOL or row["tile"][v] == "no mma tile":
                failed.append(f"{name} {v}: rel err {err:.2e}, {row['tile'][v]}")
                continue
            try:
                ms = float(np.median(kernel_ms(lambda: net.run({"A": a}), args.reps)))
                row["tflops"][v] = flop / (ms * 1e-3) / 1e12
            except RuntimeError as e:  # (CUPTI's kernel count off: no time, not a wrong answer)
                print(f"  {name} {v}: not timed ({e})", flush=True)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        row["rel_err"]["torch_tf32"] = float(torch.linalg.norm(op(a, w).double() - want) / torch.linalg.norm(want))
        try:
            ms = float(np.median(kernel_ms(lambda: op(a, w), args.reps)))
            row["tflops"]["torch_tf32"] = flop / (ms * 1e-3) / 1e12
        except RuntimeError as e:
            print(f"  {name} torch: not timed ({e})", flush=True)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        rows.append(row)
        print(f"{name:14s} {flop / 1e9:7.1f} GFLOP  " + "  ".join(f"{k} {t:6.1f}" for k, t in row["tflops"].items())
              + "  TFLOP/s", flush=True)
        for v in variants:
            print(f"{'':16s}{v}: {row['tile'][v]}, err {row['rel_err'][v]:.1e}, built in {row['compile_s'][v]} s"
                  + (f", {row['ptxas'][v]}" if ptxas else ""), flush=True)
    print(f"({time.perf_counter() - t_start:.0f} s)")
    gpu = torch.cuda.get_device_name()
    out = args.out or HERE.parent / "results" / f"sweep-mma-{'h200' if 'H200' in gpu else 'h100' if 'H100' in gpu else 'gpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows, "failed": failed}, indent=1) + "\n")
    print(f"wrote {out}")
    if failed:
        print("WRONG ANSWERS:\n  " + "\n  ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
