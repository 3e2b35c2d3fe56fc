"""The Megatron-LM weak-scaling table (Narayanan et al., SC'21, Table 1) predicted from the
configurations alone, then ``plan="auto"`` on the same models and GPU counts.

    .venv/bin/python benchmarks/megatron_table.py [--auto] [--rows 0,1] [-o results/megatron-table.md]

Each row: GPT (vocab 51,200, sequence 2,048, GELU MLP 4h, multi-head attention) on the project's
decoder (``gpt-tiny`` with its shape overridden), bf16, full recomputation, micro-batch 1,
interleaved 1F1B (2 virtual stages where the layers per stage allow) for pp > 1, ddp over the
data-parallel ranks, each per-rank program costed as ``compile(inductor=True)`` runs it (elementwise
chains fused, as Megatron-LM runs fused kernels for bias + GeLU, softmax and layer norm; ``--eager``:
op by op), the ``a100`` device row of the cost model (datasheet peaks, 60% of peak on
large matmuls, NVLink inside 8-GPU nodes, 200 Gb/s per GPU across). The step time comes from
``autopar.planner.cost`` over one block's compiled figures (the planner's screen); rows without
a pipeline are also confirmed by compiling the whole plan at depths 1 and 2 and extrapolating.
TFLOP/s per GPU is the paper's own count, 96 B s l h^2 (1 + s/6h + V/16lh) per step (recomputation
included) over the predicted step time, so the comparison is time against time.
"""

from __future__ import annotations

import argparse
import sys
import time

# Megatron-LM steps its optimizer with Apex's fused Adam: one read and one write of each tensor
# (the cost model's "adamw-fused"; torch's default AdamW makes about 3x that traffic)
OPTIMIZER = "adamw-fused"

