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
