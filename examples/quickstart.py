"""Quickstart: export a small PyTorch model, compile it into one kernel, compare with onnxruntime.

Run: python examples/quickstart.py   (after `pip install -e .`; scripts/quickstart.sh does both)
"""
import sys
import tempfile
import warnings

import numpy as np
import onnxruntime as ort
import torch

import luisaml


def main() -> int:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )
    path = f"{tempfile.mkdtemp()}/mlp.onnx"
    torch.onnx.export(model, (torch.zeros(2, 16),), path, dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})

    net = luisaml.compile(path)  # backend="auto": CUDA where a GPU works, else the CPU backend
    print(net)
    print("register allocation:", net.allocation.report())

    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    y = net.run({"x": x})["y"]
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    np.set_printoptions(precision=6, suppress=True)
    print("luisaml     y[:4] =\n", y[:4])
    print("onnxruntime y[:4] =\n", ref[:4])
    diff = float(np.abs(y - ref).max())
    print(f"largest difference: {diff:.3g}")
    return 0 if diff <= 1e-5 * max(1.0, float(np.abs(ref).max())) else 1


if __name__ == "__main__":
    sys.exit(main())
