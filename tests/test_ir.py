"""Front end and IR: the joint graph knows its parameters; the invariant checker catches breakage."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.capture import capture_joint
from autopar.ir import check_invariants, source_line
from autopar.models.llama import Llama, LlamaConfig, cross_entropy


def test_joint_graph_names_parameters_and_lines():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=1))
    x = torch.randint(0, 256, (2, 8))
    prog = capture_joint(model, (x, x), cross_entropy)
    names = [w for k, w in prog.inputs if k == "param"]
    assert names == [n for n, _ in model.named_parameters()]
    assert sorted(w for k, w in prog.outputs if k == "grad") == sorted(names)
    assert [k for k, _ in prog.inputs].count("tangent") == 1
    mms = [n for n in prog.graph.nodes if n.target == torch.ops.aten.mm.default]
    assert mms and all(source_line(n).startswith("models/llama.py:") for n in mms)
    tags = {n.meta.get("partitioner_tag") for n in mms}
    assert tags == {"is_forward", "is_backward"}


def test_invariant_checker_catches_broken_ir(fake):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=1))
    x = torch.randint(0, 256, (4, 8))
    with fake(tp=2) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=(x, x), loss_fn=cross_entropy,
                             plan={"tp": "megatron"}, debug=True)
    graph = pm.program.graph
    check_invariants(graph, "collectives")
    # a consumer whose input placements were changed behind the collectives pass's back
    victim = next(n for n in graph.nodes if n.target == torch.ops.aten.mm.default)
    saved = victim.meta["autopar_in"]
    victim.meta["autopar_in"] = [tuple(torch.distributed.tensor.Replicate() for _ in p) for p in saved]
    with pytest.raises(AssertionError, match="wants"):
        check_invariants(graph, "collectives")
    victim.meta["autopar_in"] = saved
    # a value without a ShardSpec
    spec = victim.meta.pop("autopar")
    with pytest.raises(AssertionError, match="no ShardSpec"):
        check_invariants(graph, "propagate")
    victim.meta["autopar"] = spec
    # a collective that nobody can explain
    local = pm.program.local.graph
    check_invariants(local, "localize")
    coll = next(n for n in local.nodes if "autopar_comm" in n.meta)
    coll.meta.pop("autopar_comm")
    with pytest.raises(AssertionError, match="no CommRecord"):
        check_invariants(local, "localize")


def test_passes_can_be_switched_off(fake):
    from autopar.compiler import Context
    from autopar.ir import redistribute
    from autopar.passes import PASSES, run_passes
    from autopar.plan import parse_plan, place_parameters

    assert [name for name, _ in PASSES] == ["propagate", "recompute", "state", "collectives", "localize"]
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=1))
    x = torch.randint(0, 256, (4, 8))
    with fake(dp=2) as mesh:
        plan = parse_plan({"dp": "ddp"}, ("dp",))
        ctx = Context(mesh, plan, place_parameters(plan, dict(model.named_parameters()), (2,)))

        def markers(prog):
            return [n for n in prog.graph.nodes if n.target is redistribute]

        only_propagate = run_passes(capture_joint(model, (x, x), cross_entropy), ctx,
                                    skip=("recompute", "state", "collectives", "localize"), debug=True)
        assert not markers(only_propagate) and not hasattr(only_propagate, "local")
        assert set(ctx.timings) == {"propagate"}
        no_localize = run_passes(capture_joint(model, (x, x), cross_entropy), ctx, skip=("localize",), debug=True)
        assert len(markers(no_localize)) >= len(list(model.parameters()))  # one gradient sync each
        assert not hasattr(no_localize, "local")
