"""Benchmark harness: an autopar plan against the PyTorch-native code a user writes by hand for
it, in the same processes, alternating step by step, same initialization and data.

    autopar bench [--ranks 2 4] [--steps 12] [--warmup 3] [--pairs ddp fsdp megatron 2d]
                  [--bucket-mb 25] [--prefetch 1] [--foreach] [--inductor]
    autopar bench --planning [--planning-models llama3-8b llama3-70b] [--planning-ranks 8 64 256 1024]
    autopar bench --pipeline [--pp 2 4] [--schedules gpipe 1f1b interleaved zb] [--microbatches 8]
    autopar bench --kernels [--kernel-seqs 1024 ... 8192] [--smoke]     (GPU: Triton kernels vs SDPA / cuBLAS)
    python -m autopar.tools.bench ...          (the same)

Pairs (each on its own mesh of ``--ranks`` processes):

- ``ddp``       autopar ``{"dp": "ddp"}``                   vs ``DistributedDataParallel``
- ``fsdp``      autopar ``{"dp": "fsdp"}``                  vs FSDP2 ``fully_shard`` per block + root
- ``megatron``  autopar ``{"tp": "megatron"}``              vs DTensor ``parallelize_module`` with the
                Megatron column/row plan (vocab-parallel embedding, LM head with ``loss_parallel``)
- ``2d``        autopar ``{"dp": "fsdp", "tp": "megatron"}`` vs FSDP2 over TP (dp x tp = ranks/2 x 2)

Measured per configuration, for both sides with the same instruments:

- step time (forward + backward + ``AdamW.step`` + ``zero_grad``, barrier before and after, so
  the slowest rank sets it): median and inter-quartile range over ``--steps`` steps after
  ``--warmup``, the two systems alternating; tokens/s from the median;
- bytes sent per rank per step: every ``c10d`` / ``_c10d_functional`` collective counted by a
  TorchDispatchMode at the op it calls (what DDP's reducer, FSDP2, DTensor and autopar all go
  through), ring formula 2(N-1)/N for all-reduce, (N-1)/N for reduce-scatter and all-gather;
- memory: persistent bytes (parameters, gradients, optimizer state as stored on the rank) and the
  step's peak of allocator memory above what was allocated before it (torch.profiler's memory
  events; CPU here, the same on GPU);
- collective calls per step (the same meter);
- compile / wrap time (autopar without the eval program: the benchmark only trains), and the
  first step's time apart (``torch.compile`` compiles there); the losses of both (same model,
  same data: they must agree).

``--inductor``: autopar with ``inductor=True`` (each per-rank program's compute compiled by
Inductor when it is built: its seconds reported apart, ``inductor_s``) against the baselines under
``torch.compile``: ``torch.compile(DDP(model))`` (its DDPOptimizer splits the graph at the
buckets), FSDP2 with each block's forward compiled before ``fully_shard`` (its hooks run eagerly
around it, as under torchtitan's per-block compile), TP / 2d with each block compiled after
``parallelize_module``.

Writes JSON (machine, versions, every sample), a markdown table and PNG plots (matplotlib, if
installed: ``pip install -e .[bench]``) to ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from autopar.models.zoo import random_batches as _batches
from autopar.runtime.measure import CommMeter, allocator_peak, persistent_bytes, timed

PAIRS = ("ddp", "fsdp", "megatron", "2d")
BASELINE_NAMES = {"ddp": "DistributedDataParallel", "fsdp": "FSDP2 fully_shard",
                  "megatron": "DTensor parallelize_module (TP)", "2d": "FSDP2 + DTensor TP"}


# ----------------------------------------------------------------------------------------- the systems
MODEL = "llama-small"  # the default model; ``--model`` names any built-in (autopar dump --list-models) or factory


def bench_model(name: str = MODEL, seed: int = 0):
    """The benchmark's model, its vocabulary size and loss. The default (a Llama, 4.2M parameters) is
    big enough that compute dominates Python overhead on a CPU, small enough for 2 cores;
    ``hf-qwen2-small`` is Hugging Face's Qwen2 with its shapes."""
    from autopar.models import zoo

    loaded = zoo.load(name, meta=False, seed=seed)
    vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)
    if vocab is None:
        vocab = loaded.model.cfg.vocab_size
    return loaded.model, vocab, loaded.loss_fn or zoo._ce


