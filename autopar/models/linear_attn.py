"""A small chunked linear-attention model, written here rather than taken from a library
(tests/test_tp_linear_attn.py): the shapes of program that hybrid and linear-attention language
models (Kimi-Linear, Bailing, Qwen3-Next's gated delta rule, RWKV) and Llama-4's experts give the
tensor-parallel derivation, in a few lines.

Per block:

- separate q, k, v projections joined by ``cat`` along the projected dim, one depthwise causal
  conv1d over all three (``F.pad`` on the left, ``groups`` = channels), ``split`` back into heads;
- a chunked causal scan: per chunk of the sequence, ``(q k^T).tril() v`` plus the carried state,
  written into a fresh output buffer with ``out[:, :, a:b] = ...`` (``setitem``); the state
  decays by a per-head parameter seen through ``zeros(...) + decay.view(...)``;
- the output projection back into the residual stream;
- stacked experts multiplied with ``torch.bmm`` (``[E, T, D] @ [E, D, 2F]``, gate | up fused,
  then ``[E, T, F] @ [E, F, D]``), the tokens dealt to the experts in equal groups (no router:
  the result does not depend on a top-k that ties could flip).

Megatron's plan for it: q, k, v column-parallel by heads, the conv's filters strided over the three
parts, the decay sharded by heads, the output projection row-parallel; the experts' gate | up
split on F in two parts, their down projection row-parallel. With ``wide=2`` (values twice as
wide, as a gated delta net's) the three parts are unequal: the conv's filters are cut into one
parameter per part (autopar/unfuse_find.py) and each part is convolved sharded by its heads.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, kernel: int = 3, chunk: int = 4, experts: int = 2,
                 ffn: int = 32, wide: int = 1):
        super().__init__()
        self.heads, self.kernel, self.chunk, self.experts, self.wide = heads, kernel, chunk, experts, wide
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k = (nn.Linear(dim, dim, bias=False) for _ in range(2))
        self.v = nn.Linear(dim, wide * dim, bias=False)  # (wide > 1: values wider than keys, as GDN's)
        ch = (2 + wide) * dim
        self.conv = nn.Conv1d(ch, ch, kernel, groups=ch, bias=False)
        self.decay = nn.Parameter(torch.linspace(0.5, 2.0, heads))
        self.o = nn.Linear(wide * dim, dim, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(experts, dim, 2 * ffn) / dim ** 0.5)
        self.w_down = nn.Parameter(torch.randn(experts, ffn, dim) / ffn ** 0.5)

    def forward(self, x):
        B, S, D = x.shape
        H, C = self.heads, self.chunk
        h = self.norm1(x)
        qkv = torch.cat((self.q(h), self.k(h), self.v(h)), dim=-1).transpose(1, 2)  # [B, 3D, S]
        qkv = F.conv1d(F.pad(qkv, (self.kernel - 1, 0)), self.conv.weight, groups=qkv.shape[1])
        qkv = F.silu(qkv).transpose(1, 2)
        q, k, v = (t.reshape(B, S, H, -1).transpose(1, 2) for t in qkv.split([D, D, self.wide * D], dim=-1))
        keep = torch.sigmoid(torch.zeros(B, H, 1, 1) + self.decay.view(1, -1, 1, 1))
        out = torch.zeros_like(v)
        state = torch.zeros(B, H, D // H, self.wide * D // H)
        for a in range(0, S, C):
            qc, kc, vc = q[:, :, a:a + C], k[:, :, a:a + C], v[:, :, a:a + C]
            out[:, :, a:a + C] = (qc @ kc.transpose(-1, -2)).tril() @ vc + qc @ state
            state = state * keep + kc.transpose(-1, -2) @ vc
        x = x + self.o(out.transpose(1, 2).reshape(B, S, -1))
        t = self.norm2(x).reshape(self.experts, -1, D)
        gate, up = torch.bmm(t, self.w_gate_up).chunk(2, dim=-1)
        return x + torch.bmm(F.silu(gate) * up, self.w_down).reshape(B, S, D)


class LinearAttnLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, wide: int = 1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, wide=wide) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.layers:
            x = blk(x)
        return self.head(self.norm(x))


def build(seed: int = 0, wide: int = 1):
    """(model, batches, loss_fn): global batches of 4 x 8 tokens. ``wide``: values ``wide`` times
    as wide as queries and keys (2: q, k, v of unequal widths before the one conv)."""
    torch.manual_seed(seed)
    model = LinearAttnLM(wide=wide)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
               for _ in range(2)]
    return model, batches, lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())
