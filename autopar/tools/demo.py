"""The main job: compile the built-in Llama on a 2x2 CPU mesh (4 gloo processes; FSDP on dp,
Megatron on tp), train a few steps, and print the plan, the collectives, the losses, the bytes
moved and the memory each rank held; then the same model and data as a 2-stage 1F1B pipeline
over 2-way FSDP (its stages, bytes, measured schedule and activations in flight).

    python -m autopar.tools.demo [--steps 5] [--dp 2] [--tp 2] [--dp-plan fsdp] [--no-pipeline]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from autopar.runtime.common import local_tensor


def demo_job(axes: dict, steps: int, dp_plan: str = "fsdp") -> str:
    import autopar
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy

    mesh = autopar.mesh(**axes)
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layers=2)
    model = Llama(cfg)
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, cfg.vocab_size, (8, 32), generator=g) for _ in range(steps)]
    data = [(x, torch.roll(x, -1, dims=1)) for x in tokens]
    plan = {"dp": dp_plan, "tp": "megatron"}
    plan = {a: plan.get(a, dp_plan) for a in axes}
    t0 = time.perf_counter()
    pm = autopar.compile(model, mesh, example_inputs=data[0], loss_fn=cross_entropy, plan=plan)
    compile_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    losses, times = [], []
    pm.counter.reset()
    pm.measure()  # count the bytes each rank hands to the process group (a dispatch mode: slower steps)
    for i, (x, y) in enumerate(data):
        if i == len(data) - 1:
            pm.track_memory()  # measure the last step's memory (the allocator, and the tensors op by op)
        t = time.perf_counter()
        loss = pm.train_step(x, y)
        opt.step()
        if i == len(data) - 1:
            mem = pm.memory_report(opt)
            from autopar.analysis.cost import predict_memory

            predicted_mem = predict_memory(pm)
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    out = [f"compiled {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters) "
           f"for mesh {axes} with plan {plan} in {compile_s:.1f}s", "", "parameter placements (rank 0):"]
    for name, p in pm.named_parameters():
        out.append(f"  {name:44s} {str(list(p.shape)):>12s} -> {str(pm.ctx.placed.placements[name]):40s} "
                   f"local {list(local_tensor(p).shape)}")
    groups: dict[tuple, list] = defaultdict(list)
    for r in pm.collectives():
        why = ("gradient sync" if r.reason.startswith("gradient of") else
               r.reason.split(":")[0] + " parameter gather" if r.reason.startswith("ZeRO") else
               "inside rule: " + r.reason.split(": ", 1)[1] if r.reason.startswith("inside rule") else
               "activation " + r.reason.split(" for ")[0])
        groups[(r.phase, r.kind, r.axis, why)].append(r)
    out += ["", f"collectives in the per-rank program ({len(pm.collectives())} per step):",
            f"  {'phase':8s} {'kind':11s} {'axis':4s} {'count':>5s} {'bytes/rank':>11s}  why (first source line)"]
    for (phase, kind, axis, why), rs in groups.items():
        out.append(f"  {phase:8s} {kind:11s} {axis:4s} {len(rs):5d} {sum(r.payload_bytes for r in rs):11,d}  "
                   f"{why}  [{rs[0].source.split('  ')[0]}]")
    out += ["", "training:"]
    for i, (l, t) in enumerate(zip(losses, times)):
        out.append(f"  step {i}: loss {l:.4f}  ({t * 1000:.0f} ms, bytes counted"
                   f"{', memory tracked' if i == steps - 1 else ''})")
    backend = mem["program_peak"] - (mem["program_peak_without_backend"] or mem["program_peak"])
    out += ["", "memory on rank 0, measured (bytes):",
            f"  stored: parameters {mem['parameters']:,}  gradients {mem['gradients']:,}  "
            f"optimizer state {mem['optimizer_state']:,}",
            f"  step peak {mem['step_peak']:,} = parameters + optimizer state + the allocator's peak during the step "
            f"{mem['program_peak']:,} (of which the process group's own buffers {backend:,})",
            f"  the programs' tensors at their peak, op by op: {mem['tensor_peak']:,} = gathered parameters "
            f"{mem['peak_param_copies']:,} + gradients in flight {mem['peak_grads_in_flight']:,} + activations "
            f"{mem['peak_activations']:,}", f"  FLOPs per step on this rank: {mem['flops_per_step']:,.0f}",
            f"  the cost model predicted a step peak of {predicted_mem['step_peak']:,} "
            f"({predicted_mem['step_peak'] / mem['step_peak']:.4f} x the allocator's; `autopar plan` shows it "
            "before running)"]
    predicted = {k: v * steps for k, v in pm.predicted_bytes().items()}
    out += ["", f"bytes sent per rank over {steps} steps (ring model), predicted by the compiler vs counted at the "
            "process group (every c10d call):"]
    for k, v in pm.counter.summary().items():
        out.append(f"  {k:18s} predicted {predicted[k]:12,.0f}   counted {v['wire_bytes']:12,.0f}   "
                   f"({v['calls']} calls)")
    return "\n".join(out), losses, data


def pipeline_demo_job(steps: int, data) -> tuple[str, list[float]]:
    """The same model and data as a 2-stage 1F1B pipeline x 2-way FSDP (pp=2 x dp=2)."""
    import torch.distributed as dist

    import autopar
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy
    from autopar.tools.pipebench import measured_bubble
    from autopar.analysis.schedules import simulate

    mesh = autopar.mesh(pp=2, dp=2)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=2))
    plan = {"pp": {"schedule": "1f1b", "microbatches": 4}, "dp": "fsdp"}
    t0 = time.perf_counter()
    pm = autopar.compile(model, mesh, example_inputs=data[0], loss_fn=cross_entropy, plan=plan)
    compile_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    losses = []
    pm.counter.reset()
    for i, (x, y) in enumerate(data):
        with pm.measure(i == 0):  # bytes counted on the first step (the meter slows every op it sees)
            losses.append(pm.train_step(x, y).item())
        opt.step()
        opt.zero_grad()
    timeline = pm.gather_timeline()
    flight = [None] * dist.get_world_size()
    dist.all_gather_object(flight, (pm.in_flight, pm.predicted_in_flight()))
    out = [f"compiled the same Llama for mesh {{'pp': 2, 'dp': 2}} with plan {plan} in {compile_s:.1f}s", "",
           pm.report(), "", "training (loss of the global batch, reported on every rank):",
           "  losses " + " ".join(f"{v:.4f}" for v in losses)]
    bubble, span = measured_bubble(timeline)
    sim = simulate(pm.schedule)
    out += ["", f"last step's schedule, measured on pipeline 0 (ranks 0 and 2): {span * 1e3:.0f} ms, bubble "
            f"{bubble:.1%} (simulated with F=1, B=2: {sim.bubble:.1%})"]
    for r, ev in enumerate(timeline):
        out.append(f"  pp rank {r}: " + " ".join(f"{k}{mb}@{a * 1e3:.0f}-{b * 1e3:.0f}ms" for a, b, (k, _, mb) in ev))
    out.append("activations in flight per rank (micro-batches, bytes): measured "
               + ", ".join(f"{m['peak_microbatches']} / {m['peak_bytes']:,}" for m, _ in flight)
               + "; predicted " + ", ".join(f"{p['peak_microbatches']} / {p['peak_bytes']:,}" for _, p in flight))
    return "\n".join(out), losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dp-plan", default="fsdp", choices=["ddp", "zero1", "zero2", "zero3", "fsdp"])
    ap.add_argument("--no-pipeline", action="store_true", help="skip the pp=2 x dp=2 pipeline part")
    args = ap.parse_args(argv)
    from autopar.testing import DistPool

    axes = {k: v for k, v in (("dp", args.dp), ("tp", args.tp)) if v > 1} or {"dp": 1}
    world = 1
    for v in axes.values():
        world *= v
    print(f"autopar demo: spawning {world} gloo processes on this machine...", flush=True)
    pool = DistPool(world)
    try:
        text, losses, data = pool.run(demo_job, axes, args.steps, args.dp_plan)
        print(text)
        pp_text, pp_losses = (pool.run(pipeline_demo_job, args.steps, data) if world == 4 and not args.no_pipeline
                              else (None, None))
    finally:
        pool.close()
    # the same steps on one process, eager PyTorch, for comparison
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref = []
    for x, y in data:
        loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    print("\nsingle-process eager PyTorch, same init and data:")
    print("  losses " + " ".join(f"{v:.4f}" for v in ref))
    diff = max(abs(a - b) for a, b in zip(ref, losses))
    print(f"  max |loss difference| vs autopar: {diff:.2e}")
    if pp_text is not None:
        print("\n" + "=" * 100 + "\npipeline: the same model and data on pp=2 x dp=2 (4 processes)\n" + "=" * 100)
        print(pp_text)
        print(f"  max |loss difference| vs single-process eager: {max(abs(a - b) for a, b in zip(ref, pp_losses)):.2e}")


if __name__ == "__main__":
    main()
