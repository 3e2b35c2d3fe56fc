"""``autopar.compile(memory_budget=...)``: the cost model's predicted per-rank step peak checked
after the passes, before the parameters are distributed (autopar/analysis/budget.py).

The long-sequence demonstration (issue 18): the built-in Llama at sequence 8,192 (batch 1, fp32)
under an 80 MiB budget does not fit on one rank (predicted step peak ~105 MiB: a clear
MemoryBudgetError before anything runs) and fits on cp=2 ulysses (~55 MiB), on the fake process
group and on a real 2-rank gloo group (trained one step, the allocator's peak measured).
"""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.analysis.budget import parse_budget, predicted_memory
from autopar.analysis.cost import predict_memory
from autopar.compiler import build
from autopar.errors import MemoryBudgetError, PlanError
from autopar.models.llama import Llama, LlamaConfig, cross_entropy
from autopar.testing import build_model

SEQ = 8192
BUDGET = "80MiB"


def _long(seed: int = 0):
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(max_seq_len=SEQ))
    x = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    y = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(seed + 2))
    return model, (x, y)


def test_parse_budget():
    assert parse_budget(None) is None
    assert parse_budget(1234) == 1234
    assert parse_budget("80GiB") == 80 * 2**30
    assert parse_budget("512 MiB") == 512 * 2**20
    assert parse_budget("1.5GB") == 1_500_000_000
    assert parse_budget("4096") == 4096
    assert parse_budget("2kib") == 2048
    for bad in ("80 gigs", "GiB", "-1GiB", "1e999", 0, -5, True, [1], float("nan"), "0MiB"):
        with pytest.raises(PlanError, match="memory_budget") as e:
            parse_budget(bad)
        assert "memory_budget=" in e.value.where


def test_bad_budget_option(fake):
    model, batches, loss_fn = build_model("llama")
    with fake(dp=2) as mesh, pytest.raises(PlanError, match=r"memory_budget '80 gigs' is not a size"):
        autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                        memory_budget="80 gigs")


@pytest.mark.parametrize("axes,plan,options", [
    ({"cp": 2}, {"cp": "ulysses"}, {}),
    ({"dp": 2}, {"dp": "fsdp"}, {"accumulate": 2}),
    ({"pp": 2}, {"pp": "1f1b"}, {}),
])
def test_prediction_before_runtime_matches_runtime(fake, axes, plan, options):
    # the check's view of a rank (parameter shards from the placements, no runtime) predicts what
    # cost.predict_memory predicts for the built runtime
    model, batches, loss_fn = build_model("llama")
    with fake(**axes) as mesh:
        state = build(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan=plan, **options)
        before = predicted_memory(state)
        pm = autopar.compiler.runtime_for(state, capture_eval=False)
    after = predict_memory(pm)
    for k in ("parameters", "gradients", "optimizer_state", "program_peak", "step_peak"):
        assert before[k] == after[k], (k, before[k], after[k])


def test_long_sequence_fits_only_with_cp(fake):
    # cp=1: the predicted step peak exceeds the budget -> MemoryBudgetError at compile time, naming
    # the peak, its biggest parts, the budget and what to do
    model, batch = _long()
    with fake(cp=1) as mesh, pytest.raises(MemoryBudgetError) as e:
        autopar.compile(model, mesh, example_inputs=batch, loss_fn=cross_entropy, plan={"cp": "ulysses"},
                        capture_eval=False, memory_budget=BUDGET)
    msg = str(e.value)
    assert isinstance(e.value, PlanError)
    assert "predicted step peak 100.78 MiB" in msg and "exceeds memory_budget 80.00 MiB" in msg, msg
    assert "activations at the program's peak" in msg and "'cp': 'ulysses'" in msg and "recompute=" in msg
    assert e.value.predicted["step_peak"] > e.value.budget == 80 * 2**20
    # parameters never became DTensors: nothing was distributed
    assert not any(type(p) is not torch.nn.Parameter for p in model.parameters())
    # cp=2: fits
    model, batch = _long()
    with fake(cp=2) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batch, loss_fn=cross_entropy, plan={"cp": "ulysses"},
                             capture_eval=False, memory_budget=BUDGET)
    m = predict_memory(pm)
    assert m["step_peak"] <= 80 * 2**20 < e.value.predicted["step_peak"]
    assert m["step_peak"] / e.value.predicted["step_peak"] == pytest.approx(0.525, abs=0.02)


