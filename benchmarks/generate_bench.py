"""Greedy generation throughput: ``pm.generate`` on tp=1 (one process) and tp=2 (2 gloo ranks,
{"tp": "megatron"}) against Hugging Face's ``model.generate`` on one process, same model and
prompts:

    .venv/bin/python benchmarks/generate_bench.py [--hidden 256 --layers 4 --prompt 32 --new 64 --runs 5]

The model is a Hugging Face LlamaForCausalLM (random weights, fp32; vocab 2048, 8 heads / 4 KV
heads, MLP 3x hidden). Each row: a warm-up call (pm: it compiles the prefill and decode programs),
then the median over ``--runs`` calls of the whole call's wall time; tokens/s = batch x new tokens /
that time; prefill and per-token decode times from ``pm.generate_stats``. Every process runs one
torch thread (the pool's workers set it); HF's generate runs in the tp=1 worker, its calls
alternating with pm's (the machine is shared: alternating keeps the two under the same load).
The tokens of every pm row are compared with HF's. Writes the table to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _config(a):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=2048, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=a.prompt + a.new, use_cache=False, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def _model(a):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(a))
    model.generation_config.eos_token_id = None  # every call generates exactly --new tokens
    return model.eval()


def _prompts(a, batch: int) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, a.prompt), generator=torch.Generator().manual_seed(batch))


def _timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def pm_job(a, batches) -> dict:
    """On every rank of the pool: compile for tp = world size, then time pm.generate per batch. On
    one process, HF's generate is timed in the same process, its calls alternating with pm's."""
    import torch.distributed as dist

    import autopar
    from autopar.testing import _ce

    one = dist.get_world_size() == 1
    model, hf = _model(a), _model(a) if one else None
    x = _prompts(a, batches[0])
    t0 = time.perf_counter()
    pm = autopar.compile(model, autopar.mesh(tp=dist.get_world_size()), example_inputs=(x, x), loss_fn=_ce,
                         plan={"tp": "megatron"}, capture_eval=False)
    out = {"compile_s": time.perf_counter() - t0}
    for b in batches:
        ids = _prompts(a, b)
        kw = dict(max_new_tokens=a.new, do_sample=False, attention_mask=torch.ones_like(ids))
        pm.generate(ids, a.new)  # compiles the prefill / decode programs for this shape
        gen_compile = pm.generate_stats.compile_s
        times, stats, hf_times, plain = [], [], [], []
        with torch.no_grad():
            if one:
                hf.generate(ids, **kw)  # warm-up
            for _ in range(a.runs):
                if one:
                    dt, hf_tokens = _timed(lambda: hf.generate(ids, **kw))
                    hf_times.append(dt)
                dt, tokens = _timed(lambda: pm.generate(ids, a.new))
                times.append(dt)
                stats.append(pm.generate_stats)
                pm.guard = False  # the programs' own functional collectives and waits (no failure channel)
                plain.append(_timed(lambda: pm.generate(ids, a.new))[0])
                pm.guard = True
        s = stats[0]
        out[b] = dict(tokens=tokens, s=statistics.median(times), unguarded_s=statistics.median(plain),
                      gen_compile_s=gen_compile,
                      prefill_ms=1e3 * statistics.median(x.prefill_s for x in stats),
                      decode_ms=1e3 * statistics.median(x.decode_s / (a.new - 1) for x in stats),
                      cache_bytes=s.cache_bytes, cache_local=s.cache_local_shape, collectives=s.collectives)
        if one:
            out[b]["hf"] = dict(tokens=hf_tokens, s=statistics.median(hf_times))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/generate-2026-11-23.md")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]

    from autopar.testing import DistPool

    pm = {}
    for tp in (1, 2):
        pool = DistPool(tp)
        try:
            pm[tp] = pool.run(pm_job, a, batches)
        finally:
            pool.close()

    load = os.getloadavg()  # (the machine is shared: say how busy it was)
    lines = [f"Greedy generation, HF LlamaForCausalLM hidden {a.hidden}, {a.layers} layers, 8 heads / 4 KV heads, "
             f"vocab 2048, fp32; prompt {a.prompt}, {a.new} new tokens; CPU, gloo, 2 cores shared with other work "
             f"(load average {load[0]:.1f} at the end); torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%dT%H:%M:%S')}; medians of {a.runs} calls after a warm-up.", "",
             "| batch | runner | processes x threads | tokens/s | vs HF (1 thread) | prefill ms | decode ms/token "
             "| KV cache bytes per rank | collectives per decode step | same tokens as HF |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b in batches:
        hf = pm[1][b]["hf"]
        base = b * a.new / hf["s"]
        lines.append(f"| {b} | HF generate | 1 x 1 | {base:.0f} | 1.00x | | | | | |")
        for tp in (1, 2):
            r = pm[tp][b]
            tps = b * a.new / r["s"]
            lines.append(f"| {b} | pm.generate tp={tp} | {tp} x 1 | {tps:.0f} | {tps / base:.2f}x | "
                         f"{r['prefill_ms']:.1f} | {r['decode_ms']:.2f} | {r['cache_bytes']:,} "
                         f"({list(r['cache_local'])} x {2 * a.layers}) | {r['collectives']['decode']} | "
                         f"{'yes' if torch.equal(r['tokens'], hf['tokens']) else 'NO'} |")
    lines += ["", "Without the failure channel (`pm.guard = False`: plain functional collectives and waits), "
              "tokens/s: " + "; ".join(f"batch {b} tp={tp} {b * a.new / pm[tp][b]['unguarded_s']:.0f}"
                                       for b in batches for tp in (1, 2)) + "."]
    lines += ["", "Compile (per rank): " + "; ".join(
        f"tp={tp}: training program {pm[tp]['compile_s']:.1f} s, prefill + decode programs "
        + ", ".join(f"batch {b} {pm[tp][b]['gen_compile_s']:.1f} s" for b in batches) for tp in (1, 2)) + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
