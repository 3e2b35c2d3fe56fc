"""Tensor parallelism derived from the graph: sharded values contracted with each other, one of
several fused parts picked by an index (capture and derivation only; the numbers against one
process: tests/test_hf_breadth.py's DeepSeek-V3.2 and Moshi cases)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Replicate, Shard

from autopar import torch_compat as tc
from autopar.analysis.tensor_parallel import derive
from autopar.capture import capture_graph


def _derived(model, inputs, loss_fn, tp=2):
    gm = capture_graph(model, inputs, loss_fn)
    return derive(gm, model, tp).decisions


def _ce(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


class Indexer(nn.Module):
    """A sparse-attention indexer's shape (DeepSeek-V3.2's): per-head queries and per-head
    weights, summed over the heads into one score per (query, key); the top k keys of each
    query kept by a mask. ``whole``: the per-head weights a fixed buffer, not a projection."""

    def __init__(self, dim=16, heads=4, hd=8, vocab=32, whole=False):
        super().__init__()
        self.heads, self.hd = heads, hd
        self.emb = nn.Embedding(vocab, dim)
        self.wq = nn.Linear(dim, heads * hd, bias=False)
        self.wk = nn.Linear(dim, hd, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.w = nn.Linear(dim, heads, bias=False)
        if whole:
            self.register_buffer("fixed", torch.linspace(0.5, 1.5, heads))
        self.whole = whole
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd)
        k = self.wk(x)
        scores = torch.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)))  # [b, s, h, s]
        w = self.fixed.expand(b, s, self.heads) if self.whole else self.w(x)
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # sum over heads: [b, s, s]
        keep = torch.zeros_like(index).scatter(-1, index.topk(3, dim=-1).indices, 1.0).bool()
        att = torch.softmax(torch.einsum("bsd,btd->bst", x, x).masked_fill(~keep, -1e9), -1)
        return self.out(x + att @ self.wv(x))


def test_values_sharded_alike_are_contracted_into_a_partial_sum():
    """The indexer's queries and its per-head weights are both split by heads; their contraction
    over the heads gives each rank a partial sum (all-reduced before the top-k): both projections
    column-parallel, the reason naming the contraction. The key projection (one head) is whole."""
    tokens = torch.randint(0, 32, (2, 8))
    dec = _derived(Indexer(), (tokens, tokens), _ce)
    for w in ("wq.weight", "w.weight"):
        assert dec[w].placement == Shard(0) and dec[w].role == "column", (w, dec[w])
        assert "contracted with another sharded value by matmul" in dec[w].why, dec[w].why
    assert dec["wk.weight"].placement == Replicate()


def test_a_contraction_with_a_value_no_flow_shards_slices_it_locally():
    """The per-head weights a buffer (no gradient): each rank takes its heads of it; the queries
    still column-parallel."""
    tokens = torch.randint(0, 32, (2, 8))
    dec = _derived(Indexer(whole=True), (tokens, tokens), _ce)
    assert dec["wq.weight"].placement == Shard(0), dec["wq.weight"]


class PickedParts(nn.Module):
    """Moshi's gating MLP: [gate | up] in one weight, viewed [.., 2, ffn] and picked by index."""

    def __init__(self, dim=16, ffn=32, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, dim, bias=False)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        h = self.fc1(x).view(*x.shape[:2], 2, -1)
        return self.out(x + self.fc2(nn.functional.silu(h[..., 0, :]) * h[..., 1, :]))


def test_a_part_picked_by_index_makes_the_weight_strided_by_its_parts():
    tokens = torch.randint(0, 32, (2, 8))
    dec = _derived(PickedParts(), (tokens, tokens), _ce)
    assert dec["fc1.weight"].placement == tc.StridedShard(0, split_factor=2), dec["fc1.weight"]
    assert dec["fc2.weight"].placement == Shard(1) and dec["fc2.weight"].role == "row"


