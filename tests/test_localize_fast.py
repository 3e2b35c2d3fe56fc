"""localize's fast paths (passes/localize.py) against DTensor's own dispatch.

localize runs most ops directly on the local shards instead of through DTensor: ops whose
arguments hold no sizes, and views whose size argument is the output's shape (given the output's
local shape). ``AUTOPAR_LOCALIZE_FAST=0`` (``localize._FAST``) sends every op through DTensor. The
per-rank programs of both ways must be the same program: the same ops in the same order on the
same operands, each value with the same shape, strides and dtype (node names may differ: DTensor's
dispatch makes nodes the trace then drops). Cases chosen for their views: Megatron's head split and
merge (Shard / Partial), sequence parallelism's (a strided shard: batch x sequence flattened with
the sequence sharded), ring and Ulysses context parallelism, expert parallelism.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from autopar.compiler import build
from autopar.options import CompileOptions
from autopar.passes import localize
from autopar.testing import build_model

CASES = [
    ("hf_llama", {"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "megatron"}, 3),
    ("llama", {"dp": 2, "tp": 2}, {"dp": "zero2", "tp": "sequence"}, 1),
    ("llama", {"dp": 2, "cp": 2}, {"dp": "fsdp", "cp": "context"}, 3),
    ("llama", {"cp": 2}, {"cp": "ulysses"}, 0),
    ("moe_dropless", {"dp": 2, "ep": 2}, {"dp": "fsdp", "ep": "expert"}, 3),
]


def program(name, axes, plan, rank, fake, fast: bool, monkeypatch) -> list:
    monkeypatch.setattr(localize, "_FAST", fast)
    model, batches, loss_fn = build_model(name)
    with fake(rank, **axes) as mesh:
        state = build(model, mesh, CompileOptions(plan=plan, example_inputs=batches[0], loss_fn=loss_fn,
                                                  capture_eval=False), stop_after="localize")
    (stage,) = state.stages
    gm = stage.program.local
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def arg(a):
        return ("node", index[a]) if isinstance(a, fx.Node) else \
            type(a)(arg(x) for x in a) if isinstance(a, (list, tuple)) else a

    def meta(v):
        return (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else \
            [meta(x) for x in v] if isinstance(v, (list, tuple)) else None

    return [(n.op, str(n.target), arg(n.args), arg(tuple(n.kwargs.items())), meta(n.meta.get("val")))
            for n in gm.graph.nodes]


@pytest.mark.parametrize("name,axes,plan,rank", CASES, ids=[f"{c[0]}-{'x'.join(c[2].values())}" for c in CASES])
def test_fast_paths_give_dtensors_program(name, axes, plan, rank, fake, monkeypatch):
    fast = program(name, axes, plan, rank, fake, True, monkeypatch)
    slow = program(name, axes, plan, rank, fake, False, monkeypatch)
    assert len(fast) == len(slow)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert a == b, f"node {i}: fast {a} != DTensor's {b}"


def test_the_comparison_sees_a_difference(fake, monkeypatch):
    """The check above can fail: a fast view that copies its input first (which DTensor's path
    does only where the view fails) makes another program, and the comparison says so."""
    real = localize._shaped

    def contiguous_first(n, args, kwargs, ctx):
        return real(n, (args[0].contiguous(), *args[1:]), kwargs, ctx)

    monkeypatch.setattr(localize, "_shaped", contiguous_first)
    case = ("hf_llama", {"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "megatron"}, 3)
    assert program(*case, fake, True, monkeypatch) != program(*case, fake, False, monkeypatch)