def _logits(out):
    """A Hugging Face model's output object holds the logits; the built-in models return them."""
    return getattr(out, "logits", out)


def _blocks(model):
    """The model's repeated block list (found from its structure, as autopar's planner does)."""
    from autopar.splice import find_blocks

    found = find_blocks(model, min_blocks=2)
    if isinstance(found, str):
        raise SystemExit(f"autopar bench: the model has no repeated block list for the baselines: {found}")
    return found[1]


def _axes(pair: str, world: int) -> dict[str, int]:
    if pair == "megatron":
        return {"tp": world}
    if pair == "2d":
        return {"dp": world // 2, "tp": 2}
    return {"dp": world}


def build_autopar(pair: str, world: int, example, foreach=None, compiled=False, model_name=MODEL, **options):
    import autopar

    axes = _axes(pair, world)
    plan = {"ddp": {"dp": "ddp"}, "fsdp": {"dp": "fsdp"}, "megatron": {"tp": "megatron"},
            "2d": {"dp": "fsdp", "tp": "megatron"}}[pair]
    model, _, loss_fn = bench_model(model_name)
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=example, loss_fn=loss_fn, plan=plan,
                         capture_eval=False, inductor=compiled, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=foreach)

    def step(x, y, zero_grad=True):
        loss = pm.train_step(x, y)
        opt.step()
        if zero_grad:
            opt.zero_grad()
        return loss

    step.compile_s = pm.ctx.timings.get("inductor")  # (Inductor's seconds, apart from the passes')
    step.inductor = str(pm.inductor) if pm.inductor is not None else None
    return step, pm.parameters, opt


def _tp_plan(model, tp_mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.embed_tokens
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
    parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    for layer in _blocks(model):  # Llama's projection names (the built-in's and Hugging Face's)
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })


