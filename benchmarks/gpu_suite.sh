# The CPU test suite (what ./run.sh test runs) on the GPU machine's own torch: the only torch 2.11 this
# project can reach (pyproject: torch>=2.11; this machine's venv has 2.13). Run from the checkout's root
# after gpu_env.sh:
#
#     . benchmarks/gpu_env.sh && bash benchmarks/gpu_suite.sh WHEELS OUT [SECONDS] [pytest args...]
#
# WHEELS: a folder of wheels for what the suite needs beyond torch (pytest, pytest-xdist, transformers
# 5.23.0, safetensors and their dependencies), made here for the GPU machine's Python 3.12 (it has no
# network) and carried to it (the device tool's `carry`):
#
#     .venv/bin/pip download -d gpu_wheels --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#         pytest pytest-xdist transformers==5.23.0 safetensors
#
# They are installed only where missing, never over torch or Triton (none of them depends on either).
# SECONDS (default 240) caps the run; pytest's log and JUnit report go to OUT. Without pytest args: the
# suite as CI runs it (not slow), a test file per worker, 14 workers.
set -u
wheels=$1; out=$2; cap=${3:-240}; shift $(( $# < 3 ? $# : 3 ))
py=${PYTHON:-python3}
mkdir -p "$out"
if ! "$py" -c "import pytest, xdist, transformers, safetensors; assert transformers.__version__ == '5.23.0'" 2>/dev/null; then
  pkgs="pytest pytest-xdist transformers==5.23.0 safetensors"
  "$py" -m pip install -q --no-index --find-links "$wheels" $pkgs >"$out/pip.log" 2>&1 \
    || "$py" -m pip install -q --no-index --find-links "$wheels" --break-system-packages $pkgs >>"$out/pip.log" 2>&1 \
    || { echo "gpu_suite: pip could not install the test wheels:"; tail -n 5 "$out/pip.log"; }
fi
"$py" -c "import torch, pytest, transformers; print(f'gpu_suite: torch {torch.__version__}, pytest {pytest.__version__}, transformers {transformers.__version__}')"
[ $# -eq 0 ] && set -- -n 14 --dist loadfile -m "not slow"
start=$(date +%s)
# benchmarks/failures_log.py: each failure's traceback into failures.txt as it happens (a run cut at
# the cap still says why; pytest itself prints them only at the end)
AUTOPAR_FAILURES_LOG="$out/failures.txt" timeout -k 10 "$cap" "$py" -m pytest -p no:cacheprovider \
  -p benchmarks.failures_log -o addopts="-v --durations=15" -rfE --junitxml="$out/junit.xml" "$@" >"$out/suite.log" 2>&1
rc=$?
echo "gpu_suite: rc $rc after $(( $(date +%s) - start )) s (124: cut at ${cap} s)"
grep -E "(FAILED|ERROR) " "$out/suite.log" | head -n 60; grep -c "PASSED" "$out/suite.log"
tail -n 3 "$out/suite.log"
exit $rc
