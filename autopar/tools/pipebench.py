"""Pipeline section of the benchmark harness: autopar's pipeline schedules against
``torch.distributed.pipelining`` (what a user writes by hand: the model split into stage modules,
``PipelineStage`` + the matching schedule class), on real gloo process groups.

    autopar bench --pipeline [--pp 2 4] [--schedules gpipe 1f1b interleaved zb] [--microbatches 8]
                             [--steps 6] [--warmup 2] [--batch 16] [--seq 128] [--layers 8]

Per schedule and pipeline size, in the same processes, the two systems alternating step by step
(same init, same data):

- step time (forward + backward over M micro-batches + AdamW step; barriers around it): median;
- autopar's measured schedule: every action's start and end on every rank (the executor times
  them), the measured bubble ``1 - busy / (P x makespan)`` per step, and the simulator's bubble
  for the same action lists fed with the measured mean duration of each action kind per stage
  (no transfer time); the textbook bubble for the schedule;
- activations held in flight per rank: measured by the executor (micro-batch sets and bytes of
  the saved values) and predicted by the compiler;
- bytes sent per rank per step (counted at each send).

Writes ``pipeline-DATE.json``/``.md`` and a Gantt chart per run (measured above, simulated with
the measured costs below) to ``--out``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

BASELINE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                    "zb": "ScheduleInterleavedZeroBubble"}


def _model(layers: int):
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy
    from autopar.models.zoo import LLAMA_SMALL

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**LLAMA_SMALL, "n_layers": layers})
    return Llama(cfg), cfg, cross_entropy


class _LlamaStage(nn.Module):
    """A hand-written stage of the Llama: embedding on the first, layers [lo, hi), head on the last."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.layers[lo:hi])
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x):
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        s = x.shape[1]
        cos, sin = self.rope_cos[:s].to(x.dtype), self.rope_sin[:s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def _build_baseline(schedule: str, p: int, m: int, v: int, layers: int, example):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    model, cfg, loss_fn = _model(layers)
    rank = dist.get_rank()
    n_stages = p * v
    per = [layers // n_stages + (1 if i < layers % n_stages else 0) for i in range(n_stages)]
    bounds = [sum(per[:i]) for i in range(n_stages + 1)]
    mb = example[0].shape[0] // m
    stages = []
    for s in range(rank, n_stages, p):
        mod = _LlamaStage(model, bounds[s], bounds[s + 1], s == 0, s == n_stages - 1)
        x_in = example[0][:mb] if s == 0 else torch.zeros(mb, example[0].shape[1], cfg.dim)
        stages.append(PipelineStage(mod, s, n_stages, torch.device("cpu"), input_args=(x_in,)))
    cls = getattr(S, BASELINE_CLASSES[schedule])
    sched = cls(stages[0], m, loss_fn=loss_fn) if schedule in ("gpipe", "1f1b") else cls(stages, m, loss_fn=loss_fn)
    params = [q for st in stages for q in st.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    has_first = any(st.is_first for st in stages)
    has_last = any(st.is_last for st in stages)

    def step(x, y):
        losses = []
        kwargs = {"target": y, "losses": losses} if has_last else {}
        if has_first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=p - 1)  # every rank reports the loss, as autopar's train_step does
        return float(loss)

    return step


def _build_autopar(schedule: str, p: int, m: int, v: int, layers: int, example):
    import autopar

    model, _, loss_fn = _model(layers)
    opts = {"schedule": schedule, "microbatches": m}
    if schedule == "interleaved":
        opts["virtual"] = v
    pm = autopar.compile(model, autopar.mesh(pp=p), example_inputs=example, loss_fn=loss_fn, plan={"pp": opts})
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

    def step(x, y):
        loss = pm.train_step(x, y)
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step, pm


def measured_bubble(timeline) -> tuple[float, float]:
    """(bubble, makespan) of one step's measured schedule (every pipeline rank's actions)."""
    start = min(e[0][0] for e in timeline if e)
    end = max(e[-1][1] for e in timeline if e)
    busy = sum(b - a for ev in timeline for a, b, _ in ev)
    span = end - start
    return 1.0 - busy / (len(timeline) * span), span


def stage_costs(timelines, n_stages: int) -> dict[str, list[float]]:
    """Mean measured duration of each action kind per stage, over the timed steps."""
    acc: dict[tuple[str, int], list[float]] = {}
    for tl in timelines:
        for ev in tl:
            for a, b, (kind, s, _) in ev:
                acc.setdefault((kind, s), []).append(b - a)
    kinds = sorted({k for k, _ in acc})
    return {k: [statistics.mean(acc.get((k, s), [0.0])) for s in range(n_stages)] for k in kinds}


def pipeline_job(schedule: str, m: int, v: int, steps: int, warmup: int, batch: int, seq: int, layers: int,
                 baseline: bool = True):
    from autopar.models.zoo import random_batches as _batches
    from autopar.runtime.measure import timed

    p = dist.get_world_size()
    _, cfg, _ = _model(layers)
    data = _batches(cfg, 4, batch, seq)
    out = {"schedule": schedule, "P": p, "M": m, "v": v, "batch": batch, "seq": seq, "layers": layers}
    systems = {}
    dist.barrier()
    t0 = time.perf_counter()
    step, pm = _build_autopar(schedule, p, m, v, layers, data[0])
    systems["autopar"] = step
    out["autopar_build_s"] = time.perf_counter() - t0
    if baseline:
        try:
            dist.barrier()
            t0 = time.perf_counter()
            systems["baseline"] = _build_baseline(schedule, p, m, v, layers, data[0])
            out["baseline_build_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - reported in the table
            out["baseline_error"] = f"{type(e).__name__}: {e}"[:300]
    times = {k: [] for k in systems}
    losses = {k: [] for k in systems}
    timelines, waits = [], []
    for i in range(warmup + steps):
        order = list(systems.items()) if i % 2 == 0 else list(reversed(systems.items()))
        for name, fn in order:
            loss, dt = timed(fn, *data[i % len(data)])
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(dt)
                if name == "autopar":
                    timelines.append(pm.gather_timeline())
                    waits.append(pm.gathered_recv_wait)
    pm.counter.reset()
    with pm.measure():  # bytes handed to the process group, on one untimed step
        systems["autopar"](*data[0])
    out["sent"] = {k: v["wire_bytes"] for k, v in pm.counter.summary().items()}
    out["predicted_sent"] = pm.predicted_bytes()
    everyone = [None] * p
    dist.all_gather_object(everyone, (pm.in_flight, pm.predicted_in_flight(), out["sent"]))
    out["in_flight"] = [e[0] for e in everyone]
    out["predicted_in_flight"] = [e[1] for e in everyone]
    out["sent_per_rank"] = [e[2] for e in everyone]
    out["times"] = times
    out["losses"] = losses
    out["timelines"] = timelines
    out["recv_wait"] = waits
    out["stages"] = pm.describe_stages()
    out["actions"] = pm.schedule.actions
    return out


def analyse(r: dict) -> dict:
    from autopar.analysis import schedules as S

    sched = S.Schedule(r["schedule"] if r["schedule"] != "zb" else "zb-h1", r["P"], r["M"], r["v"],
                       [[tuple(a) for a in acts] for acts in r["actions"]])
    bubbles = [measured_bubble(tl)[0] for tl in r["timelines"]]
    # where each rank's idle time went: blocked in a receive, or between actions (sends, executor)
    spans = [measured_bubble(tl)[1] for tl in r["timelines"]]
    busy = [sum(b - a for a, b, _ in ev) for tl in r["timelines"] for ev in tl]
    idle = sum(len(tl) * sp for tl, sp in zip(r["timelines"], spans)) - sum(busy)
    waited = sum(sum(w) for w in r["recv_wait"])
    costs = stage_costs(r["timelines"], r["P"] * r["v"])
    sim = S.simulate(sched, costs, per_stage=True)
    row = {
        "schedule": r["schedule"], "P": r["P"], "M": r["M"], "v": r["v"],
        "autopar_ms": 1e3 * statistics.median(r["times"]["autopar"]),
        "baseline_ms": 1e3 * statistics.median(r["times"]["baseline"]) if "baseline" in r["times"] else None,
        "baseline_error": r.get("baseline_error"),
        "bubble_measured": statistics.median(bubbles),
        "bubble_simulated": sim.bubble,
        "bubble_theory": S.theory_bubble(r["schedule"], r["P"], r["M"], r["v"]),
        "idle_in_recv": waited / idle if idle > 0 else 0.0,
        "makespan_ms": 1e3 * statistics.median(spans),
        "makespan_simulated_ms": 1e3 * sim.makespan,
        "in_flight_measured": [f["peak_microbatches"] for f in r["in_flight"]],
        "in_flight_simulated": sim.peak_in_flight,
        "in_flight_bytes_measured": [f["peak_bytes"] for f in r["in_flight"]],
        "in_flight_bytes_predicted": [f["peak_bytes"] for f in r["predicted_in_flight"]],
        "sent_per_rank": r["sent_per_rank"],
        "losses_agree": ("baseline" not in r["losses"]) or max(
            abs(a - b) for a, b in zip(r["losses"]["autopar"], r["losses"]["baseline"])) < 1e-3,
        "costs_ms": {k: [round(1e3 * c, 2) for c in v] for k, v in costs.items()},
    }
    return row, sched, sim


def markdown(rows, meta) -> str:
    lines = [f"Pipeline schedules, {meta['model']}, batch {meta['batch']} x seq {meta['seq']}, {meta['device']} "
             f"({meta['cpus']} cores), torch {meta['torch']}, {meta['date']}; medians of {meta['steps']} steps.", "",
             "| schedule | P | M | v | autopar step | torch.distributed.pipelining | bubble measured | simulated "
             "(measured costs) | theory | in flight measured = simulated | saved bytes measured / predicted (max rank) "
             "| sent/rank/step (rank 0) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        base = f"{r['baseline_ms']:.0f} ms" if r["baseline_ms"] else f"failed: {r['baseline_error'][:60]}"
        same = "yes" if r["in_flight_measured"] == r["in_flight_simulated"] else "NO"
        i = max(range(len(r["in_flight_bytes_measured"])), key=lambda k: r["in_flight_bytes_measured"][k])
        sent = r["sent_per_rank"][0].get("send@pp", 0)
        lines.append(f"| {r['schedule']} | {r['P']} | {r['M']} | {r['v']} | {r['autopar_ms']:.0f} ms | {base} | "
                     f"{r['bubble_measured']:.1%} | {r['bubble_simulated']:.1%} | {r['bubble_theory']:.1%} | "
                     f"{r['in_flight_measured']} ({same}) | {r['in_flight_bytes_measured'][i]:,} / "
                     f"{r['in_flight_bytes_predicted'][i]:,} | {sent / 2**20:.2f} MiB |")
        notes.append(f"- {r['schedule']} P={r['P']}: schedule makespan measured {r['makespan_ms']:.0f} ms, simulated "
                     f"{r['makespan_simulated_ms']:.0f} ms; {r['idle_in_recv']:.0%} of the measured idle time was "
                     f"spent blocked in receives; mean action ms per stage {r['costs_ms']}")
    return "\n".join(lines + [""] + notes)


def main(args):
    from autopar.analysis import schedules as S
    from autopar.testing import DistPool

    results = []
    for p in args.pp:
        pool = DistPool(p)
        try:
            for s in args.schedules:
                v = 2 if s == "interleaved" else 1
                m = args.microbatches
                print(f"[pipeline] {s} on {p} ranks, M={m}", flush=True)
                results.append(pool.run(pipeline_job, s, m, v, args.steps, args.warmup, args.batch, args.seq,
                                        args.layers, not args.no_baseline))
        finally:
            pool.close()
    _, cfg, _ = _model(args.layers)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "platform": platform.platform(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "device": "CUDA" if torch.cuda.is_available() else "CPU, gloo",
            "model": f"Llama dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}",
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup}
    rows, charts = [], {}
    for r in results:
        row, sched, sim = analyse(r)
        rows.append(row)
        measured = S.Timeline(0.0, [], [[(a, b, tuple(act)) for a, b, act in ev] for ev in r["timelines"][-1]],
                              row["in_flight_measured"], row["bubble_measured"])
        charts[f"{r['schedule']} P={r['P']} measured"] = (sched, measured)
        charts[f"{r['schedule']} P={r['P']} simulated, measured costs"] = (sched, sim)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"pipeline-{datetime.date.today()}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "raw": [{k: v for k, v in r.items() if k != "timelines"}
                                                       for r in results]}, f, indent=1, default=str)
    md = markdown(rows, meta)
    with open(stem + ".md", "w") as f:
        f.write(md + "\n")
    png = S.gantt(charts, stem + "-gantt.png", unit="s")
    print(md)
    print(f"wrote {stem}.json, {stem}.md, {png}")
