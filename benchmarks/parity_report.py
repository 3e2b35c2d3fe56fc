"""Parity figures for the README: every plan against one eager process, max differences.

    .venv/bin/python benchmarks/parity_report.py
"""

from __future__ import annotations

from autopar.ir import bytes_by_collective
from autopar.testing import DistPool, parity_job, reference_run

CASES = [
    ("llama", {"dp": 2}, {"dp": "ddp"}),
    ("llama", {"tp": 2}, {"tp": "megatron"}),
    ("llama", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "megatron"}),
    ("hf_llama", {"dp": 2}, {"dp": "ddp"}),
    ("hf_llama", {"tp": 2}, {"tp": "megatron"}),
    ("hf_llama", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "megatron"}),
]


def main():
    pools = {2: DistPool(2), 4: DistPool(4)}
    refs = {}
    print("| model | mesh, plan | max loss diff (3 steps) | max grad diff, step 0 | max grad diff, all steps "
          "| max param diff after 3 AdamW steps | bytes/rank/step predicted = counted |")
    print("|---|---|---|---|---|---|---|")
    try:
        for name, axes, plan in CASES:
            ref = refs.setdefault(name, reference_run(name))
            world = 1
            for v in axes.values():
                world *= v
            out = pools[world].run(parity_job, name, axes, plan)
            dl = max(abs(a - b) for a, b in zip(ref["losses"], out["losses"]))
            dg = [max((r[k] - o[k]).abs().max().item() for k in r) for r, o in zip(ref["grads"], out["grads"])]
            dp = max((ref["params"][k] - out["params"][k]).abs().max().item() for k in ref["params"])
            pred = sum(bytes_by_collective(out["records"]).values())
            meas = sum(v["wire_bytes"] for v in out["measured"].values()) / out["steps"]
            print(f"| {name} | {' x '.join(f'{a}={n}' for a, n in axes.items())} "
                  f"{'+'.join(plan.values())} | {dl:.1e} | {dg[0]:.1e} | {max(dg):.1e} | {dp:.1e} "
                  f"| {pred:,.0f} = {meas:,.0f} |", flush=True)
    finally:
        for p in pools.values():
            p.close()


if __name__ == "__main__":
    main()
