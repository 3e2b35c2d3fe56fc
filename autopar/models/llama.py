"""A small Llama/GPT-style decoder, written the way users write theirs.

Nothing here knows about parallelism: module names follow the usual Llama
convention (``embed_tokens``, ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
``gate_proj``/``up_proj``/``down_proj``, ``lm_head``) so that the presets can
recognise them, and ``mlp="gelu"`` gives a GPT-style block (``fc1``/``fc2``
in GPT-2 naming would also be recognised).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    mlp: str = "swiglu"  # or "gelu" (GPT-style)
    tie_embeddings: bool = False
    n_experts: int = 0  # > 0: a mixture-of-experts MLP in every block (top_k routing, per-sequence capacity)
    top_k: int = 2
    capacity_factor: float = 1.25
    moe_dispatch: str = "capacity"  # or "dropless": every token-expert pair computed (autopar/experts.py)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, cache=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        mask = None
        if cache is not None:  # generation: this step's keys / values go into the static cache at their positions
            k_cache, v_cache, positions, mask = cache
            k_cache.index_copy_(2, positions, k)
            v_cache.index_copy_(2, positions, v)
            k, v = k_cache, v_cache  # attend over the whole cache; ``mask`` hides the positions not written yet
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        o = o.transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
            self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
            self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        elif cfg.mlp == "gelu":
            self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim)
            self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim)
        else:
            raise ValueError(f"LlamaConfig.mlp must be 'swiglu' or 'gelu', got {cfg.mlp!r}")

    def forward(self, x):
        if self.kind == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class MoE(nn.Module):
    """Top-k mixture of experts with GShard-style fixed-capacity dispatch (static shapes).

    Each sequence is a routing group: token-expert pairs are queued per expert in (position,
    choice) order and the first ``capacity = ceil(seq * top_k / n_experts * capacity_factor)``
    are kept (the rest pass through the residual only). Experts are stacked SwiGLU weights
    ``[E, dim, ffn]``, applied with batched matmuls (einsum).

    ``moe_dispatch="dropless"``: every token-expert pair is computed, by ``autopar::moe_experts``
    (autopar/experts.py: data-dependent sizes inside one op), which expert parallelism shards.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.top_k, self.n_experts, self.capacity_factor = cfg.top_k, cfg.n_experts, cfg.capacity_factor
        if cfg.moe_dispatch not in ("capacity", "dropless"):
            raise ValueError(f"LlamaConfig.moe_dispatch must be 'capacity' or 'dropless', got {cfg.moe_dispatch!r}")
        self.dropless = cfg.moe_dispatch == "dropless"
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))
        self.w_up = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))
        self.w_down = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_dim, cfg.dim))

    def forward(self, x):
        if self.dropless:
            return self._dropless(x)
        b, s, _ = x.shape
        e, k = self.n_experts, self.top_k
        cap = math.ceil(s * k / e * self.capacity_factor)
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, idx = probs.topk(k, dim=-1)  # [b, s, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        experts = torch.arange(e, device=x.device)
        choice = (idx.unsqueeze(-1) == experts).long().flatten(1, 2)  # [b, s*k, e] one-hot
        pos = choice.cumsum(dim=1) - 1  # queue position of each pair at its expert
        keep = choice * (pos < cap)
        slots = torch.arange(cap, device=x.device)
        slot = (pos.unsqueeze(-1) == slots) * keep.unsqueeze(-1)  # [b, s*k, e, cap]
        slot = slot.view(b, s, k, e, cap).to(x.dtype)
        dispatch = slot.sum(2)  # [b, s, e, cap]
        combine = (slot * weights[..., None, None]).sum(2)
        xe = torch.einsum("bsec,bsd->becd", dispatch, x)
        h = F.silu(torch.einsum("becd,edf->becf", xe, self.w_gate)) * torch.einsum("becd,edf->becf", xe, self.w_up)
        ye = torch.einsum("becf,efd->becd", h, self.w_down)
        return torch.einsum("bsec,becd->bsd", combine, ye)

    def _dropless(self, x):
        from autopar.experts import moe_experts

        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, idx = probs.topk(self.top_k, dim=-1)  # [b*s, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        return moe_experts(flat, idx, weights, self.w_gate, self.w_up, self.w_down).view(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one parameter, read by the embedding and the LM head
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None):
        g = None if seed is None else torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            with torch.no_grad():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                elif p.ndim == 1:
                    p.zero_()
                else:
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)

    def forward(self, tokens, kv_cache=None, positions=None):
        """Logits ``[batch, seq, vocab]``. With ``kv_cache`` (generation, autopar/runtime/generate.py):
        ``tokens`` sit at ``positions`` (``[seq]``, the same for every sequence), ``kv_cache`` is a
        (keys, values) pair per layer, each ``[batch, n_kv_heads, max_len, head_dim]``; this step's
        keys and values are written into it in place, and every position attends to the cached
        positions up to its own."""
        s = tokens.shape[1]
        x = self.embed_tokens(tokens)
        if kv_cache is None:
            cos, sin = self.rope_cos[:s].to(x.dtype), self.rope_sin[:s].to(x.dtype)  # bf16 under mixed precision
            for layer in self.layers:
                x = layer(x, cos, sin)
        else:
            cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
            max_len = kv_cache[0][0].shape[2]
            mask = torch.arange(max_len, device=tokens.device) <= positions[:, None]  # [seq, max_len]
            for layer, (k_cache, v_cache) in zip(self.layers, kv_cache):
                x = layer(x, cos, sin, (k_cache, v_cache, positions, mask))
        return self.lm_head(self.norm(x))


def cross_entropy(logits, targets):
    """The usual next-token loss: mean over every token of the global batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
