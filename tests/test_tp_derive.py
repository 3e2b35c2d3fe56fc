"""Megatron's plan derived from the captured graph (autopar/analysis/tensor_parallel.py), not from
layer names: which matmul is column- or row-parallel, fused projections strided by parts, what is
replicated and why, and Megatron's communication count. On the capture alone or a fake process
group: seconds, no processes (the numerics against one process: tests/test_hf_breadth.py and
benchmarks/hf_breadth.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Replicate, Shard

import autopar
from autopar import torch_compat as tc
from autopar.analysis.tensor_parallel import derive
from autopar.capture import capture_graph

R = Replicate()
_StridedShard = tc.StridedShard  # torch's private placement, through the boundary


def _derived(model, inputs, loss_fn=None, tp=2):
    gm = capture_graph(model, inputs, loss_fn)
    return derive(gm, model, tp).decisions


def _hf(name, **overrides):
    from autopar.models.hf_archs import build_hf

    model, batches, loss_fn = build_hf(name, num_hidden_layers=1, **overrides)
    return model, batches[0], loss_fn


# (architecture, {parameter suffix: (placement, role)}) for block 0 and the ends of the model
CASES = {
    "Llama": {"self_attn.q_proj.weight": (Shard(0), "column"), "self_attn.k_proj.weight": (Shard(0), "column"),
              "self_attn.o_proj.weight": (Shard(1), "row"), "mlp.gate_proj.weight": (Shard(0), "column"),
              "mlp.down_proj.weight": (Shard(1), "row"), "input_layernorm.weight": (R, "replicated"),
              "embed_tokens.weight": (Shard(0), "vocab"), "lm_head.weight": (Shard(0), "vocab")},
    # Conv1D: weights stored [in, out] (addmm(b, x, W)); q, k, v fused and split after the matmul
    "GPT-2": {"attn.c_attn.weight": (_StridedShard(1, split_factor=3), "column"),
              "attn.c_attn.bias": (_StridedShard(0, split_factor=3), "with-column"),
              "attn.c_proj.weight": (Shard(0), "row"), "attn.c_proj.bias": (R, "replicated"),
              "mlp.c_fc.weight": (Shard(1), "column"), "mlp.c_proj.weight": (Shard(0), "row"),
              "wpe.weight": (R, "replicated"), "wte.weight": (Shard(0), "vocab")},
    # attention and MLP in parallel off one norm; partial rotary (slices of the head dim)
    "GPT-J": {"attn.q_proj.weight": (Shard(0), "column"), "attn.out_proj.weight": (Shard(1), "row"),
              "mlp.fc_in.weight": (Shard(0), "column"), "mlp.fc_in.bias": (Shard(0), "with-column"),
              "mlp.fc_out.weight": (Shard(1), "row")},
    # fused query_key_value viewed per head as [.., heads, 3 * head_dim]: a plain shard is per head
    "GPT-NeoX": {"attention.query_key_value.weight": (Shard(0), "column"), "attention.dense.weight": (Shard(1), "row"),
                 "embed_in.weight": (Shard(0), "vocab"), "lm_head.weight": (Shard(0), "vocab")},
    # a norm over the whole projected q and k: sharded in the second pass, its statistic all-reduced
    # multi-query (one KV head for all query heads, fewer than the ranks): q and o sharded by
    # heads, k and v held whole; the repeated head reaches every rank's query heads as it is
    "Llama-MQA": {"self_attn.q_proj.weight": (Shard(0), "column"), "self_attn.k_proj.weight": (R, "replicated"),
                  "self_attn.v_proj.weight": (R, "replicated"), "self_attn.o_proj.weight": (Shard(1), "row")},
    "OLMo2": {"self_attn.q_proj.weight": (Shard(0), "column"), "self_attn.q_norm.weight": (Shard(0), "with-column"),
              "self_attn.o_proj.weight": (Shard(1), "row")},
    # the router's softmax is over the experts: replicated, whatever it is called
    "Mixtral": {"mlp.gate.weight": (R, "replicated"), "self_attn.q_proj.weight": (Shard(0), "column"),
                # stacked experts [E, 2 x ffn, hidden] / [E, hidden, ffn] through an op with no table
                # entry (transformers' grouped_mm_fallback): followed by running it
                "mlp.experts.gate_up_proj": (_StridedShard(1, split_factor=2), "column"),
                "mlp.experts.down_proj": (Shard(2), "row")},
    # MLA: the latent down-projections are reduced by a norm over their whole output (replicated,
    # as Megatron does); the up-projections are split by heads, the keys assembled by slice
    # assignment into a fresh buffer ([k_nope | k_rope]: the rope part broadcast to every head)
    "DeepSeek-V3": {"self_attn.q_b_proj.weight": (Shard(0), "column"), "self_attn.kv_b_proj.weight": (Shard(0), "column"),
                    "self_attn.o_proj.weight": (Shard(1), "row"), "self_attn.q_a_proj.weight": (R, "replicated"),
                    "self_attn.kv_a_proj_with_mqa.weight": (R, "replicated")},
    # Mamba: in_proj's [x | gate] strided; a conv1d per channel, the scan's per-channel parameters
    # (A_log through -exp, D, dt_proj's bias) sharded with the channels; dt_proj multiplied weight
    # first; x_proj and out_proj contract the channels
    "Mamba": {"mixer.in_proj.weight": (_StridedShard(0, split_factor=2), "column"),
              "mixer.conv1d.weight": (Shard(0), "with-column"), "mixer.conv1d.bias": (Shard(0), "with-column"),
              "mixer.x_proj.weight": (Shard(1), "row"), "mixer.dt_proj.weight": (Shard(0), "column"),
              "mixer.dt_proj.bias": (Shard(0), "with-column"), "mixer.A_log": (Shard(0), "with-column"),
              "mixer.D": (Shard(0), "with-column"), "mixer.out_proj.weight": (Shard(1), "row")},
    # gate and up interleaved in one expert projection ([..., ::2] / [..., 1::2]), a bias per expert
    "gpt-oss": {"mlp.experts.gate_up_proj": (Shard(2), "column"), "mlp.experts.gate_up_proj_bias": (Shard(1), "with-column"),
                "mlp.experts.down_proj": (Shard(1), "row"), "mlp.router.weight": (R, "replicated")},
    # Falcon-40B's layout: q, k and v grouped per key / value head ([.., groups, heads per group + 2,
    # head_dim]): a plain shard of the groups; k and v taken with a one-element list (qkv[..., [-2]])
    # on a dim that is not sharded (against one process: tests/test_hf_breadth.py; on 2 and 4 ranks:
    # benchmarks/results/hf-breadth-2026-11-27.md)
    "Falcon-40B": {"self_attention.query_key_value.weight": (Shard(0), "column"),
                   "self_attention.dense.weight": (Shard(1), "row")},
}


# Qwen3.5's gated delta net (linear attention) at small sizes: 4 key heads, 8 value heads of 16
GDN = dict(linear_num_key_heads=4, linear_key_head_dim=16, linear_num_value_heads=8, linear_value_head_dim=16)
VARIANTS = {"Llama-MQA": ("Llama", dict(num_key_value_heads=1)),  # case -> (architecture, config overrides)
            "Falcon-40B": ("Falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
            "Qwen3.5": ("qwen3_5_text", GDN)}


@pytest.mark.parametrize("arch", list(CASES))
def test_placements_come_from_the_graph(arch):
    name, overrides = VARIANTS.get(arch, (arch, {}))
    dec = _derived(*_hf(name, **overrides))
    for suffix, (placement, role) in CASES[arch].items():
        name = next(n for n in dec if n.endswith(suffix) and (".0." in n or "layers" not in n and ".h." not in n))
        assert (dec[name].placement, dec[name].role) == (placement, role), (name, dec[name])
        assert dec[name].why  # every decision says why
    router = [d for n, d in dec.items() if n.endswith("mlp.gate.weight")]
    assert all("softmax reduces over the sharded dim" in d.why for d in router)


class Block(nn.Module):
    """A transformer block with names no preset knows: a fused [gate | up] projection stored
    [in, out] (multiplied as ``x @ w``), attention heads made by a view, a per-head bias."""

    def __init__(self, dim=32, heads=4, ffn=64, names=("alpha", "beta", "gamma", "delta", "eps")):
        super().__init__()
        a, b, c, d, e = names
        self.heads = heads
        self.names = names
        setattr(self, a, nn.Linear(dim, 3 * dim, bias=False))  # fused q, k, v
        setattr(self, b, nn.Linear(dim, dim, bias=False))
        setattr(self, c, nn.Parameter(torch.randn(dim, 2 * ffn) * 0.1))  # fused gate | up, [in, out]
        setattr(self, d, nn.Parameter(torch.randn(ffn, dim) * 0.1))
        setattr(self, e, nn.Parameter(torch.zeros(heads)))  # one scalar per head
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x):
        a, b, c, d, e = (getattr(self, n) for n in self.names)
        B, S, D = x.shape
        q, k, v = a(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, S, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        q = q + e.view(1, -1, 1, 1)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + b(att.transpose(1, 2).reshape(B, S, D))
        gate, up = (self.norm2(x) @ c).chunk(2, dim=-1)
        return x + (nn.functional.silu(gate) * up) @ d


class LM(nn.Module):
    """An embedding, ``blocks`` on the residual stream, an LM head."""

    def __init__(self, blocks, vocab=64, dim=32):
        super().__init__()
        self.table = nn.Embedding(vocab, dim)
        self.stack = nn.ModuleList(blocks)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.table(tokens)
        for blk in self.stack:
            x = blk(x)
        return self.out(x)


def Net(names):
    return LM([Block(names=names) for _ in range(2)])


def _ce(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def test_names_decide_nothing():
    """The same program under two sets of names gets the same placements; parameters named
    like Megatron's projections but used otherwise follow their use, not their names."""
    tokens = torch.randint(0, 64, (2, 8))
    runs = []
    for names in (("alpha", "beta", "gamma", "delta", "eps"), ("o_proj", "q_proj", "down_proj", "up_proj", "norm")):
        torch.manual_seed(0)
        dec = _derived(Net(names), (tokens, tokens), _ce)
        runs.append([(d.placement, d.role) for d in dec.values()])
        blk = {n.split(".")[2]: d for n, d in dec.items() if n.startswith("stack.0.")}
        fused, out_proj, gate_up, down, per_head = (blk[n] for n in names)
        assert fused.placement == _StridedShard(0, split_factor=3) and fused.role == "column"
        assert out_proj.placement == Shard(1) and out_proj.role == "row"
        assert gate_up.placement == _StridedShard(1, split_factor=2)  # stored [in, out]: dim 1 is the output
        assert down.placement == Shard(0) and down.role == "row"  # [in, out]: contracted dim 0
        assert per_head.placement == Shard(0) and per_head.role == "with-column"
        assert dec["table.weight"].placement == dec["out.weight"].placement == Shard(0)
    assert runs[0] == runs[1]


