"""Does the cost model's view of ``compile(inductor=True)`` match what Inductor buys on this CPU?

    .venv/bin/python benchmarks/fusion_check.py [--steps 15]

One process (a one-rank gloo group), the built-in Llama at two shapes: the same per-rank program
run op by op (``inductor=False``) and compiled by Inductor (``inductor=True``), alternating step
by step in the same process (forward + backward, ``train_step``, no optimizer). Measured: the
median wall time of each. Predicted: the cost model's simulation of the same program on the
calibrated ``cpu`` device row, op by op and with its kernels fused as Inductor fuses them (``cost.Fusion``).
Independent sides: the wall clock against the cost model. The figure compared is the speed-up
(eager / compiled), measured against predicted, and each side's absolute time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

SHAPES = {  # name: (LlamaConfig fields, batch, seq)
    "matmul-bound (dim 256, 4 layers)": (dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=1024,
                                              ffn_dim=704), 8, 128),
    "elementwise-heavy (dim 64, 2 layers)": (dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                                  ffn_dim=176), 16, 256),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import autopar
    from autopar.analysis import cost
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    dev = cost.get_device("cpu")
    print("| shape | eager measured ms | eager predicted ms | compiled measured ms | compiled predicted ms | "
          "speed-up measured | speed-up predicted |")
    print("|---|---|---|---|---|---|---|")
    for name, (fields, batch, seq) in SHAPES.items():
        cfg = LlamaConfig(**fields, max_seq_len=seq)
        torch.manual_seed(0)
        x = torch.randint(0, cfg.vocab_size, (batch, seq))
        y = torch.randint(0, cfg.vocab_size, (batch, seq))
        pms, pred = {}, {}
        for compiled in (False, True):
            torch.manual_seed(0)
            pm = autopar.compile(Llama(cfg), autopar.mesh(dp=1), example_inputs=(x, y), loss_fn=cross_entropy,
                                 plan={"dp": "ddp"}, capture_eval=False, inductor=compiled)
            links = cost.axis_links(pm.ctx.axis_names, pm.ctx.axis_sizes, dev)
            pred[compiled] = cost.simulate(pm.program.local, dev, links, 1.0, fused=compiled).step_s
            pms[compiled] = pm
            for _ in range(3):
                pm.train_step(x, y)  # (Inductor compiles on the first step)
        times = {False: [], True: []}
        for _ in range(a.steps):
            for compiled in (False, True):
                t = time.perf_counter()
                pms[compiled].train_step(x, y)
                times[compiled].append(time.perf_counter() - t)
        m = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {name} | {m[False] * 1e3:.1f} | {pred[False] * 1e3:.1f} | {m[True] * 1e3:.1f} | "
              f"{pred[True] * 1e3:.1f} | {m[False] / m[True]:.2f} | {pred[False] / pred[True]:.2f} |", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