# ------------------------------------------------------------------------------- real gloo ranks
def long_cp_job(budget):
    import autopar

    mesh = autopar.mesh(cp=2)
    model, batch = _long()
    try:
        pm = autopar.compile(model, mesh, example_inputs=batch, loss_fn=cross_entropy, plan={"cp": "ulysses"},
                             capture_eval=False, memory_budget=budget)
    except MemoryBudgetError as e:
        return {"error": str(e), "distributed": any(type(p) is not torch.nn.Parameter for p in model.parameters())}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.track_memory()  # (on until the report: it reads the tracker)
    loss = pm.train_step(*batch)
    opt.step()
    return {"loss": loss.item(), "memory": pm.memory_report(opt), "records": [copy.copy(r) for r in pm.collectives()],
            "predicted_memory": {k: v for k, v in predict_memory(pm).items() if k != "alive_at_peak"}}


def test_long_sequence_cp2_gloo(pools):
    import time

    t0 = time.perf_counter()
    out = pools(2).run(long_cp_job, BUDGET)
    wall = time.perf_counter() - t0
    pred, mem = out["predicted_memory"], out["memory"]
    print(f"\ncp=2 seq {SEQ}: predicted step peak {pred['step_peak']:,}, measured {mem['step_peak']:,} "
          f"(allocator program peak {mem['program_peak']:,}, without the process group's buffers "
          f"{mem['program_peak_without_backend']:,}; tensors {mem['tensor_peak']:,} vs predicted "
          f"{pred['tensor_peak']:,}); loss {out['loss']:.4f}; {wall:.1f} s")
    assert mem["step_peak"] <= parse_budget(BUDGET)
    # the allocator's peak against the prediction: 10%, not the parity suite's 5%. At seq 8,192 the
    # full suite measured 59,506,696 B against 56,393,732 predicted (+5.5%; alone: within 5%); the
    # claim tested here is the budget, above
    allocator, predicted = mem["program_peak_without_backend"], pred["program_peak"]
    assert 0.95 * predicted <= allocator <= 1.10 * predicted, (allocator, predicted)
    # a budget below cp=2's own prediction: every rank raises MemoryBudgetError, nothing distributed
    out = pools(2).run(long_cp_job, "40MiB")
    assert "exceeds memory_budget 40.00 MiB" in out["error"] and not out["distributed"]


def uneven_budget_job(budget):
    import autopar
    import torch.distributed as dist

    model, batches, loss_fn = build_model("llama")
    try:
        autopar.compile(model, autopar.mesh(pp=2), example_inputs=batches[0], loss_fn=loss_fn, plan={"pp": "1f1b"},
                        memory_budget=budget)
    except MemoryBudgetError as e:
        msgs = [None] * dist.get_world_size()
        dist.all_gather_object(msgs, str(e))  # (the group is still usable: nothing was sent)
        return msgs
    return None


def test_one_rank_over_budget_every_rank_raises(pools):
    # pp=2: the first stage's rank predicts 1,158,272 B, the last's 1,093,188 B; a budget between
    # them stops rank 0 with its own prediction and rank 1 with the same kind of error naming rank 0
    msgs = pools(2).run(uneven_budget_job, 1_125_000)
    assert msgs is not None
    assert msgs[0].startswith("predicted step peak") and "exceeds memory_budget" in msgs[0]
    assert msgs[1].startswith("rank 0: predicted step peak") and "exceeds memory_budget" in msgs[1], msgs[1]


def test_the_runtime_meter_counts_grouped_query_attention_as_the_cost_model(monkeypatch):
    """The runtime's FLOP meter (ProgramMeter) counts SDPA with grouped K / V heads through
    analysis.ops.op_flops, heads matched to the query's, as the cost model does. torch 2.11's SDPA
    formula asserts equal heads: the meter called it raw and every training step of a GQA model
    raised there (found on torch 2.11, 2026-12-04). Here 2.11's assertion is put back in front of
    torch's formula."""
    import torch.nn.functional as F
    from torch.utils import flop_counter

    from autopar.runtime.memory import ProgramMeter

    formula = flop_counter.sdpa_flop_count

    def as_in_2_11(q, k, v):
        assert q[1] == k[1] == v[1], "sdpa_flop_count: query/key/value shapes are incompatible"
        return formula(q, k, v)

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", as_in_2_11)
    q, k = torch.randn(2, 8, 32, 16), torch.randn(2, 2, 32, 16)
    with ProgramMeter([], []) as meter:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    wide = torch.randn(2, 8, 32, 16)
    with ProgramMeter([], []) as whole:
        F.scaled_dot_product_attention(q, wide, wide, is_causal=True)
    assert meter.flops == whole.flops > 0
