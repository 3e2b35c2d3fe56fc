"""Faults and bad inputs on 2 gloo processes: what every rank raised and how long until it exited.

    .venv/bin/python benchmarks/faults.py [--plans fsdp,pp] [--cases token_one,...] [--timeout 5]
    .venv/bin/python benchmarks/faults.py --overhead [--steps 40]

Each case runs on its own 2 fresh processes (autopar/faults.py ``run_fault_case``): the tiny
Llama compiled under an SPMD plan ({"dp": "fsdp"}, 1 block) or a pipeline ({"pp": "1f1b"}), one
good step, then the fault (FAULT_CASES lists them). Seconds are counted from the fault (the
failing rank's call, or compile for plan errors) to the error each rank raised and to its
process's exit (a process's exit takes about 1-2 s of interpreter teardown here). A case still
running 120 s after it started would be reported as a hang, and killed.

``--overhead``: what the failure mechanism costs a healthy step (autopar/runtime/failure.py):
the same processes alternate steps with ``pm.guard`` on and off (off: the programs' own
functional collectives, unbounded waits, no batch value checks), medians over ``--steps`` each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from autopar.faults import FAULT_CASES, FAULT_PLANS, run_fault_case
from autopar.testing import DistPool, build_model

ORDER = ["token_one", "token_all", "shape_one", "dtype_one", "loss_one", "hang_one", "kill_one", "kill_zero",
         "short_one", "compile_one", "plan_bad", "plan_batch"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(plans, cases, timeout: float) -> None:
    print(f"Faults, 2 gloo ranks, timeout={timeout:g}s, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%dT%H:%M:%S')}; seconds from the fault: raised / process exited.\n")
    print("| plan | case | rank 0 raised (first line) | rank 1 raised (first line) | raised s (r0, r1) | "
          "exited s (r0, r1) | hang? |")
    print("|---|---|---|---|---|---|---|")
    for plan in plans:
        for case in cases:
            t = time.monotonic()
            out = run_fault_case(case, plan, timeout=timeout)
            wall = time.monotonic() - t
            r = out["ranks"]

            def f(v):
                return "-" if v is None else f"{v:.1f}"

            hang = "no" if all(v["exit_s"] is not None for v in r.values()) else "HANG (killed at 120 s)"
            print(f"| {plan} | {case}: {FAULT_CASES[case]} | {_cell(r[0]['said'])} | {_cell(r[1]['said'])} | "
                  f"{f(r[0]['raised_s'])}, {f(r[1]['raised_s'])} | {f(r[0]['exit_s'])}, {f(r[1]['exit_s'])} | "
                  f"{hang} |", flush=True)
            print(f"  ({plan} {case}: {wall:.0f} s wall with spawning and compiling)", file=sys.stderr, flush=True)


def overhead_job(plan_name: str, steps: int, size: str):
    import torch.distributed as dist

    import autopar
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy
    from autopar.runtime import failure

    axes, plan = FAULT_PLANS[plan_name]
    if size == "tiny":
        _, batches, _ = build_model("llama")
        x, y = batches[0]
        cfg = LlamaConfig()
    else:  # dim 256, 4 blocks, batch 8 x 128
        cfg = LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=2048, max_seq_len=128)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg.vocab_size, (8, 128), generator=g)
        y = torch.randint(0, cfg.vocab_size, (8, 128), generator=g)
    torch.manual_seed(0)
    pm = autopar.compile(Llama(cfg), autopar.mesh(**axes), example_inputs=(x, y), loss_fn=cross_entropy, plan=plan,
                         capture_eval=False)
    times = {True: [], False: []}
    for i in range(2 * steps + 4):
        on = i % 2 == 0
        pm.guard = on
        dist.barrier()
        t0 = time.perf_counter()
        pm.train_step(x, y)
        dt = time.perf_counter() - t0
        if i >= 4:  # (warm-up: the guarded copies are made on the first steps)
            times[on].append(dt)
    w = failure.world()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (times, w.store_reads, w.seen))
    return everyone


def overhead(steps: int, plans=("fsdp", "pp"), sizes=("tiny", "medium")) -> None:
    pool = DistPool(2)
    try:
        print(f"Overhead of the failure mechanism per train_step, 2 gloo ranks, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%dT%H:%M:%S')}: the same processes alternate steps guarded / unguarded, "
              f"{steps} of each; medians (ms), rank 0 / rank 1.\n")
        print("| plan | model | guarded | unguarded | difference of the medians | median of paired differences "
              "(each guarded step - the unguarded step after it) | store round trips in the guarded steps |")
        print("|---|---|---|---|---|---|---|")
        for size in sizes:
            for plan in plans:
                out = pool.run(overhead_job, plan, steps, size)
                on = [statistics.median(t[True]) * 1e3 for t, _, _ in out]
                off = [statistics.median(t[False]) * 1e3 for t, _, _ in out]
                reads = [r for _, r, _ in out]
                paired = [statistics.median(a - b for a, b in zip(t[True], t[False])) * 1e3 for t, _, _ in out]
                model = "Llama dim 64, 2 blocks, batch 4x16" if size == "tiny" else \
                    "Llama dim 256, 4 blocks, vocab 2048, batch 8x128"
                print(f"| {FAULT_PLANS[plan][1]} | {model} | {on[0]:.2f} / {on[1]:.2f} | {off[0]:.2f} / {off[1]:.2f} | "
                      f"{on[0] - off[0]:+.2f} / {on[1] - off[1]:+.2f} ({(on[0] / off[0] - 1) * 100:+.1f}% / "
                      f"{(on[1] / off[1] - 1) * 100:+.1f}%) | {paired[0]:+.2f} / {paired[1]:+.2f} | "
                      f"{reads[0]} / {reads[1]} |", flush=True)
    finally:
        pool.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", default="fsdp,pp")
    ap.add_argument("--cases", default=",".join(ORDER))
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sizes", default="tiny,medium", help="--overhead: models (tiny, medium)")
    args = ap.parse_args()
    if args.overhead:
        overhead(args.steps, args.plans.split(","), args.sizes.split(","))
        return
    table(args.plans.split(","), args.cases.split(","), args.timeout)


if __name__ == "__main__":
    main()
