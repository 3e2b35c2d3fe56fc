"""Ops nobody wrote a sharding rule for (issue 35, item 6): autopar derives one by running the op
whole and in chunks on random inputs (autopar/derived_rules.py), or gathers its inputs whole where
no split of them gives its result, and says which; either way the run matches one process."""

from __future__ import annotations

import pytest
import torch

from autopar.models import unruled


def _close(out, ref):
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    for got, want in zip(out["grads"], ref["grads"]):
        assert set(got) == set(want), set(got) ^ set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_a_row_wise_op_without_a_rule_runs_batch_parallel(pools, plan):
    """The gate op and its backward: tokens split over dp arrive split, and the derivation finds
    that the op runs on each rank's rows (output split the same way) and that its weight gradient
    is a partial sum (reduced like any other); no gather of the activations."""
    out = pools(2).run(unruled.job, {"dp": 2}, {"dp": plan}, False)
    _close(out, unruled.reference(False))
    derived = "\n".join(out["derived"])
    assert "demo_unruled.gate.default: on dp: inputs S(0), R -> outputs S(0) (checked by running it" in derived
    assert "demo_unruled.gate_backward.default: on dp: inputs S(0), S(0), R -> outputs S(0), P(sum)" in derived
    assert "no rule, derived: demo_unruled.gate.default" in out["report"]


def test_an_op_no_split_computes_gathers_its_inputs_and_says_so(pools):
    """center(x) = x - mean over the batch: chunk-wise results are not the whole, so its input
    is gathered whole on dp and the op runs replicated; the run still matches one process."""
    out = pools(2).run(unruled.job, {"dp": 2}, {"dp": "ddp"}, True)
    _close(out, unruled.reference(True))
    assert any(line.startswith("demo_unruled.center.default: on dp: inputs gathered whole, the op replicated "
                               "(its chunk-wise results do not make up the whole)") for line in out["derived"]), \
        out["derived"]


def test_what_cannot_be_checked_is_replicated_with_the_reason(monkeypatch):
    """Inputs past the size limit that stay past it scaled down are not run: the op is replicated,
    and the reason names the limit."""
    import autopar
    from autopar import derived_rules
    from autopar.mesh import fake_mesh
    from autopar.passes import propagate

    monkeypatch.setattr(derived_rules, "MAX_ELEMENTS", 16)
    monkeypatch.setattr(derived_rules, "_CACHE", {})
    monkeypatch.setattr(propagate, "_SHARED_STRATEGIES", {})
    monkeypatch.setenv("AUTOPAR_DISK_CACHE", "0")  # (DTensor asked anew: no answers from disk)
    model, batches, loss_fn = unruled.build()
    with fake_mesh({"dp": 2}, 0) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                             capture_eval=False)
    assert any("inputs larger than 16 elements that cannot be scaled down to check it" in line
               for line in pm.ctx.derived_rules), pm.ctx.derived_rules


def test_inputs_past_the_limit_are_checked_scaled_down(monkeypatch):
    """Planning at scale: inputs past the size limit are run on shapes scaled down (each distinct
    large size to its own small one), which finds the same rule as the traced shapes do."""
    import autopar
    from autopar import derived_rules
    from autopar.mesh import fake_mesh
    from autopar.passes import propagate

    monkeypatch.setattr(derived_rules, "MAX_ELEMENTS", 256)  # the traced [4, 8, 32] has 1,024
    monkeypatch.setattr(derived_rules, "_SMALL", 2)
    monkeypatch.setattr(derived_rules, "_CACHE", {})
    monkeypatch.setattr(propagate, "_SHARED_STRATEGIES", {})  # DTensor's answers shared by the process's compiles
    monkeypatch.setenv("AUTOPAR_DISK_CACHE", "0")  # (DTensor asked anew: no answers from disk)
    model, batches, loss_fn = unruled.build()
    with fake_mesh({"dp": 2}, 0) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                             capture_eval=False)
    gate = next(line for line in pm.ctx.derived_rules if line.startswith("demo_unruled.gate.default"))
    assert "inputs S(0), R -> outputs S(0) (checked by running it" in gate, gate
    assert "on shapes scaled down to [4, 6, 8], [8]" in gate, gate


def test_strided_shards_are_split_and_found_as_such():
    """A weight strided-sharded as a fused projection's is (each rank holds its share of every
    part) is split that way when the op runs in pieces, and an output laid out the same way is
    found as a strided shard: a column-wise op keeps the layout, a contraction gives a partial sum."""
    from torch import fx
    from torch.distributed.tensor import Partial, Replicate, Shard

    from autopar import derived_rules
    from autopar import torch_compat as tc

    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    vals = [torch.empty(6, 8), torch.empty(8, 12)]
    strided = tc.StridedShard(1, split_factor=2)
    found, how = derived_rules.measure(mm, [x, w], vals, [Replicate(), strided], 2)
    assert found == [strided], how
    found, _ = derived_rules.measure(mm, [x, w], vals, [Shard(1), Shard(0)], 2)
    assert found == [Partial()]
    # taken for a plain shard, the strided pieces would not make up the whole: never Shard(1)
    found, _ = derived_rules.measure(mm, [x, w], vals, [Replicate(), Shard(1)], 2)
    assert found == [Shard(1)]


def test_a_custom_grouped_matmul_is_sharded_by_tensor_parallelism(pools):
    """Stacked experts through an op nobody wrote a rule or a table entry for (segment_mm: tokens
    in E groups, each times its expert's [K, N] matrix): the tensor-parallel derivation runs it
    whole and in pieces and finds the up projection column-parallel (N split) and the down
    projection row-parallel (K split, a partial sum); the compiled rules, derived the same way,
    keep everything local (no gather), and two steps on tp=2 match one process."""
    from torch.distributed.tensor.placement_types import Shard

    from autopar.analysis.tensor_parallel import derive
    from autopar.capture import capture_graph

    model, batches, loss_fn = unruled.build(experts=4)
    dec = derive(capture_graph(model, batches[0], loss_fn), model, 2).decisions
    assert (dec["w_up"].placement, dec["w_up"].role) == (Shard(2), "column"), dec["w_up"]
    assert (dec["w_down"].placement, dec["w_down"].role) == (Shard(1), "row"), dec["w_down"]
    assert "segment_mm contracts it with w_down split on dim 1 (found by running it)" in dec["w_up"].why
    out = pools(2).run(unruled.job, {"tp": 2}, {"tp": "megatron"}, False, experts=4)
    _close(out, unruled.reference(False, experts=4))
    # a frozen parameter (no gradient) among sharded ones: the program's outputs keep their order
    # (the placement check paired the gradients with the wrong parameters past a missing one, and
    # stopped the compile with an internal error under megatron)
    out = pools(2).run(unruled.job, {"tp": 2}, {"tp": "megatron"}, False, experts=4, frozen=("proj.weight", "w_up"))
    _close(out, unruled.reference(False, experts=4, frozen=("proj.weight", "w_up")))
    assert out["placements"]["w_up"] == "(Shard(dim=2),)" and out["placements"]["w_down"] == "(Shard(dim=1),)"
    segment = [line for line in out["derived"] if line.startswith("demo_unruled.segment_mm")]
    assert segment and not any("gathered whole" in line for line in segment), out["derived"]
