"""The robustness suite: luisaml on hostile input must not run injected code, abort, or return a
silently wrong result, and every error it raises must be a luisaml.LuisamlError naming the
offender.

Layout:
- harness.py: cases, outcomes (PASS, FAIL_ABORT, FAIL_INJECTION, FAIL_WRONG, FAIL_ERROR,
  FAIL_HARNESS) and the checks recipes use (attempt, judge, compare_outputs).
- pool.py / worker.py: long-lived worker processes that run one case at a time; a worker that
  dies or hangs turns its case into FAIL_ABORT and is replaced.
- child.py: a fresh process for one compile + run (cache faults, several processes at once).
- models.py, actions.py: base models, outside references, and the luisaml actions (compile + run,
  NetworkInstance, the CLI, emit) with the check for code smuggled into generated source.
- families/: one module per kind of hostile input, each registering recipes and listing cases.
- fuzz.py, fuzz_triage.py: random valid graphs against onnxruntime in mixed batches, and the
  known classes of mismatch.
- catalog.py: the full run and the deterministic CI sample.
- __main__.py: `python -m tests.robustness [--full]`, the summary table.
- test_robustness.py: the pytest entry (the CI sample).
- selftest.py: recipes that misbehave on purpose, to check the harness classifies them.

Run from the repository root:
    python -m tests.robustness --full        # every case + 10,000 fuzz graphs
    python -m tests.robustness               # the CI sample (~100 cases + 40 fuzz graphs)
    python -m pytest tests/robustness -n 2   # the CI sample under pytest
"""