def build_baseline(pair: str, world: int, example, foreach=None, compiled=False, model_name=MODEL):
    from torch.distributed.device_mesh import init_device_mesh

    model, _, loss_fn = bench_model(model_name)
    layers = _blocks(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    local_batch = False
    if pair == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # buffers (RoPE tables) are constant: re-broadcasting them every forward would be a handicap
        model = DDP(model, broadcast_buffers=False)
        if compiled:
            model = torch.compile(model)
        local_batch = True
        loss_ctx = None
    elif pair == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
        for layer in layers:
            if compiled:  # the block's forward, FSDP2's hooks around it run eagerly (torchtitan's way)
                layer.forward = torch.compile(layer.forward)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local_batch = True
        loss_ctx = None
    else:
        from torch.distributed.tensor.parallel import loss_parallel

        axes = _axes(pair, world)
        mesh = init_device_mesh(device, tuple(axes.values()), mesh_dim_names=tuple(axes))
        _tp_plan(model, mesh["tp"])
        if compiled:
            for layer in layers:
                layer.compile()
        if pair == "2d":
            from torch.distributed.fsdp import fully_shard

            for layer in layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            local_batch = True
        loss_ctx = loss_parallel
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    dp = {"ddp": world, "fsdp": world, "megatron": 1, "2d": world // 2}[pair]
    rank_dp = dist.get_rank() // (world // dp) if dp > 1 else 0

    def step(x, y, zero_grad=True):
        if local_batch:
            rows = x.shape[0] // dp
            x, y = x[rank_dp * rows:(rank_dp + 1) * rows], y[rank_dp * rows:(rank_dp + 1) * rows]
        x, y = x.to(device), y.to(device)
        if loss_ctx is not None:
            with loss_ctx():
                loss = loss_fn(_logits(model(x)), y)
                loss.backward()
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        else:
            loss = loss_fn(_logits(model(x)), y)
            loss.backward()
        opt.step()
        if zero_grad:
            opt.zero_grad()
        if local_batch:  # the global-batch loss, as autopar reports it
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=None if pair != "2d" else mesh["dp"].get_group())
            loss /= dp
        return loss

    return step, model.parameters, opt


# ----------------------------------------------------------------------------------------- the run
def pair_job(pair: str, steps: int, warmup: int, batch: int, seq: int, options: dict | None = None,
             foreach: bool | None = None, compiled: bool = False, model_name: str = MODEL):
    """On every rank: build both systems, then alternate their steps; rank 0's figures come back.
    ``compiled``: autopar with inductor=True against the baselines under torch.compile."""
    world = dist.get_world_size()
    _, vocab, _ = bench_model(model_name)
    data = _batches(vocab, 4, batch, seq)
    out = {"pair": pair, "world": world, "axes": _axes(pair, world)}
    builders = {"autopar": build_autopar, "baseline": build_baseline}
    systems = {}
    for name, build in builders.items():
        dist.barrier()
        t0 = time.perf_counter()
        systems[name] = build(pair, world, data[0], foreach=foreach, compiled=compiled, model_name=model_name,
                              **((options or {}) if name == "autopar" else {}))
        out[f"{name}_build_s"] = time.perf_counter() - t0
        out[f"{name}_compile_s"] = getattr(systems[name][0], "compile_s", None)
        out[f"{name}_inductor"] = getattr(systems[name][0], "inductor", None)
    times = {k: [] for k in systems}
    losses = {k: [] for k in systems}
    for i in range(warmup + steps):
        for name, (step, _, _) in (systems.items() if i % 2 == 0 else reversed(list(systems.items()))):
            loss, dt = timed(step, *data[i % len(data)])
            losses[name].append(float(loss))
            if i == 0:
                out[f"{name}_first_step_s"] = dt
            if i >= warmup:
                times[name].append(dt)
    # communication and memory: one more step each, instrumented (not timed)
    for name, (step, params, opt) in systems.items():
        x, y = data[0]
        with CommMeter() as meter:
            step(x, y)
        out[f"{name}_comm_bytes"] = dict(meter.bytes)
        out[f"{name}_comm_calls"] = dict(meter.calls)
        dist.barrier()

        out[f"{name}_peak_bytes"] = allocator_peak(lambda step=step, x=x, y=y: step(x, y))
        out[f"{name}_persistent"] = _persistent_with_grads(systems[name], data[0])
    out["times"] = times
    out["losses"] = losses
    return out


def _persistent_with_grads(system, batch) -> dict[str, int]:
    """Parameters, gradients and optimizer state as stored on this rank after a step (before
    ``zero_grad``: the moment all three exist)."""
    step, params, opt = system
    step(*batch, zero_grad=False)
    stored = persistent_bytes(params(), opt)
    opt.zero_grad()
    return stored


# ----------------------------------------------------------------------------------------- planning time
LLAMA3 = ("llama3-8b", "llama3-70b")  # built-in shapes (autopar/models/zoo.py)


def plan_one(name: str, world: int, tp: int = 8, seq: int = 2048) -> dict:
    """``autopar plan`` of a Llama-3 shape on meta tensors over a fake process group of ``world``
    ranks (dp = world / tp, fsdp x megatron, bf16, one sequence per dp rank), in this process:
    the trace, the passes, the per-rank program and the cost model. Seconds and peak RSS."""
    import argparse
    import resource

    from autopar.tools import explain

    tp = min(tp, world)
    dp = world // tp
    parser = argparse.ArgumentParser()
    explain.add_common(parser)
    args = parser.parse_args([name, "--mesh", f"dp={dp},tp={tp}", "--plan", "dp=fsdp,tp=megatron", "--precision",
                              "bf16", "--batch", str(dp), "--seq", str(seq), "--device", "h100"])
    a = explain.analyse(args, 0, explain.Progress(quiet=True))
    recs = a.pm.collectives()
    return {"model": name, "world": world, "mesh": f"dp={dp} x tp={tp}", "seconds": a.seconds["total"],
            "timings": dict(a.pm.ctx.timings), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "params": a.n_params, "collectives": len(recs), "bytes_per_rank_step": sum(r.wire_bytes for r in recs),
            "nodes": len(a.pm.program.local.graph.nodes), "step_peak": a.memory["step_peak"],
            "predicted_step_s": a.time.step_s}


def planning(models, worlds) -> list[dict]:
    """Each configuration in a fresh process (peak RSS is per process)."""
    import subprocess

    rows = []
    jobs = [(m, w) for m in models for w in worlds]
    for i, (m, w) in enumerate(jobs):
        _progress(i, len(jobs), f"planning {m} on {w} ranks")
        code = f"import json, autopar.tools.bench as b; print(json.dumps(b.plan_one({m!r}, {w})))"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            rows.append({"model": m, "world": w, "error": r.stderr.strip().splitlines()[-1:]})
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    _progress(len(jobs), len(jobs), "planning done")
    return rows


def planning_markdown(rows) -> str:
    lines = ["| model | ranks | mesh | parameters | seconds (trace + plan + per-rank program + cost model) | peak RSS | "
             "per-rank graph nodes | collectives / step | bytes sent / rank / step | step peak / rank | "
             "predicted step (h100) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['world']} | | | failed: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['world']} | {r['mesh']} | {r['params'] / 1e9:.1f} B | {r['seconds']:.1f} | "
                     f"{r['peak_rss_mib']:,.0f} MiB | {r['nodes']:,} | {r['collectives']:,} | "
                     f"{r['bytes_per_rank_step'] / 2**30:.1f} GiB | {r['step_peak'] / 2**30:.1f} GiB | "
                     f"{r['predicted_step_s'] * 1e3:,.0f} ms |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- reporting
def summarize(results: list[dict], batch: int, seq: int) -> list[dict]:
    rows = []
    for r in results:
        row = {"pair": r["pair"], "mesh": " x ".join(f"{a}={n}" for a, n in r["axes"].items()), "world": r["world"]}
        for side in ("autopar", "baseline"):
            t = sorted(r["times"][side])
            q1, med, q3 = _quantile(t, 0.25), statistics.median(t), _quantile(t, 0.75)
            row[side] = {
                "median_s": med, "iqr_s": q3 - q1, "tokens_per_s": batch * seq / med,
                "comm_bytes": sum(r[f"{side}_comm_bytes"].values()), "comm": r[f"{side}_comm_bytes"],
                "peak_bytes": r[f"{side}_peak_bytes"], "persistent_bytes": sum(r[f"{side}_persistent"].values()),
                "build_s": r[f"{side}_build_s"], "losses": r["losses"][side],
                "calls": sum(r[f"{side}_comm_calls"].values()), "first_step_s": r.get(f"{side}_first_step_s"),
                "compile_s": r.get(f"{side}_compile_s"),
            }
        a, b = row["autopar"], row["baseline"]
        row["ratio"] = {k: (a[k] / b[k] if b[k] else float("nan"))
                        for k in ("median_s", "comm_bytes", "peak_bytes", "persistent_bytes", "build_s")}
        # the two systems alternate step by step: each autopar step against the baseline step beside it
        paired = [x / y for x, y in zip(r["times"]["autopar"], r["times"]["baseline"])]
        row["paired_ratios"] = paired
        row["ratio"]["paired_median"] = statistics.median(paired) if paired else float("nan")
        row["max_loss_diff"] = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
        rows.append(row)
    return rows


def _quantile(xs, q):
    if not xs:
        return float("nan")
    i = (len(xs) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Benchmark {meta['date']} on {meta['machine']} ({meta['device']}, torch {meta['torch']}): "
             f"{meta['model']}, global batch {meta['batch']} x {meta['seq']} tokens, {meta.get('optimizer', 'AdamW')}; "
             f"{meta['steps']} timed steps after {meta['warmup']} warm-up, the two systems alternating"
             + (f"; autopar inductor=True, baselines under {meta['baseline_compiled']}"
                if meta.get("autopar_options", {}).get("inductor") else "")
             + (f"; load average {_load(meta['load_average'])} before, {_load(meta['load_average_after'])} after"
                if "load_average_after" in meta else "") + ".", "",
             "| pair | mesh | baseline | step time autopar (IQR) | step time baseline (IQR) | autopar / baseline "
             "| paired per-step ratio (median) | tokens/s autopar | bytes sent/rank/step autopar | baseline | ratio | step peak autopar | "
             "baseline | ratio | persistent autopar | baseline | collective calls/step autopar | baseline "
             "| compile/wrap s autopar | baseline | first step s autopar | baseline | max loss diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b, q = r["autopar"], r["baseline"], r["ratio"]
        lines.append(
            f"| {r['pair']} | {r['mesh']} | {BASELINE_NAMES[r['pair']]} | {a['median_s'] * 1e3:.0f} ms "
            f"({a['iqr_s'] * 1e3:.0f}) | {b['median_s'] * 1e3:.0f} ms ({b['iqr_s'] * 1e3:.0f}) | "
            f"**{q['median_s']:.2f}** | {q.get('paired_median', float('nan')):.2f} | {a['tokens_per_s']:,.0f} | {a['comm_bytes']:,.0f} | {b['comm_bytes']:,.0f} | "
            f"{q['comm_bytes']:.2f} | {a['peak_bytes'] / 2**20:.1f} MiB | {b['peak_bytes'] / 2**20:.1f} MiB | "
            f"{q['peak_bytes']:.2f} | {a['persistent_bytes'] / 2**20:.1f} MiB | {b['persistent_bytes'] / 2**20:.1f} MiB | "
            f"{a['calls']} | {b['calls']} | {a['build_s']:.1f}{_of_it(a.get('compile_s'))} | {b['build_s']:.2f} | "
            f"{_seconds(a.get('first_step_s'))} | {_seconds(b.get('first_step_s'))} | {r['max_loss_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def _seconds(v) -> str:
    return "" if v is None else f"{v:.2f}"


def _of_it(compile_s) -> str:
    return "" if compile_s is None else f" (Inductor {compile_s:.1f})"


def plots(rows: list[dict], path_prefix: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plots", file=sys.stderr)
        return []
    labels = [f"{r['pair']}\n{r['mesh']}" for r in rows]
    x = range(len(rows))
    out = []
    for key, title, scale, unit in [("median_s", "step time (median, IQR bars)", 1e3, "ms"),
                                    ("peak_bytes", "step peak memory per rank", 2**-20, "MiB"),
                                    ("comm_bytes", "bytes sent per rank per step", 2**-20, "MiB")]:
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
        for off, side, color in [(-0.2, "autopar", "#1f77b4"), (0.2, "baseline", "#aaaaaa")]:
            vals = [r[side][key] * scale for r in rows]
            err = [r[side]["iqr_s"] * scale / 2 for r in rows] if key == "median_s" else None
            ax.bar([i + off for i in x], vals, width=0.4, yerr=err, label=side, color=color)
        ax.set_xticks(list(x), labels)
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        p = f"{path_prefix}-{key}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)
    return out


def _describe(name: str, model) -> str:
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    n = sum(p.numel() for p in model.parameters())
    if hasattr(model, "config"):  # Hugging Face
        return (f"{type(model).__name__} ({name}) hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab "
                f"{cfg.vocab_size}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, ffn "
                f"{cfg.intermediate_size}, {n / 1e6:.1f}M parameters")
    if cfg is not None and hasattr(cfg, "dim"):
        return (f"Llama ({name}) dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, {cfg.n_heads} heads / "
                f"{cfg.n_kv_heads} KV heads, ffn {cfg.ffn_dim}, {n / 1e6:.1f}M parameters")
    return f"{type(model).__name__} ({name}), {n / 1e6:.1f}M parameters"


def _progress(i: int, n: int, what: str):
    bar = "#" * int(30 * i / n)
    print(f"\r[{bar:30s}] {i}/{n} {what:40s}", end="" if i < n else "\n", file=sys.stderr, flush=True)


def main(argv=None):
    from autopar.testing import DistPool

    ap = argparse.ArgumentParser(prog="autopar bench", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to run (gloo processes)")
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=PAIRS)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per system")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=25, help="autopar.compile(bucket_mb=...) (0: per-tensor collectives)")
    ap.add_argument("--prefetch", type=int, default=1, help="autopar.compile(prefetch=...) (0: gathers where used)")
    ap.add_argument("--foreach", action="store_true",
                    help="AdamW(foreach=True) on both sides (CUDA's default; on CPU torch loops over parameters, "
                         "which costs DTensor parameters (autopar where it shards them, FSDP2, DTensor TP) a dispatch per op)")
    ap.add_argument("--inductor", action="store_true",
                    help="autopar.compile(inductor=True) against the baselines under torch.compile")
    ap.add_argument("--tag", default="", help="appended to the results' file names")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--model", default=MODEL,
                    help="a built-in model name (autopar dump --list-models; e.g. hf-qwen2-small: Hugging Face's Qwen2 "
                         "with the default's shapes) or package.module:factory; the pairs' baselines find its "
                         "repeated block list from its structure (megatron / 2d: Llama's projection names)")
    ap.add_argument("--out", default="benchmarks/results", help="directory for the JSON, markdown and PNGs")
    ap.add_argument("--planning", action="store_true",
                    help="instead: time trace + plan of Llama-3 shapes on meta tensors with a fake process group")
    ap.add_argument("--planning-models", nargs="+", default=list(LLAMA3), choices=list(LLAMA3))
    ap.add_argument("--planning-ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--pipeline", action="store_true",
                    help="instead: autopar's pipeline schedules vs torch.distributed.pipelining (autopar/tools/pipebench.py)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (--pipeline)")
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb"],
                    choices=["gpipe", "1f1b", "interleaved", "zb"])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8, help="Llama blocks of the pipeline benchmark model")
    ap.add_argument("--no-baseline", action="store_true", help="autopar only (--pipeline)")
    ap.add_argument("--kernels", action="store_true",
                    help="instead: autopar's Triton kernels vs PyTorch (SDPA, cuBLAS) in TFLOP/s; needs a GPU")
    ap.add_argument("--kernel-seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--smoke", action="store_true", help="--kernels on tiny shapes (checks the harness on CPU)")
    args = ap.parse_args(argv)
    if args.kernels:
        from autopar.tools import kernelbench

        return kernelbench.main(args)
    if args.pipeline:
        from autopar.tools import pipebench

        args.steps = args.steps if "--steps" in (argv or sys.argv) else 6
        args.warmup = args.warmup if "--warmup" in (argv or sys.argv) else 2
        pipebench.main(args)
        return
    if args.planning:
        rows = planning(args.planning_models, args.planning_ranks)
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"planning-{datetime.date.today()}")
        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "platform": platform.platform(),
                "cpus": os.cpu_count(), "torch": torch.__version__}
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        md = planning_markdown(rows)
        with open(stem + ".md", "w") as f:
            f.write(md)
        print(md)
        print(f"wrote {stem}.json, {stem}.md")
        return
    load_before = os.getloadavg()
    jobs = [(w, p) for w in args.ranks for p in args.pairs if not (p == "2d" and w < 4)]
    if not jobs:
        ap.error("nothing to run (2d needs --ranks 4 or more)")
    results = []
    _progress(0, len(jobs), "starting")
    for w in sorted(set(w for w, _ in jobs)):
        pool = DistPool(w)
        try:
            for ww, pair in jobs:
                if ww != w:
                    continue
                _progress(len(results), len(jobs), f"{pair} on {w} ranks")
                results.append(pool.run(pair_job, pair, args.steps, args.warmup, args.batch, args.seq,
                                        {"bucket_mb": args.bucket_mb, "prefetch": args.prefetch},
                                        True if args.foreach else None, args.inductor, args.model))
        finally:
            pool.close()
    _progress(len(results), len(jobs), "done")
    model, _, _ = bench_model(args.model)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.node() or "?",
            "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "device": "CUDA" if torch.cuda.is_available() else "CPU, gloo",
            "model": _describe(args.model, model),
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "autopar_options": {"bucket_mb": args.bucket_mb, "prefetch": args.prefetch, "inductor": args.inductor},
            "baseline_compiled": "torch.compile" if args.inductor else "eager", "load_average": load_before,
            "optimizer": "AdamW(foreach=True)" if args.foreach else "AdamW (torch's default: a for-loop on CPU)"}
    rows = summarize(results, args.batch, args.seq)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench-{datetime.date.today()}{args.tag}")
    meta["load_average_after"] = os.getloadavg()
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "raw": results}, f, indent=1, default=str)
    md = markdown(rows, meta)
    with open(stem + ".md", "w") as f:
        f.write(md)
    pngs = plots(rows, stem)
    print(md)
    print("wrote " + ", ".join([stem + ".json", stem + ".md"] + pngs))


if __name__ == "__main__":
    main()