def _tp_collectives(model_fn, inputs, loss_fn, plan, layers):
    counts = {}
    from autopar.mesh import fake_mesh

    with fake_mesh({"tp": 2}, 0) as mesh:
        pm = autopar.compile(model_fn(layers), mesh, example_inputs=inputs, loss_fn=loss_fn, plan=plan,
                             capture_eval=False)
        for r in pm.collectives():
            counts[(r.phase, r.kind)] = counts.get((r.phase, r.kind), 0) + 1
    return counts


def _hf_layers(arch):
    from autopar.models.hf_archs import build_hf

    arch, overrides = VARIANTS.get(arch, (arch, {}))

    def make(layers):
        return build_hf(arch, num_hidden_layers=layers, **overrides)[0]

    _, batches, loss_fn = build_hf(arch, num_hidden_layers=1, **overrides)
    return make, batches[0], loss_fn


MEGATRON = {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 2}
SEQUENCE = {(p, k): 2 for p in ("forward", "backward") for k in ("all_gather", "reduce_scatter")}
COUNTS = [("Llama", "megatron", MEGATRON), ("GPT-2", "megatron", MEGATRON),
          # one norm feeds both branches: their input gradients are summed before one all-reduce, and
          # their outputs too (each through a dropout, a clone at p = 0: a clone of a partial sum is one)
          ("GPT-J", "megatron", {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 1}),
          ("Llama", "sequence", SEQUENCE), ("GPT-2", "sequence", SEQUENCE),
          # stacked experts through transformers' grouped_mm_fallback (followed by running it); Mamba's
          # scan reading x_proj's output once per token (reduced once, where it is split)
          ("Mixtral", "megatron", MEGATRON), ("Mamba", "megatron", MEGATRON),
          # [q | k | v] with fewer key / value heads in one weight: one parameter per part (autopar/unfuse.py)
          ("Phi-3", "megatron", MEGATRON), ("Phi-3", "sequence", SEQUENCE),
          # multi-query attention fused ([q | k | v], one key / value head): q by heads, k and v whole;
          # the one head's gradient is a partial sum over the ranks' query heads, all-reduced at k's
          # and v's views ([batch, seq, head_dim] each) before their weight gradients: 2 more backward
          ("GPTBigCode", "megatron", {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 4}),
          # the same cut through a view as [.., heads + 2, head_dim] (x @ W.T, then [..., :-2, :],
          # [..., [-2], :]); attention and MLP in parallel off one norm: their partial sums added
          # before one all-reduce forward; backward the norm's and the one K/V head's two
          ("Falcon", "megatron", {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 3}),
          # Qwen3.5's gated delta net: [q | k | v] fused, cut through its depthwise causal conv; the
          # chunked scan per head. Under sequence, the block's output is reduce-scattered by the
          # residual add's sequence dim (the conv's padding and the chunks lose the block's own)
          # (1-2 min each: marked slow; test_sequence_parallel_through_a_causal_conv is the cheap one)
          pytest.param("Qwen3.5", "megatron", MEGATRON, marks=pytest.mark.slow, id="Qwen3.5-megatron"),
          pytest.param("Qwen3.5", "sequence", SEQUENCE, marks=pytest.mark.slow, id="Qwen3.5-sequence")]


