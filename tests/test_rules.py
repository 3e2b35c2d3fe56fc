"""autopar's own sharding rules, each run sharded against the unsharded op.

Small models whose only interesting ops are the ones a rule covers, compiled on real gloo
groups with the placements that make the rule fire, compared with one process (outputs,
gradients, parameters), and checked to have used the rule.
"""

from __future__ import annotations

import pytest

from autopar.testing import parity_job
from test_parity import assert_parity, case_ids

CASES = [
    # vocab-parallel embedding (+ padding row) and LM head, log_softmax and nll_loss over classes
    ("ce_rules", {"tp": 2}, {"tp": "megatron"},
     {"vocab-parallel embedding", "vocab-parallel embedding backward", "vocab-parallel log_softmax",
      "vocab-parallel log_softmax backward", "nll_loss over sharded rows/classes",
      "nll_loss backward over sharded rows/classes"}),
    # rows sharded with ignore_index on one rank only (DTensor's Partial("avg") gets this wrong)
    ("ce_rules", {"dp": 2}, {"dp": "ddp"},
     {"embedding", "embedding backward", "log_softmax on local rows", "nll_loss over sharded rows/classes"}),
    ("ce_rules", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "megatron"},
     {"vocab-parallel embedding", "vocab-parallel log_softmax", "nll_loss over sharded rows/classes"}),
    # attention sharded over batch and heads, with an explicit mask that follows the batch shard
    ("attn_mask", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "megatron"}, {"attention over batch/heads"}),
    # context parallelism: rows of the flattened [b, s] strided-sharded (ignored targets on one rank
    # only: the mean over the global token count), attention on heads with the padding mask gathered
    ("ce_rules", {"cp": 2}, {"cp": "ulysses"},
     {"embedding", "embedding backward", "log_softmax on local rows", "nll_loss over sharded rows/classes"}),
    ("attn_mask", {"cp": 2}, {"cp": "ulysses"}, {"attention over batch/heads"}),
]


@pytest.mark.parametrize("name,axes,plan,rules", CASES, ids=case_ids(CASES))
def test_rule_against_unsharded(pools, references, name, axes, plan, rules):
    world = 1
    for v in axes.values():
        world *= v
    out = pools(world).run(parity_job, name, axes, plan)
    assert rules <= set(out["rules"]), f"rules that did not fire: {rules - set(out['rules'])}"
    assert_parity(references(name), out, name)


@pytest.mark.parametrize("model,mesh,plan", [
    ("llama-tiny", "dp=2,tp=2", "dp=fsdp,tp=megatron"),
    ("llama-tiny", "dp=2,tp=2", "dp=zero2,tp=sequence"),
    ("llama-tiny", "dp=2,cp=2", "dp=fsdp,cp=context"),
    ("moe-tiny-dropless", "dp=2,ep=2", "dp=fsdp,ep=expert"),
    ("tests/foreign_models.py:hf_gpt2", "dp=2,tp=2", "dp=ddp,tp=megatron"),
    ("tests/foreign_models.py:hf_mixtral", "tp=2,dp=2", "dp=fsdp,tp=megatron"),
])
def test_kept_layout_is_the_choice_dtensor_makes(monkeypatch, model, mesh, plan):
    """propagate answers an elementwise op whose inputs share the output's shape and one layout
    without asking DTensor (autopar/rules.py ``kept_layout``): with the check on, DTensor is asked
    too, for every such op of these compiles, and must choose the same (passes/propagate.py raises
    where it does not); the shortcut must have fired."""
    from autopar import rules
    from autopar.passes import propagate
    from autopar.tools import cli

    hits = []

    def counted(n, in_specs, ctx):
        res = rules.kept_layout(n, in_specs, ctx)
        hits.append(res is not None)
        return res

    monkeypatch.setattr(propagate, "_CHECK_KEPT", True)
    monkeypatch.setattr(propagate, "kept_layout", counted)
    monkeypatch.setenv("AUTOPAR_DISK_CACHE", "0")
    assert cli.main(["plan", model, "--mesh", mesh, "--plan", plan, "-q", "--full-depth"]) == 0
    assert sum(hits) > 0, hits


