"""The catalog: every case of the full run, and the deterministic sample CI runs.

The full run is every family's cases plus the fuzz (10,000 random graphs in mixed batches). The CI
sample is every case a family marks `ci` (the outside probe's findings and one representative of
each class), topped up to about 100 cases by a stable hash order taken round-robin over the
families, plus 40 fuzz graphs. The same code always gives the same sample.
"""
from __future__ import annotations

import hashlib
import re
from collections import Counter
from itertools import zip_longest

from . import fuzz
from .families import FAMILIES
from .harness import Case

FULL_FUZZ_GRAPHS = 10_000
CI_FUZZ_GRAPHS = 40
CI_CASES = 100


def family_cases(families=None) -> list[Case]:
    """Return the cases of the named families (all by default), in catalog order."""
    out = []
    for name, module in FAMILIES.items():
        if families and name not in families:
            continue
        out.extend(module.cases())
    dup = [i for i, n in Counter(c.id for c in out).items() if n > 1]
    if dup:
        raise ValueError(f"duplicate case ids: {sorted(dup)[:5]}")
    return out


def _stable(case: Case) -> str:
    return hashlib.sha1(case.id.encode()).hexdigest()


def ci_sample(cases: list[Case], target: int = CI_CASES) -> list[Case]:
    """Return the `ci` cases, topped up to `target` round-robin over families in a stable order."""
    chosen = [c for c in cases if c.ci]
    by_family: dict[str, list[Case]] = {}
    for c in sorted((c for c in cases if not c.ci), key=_stable):
        by_family.setdefault(c.family, []).append(c)
    for row in zip_longest(*by_family.values()):
        for c in row:
            if c is not None and len(chosen) < target:
                chosen.append(c)
    return chosen


def select(full: bool, families=None, pattern: str | None = None, fuzz_graphs: int | None = None,
           fuzz_seed: int = 0) -> list[Case]:
    """Return the cases of a run: the full catalog or the CI sample, optionally filtered by family
    and by a regular expression on the case id; fuzz_graphs overrides the number of fuzz graphs
    (0: none)."""
    cases = family_cases(families)
    if not full:
        cases = ci_sample(cases)
    graphs = fuzz_graphs if fuzz_graphs is not None else (FULL_FUZZ_GRAPHS if full else CI_FUZZ_GRAPHS)
    if graphs and (not families or "fuzz" in families):
        cases += fuzz.cases(graphs, seed=fuzz_seed)
    if pattern:
        rx = re.compile(pattern)
        cases = [c for c in cases if rx.search(c.id)]
    return cases