@pytest.mark.parametrize("arch,strategy,expected", COUNTS)
def test_megatrons_communication_per_block(arch, strategy, expected):
    """Per block (the difference between 2 and 1 blocks): two all-reduces forward and two
    backward under megatron; under sequence, reduce-scatter / all-gather pairs instead, no
    all-reduce. GPT-2's q, k, v are one fused Conv1D matmul; GPT-J's attention and MLP run in
    parallel off one norm."""
    make, inputs, loss_fn = _hf_layers(arch)
    one, two = (_tp_collectives(make, inputs, loss_fn, {"tp": strategy}, n) for n in (1, 2))
    per_block = {k: two.get(k, 0) - one.get(k, 0) for k in set(one) | set(two)}
    assert {k: v for k, v in per_block.items() if v} == expected


def gpt2():
    """``autopar explain tests/test_tp_derive.py:gpt2``: Hugging Face GPT-2, 1 block (a factory)."""
    model, inputs, loss_fn = _hf("GPT-2")
    return model, inputs, loss_fn


class _WideResidual(nn.Module):
    """Mamba's ``residual_in_fp32``: the block's bf16 output (a partial sum under megatron, its
    ``down`` row-parallel) added to the fp32 residual."""

    def __init__(self, dim=32):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x.float() + self.down(torch.relu(self.up(x.to(self.up.weight.dtype))))


class _WideBranch(_WideResidual):
    """Gemma 2's norm after each branch: the row-parallel output (a partial sum) cast to fp32
    before anything else reads it."""

    def forward(self, x):
        return x.float() + self.down(torch.relu(self.up(x.to(self.up.weight.dtype)))).float()


