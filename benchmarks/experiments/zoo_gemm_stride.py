"""One MatMul with a constant B on the CPU backend at the zoo's power-of-two widths and at widths just
off them: the reproducer of NOTES.md's "The zoo on the CPU", finding 1 (a prepacked B whose rows are
a multiple of 4 KB apart ran 2-5x slower; since the CPU's tiles read B as column-block panels, the
widths measure alike: NOTES.md, "Column-block panels and square tiles").

    python benchmarks/experiments/zoo_gemm_stride.py [--reps 7]

Prints the best and the median of `net.run` over reps for each [M, K] x [K, N] (one sample; host
copies included), with GFLOP/s (2 per multiply-add) of the best."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_mlp's timing
from bench_mlp import timed  # noqa: E402

# (M, K, N): Mixer-S's channel MLP and a 0.5 MB B, each at N a power of two and N just off it
SHAPES = [(196, 512, 2048), (196, 512, 2064), (1568, 128, 1024), (1568, 128, 1040), (1568, 128, 1008),
          (1568, 512, 256), (196, 2048, 512)]


def matmul_model(M: int, K: int, N: int, seed: int = 0):
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((K, N)).astype(np.float32) * 0.05
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", M, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", M, N])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    import luisaml

    for M, K, N in SHAPES:
        net = luisaml.compile(matmul_model(M, K, N), backend="cpu")
        x = np.random.default_rng(1).standard_normal((1, M, K)).astype(np.float32)
        ms = timed(lambda: net.run({"x": x}), a.reps, warmup=1)
        print(f"[{M}, {K}] x [{K}, {N}] (B's [K][N] rows {4 * N} bytes apart, before packing): best {min(ms):.1f} ms "
              f"({2 * M * K * N / min(ms) / 1e6:.1f} GFLOP/s), median {np.median(ms):.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
