"""{"ep": "expert"}: expert parallelism on an ``ep`` mesh axis (autopar/experts.py).

Stacked expert weights sharded on the expert dim over ep, the batch split over ep (dense
parameters replicated, their gradients all-reduced as under ddp), tokens sent to their experts'
ranks and back by uneven all-to-alls inside ``autopar::moe_experts_ep``. Checked: the dropless
op against a per-token loop (values and gradients); parity with one process on gloo pools
(losses, gradients, parameters after AdamW steps, eval forward, memory); the bytes the process
group counted for the token exchange against the formula from the single-process run's own
routing; every other collective's bytes = predicted; and the PlanErrors before any process group
work (experts not divisible by ep, an ep axis on a model without experts, the GShard capacity MoE).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.errors import PlanError
from autopar.ir import bytes_by_collective, info
from autopar.testing import build_model, parity_job
from test_parity import LR, assert_memory_predicted, assert_parity

EP_KEY = "all_to_all_v@ep"


def test_dropless_op_matches_loop():
    torch.manual_seed(0)
    t, h, f, e, k = 12, 8, 6, 4, 2
    x = torch.randn(t, h, dtype=torch.float64, requires_grad=True)
    w, idx = torch.randn(t, e, dtype=torch.float64).softmax(-1).topk(k, -1)
    w = w.detach().requires_grad_()
    weights = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((e, h, f), (e, h, f), (e, f, h))]

    def loop(x, w, wg, wu, wd):
        rows = []
        for i in range(t):
            rows.append(sum(w[i, j] * ((F.silu(x[i] @ wg[idx[i, j]]) * (x[i] @ wu[idx[i, j]])) @ wd[idx[i, j]])
                            for j in range(k)))
        return torch.stack(rows)

    got = torch.ops.autopar.moe_experts(x, idx, w, *weights)
    want = loop(x, w, *weights)
    torch.testing.assert_close(got, want)
    g = torch.randn(t, h, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, [x, w, *weights], g), torch.autograd.grad(want, [x, w, *weights], g)):
        torch.testing.assert_close(a, b)


def _routing_reference(name: str, steps: int = 3):
    """The single-process run's routing: per step, per MoE layer, the expert ids [tokens, k]."""
    model, batches, loss_fn = build_model(name)
    seen: list = []

    def hook(k):
        return lambda mod, inp, out: seen.append(F.softmax(out, dim=-1, dtype=torch.float32).topk(k, dim=-1)[1])

    hooks = [m.router.register_forward_hook(hook(m.top_k)) for m in model.modules() if hasattr(m, "w_gate")]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    per_step = []
    for i in range(steps):
        seen.clear()
        x, y = batches[i % len(batches)]
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(list(seen))
    for hk in hooks:
        hk.remove()
    return per_step, model


