"""Front end and IR: the joint graph knows its parameters; the invariant checker catches breakage."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.capture import capture_joint
from autopar.ir import NodeInfo, check_invariants, info, source_line, spec_of
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
    saved = info(victim).wants
    info(victim).wants = [tuple(torch.distributed.tensor.Replicate() for _ in p) for p in saved]
    with pytest.raises(AssertionError, match="wants"):
        check_invariants(graph, "collectives")
    info(victim).wants = saved
    # a value without a ShardSpec
    spec = info(victim).spec
    info(victim).spec = NodeInfo().spec  # never propagated
    with pytest.raises(AssertionError, match="no ShardSpec"):
        check_invariants(graph, "propagate")
    info(victim).spec = spec
    # a collective that nobody can explain
    local = pm.program.local.graph
    check_invariants(local, "localize")
    coll = next(n for n in local.nodes if info(n).comm is not None)
    info(coll).comm = None
    with pytest.raises(AssertionError, match="no CommRecord"):
        check_invariants(local, "localize")


def test_per_rank_checker_catches_broken_graphs(fake):
    """The debug checker reads the per-rank graph: a value left at its global shape, or a
    collective whose wait was dropped, is caught and named."""
    from autopar.ir import check_local

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=1))
    x = torch.randint(0, 256, (4, 8))
    with fake(dp=2, tp=2) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=(x, x), loss_fn=cross_entropy,
                             plan={"dp": "fsdp", "tp": "megatron"}, debug=True)
    local, sizes = pm.program.local, pm.ctx.axis_sizes
    check_local(local, pm.program, sizes, "localize")  # the real program passes
    # a matmul whose per-rank value has the global shape (what a view that kept its global
    # size would produce): the per-rank graph disagrees with the placements
    origins = {n.name: n for n in pm.program.graph.nodes}
    def origin_spec(n):
        return spec_of(origins[n.meta["custom"]["autopar_origin"]])

    mm = next(n for n in local.graph.nodes if n.target == torch.ops.aten.mm.default
              and origin_spec(n).local_shape(sizes) != origin_spec(n).shape)
    spec = origin_spec(mm)
    saved = mm.meta["val"]
    mm.meta["val"] = saved.new_empty(spec.shape)
    with pytest.raises(AssertionError, match="GLOBAL shape"):
        check_local(local, pm.program, sizes, "overlap")
    mm.meta["val"] = saved
    # a collective whose wait_tensor is gone
    coll = next(n for n in local.graph.nodes if info(n).comm is not None)
    wait = next(u for u in coll.users if "wait_tensor" in str(u.target))
    wait.replace_all_uses_with(coll)
    local.graph.erase_node(wait)
    with pytest.raises(AssertionError, match="has no wait_tensor"):
        check_local(local, pm.program, sizes, "overlap")


def test_pass_list_is_one_ordered_list():
    from autopar.passes import PASSES

    assert [p.name for p in PASSES] == ["capture", "masks", "lower", "split", "autograd", "propagate", "recompute",
                                        "state", "collectives", "localize", "overlap", "schedule"]
    assert all(p.doc for p in PASSES), [p.name for p in PASSES if not p.doc]
    assert {p.name for p in PASSES if not p.required} == {"masks", "lower", "recompute", "overlap"}


def test_passes_can_be_switched_off(fake):
    from autopar.compiler import build
    from autopar.errors import PlanError
    from autopar.ir import redistribute
    from autopar.passes.localize import COLLECTIVES

    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 8))

    def collectives_then_waits(gm):
        nodes = list(gm.graph.nodes)
        return [nodes[i + 1].target == torch.ops._c10d_functional.wait_tensor.default
                for i, n in enumerate(nodes) if n.target in COLLECTIVES]

    with fake(dp=2) as mesh:
        def compile_(**kw):
            return build(Llama(LlamaConfig(n_layers=1)), mesh, example_inputs=(x, x), loss_fn=cross_entropy,
                         plan={"dp": "ddp"}, debug=True, **kw)

        upto = compile_(stop_after="collectives")
        assert upto.done == ["capture", "masks", "lower", "split", "autograd", "propagate", "recompute", "state",
                             "collectives"]
        prog = upto.stages[0].program
        assert sum(n.target is redistribute for n in prog.graph.nodes) >= 9  # one gradient sync each
        assert not hasattr(prog, "local")
        # overlap off: every wait right after its collective; on: gradient waits deferred
        sync = compile_(skip_passes=("overlap",)).stages[0].program.local
        assert all(collectives_then_waits(sync))
        deferred = compile_(bucket_mb=0).stages[0].program.local  # (one bucket would be issued last)
        assert not all(collectives_then_waits(deferred))
        with pytest.raises(PlanError, match="cannot be switched off"):
            compile_(skip_passes=("localize",))
        with pytest.raises(PlanError, match="unknown pass"):
            compile_(skip_passes=("overlapp",))
