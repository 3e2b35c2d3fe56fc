"""Architecture breadth: the most used Hugging Face causal-LM families, end to end on 2 gloo ranks.

    .venv/bin/python benchmarks/hf_breadth.py [NAME ...] [--plans fsdp,megatron] [--no-debug]

Each architecture of ``autopar.models.hf_archs.ARCHS`` (tiny config: 2 layers, hidden 64, 4 heads,
vocab 128; batch 4 x 16 tokens) is compiled under {"dp": "fsdp"} on dp=2 and under
{"tp": "megatron"} / {"tp": "sequence"} on tp=2 (placements derived from the graph: no rules, no
"rest"), trained 2 AdamW steps and compared with one eager process (every step's loss and gradients, the parameters AdamW gives, the eval forward:
``hf_archs.compare``). Prints one table row per
architecture: ok (with a tensor-parallel plan, the share of the blocks' matrix parameters that tp
shards), or the first line of what went wrong (a compile error, or where the numbers differ). About 20 s per architecture on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from autopar.models.hf_archs import ARCHS, MORE_PLANS, PLANS, breadth_job, breadth_reference, compare
from autopar.testing import DistPool


def _short(e: BaseException | str) -> str:
    """The error's first meaningful line (the pool prefixes 'distributed job failed / rank 0:')."""
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("rank 0:", "rank 1:")):
            return ln.split(":", 1)[1].strip()[:240]
    return (lines[0] if lines else type(e).__name__)[:240]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"architectures (default: all {len(ARCHS)}), or transformers model_types")
    ap.add_argument("--plans", default=",".join(PLANS),
                    help="comma-separated, of: " + ", ".join({**PLANS, **MORE_PLANS}) + " (each on as many gloo ranks as its mesh)")
    ap.add_argument("--no-debug", action="store_true", help="skip the invariant checks after every pass")
    a = ap.parse_args()
    names, plans, debug = a.names or list(ARCHS), a.plans.split(","), not a.no_debug
    torch.set_num_threads(1)
    pools: dict[int, DistPool] = {}

    def pool_for(plan: str) -> DistPool:
        n = math.prod({**PLANS, **MORE_PLANS}[plan][0].values())
        if n not in pools:
            pools[n] = DistPool(n)
        return pools[n]

    passed = {p: 0 for p in plans}
    print("| architecture | " + " | ".join(plans) + " | error / note | s |")
    print("|---|" + "---|" * len(plans) + "---|---|", flush=True)
    try:
        for name in names:
            t0 = time.perf_counter()
            cells, notes = [], []
            try:
                ref = breadth_reference(name)
            except Exception as e:  # noqa: BLE001 - the eager model itself fails: report, go on
                print(f"| {name} | " + " | ".join("-" for _ in plans) + f" | reference: {_short(e)} | |", flush=True)
                continue
            for plan in plans:
                try:
                    out = pool_for(plan).run(breadth_job, name, plan, debug)
                    why = compare(ref, out)
                except Exception as e:  # noqa: BLE001
                    why = _short(e)
                    broken = pools.pop(math.prod({**PLANS, **MORE_PLANS}[plan][0].values()), None)
                    if broken is not None:  # a failed job has closed it already; a failed compare has not
                        broken.close(force=True)
                share = out.get("tp_sharded") if why is None else None
                cells.append(("ok" if why is None else "FAIL") + (f" ({share:.0%} sharded)" if share is not None else ""))
                if why is None:
                    passed[plan] += 1
                else:
                    notes.append(f"{plan}: {why}")
            print(f"| {name} | " + " | ".join(cells) + f" | {'; '.join(notes)} | {time.perf_counter() - t0:.0f} |",
                  flush=True)
        print("\npassed: " + ", ".join(f"{p} {passed[p]}/{len(names)}" for p in plans), flush=True)
    finally:
        for p in pools.values():
            p.close()


if __name__ == "__main__":
    main()
