"""``autopar.verify``: the numerics check behind the parity tests, as a user-facing call.

Every rank runs the same steps twice — eagerly on one process (a deep copy of the model, no
communication) and as the compiled program on the mesh — with the same init and batches and
an unchanged AdamW, then compares losses, full gradients and full parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch


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
    Default tolerances are for fp32 (loss 1e-5, gradients 1e-4, parameters 10% of one lr step).
    """
    import autopar
    from autopar.frontend import _unwrap_output

    tol = {"loss": 1e-5, "grad": 1e-4, "param": 0.1 * lr}
    tol.update(tolerances or {})
    batches = list(batches) if batches is not None else [tuple(example_inputs)] * steps
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(eager.parameters(), lr=lr)
    ref_losses, ref_grads = [], []
    for b in batches:
        out = _unwrap_output(eager(*b[:-1]) if loss_fn is not None else eager(*b))
        loss = loss_fn(out, b[-1]) if loss_fn is not None else out
        loss.backward()
        ref_losses.append(loss.item())
        ref_grads.append({n: p.grad.detach().clone() for n, p in eager.named_parameters()})
        opt.step()
        opt.zero_grad()
    pm = autopar.compile(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, plan=plan,
                         **compile_kwargs)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    losses, grad_diffs, worst = [], [], ("", 0.0)
    for b, ref in zip(batches, ref_grads):
        losses.append(pm.train_step(*b).item())
        step_max = 0.0
        for n, p in pm.named_parameters():
            d = (p.grad.full_tensor().detach() - ref[n]).abs().max().item()
            step_max = max(step_max, d)
            if d > worst[1]:
                worst = (n, d)
        grad_diffs.append(step_max)
        opt.step()
        opt.zero_grad()
    eager_params = dict(eager.named_parameters())
    param_diff = max((p.detach().full_tensor() - eager_params[n].detach()).abs().max().item()
                     for n, p in pm.named_parameters())
    return VerifyReport(ref_losses, losses, max(abs(a - b) for a, b in zip(ref_losses, losses)), grad_diffs,
                        param_diff, worst[0], tol)
