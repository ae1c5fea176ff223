#!/usr/bin/env bash
# Installs everything into .venv (scripts/setup.sh), then exports a small model, compiles it with
# luisaml on the default backend (CUDA where there is a GPU, else CPU) and prints its outputs beside
# onnxruntime's. Afterwards `source .venv/bin/activate` gives a shell with luisaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py
