"""Soak: 1,000 steps of a 2-rank FSDP program and of a 2-stage 1F1B pipeline (the small Llama,
AdamW, a checkpoint every 250 steps), sampling every rank's resident memory, open file
descriptors and threads at steps 100, 250, 500, 750 and 1000. Exits 1 if, after the warm-up
(step 100), resident memory grew more than 5% or any fd / thread count grew at all.

    .venv/bin/python benchmarks/soak.py [--steps 1000] [--plans fsdp,1f1b] [--no-checkpoints]

The job itself: autopar/soak.py (tests/test_soak.py runs 60 steps of it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from autopar.soak import soak_job, verdict
from autopar.testing import DistPool


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--plans", default="fsdp,1f1b")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=250)
    ap.add_argument("--no-checkpoints", action="store_true")
    args = ap.parse_args()
    marks = sorted({m for m in (args.warmup, 250, 500, 750, args.steps) if m <= args.steps})
    every = 0 if args.no_checkpoints else args.ckpt_every
    print(f"Soak, 2 gloo ranks, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%M:%S')}: Llama (2 blocks, "
          f"dim 64, vocab 256), batch 8x32, AdamW, {args.steps} steps"
          + (f", a checkpoint every {every} steps (CheckpointManager, keep=2)" if every else "") + ".\n")
    print("| plan | rank | " + " | ".join(f"step {m}" for m in marks) + " |")
    print("|---|---|" + "---|" * len(marks))
    bad, notes = [], []
    for plan in args.plans.split(","):
        pool = DistPool(2)
        t = time.monotonic()
        try:
            with tempfile.TemporaryDirectory() as ckpt:
                res = pool.run(soak_job, plan, args.steps, marks, ckpt=ckpt, ckpt_every=every)
        finally:
            pool.close()
        for r, rank in enumerate(res["ranks"]):
            s = rank["samples"]
            cells = [f"{s[m]['rss'] / 2**20:.1f} MiB, {s[m]['fds']} fds, {s[m]['threads']} / {s[m]['os_threads']} "
                     "threads" for m in marks]
            print(f"| {plan} | {r} | " + " | ".join(cells) + " |", flush=True)
            notes.append(f"{plan} rank {r}: compiled in {rank['compile_s']:.1f} s, median step {rank['step_ms']:.1f} ms, "
                         f"loss {rank['losses'][0][1]:.4f} at step {rank['losses'][0][0]} -> {rank['losses'][-1][1]:.4f} "
                         f"at step {rank['losses'][-1][0]}, StragglerWarnings {rank['straggler_warnings']}, "
                         f"resident at step 0 (after compile) {s[0]['rss'] / 2**20:.1f} MiB")
        notes.append(f"{plan}: {time.monotonic() - t:.0f} s wall with spawning and compiling")
        bad += verdict(res, args.warmup)
    print("\nthreads: Python's threading.active_count() / the process's (/proc/self/status: gloo's and torch's "
          "own included).\n")
    for n in notes:
        print(f"- {n}")
    print("\n" + ("FAIL:\n" + "\n".join(f"- {b}" for b in bad) if bad else
                  f"PASS: after step {args.warmup} no rank's resident memory grew more than 5%, and no fd or "
                  "thread count grew."))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
