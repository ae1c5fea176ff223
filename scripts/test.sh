#!/usr/bin/env bash
# Installs everything the tests need, then runs the whole test suite on both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec "${PYTHON:-python3}" -m pytest -n "${PYTEST_WORKERS:-2}" -q -p no:cacheprovider "$@"