PAPER = [  # params, layers, hidden, heads, tp, pp, GPUs, batch, TFLOP/s per GPU (published)
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("7.5B", 36, 4096, 32, 4, 1, 128, 512, 142),
    ("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 138),
    ("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 148),
    ("1008B", 128, 25600, 160, 8, 64, 3072, 3072, 163),
]


def gpt(layers, hidden, heads) -> dict:
    return dict(vocab_size=51200, dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads, ffn_dim=4 * hidden,
                max_seq_len=2048, mlp="gelu")


def row(i: int, dev, confirm: bool, fused: bool = True) -> dict:
    from autopar import planner as P

    name, layers, hidden, heads, tp, pp, gpus, batch, published = PAPER[i]
    info = P.model_info("gpt-tiny", batch, 2048, gpt(layers, hidden, heads))
    dp = gpus // (tp * pp)
    mbs = 1
    m = batch // dp // mbs
    v = 2 if pp > 1 and layers % (2 * pp) == 0 else 1
    sched = None if pp == 1 else "interleaved" if v > 1 else "1f1b"
    t0 = time.perf_counter()
    co = P.block_coefficients(info, tp, "megatron" if tp > 1 else None, "full", mbs, precision="bf16", dev=dev,
                              fused=fused)
    c = P.cost(P.Candidate(dp, tp, pp, "ddp", "megatron" if tp > 1 else None, sched, v, "full", mbs, m), info, co,
               dev, precision="bf16", optimizer=OPTIMIZER)
    flops = P.model_flops_per_step(info, recompute=True)
    out = {"name": name, "dp": dp, "tp": tp, "pp": pp, "v": v, "m": m, "step_s": c.step_s, "bubble": c.bubble,
           "peak": c.peak, "tflops": flops / c.step_s / gpus / 1e12, "published": published,
           "params": info.params, "seconds": time.perf_counter() - t0}
    if confirm and pp == 1:
        got = P.confirm(c, info, dev, precision="bf16", optimizer=OPTIMIZER, fused=fused)
        out["confirmed_tflops"] = flops / got["step_s"] / gpus / 1e12
        out["confirmed_peak"] = got["peak"]
    return out


def auto(i: int, dev_name: str, top: int, fused: bool = True) -> dict:
    from autopar import planner as P

    name, layers, hidden, heads, tp, pp, gpus, batch, published = PAPER[i]
    t0 = time.perf_counter()
    res = P.search("gpt-tiny", gpus, device=dev_name, budget="80GiB", batch=batch, seq=2048,
                   overrides=gpt(layers, hidden, heads), precision="bf16", optimizer=OPTIMIZER, confirm_top=top,
                   inductor=fused,
                   progress=lambda s: print(f"  [{name} {time.perf_counter() - t0:6.1f}s] {s}", file=sys.stderr))
    if not res.ranked:
        return {"name": name, "chosen": "none fits", "seconds": res.seconds}
    c = res.ranked[0]
    flops = P.model_flops_per_step(res.info, recompute=c.recompute == "full")
    return {"name": name, "chosen": c.label(), "step_s": c.step_s, "peak": c.peak, "confirmed": c.confirmed is not None,
            "tflops_paper_count": P.model_flops_per_step(res.info, recompute=True) / c.step_s / gpus / 1e12,
            "tflops_useful": P.model_flops_per_step(res.info) / c.step_s / gpus / 1e12,
            "flops_counted": flops, "seconds": res.seconds, "considered": res.considered}


def main(argv=None) -> int:
    import warnings

    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(str(i) for i in range(len(PAPER))))
    ap.add_argument("--auto", action="store_true", help="also run plan='auto' on each row's model and GPU count")
    ap.add_argument("--top", type=int, default=0, help="plan='auto': candidates confirmed by a compile (default 0)")
    ap.add_argument("--no-confirm", action="store_true")
    ap.add_argument("--eager", action="store_true",
                    help="cost autopar's programs run op by op (default: as compile(inductor=True) runs them, "
                         "elementwise chains fused, as Megatron-LM's fused kernels do)")
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args(argv)
    from autopar.analysis import cost

    dev = cost.get_device("a100")
    rows = [int(r) for r in a.rows.split(",")]
    lines = ["| params | layers | hidden | heads | tp | pp | v | GPUs | batch | published TFLOP/s | predicted | error | "
             "predicted bubble | predicted peak GiB |", "|" + "---|" * 14]
    errs = []
    for i in rows:
        r = row(i, dev, not a.no_confirm, not a.eager)
        name, layers, hidden, heads, tp, pp, gpus, batch, published = PAPER[i]
        err = r["tflops"] / published - 1
        errs.append(abs(err))
        conf = (f" (confirmed by compile: {r['confirmed_tflops']:.0f})" if "confirmed_tflops" in r else "")
        lines.append(f"| {name} | {layers} | {hidden} | {heads} | {tp} | {pp} | {r['v']} | {gpus} | {batch} | {published} "
                     f"| {r['tflops']:.0f}{conf} | {err:+.1%} | {r['bubble']:.1%} | {r['peak'] / 2**30:.1f} |")
        print(lines[-1], file=sys.stderr)
    lines.append("")
    lines.append(f"largest |error|: {max(errs):.1%}; mean |error|: {sum(errs) / len(errs):.1%}")
    if a.auto:
        lines += ["", "plan='auto' on the same models and GPU counts (80 GiB budget, a100):", "",
                  "| params | GPUs | chosen | predicted step s | peak GiB | TFLOP/s (paper's count) | TFLOP/s "
                  "(model FLOPs, 72 B s l h^2 ...) | published TFLOP/s | search s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for i in rows:
            r = auto(i, "a100", a.top, not a.eager)
            if "step_s" not in r:
                lines.append(f"| {PAPER[i][0]} | {PAPER[i][6]} | none fits | | | | | {PAPER[i][8]} | {r['seconds']:.0f} |")
                continue
            lines.append(f"| {r['name']} | {PAPER[i][6]} | {r['chosen']}{' (confirmed)' if r['confirmed'] else ''} | "
                         f"{r['step_s']:.2f} | {r['peak'] / 2**30:.1f} | {r['tflops_paper_count']:.0f} | "
                         f"{r['tflops_useful']:.0f} | {PAPER[i][8]} | {r['seconds']:.0f} |")
            print(lines[-1], file=sys.stderr)
    text = "\n".join(lines) + "\n"
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
