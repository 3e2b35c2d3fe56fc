# Make this checkout importable as `autopar` by the GPU machine's python3, without the network and
# without touching its preinstalled torch / Triton. Source it from the checkout's root:
#
#     . benchmarks/gpu_env.sh && python3 benchmarks/gpu_check.py --out $OUT --commit HASH
#
# A plain PYTHONPATH of the root is not enough: pyproject.toml installs passes/ and kernels/ as
# autopar.passes / autopar.kernels. First choice: an editable install with no index, no
# dependencies and no build isolation (pip then uses the setuptools already there; it needs
# setuptools >= 70.1, or an older one with the `wheel` package). Where pip refuses (an older
# setuptools, an externally managed Python), a shim folder in /tmp lays the package out by
# symbolic links to this checkout, and PYTHONPATH points at it (exported: source this file).
# PYTHON overrides the interpreter (default python3).

_ap_py=${PYTHON:-python3}
_ap_root=$(pwd -P)
_ap_here() {  # autopar importable, with its kernels and passes, from this checkout (as a script
  # sees it: from elsewhere than the root, whose autopar/ folder alone python -c would find first)
  (cd / && "$_ap_py" -c "import os, sys, autopar.kernels, autopar.passes as p
sys.exit(not os.path.realpath(p.__file__).startswith('$_ap_root' + os.sep))" 2>/dev/null)
}
if ! _ap_here; then
  if "$_ap_py" -m pip install -q --no-index --no-deps --no-build-isolation -e "$_ap_root" >/tmp/autopar-pip.log 2>&1 \
      && _ap_here; then
    echo "gpu_env: autopar installed editable from $_ap_root (pip --no-index --no-deps --no-build-isolation)"
  else
    _ap_shim=/tmp/autopar-shim
    rm -rf "$_ap_shim" && mkdir -p "$_ap_shim/autopar"
    ln -s "$_ap_root"/autopar/* "$_ap_shim/autopar/"
    ln -s "$_ap_root/passes" "$_ap_shim/autopar/passes"
    ln -s "$_ap_root/kernels" "$_ap_shim/autopar/kernels"
    export PYTHONPATH="$_ap_shim${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_env: pip could not install ($(grep 'error: ' /tmp/autopar-pip.log | sed 's/^ *//' | head -n 3 | paste -sd ';' -)); PYTHONPATH=$_ap_shim"
  fi
fi
(cd / && "$_ap_py" -c "import autopar.passes, torch
try:
    import triton; t = triton.__version__
except ImportError as e:
    t = f'not importable ({e})'
print(f'gpu_env: autopar.passes from {autopar.passes.__file__}, torch {torch.__version__}, Triton {t}')")
