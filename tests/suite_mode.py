"""Which run this is: the CI run (the default) or the full run (`bash scripts/test.sh --full`,
pytest's `--full`, which tests/conftest.py turns into LUISAML_TESTS=full before collection)."""
from __future__ import annotations

import os

FULL_ENV = "LUISAML_TESTS"


def full_run() -> bool:
    """True in the full run: every test, every robustness case, the full artifact fuzz."""
    return os.environ.get(FULL_ENV) == "full"
