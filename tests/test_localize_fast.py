"""localize's fast paths (passes/localize.py) against DTensor's own dispatch.

localize runs most ops directly on the local shards instead of through DTensor: ops whose
arguments hold no sizes, and views whose size argument is the output's shape (given the output's
local shape). ``AUTOPAR_LOCALIZE_FAST=0`` (``localize._FAST``) sends every op through DTensor. The
per-rank programs of both ways must be the same program, as tests/test_splice.py's ``_local_canon``
reads one: the same ops in the same order on the same operands, each value with the same shape,
strides, dtype and storage offset and sharing its storage with the same earlier value (liveness
reads that), the same origins, CommRecords and module paths (node names may differ: DTensor's
dispatch makes nodes the trace then drops). Cases chosen for their views: Megatron's head split and
merge (Shard / Partial), sequence parallelism's (a strided shard: batch x sequence flattened with
the sequence sharded), ring and Ulysses context parallelism, expert parallelism.
"""

from __future__ import annotations

import pytest

from autopar.compiler import build
from autopar.options import CompileOptions
from autopar.passes import localize
from autopar.testing import build_model

from test_splice import _local_canon  # (the canonical per-rank program test_record compares too)

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
    return _local_canon(stage.program.local)


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
