"""ResNet-18's .lml against its weights (issue 29: "weights stored once"), and `luisaml.load`'s time.

    python benchmarks/bench_artifact_size.py [--processes 7] [--out-dir DIR]

Exports bench_models.resnet18 (torchvision's layout, random weights, seed 0; batch fixed at 1) to
ONNX, compiles it on the CPU backend and saves the .lml, then prints the ONNX file's size, its
initializers' bytes, the artifact's size and members, the ratio of the artifact to the weights, and
the plan's weight blob (what the kernels read: the originals and the packed forms, made again at
load). Then `--processes` fresh Python processes each `import luisaml` and `luisaml.load` the file;
the P50 of load's wall time and of its CPU time (the host is shared: wall time moves with the other
processes' load, CPU time much less), and one process's split (read, hash, rebuild, device init,
module import). Nothing is written to the repository unless --out-dir names it."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

LOAD = """
import json, sys, time
t = time.perf_counter(); c = time.process_time()
import luisaml
t1 = time.perf_counter(); c1 = time.process_time()
net = luisaml.load(sys.argv[1])
print(json.dumps({"import": t1 - t, "load": time.perf_counter() - t1, "load_cpu": time.process_time() - c1,
                  "steps": net.artifact.seconds}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=7)
    ap.add_argument("--out-dir", type=Path, default=None, help="where the .onnx and .lml go (default: a temp dir)")
    a = ap.parse_args()
    out = a.out_dir or Path(tempfile.mkdtemp(prefix="luisaml-artifact-size-"))
    out.mkdir(parents=True, exist_ok=True)

    import onnx
    import torch

    sys.path.insert(0, str(HERE))
    from bench_models import resnet18

    import luisaml

    onnx_path, lml = out / "resnet18.onnx", out / "resnet18.lml"
    torch.manual_seed(0)
    torch.onnx.export(resnet18().eval(), torch.randn(1, 3, 224, 224), onnx_path, input_names=["x"],
                      output_names=["y"], dynamo=False)
    weights = sum(onnx.numpy_helper.to_array(t).nbytes for t in onnx.load(onnx_path).graph.initializer)
    net = luisaml.compile(str(onnx_path), backend="cpu", batch_axis=None)
    net.save(lml)
    size = lml.stat().st_size
    with zipfile.ZipFile(lml) as z:
        members = {i.filename: i.file_size for i in z.infolist()}
    runs = []
    for _ in range(a.processes):
        r = subprocess.run([sys.executable, "-c", LOAD, str(lml)], capture_output=True, text=True, cwd=out,
                           env=dict(os.environ, LUISAML_BACKEND="cpu"), check=True)
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(json.dumps({
        "onnx_bytes": onnx_path.stat().st_size, "weight_bytes": weights, "lml_bytes": size,
        "lml_over_weights": round(size / weights, 4), "members": members, "plan_blob_bytes": net.plan.blob.size,
        "load_s_p50": round(statistics.median(r["load"] for r in runs), 3),
        "load_cpu_s_p50": round(statistics.median(r["load_cpu"] for r in runs), 3),
        "loads_s": [round(r["load"], 3) for r in runs], "steps_first": runs[0]["steps"],
    }, indent=1))


if __name__ == "__main__":
    main()
