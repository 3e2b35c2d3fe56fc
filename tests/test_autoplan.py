"""plan="auto" from Python (autopar/planner/api.py): ``autopar.plan`` ranks a user's model's plans
as data without compiling for a real mesh; ``autopar.compile(plan="auto")`` searches on the mesh
it is given, says in one line (and in report()) what it chose, and compiles that, on a fake mesh
and on two real gloo ranks (rank 0 searches in a forked copy that forgets the process groups)."""

from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar.errors import PlanError


def _model(name: str):
    import foreign_models

    return getattr(foreign_models, name)()


def test_plan_returns_the_ranked_plans_as_data(monkeypatch):
    monkeypatch.setenv("AUTOPAR_PLAN_FORK", "always")
    model, inputs, loss = _model("hf_gpt2")  # Hugging Face GPT-2 from its config: transformer.h, 6 blocks
    plans = autopar.plan(model, inputs, loss, world=4, device="h100", budget="80GiB", recompute="none", top=1)
    assert isinstance(plans, autopar.Plans) and isinstance(plans.best, autopar.PlanChoice)
    best = plans.best
    assert best.confirmed and best.step_s > 0 and 0 < best.peak_bytes <= 80 * 2**30
    assert set(best.compile_options()) == {"plan", "recompute", "accumulate"} and best.recompute == "none"
    assert [c.step_s for c in plans.ranked if c.confirmed] == sorted(c.step_s for c in plans.ranked if c.confirmed)
    assert any("not divisible" in why for _, why in plans.rejected)  # (e.g. 6 layers by pp=4)
    text = plans.report()
    assert "the blocks of transformer.h checked identical at depths 1-3" in text
    assert "autopar.compile(model, autopar.mesh(" in text  # the call that compiles the chosen plan
    assert all(p.is_meta and type(p) is torch.nn.Parameter for p in model.parameters())  # the model untouched
    with pytest.raises(PlanError, match="cannot search Unalike: the blocks of its list blocks are not alike"):
        autopar.plan(*_model("unalike"), world=2)


@pytest.mark.slow  # (37 s; test_compile_auto_on_real_ranks below runs compile(plan="auto") in CI)
def test_compile_auto_chooses_says_why_and_compiles(monkeypatch, capsys):
    from autopar.mesh import fake_mesh

    # (this process does not fork here: the search replaces the fake process group, then makes it
    # again, and compile its mesh; the job below forks)
    model, inputs, loss = _model("hf_llama_wide")
    with fake_mesh({"dp": 2, "tp": 2}, 0) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=inputs, loss_fn=loss, plan="auto", precision="bf16",
                             memory_budget="24GiB", recompute="selective", capture_eval=False)  # (fixed: fewer compiles)
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith("autopar: plan='auto' chose plan={'dp': ") and "on mesh {'dp': 2, 'tp': 2}" in line
        assert "recompute='selective'" in line
        assert "the fastest predicted step" in line and "of 24.00 GiB" in line
        assert line in pm.report()
        assert pm.ctx.plan.describe().startswith("dp=")
    with pytest.raises(PlanError, match="chooses accumulate"):
        with fake_mesh({"dp": 2}, 0) as mesh:
            autopar.compile(torch.nn.Linear(2, 2), mesh, example_inputs=(torch.zeros(2, 2),), plan="auto",
                            accumulate=2)


def auto_job():
    """On each of two gloo ranks: compile(plan="auto") on a real (CPU) model, then a step."""
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy
    from autopar.testing import build_model

    os.environ["AUTOPAR_PLAN_FORK"] = "always"  # (the pool's worker has a queue feeder thread)
    torch.manual_seed(0)
    _, batches, _ = build_model("llama")
    x, y = batches[0]
    mesh = autopar.mesh(dp=2)
    pm = autopar.compile(Llama(LlamaConfig(n_layers=3)), mesh, example_inputs=(x, y), loss_fn=cross_entropy,
                         plan="auto", recompute="none")
    loss = pm.train_step(x, y).item()
    every = [None, None]
    torch.distributed.all_gather_object(every, (pm.ctx.plan.describe(), pm.auto_plan))
    return {"plan": pm.ctx.plan.describe(), "line": pm.auto_plan, "loss": loss, "every": every}


def test_compile_auto_on_real_ranks(pools):
    out = pools(2).run(auto_job)
    assert out["line"].startswith("autopar: plan='auto' chose") and "on cpu" in out["line"]
    assert out["plan"].startswith("dp=") and out["loss"] > 0
    assert out["every"][0] == out["every"][1]  # rank 1 took rank 0's choice
