#!/usr/bin/env bash
# lint-imports over the package as the wheel lays it out: operators/, opsets/ and shaders/ sit beside
# luisaml/ in the checkout (setuptools' package-dir mapping, which import-linter does not follow), so
# plain `lint-imports` at the root reports "module luisaml.operators does not exist". This copies them
# into one luisaml/ folder first; tests/test_layers.py runs the same check in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cp -r luisaml "$tmp/luisaml"
for part in operators opsets shaders; do cp -r "$part" "$tmp/luisaml/$part"; done
cp .importlinter "$tmp/"
cd "$tmp" && PYTHONPATH="$tmp" lint-imports --config .importlinter --no-cache "$@"
