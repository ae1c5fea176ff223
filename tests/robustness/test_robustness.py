"""The robustness suite's CI entry: the deterministic sample of hostile-input cases and fuzz
graphs, each run in a worker process (an abort fails its case, not the test session), and the
harness's own checks. The full run is `python -m tests.robustness --full`, or the suite's
`bash scripts/test.sh --full` (every case through this test)."""
from __future__ import annotations

import pytest
from suite_mode import full_run

from . import catalog, selftest
from .harness import PASS, Case
from .pool import Pool

pytestmark = pytest.mark.robustness

SAMPLE = catalog.select(full=full_run())


@pytest.fixture(scope="session")
def pool():
    # one worker per pytest process: under `pytest -n 2` that makes two, the most the suite uses
    with Pool(workers=1) as p:
        yield p


@pytest.mark.parametrize("case", SAMPLE, ids=[c.id for c in SAMPLE])
def test_case(pool, case: Case):
    r = pool.run_one(case)
    assert r.outcome == PASS, f"{r.outcome}: {r.detail}"


@pytest.mark.parametrize("case", selftest.cases(), ids=[c.id for c in selftest.cases()])
def test_harness_classifies(pool, case: Case):
    """Each deliberately broken recipe ends in the outcome class it stands for."""
    r = pool.run_one(case)
    assert r.outcome == selftest.SELFTESTS[case.recipe], f"{r.outcome}: {r.detail}"


def test_catalog():
    """The full run holds at least 1,000 cases besides the fuzz, ids are unique, the CI sample is
    a deterministic subset of about 100 cases plus 40 fuzz graphs."""
    full = catalog.family_cases()
    assert len(full) >= 1000
    assert len({c.id for c in full}) == len(full)
    sample = catalog.select(full=False)
    assert [c.id for c in sample] == [c.id for c in catalog.select(full=False)]
    assert {c.id for c in sample if c.family != "fuzz"} <= {c.id for c in full}
    assert 90 <= sum(c.family != "fuzz" for c in sample) <= 130
    assert sum(c.params.get("count", 0) for c in sample if c.family == "fuzz") == catalog.CI_FUZZ_GRAPHS
    assert sum(c.params["count"] for c in catalog.select(full=True, families={"fuzz"})) == catalog.FULL_FUZZ_GRAPHS


def test_fuzz_graphs_are_reproducible():
    import numpy as np

    from . import fuzz

    a, b = fuzz.generate(3, 7), fuzz.generate(3, 7)
    assert [n.SerializeToString() for n in a.nodes] == [n.SerializeToString() for n in b.nodes]
    assert a.feeds.keys() == b.feeds.keys()
    for k in a.feeds:
        np.testing.assert_array_equal(a.feeds[k], b.feeds[k])  # NaN equals NaN here


def test_smuggled_code_check():
    """The static injection check flags code a name put into a module, not quoted names."""
    from .actions import smuggled_code

    clean = "import luisa\n# node 'a\\rimport pathlib'\nx = 'pathlib.Path(1).touch()'\n"
    assert smuggled_code(clean) is None
    assert smuggled_code("import luisa\n__import__('pathlib').Path('m').touch()\n")
    assert smuggled_code("def f():\n    pathlib.Path('m').touch()\n")
