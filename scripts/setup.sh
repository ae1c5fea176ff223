#!/usr/bin/env bash
# Installs what luisaml needs on a Debian/Ubuntu machine (run as root, or with sudo available):
# the system libraries of LuisaCompute's CPU backend (clang and libvulkan1, plus the X11 client
# libraries its shared objects link), then the Python packages and luisaml itself (editable).
# Usage: bash scripts/setup.sh [--test]   (--test adds what the test suite needs)
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
pkgs=(libvulkan1 clang libx11-6 libxext6 libsm6 libice6)
# the tests render `luisaml inspect --html` in a headless Chromium (Playwright drives Debian's)
if [ "${1:-}" = "--test" ]; then pkgs+=(chromium); fi
need=()
for pkg in "${pkgs[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "[setup] apt-get install ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
PY=${PYTHON:-python3}
# torch is pinned: the CPU wheel on the machine; a bare "torch" would pull a multi-GB CUDA build.
# It is used to export models and in tests, never to run a compiled model.
echo "[setup] pip install luisaml and its dependencies"
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0" onnxscript onnxruntime
if [ "${1:-}" = "--test" ]; then
  $PY -m pip install -q --disable-pip-version-check -e ".[test]" warp-lang playwright
else
  $PY -m pip install -q --disable-pip-version-check -e .
fi
