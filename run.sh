#!/usr/bin/env bash
# The two set-up commands (see README):  ./run.sh demo   |   ./run.sh test
# Each creates .venv (torch pinned to 2.13.0, CPU) on first use and installs autopar into it.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! .venv/bin/python -c "import autopar, torch, pytest, xdist, transformers, matplotlib, triton; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  echo "setting up .venv (first run only)..." >&2
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[test]"
fi
cmd=${1:-}
shift || true
case "$cmd" in
  demo) exec .venv/bin/python -m autopar.tools.demo "$@" ;;
  # the whole suite (no arguments): two pytest-xdist workers, a test file per worker at a time (each
  # worker spawns its own gloo pools; the tests' processes and the single-process tests share the
  # cores better than one worker does: 13 -> 11 minutes on 2 cores); with arguments, as given
  # (the confirmations marked slow are left out: ./run.sh test -m slow -n 2 --dist loadfile runs them)
  test) if [ $# -eq 0 ]; then set -- -n "${AUTOPAR_TEST_WORKERS:-2}" --dist loadfile -m "not slow"; fi
        exec .venv/bin/python -m pytest "$@" ;;
  *) echo "usage: ./run.sh demo|test [args]" >&2; exit 2 ;;
esac