class Heads(nn.Module):
    """Attention over heads on the residual stream (q, k, v and o projections, an LM head), with
    ``between(q, k)`` applied to the queries and keys and ``after(x, a)`` to the attention's output
    (both [b, s, heads, head_dim]): what the tests below vary."""

    def __init__(self, dim=16, heads=4, vocab=32):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, vocab, bias=False)

    def between(self, q, k):
        return q, k

    def after(self, x, a):
        return a

    def forward(self, tokens):
        x = self.emb(tokens)
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1) for p in self.qkv)
        q, k = self.between(q, k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.out(x + self.o(self.after(x, a).reshape(b, s, d)))


class L2Heads(Heads):
    """Queries and keys scaled per head and clipped to a length (torch.linalg.vector_norm over
    head_dim, Inkling2's scaled l2 clip): a reduction over another dim than the heads."""

    def __init__(self, dim=16, heads=4, vocab=32):
        super().__init__(dim, heads, vocab)
        self.scale = nn.Parameter(torch.ones(heads, dim // heads))

    def between(self, q, k):
        def clip(t):
            t = t.float() * self.scale.float()
            return t * (1.0 / (torch.linalg.vector_norm(t, dim=-1, keepdim=True) + 1e-6)).clamp(max=1.0)

        return clip(q), clip(k)


def test_a_vector_norm_over_the_head_dim_keeps_the_heads_sharded():
    tokens = torch.randint(0, 32, (2, 8))
    dec = _derived(L2Heads(), (tokens, tokens), _ce)
    assert [dec[f"qkv.{i}.weight"].role for i in range(3)] == ["column"] * 3
    assert dec["o.weight"].role == "row"


class GatedHeads(Heads):
    """An output gate per head, shaped by the attention's output (Beam's
    ``gate_proj(x).view_as(attn_output) + gate_bias[None, None, :, None]``)."""

    def __init__(self, dim=16, heads=4, vocab=32):
        super().__init__(dim, heads, vocab)
        self.gate = nn.Linear(dim, dim, bias=False)
        self.gate_bias = nn.Parameter(torch.zeros(heads))

    def after(self, x, a):
        return a * torch.sigmoid(self.gate(x).view_as(a) + self.gate_bias[None, None, :, None])


def test_a_value_shaped_like_a_sharded_one_by_view_as_is_sharded_with_it():
    """``view_as(a)`` reads only a's shape: the q / k / v flows go on past it, and the gate, viewed
    per head, is column-parallel with its bias by heads."""
    tokens = torch.randint(0, 32, (2, 8))
    dec = _derived(GatedHeads(), (tokens, tokens), _ce)
    assert [dec[f"qkv.{i}.weight"].role for i in range(3)] + [dec["gate.weight"].role] == ["column"] * 4
    assert dec["gate_bias"].placement == Shard(0) and dec["o.weight"].role == "row"


class GroupedOut(nn.Module):
    """DeepSeek-V4's shape: one key / value head repeated for every query head (expand + reshape,
    then transposed for ``q @ k^T``), and a grouped output projection whose weight is read as
    ``W.view(groups, -1, k).transpose(1, 2)`` in a bmm over the head groups."""

    def __init__(self, dim=16, heads=4, hd=4, groups=2, rank=8, vocab=32):
        super().__init__()
        self.heads, self.hd, self.groups = heads, hd, groups
        self.emb = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, heads * hd, bias=False)
        self.kv = nn.Linear(dim, hd, bias=False)
        self.o_a = nn.Parameter(torch.randn(groups * rank, heads * hd // groups) / 4)
        self.o_b = nn.Linear(groups * rank, dim, bias=False)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        kv = self.kv(x).view(b, s, 1, self.hd).transpose(1, 2)  # one head
        kv = kv[:, :, None].expand(b, 1, self.heads, s, self.hd).reshape(b, self.heads, s, self.hd)
        a = torch.softmax(torch.matmul(q, kv.transpose(2, 3)), -1) @ kv  # [b, h, s, hd]
        g = a.transpose(1, 2).reshape(b * s, self.groups, -1).transpose(0, 1)  # [groups, b*s, h*hd/groups]
        w = self.o_a.view(self.groups, -1, g.shape[-1]).transpose(1, 2)
        y = torch.bmm(g, w).transpose(0, 1).reshape(b, s, -1)
        return self.out(x + self.o_b(y))


def test_a_transposed_broadcast_head_and_a_grouped_weight_read_through_a_transpose():
    """The one key / value head, transposed, is seen as the same on every rank's heads; the
    grouped weight, seen back through its transpose and view, is split by groups with the heads:
    q column-parallel, the grouped weight sharded with it, the mixing projection row-parallel."""
    tokens = torch.randint(0, 32, (2, 8))
    dec = _derived(GroupedOut(), (tokens, tokens), _ce)
    assert dec["q.weight"].role == "column", dec["q.weight"]
    assert dec["o_a"].placement == Shard(0) and dec["o_a"].role == "with-column", dec["o_a"]
    assert dec["o_b.weight"].role == "row" and dec["kv.weight"].placement == Replicate()
