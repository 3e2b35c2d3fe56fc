"""{"cp": "ulysses"}: context parallelism by all-to-all (DeepSpeed-Ulysses) on a ``cp`` mesh axis.

The inputs' sequence dim is sharded over cp everywhere but attention, whose q, k, v are turned
from sequence shards into head shards by one all-to-all each, and whose output is turned back
(autopar/layout.py); parameters are replicated on cp, their gradients all-reduced over it.
Checked: parity against one process on gloo pools (losses, gradients, parameters after AdamW
steps, eval forward; measured = predicted bytes and memory), the all-to-alls' count and bytes
per layer against 4·b·s·h/cp per direction, activation memory falling with cp, and the
PlanErrors for a sequence or a head count cp does not divide.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.testing import build_model
from test_parity import case_ids, run_and_check_parity

CASES = [
    ("llama", {"cp": 2}, {"cp": "ulysses"}),
    ("hf_llama", {"cp": 2}, {"cp": "ulysses"}),
    ("llama", {"dp": 2, "cp": 2}, {"dp": "fsdp", "cp": "ulysses"}),
]


@pytest.mark.parametrize("name,axes,plan", CASES, ids=case_ids(CASES))
def test_ulysses_parity(pools, references, name, axes, plan):
    out = run_and_check_parity(pools, references, name, axes, plan)  # numbers, memory, bytes
    cp = [r for r in out["records"] if r.axis == "cp"]
    assert {r.kind for r in cp} == {"all_to_all", "all_reduce"}
    for r in cp:  # the all-to-alls at attention; the loss rule's sums and the gradients' all-reduces
        assert r.reason.startswith("ulysses") if r.kind == "all_to_all" else \
            r.reason.startswith(("inside rule", "bucket of", "gradient of")), r


def _compile(fake, name, axes, plan, batch=None):
    model, batches, loss_fn = build_model(name)
    with fake(**axes) as mesh:
        return autopar.compile(model, mesh, example_inputs=batch or batches[0], loss_fn=loss_fn, plan=plan,
                               capture_eval=False)


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_bytes_per_layer(fake, cp):
    # the built-in Llama (2 layers, h = dim = 64 = 4 heads x 16, 2 KV heads: kv = 32, which
    # attention reads as they are, enable_gqa: passes/masks.py), batch 4, seq 16, fp32: per layer
    # and direction 4 all-to-alls (forward: q, k, v to heads, the output back; backward: the
    # output's gradient to heads, dq, dk, dv back), each handing the process group this rank's
    # [b, s/cp, h] block (k's and v's: [b, s/cp, kv]): (2h + 2kv)·b·s/cp elements per layer and
    # direction, of which (cp-1)/cp leave the rank. At cp=4 the two KV heads cannot be split over
    # 4 ranks: they stay repeated to 4 (kv = h), as passes/masks.py reports
    b, s, h, layers = 4, 16, 64, 2
    kv = 32 if cp == 2 else h
    pm = _compile(fake, "llama", {"cp": cp}, {"cp": "ulysses"})
    said = "2 KV heads read as they are" if cp == 2 else "the plan splits the heads over 4 ranks"
    assert any(said in line for line in pm.ctx.masks), pm.ctx.masks
    a2a = [r for r in pm.collectives() if r.kind == "all_to_all"]
    assert all(r.axis == "cp" and r.group_size == cp for r in a2a)
    for phase in ("forward", "backward"):
        recs = [r for r in a2a if r.phase == phase]
        assert len(recs) == 4 * layers
        assert sum(r.payload_bytes for r in recs) == layers * (2 * h + 2 * kv) * b * s // cp * 4
        assert sum(r.wire_bytes for r in recs) == \
            pytest.approx(layers * (2 * h + 2 * kv) * b * s / cp * 4 * (cp - 1) / cp)
    # nothing else moves activations on cp: the loss rule's two scalars, the gradients' all-reduce
    others = [r for r in pm.collectives() if r.kind != "all_to_all"]
    assert {r.kind for r in others} == {"all_reduce"}
    assert all(r.payload_bytes == 4 or r.reason.startswith(("bucket of", "gradient of")) for r in others)


def test_ulysses_lowers_activation_memory(fake):
    from autopar.analysis.cost import predict_memory

    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    peak = {cp: predict_memory(_compile(fake, "llama", {"cp": cp}, {"cp": "ulysses"}, batch=(x, x)))
            for cp in (1, 2, 4)}
    assert peak[1]["parameters"] == peak[2]["parameters"] == peak[4]["parameters"]  # replicated on cp
    for cp in (2, 4):  # every activation is divided by cp (attention's too: heads instead of sequence)
        ratio = peak[cp]["peak_activations"] / peak[1]["peak_activations"]
        assert ratio == pytest.approx(1 / cp, rel=0.15), (cp, ratio)


@pytest.mark.parametrize("strategy", ["ulysses", "context"])
def test_fewer_sequences_than_cp_ranks_under_data_parallelism(fake, strategy):
    """dp=2 x cp=4 on 2 sequences: the [b*s] rows of a linear, the batch sharded on dp and the
    sequence strided on cp, unflattened back to [b, s] (torch 2.13's view propagation refused it:
    autopar/torch_compat.py ``fixed_views``). Parity on 8 gloo ranks with accumulate=2 was checked by
    hand (2 sequences per micro-batch; the suite's machine has 2 cores)."""
    _, batches, _ = build_model("llama")
    pm = _compile(fake, "llama", {"dp": 2, "cp": 4}, {"dp": "ddp", "cp": strategy}, batch=tuple(t[:2] for t in batches[0]))
    # each rank: one sequence of 16 / 4 tokens into the first linear, [1 * 4, 64]
    assert any(list(n.meta["val"].shape) == [4, 64] for n in pm.program.local.graph.nodes
               if n.op == "call_function" and "mm" in str(n.target) and "val" in n.meta)


def test_ulysses_bad_inputs(fake):
    x = torch.randint(0, 256, (4, 15))
    with pytest.raises(PlanError, match=r"sequence length .*15.* divisible .*'cp' \(2\)"):
        _compile(fake, "llama", {"cp": 2}, {"cp": "ulysses"}, batch=(x, x))
    x = torch.randint(0, 256, (4, 16))
    with pytest.raises(PlanError, match=r"heads over mesh axis 'cp' \(8 ranks\).* 4 heads"):
        _compile(fake, "llama", {"cp": 8}, {"cp": "ulysses"}, batch=(x, x))
    # tp x cp: megatron already split the 4 heads over tp=2; 2 per rank do not divide by cp=4
    with pytest.raises(PlanError, match=r"4 heads .*after mesh axis 'tp' \(2 ranks\) sharded them \(2 per rank\), "
                                        r"not divisible by 4"):
        _compile(fake, "llama", {"tp": 2, "cp": 4}, {"tp": "megatron", "cp": "ulysses"}, batch=(x, x))


# ------------------------------------------------------------------------------- compositions
def test_ulysses_with_megatron_parity(pools, references):
    # tp x cp on 4 ranks: megatron shards the heads over tp, ulysses the remaining heads over cp
    # at attention (2 query heads per tp rank -> 1 per rank; 2 KV heads -> 1 per tp rank,
    # repeated to 2 before SDPA -> 1 per rank) and the sequence over cp everywhere else
    out = run_and_check_parity(pools, references, "llama", {"tp": 2, "cp": 2}, {"tp": "megatron", "cp": "ulysses"})
    kinds = {(r.kind, r.axis) for r in out["records"]}
    assert ("all_to_all", "cp") in kinds and ("all_reduce", "tp") in kinds
    a2a = [r for r in out["records"] if r.kind == "all_to_all"]
    # per layer and direction 4 all-to-alls of this rank's [b, s/cp, h/tp] block
    b, s, h, layers, tp, cp = 4, 16, 64, 2, 2, 2
    assert len(a2a) == 2 * 4 * layers
    assert sum(r.payload_bytes for r in a2a) == 2 * layers * 4 * b * (s // cp) * (h // tp) * 4


def test_ulysses_in_pipeline_parity(pools, references):
    # pp x cp on 4 ranks (1f1b): each stage runs ulysses on its cp sub-mesh; the stages hand each
    # other sequence shards (cp rank r of stage 0 -> cp rank r of stage 1)
    from autopar.testing import pipeline_parity_job
    from test_pipeline import assert_bytes_predicted, assert_parity as assert_pipeline_parity

    out = pools(4).run(pipeline_parity_job, "llama", {"pp": 2, "cp": 2}, {"pp": "1f1b", "cp": "ulysses"})
    assert_pipeline_parity(references("llama"), out)
    for got in assert_bytes_predicted(out):
        assert got.get("send@pp", 0) > 0 and got.get("all_to_all@cp", 0) > 0, got