@pytest.mark.parametrize("block", [_WideResidual, _WideBranch])
def test_a_partial_sum_is_reduced_before_it_is_widened(block):
    """The bf16 partial sum is all-reduced before the op that widens it to fp32 (bf16 bytes, as
    Megatron does), in every block. For the add of Mamba's fp32 residual (``_WideResidual``),
    DTensor's own choice made the fp32 residual Partial too (free for the add) and the program
    then all-reduced the fp32 sum in some blocks and not others (increments of 2,048 and 4,096
    bytes alternating: the planner read blocks that differ); for a cast (``_WideBranch``) it kept
    the cast Partial and all-reduced 4,096 bytes in every block (Gemma 2 twice the bytes of
    Llama per block: 16,384 against 8,192 in each direction on its tiny config)."""
    from autopar.mesh import fake_mesh

    tokens = torch.zeros(4, 8, dtype=torch.long)
    activation = tokens.numel() * 32 * 2  # bf16 bytes of one [4, 8, 32] activation: 2 ranks' ring all-reduce moves this

    def loss(logits, targets):
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))

    forward = []
    for n in (1, 2, 3):
        with fake_mesh({"tp": 2}, 0) as mesh:
            pm = autopar.compile(LM([block() for _ in range(n)]), mesh, example_inputs=(tokens, tokens),
                                 loss_fn=loss, plan={"tp": "megatron"}, precision="bf16", capture_eval=False)
        forward.append([int(r.wire_bytes) for r in pm.collectives()
                        if r.phase == "forward" and r.kind == "all_reduce" and "inside rule" not in r.reason])
    assert all(b == activation for got in forward for b in got), forward
    assert [len(got) for got in forward] == [2, 3, 4], forward  # the embedding's, then one per block


class _NormOverWidth(nn.Module):
    """OLMo 2's q / k norms: an RMS norm over the whole width of a column-parallel projection,
    which megatron shards (the statistic is a per-token sum over the ranks' parts)."""

    def __init__(self, dim=32):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.weight = nn.Parameter(torch.ones(4 * dim))
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        h = self.up(x)
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return x + self.down(torch.relu(h))


class _Rms(nn.Module):
    """Hugging Face's RMS norm: computed in fp32, the weighted result cast back."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))).to(x.dtype)


class _PostNorms(nn.Module):
    """OLMo 2's block: no norm before the branches, one after each (on its row-parallel output);
    the MLP's input read by two column-parallel projections."""

    def __init__(self, dim=32):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate, self.up = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.a_norm, self.m_norm = _Rms(dim), _Rms(dim)

    def forward(self, x):
        h = x + self.a_norm(self.o(torch.tanh(self.q(x)) * self.k(x) + self.v(x)))
        return h + self.m_norm(self.down(torch.relu(self.gate(h)) * self.up(h)))


@pytest.mark.parametrize("block,per_block", [
    # forward and backward alike: the statistic's per-token sum (64 bytes) and the block's output
    (_NormOverWidth, {"forward": [64, 2048], "backward": [64, 2048]}),
    # one all-reduce per branch each way
    (_PostNorms, {"forward": [2048, 2048], "backward": [2048, 2048]})], ids=["norm-over-width", "post-norms"])
def test_a_partial_sum_is_reduced_where_it_is_smallest_and_once(block, per_block):
    """The tp all-reduces a block adds (bf16 bytes; the compile of 2 blocks less that of 1), none
    an all-gather. Before: the norm's backward kept the statistic's gradient Partial through its
    expand to the width, then gathered both sharded operands it met and all-reduced the
    whole-width product (2 all-gathers of 4,096 bytes and all-reduces of 2,048 and 8,192 per block
    for the 64 and 2,048 here); with a norm after each branch, the residual's gradient, reduced for
    the previous block's norm backward, made its sum with the MLP's two input gradients reduce
    those apart (4 all-reduces per block in the backward). GPT-J's side-by-side branches, each
    through a dropout's clone, are test_megatrons_communication_per_block's."""
    import collections

    from autopar.mesh import fake_mesh

    tokens = torch.zeros(4, 8, dtype=torch.long)

    def loss(logits, targets):
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))

    sent = []
    for n in (1, 2):
        with fake_mesh({"tp": 2}, 0) as mesh:
            pm = autopar.compile(LM([block() for _ in range(n)]), mesh, example_inputs=(tokens, tokens),
                                 loss_fn=loss, plan={"tp": "megatron"}, precision="bf16", capture_eval=False)
        sent.append({phase: collections.Counter((r.kind, int(r.wire_bytes)) for r in pm.collectives()
                                                if r.phase == phase and "inside rule" not in r.reason)
                     for phase in ("forward", "backward")})
    got = {phase: sent[1][phase] - sent[0][phase] for phase in per_block}
    want = {phase: collections.Counter(("all_reduce", b) for b in sizes) for phase, sizes in per_block.items()}
    assert got == want, got
    assert not any(kind == "all_gather" for s in sent for c in s.values() for kind, _ in c), sent


