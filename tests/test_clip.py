"""Global gradient clipping (``pm.clip_grad_norm_``, autopar/runtime/grads.py) against
torch.nn.utils.clip_grad_norm_ on one process: the same model, init and batches, 2 steps of
train_step -> clip -> AdamW. The total norm (orders 2, 3, inf), the clipped gradients and the
parameters after the steps, under ddp, fsdp, megatron (its norm weights are replicated: counted
once), fsdp x megatron on 4 ranks, a 2-stage pipeline and fp16 with loss scaling; and the errors
(before any step; a non-finite gradient on one rank raises on every rank).
"""

from __future__ import annotations

import math

import pytest
import torch

import autopar
from autopar.testing import FP16_TEST_SCALE, build_model
from autopar.runtime.common import full_tensor, local_tensor
from torch.distributed.tensor import DTensor

LR = 1e-2
STEPS = 2
FRACTION = 0.5  # max_norm = half the step's true norm: every step is clipped

CASES = [  # (id, model, mesh, plan, compile options, pool size)
    ("ddp", "ce_rules", {"dp": 2}, {"dp": "ddp"}, {}, 2),
    ("fsdp", "ce_rules", {"dp": 2}, {"dp": "fsdp"}, {}, 2),
    ("megatron", "ce_rules", {"tp": 2}, {"tp": "megatron"}, {}, 2),
    ("fp16-ddp", "ce_rules", {"dp": 2}, {"dp": "ddp"}, {"precision": "fp16", "loss_scale": FP16_TEST_SCALE}, 2),
    ("pp2-1f1b-tied", "llama_tied", {"pp": 2}, {"pp": "1f1b"}, {}, 2),  # the tied weight on both stages: once
    ("fsdp-x-megatron", "ce_rules", {"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "megatron"}, {}, 4),
]


def reference(name: str, precision: str = "fp32") -> dict:
    """One process, eager: train_step -> torch.nn.utils.clip_grad_norm_ -> AdamW, STEPS times."""
    from autopar.capture import _WithLoss

    model, batches, loss_fn = build_model(name)
    dtype = torch.float16 if precision == "fp16" else None
    scale = FP16_TEST_SCALE if dtype else 1.0
    step_fn = _WithLoss(model, loss_fn, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    params = list(model.parameters())
    out = {"losses": [], "max_norm": [], "total": [], "grads": [], "inf": None, "p3": None}
    for i in range(STEPS):
        loss = step_fn(*batches[i])
        (loss * scale).backward()
        for p in params:
            p.grad.div_(scale)
        out["losses"].append(loss.item())
        if i == 0:
            out["raw"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            out["inf"] = torch.nn.utils.get_total_norm([p.grad for p in params], math.inf).item()
            out["p3"] = torch.nn.utils.get_total_norm([p.grad for p in params], 3.0).item()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0).item()
        out["max_norm"].append(FRACTION * norm)
        out["total"].append(torch.nn.utils.clip_grad_norm_(params, FRACTION * norm).item())
        out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _gather(d: dict) -> dict:
    """This rank's {name: full tensor} merged with every rank's (pipeline ranks hold their stages)."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, d)
    out = {}
    for e in everyone:
        out.update(e)
    return out


def clip_job(name: str, axes: dict, plan: dict, max_norms: list[float], **options) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor.placement_types import Replicate

    model, batches, loss_fn = build_model(name)
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=batches[0], loss_fn=loss_fn, plan=plan,
                         capture_eval=False, **options)
    out = {"losses": [], "totals": [], "grads": []}
    try:
        pm.clip_grad_norm_(1.0)
    except autopar.TrainingError as e:
        out["before_step"] = str(e)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    mine = dict(pm.named_parameters())
    placements = {n: p.placements if isinstance(p, DTensor) else pm.ctx.placed.placements[n] for n, p in mine.items()}
    for i in range(STEPS):
        out["losses"].append(pm.train_step(*batches[i]).item())
        if i == 0:
            out["raw"] = _gather({n: full_tensor(p.grad) for n, p in mine.items()})
            out["inf"] = pm.clip_grad_norm_(1e9, norm_type=math.inf).item()  # (scales by 1: nothing changes)
            out["p3"] = pm.clip_grad_norm_(1e9, norm_type=3).item()
            # only the gradients replicated on some axis: each must count once, not once per replica
            locals_ = {n: local_tensor(p.grad) for n, p in mine.items()}
            saved = {n: t.clone() for n, t in locals_.items()}
            out["replicated"] = sorted(_gather({n: None for n, p in mine.items()
                                                if any(isinstance(pl, Replicate) for pl in placements[n])}))
            for n, t in locals_.items():
                if n not in out["replicated"]:
                    t.zero_()
            out["replicated_norm"] = pm.clip_grad_norm_(1e9).item()
            for n, t in locals_.items():
                t.copy_(saved[n])
        total = pm.clip_grad_norm_(max_norms[i])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (total.item(), str(total.dtype), total.shape, type(total).__name__))
        out["totals"].append(everyone)
        out["grads"].append(_gather({n: full_tensor(p.grad) for n, p in mine.items()}))
        opt.step()
        opt.zero_grad()
    out["params"] = _gather({n: full_tensor(p.detach()) for n, p in mine.items()})
    # a non-finite gradient on rank 0 only: every rank must raise (none may wait in a collective)
    pm.train_step(*batches[0])
    if dist.get_rank() == 0:
        local_tensor(next(iter(mine.values())).grad).view(-1)[0] = float("inf")
    try:
        pm.clip_grad_norm_(1.0, error_if_nonfinite=True)
        raised = None
    except autopar.TrainingError as e:
        raised = str(e)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, raised)
    out["nonfinite"] = everyone
    try:
        pm.clip_grad_norm_(1.0, norm_type=0)
    except autopar.PlanError as e:
        out["norm_type_0"] = str(e)
    opt.zero_grad()  # (set_to_none): no gradient anywhere, on any rank: the norm is 0, as torch's
    out["no_grads"] = pm.clip_grad_norm_(1.0).item()
    return out


@pytest.fixture(scope="module")
def references():
    torch.set_num_threads(1)
    cache = {}

    def get(name, precision="fp32"):
        if (name, precision) not in cache:
            cache[(name, precision)] = reference(name, precision)
        return cache[(name, precision)]

    return get


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_clip_grad_norm_matches_torch(pools, references, case):
    cid, name, axes, plan, options, world = case
    ref = references(name, options.get("precision", "fp32"))
    out = pools(world).run(clip_job, name, axes, plan, ref["max_norm"], **options)
    fp16 = options.get("precision") == "fp16"
    rel = 2e-3 if fp16 else 1e-5  # fp16: the gradients themselves differ at half precision
    assert "before any train_step" in out["before_step"] and "clip_grad_norm_" in out["before_step"]
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=rel, atol=1e-5)
    for i in range(STEPS):
        values = {v for v, *_ in out["totals"][i]}
        assert len(values) == 1, f"step {i}: ranks disagree on the total norm: {out['totals'][i]}"
        total, dtype, shape, kind = out["totals"][i][0]
        assert (dtype, tuple(shape), kind) == ("torch.float32", (), "Tensor")
        assert total == pytest.approx(ref["total"][i], rel=rel), (cid, i, total, ref["total"][i])
        for k, g in ref["grads"][i].items():  # clipped: about half the raw gradient
            torch.testing.assert_close(out["grads"][i][k], g, rtol=1e-4 if not fp16 else 1e-2,
                                       atol=3e-5 if not fp16 else 1e-4, msg=f"{cid}: clipped grad {k}, step {i}")
    assert out["inf"] == pytest.approx(ref["inf"], rel=rel)
    assert out["p3"] == pytest.approx(ref["p3"], rel=rel)
    assert out["grads"][0].keys() == ref["grads"][0].keys()
    for k, p in ref["params"].items():
        # Adam divides by sqrt(v): an element whose gradient is about 0 at some step (|g| < 1e-6,
        # float noise on both sides) moves by up to lr either way, so it is held to that bound
        tiny = torch.stack([g[k].abs() < 1e-6 for g in ref["grads"]]).any(0)
        got, want = out["params"][k], p
        torch.testing.assert_close(got[~tiny], want[~tiny], rtol=0, atol=1e-4 if not fp16 else 1e-3,
                                   msg=f"{cid}: parameter {k} after {STEPS} AdamW steps")
        assert (got[tiny] - want[tiny]).abs().max().item() <= STEPS * LR if tiny.any() else True
    # replicated gradients alone: once each (a replica counted twice would give sqrt(2) x the norm)
    expect = torch.nn.utils.get_total_norm([ref["raw"][k] for k in out["replicated"]], 2.0).item() \
        if out["replicated"] else 0.0
    assert out["replicated_norm"] == pytest.approx(expect, rel=rel, abs=1e-12), (out["replicated"], expect)
    if cid == "megatron":  # the norm's weight and bias are replicated on tp, the rest is sharded
        assert out["replicated"] == ["norm.bias", "norm.weight"]
        assert 0 < out["replicated_norm"] < ref["max_norm"][0] / FRACTION  # a part of the whole gradient
    # one rank's inf: every rank raised, naming the parameter and rank 0
    assert all(e is not None and "non-finite" in e and "(rank 0)" in e for e in out["nonfinite"]), out["nonfinite"]
    assert "norm_type 0" in out["norm_type_0"] and out["no_grads"] == 0.0
