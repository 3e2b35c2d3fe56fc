"""The eval program (``pm(x)``) is captured on its first call, not at compile (autopar/capture.py
``forward_later``): a run that only trains never exports its forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar import capture
from autopar.testing import build_model


def _compiled(name: str, monkeypatch, **options):
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")  # (each compile exports for itself)
    model, batches, loss_fn = build_model(name)
    eager, _, _ = build_model(name)
    pm = autopar.compile(model, autopar.mesh(dp=1), example_inputs=batches[0], loss_fn=loss_fn,
                         plan={"dp": "fsdp"}, **options)
    return pm, eager, batches[0][0]


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", ["hf_llama", "gpt"])
def test_the_eval_program_is_exported_at_its_first_call_and_equals_the_compile_times(name, monkeypatch):
    exports = []
    real = capture._capture_forward
    monkeypatch.setattr(capture, "_capture_forward", lambda *a: exports.append(1) or real(*a))
    pm, eager, x = _compiled(name, monkeypatch)
    assert exports == [] and "capture_forward" not in pm.ctx.timings  # compile exported nothing
    pm.train_step(*build_model(name)[1][0])  # (training does not need it either)
    assert exports == []
    out = _logits(pm(x))
    assert exports == [1] and pm.ctx.timings["capture_forward"] > 0
    pm(x)
    assert exports == [1]  # once
    with torch.no_grad():
        eager.load_state_dict({k: v.detach() for k, v in pm.module.state_dict().items()})
        assert torch.allclose(out, _logits(eager(x)), atol=1e-5, rtol=1e-5)
    at_compile, _, _ = _compiled(name, monkeypatch, capture_eval="compile")
    assert exports == [1, 1]  # the old way: at compile
    at_compile(x)
    # the same per-rank program either way
    assert str(pm._forward_program.local.graph) == str(at_compile._forward_program.local.graph)


class _MakesAConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) * torch.tensor([2.0, 3.0] * 4)  # a tensor made from data: export's constant


def _mse(out, y):
    return ((out - y) ** 2).mean()


def test_a_tensor_made_from_data_keeps_its_value_and_a_stand_in_is_refused(monkeypatch):
    """export records a tensor the forward makes from data as it is made (a real constant) even
    on the fake stand-ins; a constant that were a stand-in would have lost its value: refused."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    model, eager = _MakesAConstant(), _MakesAConstant()
    eager.load_state_dict(model.state_dict())
    pm = autopar.compile(model, autopar.mesh(dp=1), example_inputs=(x, y), loss_fn=_mse, plan={"dp": "ddp"})
    assert torch.equal(pm(x), eager(x))
    assert [type(t) for t in pm._forward_program.buffers.values()] == [torch.Tensor]

    real = capture._capture_forward

    def with_a_stand_in(model, wrapper, inputs):
        program = real(model, wrapper, inputs)
        program.buffers["made"] = torch.empty_like(inputs[0])  # (a fake tensor, as the inputs are)
        return program

    monkeypatch.setattr(capture, "_capture_forward", with_a_stand_in)
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")  # (not the first compile's cached program)
    pm = autopar.compile(_MakesAConstant(), autopar.mesh(dp=1), example_inputs=(x, y), loss_fn=_mse,
                         plan={"dp": "ddp"})
    with pytest.raises(autopar.CaptureError) as e:
        pm(x)
    msg = str(e.value)
    assert "['made']" in msg and "_MakesAConstant" in msg and 'capture_eval="compile"' in msg


def test_an_unknown_capture_eval_is_refused():
    model, batches, loss_fn = build_model("gpt")
    with pytest.raises(autopar.PlanError) as e:
        autopar.compile(model, autopar.mesh(dp=1), example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                        capture_eval="later")
    assert "capture_eval" in str(e.value) and "what to do" in str(e.value)