def ep_bytes_formula(routing, ep: int, rank: int, ranks_tokens: int, h: int, num_experts: int, itemsize: int = 4):
    """Bytes expert-parallel rank ``rank`` sends off-rank per the module docstring of autopar/experts.py:
    per layer, forward (P_out + P_in)·h, backward P_out·(2h+1) + P_in·(h+1) elements, P_out its
    pairs routed to other ranks' experts, P_in the pairs other ranks route to its experts.
    ``ranks_tokens``: how many tokens each ep rank holds (a contiguous block, in rank order)."""
    local = num_experts // ep
    total = 0
    for layers in routing:
        for idx in layers:
            owner = idx // local
            src = (torch.arange(idx.shape[0]) // ranks_tokens)[:, None].expand_as(idx)
            p_out = int(((src == rank) & (owner != rank)).sum())
            p_in = int(((src != rank) & (owner == rank)).sum())
            total += (p_out + p_in) * h + p_out * (2 * h + 1) + p_in * (h + 1)
    return total * itemsize


CASES = [
    ("moe_dropless", {"ep": 2}, {"ep": "expert"}),
    ("moe_dropless", {"dp": 2, "ep": 2}, {"dp": "fsdp", "ep": "expert"}),
]


@pytest.mark.parametrize("name,axes,plan", CASES, ids=["ep2", "fsdp2xep2"])
def test_expert_parallel_parity(pools, references, name, axes, plan):
    world = 1
    for v in axes.values():
        world *= v
    out = pools(world).run(parity_job, name, axes, plan)
    assert_parity(references(name), out, name)
    assert_memory_predicted(out)
    assert "expert parallel (ep=expert)" in out["rules"]
    assert out["placements"]["layers.0.mlp.w_gate"].count("Shard(dim=0)") >= 1
    # every collective but the token exchange: measured = predicted, step for step
    predicted = {k: v * out["steps"] for k, v in bytes_by_collective(out["records"]).items()}
    measured = {k: v["wire_bytes"] for k, v in out["measured"].items()}
    assert set(measured) == set(predicted)
    routed = measured.pop(EP_KEY)
    predicted.pop(EP_KEY)
    assert measured == pytest.approx(predicted)
    # the token exchange: the bytes the process group carried = the formula over the routing the
    # single-process run chose (rank 0 of ep holds the first half of the batch; under dp x ep the
    # dp rank 0 / ep rank 0 process holds the first quarter, its ep peer the second)
    routing, _ = _routing_reference(name)
    b, s, h = 4, 16, 64
    dp = axes.get("dp", 1)
    tokens = b * s // dp  # the tokens of rank 0's ep group, in ep rank order
    routing_dp0 = [[idx[:tokens] for idx in layers] for layers in routing]
    assert routed == ep_bytes_formula(routing_dp0, axes["ep"], 0, tokens // axes["ep"], h, 4)
    est = [r for r in out["records"] if r.kind == "all_to_all_v"]
    assert len(est) == 2 * 2 and all(r.axis == "ep" for r in est)  # per layer: forward and backward


def _compile(fake, name, axes, plan, batch=None):
    model, batches, loss_fn = build_model(name)
    with fake(**axes) as mesh:
        return autopar.compile(model, mesh, example_inputs=batch or batches[0], loss_fn=loss_fn, plan=plan,
                               capture_eval=False)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_predicted_bytes(fake, ep):
    # the built-in MoE (2 layers, 4 experts, top-2, h = 64), batch 4 x 16, fp32: per layer one
    # all-gather of the [E] pair counts per direction, and the token exchange's balanced-routing
    # estimate: T = 64/ep local tokens, T·k·(ep-1)/ep of its pairs leave the rank, as many come
    # back: forward 2·h per pair, backward (2h+1) + (h+1) elements per pair
    t, k, h, e, layers = 64 // ep, 2, 64, 4, 2
    pm = _compile(fake, "moe_dropless", {"ep": ep}, {"ep": "expert"})
    recs = [r for r in pm.collectives() if r.axis == "ep"]
    off = t * k * (ep - 1) // ep
    for phase, per_pair in (("forward", 2 * h), ("backward", 3 * h + 2)):
        v = [r for r in recs if r.kind == "all_to_all_v" and r.phase == phase]
        assert len(v) == layers and all(r.payload_bytes == off * per_pair * 4 for r in v)
        g = [r for r in recs if r.kind == "all_gather" and r.phase == phase]
        assert len(g) == layers and all(r.payload_bytes == e * 8 for r in g)
    assert pm.predicted_bytes()["all_to_all_v@ep"] == layers * off * (5 * h + 2) * 4
    rules = {info(n).rule.name for n in pm.program.graph.nodes if info(n).rule is not None}
    assert "expert parallel (ep=expert)" in rules


def test_expert_parallel_bad_inputs(fake):
    x = torch.randint(0, 256, (6, 16))  # a batch 3 ranks split
    with pytest.raises(PlanError, match=r"'layers.0.mlp.w_gate' .* stacks 4 experts.*'ep' of size 3: 4 is not "
                                        r"divisible by 3"):
        _compile(fake, "moe_dropless", {"ep": 3}, {"ep": "expert"}, batch=(x, x))
    with pytest.raises(PlanError, match=r"'ep' is expert-parallel but the model has no expert weights"):
        _compile(fake, "llama", {"ep": 2}, {"ep": "expert"})
    with pytest.raises(PlanError, match=r"does not compute its experts with the dropless expert op"):
        _compile(fake, "moe", {"ep": 2}, {"ep": "expert"})


HF_CASES = [pytest.param("Mixtral", "ep", 0.0, marks=pytest.mark.slow),  # (9 s; CI: the same with the router's loss)
            ("Qwen2-MoE", "ep", 0.0), ("Mixtral", "ep", 0.5),
            pytest.param("Mixtral", "fsdp+ep", 0.5, marks=pytest.mark.slow)]  # (4 ranks, 13 s; fsdp2xep2 in CI)


@pytest.mark.parametrize("name,plan,aux", HF_CASES, ids=["Mixtral-ep", "Qwen2-MoE-ep", "Mixtral-ep-aux",
                                                         "Mixtral-fsdp+ep-aux"])
def test_hf_expert_parallel_parity(pools, name, plan, aux):
    # transformers' MixtralExperts / Qwen2MoeExperts (stacked gate_up_proj [E, 2f, h], down_proj
    # [E, h, f]) traced as autopar::moe_experts under the expert plan; every step's loss, gradients
    # and parameters, and the eval forward, against eager transformers on one process. ``aux``: the
    # loss adds aux x Mixtral's load-balancing loss (its router's top-k and histc over the batch:
    # sums over ep-sharded tokens, all-reduced, as on one device)
    from autopar.models.hf_archs import MORE_PLANS, breadth_job, breadth_reference, compare

    world = 1
    for v in MORE_PLANS[plan][0].values():
        world *= v
    out = pools(world).run(breadth_job, name, plan, router_aux=aux)
    assert compare(breadth_reference(name, router_aux=aux), out) is None
    assert "expert parallel (ep=expert)" in out["rules"]


def test_expert_parallel_in_pipeline_parity(pools, references):
    # pp x ep on 4 ranks (1f1b): each stage's MoE layer runs expert-parallel on its ep sub-mesh;
    # the stages hand each other the ep rank's batch shard
    from autopar.testing import pipeline_parity_job
    from test_pipeline import assert_bytes_predicted, assert_parity as assert_pipeline_parity

    out = pools(4).run(pipeline_parity_job, "moe_dropless", {"pp": 2, "ep": 2}, {"pp": "1f1b", "ep": "expert"})
    assert_pipeline_parity(references("moe_dropless"), out)
    for got in assert_bytes_predicted(out, data_dependent=(EP_KEY,)):  # the token exchange: the router's
        assert got.get("send@pp", 0) > 0, got


def test_hf_experts_swap_is_undone(fake):
    # the swap of transformers' experts forward lives only inside autopar's capture: after a
    # compile, and after a capture that raises, every experts module is as transformers made it
    from autopar.errors import CaptureError
    from autopar.models.hf_archs import build_hf

    def experts_of(model):
        found = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
        assert len(found) == 2
        return found

    model, batches, loss_fn = build_hf("Mixtral")
    with fake(ep=2) as mesh:
        autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"ep": "expert"})
    assert not any("forward" in m.__dict__ for m in experts_of(model))

    model, batches, _ = build_hf("Mixtral")
    experts = experts_of(model)
    swapped = []

    def failing_loss(logits, targets):
        swapped.append(all("forward" in m.__dict__ for m in experts))
        raise ValueError("a loss that raises")

    with fake(ep=2) as mesh, pytest.raises(CaptureError, match="a loss that raises"):
        autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=failing_loss, plan={"ep": "expert"})
    assert swapped and all(swapped)  # swapped while tracing
    assert not any("forward" in m.__dict__ for m in experts)
    # under another plan too, the user's exception is what the error says (transformers' experts
    # path on fake fp32 CPU tensors said "Expected inputs of BF16 type" instead)
    with fake(dp=2) as mesh, pytest.raises(CaptureError, match="a loss that raises"):
        autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=failing_loss, plan={"dp": "fsdp"})
    assert not any("forward" in m.__dict__ for m in experts)


