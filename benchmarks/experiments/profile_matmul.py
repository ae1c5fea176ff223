"""One MatMul layer (a constant B, as a model's layer has it) compiled and launched a few times, for ncu
or for LUISA_CUDA_DUMP_SOURCE=1: the GEMM tiles alone, FP32 (operators/tiled.py) or TF32 mma
(operators/tiled_mma.py, --tensor-cores).

    ncu --clock-control none --kernel-name kernel_main --launch-skip 2 --launch-count 1 --set full -o /tmp/rep \\
        python3 -P benchmarks/experiments/profile_matmul.py --shape 2048,768,3072 --tensor-cores --launches 4

Prints each launch's wall time (synchronised) so that a run without a profiler is a rough timing too."""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("luisaml") is None:
    sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))
from bench_tensor_cores import matmul_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048,768,3072", help="M,K,N")
    ap.add_argument("--tensor-cores", action="store_true")
    ap.add_argument("--launches", type=int, default=4)
    a = ap.parse_args(argv)
    M, K, N = (int(v) for v in a.shape.split(","))
    import onnx

    import luisaml

    luisaml.device.init("cuda", tensor_cores=a.tensor_cores)
    rng = np.random.default_rng(0)
    b = rng.standard_normal((K, N), dtype=np.float32)
    x = rng.standard_normal((M, K), dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "matmul.onnx"
        onnx.save(matmul_model(M, K, N, b), path)
        net = luisaml.compile(str(path), tensor_cores="auto" if a.tensor_cores else False)
        want = x.astype(np.float64) @ b.astype(np.float64)
        for i in range(a.launches):
            t = time.perf_counter()
            y = net.run({"A": x})["Y"]
            ms = 1e3 * (time.perf_counter() - t)
            err = float(np.linalg.norm(y - want) / np.linalg.norm(want))
            print(f"launch {i}: {ms:.3f} ms wall (upload, run, download), rel err {err:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
