"""The robustness run from the command line: `python -m tests.robustness [--full] ...`.

Without --full it runs the CI sample (what tests/robustness/test_robustness.py runs); with --full
every case and 10,000 fuzz graphs. It prints a table per family and outcome class, the failures by
class, and exits 1 when anything failed. Run from the repository root.

    python -m tests.robustness --full                      # the whole suite, two workers
    python -m tests.robustness --families names,nvdb -k cr # a slice
    python -m tests.robustness --fuzz 500 --families fuzz  # only fuzz graphs
    python -m tests.robustness --case 'graphs/self_loop'   # one case in this process (traceback)
    python -m tests.robustness --fuzz-graph 0:17 --dump /tmp/bug  # one fuzz graph as an .onnx file
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from . import catalog
from .harness import OUTCOMES, PASS, Result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.robustness", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="every case and 10,000 fuzz graphs (default: the CI sample)")
    ap.add_argument("--families", help="comma-separated families (names, graphs, ..., fuzz)")
    ap.add_argument("-k", dest="pattern", help="regular expression on case ids")
    ap.add_argument("--fuzz", type=int, help="number of fuzz graphs (0: no fuzz)")
    ap.add_argument("--fuzz-seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--report", help="write every result to this JSON file")
    ap.add_argument("--dump", help="copy each failing case's files (models, weights, feeds) here")
    ap.add_argument("--list", action="store_true", help="print the selected case ids and counts, run nothing")
    ap.add_argument("--case", help="run the case with this id in this process and print its result")
    ap.add_argument("--fuzz-graph", help="SEED:INDEX: write that fuzz graph (.onnx + feeds) to --dump and compare it")
    ap.add_argument("--keep-logs", action="store_true", help="keep the workers' logs and folders")
    ap.add_argument("-q", "--quiet", action="store_true", help="no line per failure while running")
    a = ap.parse_args(argv)
    families = set(a.families.split(",")) if a.families else None

    if a.fuzz_graph:
        from . import fuzz

        seed, index = (int(v) for v in a.fuzz_graph.split(":"))
        return fuzz.reproduce(seed, index, Path(a.dump or "."))
    if a.case:
        return _run_in_process(a.case, a.dump)
    cases = catalog.select(a.full, families, a.pattern, a.fuzz, a.fuzz_seed)
    if a.list:
        for c in cases:
            print(c.id)
        counts = Counter(c.family for c in cases)
        print("\n" + ", ".join(f"{k}: {v}" for k, v in counts.items()) + f"; total {len(cases)}")
        return 0
    return _run(cases, a)


def _run_in_process(case_id: str, dump) -> int:
    """Run one case here (no worker): for a debugger or a full traceback."""
    from .worker import load_recipes, run_case

    os.environ["ROBUSTNESS_INPROCESS"] = "1"
    os.environ.setdefault("LUISAML_BACKEND", "cpu")
    load_recipes()
    matches = [c for c in catalog.select(True, fuzz_graphs=catalog.FULL_FUZZ_GRAPHS) if c.id == case_id]
    if not matches:
        print(f"no case {case_id!r} (see --list --full)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="luisaml-robustness-case-"))
    r = run_case(matches[0], work, Path(dump) if dump else None, keep=True)
    print(f"{r.outcome} {r.case_id} ({r.seconds:.2f} s)\n{r.detail}\nfiles: {work}")
    if r.extra:
        print(json.dumps(r.extra, indent=1, default=str)[:4000])
    return 0 if r.outcome == PASS else 1


def _run(cases, a) -> int:
    from .pool import Pool

    print(f"running {len(cases)} cases on {a.workers} workers", flush=True)
    t0 = time.perf_counter()
    done = []

    def progress(r: Result) -> None:
        done.append(r)
        if r.outcome != PASS and not a.quiet:
            print(f"  {r.outcome:14s} {r.case_id}: {_first_line(r.detail)}", flush=True)
        if len(done) % 100 == 0:
            print(f"  ... {len(done)}/{len(cases)} in {time.perf_counter() - t0:.0f} s", flush=True)

    with Pool(a.workers, a.dump, keep_logs=a.keep_logs) as pool:
        results = pool.run(cases, progress)
        # a fuzz batch that killed its worker: run its graphs one by one to find the one at fault
        by_id = {c.id: c for c in cases}
        aborted = [by_id[r.case_id] for r in results
                   if r.family == "fuzz" and r.outcome == "FAIL_ABORT" and by_id[r.case_id].params["count"] > 1]
        if aborted:
            from . import fuzz

            follow = [c for case in aborted for c in fuzz.single_cases(case)]
            print(f"re-running {len(follow)} graphs of {len(aborted)} aborted fuzz batches one by one", flush=True)
            results += pool.run(follow, progress)
    wall = time.perf_counter() - t0
    print(summary(results, wall))
    if a.report:
        Path(a.report).write_text(json.dumps([r.__dict__ for r in results], indent=1, default=str))
        print(f"results: {a.report}")
    return 0 if all(r.outcome == PASS for r in results) else 1


def _first_line(text: str, n: int = 240) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= n else line[: n - 3] + "..."


def summary(results: list[Result], wall: float, examples: int = 3) -> str:
    """Return the table per family and outcome, the fuzz totals, and failure examples by class."""
    rows: dict[str, Counter] = defaultdict(Counter)
    secs: dict[str, float] = defaultdict(float)
    for r in results:
        rows[r.family][r.outcome] += 1
        secs[r.family] += r.seconds
    cols = [o for o in OUTCOMES]
    head = f"{'family':12s} {'cases':>6s} " + " ".join(f"{c.replace('FAIL_', ''):>9s}" for c in cols) + f" {'case-s':>8s}"
    lines = ["", head, "-" * len(head)]
    total = Counter()
    for fam in sorted(rows):
        c = rows[fam]
        total += c
        lines.append(f"{fam:12s} {sum(c.values()):6d} " + " ".join(f"{c[o]:9d}" for o in cols) + f" {secs[fam]:8.0f}")
    lines.append("-" * len(head))
    lines.append(f"{'total':12s} {sum(total.values()):6d} " + " ".join(f"{total[o]:9d}" for o in cols)
                 + f" {sum(secs.values()):8.0f}")
    lines.append(f"wall time {wall:.0f} s")
    fz = fuzz_totals(results)
    if fz:
        lines.append(f"fuzz: {fz['graphs']} graphs in {fz['batches']} batches, {fz['compared']} compared with "
                     f"onnxruntime, {fz['invalid']} invalid (generator), {fz['untriaged']} untriaged mismatches, "
                     f"triaged: " + (", ".join(f"{k} {v}" for k, v in sorted(fz['triaged'].items())) or "none"))
    by_class: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        if r.outcome != PASS:
            by_class[r.outcome].append(r)
    for cls in cols:
        if cls in by_class:
            lines.append(f"\n{cls}: {len(by_class[cls])}")
            for r in sorted(by_class[cls], key=lambda r: r.case_id)[:examples]:
                lines.append(f"  {r.case_id}: {_first_line(r.detail, 400)}")
    return "\n".join(lines)


def fuzz_totals(results: list[Result]) -> dict | None:
    """Return the fuzz counts summed over the fuzz batch results, or None without fuzz."""
    fz = [r.extra for r in results if r.family == "fuzz" and r.extra]
    if not fz:
        return None
    triaged: Counter = Counter()
    for e in fz:
        triaged.update(e.get("triaged", {}))
    return {"batches": len(fz), "graphs": sum(e.get("graphs", 0) for e in fz),
            "compared": sum(e.get("compared", 0) for e in fz), "invalid": sum(e.get("invalid", 0) for e in fz),
            "untriaged": sum(len(e.get("untriaged", [])) for e in fz), "triaged": dict(triaged)}


if __name__ == "__main__":
    sys.exit(main())