def test_hf_experts_computing_as_mixtrals_are_swapped():
    # transformers' experts classes whose forward is MixtralExperts.forward word for word are traced
    # as autopar::moe_experts whatever their name (DeepSeek-V3's: parity under ep=2 against eager
    # transformers checked by benchmarks/hf_breadth.py DeepSeek-V3 --plans ep); gpt-oss's (biases,
    # a clamped SwiGLU) is not, and its ep plan is the PlanError that says so
    from autopar.experts import _swappable
    from autopar.models.hf_archs import build_hf

    for name, cls, swapped in (("DeepSeek-V3", "DeepseekV3Experts", True), ("gpt-oss", "GptOssExperts", False)):
        model, _, _ = build_hf(name)
        found = [m for m in model.modules() if type(m).__name__ == cls]
        assert found and all(_swappable(m) is swapped for m in found), name


def test_expert_parallel_bf16_parity(pools, references):
    # bf16 compute, fp32 master weights (the reference casts as autopar's front end does): the
    # mixed-precision tolerances of tests/test_state.py; every collective but the token exchange
    # measured = predicted
    from test_state import assert_close_mixed

    out = pools(2).run(parity_job, "moe_dropless", {"ep": 2}, {"ep": "expert"}, evaluate=False, precision="bf16")
    assert_close_mixed(references("moe_dropless", "bf16"), out, references("moe_dropless"))
    predicted = {k: v * out["steps"] for k, v in bytes_by_collective(out["records"]).items()}
    measured = {k: v["wire_bytes"] for k, v in out["measured"].items()}
    assert measured.pop(EP_KEY) > 0 and predicted.pop(EP_KEY) > 0
    assert measured == pytest.approx(predicted)
