#!/usr/bin/env bash
# Installs everything the tests need, then runs the test suite on both cores: CI's run by default,
# everything with --full (tests marked `full`, every robustness case, the full artifact fuzz: hours).
# Further arguments go to pytest (`bash scripts/test.sh -k artifact`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec "${PYTHON:-python3}" -m pytest -n "${PYTEST_WORKERS:-2}" -q -p no:cacheprovider "$@"
