"""Host memory of ``pm.load_pretrained`` per rank against the model's size, 2 gloo ranks:

    .venv/bin/python benchmarks/pretrained_memory.py [--hidden 1536 --inter 4096 --layers 4 --vocab 32000]

A Hugging Face Llama of that config (random weights, bf16) is saved with save_pretrained in
100 MB files; then, on 2 ranks, for each plan: the model built under ``autopar.init_empty_weights()``,
compiled (fp32 parameters) and loaded with ``load_pretrained``. Per rank: the bytes its slices
read (as stored), its fp32 shards (what it must hold after the load), and the peak resident
memory during the load above the level before it (VmHWM reset through /proc/self/clear_refs;
it counts the fp32 shards being filled, the bf16 slices read, and the checkpoint pages the
safetensors mmap touched). Against: every rank loading the whole model with ``from_pretrained``
(fp32), what a loader that does not shard costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch


def _config(a):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                      num_attention_heads=a.hidden // 128, num_key_value_heads=a.hidden // 128 // 2,
                      max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def load_job(path: str, a, axes: dict, plan: dict) -> list:
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import autopar
    from autopar.runtime.common import local_tensor
    from autopar.testing import _ce

    with autopar.init_empty_weights():
        model = LlamaForCausalLM(_config(a))
    x = torch.randint(0, a.vocab, (4, 16))
    t0 = time.perf_counter()
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=(x, x), loss_fn=_ce, plan=plan,
                         capture_eval=False)
    compile_s = time.perf_counter() - t0
    rep = pm.load_pretrained(path, verbose=False)
    shards = sum(local_tensor(p).numel() * p.element_size() for p in pm.parameters())
    row = (dist.get_rank(), rep.bytes_read, shards, rep.rss_peak - rep.rss_before, rep.rss_after - rep.rss_before,
           rep.seconds, compile_s, rep.model_bytes)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, row)
    return everyone


def baseline_job(path: str) -> list:
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from autopar.runtime.weights import _proc_status, _reset_peak_rss

    _reset_peak_rss()
    before = _proc_status("VmRSS")
    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    row = (dist.get_rank(), _proc_status("VmHWM") - before, time.perf_counter() - t0,
           sum(p.numel() * p.element_size() for p in model.parameters()))
    del model
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, row)
    return everyone


def main():
    from transformers import LlamaForCausalLM

    from autopar.testing import DistPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--inter", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ckpt", default=None, help="a folder to save the checkpoint to (default: a temporary one)")
    a = ap.parse_args()
    path = a.ckpt or tempfile.mkdtemp(prefix="autopar-hf-")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        LlamaForCausalLM(_config(a)).to(torch.bfloat16).save_pretrained(path, max_shard_size="100MB")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    mib = 2 ** 20
    print(f"checkpoint: {len(files)} files, {sum(os.path.getsize(os.path.join(path, f)) for f in files) / mib:.0f} MiB "
          f"(bf16); config hidden {a.hidden}, intermediate {a.inter}, {a.layers} layers, vocab {a.vocab}")
    try:
        print("| plan | rank | read (MiB) | of the checkpoint | fp32 shards held (MiB) | peak RSS during the load "
              "(MiB above before) | RSS after (MiB above before) | load s |")
        print("|---|---|---|---|---|---|---|---|")
        for label, axes, plan in [("fsdp dp=2", {"dp": 2}, {"dp": "fsdp"}),
                                  ("megatron tp=2", {"tp": 2}, {"tp": "megatron"}),
                                  ("pp=2 1f1b", {"pp": 2}, {"pp": "1f1b"})]:
            pool = DistPool(2)  # fresh processes for each case: nothing a previous one freed blurs the figures
            for rank, read, shards, peak, after, secs, _, model in pool.run(load_job, path, a, axes, plan):
                print(f"| {label} | {rank} | {read / mib:.0f} | {read / model:.0%} | {shards / mib:.0f} | "
                      f"{peak / mib:.0f} | {after / mib:.0f} | {secs:.2f} |")
                sys.stdout.flush()
            pool.close()
        pool = DistPool(2)
        for rank, peak, secs, full in pool.run(baseline_job, path):
            print(f"| from_pretrained on every rank | {rank} | {full / 2 / mib:.0f} | 100% | {full / mib:.0f} | "
                  f"{peak / mib:.0f} | | {secs:.2f} |")
        pool.close()
    finally:
        if a.ckpt is None:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
