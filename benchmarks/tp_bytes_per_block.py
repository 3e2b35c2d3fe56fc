"""Tensor-parallel bytes per block for the 34 Hugging Face families of autopar/models/hf_archs.py.

Each family's tiny config at 1 and 2 layers, compiled under ``{"tp": "megatron"}`` on a fake tp=2
mesh in bf16; a block's bytes are the difference between the two compiles' tp bytes per step
(forward and backward: the bytes the cost model counts for the program's own collectives), and the
1-layer total is printed too. ``--against REV``: the same with propagation's choices as they were at
git revision REV (``passes/propagate.py``'s ``_select_strategy`` and ``_dtensor_rule_uncached``
from that revision, swapped in, in this process; the helpers they import, such as
``passes/partials.py``, are the working tree's), each row both ways.

    .venv/bin/python benchmarks/tp_bytes_per_block.py [--against REV] [--strategy sequence] [NAME ...]
    .venv/bin/python benchmarks/tp_bytes_per_block.py --builtin --against REV

``--builtin``: instead, the built-in test models (Llama, tied Llama, GPT, MoE, Hugging Face Llama:
autopar.testing.build_model) under ddp, fsdp, zero2, megatron, fsdp + megatron and fsdp + sequence
(dp=2, tp=2 or dp=2 x tp=2, fake meshes), each in fp32, bf16 and bf16 with ``reduce_dtype="fp32"``:
every collective's bytes by kind, axis and phase, one JSON line per compile saying whether both sides
are equal (a change to propagation that should move only tensor-parallel bytes of some families
must leave these alone).
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


def tp_bytes(arch: str, layers: int, strategy: str = "megatron") -> dict:
    import autopar
    from autopar.mesh import fake_mesh
    from autopar.models.hf_archs import build_hf

    model, batches, loss_fn = build_hf(arch, num_hidden_layers=layers)
    with fake_mesh({"tp": 2}, 0) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"tp": strategy},
                             precision="bf16", capture_eval=False)
    return {phase: int(sum(v for k, v in by.items() if k.endswith("@tp"))) for phase, by in _sent(pm).items()}


def _sent(pm) -> dict:
    """Per phase, the program's collectives' bytes per step by "kind@axis" (autopar.ir.bytes_by_collective)."""
    from autopar.ir import bytes_by_collective

    records = pm.collectives()
    return {phase: bytes_by_collective([r for r in records if r.phase == phase]) for phase in ("forward", "backward")}


def row(arch: str, strategy: str = "megatron") -> dict:
    try:
        one, two = tp_bytes(arch, 1, strategy), tp_bytes(arch, 2, strategy)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
    return {"block": {k: two[k] - one[k] for k in ("forward", "backward")}, "one_layer": sum(one.values())}


BUILTIN_PLANS = [({"dp": "ddp"}, {"dp": 2}), ({"dp": "fsdp"}, {"dp": 2}), ({"dp": "zero2"}, {"dp": 2}),
                 ({"tp": "megatron"}, {"tp": 2}), ({"dp": "fsdp", "tp": "megatron"}, {"dp": 2, "tp": 2}),
                 ({"dp": "fsdp", "tp": "sequence"}, {"dp": 2, "tp": 2})]


def plan_bytes(name: str, plan: dict, axes: dict, precision: str, reduce_dtype) -> list | str:
    """Every collective's bytes per step by (kind, axis, phase) of a built-in model under ``plan``."""
    import autopar
    from autopar.mesh import fake_mesh
    from autopar.testing import build_model

    try:
        model, batches, loss_fn = build_model(name)
        with fake_mesh(axes, 0) as mesh:
            pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan=plan,
                                 precision=precision, reduce_dtype=reduce_dtype, capture_eval=False)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return sorted((f"{k}@{phase}", int(v)) for phase, by in _sent(pm).items() for k, v in by.items())


def _selector_at(rev: str):
    src = subprocess.run(["git", "-C", HERE, "show", f"{rev}:passes/propagate.py"], check=True,
                         capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("propagate_at_rev", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return mod._select_strategy, mod._dtensor_rule_uncached


def main() -> None:
    from autopar.models.hf_archs import ARCHS
    from autopar.passes import propagate

    p = argparse.ArgumentParser()
    p.add_argument("--against", default=None)
    p.add_argument("--builtin", action="store_true",
                   help="the built-in models under six plans (module docstring)")
    p.add_argument("--strategy", default="megatron", choices=("megatron", "sequence"),
                   help="the tp axis's strategy")
    p.add_argument("names", nargs="*")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    now = propagate._select_strategy, propagate._dtensor_rule_uncached
    sides = {"now": now}
    if args.against:
        sides = {args.against: _selector_at(args.against), **sides}
    def each_side(out: dict, measure) -> dict:
        """``out`` with ``measure()`` under each side's propagation, by side name"""
        for side, (selector, rule) in sides.items():
            propagate._select_strategy, propagate._dtensor_rule_uncached = selector, rule
            propagate._SHARED_STRATEGIES.clear()  # (DTensor's answers of the other side)
            out[side] = measure()
        propagate._select_strategy, propagate._dtensor_rule_uncached = now
        return out

    if args.builtin:
        for name in args.names or ("llama", "llama_tied", "gpt", "moe", "hf_llama"):
            for plan, axes in BUILTIN_PLANS:
                for precision, rd in (("fp32", None), ("bf16", None), ("bf16", "fp32")):
                    out = each_side({"model": name, "plan": plan, "precision": precision, "reduce_dtype": rd},
                                    lambda: plan_bytes(name, plan, axes, precision, rd))
                    out["equal"] = len({json.dumps(out[side]) for side in sides}) == 1
                    print(json.dumps(out), flush=True)
        return
    for arch in args.names or list(ARCHS):
        print(json.dumps(each_side({"arch": arch}, lambda: row(arch, args.strategy))), flush=True)


if __name__ == "__main__":
    main()
