"""Where a step's time goes: autopar ``{"dp": "ddp"}`` against ``DistributedDataParallel`` in the
same gloo processes, alternating step by step from the same initialization on the same batches
(the systems of ``autopar bench``, autopar/tools/bench.py).

    python benchmarks/ddp_breakdown.py [--model hf-qwen2-small] [--ranks 2] [--steps 20] [--profiled 6]

Two measurements, both taken on every rank and reported for rank 0 (the slowest rank sets the
step: ``timed`` puts a barrier before and after):

1. Phases by the wall clock (no profiler), medians over ``--steps`` alternating steps: forward +
   backward + gradient all-reduce (autopar: ``pm.train_step``; DDP: ``model(x)`` + loss, then
   ``loss.backward()``), the global loss (DDP's side all-reduces it, as autopar reports it),
   ``AdamW.step`` and ``zero_grad``.
2. The same steps under ``torch.profiler`` (``--profiled`` steps each, alternating): the CPU time
   of every ATen op by its own (self) time, grouped: matmuls, attention, the collectives and their
   waits, the optimizer's ops, every other op; the number of ops dispatched; and what is left of
   the step's wall time (Python between the ops: the per-rank program's generated code, the
   module's forward, autograd's engine, hooks).

The two systems' losses are printed side by side (same model, same data: they must agree).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

GROUPS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("collective", ("c10d", "allreduce", "all_reduce", "wait_tensor", "gloo", "broadcast", "barrier")),
)


def _group(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k in low for k in keys):
            return g
    return "other"


def _optimizer(opt, t: dict) -> dict:
    t0 = time.perf_counter()
    opt.step()
    t["optimizer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.zero_grad()
    t["zero_grad"] = time.perf_counter() - t0
    return t


def _phased_autopar(pm, opt):
    def step(x, y):
        t = {}
        t0 = time.perf_counter()
        loss = pm.train_step(x, y)
        t["fwd+bwd+sync"] = time.perf_counter() - t0
        t["loss"] = 0.0  # (train_step returns the global loss: inside fwd+bwd+sync)
        return loss, _optimizer(opt, t)
    return step


def _phased_ddp(model, opt, loss_fn, world):
    from autopar.tools.bench import _logits

    rank = dist.get_rank()

    def step(x, y):
        t = {}
        rows = x.shape[0] // world
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        t0 = time.perf_counter()
        loss = loss_fn(_logits(model(x)), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        t["forward"], t["backward+sync"] = t1 - t0, t2 - t1
        t["fwd+bwd+sync"] = t2 - t0
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world
        t["loss"] = time.perf_counter() - t2
        return loss, _optimizer(opt, t)
    return step


def job(model_name: str, steps: int, warmup: int, profiled: int, batch: int, seq: int, options: dict) -> dict:
    import autopar
    from autopar.models.zoo import random_batches
    from autopar.tools.bench import bench_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = dist.get_world_size()
    model, vocab, loss_fn = bench_model(model_name)
    data = random_batches(vocab, 4, batch, seq)
    pm = autopar.compile(model, autopar.mesh(dp=world), example_inputs=data[0], loss_fn=loss_fn,
                         plan={"dp": "ddp"}, capture_eval=False, **options)
    opt_a = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    base, _, _ = bench_model(model_name)
    ddp = DDP(base, broadcast_buffers=False)
    opt_b = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    systems = {"autopar": _phased_autopar(pm, opt_a), "DDP": _phased_ddp(ddp, opt_b, loss_fn, world)}
    phases = {k: [] for k in systems}
    walls = {k: [] for k in systems}
    losses = {k: [] for k in systems}
    for i in range(warmup + steps):
        for name, step in (systems.items() if i % 2 == 0 else reversed(list(systems.items()))):
            dist.barrier()
            t0 = time.perf_counter()
            loss, t = step(*data[i % len(data)])
            dist.barrier()
            wall = time.perf_counter() - t0
            losses[name].append(float(loss))
            if i >= warmup:
                phases[name].append(t)
                walls[name].append(wall)
    out = {"world": world, "walls": walls, "losses": losses,
           "phases": {k: {p: statistics.median(t[p] for t in v) for p in v[0]} for k, v in phases.items()}}

    from torch.profiler import ProfilerActivity, profile

    prof = {}
    for name in systems:
        prof[name] = {"self_us": {}, "ops": 0, "wall_us": 0.0}
    for i in range(2 * profiled):
        name = list(systems)[i % 2]
        step = systems[name]
        x, y = data[i % len(data)]
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as p:
            t0 = time.perf_counter()
            step(x, y)
            wall = time.perf_counter() - t0
        dist.barrier()
        rec = prof[name]
        rec["wall_us"] += wall * 1e6
        for e in p.key_averages():
            if e.key.startswith("aten::") or e.key.startswith("c10d") or "gloo" in e.key or "_c10d" in e.key:
                g = _group(e.key)
                rec["self_us"][g] = rec["self_us"].get(g, 0.0) + e.self_cpu_time_total
                rec["ops"] += e.count
                if g == "other":
                    rec.setdefault("top_other", {})
                    rec["top_other"][e.key] = rec["top_other"].get(e.key, 0.0) + e.self_cpu_time_total
    for rec in prof.values():
        for k in rec["self_us"]:
            rec["self_us"][k] /= profiled
        rec["ops"] //= profiled
        rec["wall_us"] /= profiled
        rec["top_other"] = dict(sorted(((k, v / profiled) for k, v in rec.get("top_other", {}).items()),
                                       key=lambda kv: -kv[1])[:12])
    out["profile"] = prof
    return out


def main():
    from autopar.testing import DistPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="hf-qwen2-small")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profiled", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=25)
    ap.add_argument("--skip", nargs="*", default=[], help="autopar.compile(skip_passes=...), e.g. masks")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    pool = DistPool(args.ranks)
    try:
        r = pool.run(job, args.model, args.steps, args.warmup, args.profiled, args.batch, args.seq,
                     {"bucket_mb": args.bucket_mb, "skip_passes": tuple(args.skip)})
    finally:
        pool.close()
    a, b = r["walls"]["autopar"], r["walls"]["DDP"]
    print(f"{args.model}, dp={args.ranks}{', skip_passes=' + str(args.skip) if args.skip else ''}, global batch {args.batch} x {args.seq}: step autopar "
          f"{statistics.median(a) * 1e3:.1f} ms, DDP {statistics.median(b) * 1e3:.1f} ms, ratio "
          f"{statistics.median(a) / statistics.median(b):.3f}, paired {statistics.median(x / y for x, y in zip(a, b)):.3f}")
    diff = max(abs(x - y) for x, y in zip(r["losses"]["autopar"], r["losses"]["DDP"]))
    print(f"largest loss difference {diff:.1e}")
    print("\nphases (wall clock, medians, ms):")
    names = sorted(set(r["phases"]["autopar"]) | set(r["phases"]["DDP"]))
    for k in names:
        print(f"  {k:16s} autopar {r['phases']['autopar'].get(k, float('nan')) * 1e3:8.1f}   "
              f"DDP {r['phases']['DDP'].get(k, float('nan')) * 1e3:8.1f}")
    print(f"\nprofiled ({args.profiled} steps each, per step, ms of CPU self time on rank 0):")
    pa, pb = r["profile"]["autopar"], r["profile"]["DDP"]
    for g in ("matmul", "attention", "collective", "other"):
        print(f"  {g:16s} autopar {pa['self_us'].get(g, 0) / 1e3:8.1f}   DDP {pb['self_us'].get(g, 0) / 1e3:8.1f}")
    for name, rec in (("autopar", pa), ("DDP", pb)):
        ops = sum(rec["self_us"].values())
        print(f"  {name}: wall {rec['wall_us'] / 1e3:.1f} ms, ops {ops / 1e3:.1f} ms, outside the ops "
              f"{(rec['wall_us'] - ops) / 1e3:.1f} ms; {rec['ops']} ops dispatched")
    for name, rec in (("autopar", pa), ("DDP", pb)):
        print(f"  {name} 'other' by op: " + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in rec["top_other"].items()))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
