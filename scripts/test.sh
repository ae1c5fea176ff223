#!/usr/bin/env bash
# Installs everything the tests need into .venv (scripts/setup.sh, which reuses one that exists),
# then runs the test suite on both cores with its Python: CI's run by default, everything with --full
# (tests marked `full`, every robustness case, the full artifact fuzz: hours); the 20 slowest tests listed last.
# Further arguments go to pytest (`bash scripts/test.sh -k artifact`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# as `source .venv/bin/activate` would: anything a test runs by name is the venv's
export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" -q -p no:cacheprovider --durations=20 "$@"
