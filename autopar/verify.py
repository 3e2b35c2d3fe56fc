"""``autopar.verify``: the numerics check behind the parity tests, as a user-facing call.

Every rank runs the same steps twice — eagerly on one process (a deep copy of the model, no
communication) and as the compiled program on the mesh — with the same init and batches and
an unchanged AdamW, then compares losses, full gradients and full parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from autopar.runtime.common import full_tensor


@dataclass
class VerifyReport:
    losses_eager: list[float]
    losses_autopar: list[float]
    max_loss_diff: float
    max_grad_diff: list[float]  # per step, over every parameter
    max_param_diff: float  # after the last optimizer step
    worst_grad: str
    tolerances: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        t = self.tolerances
        return (self.max_loss_diff <= t["loss"] and max(self.max_grad_diff) <= t["grad"]
                and self.max_param_diff <= t["param"])

    def __str__(self) -> str:
        return (f"autopar.verify: {'OK' if self.ok else 'MISMATCH'} over {len(self.losses_eager)} steps\n"
                f"  max |loss diff| {self.max_loss_diff:.2e} (tol {self.tolerances['loss']:.0e})\n"
                f"  max |grad diff| per step {['%.1e' % g for g in self.max_grad_diff]} "
                f"(tol {self.tolerances['grad']:.0e}; worst: {self.worst_grad})\n"
                f"  max |param diff| after the last step {self.max_param_diff:.2e} "
                f"(tol {self.tolerances['param']:.0e})")


def verify(model, mesh, *, example_inputs, loss_fn=None, plan=None, batches=None, steps: int = 3,
           lr: float = 1e-3, tolerances: dict | None = None, **compile_kwargs) -> VerifyReport:
    """Compile ``model`` and check it against eager PyTorch on one process.

    ``batches``: a list of GLOBAL input tuples (default: ``example_inputs`` every step). The
    model is deep-copied for the eager run before it is compiled; call this on every rank.
    Default tolerances: fp32 loss 1e-5, gradients 1e-4, parameters 10% of one lr step; bf16/fp16
    (the eager side computes in the same dtype from fp32 master weights) loss 1e-2, gradients
    5e-2, parameters 5 lr steps. ``compile_kwargs`` (precision, accumulate, recompute...) go to
    ``autopar.compile``; under fp16 a step the compiled program skips on overflow is skipped on
    the eager side too.
    """
    from autopar.compiler import compile as autopar_compile
    from autopar.capture import _WithLoss

    precision = compile_kwargs.get("precision", "fp32")
    mixed = precision not in ("fp32", "float32", torch.float32)
    tol = ({"loss": 1e-2, "grad": 5e-2, "param": 5 * lr} if mixed else {"loss": 1e-5, "grad": 1e-4, "param": 0.1 * lr})
    tol.update(tolerances or {})
    batches = list(batches) if batches is not None else [tuple(example_inputs)] * steps
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=lr)
    pm = autopar_compile(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, plan=plan,
                         **compile_kwargs)
    # the eager side computes in the same dtype from fp32 master weights, as the front end does
    eager_step = _WithLoss(eager, loss_fn, pm.ctx.compute_dtype)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    ref_losses, losses, grad_diffs, worst = [], [], [], ("", 0.0)
    for b in batches:
        scale = pm.loss_scale or 1.0  # fp16: the scale this step runs with
        skipped = pm.skipped_steps
        losses.append(pm.train_step(*b).item())
        loss = eager_step(*b)
        (loss * scale).backward()
        ref_losses.append(loss.item())
        if pm.skipped_steps > skipped:  # fp16 overflow: both sides skip the step
            eager_opt.zero_grad()
            grad_diffs.append(0.0)
            continue
        step_max = 0.0
        for n, p in pm.named_parameters():
            ref = eager.get_parameter(n).grad / scale
            d = (full_tensor(p.grad).detach() - ref).abs().max().item()
            step_max = max(step_max, d)
            if d > worst[1]:
                worst = (n, d)
        grad_diffs.append(step_max)
        for p in eager.parameters():
            p.grad.div_(scale)
        opt.step()
        opt.zero_grad()
        eager_opt.step()
        eager_opt.zero_grad()
    eager_params = dict(eager.named_parameters())
    param_diff = max((full_tensor(p.detach()) - eager_params[n].detach()).abs().max().item()
                     for n, p in pm.named_parameters())
    return VerifyReport(ref_losses, losses, max(abs(a - b) for a, b in zip(ref_losses, losses)), grad_diffs,
                        param_diff, worst[0], tol)
