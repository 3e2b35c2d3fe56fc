"""Twin pipeline stages (passes/twins.py): a stage that compiles to the same program as an
earlier one gets a renamed copy of it. Every stage's programs, roles, CommRecords and predicted
figures must equal a compile that traces every stage (AUTOPAR_STAGE_TWINS=0); parity on real
gloo ranks with twins is test_pipeline's llama6 pp=4 interleaved case (ranks 1 and 2 each hold
two one-block stages: the later is a twin)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.analysis import cost
from autopar.compiler import build
from autopar.mesh import fake_mesh
from autopar.testing import build_model


def _compile(name, axes, plan, twins: bool, monkeypatch, model=None, rank=1, figures=False):
    """The compile state (every stage); with ``figures``, also the cost model's time, memory and
    collectives of the compiled program."""
    monkeypatch.setenv("AUTOPAR_STAGE_TWINS", "1" if twins else "0")
    if model is None:
        model, batches, loss_fn = build_model(name)
        example = batches[0]
    else:
        model, example, loss_fn = model
    with fake_mesh(axes, rank) as mesh:
        if not figures:
            return build(model, mesh, example_inputs=example, loss_fn=loss_fn, plan=plan, pipeline_stages="all")
        pm = autopar.compile(model, mesh, example_inputs=example, loss_fn=loss_fn, plan=plan, pipeline_stages="all",
                             capture_eval=False)
        dev = cost.get_device("h100")
        est = cost.predict_time(pm, dev)
        return [pm.stages[s] for s in sorted(pm.stages)], (est.step_s, est.stage_seconds, est.comm_s, est.bubble,
                                                            cost.predict_memory(pm), list(pm.collectives()))


def _records(gm):
    return [n.meta["autopar"].comm for n in gm.graph.nodes if "autopar" in n.meta and n.meta["autopar"].comm]


def _assert_same_stage(a, b):
    assert str(b.program.local.graph) == str(a.program.local.graph)
    assert b.program.inputs == a.program.inputs and b.program.outputs == a.program.outputs
    assert str(b.program.graph) == str(a.program.graph)
    assert _records(b.program.local) == _records(a.program.local)
    assert [n.meta["autopar"].predicted for n in b.program.graph.nodes if "autopar" in n.meta] == \
        [n.meta["autopar"].predicted for n in a.program.graph.nodes if "autopar" in n.meta]
    assert str(b.sync.local.graph) == str(a.sync.local.graph) and _records(b.sync.local) == _records(a.sync.local)
    assert b.sync.inputs == a.sync.inputs and b.sync.outputs == a.sync.outputs
    assert {k: str(v.gm.graph) if v.gm is not None else None for k, v in b.parts.items()} == \
        {k: str(v.gm.graph) if v.gm is not None else None for k, v in a.parts.items()}
    assert (b.saved_bytes, b.saved_after_i, b.prologue_bytes) == (a.saved_bytes, a.saved_after_i, a.prologue_bytes)
    assert b.ph_names == a.ph_names and b.out_names == a.out_names
    assert set(b.program.buffers) == set(a.program.buffers)


@pytest.mark.parametrize("axes,plan", [
    ({"pp": 4}, {"pp": {"schedule": "interleaved", "virtual": 2}}),
    ({"pp": 2, "dp": 2, "tp": 2}, {"pp": {"schedule": "interleaved", "virtual": 4}, "dp": "zero2", "tp": "sequence"}),
    pytest.param({"pp": 2, "dp": 2}, {"pp": {"schedule": "interleaved", "virtual": 3}, "dp": "fsdp"},
                 marks=pytest.mark.slow),  # (10 s; CI: pp4, and the three-axis case's dp x pp)
], ids=["pp4", "pp2xdp2xtp2-zero2-sequence", "pp2xdp2-fsdp"])
def test_twins_equal_stages_traced_apart(monkeypatch, axes, plan):
    every, figures = _compile("llama6", axes, plan, False, monkeypatch, figures=True)
    twins, twin_figures = _compile("llama6", axes, plan, True, monkeypatch, figures=True)
    assert all(st.twin_of is None for st in every)
    marked = [st.twin_of for st in twins]
    assert sum(t is not None for t in marked) >= 3, marked  # the one-block stages after the first
    for a, b in zip(every, twins):
        _assert_same_stage(a, b)
    # the same predicted step, per-stage times, memory and collectives (reasons included)
    assert twin_figures == figures
    # a twin's program names its own parameters (not its original's), in its roles and reasons
    st = next(s for s in twins if s.twin_of is not None)
    rep = twins[st.twin_of]
    mine = {r[1] for r in st.program.inputs if r[0] == "param"}
    assert mine == set(st.param_names) and not mine & set(rep.param_names)


def test_a_stage_that_draws_random_numbers_has_no_twin(monkeypatch):
    import transformers

    from autopar.models.zoo import HF_TINY

    cfg = transformers.LlamaConfig(**dict(HF_TINY, vocab_size=128, num_hidden_layers=6), attention_dropout=0.1,
                                   use_cache=False, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 128, (4, 16))

    def ce(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))

    state = _compile(None, {"pp": 4}, {"pp": {"schedule": "interleaved", "virtual": 2}}, True, monkeypatch,
                     model=(model, (x, x), ce))
    assert [st.twin_of for st in state.stages] == [None] * 8
    model.eval()  # the same model in eval mode: its dropout draws nothing, so the blocks are twins again
    state = _compile(None, {"pp": 4}, {"pp": {"schedule": "interleaved", "virtual": 2}}, True, monkeypatch,
                     model=(model, (x, x), ce))
    assert any(st.twin_of is not None for st in state.stages)


def test_a_copied_program_is_its_own_module():
    """A twin's GraphModule shares its original's generated code (no code generation per copy)
    but not its class: recompiling one after editing its graph leaves the other as it was."""
    from torch import fx

    from autopar.passes.twins import _clone_gm, _copy_graph

    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    twin = _clone_gm(gm, _copy_graph(gm.graph, lambda s: s))
    x = torch.randn(5)
    assert torch.equal(twin(x), gm(x)) and twin.graph is not gm.graph
    next(n for n in twin.graph.nodes if n.target is torch.relu).target = torch.sigmoid
    twin.recompile()
    assert torch.equal(gm(x), torch.relu(x) + 1) and torch.equal(twin(x), torch.sigmoid(x) + 1)
