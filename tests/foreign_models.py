"""Models nobody on autopar wrote, as factories (``autopar plan tests/foreign_models.py:NAME``):
Hugging Face classes from their configs (tiny, and Llama-3-70B's full-size shapes with few
layers), on the meta device; torch's own ``nn.TransformerEncoder`` as a causal LM; and a model
whose blocks are not all alike. Each returns ``(model, (tokens, targets), loss_fn)``, the batch
global (tests/test_depth.py)."""

from __future__ import annotations

import torch
from torch import nn

from autopar.models.hf_archs import ARCHS, COMMON

LAYERS, BATCH, SEQ = 6, 4, 16  # 6 blocks: the fewest `autopar plan` extrapolates (depths 3-5)
# a small model's shapes (on meta: a compile costs the same at any width); a block's gradients fill
# buckets of their own, as a real model's do (a tiny model's 1 MiB first bucket moves with the depth)
WIDE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=4,
            head_dim=128)


def _ce(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def _batch(batch: int, seq: int) -> tuple:
    tokens = torch.empty((batch, seq), dtype=torch.long, device="meta")
    return tokens, torch.empty_like(tokens)


def hf(name: str, batch: int = BATCH, seq: int = SEQ, **fields):
    """``hf_archs.ARCHS[name]`` at ``LAYERS`` blocks (``fields`` on top of its tiny config), on meta."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    model_type, extra = ARCHS[name]
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra, "num_hidden_layers": LAYERS, **fields})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return model, _batch(batch, seq), _ce


def hf_llama():
    return hf("Llama")


def hf_llama_wide():
    return hf("Llama", **WIDE)


def hf_qwen2():
    return hf("Qwen2", **WIDE)


def hf_mistral():
    return hf("Mistral")


def hf_gpt2():
    return hf("GPT-2", **WIDE)


def hf_mixtral():
    return hf("Mixtral")


def hf_falcon():
    """Falcon: the search's depth 1 is off its blocks' line (forward seconds): figures from depths 2
    and 3. (Its config through ``hf_archs.hf_config``, which leaves ``head_dim``, a property of
    Falcon's config, to the model.)"""
    from transformers import AutoModelForCausalLM

    from autopar.models.hf_archs import hf_config

    model_type, extra = ARCHS["Falcon"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(model_type, extra, num_hidden_layers=LAYERS))
    return model, _batch(BATCH, SEQ), _ce


def hf_mamba():
    """Mamba: its bf16 blocks add to an fp32 residual (``residual_in_fp32``)."""
    return hf("Mamba")


def hf_llama70b_shapes():
    """Llama-3-70B's shapes (hidden 8192, ffn 28672, 64 / 8 heads, vocab 128256) at 6 blocks, 4096 tokens."""
    return hf("Llama", batch=8, seq=4096, vocab_size=128256, hidden_size=8192, intermediate_size=28672,
              num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)


class TorchEncoderLM(nn.Module):
    """torch's own ``nn.TransformerEncoder`` (pre-norm, causal) between an embedding and a head."""

    def __init__(self, vocab: int = 32000, dim: int = 1024, heads: int = 8, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=x.device, dtype=x.dtype)
        return self.head(self.encoder(x, mask=mask, is_causal=True))


def torch_encoder():
    with torch.device("meta"):
        model = TorchEncoderLM()
    return model, _batch(BATCH, SEQ), _ce


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int, gate: float | None = None):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.gate = gate  # (a plain attribute that changes the block's ops where set)

    def forward(self, x):
        h = self.down(nn.functional.gelu(self.up(self.norm(x))))
        return x + (h if self.gate is None else h * torch.sigmoid(h) * self.gate)


class Unalike(nn.Module):
    """Eight blocks of one class, the last four twice as wide inside: not one repeated block."""

    def __init__(self, vocab: int = 128, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, 4 * dim if i < 4 else 8 * dim) for i in range(8))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Alternating(Unalike):
    """Twelve blocks alike in their parameters whose odd ones gate their output (a plain attribute,
    as Gemma 2 alternates its attention window): repeated in units of two blocks, not one."""

    def __init__(self, vocab: int = 128, dim: int = 64):
        super().__init__(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, 4 * dim, None if i % 2 == 0 else 0.5) for i in range(12))


def alternating():
    with torch.device("meta"):
        model = Alternating()
    return model, _batch(BATCH, SEQ), _ce


def hf_gemma2():
    """Gemma 2 at 12 layers: sliding-window and full attention alternate (its config's layer_types)."""
    return hf("Gemma2", num_hidden_layers=2 * LAYERS)


def unalike():
    with torch.device("meta"):
        model = Unalike()
    return model, _batch(BATCH, SEQ), _ce
