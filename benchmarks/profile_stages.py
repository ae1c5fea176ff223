"""Per-stage device time of one benchmark model (bench_models.py's specs): which stages to work on.

    python benchmarks/profile_stages.py --model resnet-18 [--batch 32] [--top 15]

Each stage is launched on its own and synchronised (CompiledNetwork.profile), so a stage's time
includes one launch's overhead (a few microseconds); the sum is above the one-command-list forward
that bench_models.py times."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
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
    print(f"{args.model}, batch {n}: {len(times)} stages, {total:.3f} ms launched one by one")
    for name, t in sorted(times, key=lambda p: -p[1])[: args.top]:
        print(f"{t:8.3f} ms {100 * t / total:5.1f}%  {name[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
