"""The megatron preset recognises Llama / GPT / Qwen-style names without being told."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

import autopar
from autopar.testing import build_model


def hf_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    x = torch.randint(0, 256, (4, 16))
    return model, [(x, x)], lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(0, 1))


@pytest.mark.parametrize("name", ["llama", "gpt", "hf_llama", "hf_qwen2"])
def test_megatron_preset_places_every_parameter(fake, name):
    model, batches, loss_fn = hf_qwen2() if name == "hf_qwen2" else build_model(name)
    with fake(tp=2) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"tp": "megatron"},
                             capture_eval=False)
    assert pm.ctx.placed.unplaced == {}
    placements = {n: p.placements[0] for n, p in pm.named_parameters()}
    for n, p in placements.items():
        if any(k in n for k in ("q_proj.weight", "k_proj.weight", "up_proj.weight", "q_proj.bias")):
            assert p == Shard(0), n
        elif any(k in n for k in ("o_proj.weight", "down_proj.weight")):
            assert p == Shard(1), n
        elif "norm" in n:
            assert p == Replicate(), n
    assert all(isinstance(placements[n], Shard) for n in placements if "embed_tokens" in n or "lm_head" in n)
    # and the logits stay vocab-sharded through the loss
    assert not [r for r in pm.collectives() if r.kind == "all_gather"]
