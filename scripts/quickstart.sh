#!/usr/bin/env bash
# Installs everything, then exports a small model, compiles it with luisaml on the default
# backend (CUDA where there is a GPU, else CPU) and prints its outputs beside onnxruntime's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" examples/quickstart.py
