"""Bad input is a clear autopar error naming the problem, where it came from and what to do."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

import autopar
from autopar.models.llama import Llama, LlamaConfig, cross_entropy


def _compile(mesh, plan, **cfg):
    torch.manual_seed(0)
    c = LlamaConfig(n_layers=1, **cfg)
    tokens = torch.randint(0, c.vocab_size, (4, 16))
    return autopar.compile(Llama(c), mesh, example_inputs=(tokens, tokens), loss_fn=cross_entropy, plan=plan)


def test_heads_not_divisible_by_tp(fake):
    """The derivation (autopar/analysis/tensor_parallel.py) finds the K/V heads view that tp=4 cannot
    split: a PlanError naming the parameters, the view's line and what to do."""
    with fake(tp=4) as mesh, pytest.raises(autopar.PlanError) as e:
        _compile(mesh, {"tp": "megatron"}, n_kv_heads=2)
    msg = str(e.value)
    assert "heads" in msg and "'tp'" in msg
    import inspect

    from autopar.models import llama

    line = next(i for i, t in enumerate(inspect.getsource(llama).splitlines(), 1) if "k = self.k_proj(x)" in t)
    assert f"models/llama.py:{line}" in msg and "k_proj" in msg  # the user's line
    assert "what to do" in msg


def test_parameter_not_divisible(fake):
    with fake(tp=4) as mesh, pytest.raises(autopar.PlanError) as e:
        _compile(mesh, {"tp": "megatron"}, vocab_size=250)
    # (the token table is split by its columns instead since 2026-11-28; the LM head, vocabulary-parallel, cannot be)
    assert "lm_head.weight" in str(e.value) and "250" in str(e.value)


@pytest.mark.parametrize("plan,needle", [
    ({"tp": "zero9"}, "unknown strategy 'zero9'"),
    ({"tp": "megatron", "pp": "1f1b"}, "'pp', which the mesh does not have"),
    ({}, "has no strategy"),
    ({"tp": "megatron", "rules": {"*lm_head.weight": {"xx": "R"}}}, "unknown mesh axis 'xx'"),
    ({"tp": "megatron", "rules": {"*lm_head.weight": {"tp": "Q(1)"}}}, "cannot read placement"),
])
def test_bad_plans(fake, plan, needle):
    with fake(tp=2) as mesh, pytest.raises(autopar.PlanError) as e:
        _compile(mesh, plan)
    assert needle in str(e.value)


@torch.library.custom_op("autopar_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


mystery.register_autograd(lambda ctx, g: g * 2)


class UsesMystery(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = torch.nn.Linear(8, 16, bias=False)
        self.down_proj = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down_proj(mystery(self.up_proj(x))).sum()


def test_op_without_rule(fake):
    """Rules that shard a value into an op nobody wrote a rule for: autopar derives the op's rule
    by running it whole and in chunks (autopar/derived_rules.py; tests/test_derived_rules.py checks
    the numbers against one process) and says so, naming the op. The megatron preset follows the
    split through it the same way (autopar/analysis/tp_measured.py) and says so."""
    rules = [("up_proj.weight", "S(0)"), ("down_proj.weight", "S(1)")]
    with fake(tp=2) as mesh:
        pm = autopar.compile(UsesMystery(), mesh, example_inputs=(torch.randn(4, 8),), plan={"tp": rules})
        assert any(line.startswith("autopar_test.mystery.default: on tp: inputs S(1) -> outputs S(1) (checked by")
                   for line in pm.ctx.derived_rules), pm.ctx.derived_rules
        assert "no rule, derived: autopar_test.mystery.default" in pm.report()
    with fake(tp=2) as mesh:
        pm = autopar.compile(UsesMystery(), mesh, example_inputs=(torch.randn(4, 8),), plan={"tp": "megatron"})
        why = pm.ctx.plan.derived["tp"].decisions["up_proj.weight"].why
        assert [tuple(p.placements) for p in (pm.module.up_proj.weight, pm.module.down_proj.weight)] == \
            [(Shard(0),), (Shard(1),)]
    assert "mystery keeps the split (found by running it) at tests/test_errors.py:" in why, why


def test_batch_shape_mismatch(fake):
    with fake(dp=2) as mesh:
        pm = _compile(mesh, {"dp": "ddp"})
        with pytest.raises(autopar.InputError, match=r"compiled for global shape \[4, 16\]"):
            pm.train_step(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))
        with pytest.raises(autopar.InputError, match="inputs='local'"):
            pm.train_step(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
        with pytest.raises(autopar.InputError, match="expected 2 inputs"):
            pm.train_step(torch.zeros(4, 16, dtype=torch.long))


def test_batch_not_divisible_by_data_parallel_ranks(fake):
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy

    x = torch.zeros(6, 16, dtype=torch.long)
    with fake(dp=4) as mesh, pytest.raises(autopar.PlanError, match=r"batch size 6.*\(dp, 4 ranks\) cannot split") as e:
        autopar.compile(Llama(LlamaConfig()), mesh, example_inputs=(x, x), loss_fn=cross_entropy, plan={"dp": "ddp"})
    assert "multiple of 4" in str(e.value) and "example_inputs[0]" in str(e.value)


def test_a_loss_that_raises_while_traced_keeps_its_own_message(fake):
    """dynamo reports a user exception only as "Observed exception"; the error says what the
    user's code raised and on which of its lines."""
    def loss(out, y):
        if out.shape[-1] != 7:
            raise ValueError(f"expected 7 classes, got {out.shape[-1]}")
        return cross_entropy(out, y)

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 16))
    with fake(dp=2) as mesh, pytest.raises(autopar.CaptureError) as e:
        autopar.compile(Llama(LlamaConfig(n_layers=1)), mesh, example_inputs=(tokens, tokens), loss_fn=loss,
                        plan={"dp": "ddp"})
    msg = str(e.value)
    assert "ValueError: expected 7 classes, got 256" in msg and "Observed exception" not in msg
    assert "test_errors.py" in msg and "raise ValueError" in msg
