"""Design sweep for the fused MLP kernel (benchmarks/NOTES.md records what it measured).

Compiles each model under several plan overrides (luisaml.MLPConfig: T samples per tile, NT threads
per block, U host-unrolled k-steps, blocks per SM, weights placement, float4 accumulators, input
prefetch, operands a k step ahead), checks each against torch fp32, and times it the same way
bench_mlp.py does.
    python benchmarks/experiments/sweep_mlp.py [--models 32-32x3-4 ...] [--out sweep.json]"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for its bench modules
import bench_mlp as B

def _variants():
    """Plan overrides by name (luisaml.MLPConfig). Designs measured and rejected (pipelined weight
    chunks, the output-major thread map, 8x16/16x8 tiles on 64 threads, ...) left the code with
    their numbers in NOTES.md and results/sweep-*.json."""
    from luisaml import MLPConfig as C

    return {
        "default": C(),
        "T128": C(T=128),
        "acc128_nt64": C(max_acc=128, NT=64),
        "U4": C(U=4),
        "U8": C(U=8),
        "U16": C(U=16),
        "global": C(weights="global"),
        "staged": C(weights="staged"),
        "BPS3": C(blocks_per_sm=3),
        "BPS4": C(blocks_per_sm=4),
        "BPS8": C(blocks_per_sm=8),
        "splitK0": C(split_k=False),
        "vector": C(vector_acc=True),
        "prefetch": C(prefetch=True),
        "kpipe": C(kpipe=True),
        "global_prefetch": C(weights="global", prefetch=True),
        "global_prefetch_U8": C(weights="global", prefetch=True, U=8),
        "prefetch_BPS3": C(prefetch=True, blocks_per_sm=3),
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
            for vname, config in _variants().items():
                if a.variants and vname not in a.variants:
                    continue
                rec = {"model": name, "variant": vname}
                try:
                    for prec, xin in (("fp32", x), ("fp16", x.half())):
                        t0 = time.perf_counter()
                        net = luisaml.compile(str(path), backend="cuda", precision=prec, mlp=config)
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
                results.append(rec)
                print(json.dumps(rec), flush=True)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
