"""precision="fp16" MLPs on CUDA, its forms against each other and torch fp16 in one process (issue 27's last
Done-when row; benchmarks/NOTES.md, "The fp16 MLPs on the FP16 mma tile"): RESULTS.md's 63-128x4-4 and
63-256x4-4 at 1M samples, each compiled with tensor_cores="auto" under luisaml/rewrites/mlp.py's A/B switches:

  fused        FP16_STAGES off: the fused FP32 kernel with half inputs and outputs (main's form)
  stages-f32   the layers as stages on the FP16 mma tile, activations in float buffers (FP16_HALF_ACTIVATIONS off)
  stages       the same, activations in half buffers (the default)

    LUISAML_BACKEND=cuda python -P benchmarks/experiments/fp16_mlp.py [--models 63-128x4-4 63-256x4-4]
        [--batch 1048576] [--reps 50] [--tiles w64,w32]

Times are CUPTI spans of net.launch on DLPack-shared torch half tensors (bench_mlp's luisaml_launcher and
device_times, as RESULTS.md's MLP table), P50 over --reps; each stage is also launched alone (its P50
span, the layer's TFLOP/s and the bytes it moves per its tensors' element sizes at HBM rate). --tiles:
operators/tiled_mma.py's variants for the stage forms (LUISAML_MMA_TILE). Every form's output is checked
against torch float32 on the same half input: its largest error, relative to the output's largest
magnitude, within max(1e-3, 3 x torch fp16's own); a mismatch exits 1 after the table."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("luisaml") is None:
    sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))  # bench_mlp

FORMS = {"fused": (False, True), "stages-f32": (True, False), "stages": (True, True)}  # (FP16_STAGES, HALF_ACTIVATIONS)


def stage_rows(net, args, n: int, reps: int, sync) -> list[str]:
    """Each stage of a staged network launched alone: its P50 device span, a product's TFLOP/s, and the bytes of
    its row in and row out (n x (K + N) elements: half for the graph's input and output, and for the
    activations under Plan.half_activations, else float) at the rate they moved."""
    from bench_mlp import device_times

    plan, rows = net.plan, []
    for k, st in enumerate(plan.schedule.stages):
        node, op = st.root
        ms, _ = device_times(lambda k=k: net.launch(args, [], n, only=k), sync, reps)
        t = float(np.median(ms))
        if node.op_type not in ("Gemm", "MatMul"):
            rows.append(f"    stage {k} {node.name:10s} {st.domain:6s} {t:7.3f} ms")
            continue
        first, last = k == 0, k == len(plan.schedule.stages) - 1
        inner = 2 if plan.half_activations else 4
        moved = n * (op.K * (2 if first else inner) + op.N * (2 if last else inner))
        tl = op.block_tiling() if st.domain == "blocks" else None
        rows.append(f"    stage {k} {node.name:10s} {st.domain:6s} {type(tl).__name__ if tl is not None else '':10s} "
                    f"{t:7.3f} ms  {2.0 * op.N * op.K * n / t / 1e9:6.1f} TFLOP/s  {moved / 1e6:7.1f} MB "
                    f"({moved / t / 1e9:5.2f} TB/s)")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["63-128x4-4", "63-256x4-4"])
    ap.add_argument("--batch", type=int, default=1 << 20)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiles", default="w64", help="tiled_mma variants for the stage forms, comma-separated")
    a = ap.parse_args()
    import torch

    import luisaml
    import luisaml.rewrites.mlp as mlp_rewrite
    from bench_mlp import MODELS, build_torch, device_times, export_onnx, luisaml_launcher, rel_err

    luisaml.device.init("cuda", tensor_cores=True)
    from luisaml import tensor_cores

    print(f"{torch.cuda.get_device_name()}; mma self-tests live: tf32 {tensor_cores.live('tf32')}, "
          f"f16 {tensor_cores.live('f16')}", flush=True)
    import luisa

    def sync():  # (torch's and LuisaCompute's work: net.launch leaves its last launches uncommitted, so
        # torch.cuda.synchronize alone neither waits for them nor lets CUPTI see them: what this script
        # read on 2026-12-07, luisaml outputs of another form and 0.02 ms "kernels")
        luisa.synchronize()
        torch.cuda.synchronize()

    bad, lines = [], []
    for name, k0, width, layers, out, _, _, _ in MODELS:
        if name not in a.models:
            continue
        tmp = Path(tempfile.mkdtemp())
        export_onnx(build_torch(k0, width, layers, out), k0, tmp / "mlp.onnx")
        model = build_torch(k0, width, layers, out).cuda()
        x16 = torch.randn(a.batch, k0, device="cuda").half()
        with torch.no_grad():
            ref = model(x16.float()).cpu().numpy()
            half_model = model.half()
            floor = rel_err(half_model(x16).float().cpu().numpy(), ref)
            ms, _ = device_times(lambda: half_model(x16), sync, a.reps)
        torch_ms = float(np.median(ms))
        tol = max(1e-3, 3 * floor)
        lines.append(f"{name} at {a.batch}: torch fp16 {torch_ms:.3f} ms (its error {floor:.1e}; tolerance {tol:.1e})")
        print(lines[-1], flush=True)
        for form, (stages, half_act) in FORMS.items():
            for tile in (a.tiles.split(",") if stages else ["-"]):
                os.environ["LUISAML_MMA_TILE"] = tile if stages else "w64"
                mlp_rewrite.FP16_STAGES, mlp_rewrite.FP16_HALF_ACTIVATIONS = stages, half_act
                try:
                    net = luisaml.compile(str(tmp / "mlp.onnx"), backend="cuda", precision="fp16", tensor_cores="auto")
                    launch, y, _ = luisaml_launcher(net, x16)
                    launch()
                    sync()
                except Exception as e:  # (the other forms still run; the command exits 1)
                    bad.append(f"{name} {form} {tile}: {type(e).__name__}: {str(e)[:300]}")
                    print(bad[-1], flush=True)
                    continue
                finally:
                    mlp_rewrite.FP16_STAGES, mlp_rewrite.FP16_HALF_ACTIVATIONS = True, True
                err = rel_err(y.float().cpu().numpy(), ref)
                if not err <= tol:
                    bad.append(f"{name} {form} {tile}: error {err:.1e} past {tol:.1e}")
                ms, how = device_times(launch, sync, a.reps)
                t = float(np.median(ms))
                lines.append(f"  {form:10s} {tile:4s} {t:8.3f} ms  {torch_ms / t:5.2f}x torch fp16  err {err:.1e}  "
                             f"({net.plan.fusion_note[:60]}; {how})")
                print(lines[-1], flush=True)
                if net.plan.schedule is not None and net.plan.fused is None:
                    from luisaml.interop import dlpack_buffer

                    lines += stage_rows(net, [dlpack_buffer(x16), dlpack_buffer(y)], a.batch, max(5, a.reps // 5), sync)
                    print("\n".join(lines[-len(net.plan.schedule.stages):]), flush=True)
                del net
    print("\n".join(lines))
    if bad:
        print("MISMATCH:\n  " + "\n  ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
