"""autopar with inductor=True against autopar's uncompiled programs, in the same gloo processes,
alternating step by step on the same batches (the bench model, autopar/tools/bench.py).

    python benchmarks/inductor_vs_eager.py [--ranks 2] [--pairs ddp fsdp] [--steps 12] [--warmup 3]

Prints, per plan: the median step time of each, the median of the paired per-step ratios
(compiled / uncompiled), the collective calls per step of each (the meter at the process group)
and the losses' largest difference.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def job(pair: str, steps: int, warmup: int, batch: int, seq: int) -> dict:
    from autopar.models.zoo import random_batches
    from autopar.runtime.measure import CommMeter, timed
    from autopar.tools.bench import bench_model, build_autopar

    world = dist.get_world_size()
    _, vocab, _ = bench_model()
    data = random_batches(vocab, 4, batch, seq)
    systems = {name: build_autopar(pair, world, data[0], compiled=name == "inductor")
               for name in ("eager", "inductor")}
    times = {k: [] for k in systems}
    losses = {k: [] for k in systems}
    for i in range(warmup + steps):
        order = list(systems.items()) if i % 2 == 0 else list(reversed(systems.items()))
        for name, (step, _, _) in order:
            loss, dt = timed(step, *data[i % len(data)])
            losses[name].append(float(loss))
            if i >= warmup:
                times[name].append(dt)
    calls = {}
    for name, (step, _, _) in systems.items():
        with CommMeter() as meter:
            step(*data[0])
        calls[name] = dict(meter.calls)
    return {"times": times, "losses": losses, "calls": calls,
            "compile_s": systems["inductor"][0].compile_s, "inductor": systems["inductor"][0].inductor}


def main():
    from autopar.testing import DistPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pairs", nargs="+", default=["ddp", "fsdp"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    pool = DistPool(args.ranks)
    try:
        for pair in args.pairs:
            r = pool.run(job, pair, args.steps, args.warmup, args.batch, args.seq)
            e, c = r["times"]["eager"], r["times"]["inductor"]
            paired = statistics.median(x / y for x, y in zip(c, e))
            diff = max(abs(a - b) for a, b in zip(r["losses"]["eager"], r["losses"]["inductor"]))
            print(f"{pair} dp={args.ranks}: uncompiled {statistics.median(e) * 1e3:.0f} ms, inductor "
                  f"{statistics.median(c) * 1e3:.0f} ms, paired ratio {paired:.2f}; calls/step uncompiled "
                  f"{r['calls']['eager']}, inductor {r['calls']['inductor']}; max loss diff {diff:.1e}; "
                  f"compile {r['compile_s']:.1f}s; {r['inductor']}")
    finally:
        pool.close()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
