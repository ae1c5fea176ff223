"""CUDA's recurrent step forms A/B on the zoo's recurrent rows, one process, the same inputs: each form of
compile's `recurrent` (operators/rnn_block.py FORMS) against torch fp32 (cuDNN) and each other.

    python benchmarks/experiments/rnn_forms.py [--forms block,auto] [--only "bilstm tagger 2x256,..."]

Per row and form: the block loop's geometry (rows a block, k's an iteration, blocks), the kernels'
span (CUPTI, P50) and net.run's wall time (P50), the steps stages' time launched alone (net.profile)
and its microseconds a step, the relative error against torch fp32 with TF32 off (bench_zoo's check:
tolerance max(1e-4, 10 x torch's own CPU-vs-CUDA disagreement, and TF32's with tensor cores)).
Exits 1 when a form's output misses the tolerance or two forms differ past it."""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))  # benchmarks/: bench_zoo's export and check, bench_mlp's CUPTI spans

import bench_zoo  # noqa: E402  (sets OMP_WAIT_POLICY before torch)
from bench_models import rel_err  # noqa: E402

ROWS = "bilstm tagger 2x256,gru 64-128 seq 32,lstm 64-128 seq 32"


def geometry(net) -> str:
    """The recurrent steps' form of each recurrent node, e.g. "4r x 8k, 32 blocks" or "a phase a step"."""
    out = []
    for st in net.plan.schedule.stages:
        op = st.root[1]
        if not st.root[0].op_type.endswith("Steps") or not hasattr(op, "block"):
            continue
        if op.block is None:
            out.append("a thread a row group" if op.loop else "a phase a step")
        else:
            out.append(f"{op.block.SB}r x {op.block.U}k, {op.block.blocks} blocks")
    return "; ".join(dict.fromkeys(out))


def steps_ms(net, feeds: dict) -> tuple[float, int]:
    """The recurrent steps' stages' ms (each launched alone, the least of 3) and their step count."""
    times = net.profile(feeds, repeat=3)
    total, steps = 0.0, 0
    for st, (_, ms) in zip(net.plan.schedule.stages, times):
        if st.root[0].op_type.endswith("Steps"):
            total += ms
            steps = max(steps, st.root[1].cell.S)
    return total, steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=ROWS, help="comma-separated zoo rows")
    ap.add_argument("--forms", default="block,auto", help="compile(recurrent=...) values, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tensor-cores", default="auto", help="compile's tensor_cores ('auto' as the zoo's H200 run, or false)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of this script (every form is the loop)")
    a = ap.parse_args(argv)
    import torch

    import luisaml
    from bench_mlp import device_times

    tc = False if a.tensor_cores.lower() == "false" or a.device == "cpu" else "auto"
    luisaml.device.init(a.device, tensor_cores=bool(tc))
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    dev = "cuda" if a.device == "cuda" else "cpu"
    forms = [f.strip() for f in a.forms.split(",") if f.strip()]
    bad = 0
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, tensor_cores={tc}, reps {a.reps}")
    head = f"{'row':24} {'form':8} {'geometry':28} {'span ms':>8} {'wall ms':>8} {'steps ms':>9} {'us/step':>8} {'x span':>7} {'x wall':>7} {'rel err':>9}"
    print(head)
    for net_spec in bench_zoo.select(a.only, None):
        rec: dict = {}
        with tempfile.TemporaryDirectory() as tmp:
            module, inputs = bench_zoo.prepare(net_spec, net_spec.batch, False, Path(tmp), rec)
            gpu = copy.deepcopy(module).to(dev)
            feeds = {k: v.to(dev) for k, v in inputs.items()}
            args = tuple(feeds.values())
            b = torch.backends
            shipped = b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32
            with torch.no_grad():
                b.cudnn.allow_tf32 = b.cuda.matmul.allow_tf32 = False
                ref = gpu(*args).float().cpu().numpy()
                b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = shipped
                floor = rel_err(module(*inputs.values()).numpy(), ref)
                if tc:
                    b.cudnn.allow_tf32 = b.cuda.matmul.allow_tf32 = True
                    floor = max(floor, rel_err(gpu(*args).float().cpu().numpy(), ref))
                    b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = shipped
                tol = max(bench_zoo.REL_TOL, bench_zoo.FLOOR_FACTOR * floor)
                t_span, _ = device_times(lambda: gpu(*args), sync, a.reps)
                t_wall = bench_zoo.wall_times(lambda: gpu(*args), sync, a.reps)
                torch_span, torch_wall = float(np.median(t_span)), float(np.median(t_wall))
                print(f"{net_spec.name[:24]:24} {'torch':8} {'cuDNN fp32':28} {torch_span:8.3f} {torch_wall:8.3f}")
                outs = {}
                for form in forms:
                    try:
                        net = luisaml.compile(str(Path(tmp) / "model.onnx"), backend=a.device, tensor_cores=tc, recurrent=form)
                        y = net.run(feeds)["y"].float().cpu().numpy()
                        sync()
                    except Exception as e:  # a form that does not build or run: said, counted, the others go on
                        print(f"{'':24} {form:8} FAILED: {bench_zoo.first_line(e)}", flush=True)
                        bad += 1
                        continue
                    outs[form] = y
                    err = rel_err(y.reshape(ref.shape), ref) if np.all(np.isfinite(y)) else float("inf")
                    span, _ = device_times(lambda: net.run(feeds), sync, a.reps)
                    wall = bench_zoo.wall_times(lambda: net.run(feeds), sync, a.reps)
                    one = net.network_for(net_spec.batch) if hasattr(net, "network_for") else net
                    sms, steps = steps_ms(one, feeds)
                    s50, w50 = float(np.median(span)), float(np.median(wall))
                    flag = "" if err <= tol else f"  MISMATCH (tol {tol:.2g})"
                    bad += err > tol
                    print(f"{'':24} {form:8} {geometry(one)[:28]:28} {s50:8.3f} {w50:8.3f} {sms:9.3f} "
                          f"{1e3 * sms / max(steps, 1):8.2f} {torch_span / s50:7.2f} {torch_wall / w50:7.2f} {err:9.2e}{flag}",
                          flush=True)
                for f in [f for f in forms if f in outs][1:]:
                    first = next(iter(outs))
                    d = rel_err(outs[f].reshape(ref.shape), outs[first].reshape(ref.shape))
                    if d > tol:
                        print(f"   {f} against {first}: {d:.2e} past {tol:.2g}")
                        bad += 1
    print("FAILED" if bad else "all forms within tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
