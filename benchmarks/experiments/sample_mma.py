"""Layers of one row a sample on CUDA, old forms against new on the same inputs, in one process: the zoo's
MLP rows and CNN head with tensor_cores="auto", each compiled under operators/gemm.py's A/B switches
(Dense.MMA_GROUP: the samples a block on the TF32 mma tile, 0 the FP32 tile of 64; Dense.WARP_MIN_K: a
warp a sample for a head of few columns, 0 the items form), against torch fp32 (shipped TF32 settings).

    LUISAML_BACKEND=cuda python -P benchmarks/experiments/sample_mma.py [--models nerf cifar] [--reps 20]

Variants: "main" (MMA_GROUP=0, WARP_MIN_K=0: main's plan with tensor cores, its source byte for byte),
"new" (the defaults: 128 and 256; LeNet-5's 400 -> 120 -> 84 on the mma tile too), and for nerf "mma64+warp" and "mma128" (no warp head) too; for sdf
and siren (--models; a plain chain: the fused MLP kernel by default) "main" is the fused kernel and
"new" the same layers unfused (fuse="off"). Each
variant's output is checked against torch fp32 with TF32 off as bench_zoo.py checks it (relative error
within max(1e-4, 10 x torch TF32's own)); a mismatch exits 1 after the table. Times are CUPTI spans of
net.run (bench_mlp.device_times, as bench_zoo's), P50 over --reps; "products" sums the Gemm and MatMul
stages each launched alone (net.stage_timer, median of 5) with their TFLOP/s."""
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
sys.path.insert(0, str(HERE.parent))  # bench_zoo, bench_mlp, zoo_models
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# zoo row -> (short name, batch, variants: name -> (MMA_GROUP, WARP_MIN_K, compile keywords))
OLD, NEW = (0, 0, {}), (128, 256, {})
MLP = {"main": OLD, "mma64+warp": (64, 256, {}), "mma128": (128, 0, {}), "new": NEW}
CHAIN = {"main": OLD, "new": (128, 256, {"fuse": "off"})}
ROWS = {"nerf mlp 8x256": ("nerf", 65536, MLP), "pointnet": ("pointnet", 32, {"main": OLD, "new": NEW}),
        "cifar-cnn": ("cifar", 4096, {"main": OLD, "new": NEW}), "lenet-5": ("lenet", 8192, {"main": OLD, "new": NEW}),
        "sdf 3-64x4-1 softplus": ("sdf", 1 << 20, CHAIN), "siren 2-256x3-3": ("siren", 1 << 18, CHAIN)}


def products(net, feeds) -> tuple[float, float]:
    """(ms, FLOPs) of the network's Gemm and MatMul stages, each launched alone (median of 5)."""
    timer = net.stage_timer(feeds)
    n = next(iter(feeds.values())).shape[0]
    ms = flop = 0.0
    for k, st in enumerate(net.plan.schedule.stages):
        node, op = st.root
        if node.op_type in ("Gemm", "MatMul"):
            ms += float(np.median([timer(k) for _ in range(5)]))
            flop += 2.0 * op.M * op.N * op.K * op.nbatch * (n if st.batched else 1)
    return ms, flop


def forms(net) -> str:
    """The products' stage forms, compactly: blocks/<samples a block> or items, by count."""
    seen: dict[str, int] = {}
    for st in net.plan.schedule.stages:
        if st.root[0].op_type in ("Gemm", "MatMul", "FusedMLP"):
            tl = st.root[1].block_tiling() if st.domain == "blocks" else None
            f = f"{type(tl).__name__}/{st.samples}" if tl is not None else st.domain
            seen[f] = seen.get(f, 0) + 1
    return " ".join(f"{k}x{v}" for k, v in seen.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["nerf", "cifar", "pointnet", "lenet"],
                    help="of nerf, cifar, pointnet, lenet, sdf, siren (the last two: fused against unfused layers)")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    import torch

    import bench_zoo
    import luisaml
    import zoo_models
    from bench_mlp import device_times
    from luisaml.operators.gemm import Dense

    luisaml.device.init("cuda", tensor_cores=True)
    from luisaml import tensor_cores

    print(f"{torch.cuda.get_device_name()}; TF32 mma self-test live: {tensor_cores.live('tf32')}", flush=True)
    sync, bad, lines = torch.cuda.synchronize, [], []
    defaults = Dense.MMA_GROUP, Dense.WARP_MIN_K
    for zoo_net in zoo_models.ZOO:
        if zoo_net.name not in ROWS or ROWS[zoo_net.name][0] not in a.models:
            continue
        short, batch, variants = ROWS[zoo_net.name]
        tmp = Path(tempfile.mkdtemp())
        module, inputs = bench_zoo.prepare(zoo_net, batch, False, tmp, {})
        gpu = module.cuda()
        feeds = {k: v.cuda() for k, v in inputs.items()}
        bk = torch.backends
        shipped = bk.cudnn.allow_tf32, bk.cuda.matmul.allow_tf32
        with torch.no_grad():
            bk.cudnn.allow_tf32 = bk.cuda.matmul.allow_tf32 = False
            ref = gpu(*feeds.values()).float().cpu().numpy()
            bk.cudnn.allow_tf32 = bk.cuda.matmul.allow_tf32 = True
            floor = bench_zoo.rel_err(gpu(*feeds.values()).float().cpu().numpy(), ref)
            bk.cudnn.allow_tf32, bk.cuda.matmul.allow_tf32 = shipped
            ms, _ = device_times(lambda: gpu(*feeds.values()), sync, a.reps)
        torch_ms = float(np.median(ms))
        lines.append(f"{short} b{batch}: torch fp32 {torch_ms:.3f} ms")
        for name, (group, min_k, kw) in variants.items():
            Dense.MMA_GROUP, Dense.WARP_MIN_K = group, min_k
            try:
                net = luisaml.compile(str(tmp / "model.onnx"), backend="cuda", tensor_cores="auto", **kw)
                form = forms(net)  # (under the variant's switches: block_tiling reads them)
                y = net.run(feeds)["y"]
                sync()
            except Exception as e:  # (the other variants still run; the command exits 1)
                bad.append(f"{short} {name}: {type(e).__name__}: {str(e)[:300]}")
                print(bad[-1], flush=True)
                continue
            finally:
                Dense.MMA_GROUP, Dense.WARP_MIN_K = defaults
            rec: dict = {}
            if not bench_zoo.check(rec, y.float().cpu().numpy(), ref, floor):
                bad.append(f"{short} {name}: {rec['error']}")
            ms, _ = device_times(lambda: net.run(feeds), sync, a.reps)
            try:
                p_ms, flop = products(net, feeds)
            except Exception as e:
                print(f"  ({name}: the stage timer failed: {type(e).__name__}: {str(e)[:200]})", flush=True)
                p_ms, flop = float("nan"), 0.0
            t = float(np.median(ms))
            lines.append(f"  {name:11s} {t:8.3f} ms  {torch_ms / t:5.2f}x torch  products {p_ms:7.3f} ms "
                         f"({flop / max(p_ms, 1e-9) / 1e9:5.1f} TFLOP/s)  err {rec['rel_err']:.1e} (tol {rec['tol']:.0e})  "
                         f"{form}")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if bad:
        print("MISMATCH:\n  " + "\n  ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
