"""Where the GPU waits for the host in one training step, autopar `inductor=True` beside torch.compile.

gpu_check.py's kernel profile of the 0.5B Llama step (runs 5 and 6 of 2026-11-27) put autopar's
kernels at 0.954x torch.compile's device time, but its step at 0.970x: autopar's step leaves the
GPU idle about 5 ms, torch.compile's about 3.7. This script finds those idle stretches. For each
side it runs the step (2 warm-up steps), then one step under torch.profiler with the host's ops
and the device's kernels on one timeline; it merges the kernels' intervals, lists every gap
between them longer than ``--min-gap-us`` (the step's start to its first kernel included), and
names the host ops that overlap each gap most. The profiler's own per-op cost lengthens the host's
side: compare the two systems, not the figures with an unprofiled step's. Writes DIR/gaps.json
and DIR/gaps.md.

    . benchmarks/gpu_env.sh && python3 benchmarks/gpu_gaps.py --out DIR [--optimizer adamw-fused] [--smoke]

``--smoke`` runs the tiny Llama on this CPU: no device kernels, so no gaps; a check of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402  (the step's model, batches, config and the two sides' steps)


def _profile_step(step, cuda: bool) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        with record_function("## step"):
            step()
            if cuda:
                torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    step_ev = next(e for e in host if e.name == "## step")
    t0, t1 = step_ev.time_range.start, step_ev.time_range.end
    merged: list[list[float]] = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    gaps = []
    if merged:
        gaps.append((t0, merged[0][0]))  # the step's start to its first kernel
        gaps += [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
    return {"t0": t0, "t1": t1, "busy_us": sum(b - a for a, b in merged), "gaps": gaps, "host": host}


def _named(a: float, b: float, host, limit: int = 6) -> list[str]:
    """The host ops that overlap the gap [a, b] most, with the microseconds of each inside it (the
    step's own range left out; an op's parent ranges are listed too)."""
    inside = [(min(b, e.time_range.end) - max(a, e.time_range.start), e.name) for e in host
              if e.name != "## step" and e.time_range.start < b and e.time_range.end > a]
    inside.sort(reverse=True)
    return [f"{name[:70]} {us:.0f}" for us, name in inside[:limit]]


def side(cfg, system: str, optimizer: str, min_gap_us: float) -> dict:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model, batches = gpu_check._build(cfg, device)
    out: dict = {}
    if system == "autopar-inductor":
        row = gpu_check.device_row(torch.cuda.get_device_name() if cuda else None)
        step = gpu_check._autopar_step(model, batches, "off", True, out, row, lambda s: None, None, optimizer)
    else:
        step = gpu_check._torch_step(model, device, True, optimizer)
    i = [0]

    def one():
        x, y = batches[i[0] % len(batches)]
        i[0] += 1
        return step(x, y).item()  # (each step ends on its loss, as gpu_check times it)
    for _ in range(3):
        one()
    r = _profile_step(one, cuda)
    big = sorted(((b - a, a) for a, b in r["gaps"] if b - a >= min_gap_us), reverse=True)
    return {"system": system, "step_us": r["t1"] - r["t0"], "kernels_busy_us": r["busy_us"],
            "idle_us": sum(b - a for a, b in r["gaps"]), "gaps_over_min": len(big),
            "idle_in_gaps_over_min_us": sum(d for d, _ in big),
            "largest": [{"us": round(d, 1), "at_us": round(a - r["t0"], 1), "host": _named(a, a + d, r["host"])}
                        for d, a in big[:25]]}


def summary(res: dict) -> str:
    lines = [f"# The GPU waiting for the host in one step: {res['device']}, {res['date']}", "",
             f"torch {res['torch']}; model {res['model']}, batch {res['batch']} x {res['seq']}, bf16, "
             f"{res['optimizer']}; gaps of at least {res['min_gap_us']:g} us listed", "",
             "| system | step ms (profiled) | kernels busy ms | idle ms | gaps >= min | idle in them ms |",
             "|---|---|---|---|---|---|"]
    for s in res["sides"]:
        lines.append(f"| {s['system']} | {s['step_us'] / 1e3:.1f} | {s['kernels_busy_us'] / 1e3:.1f} | "
                     f"{s['idle_us'] / 1e3:.2f} | {s['gaps_over_min']} | {s['idle_in_gaps_over_min_us'] / 1e3:.2f} |")
    for s in res["sides"]:
        lines += ["", f"## {s['system']}: the largest gaps", "", "| us | at us | host ops overlapping it most (us inside the gap) |",
                  "|---|---|---|"]
        lines += [f"| {g['us']:.0f} | {g['at_us']:.0f} | {'; '.join(g['host'])} |" for g in s["largest"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--optimizer", choices=("adamw", "adamw-fused"), default="adamw")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg = gpu_check.config(args.smoke)
    cuda = torch.cuda.is_available()
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "model": cfg.model, "batch": cfg.batch, "seq": cfg.seq, "optimizer": args.optimizer,
           "min_gap_us": args.min_gap_us, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "sides": []}
    for system in ("autopar-inductor", "compile"):
        res["sides"].append(side(cfg, system, args.optimizer, args.min_gap_us))
        with open(os.path.join(args.out, "gaps.json"), "w") as f:
            json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "gaps.md"), "w") as f:
        f.write(summary(res))
    print(summary(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
