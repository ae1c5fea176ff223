"""Run one fused MLP kernel a few times, for a profiler (ncu) and for dumping its CUDA source/PTX.

    python benchmarks/experiments/profile_mlp.py --model 32-64x3-4 [--batch N] [--precision fp32] [--launches 3]

--variant picks one of sweep_mlp.py's plan overrides (luisaml.MLPConfig). Prints the plan, the
relative error against torch fp32 and the host wall time of each launch."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for its bench modules
import bench_mlp as B


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="32-64x3-4")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--variant", default="default", help="a plan override of sweep_mlp.py")
    a = ap.parse_args(argv)
    import luisa
    import torch

    import luisaml

    luisaml.device.init("cuda")
    spec = next(m for m in B.MODELS if m[0] == a.model)
    name, k0, width, layers, out, batch, _, _ = spec
    batch = a.batch or batch
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        model = B.build_torch(k0, width, layers, out)
        path = Path(tmp) / f"{name}.onnx"
        B.export_onnx(model, k0, path)
        torch.manual_seed(1)
        x = torch.randn(batch, k0, device="cuda")
        ref = model.cuda()(x).cpu().numpy()
        xin = x.half() if a.precision == "fp16" else x
        from sweep_mlp import _variants

        net = luisaml.compile(str(path), backend="cuda", precision=a.precision, mlp=_variants()[a.variant])
        print("plan:", net.plan.fusion_note)
        launch, y, _ = B.luisaml_launcher(net, xin)
        for i in range(a.launches):
            t = time.perf_counter()
            launch()
            luisa.synchronize()
            print(f"launch {i}: {1e3 * (time.perf_counter() - t):.3f} ms wall")
        print("rel err:", B.rel_err(y.float().cpu().numpy(), ref))
    return 0


if __name__ == "__main__":
    sys.exit(main())
