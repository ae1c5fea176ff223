#!/usr/bin/env bash
# Installs what luisaml needs on a Debian/Ubuntu machine: the system libraries of LuisaCompute's CPU
# backend with apt (as root, or through sudo: clang and libvulkan1, plus the X11 client libraries its
# shared objects link), then a virtual environment, .venv at the repository's root, holding the
# Python packages and luisaml itself (editable). Nothing is pip-installed into the system's Python.
# A .venv that still runs is reused; PYTHON picks the interpreter that creates one (default python3).
# Usage: bash scripts/setup.sh [--test]   (--test adds what the test suite needs)
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
PY=${PYTHON:-python3}
VENV=.venv

# Reuse .venv when its Python runs with pip, and is the version PYTHON asks for when PYTHON is set.
venv_ok() {
  local have
  have=$("$VENV/bin/python" -c "import pip, sys; print(sys.version_info[:2])" 2>/dev/null) || return 1
  [ -z "${PYTHON:-}" ] || [ "$have" = "$("$PYTHON" -c "import sys; print(sys.version_info[:2])")" ]
}
reuse=0; venv_ok && reuse=1

pkgs=(libvulkan1 clang libx11-6 libxext6 libsm6 libice6)
# the tests render `luisaml inspect --html` in a headless Chromium (Playwright drives Debian's)
if [ "${1:-}" = "--test" ]; then pkgs+=(chromium); fi
# `python3 -m venv` needs ensurepip, which Debian and Ubuntu ship apart (python3.X-venv)
if [ $reuse -eq 0 ] && ! "$PY" -c "import ensurepip" >/dev/null 2>&1; then
  pkgs+=("python$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
fi
need=()
for pkg in "${pkgs[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "[setup] apt-get install ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [ $reuse -eq 1 ]; then
  echo "[setup] reusing $VENV ($("$VENV/bin/python" --version))"
else
  echo "[setup] creating $VENV with $PY ($("$PY" --version))"
  "$PY" -m venv --clear "$VENV"
fi
VPY=$VENV/bin/python
pip_install() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }

# torch's CPU build, asked for by name: PyPI's torch==2.13.0 for Linux is the multi-GB CUDA build.
# Where pip's own configuration already finds that CPU wheel without an index (a wheel directory
# in find-links, as on the project's machines and CI), it is taken from there; elsewhere from
# PyTorch's CPU index. torch exports models and checks results, it never runs a compiled model.
TORCH="torch==2.13.0+cpu"
if "$VPY" -m pip install -q --disable-pip-version-check --dry-run --no-index --no-deps "$TORCH" >/dev/null 2>&1; then
  echo "[setup] pip install $TORCH (the wheel pip's configuration points at)"
  pip_install "$TORCH"
else
  echo "[setup] pip install $TORCH from https://download.pytorch.org/whl/cpu"
  pip_install --index-url https://download.pytorch.org/whl/cpu "$TORCH"
fi
echo "[setup] pip install luisaml and its dependencies into $VENV"
if [ "${1:-}" = "--test" ]; then
  pip_install -e ".[test]" onnxscript onnxruntime playwright
else
  pip_install -e . onnxscript onnxruntime
fi
