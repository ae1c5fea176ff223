"""Tiling sweep for ResNet-18's convolutions on CUDA (benchmarks/NOTES.md, "Thread tiles of 4 x 8").

Each of ResNet-18's convolution shapes at batch 32 (a Conv + Relu exported from torch) is compiled
with the operator's own block tiling and then with each variant (BM, BN, TM, TN, BK, double-buffered)
in its place: the Winograd product's for the stride-1 3x3 layers, Conv's own for the others. Every
variant is checked against torch first, then each stage is timed on its own (CompiledNetwork.profile:
launch and synchronise, the median of 15), so a stage's time includes one launch's overhead.

    python benchmarks/experiments/sweep_conv.py [--shapes l1 s2a ...] [--out results/conv-tilings-h200.json]

The overrides replace `block_tiling` in this process only; the library's choice is tiled.choose."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

# name: (input channels, output channels, input side, kernel, stride, padding)
SHAPES = {
    "l1": (64, 64, 56, 3, 1, 1), "l2": (128, 128, 28, 3, 1, 1), "l3": (256, 256, 14, 3, 1, 1),
    "l4": (512, 512, 7, 3, 1, 1), "s2a": (64, 128, 56, 3, 2, 1), "s2b": (128, 256, 28, 3, 2, 1),
    "s2c": (256, 512, 14, 3, 2, 1), "stem": (3, 64, 224, 7, 2, 3),
}
# (BM, BN, TM, TN, BK, double); None: the operator's own choice
VARIANTS = [None, (64, 64, 8, 8, 16, True), (128, 64, 8, 8, 8, True), (64, 64, 8, 4, 8, True),
            (64, 64, 4, 8, 8, True), (128, 64, 8, 4, 16, True), (64, 64, 4, 4, 16, True),
            (128, 128, 8, 8, 8, True), (128, 128, 8, 8, 16, True), (64, 128, 8, 8, 8, True),
            (128, 128, 8, 4, 16, True), (128, 64, 8, 8, 16, True)]
BATCH = 32
REL_TOL = 1e-4


def _override(cls, chosen, variant):
    """Make cls.block_tiling return the chosen tiling with the variant's tile sides."""
    def block_tiling(op):
        tl = chosen(op)
        if tl is None or variant is None:
            return tl
        BM, BN, TM, TN, BK, double = variant
        threads = (BM // TM) * (BN // TN)
        if (BM * BK // 4) % threads or (BN * BK // 4) % threads:
            raise ValueError(f"{variant}: a step's float4s do not divide among {threads} threads")
        return dataclasses.replace(tl, BM=BM, BN=BN, TM=TM, TN=TN, BK=BK, double=double)
    cls.block_tiling = block_tiling


def sweep(shapes: list[str], backend: str) -> list[dict]:
    import torch

    import luisaml
    from luisaml.operators import conv, winograd

    chosen = {winograd.WinogradProduct: winograd.WinogradProduct.block_tiling, conv.Conv: conv.Conv.block_tiling}
    out = []
    try:
        for name in shapes:
            c, k, side, kernel, stride, pad = SHAPES[name]
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Conv2d(c, k, kernel, stride, pad), torch.nn.ReLU()).eval()
            x = torch.randn(BATCH, c, side, side)
            with torch.no_grad():
                want = model(x).numpy()
            cls = winograd.WinogradProduct if stride == 1 else conv.Conv
            with tempfile.TemporaryDirectory() as tmp:
                path = str(Path(tmp) / "conv.onnx")
                torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"], output_names=["y"],
                                  dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
                for variant in VARIANTS:
                    if variant is not None and variant[1] > k:
                        continue
                    for klass, fn in chosen.items():
                        klass.block_tiling = fn
                    _override(cls, chosen[cls], variant)
                    rec = {"shape": name, "variant": variant}
                    try:
                        net = luisaml.compile(path, backend=backend)
                        y = np.asarray(net.run({"x": x.numpy()})["y"])
                        rec["rel_err"] = float(np.abs(y - want).max() / np.abs(want).max())
                        if rec["rel_err"] <= REL_TOL:
                            one = net.network_for(BATCH) if hasattr(net, "network_for") else net
                            rec["stages"] = [(d[:60], round(t, 4)) for d, t in one.profile({"x": x.numpy()}, repeat=15)]
                    except Exception as e:  # a variant the emitter refuses: recorded, the sweep goes on
                        rec["error"] = repr(e)[:300]
                    print(json.dumps(rec), flush=True)
                    out.append(rec)
    finally:
        for klass, fn in chosen.items():
            klass.block_tiling = fn
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--out", default=None, help="a JSON file for the records")
    args = ap.parse_args(argv)
    records = sweep(args.shapes, args.backend)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
