"""Per-stage device time and achieved TFLOP/s of one benchmark model (bench_models.py's specs): which
stages to work on.

    python benchmarks/experiments/profile_stages.py --model resnet-18 [--batch 32] [--top 15]

Each stage is launched on its own and synchronised (CompiledNetwork.profile), so a stage's time
includes one launch's overhead (a few microseconds); the sum is above the one-command-list forward
that bench_models.py times."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for its bench modules
import bench_models  # noqa: E402


def main(argv=None) -> int:
    specs = {s.name: s for s in bench_models.MODELS} | {s.name: s for s, _ in bench_models.GPU_MODELS}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(specs))
    ap.add_argument("--batch", type=int, default=None, help="default: the benchmark's batch")
    ap.add_argument("--top", type=int, default=15, help="stages to print, slowest first")
    args = ap.parse_args(argv)
    import luisaml

    spec = specs[args.model]
    n = args.batch or spec.batch
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        bench_models.export(spec, path)
        net = luisaml.compile(str(path))
        x = np.random.default_rng(0).standard_normal((n, *spec.sample_shape), dtype=np.float32)
        if hasattr(net, "network_for"):
            net = net.network_for(n)
        times = net.profile({"x": x})
    total = sum(t for _, t in times)
    rates = stage_tflops(net, n, times)
    print(f"{args.model}, batch {n}: {len(times)} stages, {total:.3f} ms launched one by one; TFLOP/s counts "
          "2 per multiply-add of the stage's nodes (luisaml.report.flops)")
    for (name, t), rate in sorted(zip(times, rates), key=lambda p: -p[0][1])[: args.top]:
        print(f"{t:8.3f} ms {100 * t / total:5.1f}% {rate:7.3f} TFLOP/s  {name[:140]}")
    return 0


def stage_tflops(net, n: int, times: list[tuple[str, float]]) -> list[float]:
    """Return each stage's achieved TFLOP/s: its root's and epilogue's FLOPs (per sample times n for a
    per-sample plan) over its time."""
    from luisaml.report import flops

    stages = net.plan.schedule.stages if net.plan.schedule is not None else []
    scale = n if net.plan.symbol is not None else 1
    out = []
    for k, (_, ms) in enumerate(times):
        nodes = (stages[k].nodes + stages[k].epilogue) if k < len(stages) else []
        work = sum(flops(node, op) or 0 for node, op in nodes) * scale
        out.append(work / (ms * 1e-3) / 1e12 if ms > 0 else 0.0)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