def test_an_index_put_is_never_sharded_on_what_its_global_indices_address():
    """indexing.sound_indexing (applied to DTensor's answer for every index_put): the indices hold global
    positions, so a layout that shards an indexed dim of ``self``, the index result's dims of ``values``
    or the indices is replicated on that mesh axis; a shard of a dim nothing indexes stays. torch
    2.11's DTensor chose the first (DeepSeek-V3 under fsdp failed in its step)."""
    import torch
    from torch import fx
    from torch.distributed.tensor.placement_types import Replicate, Shard

    from autopar.ir import RuleResult
    from autopar.indexing import sound_indexing

    g = fx.Graph()
    vals = {"self": torch.empty(128, 64), "idx": torch.empty(96, dtype=torch.long), "values": torch.empty(96, 64)}
    nodes = {}
    for name, v in vals.items():
        nodes[name] = g.placeholder(name)
        nodes[name].meta["val"] = v
    n = g.call_function(torch.ops.aten.index_put.default, (nodes["self"], [nodes["idx"]], nodes["values"], True))
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    bad = RuleResult([(S0, R), (R, R), (S0, R)], (S0, R), None, "dtensor")  # 2.11's choice, axis 0
    assert sound_indexing(n, bad) == RuleResult([(R, R), (R, R), (R, R)], (R, R), None, "dtensor")
    trailing = RuleResult([(R, S1), (R, R), (R, S1)], (R, S1), None, "dtensor")  # columns: nothing indexes them
    assert sound_indexing(n, trailing) is trailing
    split_indices = RuleResult([(R, R), (S0, R), (R, R)], (R, R), None, "dtensor")
    assert sound_indexing(n, split_indices).inputs[1] == (R, R)
    other = g.call_function(torch.ops.aten.add.Tensor, (nodes["self"], nodes["self"]))
    assert sound_indexing(other, bad) is bad
    # a cache written at positions of dim 2 ([None, None, pos]), heads sharded on dim 1: sound, kept
    cache = g.placeholder("cache")
    cache.meta["val"] = torch.empty(2, 8, 32, 16)
    pos = g.placeholder("pos")
    pos.meta["val"] = torch.empty(4, dtype=torch.long)
    new = g.placeholder("new")
    new.meta["val"] = torch.empty(2, 8, 4, 16)
    write = g.call_function(torch.ops.aten.index_put.default, (cache, [None, None, pos], new))
    heads = RuleResult([(S1, R), (R, R), (S1, R)], (S1, R), None, "dtensor")
    assert sound_indexing(write, heads) is heads
    S2 = Shard(2)
    positions = RuleResult([(S2, R), (R, R), (S2, R)], (S2, R), None, "dtensor")
    assert sound_indexing(write, positions).outputs == (R, R)


def test_an_index_put_dtensor_has_no_strategy_for_is_laid_out_from_its_indices():
    """indexing.index_put_layout (where DTensor has no strategy: torch 2.11's asserts every index is
    a tensor, so a KV cache written at ``[None, None, pos]`` under tp did not compile there): a
    shard of ``self`` on a dim the indices do not address is kept and ``values`` sharded on the dim
    that lands there (whole where it broadcasts); an indexed dim, a Partial, anything else: whole."""
    import torch
    from torch import fx
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    from autopar.indexing import index_put_layout
    from autopar.ir import ShardSpec

    g = fx.Graph()

    def ph(name, *shape, dtype=torch.float32):
        n = g.placeholder(name)
        n.meta["val"] = torch.empty(*shape, dtype=dtype)
        return n

    R, P = Replicate(), Partial()
    cache, pos, new = ph("cache", 2, 8, 32, 16), ph("pos", 4, dtype=torch.long), ph("new", 2, 8, 4, 16)
    write = g.call_function(torch.ops.aten.index_put.default, (cache, [None, None, pos], new))

    def layout(node, *placements):
        specs = [ShardSpec(p, tuple(a.meta["val"].shape), a.meta["val"].dtype)
                 for p, a in zip(placements, [node.args[0], *[i for i in node.args[1] if i is not None], node.args[2]])]
        res = index_put_layout(node, specs)
        return res.inputs, res.outputs

    assert layout(write, (Shard(1), R), (R, R), (Shard(1), R)) == ([(Shard(1), R), (R, R), (Shard(1), R)], (Shard(1), R))
    assert layout(write, (Shard(2), R), (R, R), (R, R)) == ([(R, R)] * 3, (R, R))  # the positions' dim: whole
    assert layout(write, (R, Shard(3)), (R, R), (R, P)) == ([(R, Shard(3)), (R, R), (R, Shard(3))], (R, Shard(3)))
    assert layout(write, (P, R), (R, R), (P, R)) == ([(R, R)] * 3, (R, R))  # partial sums: reduced
    one = g.call_function(torch.ops.aten.index_put.default, (cache, [None, None, pos], ph("bcast", 1, 8, 1, 16)))
    assert layout(one, (Shard(0), Shard(1)), (R, R), (R, R)) == ([(Shard(0), Shard(1)), (R, R), (R, Shard(1))],
                                                                 (Shard(0), Shard(1)))  # broadcast along dim 0
    # indices apart ([i, None, j]): the index result's dim first, then self's dim 1
    apart = g.call_function(torch.ops.aten.index_put.default,
                            (ph("x", 4, 5, 6), [ph("i", 3, dtype=torch.long), None, ph("j", 3, dtype=torch.long)],
                             ph("v", 3, 5)))
    assert layout(apart, (Shard(1),), (R,), (R,), (R,)) == ([(Shard(1),), (R,), (R,), (Shard(1),)], (Shard(1),))
    assert index_put_layout(g.call_function(torch.ops.aten.add.Tensor, (cache, cache)), []) is None
