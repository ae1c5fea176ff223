"""Every FP32 block tiling (operators/tiled.py) of MatMul layers with a constant B, timed on the device:
which tile sizes fill a GPU at the shapes the zoo's transformers run (measurements for tiled.choose).

    LUISAML_BACKEND=cuda python3 -P benchmarks/experiments/sweep_gemm.py --shapes 1024,768,3072 1024,3072,768

Each shape is one network of one MatMul node a candidate (the same A and B), each candidate's tiling
set through the schedules a search would set (luisaml/tune.py); every candidate's output is checked
against float64 numpy before any is timed, then the stages are timed round robin, each launched
alone and synchronised (network.stage_timer: a launch's overhead, ~10-20 us, is in every time).
Prints a line a candidate (ms, TFLOP/s, blocks) and writes --out JSON."""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("luisaml") is None:
    sys.path.insert(0, str(HERE.parents[1]))


def model(M: int, K: int, N: int, b: np.ndarray, n: int):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["A", "B"], [f"Y{c}"], name=f"cand{c}") for c in range(n)]
    g = helper.make_graph(nodes, "sweep", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [M, K])],
                          [helper.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, [M, N]) for c in range(n)],
                          [numpy_helper.from_array(b, "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def tilings(M: int, N: int) -> list[tuple]:
    from luisaml.operators.tiled import _valid

    out = [v for v in itertools.product((64, 128), (64, 128), (4, 8), (4, 8), (8, 16), (False, True))
           if v[2] * v[3] >= 32 and _valid(*v)]
    if min(M, N) < 128:
        out += [v for v in itertools.product((32, 64), (32, 64), (4,), (4, 8), (8, 16), (False, True))
                if (v[0] == 32 or v[1] == 32) and _valid(*v)]
    return out


def sweep(M: int, K: int, N: int, reps: int) -> dict:
    from luisaml import runtime
    from luisaml.operators import tiled
    from luisaml.planning import CompileOptions, plan_for

    rule = tiled.choose(M, N, K, 1, m_fast=False)
    cands = tilings(M, N)
    keys = ("BM", "BN", "TM", "TN", "BK", "double")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    opts = CompileOptions(batch_axis=None).resolve("cuda")
    sched = tuple((f"cand{c}", tuple(sorted({"form": "blocks", **dict(zip(keys, v))}.items()))) for c, v in enumerate(cands))
    t = time.perf_counter()
    plan, _, _ = plan_for(model(M, K, N, b, len(cands)), "sweep", replace(opts, schedules=sched))
    net = runtime._network(plan, "cuda")
    got = net.run({"A": a})
    build_s = time.perf_counter() - t
    stage_of = {int(st.root[0].name[4:]): st.index for st in plan.schedule.stages
                if st.root[0].name.startswith("cand") and st.domain == "blocks"}
    errs = {c: float(np.linalg.norm(got[f"Y{c}"] - want) / np.linalg.norm(want)) for c in stage_of}
    timer = net.stage_timer({"A": a})
    times: dict[int, list[float]] = {c: [] for c in stage_of}
    for c in stage_of:
        timer(stage_of[c])
    for r in range(reps):
        for c in stage_of:
            times[c].append(timer(stage_of[c]))
    rows = []
    flop = 2.0 * M * N * K
    for c, v in enumerate(cands):
        if c not in stage_of:
            continue
        ms = float(np.median(times[c]))
        tl = tiled.Tiling(M, N, K, 1, *v[:5], False, double=v[5])
        rows.append({**dict(zip(keys, v)), "ms": ms, "tflops": flop / ms / 1e9, "blocks": tl.blocks,
                     "rel_err": errs[c], "ok": errs[c] < 1e-5})
    rows.sort(key=lambda r: r["ms"])
    return {"M": M, "K": K, "N": N, "rule": dict(zip(keys, (rule.BM, rule.BN, rule.TM, rule.TN, rule.BK, rule.double))),
            "build_s": build_s, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", required=True, help="M,K,N each")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    import luisaml

    luisaml.device.init("cuda")
    results = []
    for s in a.shapes:
        M, K, N = (int(v) for v in s.split(","))
        r = sweep(M, K, N, a.reps)
        results.append(r)
        rule = r["rule"]
        print(f"== {M}x{K}x{N}: {len(r['rows'])} tilings, built in {r['build_s']:.1f} s; rule {rule}", flush=True)
        for row in r["rows"]:
            mark = " <- rule" if all(row[k] == rule[k] for k in rule) else ""
            print(f"   {row['BM']:>3} x {row['BN']:<3} {row['TM']}x{row['TN']} BK {row['BK']:>2} "
                  f"{'double' if row['double'] else 'single'}: {row['ms']:.4f} ms {row['tflops']:.1f} TFLOP/s "
                  f"{row['blocks']} blocks err {row['rel_err']:.1e}{'' if row['ok'] else ' WRONG'}{mark}", flush=True)
        if a.out:
            a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
