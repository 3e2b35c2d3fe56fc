"""Parity figures for docs/results.md (--cost: docs/cost-model.md; --pipeline: docs/pipelines.md):
every plan against one eager process, max differences.

    .venv/bin/python benchmarks/parity_report.py [--state | --cost | --pipeline]

--state: the ZeRO / mixed-precision / accumulation / recompute cases (bf16 and fp16 against a
single process in the same precision).
--cost: every case (both lists and the MoE model): the cost model's per-rank memory and bytes
against instruments that do not read the graph: the allocator over the real step (without the
process group's own buffers; with them in brackets), the storages the programs' ops created
alive at once, and the bytes handed to the process group (every c10d call).
--pipeline: the pipeline cases (every schedule at pp=2 and pp=4, pp x dp, pp x tp).
--strategies: sequence, context (ulysses, ring) and expert parallelism, alone and under fsdp:
parity, bytes per axis predicted = counted at the process group, and the activations each rank
held at its peak (measured over the real step's tensors) against one process.
"""

from __future__ import annotations

import math

from autopar.ir import bytes_by_collective
from autopar.testing import PIPELINE_CASES, DistPool, parity_job, pipeline_parity_job, reference_run

import sys

CASES = [
    ("llama", {"dp": 2}, {"dp": "ddp"}, {}),
    ("llama", {"tp": 2}, {"tp": "megatron"}, {}),
    ("llama", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "megatron"}, {}),
    ("hf_llama", {"dp": 2}, {"dp": "ddp"}, {}),
    ("hf_llama", {"tp": 2}, {"tp": "megatron"}, {}),
    ("hf_llama", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "megatron"}, {}),
]
# ZeRO, mixed precision, accumulation, recompute (``--state``)
STATE_CASES = [
    ("llama", {"dp": 2}, {"dp": "zero1"}, {}),
    ("llama", {"dp": 2}, {"dp": "zero2"}, {}),
    ("llama", {"dp": 2}, {"dp": "zero3"}, {}),
    ("llama", {"dp": 4}, {"dp": "zero3"}, {"recompute": "selective"}),
    ("llama", {"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "megatron"}, {}),
    ("llama", {"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "megatron"}, {"accumulate": 2, "recompute": "full"}),
    ("hf_llama", {"dp": 2}, {"dp": "fsdp"}, {"accumulate": 2}),
    ("hf_llama", {"dp": 2}, {"dp": "fsdp"}, {"recompute": "full"}),
    ("llama", {"dp": 2}, {"dp": "ddp"}, {"precision": "bf16"}),
    ("llama", {"dp": 2}, {"dp": "zero2"}, {"precision": "bf16"}),
    ("llama", {"dp": 2}, {"dp": "zero3"}, {"precision": "bf16", "reduce_dtype": "fp32"}),
    ("hf_llama", {"dp": 2}, {"dp": "fsdp"}, {"precision": "bf16", "recompute": "full"}),
    ("llama", {"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "megatron"}, {"precision": "bf16", "accumulate": 2}),
    ("llama", {"dp": 2}, {"dp": "ddp"}, {"precision": "fp16", "loss_scale": 1024.0, "accumulate": 2}),
    ("llama", {"dp": 2}, {"dp": "zero3"}, {"precision": "fp16", "loss_scale": 1024.0}),
]


# sequence / context / expert parallelism (``--strategies``)
STRATEGY_CASES = [
    ("llama", {"tp": 2}, {"tp": "megatron"}, {}),
    ("llama", {"tp": 2}, {"tp": "sequence"}, {}),
    ("hf_llama", {"tp": 2}, {"tp": "sequence"}, {}),
    ("llama", {"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "sequence"}, {}),
    ("llama", {"cp": 2}, {"cp": "ulysses"}, {}),
    ("hf_llama", {"cp": 2}, {"cp": "ulysses"}, {}),
    ("llama", {"dp": 2, "cp": 2}, {"dp": "fsdp", "cp": "ulysses"}, {}),
    ("llama", {"cp": 2}, {"cp": "context"}, {}),
    ("llama", {"cp": 4}, {"cp": "context"}, {}),
    ("hf_llama", {"cp": 2}, {"cp": "context"}, {}),
    ("llama", {"dp": 2, "cp": 2}, {"dp": "fsdp", "cp": "context"}, {}),
    ("moe_dropless", {"ep": 2}, {"ep": "expert"}, {}),
    ("moe_dropless", {"dp": 2, "ep": 2}, {"dp": "fsdp", "ep": "expert"}, {}),
]


def strategies_report(pools):
    print("| model | mesh, plan | max loss diff (3 steps) | max grad diff, all steps | max param diff after 3 AdamW "
          "steps | bytes/rank/step by kind@axis, predicted = counted | activations at the peak, rank 0 | vs one process |")
    print("|---|---|---|---|---|---|---|---|")
    refs, alone = {}, {}
    for name, axes, plan, opts in STRATEGY_CASES:
        ref = refs.setdefault(name, reference_run(name))
        if name not in alone:  # the same model on one rank: its activations at the peak
            alone[name] = pools[1].run(parity_job, name, {"dp": 1}, {"dp": "ddp"}, evaluate=False)["memory"]
        out = pools[math.prod(axes.values())].run(parity_job, name, axes, plan, evaluate=False, **opts)
        dl = max(abs(a - b) for a, b in zip(ref["losses"], out["losses"]))
        dg = max(max((r[k] - o[k]).abs().max().item() for k in r) for r, o in zip(ref["grads"], out["grads"]))
        dp = max((ref["params"][k] - out["params"][k]).abs().max().item() for k in ref["params"])
        pred = bytes_by_collective(out["records"])
        meas = {k: v["wire_bytes"] / out["steps"] for k, v in out["measured"].items()}
        kinds = ", ".join(f"{k} {pred.get(k, 0):,.0f} = {meas.get(k, 0):,.0f}" for k in sorted(set(pred) | set(meas)))
        acts, one = out["memory"]["peak_activations"], alone[name]["peak_activations"]
        print(f"| {name} | {' x '.join(f'{a}={n}' for a, n in axes.items())} {'+'.join(plan.values())} | {dl:.1e} | "
              f"{dg:.1e} | {dp:.1e} | {kinds} | {acts:,} | {acts / one:.2f} |", flush=True)


def cost_report(pools):
    print("| model | mesh, plan, options | program peak predicted | allocator without gloo's buffers (with) | ratio | "
          "op outputs | ratio | step peak predicted | allocator | ratio | persistent predicted = measured | "
          "bytes/rank/step predicted | counted at the process group |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, axes, plan, opts in CASES + STATE_CASES + [("moe", {"dp": 2}, {"dp": "fsdp"}, {})]:
        world = 1
        for v in axes.values():
            world *= v
        out = pools[world].run(parity_job, name, axes, plan, **opts)
        p, m = out["predicted_memory"], out["memory"]
        persistent = [p[k] == m[k] for k in ("parameters", "gradients", "optimizer_state")]
        pred = sum(bytes_by_collective(out["records"]).values())
        meas = sum(v["wire_bytes"] for v in out["measured"].values()) / out["steps"]
        alloc = m["program_peak_without_backend"]
        step = m["parameters"] + m["optimizer_state"] + alloc
        print(f"| {name} | {' x '.join(f'{a}={n}' for a, n in axes.items())} "
              f"{'+'.join(plan.values())} {' '.join(f'{k}={v}' for k, v in opts.items())} | "
              f"{p['program_peak']:,} | {alloc:,} ({m['program_peak']:,}) | {alloc / p['program_peak']:.3f} | "
              f"{m['tensor_peak']:,} | {m['tensor_peak'] / p['program_peak']:.3f} | "
              f"{p['step_peak']:,} | {step:,} | {step / p['step_peak']:.3f} | "
              f"{'yes' if all(persistent) else 'NO'} ({p['parameters'] + p['gradients'] + p['optimizer_state']:,}) | "
              f"{pred:,.0f} | {meas:,.0f} |", flush=True)


def pipeline_report(pools):
    print("| model | mesh, plan, options | M | max loss diff (3 steps) | max grad diff, all steps | max param diff "
          "after 3 AdamW steps | bytes/rank/step predicted = counted (every rank) | activations in flight, "
          "measured (predicted) per pipeline rank |")
    print("|---|---|---|---|---|---|---|---|")
    refs = {}
    for name, axes, plan, opts in PIPELINE_CASES:
        ref = refs.setdefault(name, reference_run(name))
        world = 1
        for v in axes.values():
            world *= v
        out = pools[world].run(pipeline_parity_job, name, axes, plan, **opts)
        dl = max(abs(a - b) for a, b in zip(ref["losses"], out["losses"]))
        dg = max(max((r[k] - o[k]).abs().max().item() for k in r) for r, o in zip(ref["grads"], out["grads"]))
        dp = max((ref["params"][k] - out["params"][k]).abs().max().item() for k in ref["params"])
        equal = all({k: v["wire_bytes"] for k, v in m.items() if v["wire_bytes"]}
                    == {k: v * out["steps"] for k, v in p.items() if v} for m, p in zip(out["measured"], out["predicted"]))
        sent = sum(out["predicted"][0].values())
        ranks = list(range(world))[:: world // axes["pp"]]
        flight = ", ".join(f"{out['in_flight'][r]['peak_microbatches']}: {out['in_flight'][r]['peak_bytes']:,} "
                           f"({out['predicted_in_flight'][r]['peak_bytes']:,})" for r in ranks)
        sched = plan["pp"] if isinstance(plan["pp"], str) else plan["pp"]["schedule"]
        others = "+".join(v for k, v in plan.items() if k != "pp")
        print(f"| {name} | {' x '.join(f'{a}={n}' for a, n in axes.items())} {sched}{'+' + others if others else ''} "
              f"{' '.join(f'{k}={v}' for k, v in opts.items())} | {out['microbatches']} | {dl:.1e} | {dg:.1e} | "
              f"{dp:.1e} | {'yes' if equal else 'NO'} (rank 0: {sent:,.0f}) | {flight} |", flush=True)


def main():
    pools = {2: DistPool(2), 4: DistPool(4)}
    refs = {}
    if "--strategies" in sys.argv:
        pools[1] = DistPool(1)
        try:
            strategies_report(pools)
        finally:
            for p in pools.values():
                p.close()
        return
    if "--cost" in sys.argv:
        try:
            cost_report(pools)
        finally:
            for p in pools.values():
                p.close()
        return
    if "--pipeline" in sys.argv:
        try:
            pipeline_report(pools)
        finally:
            for p in pools.values():
                p.close()
        return
    cases = STATE_CASES if "--state" in sys.argv else CASES
    print("| model | mesh, plan, options | max loss diff (3 steps) | max grad diff, step 0 | max grad diff, all steps "
          "| max param diff after 3 AdamW steps | bytes/rank/step predicted = counted |")
    print("|---|---|---|---|---|---|---|")
    try:
        for name, axes, plan, opts in cases:
            precision = opts.get("precision", "fp32")
            if (name, precision) not in refs:
                refs[(name, precision)] = reference_run(name, precision=precision)
            ref = refs[(name, precision)]
            world = 1
            for v in axes.values():
                world *= v
            out = pools[world].run(parity_job, name, axes, plan, **opts)
            dl = max(abs(a - b) for a, b in zip(ref["losses"], out["losses"]))
            dg = [max((r[k] - o[k]).abs().max().item() for k in r) for r, o in zip(ref["grads"], out["grads"])]
            dp = max((ref["params"][k] - out["params"][k]).abs().max().item() for k in ref["params"])
            pred = sum(bytes_by_collective(out["records"]).values())
            meas = sum(v["wire_bytes"] for v in out["measured"].values()) / out["steps"]
            print(f"| {name} | {' x '.join(f'{a}={n}' for a, n in axes.items())} "
                  f"{'+'.join(plan.values())} {' '.join(f'{k}={v}' for k, v in opts.items())} | {dl:.1e} | {dg[0]:.1e} | {max(dg):.1e} | {dp:.1e} "
                  f"| {pred:,.0f} = {meas:,.0f} |", flush=True)
    finally:
        for p in pools.values():
            p.close()


if __name__ == "__main__":
    main()
