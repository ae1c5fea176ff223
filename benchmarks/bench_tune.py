"""compile(tune="fast") against tune=False on zoo networks (benchmarks/zoo_models.py), same process,
same inputs: correctness against onnxruntime first, then the untuned network, the tuned one and
onnxruntime timed interleaved (P50), and what the search cost (the first tuned compile, the second
one with every choice from the tuning cache, against the untuned compile).

The tuning cache starts empty (a temporary LUISAML_CACHE unless one is set), so the first tuned
compile measures. CPU backend, the zoo's --quick size profile; writes benchmarks/results/tune-cpu.json:
    python benchmarks/bench_tune.py --only "resnet-18,vit-tiny/16,wav2vec2 conv encoder,gru 64-128 seq 32"
On CUDA (the lent machine, as bench_zoo.py's command runs there), the zoo's batches:
    python benchmarks/bench_tune.py --device cuda --only resnet-18 --out $OUT/tune-cuda.json"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if "LUISAML_CACHE" not in os.environ:  # (read when luisaml is imported: an empty tuning cache)
    os.environ["LUISAML_CACHE"] = tempfile.mkdtemp(prefix="luisaml-tune-bench-")

import numpy as np  # noqa: E402
from bench_zoo import check, prepare, select  # noqa: E402
from bench_models import interleaved, machine, percentiles, rel_err  # noqa: E402, F401


def bench(net, device: str, quick: bool, tmp: Path, reps: int, mode: str) -> dict:
    import onnxruntime as ort
    import torch

    import luisaml

    batch = net.quick_batch if quick else net.batch
    rec = {"model": net.name, "batch": batch, "status": "ok"}
    module, inputs = prepare(net, batch, quick, tmp, rec)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(tmp / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    ref = sess.run(None, feeds)[0]
    with torch.no_grad():
        floor = rel_err(module(*inputs.values()).numpy(), ref)
    path = str(tmp / "model.onnx")

    def build(tune):
        t = time.perf_counter()
        n = luisaml.compile(path, backend=device, tune=tune)
        c = time.perf_counter() - t
        y = n.run(feeds)["y"]
        return n, c, time.perf_counter() - t, y

    plain, c0, b0, y0 = build(False)
    tuned, c1, b1, y1 = build(mode)
    _, c2, _, _ = build(mode)  # every choice from the tuning cache
    rec.update(compile_s=c0, compile_and_build_s=b0, tuned_compile_s=c1, tuned_compile_and_build_s=b1,
               second_tuned_compile_s=c2)
    ok0, ok1 = check(rec, y0, ref, floor), check(dict(rec), y1, ref, floor)
    rec["rel_err_untuned"] = rel_err(np.asarray(y0, np.float64), ref)
    rec["rel_err_tuned"] = rel_err(np.asarray(y1, np.float64), ref)
    if not (ok0 and ok1):
        return rec | {"status": "mismatch"}
    t = tuned.plan.tuning
    if t is None:  # (a per-batch or per-shape network: its plan is built per run)
        t = getattr(getattr(tuned, "network_for", lambda b: tuned)(batch).plan, "tuning", None)
    rec["tuning"] = None if t is None else {
        "measured": t.measured, "seconds": t.seconds, "nodes": len(t.nodes),
        "off_rule": sum(n.choice != n.rule for n in t.nodes), "rejected": sum(n.rejected for n in t.nodes),
        "choices": [f"{n.node}: {n.choice} (rules {n.rule}) {n.best_ms:.3f} vs {n.rule_ms:.3f} ms"
                    for n in t.nodes if n.choice != n.rule]}
    fns = {"untuned": lambda: plain.run(feeds), "tuned": lambda: tuned.run(feeds), "ort": lambda: sess.run(None, feeds)}
    ms = interleaved(fns, reps, warmup=1)
    rec["ms"] = {k: percentiles(v) for k, v in ms.items()}
    rec["tuned_over_untuned"] = rec["ms"]["tuned"]["p50"] / rec["ms"]["untuned"]["p50"]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--only", help="comma-separated zoo network names")
    ap.add_argument("--mode", choices=["fast", "full"], default="fast")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    quick = a.device == "cpu"
    out = a.out or HERE / "results" / f"tune-{a.device}.json"
    records = []
    for net in select(a.only, None):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                rec = bench(net, a.device, quick, Path(tmp), a.reps, a.mode)
            except Exception as e:  # recorded, not dropped
                rec = {"model": net.name, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        records.append(rec)
        print(json.dumps(rec, default=float), flush=True)
    doc = {"date": datetime.date.today().isoformat(), "device": a.device, "machine": machine(), "mode": a.mode,
           "tuning_cache": os.environ["LUISAML_CACHE"], "records": records}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    print("\n| network | untuned ms | tuned ms | tuned/untuned | ort ms | nodes tuned (off rule) | tune s | 2nd compile s vs untuned |")
    for r in records:
        if r.get("status") != "ok":
            print(f"| {r['model']} | {r.get('status')} | {r.get('error', '')} |")
            continue
        t = r["tuning"] or {"nodes": 0, "off_rule": 0}
        print(f"| {r['model']} | {r['ms']['untuned']['p50']:.2f} | {r['ms']['tuned']['p50']:.2f} | "
              f"{r['tuned_over_untuned']:.3f} | {r['ms']['ort']['p50']:.2f} | {t['nodes']} ({t['off_rule']}) | "
              f"{r['tuned_compile_s'] - r['compile_s']:.1f} | {r['second_tuned_compile_s']:.2f} vs {r['compile_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
