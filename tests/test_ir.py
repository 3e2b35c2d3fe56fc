"""Front end and IR: the joint graph knows its parameters; the pass list (its checks: test_verifier.py)."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import capture_joint
from autopar.ir import source_line
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
        assert prog.local is None  # (localize sets it)
        # overlap off: every wait right after its collective; on: gradient waits deferred
        sync = compile_(skip_passes=("overlap",)).stages[0].program.local
        assert all(collectives_then_waits(sync))
        deferred = compile_(bucket_mb=0).stages[0].program.local  # (one bucket would be issued last)
        assert not all(collectives_then_waits(deferred))
        with pytest.raises(PlanError, match="cannot be switched off"):
            compile_(skip_passes=("localize",))
        with pytest.raises(PlanError, match="unknown pass"):
            compile_(skip_passes=("overlapp",))
