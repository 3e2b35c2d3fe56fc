"""plan="auto" against the wall clock and the allocator: every valid plan the search considered,
run on 4 gloo processes of this machine, measured, and compared with the search's prediction.

    .venv/bin/python benchmarks/planner_measured.py [--models llama,hf] [--steps 6] [--device cpu] [-o FILE]

For each model (the project's Llama at 4 layers, dim 256, and Hugging Face LlamaForCausalLM at
the same shape): ``planner.search`` on 4 ranks with a device row measured by ``autopar calibrate``
at the start of the run, on this machine, its all-reduce among 4 processes (4 ranks share the 2
cores; ``--device cpu`` uses the stored row instead, calibrated on 2026-11-22) and a memory budget, every candidate confirmed by a compile
(``confirm_top`` = all). Then each candidate is compiled and trained on a 4-rank gloo pool: the
median step time (max over ranks) and the step peak (parameters + AdamW state + the allocator's
peak in the step, max over ranks). Reported: the auto choice against the best measured plan,
Spearman's rho between predicted and measured step times, and whether any plan under the budget
by prediction went over it when measured. The search space is cut to what runs in minutes here:
recompute none, micro-batch 1, 1F1B.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

MODELS = {
    "llama": ("llama-small", dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768)),
    "hf": ("hf-llama-tiny", dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=4)),
}


def _ranks(x) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span (zero1 and zero2 often predict the
    same time: neither is ranked above the other)."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a, b) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (exact with ties)."""
    n = len(a)
    if n < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def main(argv=None) -> int:
    import warnings

    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama,hf")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--device", default=None,
                    help="a stored device row (cpu: calibrated 2026-11-22); default: calibrate this machine now")
    ap.add_argument("-o", "--output", default=None,
                    help="the table's file (default: a new benchmarks/results/planner-measured-DATE[-N].md)")
    a = ap.parse_args(argv)

    from autopar import planner as P
    from autopar.analysis.budget import parse_budget
    from autopar.testing import DistPool, measure_plan_job

    budget = parse_budget(a.budget)
    device = a.device
    if device is None:  # this machine as it is now, 4 processes on its cores (what the runs below are)
        from autopar.analysis import cost
        from autopar.tools.calibrate import calibrate

        row = calibrate("cpu-now", ranks=4)
        cost.DEVICES[row["name"]] = cost.Device(**row)
        device = row["name"]
        print(f"  device row: {cost.DEVICES[device].describe()}", file=sys.stderr)
    out = []
    pool = DistPool(4)
    try:
        for key in a.models.split(","):
            spec, over = MODELS[key]
            t0 = time.perf_counter()
            res = P.search(spec, 4, device=device, budget=budget, batch=a.batch, seq=a.seq, overrides=over,
                           precision="fp32", recompute=("none",), mbs_choices=(1,), schedules=("1f1b",),
                           confirm_top=10**6,
                           progress=lambda s: print(f"  [{key} {time.perf_counter() - t0:6.1f}s] {s}", file=sys.stderr))
            cands = res.ranked + [c for c in res.over_budget if not c.rejected.startswith("compile failed")]
            rows = []
            for c in cands:
                opts = {"recompute": c.recompute}
                if c.pp == 1 and c.microbatches > 1:
                    opts["accumulate"] = c.microbatches
                r = pool.run(measure_plan_job, spec, c.mbs * c.data * c.microbatches, a.seq, over, c.mesh(), c.plan(),
                             steps=a.steps, **opts)
                if "error" in r:
                    rows.append((c, None, None, r["error"]))
                    print(f"  {c.label()}: {r['error']}", file=sys.stderr)
                    continue
                step, peak = statistics.median(r["times"]), r["peak"]
                rows.append((c, step, peak, ""))
                print(f"  {c.label():60s} predicted {c.step_s * 1e3:8.1f} ms {c.peak / 2**20:7.1f} MiB | measured "
                      f"{step * 1e3:8.1f} ms {peak / 2**20:7.1f} MiB", file=sys.stderr)
            out.append((key, spec, res, rows))
    finally:
        pool.close()

    from autopar.analysis.cost import DEVICES

    lines = [f"# plan='auto' against measurement: 4 gloo ranks on this machine (2 cores), device row {device}, budget "
             f"{a.budget}, batch {a.batch} x seq {a.seq}, fp32, {a.steps} timed steps (median of the max over ranks)", "",
             f"Device row: {DEVICES[device].describe()}", ""]
    for key, spec, res, rows in out:
        ok = [(c, s, p) for c, s, p, e in rows if not e]
        fits = [(c, s, p) for c, s, p in ok if c.peak <= budget]
        lines.append(f"## {key} ({spec}, {res.info.params / 1e6:.1f}M parameters): {len(rows)} plans run, search "
                     f"{res.seconds:.1f} s")
        lines.append("")
        lines.append("| plan | predicted ms | measured ms | predicted MiB | measured MiB | fits (pred / meas) |")
        lines.append("|---|---|---|---|---|---|")
        for c, s, p, e in sorted(rows, key=lambda r: r[0].step_s):
            if e:
                lines.append(f"| {c.label()} | {c.step_s * 1e3:.1f} | failed: {e} | {c.peak / 2**20:.1f} | | |")
                continue
            lines.append(f"| {c.label()} | {c.step_s * 1e3:.1f} | {s * 1e3:.1f} | {c.peak / 2**20:.1f} | "
                         f"{p / 2**20:.1f} | {'yes' if c.peak <= budget else 'no'} / {'yes' if p <= budget else 'no'} |")
        if fits:
            chosen = min(fits, key=lambda x: x[0].step_s)
            best = min(fits, key=lambda x: x[1])
            rho = spearman([c.step_s for c, _, _ in ok], [s for _, s, _ in ok])
            over = [c.label() for c, s, p in fits if p > budget]
            lines += ["", f"- auto choice: {chosen[0].label()}: measured {chosen[1] * 1e3:.1f} ms; best measured "
                          f"under the budget: {best[0].label()}: {best[1] * 1e3:.1f} ms; ratio "
                          f"{chosen[1] / best[1]:.3f}",
                      f"- Spearman rho, predicted vs measured step time over the {len(ok)} plans that ran: {rho:.3f}",
                      f"- plans predicted under the budget but measured over it: {over or 'none'}"]
        lines.append("")
    text = "\n".join(lines) + "\n"
    out = a.output or _new_results_file()
    with open(out, "w") as f:
        f.write(text)
    sys.stdout.write(text + f"wrote {out}\n")
    return 0


def _new_results_file() -> str:
    """benchmarks/results/planner-measured-DATE.md, or -2, -3, ... when that day's exists (a
    run's table is its only record: never overwritten)."""
    import os

    base = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        f"planner-measured-{time.strftime('%Y-%m-%d')}")
    path, n = base + ".md", 2
    while os.path.exists(path):
        path, n = f"{base}-{n}.md", n + 1
    return path


if __name__ == "__main__":
    sys.exit(main())
