"""Measured per-rank memory and communication for ddp / ZeRO-1/2/3, fp32 and bf16, and the
activation peak and FLOPs of recompute policies, on real gloo process groups.

    .venv/bin/python benchmarks/memory_report.py [--ranks 2 4] [--out benchmarks/memory-DATE.md]

Prints markdown tables (and writes them with --out). Every figure is measured on this machine,
by instruments that do not read autopar's graphs (autopar/runtime/memory.py, measure.py):
persistent state on the tensors each rank holds; parameter copies and gradients in flight on the
storages the programs' ops created, op by op; program peaks from the allocator; FLOPs from
torch's formulas on the ops that ran; bytes where they are handed to the process group.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

PLANS = ("ddp", "zero1", "zero2", "zero3")
# the ZeRO paper's per-parameter bytes (bf16 compute, fp32 Adam) and the fp32 equivalents, as (a, b):
# a + b / N bytes per parameter
PAPER = {"bf16": {"ddp": (16, 0), "zero1": (4, 12), "zero2": (2, 14), "zero3": (0, 16)},
         "fp32": {"ddp": (16, 0), "zero1": (8, 8), "zero2": (4, 12), "zero3": (0, 16)}}


def state_job(precision: str, name: str = "llama"):
    import autopar
    from autopar.testing import build_model

    out = {}
    for plan in PLANS:
        model, batches, loss_fn = build_model(name)
        psi = sum(p.numel() for p in model.parameters())
        pm = autopar.compile(model, autopar.mesh(dp=-1), example_inputs=batches[0], loss_fn=loss_fn,
                             plan={"dp": plan}, precision=precision)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        pm.train_step(*batches[0])
        opt.step()
        opt.zero_grad()
        pm.track_memory()
        pm.counter.reset()
        pm.train_step(*batches[1])
        out[plan] = {**pm.memory_report(opt), "psi": psi,
                     "bytes": sum(v["wire_bytes"] for v in pm.counter.summary().values())}
        opt.step()
    return out


def recompute_job(name: str = "llama_deep"):
    import autopar
    from autopar.testing import build_model

    out = {}
    for policy in ("none", "selective", "full"):
        model, batches, loss_fn = build_model(name)
        pm = autopar.compile(model, autopar.mesh(dp=-1), example_inputs=batches[0], loss_fn=loss_fn,
                             plan={"dp": "ddp"}, recompute=policy)
        pm.track_memory()
        pm.train_step(*batches[0])
        out[policy] = {**pm.memory_report(), "recomputed": pm.program.recomputed}
    return out


def main(argv=None):
    from autopar.testing import DistPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lines = [f"# Memory and communication per rank, measured ({datetime.date.today()}, torch {torch.__version__}, "
             f"CPU gloo)", "",
             "Model: built-in Llama (2 layers, dim 64, vocab 256; Psi = parameters), batch 4 x 16, AdamW. "
             "Bytes per parameter = measured bytes / Psi. *Persistent* = parameters + gradients + optimizer "
             "state as stored between steps (fp32 master, fp32 .grad, exp_avg, exp_avg_sq). "
             "*Peak model states* adds the most parameter copies + gradients in flight the program held at "
             "once during the step (gathered / cast parameters, whole gradients before their reduction; "
             "measured on the storages the programs' ops created).", ""]
    lines += ["| precision | N | plan | persistent B/param | ours: 16/N or 16 | paper (a + b/N) | "
              "max param copies B/param | max grads in flight B/param | peak model states B/param | "
              "bytes sent / step | vs ddp |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in args.ranks:
        pool = DistPool(n)
        try:
            for precision in ("fp32", "bf16"):
                res = pool.run(state_job, precision)
                ddp_bytes = res["ddp"]["bytes"]
                for plan in PLANS:
                    m = res[plan]
                    psi = m["psi"]
                    persistent = (m["parameters"] + m["gradients"] + m["optimizer_state"]) / psi
                    ours = 16 if plan == "ddp" else 16 / n
                    a, b = PAPER[precision][plan]
                    lines.append(
                        f"| {precision} | {n} | {plan} | {persistent:.2f} | {ours:.2f} "
                        f"({100 * (persistent / ours - 1):+.1f}%) | {a + b / n:.2f} | "
                        f"{m['max_param_copies'] / psi:.2f} | {m['max_grads_in_flight'] / psi:.2f} | "
                        f"{m['model_states_peak'] / psi:.2f} | {m['bytes']:,.0f} | {m['bytes'] / ddp_bytes:.2f} |")
                print("\n".join(lines[-4:]), file=sys.stderr)
            if n == args.ranks[0]:
                rec = pool.run(recompute_job)
        finally:
            pool.close()
    lines += ["", f"## Activation checkpointing (llama_deep: 8 layers, seq 128, batch 4, dp={args.ranks[0]})", "",
              "| recompute | values recomputed | program peak, allocator (B) | activations at the op outputs' peak (B) "
              "| FLOPs / step | "
              "vs none: peak | vs none: FLOPs |", "|---|---|---|---|---|---|---|"]
    base = rec["none"]
    for policy, m in rec.items():
        lines.append(f"| {policy} | {m['recomputed']} | {m['program_peak']:,} | {m['peak_activations']:,} | "
                     f"{m['flops_per_step']:,.0f} | {m['program_peak'] / base['program_peak']:.2f} | "
                     f"{m['flops_per_step'] / base['flops_per_step']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
