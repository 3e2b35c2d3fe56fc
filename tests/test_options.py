"""Typed state (issue 37 item 3): compile's options spelled once (autopar/options.py), a Context that
takes no attribute it did not declare, one shape of collective record per graph kind, and dropout's
draw owned by the runtime."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import autopar
from autopar.options import CompileOptions


def test_compile_shows_every_option_with_its_default():
    sig = inspect.signature(autopar.compile)
    params = list(sig.parameters.values())
    assert [p.name for p in params[:2]] == ["model", "mesh"]
    options = {f.name: f.default for f in dataclasses.fields(CompileOptions)}
    assert {p.name: p.default for p in params[2:]} == options
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:])


def test_a_misspelt_option_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_mib'"):
        autopar.compile(torch.nn.Linear(2, 2), None, bucket_mib=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CompileOptions().plan = {}  # frozen: dataclasses.replace makes a changed copy


def test_compile_records(fake):
    """A compile on a fake mesh: the Context refuses an undeclared attribute, the global graph's
    redistribute nodes carry predicted tuples, the per-rank collectives one record each."""
    from autopar.compiler import build
    from autopar.ir import CommRecord, info, redistribute
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy

    x = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    with fake(dp=2, tp=2) as mesh:
        state = build(Llama(LlamaConfig(n_layers=1)), mesh,
                      CompileOptions(example_inputs=(x, x), loss_fn=cross_entropy, plan={"dp": "fsdp", "tp": "megatron"}))
    st = state.stages[0]
    with pytest.raises(AttributeError):
        st.ctx.not_a_field = 1
    redistributes = [n for n in st.program.graph.nodes if n.target is redistribute]
    assert redistributes and all(isinstance(info(n).predicted, tuple) and info(n).comm is None for n in redistributes)
    assert any(info(n).predicted for n in redistributes)
    local = [info(n) for n in st.program.local.graph.nodes if "autopar" in n.meta]
    comms = [r.comm for r in local if r.comm is not None]
    assert comms and all(isinstance(c, CommRecord) for c in comms) and not any(r.predicted for r in local)


def test_dropout_reads_the_current_draw():
    from autopar import dropout

    x = torch.ones(64)
    one, two = dropout.Draw(seed=1, step=3), dropout.Draw(seed=2, step=3)
    with dropout.drawing(one):
        a = torch.ops.autopar.dropout_mask(x, 0.5, [0], [1], 7)
    with dropout.drawing(two):
        b = torch.ops.autopar.dropout_mask(x, 0.5, [0], [1], 7)
    with dropout.drawing(one):
        one.micro = 1  # (the executor sets the micro-batch on the runtime's draw before each action)
        c = torch.ops.autopar.dropout_mask(x, 0.5, [0], [1], 7)
    assert torch.equal(a, dropout.keep_mask((64,), [0], [1], 0.5, dropout.call_key(1, 3, 0, 7), x.device))
    assert not torch.equal(a, b) and not torch.equal(a, c)
