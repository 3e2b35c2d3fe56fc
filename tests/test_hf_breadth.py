"""Hugging Face architectures that each needed a fix, end to end on 2 gloo ranks (one shared pool).

Each case is an architecture (1 layer of autopar.models.hf_archs's tiny config) under a plan it
failed to compile under before its fix, trained 2 AdamW steps against one eager process (losses,
parameters, the eval forward). The whole sweep, every architecture under both plans, is
``benchmarks/hf_breadth.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from autopar.ir import ShardSpec
from autopar.models import hf_archs
from autopar.models.hf_archs import breadth_job, breadth_reference, compare
from autopar.passes.collectives import plan_steps, step_kind
from autopar.rules import PSUM, copy_rule

ONE_LAYER = dict(num_hidden_layers=1)
# Qwen3.5's gated delta net (linear attention) at small sizes: 4 key heads, 8 value heads of 16
GDN = dict(linear_num_key_heads=4, linear_key_head_dim=16, linear_num_value_heads=8, linear_value_head_dim=16)
CASES = [  # (architecture, plan, config overrides, rules that must have decided some op)
    # the eval program keeps SDPA whole: its math decomposition had other strides than the op,
    # which GPT-2's Conv1D view(-1, ...) could not take
    # (tied input embedding and LM head, as GPT-2 ships: one parameter, read twice)
    ("GPT-2", "fsdp", dict(ONE_LAYER, tie_word_embeddings=True), set()),
    # tied weights across pipeline stages: the embedding's copy on stage 0 and the LM head's on
    # stage 1, their gradients summed every step (Gemma: tied, sqrt(hidden)-scaled embedding)
    ("Gemma", "pp", dict(tie_word_embeddings=True), set()),
    # tensor constants (qkv[..., [-2], :]) as constant inputs; index.Tensor on batch-sharded values
    # through DTensor's single-dim strategy (its schema info was missing: no strategy ever matched;
    # the same fix as the MoE models' expert dispatch, which benchmarks/hf_breadth.py runs)
    ("Falcon", "fsdp", ONE_LAYER, set()),
    ("DeepSeek-V3", "fsdp", dict(ONE_LAYER, first_k_dense_replace=0), {"copy (elementwise)"}),
    ("BLOOM", "megatron", ONE_LAYER, set()),  # [B, H, ...] -> [B*H, ...]: a strided shard made from R
    # softplus_backward: elementwise, not tagged so (8 tokens: the scan unrolls once per token)
    ("Mamba", "fsdp", dict(ONE_LAYER, seq=8), {"elementwise"}),
    # use_cache=True (Hugging Face's default): the traced forward concatenates each layer's keys
    # and values onto DynamicCache's empty 1-D start tensor, which torch.cat skips; it has no dim
    # to shard on tp (it failed in localize's chunk before the pass dropped it from the cat)
    ("Llama", "megatron", dict(ONE_LAYER, use_cache=True), set()),
    # megatron derived from the graph: Conv1D weights [in, out], q / k / v fused in one matmul and
    # split after it (strided shards: each rank holds its heads of each part), the dropout-free blocks
    ("GPT-2", "megatron", ONE_LAYER, {"split of a strided shard into its parts", "cat of shards into a strided shard"}),
    # stacked experts through transformers' grouped_mm_fallback, an op with no rule: followed by
    # running it (column: its weight's output dim, strided by gate | up; row: the contraction's
    # partial sum), its rules and its backward's derived the same way, with no gather
    ("Mixtral", "megatron", ONE_LAYER, set()),
    # gpt-oss: gate and up interleaved (gate_up[..., ::2], [..., 1::2]) with a bias per expert
    ("gpt-oss", "megatron", ONE_LAYER, {"strided slice of a sharded dim", "strided slice of a sharded dim, backward"}),
    # DeepSeek's MLA: keys assembled in a fresh buffer by slice assignment ([k_nope | k_rope], the
    # rope part one head broadcast to all), which stays sharded by heads rather than gathered
    ("DeepSeek-V3", "megatron", ONE_LAYER, {"slice_scatter into a buffer sharded like its source"}),
    # Mamba: the inner channels sharded through its per-channel conv1d (groups = channels) and
    # selective scan; dt_proj multiplied weight first (dt_proj.weight @ x)
    ("Mamba", "megatron", dict(ONE_LAYER, seq=8), {"convolution per channel, sharded on the channels",
                                                  "convolution per channel, sharded on the channels, backward"}),
    # multi-query attention (one KV head, repeated for every query head: fewer KV heads than
    # ranks): the queries and the output projection sharded by heads, the key / value projections
    # held whole (each rank takes its heads' copies of the one head)
    ("Llama", "megatron", dict(ONE_LAYER, num_key_value_heads=1), set()),
    # multi-query attention fused in one weight ([q | k | v], one key / value head): one parameter
    # per part (autopar/unfuse.py), q split by heads, k and v whole
    ("GPTBigCode", "megatron", ONE_LAYER, set()),
    # Falcon-40B's layout: q, k and v grouped per K/V head ([.., groups, heads per group + 2,
    # head_dim]), k and v taken with a one-element list (qkv[..., [-2]]) on a dim that is not sharded.
    # (Falcon-7B's, x @ W.T viewed as heads + 2 and cut into q | k | v, one K/V head broadcast into
    # SDPA: benchmarks/hf_breadth.py's Falcon, and its count in tests/test_tp_derive.py)
    ("Falcon", "megatron", dict(ONE_LAYER, new_decoder_architecture=True, num_kv_heads=2), set()),
    # Qwen3.5's gated delta net: [q | k | v] fused before one depthwise causal conv (both cut into
    # parts, autopar/unfuse.py); a view that splits and merges a sharded dim in one step (propagated
    # in two); softplus_backward's run-time layout differing from its trace's (the views after it
    # reshape); under sequence, the block's output reduce-scattered by the residual add's sequence dim.
    # (The chunked scan unrolls 64 steps: 1-1.5 min a plan, marked slow. In CI: the cut's placements,
    # the two-step view and the reshape in their own tests here and in test_tp_derive.py.)
    pytest.param("qwen3_5_text", "sequence", dict(ONE_LAYER, **GDN), {"convolution per channel, sharded on the channels"},
                 marks=pytest.mark.slow),
    pytest.param("qwen3_5_text", "megatron", dict(ONE_LAYER, **GDN), {"convolution per channel, sharded on the channels"},
                 marks=pytest.mark.slow),
    # Nemotron-H's Mamba-2 mixer: in_proj cut into [z | xBC | dt], xBC cut again after its depthwise
    # conv into [x | B | C] (x's filters sharded, B's and C's whole); B and C, one group for every
    # head, read by each rank's heads through repeat_interleave and the per-head einsum (broadcast)
    ("nemotron_h", "megatron", dict(layers_block_type=["linear_attention", "mlp"], n_groups=1, mamba_num_heads=4,
                                    mamba_head_dim=16, ssm_state_size=16, chunk_size=16),
     {"convolution per channel, sharded on the channels"}),
    # DeepSeek-V3.2's sparse-attention indexer: q (heads) and the per-head weights both sharded by
    # heads, contracted with each other (sum over heads): each rank's partial sum all-reduced
    # before the top-k (8 indexer heads of 32, the top 8 of 16 tokens; a dense MLP)
    ("deepseek_v32", "megatron", dict(ONE_LAYER, first_k_dense_replace=1, index_n_heads=8, index_head_dim=32,
                                      index_topk=8), set()),
    # Moshi: [gate | up] fused, viewed [.., 2, ffn] and picked by h[..., 0, :] (strided by the two
    # parts); the token table's vocabulary + 1 rows split by its columns
    ("moshi", "megatron", ONE_LAYER, set()),
    # a norm over the width megatron shards (OLMo 2's q / k norms): the gradient of its statistic
    # reduced before its expand to the width; attention and MLP side by side, each through a
    # dropout's clone (GPT-J): the two partial sums kept Partial through the clones, reduced once
    # (passes/partials.py); 2 blocks each (a confirmation: benchmarks/hf_breadth.py runs all)
    pytest.param("OLMo2", "megatron", {}, set(), marks=pytest.mark.slow),
    pytest.param("GPT-J", "megatron", {}, set(), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,plan,overrides,rules", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in (getattr(c, "values", c) for c in CASES)])
def test_architecture_against_one_process(pools, name, plan, overrides, rules):
    out = pools(2).run(breadth_job, name, plan, False, **overrides)
    assert rules <= set(out["rules"]), f"rules that did not fire: {rules - set(out['rules'])}"
    gathered = [r for r in out["rules"] if "gathered whole" in r]
    assert not gathered, gathered
    why = compare(breadth_reference(name, **overrides), out)
    assert why is None, why


def test_strided_shards_go_through_replicate():
    s, r = _StridedShard(0, split_factor=4), Replicate()
    assert plan_steps((r,), (s,)) == [(0, r, s)] and step_kind(r, s) == "local"
    assert plan_steps((s,), (Shard(0),)) == [(0, s, r), (0, r, Shard(0))] and step_kind(s, r) == "all_gather"
    assert plan_steps((s, r), (r, s)) == [(0, s, r), (1, r, s)]


def test_elementwise_rule_follows_the_shard_and_broadcasts():
    """copy(dst, src): dst's layout follows src's shard (dst's values are not read); a broadcast
    dim stays replicated; a Partial source is reduced first (the rule wants Replicate)."""
    ctx = SimpleNamespace(axis_sizes=(2,))
    r, f = Replicate(), torch.float32

    def spec(p, *shape):
        return ShardSpec((p,), shape, f)

    res = copy_rule(None, [spec(r, 4, 16, 8), spec(Shard(0), 4, 16, 8)], ctx)
    assert res.inputs == [(Shard(0),), (Shard(0),)] and res.outputs == (Shard(0),)
    res = copy_rule(None, [spec(r, 4, 16, 8), spec(Shard(0), 16, 8)], ctx)  # src broadcasts over dim 0
    assert res.inputs == [(Shard(1),), (Shard(0),)] and res.outputs == (Shard(1),)
    res = copy_rule(None, [spec(Shard(0), 4, 16, 8), spec(r, 1, 16, 8)], ctx)  # only dst is sharded
    assert res.inputs == [(Shard(0),), (r,)] and res.outputs == (Shard(0),)
    res = copy_rule(None, [spec(r, 4, 8), spec(PSUM, 4, 8)], ctx)
    assert res.inputs == [(r,), (r,)] and res.outputs == (r,)


def strided_roundtrip_job():
    """On each rank of a 2-rank pool: localize's Replicate -> strided shard and back, against
    DTensor's own strided shard of the same view ([4, 4, 3] sharded on dim 1, viewed as [16, 3])."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from autopar.passes.localize import apply_redistribute

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = dist.get_rank()
    x = torch.arange(4 * 4 * 3, dtype=torch.float32).reshape(4, 4, 3)
    piece = x[:, 2 * rank:2 * rank + 2].contiguous()
    theirs = DTensor.from_local(piece, mesh, [Shard(1)], run_check=False).view(16, 3)
    s = theirs.placements[0]
    ctx = SimpleNamespace(axis_sizes=(2,), coord=(rank,), group_name=lambda a: mesh.get_group(a).group_name)
    mine = apply_redistribute(x.view(16, 3), (Replicate(),), (s,), None, ctx)
    back = apply_redistribute(theirs.to_local(), (s,), (Replicate(),), None, ctx)
    assert isinstance(s, _StridedShard), s  # every rank checks its own piece (a failure fails the job)
    assert torch.equal(mine, theirs.to_local()) and torch.equal(back, x.view(16, 3)), rank
    return s.split_factor


def test_strided_shard_redistributes_like_dtensor(pools):
    assert pools(2).run(strided_roundtrip_job) == 4


def test_a_view_that_splits_and_merges_a_sharded_dim_goes_in_two_steps():
    """Functionalization writes ``x.view(b, s, h, d).reshape(-1, d)`` as one view of x ([b, s, h * d]
    -> [b * s * h, d]); with h sharded, DTensor's view rule cannot keep that sharded in one step, but
    can through the finest shape both sides are merges of (Qwen3.5's gated delta net)."""
    from autopar.passes.propagate import refined_shape

    assert refined_shape([4, 16, 4096], [2048, 128]) == [4, 16, 32, 128]
    assert refined_shape([4, 16, 64], [4, 16, 4, 16]) == [4, 16, 4, 16]  # (a split alone: itself)
    assert refined_shape([6, 4], [4, 6]) is None  # no shape refines both
    assert refined_shape([6, 4], [25]) is None


def test_a_view_of_an_output_whose_run_time_layout_the_trace_cannot_promise_is_a_reshape():
    """softplus_backward(g, x) with g and x laid out differently: fake tensors give the output x's
    layout, the CPU kernel g's, so a view the trace allowed fails at run time. localize turns a view
    of such a value (and of what follows its layout) into a reshape, and leaves the others alone."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.passes.localize import _reshape_views_of_mixed_layouts

    aten = torch.ops.aten

    def f(g, x, w, view):
        y = aten.softplus_backward(g, x, 1.0, 20.0)
        z = view(y * 2, 256 * 16, 16)  # follows y's layout: uncertain too
        m = (x.view(256 * 16, 16) @ w).view(256, 16, 16)  # a matmul's fresh output: certain
        return z.sum(0), m

    g = torch.randn(256, 16, 16).transpose(1, 2)
    x, w = torch.randn(256, 16, 16), torch.randn(16, 16)
    gm = make_fx(lambda g, x, w: f(g, x, w, torch.Tensor.view), tracing_mode="fake")(g, x, w)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        gm(g, x, w)  # (the check can fail: the traced program as it was)
    assert _reshape_views_of_mixed_layouts(gm.graph) == 1
    gm.recompile()
    views = [n for n in gm.graph.nodes if n.target in (aten.view.default, aten.reshape.default)]
    assert [n.target for n in views] == [aten.reshape.default, aten.view.default, aten.view.default]
    got, want = gm(g, x, w), f(g, x, w, torch.Tensor.reshape)
    assert all(torch.allclose(a, b) for a, b in zip(got, want))


def test_a_composite_config_is_tiny_throughout():
    """A multimodal model's text config and towers get the tiny sizes too, dropout off in each (they
    kept their default sizes: Emu3's 8B text model, Llama-4's and Gemma-3's, were built whole), and a
    sub-config the composite builds from its flat fields keeps the defaults it gives it (Fuyu's relu2)."""
    emu3 = hf_archs.hf_config("emu3", {})
    assert (emu3.text_config.hidden_size, emu3.text_config.num_hidden_layers, emu3.text_config.vocab_size) == (64, 2, 128)
    assert emu3.text_config.attention_dropout == 0.0  # (its own default is 0.1)
    llama4 = hf_archs.hf_config("llama4", {})
    assert (llama4.text_config.hidden_size, llama4.vision_config.hidden_size) == (64, 64)
    fuyu = hf_archs.hf_config("fuyu", {})
    assert (fuyu.text_config.hidden_size, fuyu.text_config.hidden_act) == (64, "relu2")
