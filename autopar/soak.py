"""Soak: many steps of one program, and what the process holds along the way (benchmarks/soak.py,
tests/test_soak.py).

``soak_job`` runs on every rank of a DistPool: the small Llama under an SPMD or pipeline plan,
AdamW, a different batch every step (a cycle of 16), optionally a checkpoint every so often;
at the marked steps each rank samples its resident memory (/proc/self/statm), open file
descriptors (/proc/self/fd), Python threads (``threading.active_count()``) and the process's
threads (/proc/self/status ``Threads``: gloo's and torch's own included). Rank 0 returns every
rank's samples.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import warnings

import torch

SOAK_PLANS = {"fsdp": ({"dp": 2}, {"dp": "fsdp"}), "1f1b": ({"pp": 2}, {"pp": "1f1b"})}
PAGE = os.sysconf("SC_PAGE_SIZE")


def process_stats() -> dict:
    """This process now: resident bytes, open fds, Python threads, OS threads."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * PAGE
    with open("/proc/self/status") as f:
        os_threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return {"rss": rss, "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "os_threads": os_threads}


def soak_job(plan_name: str, steps: int, marks: list[int], n_layers: int = 2, ckpt: str | None = None,
             ckpt_every: int = 0) -> dict:
    import torch.distributed as dist

    import autopar
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy

    axes, plan = SOAK_PLANS[plan_name]
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layers=n_layers)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(16):
        x = torch.randint(0, cfg.vocab_size, (8, 32), generator=g)
        batches.append((x, torch.roll(x, -1, dims=1)))
    t0 = time.perf_counter()
    pm = autopar.compile(Llama(cfg), autopar.mesh(**axes), example_inputs=batches[0], loss_fn=cross_entropy,
                         plan=plan, capture_eval=False)
    compile_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    manager = autopar.CheckpointManager(ckpt, keep=2) if ckpt and ckpt_every else None
    samples, times, losses, straggles = {0: process_stats()}, [], [], 0
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", autopar.StragglerWarning)
        for i in range(1, steps + 1):
            t = time.perf_counter()
            loss = pm.train_step(*batches[i % len(batches)])
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
            if i % 50 == 0 or i == steps:
                losses.append((i, loss.item()))
            if manager is not None and i % ckpt_every == 0:
                manager.save(pm, optimizer=opt, extra={"step": i})
            if i in marks:
                samples[i] = process_stats()
        straggles = sum(w.category is autopar.StragglerWarning for w in got)
    mine = {"samples": samples, "compile_s": compile_s, "step_ms": statistics.median(times) * 1e3,
            "losses": losses, "straggler_warnings": straggles}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return {"plan": plan_name, "steps": steps, "ranks": out}


def verdict(result: dict, warmup: int, rss_growth: float = 0.05) -> list[str]:
    """What grew after ``warmup`` steps, per rank (empty: nothing did): resident memory by more
    than ``rss_growth``, open fds or threads at all."""
    bad = []
    for r, rank in enumerate(result["ranks"]):
        s = rank["samples"]
        base = s[warmup]
        last = s[max(s)]
        if last["rss"] > base["rss"] * (1 + rss_growth):
            bad.append(f"{result['plan']} rank {r}: resident memory grew {base['rss'] / 2**20:.1f} -> "
                       f"{last['rss'] / 2**20:.1f} MiB (+{100 * (last['rss'] / base['rss'] - 1):.1f}%) after step {warmup}")
        for k in ("fds", "threads", "os_threads"):
            if max(v[k] for i, v in s.items() if i >= warmup) > base[k]:
                bad.append(f"{result['plan']} rank {r}: {k} grew after step {warmup}: "
                           + ", ".join(f"{i}: {v[k]}" for i, v in sorted(s.items())))
    return bad