def test_a_copy_of_a_partial_sum_is_not_carried_on_a_sequence_parallel_axis():
    """A partial sum on a sequence-parallel axis is reduce-scattered into the sequence layout where
    it is met (autopar/layout.py), a clone of it too: the built-in MoE's backward, with the clone
    carried Partial, reduce-scattered its dispatch buffers (156,672 bytes where the forward
    reduce-scatters 12,288; the megatron plan keeps the copy Partial and gains, this one lost)."""
    from autopar.mesh import fake_mesh
    from autopar.testing import build_model

    model, batches, loss_fn = build_model("moe")
    with fake_mesh({"tp": 2}, 0) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"tp": "sequence"},
                             precision="bf16", capture_eval=False)
    scattered = {p: sum(int(r.wire_bytes) for r in pm.collectives()
                        if r.kind == "reduce_scatter" and r.phase == p) for p in ("forward", "backward")}
    assert 0 < scattered["backward"] <= scattered["forward"], scattered


def test_explain_names_the_graph_fact_behind_every_placement(capsys):
    import pathlib

    from autopar.tools.cli import main as cli

    spec = f"{pathlib.Path(__file__).resolve()}:gpt2"
    assert cli(["explain", spec, "--mesh", "tp=2", "--plan", "tp=megatron", "-q"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  transformer.") or ln.startswith("  lm_head")}
    assert "_S(1, 3)" in rows["transformer.h.0.attn.c_attn.weight"]
    assert "column-parallel: output dim sharded, split into 3 parts" in rows["transformer.h.0.attn.c_attn.weight"]
    assert "contracted back by transformer.h.0.attn.c_proj.weight" in rows["transformer.h.0.attn.c_attn.weight"]
    assert "row-parallel" in rows["transformer.h.0.attn.c_proj.weight"]
    assert "vocabulary-parallel" in rows["lm_head.weight"] and "cross_entropy" in rows["lm_head.weight"]
    assert "positions" in rows["transformer.wpe.weight"]
    # what tensor parallelism does not divide, each with its reason
    replicated = out.split("what tensor parallelism does not divide")[1].split("\n\n")[0]
    assert "transformer.wpe.weight" in replicated and "transformer.h.0.ln_1.weight" in replicated
    assert "transformer.h.0.attn.c_proj.bias" in replicated and "bias added to a whole (reduced) output" in replicated


def test_stacked_experts_through_einsum_against_one_process(pools, references):
    """The built-in MoE's capacity dispatch multiplies stacked experts by einsum ("becd,edf->becf",
    then "becf,efd->becd"): the derivation shards w_gate / w_up on f (dim 2) and w_down on f (dim 1)
    from the equations, the router stays whole; 3 AdamW steps on tp=2 match one process."""
    from autopar.testing import parity_job
    from test_parity import assert_parity

    out = pools(2).run(parity_job, "moe", {"tp": 2}, {"tp": "megatron"})
    assert_parity(references("moe"), out, "moe")


def test_mamba_under_fsdp_and_megatron_gathers_nothing_on_tp():
    """Mamba's per-channel conv1d on a 2-D mesh: its input split on the batch (dp) and on the
    channels (tp) is convolved where it is (autopar/rules_parts.py), no all-gather on tp (DTensor's
    convolution rule gathered the channels: 3 all-gathers each way per block)."""
    from autopar.mesh import fake_mesh
    from autopar.models.hf_archs import build_hf

    model, batches, loss_fn = build_hf("Mamba", seq=8, num_hidden_layers=1)
    with fake_mesh({"dp": 2, "tp": 2}, 0) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn,
                             plan={"dp": "fsdp", "tp": "megatron"}, capture_eval=False)
    gathers = [r.reason for r in pm.collectives() if r.axis == "tp" and r.kind == "all_gather"]
    assert not gathers, gathers
    assert any(info_rule == "convolution per channel, sharded on the channels, backward"
               for info_rule in _rule_names(pm))


def _rule_names(pm):
    from autopar.ir import info

    return {info(n).rule.name for n in pm.program.graph.nodes if info(n).rule is not None}


def test_a_linear_attention_block_and_bmm_experts_against_one_process(pools):
    """autopar/models/linear_attn.py (written here: the shapes of Kimi-Linear's / Qwen3-Next's
    linear attention and Llama-4's experts): q, k, v joined by ``cat`` before one depthwise conv
    are column-parallel and the conv's filters strided over the three parts; the chunked scan
    writes each chunk into a fresh buffer (``out[:, :, a:b] = ...``), through ``.tril()`` (a
    method) and ``F.pad`` (no table entry: followed by running them); the per-head decay is seen
    through ``zeros(...) + decay.view(...)``; the bmm experts are column / row. On tp=2 the
    shards stay where they are (no tp all-gather) and two steps match one process."""
    from autopar.models import linear_attn, unruled
    from test_derived_rules import _close

    model, batches, loss_fn = linear_attn.build()
    dec = derive(capture_graph(model, batches[0], loss_fn), model, 2).decisions
    want = {"q.weight": (Shard(0), "column"), "k.weight": (Shard(0), "column"), "v.weight": (Shard(0), "column"),
            "conv.weight": (_StridedShard(0, split_factor=3), "with-column"), "decay": (Shard(0), "with-column"),
            "o.weight": (Shard(1), "row"), "w_gate_up": (_StridedShard(2, split_factor=2), "column"),
            "w_down": (Shard(1), "row")}
    for suffix, expected in want.items():
        d = dec[f"layers.0.{suffix}"]
        assert (d.placement, d.role) == expected, (suffix, d)
    assert "cat of 3 parts, each sharded" in dec["layers.0.q.weight"].why
    out = pools(2).run(unruled.job, {"tp": 2}, {"tp": "megatron"}, False, model="linear_attn")
    _close(out, unruled.reference(False, model="linear_attn"))
    assert not [c for c in out["collectives"] if c == "all_gather"], out["collectives"]


def test_a_table_with_fewer_rows_than_ranks_is_held_whole_with_the_reason():
    """A lookup indexed by the program's input with fewer rows than the tensor-parallel ranks
    (RoBERTa-XL's one-row token-type table) has nothing to split: replicated, and the reason
    says so. A table whose rows the ranks do not divide (Moshi's vocabulary + 1) is split by its
    columns, the reason saying so; one whose columns they do not divide either is a PlanError that
    names it."""

    class Typed(nn.Module):
        def __init__(self, rows, cols=16):
            super().__init__()
            self.words, self.types = nn.Embedding(64, 16), nn.Embedding(rows, cols)
            self.out = nn.Linear(16, 64, bias=False)

        def forward(self, tokens):
            t = self.types(tokens.clamp(max=0))
            return self.out(self.words(tokens) + nn.functional.pad(t, (0, 16 - t.shape[-1])))

    tokens = torch.randint(0, 64, (2, 8))
    dec = _derived(Typed(1), (tokens, tokens), _ce)
    assert dec["types.weight"].placement == R
    assert "a lookup of 1 row(s), fewer than the 2 ranks: nothing to split" in dec["types.weight"].why
    assert dec["words.weight"].placement == Shard(0)
    from autopar.errors import PlanError

    dec = _derived(Typed(3), (tokens, tokens), _ce)
    assert dec["types.weight"].placement == Shard(1)
    assert "of 3 rows, which 2 ranks do not divide: split by its 16 columns" in dec["types.weight"].why
    with pytest.raises(PlanError, match=r"types.weight \[3, 15\]"):
        _derived(Typed(3, 15), (tokens, tokens), _ce)


def _cut(model, inputs, loss_fn, keep_whole=lambda name: False, tp=2):
    """Capture, cut, derive; the rewritten program computes the loss the captured one did."""
    from autopar import unfuse

    gm = capture_graph(model, inputs, loss_fn)
    gm.recompile()  # (the capture renamed its attributes after generating its code)
    want = gm(*inputs)
    before = {n: p for n, p in model.named_parameters()}
    d, cuts, notes = unfuse.derive_with_cuts(gm, model, lambda: derive(gm, model, tp), keep_whole)
    assert not notes or not cuts
    gm.recompile()
    torch.testing.assert_close(gm(*inputs), want)
    return gm, d.decisions, cuts, before


def test_a_fused_weight_cut_into_unequal_parts_is_one_parameter_per_part():
    """Phi-3's qkv_proj ([q 64 | k 32 | v 32] rows: 4 query heads, 2 key / value heads) is sliced
    after its matmul: one linear per part in the graph, each part's parameter column-parallel by
    its heads; the module's own ``weight`` is their concatenation (its forward unchanged)."""
    model, inputs, loss_fn = _hf("Phi-3")
    want = model(inputs[0]).logits
    w = "model.layers.0.self_attn.qkv_proj"
    fused = model.get_parameter(f"{w}.weight").detach().clone()
    gm, dec, cuts, _ = _cut(model, inputs, loss_fn)
    assert [(c.weight, c.sizes) for c in cuts] == [(f"{w}.weight", [64, 32, 32])]
    parts = [f"{w}.parametrizations.weight.original{i}" for i in range(3)]
    assert all(dec[p].placement == Shard(0) and dec[p].role == "column" for p in parts), {p: dec[p] for p in parts}
    assert f"{w}.weight" not in dict(model.named_parameters())
    assert torch.equal(model.get_submodule(w).weight, fused)  # (the concatenation of the parts)
    assert sum(1 for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "linear") == 3 + 3 + 1  # (+ o, gate_up, down; the lm head)
    assert torch.equal(model(inputs[0]).logits, want)
    from autopar.unfuse_find import describe

    (line,) = describe(cuts)
    assert "3 parts of [64, 32, 32] rows" in line and "modeling_phi3.py" in line, line


def test_a_cut_that_shards_no_part_is_undone():
    """A fused weight sliced into unequal parts, each of which a norm over the whole part reads
    (no flow holds): nothing to gain, so the module keeps its own parameter (the same object)
    and the graph its one linear. (A row-parallel weight sliced after it, Mamba's x_proj into
    [dt | B | C], is kept whole too: test_megatrons_communication_per_block counts its one
    all-reduce.)"""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.fused = nn.Linear(16, 24)
            self.out = nn.Linear(16, 32)

        def forward(self, x):
            y = self.fused(self.emb(x))
            a, b = y[..., :16], y[..., 16:]
            return self.out(torch.nn.functional.layer_norm(a, (16,)) * b.softmax(-1).sum(-1, keepdim=True))

    model = Block()
    inputs = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    gm, dec, cuts, before = _cut(model, inputs, _ce)
    assert cuts == [] and dict(model.named_parameters()) == before
    assert dec["fused.weight"].placement == R
    assert sum(1 for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "linear") == 2
    gm.recompile()
    got = gm(*inputs)
    assert torch.allclose(got[0] if isinstance(got, (tuple, list)) else got, _ce(model(inputs[0]), inputs[1]))


def test_a_rule_that_names_the_fused_weight_keeps_it_whole():
    model, inputs, loss_fn = _hf("Phi-3")
    w = "model.layers.0.self_attn.qkv_proj.weight"
    _, dec, cuts, _ = _cut(model, inputs, loss_fn, keep_whole=lambda name: name == w)
    assert cuts == [] and w in dec and dec[w].placement == R


def test_a_cut_whose_parts_the_axis_does_not_divide_leaves_the_model_as_written():
    """tp=3 divides none of Phi-3's sizes: the error is the one the weights as written give (it
    names the user's own parameters, no part), and the module is left as it was."""
    from autopar.errors import PlanError

    model, inputs, loss_fn = _hf("Phi-3")
    before = dict(model.named_parameters())
    with pytest.raises(PlanError) as e:
        _cut(model, inputs, loss_fn, tp=3)
    assert "parametrizations" not in str(e.value) and "gate_up_proj.weight" in str(e.value)
    assert dict(model.named_parameters()) == before


def test_a_cut_that_a_part_makes_impossible_is_given_up_and_said():
    """tp=4 divides Phi-3's 4 query heads but not its 2 key / value heads: the weight is kept as
    written (replicated, with its reason), and the report's line says the cut was given up and why."""
    from autopar import unfuse

    model, inputs, loss_fn = _hf("Phi-3")
    gm = capture_graph(model, inputs, loss_fn)
    d, cuts, notes = unfuse.derive_with_cuts(gm, model, lambda: derive(gm, model, 4), lambda name: False)
    w = "model.layers.0.self_attn.qkv_proj.weight"
    assert cuts == [] and d.decisions[w].placement == R and w in dict(model.named_parameters())
    (note,) = notes
    assert note.startswith(f"{w} not cut") and "does not divide by 4" in note and note.endswith("kept as written"), note


def test_a_fused_projection_cut_through_its_depthwise_conv():
    """Qwen3.5's gated delta net: in_proj_qkv's output ([q | k | v], 64 + 64 + 128 channels) goes
    through one depthwise causal conv1d before it is split and viewed as heads. Both are cut into
    one parameter per part (the conv's filters alike), each part column-parallel by its heads and
    its filters sharded with it; the model computes what it did."""
    model, inputs, loss_fn = _hf("qwen3_5_text", **GDN)
    want = model(inputs[0]).logits
    gm, dec, cuts, _ = _cut(model, inputs, loss_fn)
    a = "model.layers.0.linear_attn"
    (cut,) = cuts
    assert (cut.weight, cut.sizes) == (f"{a}.in_proj_qkv.weight", [64, 64, 128])
    assert f"{a}.conv1d.weight" in cut.names()
    for i in range(3):
        part, filters = dec[f"{a}.in_proj_qkv.parametrizations.weight.original{i}"], dec[f"{a}.conv1d.parametrizations.weight.original{i}"]
        assert (part.placement, part.role) == (Shard(0), "column"), part
        assert (filters.placement, filters.role) == (Shard(0), "with-column"), filters
    for suffix, expected in {"in_proj_z.weight": (Shard(0), "column"), "in_proj_a.weight": (Shard(0), "column"),
                             "A_log": (Shard(0), "with-column"), "dt_bias": (Shard(0), "with-column"),
                             "out_proj.weight": (Shard(1), "row"), "norm.weight": (R, "replicated")}.items():
        d = dec[f"{a}.{suffix}"]
        assert (d.placement, d.role) == expected, (suffix, d)
    from autopar.unfuse_find import describe

    (line,) = describe(cuts)
    assert "through the per-channel convolution" in line and "conv1d.weight" in line, line
    assert torch.equal(model(inputs[0]).logits, want)


class ConvBlock(nn.Module):
    """Mamba's / a gated delta net's shape: a column-parallel projection, a depthwise causal conv
    over the sequence (padded, then cut back to the sequence length), a row-parallel projection
    into the residual stream."""

    def __init__(self, dim=32, inner=64, kernel=4):
        super().__init__()
        self.norm, self.up = nn.LayerNorm(dim), nn.Linear(dim, inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.down = nn.Linear(inner, dim, bias=False)

    def forward(self, x):
        h = self.up(self.norm(x)).transpose(1, 2)
        h = self.conv(h)[..., :x.shape[1]].transpose(1, 2)
        return x + self.down(nn.functional.silu(h))


def ConvNet(layers):
    return LM([ConvBlock() for _ in range(layers)])


def test_sequence_parallel_through_a_causal_conv():
    """The conv's padding changes the sequence length, so the block's output has lost its sequence
    dim by the time it leaves the region; the residual add that reads it has one, and the partial
    sum is reduce-scattered by it: one reduce-scatter / all-gather pair per block each way, no
    all-reduce (it was an all-reduce, with the pair at the norm after it)."""
    tokens = torch.randint(0, 64, (2, 8))
    one, two = (_tp_collectives(ConvNet, (tokens, tokens), _ce, {"tp": "sequence"}, n) for n in (1, 2))
    per_block = {k: two.get(k, 0) - one.get(k, 0) for k in set(one) | set(two)}
    assert {k: v for k, v in per_block.items() if v} == {(p, k): 1 for p in ("forward", "backward")
                                                         for k in ("all_gather", "reduce_scatter")}


def test_a_cat_of_unequal_parts_before_one_conv_cuts_the_conv(pools):
    """q, k and v projected apart, values twice as wide ([32 | 32 | 64] channels), joined by ``cat``
    before one depthwise conv and split back after it (OLMo-hybrid's and Qwen3-Next's gated delta
    nets): the conv's filters become one parameter per part, each sharded with its part's heads,
    and q, k, v stay column-parallel; on tp=2 no all-gather, and two steps match one process (the
    gradients compared under the user's own parameter names)."""
    from autopar.models import linear_attn, unruled
    from test_derived_rules import _close

    model, batches, loss_fn = linear_attn.build(wide=2)
    want = model(batches[0][0])
    gm, dec, cuts, _ = _cut(model, batches[0], loss_fn)
    conv = "layers.0.conv.weight"
    assert [(c.weight, c.sizes, c.joined) for c in cuts][:1] == [(conv, [32, 32, 64], True)]
    for i, (p, proj) in enumerate(zip(cuts[0].part_names(conv), ("q", "k", "v"))):
        assert (dec[p].placement, dec[p].role) == (Shard(0), "with-column"), dec[p]
        assert dec[f"layers.0.{proj}.weight"].placement == Shard(0)
    assert dec["layers.0.o.weight"].placement == Shard(1)
    from autopar.unfuse_find import describe

    line = describe(cuts)[0]
    assert "3 parts of [32, 32, 64] channels" in line and "reads a cat of them" in line, line
    assert torch.equal(model(batches[0][0]), want)
    out = pools(2).run(unruled.job, {"tp": 2}, {"tp": "megatron"}, False, model="linear_attn_wide")
    _close(out, unruled.reference(False, model="linear_attn_wide"))
    assert not [c for c in out["collectives"] if c == "all_gather"], out["collectives"]


@pytest.mark.slow  # (26 s in CI on 2026-12-02; CI keeps Falcon-H1's case below: the same Mamba-2 cut, conv parts and roles)
def test_a_part_cut_again_after_its_depthwise_conv():
    """Mamba-2 (Bamba): in_proj's output is split into [z | xBC | dt], and xBC is convolved per
    channel and split again into [x | B | C]. The cut goes through: five parts, the conv's filters
    cut into x's, B's and C's. z, x and dt are column-parallel by heads (the gated norm over the
    whole inner dim: its statistic all-reduced), out_proj row-parallel; B and C, one group shared by
    every head (repeated to the heads, multiplied per head by einsum), are held whole, and so are
    their filters; x's filters are sharded with x."""
    model, inputs, loss_fn = _hf("bamba")
    want = model(inputs[0]).logits
    gm, dec, cuts, _ = _cut(model, inputs, loss_fn)
    m = "model.layers.0.mamba"
    (c,) = cuts
    assert (c.weight, c.sizes) == (f"{m}.in_proj.weight", [128, 128, 256, 256, 128])
    assert [(w, c.conv_parts(n)) for n, w, _ in c.convs] == [(f"{m}.conv1d.weight", [1, 2, 3])]
    proj = c.part_names(c.weight)
    assert [dec[p].role for p in proj] == ["column", "column", "replicated", "replicated", "column"]
    assert "einsum" in dec[proj[2]].why
    filters = [f"{m}.conv1d.parametrizations.weight.original{i}" for i in range(3)]
    assert [dec[f].placement for f in filters] == [Shard(0), R, R]
    assert dec[f"{m}.out_proj.weight"].placement == Shard(1) and dec[f"{m}.norm.weight"].placement == Shard(0)
    from autopar.unfuse_find import describe

    (line,) = describe(cuts)
    assert "5 parts of [128, 128, 256, 256, 128] rows" in line and "parts 1, 2, 3 through the per-channel" in line, line
    assert torch.equal(model(inputs[0]).logits, want)


def test_a_scale_per_channel_before_the_split_is_sliced_per_part():
    """Falcon-H1 multiplies in_proj's output by a muP vector (a buffer, one scale per channel)
    before splitting it as Mamba-2 does: the cut goes through the multiplication, each part's copy
    reading its own channels of the buffer, and the rewritten program computes the same loss."""
    model, inputs, loss_fn = _hf("falcon_h1")
    gm, dec, cuts, _ = _cut(model, inputs, loss_fn)  # (the loss the captured program computed: _cut checks it)
    (c,) = [c for c in cuts if ".layers.0." in c.weight]
    assert c.sizes == [1024, 1024, 256, 256, 128] and [c.conv_parts(n) for n, *_ in c.convs] == [[1, 2, 3]]
    narrows = [n for n in gm.graph.nodes if n.target is torch.narrow and "mup_vector" in str(n.args[0].target)]
    assert sorted(n.args[2:] for n in narrows if "layers_0" in str(n.args[0].target)) == \
        [(0, 1024), (1024, 1024), (2048, 256), (2304, 256), (2560, 128)]
    assert [dec[p].role for p in c.part_names(c.weight)] == ["column", "column", "replicated", "replicated", "column"]
