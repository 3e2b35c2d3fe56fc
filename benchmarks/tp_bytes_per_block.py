"""Tensor-parallel bytes per block for the 34 Hugging Face families of autopar/models/hf_archs.py.

Each family's tiny config at 1 and 2 layers, compiled under ``{"tp": "megatron"}`` on a fake tp=2
mesh in bf16; a block's bytes are the difference between the two compiles' tp bytes per step
(forward and backward: the bytes the cost model counts for the program's own collectives), and the
1-layer total is printed too. ``--against REV``: the same with propagation's strategy selector as
it was at git revision REV (``passes/propagate.py``'s ``_select_strategy`` from that revision,
swapped in, in this process), each row both ways.

    .venv/bin/python benchmarks/tp_bytes_per_block.py [--against REV] [NAME ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def tp_bytes(arch: str, layers: int) -> dict:
    import autopar
    from autopar.mesh import fake_mesh
    from autopar.models.hf_archs import build_hf

    model, batches, loss_fn = build_hf(arch, num_hidden_layers=layers)
    with fake_mesh({"tp": 2}, 0) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"tp": "megatron"},
                             precision="bf16", capture_eval=False)
    out = {"forward": 0, "backward": 0}
    for r in pm.collectives():
        if r.axis == "tp":
            out[r.phase] = out.get(r.phase, 0) + int(r.wire_bytes)
    return out


def row(arch: str) -> dict:
    try:
        one, two = tp_bytes(arch, 1), tp_bytes(arch, 2)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
    return {"block": {k: two[k] - one[k] for k in ("forward", "backward")}, "one_layer": sum(one.values())}


def _selector_at(rev: str):
    src = subprocess.run(["git", "-C", HERE, "show", f"{rev}:passes/propagate.py"], check=True,
                         capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("propagate_at_rev", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return mod._select_strategy


def main() -> None:
    from autopar.models.hf_archs import ARCHS
    from autopar.passes import propagate

    p = argparse.ArgumentParser()
    p.add_argument("--against", default=None)
    p.add_argument("names", nargs="*")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    sides = {"now": propagate._select_strategy}
    if args.against:
        sides = {args.against: _selector_at(args.against), **sides}
    now = propagate._select_strategy
    for arch in args.names or list(ARCHS):
        out = {"arch": arch}
        for side, selector in sides.items():
            propagate._select_strategy = selector
            propagate._SHARED_STRATEGIES.clear()  # (DTensor's answers of the other side)
            out[side] = row(arch)
        propagate._select_strategy = now
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
