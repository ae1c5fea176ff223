"""Run the ONNX backend suite on luisaml and print what passes, per op type and per kind.

    python tests/conformance/report.py               # run with pytest -n 2, print the report
    python tests/conformance/report.py -n 4 --update # ... and record the pass counts
    python tests/conformance/report.py --results r.json   # report on an earlier run's results
    python tests/conformance/report.py --no-triage   # run every case, triage ignored (what would pass?)

The suite is tests/conformance/test_onnx_backend.py; its outcomes come from the pytest plugin
(pytest_plugin.py) through $LUISAML_CONFORMANCE_RESULTS. --update writes expected_counts.json,
which the plugin checks after every full run."""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from suite_cases import EXPECTED, KINDS, NO_TRIAGE_ENV, RESULTS_ENV, all_cases  # noqa: E402


def run_suite(workers: int, no_triage: bool, out: str) -> float:
    """Run the suite with pytest-xdist, results into `out`; return the wall time in seconds."""
    env = dict(os.environ, **{RESULTS_ENV: out})
    if no_triage:
        env[NO_TRIAGE_ENV] = "1"
    cmd = [sys.executable, "-m", "pytest", os.path.join(HERE, "test_onnx_backend.py"), "-q", "--tb=no",
           "-p", "no:warnings", "-p", "no:cacheprovider", "-o", "addopts="]
    if workers > 1:
        cmd += ["-n", str(workers)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    tail = proc.stdout.strip().splitlines()[-12:]
    print("\n".join(tail))
    if not os.path.exists(out) or os.path.getsize(out) == 0:
        sys.exit(f"the suite produced no results (pytest exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall


def registered_ops() -> set[str]:
    from luisaml import registry

    from luisaml import operators  # noqa: F401  (importing the package registers the shipped operators)
    return {op if dom == "" else f"{dom}::{op}" for dom, op in registry.registered()}


def report(results: dict[str, dict]) -> dict:
    """Print the tables; return the counts per kind (and per node op) that --update records."""
    cases = all_cases()
    kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, r in results.items():
        kinds[r["kind"]][r["outcome"]] += 1
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, c in cases.items():
        if c.kind == "node":
            by_op[c.op]["loaded"] += 1
            r = results.get(name)
            if r is not None:
                by_op[c.op][r["outcome"]] += 1
    print("\nNode tests per op type (passed/loaded; failed, expected failures, skipped):")
    width = min(40, max(len(op) for op in by_op))
    for op in sorted(by_op, key=str.lower):
        c = by_op[op]
        rest = ", ".join(f"{c[o]} {o}" for o in ("failed", "xfailed", "skipped", "xpassed") if c[o])
        name = op if len(op) <= width else op[: width - 3] + "..."
        print(f"  {name:<{width}}  {c['passed']:>3}/{c['loaded']:<3} {rest}")
    print(f"\nOperators: {sum(1 for c in by_op.values() if c['passed'])} of {len(by_op)} op types pass at least one node test")
    missing_rank(results, cases)
    failure_reasons(results)
    print("\nTotals per kind (passed/cases):")
    counts = {}
    for kind in KINDS:
        loaded = sum(1 for c in cases.values() if c.kind == kind)
        k = kinds.get(kind, collections.Counter())
        ran = sum(k.values())
        extra = ", ".join(f"{k[o]} {o}" for o in ("failed", "xfailed", "skipped", "xpassed") if k[o])
        print(f"  {kind:<18} {k['passed']:>4}/{loaded:<4} {extra}" + ("" if ran == loaded else f"  (ran {ran})"))
        counts[kind] = {"cases": loaded, "passed": k["passed"]}
    total = sum(v["passed"] for v in counts.values())
    print(f"  {'all':<18} {total:>4}/{sum(v['cases'] for v in counts.values())}")
    return {"kinds": counts, "node_passed_by_op": {op: c["passed"] for op, c in sorted(by_op.items()) if c["passed"]}}


def missing_rank(results, cases) -> None:
    """Print the unregistered op types ranked by the node tests they keep from passing: all of
    them, and those whose element types luisaml supports (what implementing the op would gain)."""
    import triage

    have = registered_ops()
    blocked, typed_ok = collections.Counter(), collections.Counter()
    for name, c in cases.items():
        if c.kind != "node" or results.get(name, {}).get("outcome") == "passed":
            continue
        ok = not any(t in triage.UNSUPPORTED_TYPES for t in c.types)
        for op in sorted(op for op in c.ops if op not in have):
            blocked[op] += 1
            typed_ok[op] += ok
    print("\nMissing op types by node tests they block (all / with supported dtypes):")
    ranked = sorted(blocked, key=lambda op: (-typed_ok[op], -blocked[op], op))
    for rank, op in enumerate(ranked, start=1):
        print(f"  {rank:>3}. {op:<34} {blocked[op]:>4} / {typed_ok[op]:<4}")


def failure_reasons(results) -> None:
    """Print the failures that are not triaged, grouped by message."""
    failed = [(n, r) for n, r in results.items() if r["outcome"] in ("failed", "xpassed")]
    if not failed:
        return
    print(f"\nUntriaged failures ({len(failed)}):")
    for name, r in sorted(failed):
        print(f"  {r['kind']}/{name}: {r['message'][:200]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2, help="pytest-xdist workers (default 2)")
    ap.add_argument("--results", help="report on this results file instead of running the suite")
    ap.add_argument("--save", help="keep the results of this run in this file")
    ap.add_argument("--update", action="store_true", help="record the pass counts in expected_counts.json")
    ap.add_argument("--no-triage", action="store_true", help="run every case, ignoring triage.py")
    args = ap.parse_args()
    if args.results:
        path = args.results
    else:
        path = args.save or os.path.join(tempfile.mkdtemp(prefix="luisaml-conformance-"), "results.json")
        wall = run_suite(args.n, args.no_triage, path)
        print(f"\nwall time: {wall:.1f} s with {args.n} worker(s)")
    with open(path) as f:
        results = json.load(f)
    counts = report(results)
    if args.update:
        if args.no_triage:
            sys.exit("--update records the triaged suite's counts; run without --no-triage")
        short = [k for k, v in counts["kinds"].items() if sum(1 for r in results.values() if r["kind"] == k) != v["cases"]]
        if short:
            sys.exit(f"not every case ran (kinds {short}); run the whole suite to --update")
        with open(EXPECTED, "w") as f:
            json.dump(counts, f, indent=1)
            f.write("\n")
        print(f"\nrecorded in {os.path.relpath(EXPECTED)}")


if __name__ == "__main__":
    main()
