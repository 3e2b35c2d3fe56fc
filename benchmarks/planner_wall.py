"""Wall time of `autopar plan` on a factory's model against the built-in with the same shapes.

    python benchmarks/planner_wall.py [--rounds 2] [--only fixed|auto]

The factories below build Hugging Face ``LlamaForCausalLM`` on the meta device from Llama-3's
configs, as a user's ``mypkg.models:llama70b`` would (this file is their module:
``autopar plan benchmarks/planner_wall.py:hf_llama70b ...``). Each round runs, one after the
other (the machine's speed drifts with the hour: compare within a round), ``autopar plan --help``
(Python, torch and autopar starting: the yardstick), then each command of a pair: the built-in
and the factory, each cold (an empty trace cache: the first plan of a model) and warm (the cache
an earlier run of the same command filled, autopar/disk_cache.py: a user's next plan of it).
Prints each wall time and its ratio to the round's ``--help``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from autopar import disk_cache


def _hf(batch: int, seq: int, **fields):
    import transformers

    cfg = transformers.LlamaConfig(use_cache=False, tie_word_embeddings=False, max_position_embeddings=8192,
                                   rope_theta=500000.0, vocab_size=128256, num_key_value_heads=8, **fields)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    tokens = torch.empty((batch, seq), dtype=torch.long, device="meta")

    def loss(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    return model, (tokens, torch.empty_like(tokens)), loss


def hf_llama70b():
    """Llama-3-70B's shapes, batch 128 x 4096 tokens (the issue's factory)."""
    return _hf(128, 4096, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)


def hf_llama8b():
    """Llama-3-8B's shapes, batch 8 x 2048 (hf-llama3-8b's defaults)."""
    return _hf(8, 2048, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)


def hf_phi3_medium():
    """Phi-3-medium's shapes (40 query heads, 10 key / value heads fused in one qkv_proj: cut into one
    parameter per part under tensor parallelism, autopar/unfuse.py), batch 64 x 4096, on meta."""
    import transformers

    cfg = transformers.Phi3Config(hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                                  num_attention_heads=40, num_key_value_heads=10, vocab_size=32064,
                                  max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Phi3ForCausalLM(cfg)
    tokens = torch.empty((64, 4096), dtype=torch.long, device="meta")

    def loss(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    return model, (tokens, torch.empty_like(tokens)), loss


HERE = os.path.abspath(__file__)
BF16 = ["--precision", "bf16"]
PAIRS = {
    "fixed": [
        ("70B fixed, 1,024 ranks",
         ["llama3-70b", "--batch", "128", "--seq", "4096", "--mesh", "dp=128,tp=8", "--plan", "dp=fsdp,tp=megatron", *BF16],
         [f"{HERE}:hf_llama70b", "--mesh", "dp=128,tp=8", "--plan", "dp=fsdp,tp=megatron", *BF16]),
        ("70B fixed, 1,024 ranks, against the same transformers class built in",
         ["hf-llama3-70b", "--batch", "128", "--seq", "4096", "--mesh", "dp=128,tp=8", "--plan", "dp=fsdp,tp=megatron",
          *BF16],
         [f"{HERE}:hf_llama70b", "--mesh", "dp=128,tp=8", "--plan", "dp=fsdp,tp=megatron", *BF16]),
        ("8B fixed, 64 ranks",
         ["hf-llama3-8b", "--mesh", "dp=8,tp=8", "--plan", "dp=fsdp,tp=megatron", *BF16],
         [f"{HERE}:hf_llama8b", "--mesh", "dp=8,tp=8", "--plan", "dp=fsdp,tp=megatron", *BF16]),
    ],
    "auto": [
        ("70B --plan auto, 1,024 ranks",
         ["llama3-70b", "--batch", "128", "--seq", "4096", "--plan", "auto", "--world", "1024", "--budget", "80GiB",
          "--device", "h100", *BF16],
         [f"{HERE}:hf_llama70b", "--plan", "auto", "--world", "1024", "--budget", "80GiB", "--device", "h100", *BF16]),
        ("70B --plan auto, 1,024 ranks, against the same transformers class built in",
         ["hf-llama3-70b", "--batch", "128", "--seq", "4096", "--plan", "auto", "--world", "1024", "--budget", "80GiB",
          "--device", "h100", *BF16],
         [f"{HERE}:hf_llama70b", "--plan", "auto", "--world", "1024", "--budget", "80GiB", "--device", "h100", *BF16]),
    ],
}


def _wall(argv: list[str], cache: str | None = None) -> float:
    """Seconds of ``autopar plan ARGV -q``; ``cache``: its trace cache directory (autopar/disk_cache.py)."""
    exe = os.path.join(os.path.dirname(sys.executable), "autopar")
    env = dict(os.environ, **({"AUTOPAR_CACHE_DIR": cache} if cache else {}))
    t0 = time.perf_counter()
    subprocess.run([exe, "plan", *argv, "-q"], check=True, stdout=subprocess.DEVNULL, env=env)
    took = time.perf_counter() - t0
    # (untimed: the trace cache's writer, which the command leaves behind it, done before the next run)
    disk_cache.wait_for_writers(env.get("AUTOPAR_CACHE_DIR"))
    return took


def _side(argv: list[str], warm_dir: str, help_s: float) -> tuple[str, float, float]:
    """One command cold (a new, empty trace cache) and warm (``warm_dir``, filled by an earlier run
    of the same command: what a user's second plan of the model reads)."""
    with tempfile.TemporaryDirectory() as empty:
        cold = _wall(argv, empty)
    warm = _wall(argv, warm_dir)
    return f"cold {cold:.1f} s ({cold / help_s:.1f}x --help), warm {warm:.1f} s ({warm / help_s:.1f}x)", cold, warm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", choices=list(PAIRS), default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for kind, pairs in PAIRS.items():
            if args.only and kind != args.only:
                continue
            for i, (what, builtin, factory) in enumerate(pairs):
                dirs = [os.path.join(root, f"{kind}{i}-{side}") for side in ("builtin", "factory")]
                for argv, d in zip((builtin, factory), dirs):
                    _wall(argv, d)  # (untimed: the warm side's cache)
                for r in range(args.rounds):
                    help_s = _wall(["--help"])
                    b, b_cold, b_warm = _side(builtin, dirs[0], help_s)
                    f, f_cold, f_warm = _side(factory, dirs[1], help_s)
                    print(f"{what} (round {r + 1}): --help {help_s:.1f} s; built-in {b}; factory {f} "
                          f"(cold {f_cold / b_cold:.2f}x, warm {f_warm / b_warm:.2f}x the built-in)", flush=True)


if __name__ == "__main__":
    main()
