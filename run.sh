#!/usr/bin/env bash
# The two set-up commands (see README):  ./run.sh demo   |   ./run.sh test
# Each creates .venv (torch pinned to 2.13.0, CPU) on first use and installs autopar into it.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! .venv/bin/python -c "import autopar, torch, pytest, transformers, matplotlib, triton; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  echo "setting up .venv (first run only)..." >&2
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[test]"
fi
cmd=${1:-}
shift || true
case "$cmd" in
  demo) exec .venv/bin/python -m autopar.tools.demo "$@" ;;
  test) exec .venv/bin/python -m pytest "$@" ;;
  *) echo "usage: ./run.sh demo|test [args]" >&2; exit 2 ;;
esac
