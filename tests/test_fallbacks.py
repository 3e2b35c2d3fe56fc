"""No silent fallbacks: a parameter no rule places, or a cost that cannot be computed, is said.

A tensor-parallel strategy that does not recognise a parameter is a PlanError naming it
(plan["rest"] = "replicate" says to replicate it, and the reports list it with its size); a FLOP
formula that fails is an error in the pipeline split and "unknown" in ``autopar plan``, never 0.
All on a fake process group: seconds, no processes.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.utils import flop_counter

import autopar
from autopar.plan import parse_plan, place_parameters
from autopar.tools.cli import main as cli

HERE = pathlib.Path(__file__).resolve()


class Odd(torch.nn.Module):
    """Megatron-named projections, a norm, and two parameters no preset knows."""

    def __init__(self):
        super().__init__()
        self.up_proj = torch.nn.Linear(8, 16, bias=False)
        self.down_proj = torch.nn.Linear(16, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)
        self.gizmo = torch.nn.Parameter(torch.ones(8))
        self.widget = torch.nn.Parameter(torch.ones(3, 8))

    def forward(self, x):
        return (self.norm(self.down_proj(self.up_proj(x)) * self.gizmo) * self.widget.sum(0)).sum()


def odd():
    """``autopar explain tests/test_fallbacks.py:odd`` (a model factory)."""
    torch.manual_seed(0)
    return Odd(), (torch.randn(4, 8),)


def _params():
    return dict(Odd().named_parameters())


def test_unmatched_parameters_are_an_error_naming_each():
    """A rule list that misses parameters names each of them (with its shape) and what to do."""
    plan = parse_plan({"tp": [("*up_proj.weight", "S(0)"), ("*down_proj.weight", "S(1)"), ("*norm*", "R")]}, ("tp",))
    with pytest.raises(autopar.PlanError) as e:
        place_parameters(plan, _params(), (2,))
    msg = str(e.value)
    assert "rule list in plan['tp'] has no rule for 2 parameter(s)" in msg and "mesh axis 'tp'" in msg
    assert "gizmo [8]" in msg and "widget [3, 8]" in msg  # every one, with its shape
    assert "up_proj" not in msg and "norm" not in msg.split("what to do")[0]  # matched ones are not named
    assert e.value.where == "plan['tp']" and 'plan["rest"] = "replicate"' in e.value.fix


def test_unmatched_on_a_user_rule_list_and_on_a_size_one_axis():
    """The rules decide, not the mesh size: a plan that works on tp=1 works on tp=8."""
    plan = parse_plan({"dp": "fsdp", "tp": [("*proj.weight", "S(0)")]}, ("dp", "tp"))
    with pytest.raises(autopar.PlanError, match=r"rule list in plan\['tp'\] has no rule for 4") as e:
        place_parameters(plan, _params(), (2, 1))
    assert "'dp'" not in str(e.value)  # data-parallel presets match every parameter


def test_rules_and_rest_say_what_to_do():
    params = _params()
    base = [("*up_proj.weight", "S(0)"), ("*down_proj.weight", "S(1)"), ("*norm*", "R")]
    rules = {"gizmo": {"tp": "R"}, "widget": {"tp": "S(1)"}}
    placed = place_parameters(parse_plan({"tp": base, "rules": rules}, ("tp",)), params, (2,))
    assert placed.unplaced == {} and placed.compute["widget"] == (Shard(1),)
    placed = place_parameters(parse_plan({"tp": base, "rest": "replicate"}, ("tp",)), params, (2,))
    assert placed.unplaced == {"tp": ["gizmo", "widget"]}
    assert placed.compute["gizmo"] == (Replicate(),) and placed.compute["up_proj.weight"] == (Shard(0),)
    why = dict(placed.replicated["tp"])
    assert why == {"norm.weight": "plan['tp'] rule '*norm*'", "norm.bias": "plan['tp'] rule '*norm*'",
                   "gizmo": "plan['rest'] = 'replicate' (no rule matched)",
                   "widget": "plan['rest'] = 'replicate' (no rule matched)"}


@pytest.mark.parametrize("rest", ["shard", {"tp": "replicate"}, None])
def test_bad_rest_is_a_plan_error(rest):
    with pytest.raises(autopar.PlanError, match="unknown plan\\['rest'\\] value") as e:
        parse_plan({"tp": "megatron", "rest": rest}, ("tp",))
    assert e.value.where == "plan['rest']"


def test_megatron_preset_shards_stacked_experts(fake):
    """The built-in MoE's experts [E, dim, ffn] are split along ffn like a dense MLP (numerics
    against one process: checked on gloo when the rule was added), the router replicated (its
    softmax is over the experts: derived from the graph)."""
    from autopar.compiler import build
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy

    model = Llama(LlamaConfig(n_experts=4, n_layers=1))
    tokens = torch.randint(0, 64, (2, 8))
    with fake(tp=2) as mesh:
        st = build(model, mesh, example_inputs=(tokens, tokens), loss_fn=cross_entropy, plan={"tp": "megatron"},
                   stop_after="split")
        placed = st.stages[0].ctx.placed
    assert placed.compute["layers.0.mlp.w_gate"] == placed.compute["layers.0.mlp.w_up"] == (Shard(2),)
    assert placed.compute["layers.0.mlp.w_down"] == (Shard(1),)
    assert placed.compute["layers.0.mlp.router.weight"] == (Replicate(),)
    assert "softmax" in st.tp_derived["tp"].decisions["layers.0.mlp.router.weight"].why


def test_rest_compiles_and_reports_list_every_replicated_parameter(fake, capsys):
    model, inputs = odd()
    base = [("*up_proj.weight", "S(0)"), ("*down_proj.weight", "S(1)"), ("*norm*", "R")]
    with fake(tp=2) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=inputs, plan={"tp": base, "rest": "replicate"})
    assert pm.ctx.placed.unplaced == {"tp": ["gizmo", "widget"]}
    report = pm.report()
    assert "'tp' (whole tensor on each of its ranks): 4 parameter(s), 48 elements, 192 B in all" in report
    assert "widget" in report and "24 elements" in report and "96 B  <- plan['rest'] = 'replicate'" in report
    # the command line: an error without "rest", the same list (with sizes) in explain with it
    spec = f"{HERE}:odd"
    assert cli(["explain", spec, "--mesh", "tp=2", "--plan", "tp=megatron,rest=bogus", "-q"]) == 2
    assert "unknown plan['rest'] value 'bogus'" in capsys.readouterr().err
    # megatron derives every placement from the graph: nothing is left without a rule, and each
    # replicated parameter says why
    assert cli(["explain", spec, "--mesh", "tp=2", "--plan", "tp=megatron", "-q"]) == 0
    out = capsys.readouterr().out
    assert "what tensor parallelism does not divide" in out
    for line in ("gizmo", "widget", "norm.weight"):
        assert any(line in ln and " B  <- derived from the graph: " in ln for ln in out.splitlines()), line
    assert any("up_proj.weight" in ln and "column-parallel" in ln for ln in out.splitlines())
    assert any("down_proj.weight" in ln and "row-parallel" in ln for ln in out.splitlines())


def _broken_mm(monkeypatch):
    def boom(*args, **kwargs):
        raise KeyError("formula broken on purpose")

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, boom)


def test_failing_flop_formula_is_unknown_in_plan_not_zero(monkeypatch, capsys):
    _broken_mm(monkeypatch)
    assert cli(["plan", "llama-tiny", "--mesh", "dp=2", "-q", "--set", "n_layers=1"]) == 0
    out = capsys.readouterr().out
    flops = next(ln for ln in out.splitlines() if ln.startswith("FLOPs per step"))
    assert "unknown (>= " in flops and "op(s) not counted" in flops
    assert "model FLOP/s utilisation" in out and "unknown" in out.split("model FLOP/s utilisation")[1].splitlines()[0]
    assert "aten.mm.default (mm) at models/llama.py:" in out and "KeyError" in out  # the op, the line, why


def test_failing_flop_formula_stops_the_pipeline_split(monkeypatch, fake):
    from autopar.testing import build_model

    _broken_mm(monkeypatch)
    model, batches, loss_fn = build_model("llama")
    with fake(pp=2) as mesh, pytest.raises(autopar.PlanError) as e:
        autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"pp": "1f1b"},
                        pipeline_stages="all")
    assert "cannot count the FLOPs of linear" in str(e.value)
    assert "aten.mm (which it runs): its FLOP formula raised KeyError" in str(e.value)
    assert e.value.where.startswith("models/llama.py:") and "plan['pp']['split']" in e.value.fix
