"""Design sweep for the fused MLP kernel (benchmarks/NOTES.md records what it measured).

Compiles each model under several plan overrides (the LUISAML_FUSED_* variables luisaml/fusion.py
reads: T samples per tile, NT threads per block, U host-unrolled k-steps, BPS blocks per SM,
WEIGHTS placement, MAP of threads, VECTOR accumulators, PREFETCH), checks each against torch fp32, and times it the same way bench_mlp.py does.
    python benchmarks/sweep_mlp.py [--models 32-32x3-4 ...] [--out sweep.json]"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mlp as B

VARIANTS = {
    "default": {},
    "T128": {"LUISAML_FUSED_T": "128"},
    "acc128_nt64": {"LUISAML_FUSED_ACC": "128", "LUISAML_FUSED_NT": "64"},
    "U4": {"LUISAML_FUSED_U": "4"},
    "U8": {"LUISAML_FUSED_U": "8"},
    "global": {"LUISAML_FUSED_WEIGHTS": "global"},
    "staged": {"LUISAML_FUSED_WEIGHTS": "staged"},
    "BPS8": {"LUISAML_FUSED_BPS": "8"},
    "splitK0": {"LUISAML_FUSED_SPLITK": "0"},
    "outputs_major": {"LUISAML_FUSED_MAP": "outputs"},
    "U16": {"LUISAML_FUSED_U": "16"},
    "vector": {"LUISAML_FUSED_VECTOR": "1"},
    "prefetch": {"LUISAML_FUSED_PREFETCH": "1"},
    "global_U8": {"LUISAML_FUSED_WEIGHTS": "global", "LUISAML_FUSED_U": "8"},
    "global_prefetch": {"LUISAML_FUSED_WEIGHTS": "global", "LUISAML_FUSED_PREFETCH": "1"},
    "global_prefetch_U8": {"LUISAML_FUSED_WEIGHTS": "global", "LUISAML_FUSED_PREFETCH": "1", "LUISAML_FUSED_U": "8"},
    "global_fast": {"LUISAML_FUSED_WEIGHTS": "global", "LUISAML_FUSED_PREFETCH": "1", "LUISAML_FUSED_U": "8",
                    "LUISAML_FUSED_VECTOR": "1"},
    "prefetch_BPS3": {"LUISAML_FUSED_PREFETCH": "1", "LUISAML_FUSED_BPS": "3"},
    "prefetch_BPS2": {"LUISAML_FUSED_PREFETCH": "1", "LUISAML_FUSED_BPS": "2"},
    "kpipe": {"LUISAML_FUSED_KPIPE": "1"},
    "BPS3": {"LUISAML_FUSED_BPS": "3"},
    "BPS4": {"LUISAML_FUSED_BPS": "4"},
    "pipelined": {"LUISAML_FUSED_WEIGHTS": "pipelined"},
    "pipelined_prefetch": {"LUISAML_FUSED_WEIGHTS": "pipelined", "LUISAML_FUSED_PREFETCH": "1"},
    "pipelined_prefetch_BPS3": {"LUISAML_FUSED_WEIGHTS": "pipelined", "LUISAML_FUSED_PREFETCH": "1",
                                "LUISAML_FUSED_BPS": "3"},
    "pipelined_BPS3": {"LUISAML_FUSED_WEIGHTS": "pipelined", "LUISAML_FUSED_BPS": "3"},
    "global_prefetch_BPS3": {"LUISAML_FUSED_WEIGHTS": "global", "LUISAML_FUSED_PREFETCH": "1", "LUISAML_FUSED_BPS": "3"},
    "t8x16_nt64": {"LUISAML_FUSED_T": "128", "LUISAML_FUSED_NT": "64", "LUISAML_FUSED_ACC": "128",
                   "LUISAML_FUSED_TILE": "8x16", "LUISAML_FUSED_PREFETCH": "1"},
    "t8x16_nt64_BPS4": {"LUISAML_FUSED_T": "128", "LUISAML_FUSED_NT": "64", "LUISAML_FUSED_ACC": "128",
                        "LUISAML_FUSED_TILE": "8x16", "LUISAML_FUSED_PREFETCH": "1", "LUISAML_FUSED_BPS": "4"},
    "t16x8_nt64": {"LUISAML_FUSED_T": "128", "LUISAML_FUSED_NT": "64", "LUISAML_FUSED_ACC": "128",
                   "LUISAML_FUSED_TILE": "16x8", "LUISAML_FUSED_PREFETCH": "1"},
    "prefetch_BPS3_U4": {"LUISAML_FUSED_PREFETCH": "1", "LUISAML_FUSED_BPS": "3", "LUISAML_FUSED_U": "4"},
    "prefetch_BPS3_vector": {"LUISAML_FUSED_PREFETCH": "1", "LUISAML_FUSED_BPS": "3", "LUISAML_FUSED_VECTOR": "1"},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*")
    ap.add_argument("--variants", nargs="*")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--fp16", action="store_true", help="time fp16 mode for every variant")
    ap.add_argument("--out", default="sweep.json")
    a = ap.parse_args(argv)
    import luisa
    import torch

    import luisaml

    luisaml.device.init("cuda")
    results = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name, k0, width, layers, out, batch, _, _ in B.MODELS:
            if a.models and name not in a.models:
                continue
            model = B.build_torch(k0, width, layers, out).cuda()
            path = Path(tmp) / f"{name}.onnx"
            B.export_onnx(B.build_torch(k0, width, layers, out), k0, path)
            torch.manual_seed(1)
            x = torch.randn(batch, k0, device="cuda")
            ref = model(x).cpu().numpy()
            ms, how = B.device_times(lambda: model(x), torch.cuda.synchronize, a.reps)
            base = {"model": name, "variant": "torch_fp32", "p50": B.percentiles(ms)["p50"], "timing": how}
            results.append(base)
            print(json.dumps(base), flush=True)
            if a.fp16:
                model16, x16 = B.build_torch(k0, width, layers, out).cuda().half(), x.half()
                ms, how = B.device_times(lambda: model16(x16), torch.cuda.synchronize, a.reps)
                base16 = {"model": name, "variant": "torch_fp16", "p50": B.percentiles(ms)["p50"], "timing": how}
                results.append(base16)
                print(json.dumps(base16), flush=True)
            for vname, env in VARIANTS.items():
                if a.variants and vname not in a.variants:
                    continue
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                rec = {"model": name, "variant": vname}
                try:
                    for prec, xin in (("fp32", x), ("fp16", x.half())):
                        t0 = time.perf_counter()
                        net = luisaml.compile(str(path), backend="cuda", precision=prec)
                        y = net.run({"x": xin})["y"]
                        rec[f"compile_{prec}_s"] = time.perf_counter() - t0
                        rec[f"rel_err_{prec}"] = B.rel_err(y.float().cpu().numpy(), ref)
                        launch, _, _ = B.luisaml_launcher(net, xin)
                        ms, how = B.device_times(launch, luisa.synchronize, a.reps)
                        rec[f"p50_{prec}"] = B.percentiles(ms)["p50"]
                        rec["timing"] = how
                        rec["plan"] = net.plan.fusion_note
                        rec[f"speedup_{prec}_vs_torch_fp32"] = base["p50"] / rec[f"p50_{prec}"]
                        if vname != "default" and not a.fp16:
                            break  # fp16 only for the default plan (--fp16: for every variant)
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                results.append(rec)
                print(json.dumps(rec), flush=True)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
