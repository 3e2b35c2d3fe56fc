"""A pipeline rank's step peak: the cost model's prediction against the allocator, per rank.

    .venv/bin/python benchmarks/pipeline_memory.py

Built-in Llama (dim 256, 4 layers, vocab 2048), batch 8 x seq 128, 4 micro-batches, fp32 unless
said, AdamW; two warm-up steps, then one step under ``pm.track_memory()``. Measured: the
allocator's peak over the step without gloo's own buffers (autopar/runtime/measure.py: the CPU
allocator's events through torch.profiler; it reads no graph). Predicted:
``analysis.cost.predict_memory`` (saved activations walked through the rank's action list, the
gradient sums each stage holds from its first backward, the running part's transient, the sync).
"""

from __future__ import annotations

import sys
import warnings

CASES = [  # (ranks, mesh, plan, compile options)
    (2, {"pp": 2}, {"pp": {"schedule": "1f1b", "microbatches": 4}}, {}),
    (2, {"pp": 2}, {"pp": {"schedule": "interleaved", "microbatches": 4, "virtual": 2}}, {}),
    (2, {"pp": 2}, {"pp": {"schedule": "zb", "microbatches": 4}}, {}),
    (2, {"pp": 2}, {"pp": {"schedule": "gpipe", "microbatches": 4}}, {}),
    (2, {"pp": 2}, {"pp": {"schedule": "1f1b", "microbatches": 4}}, {"precision": "bf16"}),
    (4, {"pp": 2, "dp": 2}, {"pp": {"schedule": "1f1b", "microbatches": 4}, "dp": "zero2"}, {}),
    (4, {"pp": 2, "dp": 2}, {"pp": {"schedule": "1f1b", "microbatches": 4}, "dp": "fsdp"}, {}),
    (4, {"pp": 2, "tp": 2}, {"pp": {"schedule": "1f1b", "microbatches": 4}, "tp": "megatron"}, {}),
]


def job(axes, plan, options):
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.analysis.cost import predict_memory
    from autopar.models import zoo

    warnings.simplefilter("ignore")
    over = dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768)
    loaded = zoo.load("llama-small", meta=False, batch=8, seq=128, overrides=over)
    pm = autopar.compile(loaded.model, autopar.mesh(**axes), example_inputs=loaded.example_inputs,
                         loss_fn=loaded.loss_fn, plan=plan, capture_eval=False, **options)
    predicted = predict_memory(pm)["program_peak"]
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for _ in range(2):
        pm.train_step(*loaded.example_inputs)
        opt.step()
        opt.zero_grad()
    pm.track_memory()
    pm.train_step(*loaded.example_inputs)
    opt.step()
    m = pm.memory_report(opt)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (predicted, m["program_peak_without_backend"] or m["program_peak"]))
    return everyone


def main() -> int:
    from autopar.testing import DistPool

    print("| mesh | plan | options | per rank: predicted / measured MiB (ratio) |")
    print("|---|---|---|---|")
    for world in sorted({c[0] for c in CASES}):
        pool = DistPool(world)
        try:
            for w, axes, plan, options in CASES:
                if w != world:
                    continue
                ranks = pool.run(job, axes, plan, options)
                cells = ", ".join(f"r{i} {p / 2**20:.2f} / {m / 2**20:.2f} ({p / m:.2f})"
                                  for i, (p, m) in enumerate(ranks))
                mesh = " x ".join(f"{k}={v}" for k, v in axes.items())
                pl = ", ".join(f"{k}={v['schedule'] if isinstance(v, dict) else v}" for k, v in plan.items())
                print(f"| {mesh} | {pl} | {options or ''} | {cells} |", flush=True)
        finally:
            pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
