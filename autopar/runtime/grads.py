"""Global gradient clipping over every shard of every plan and pipeline stage:
``pm.clip_grad_norm_(max_norm, norm_type=2.0)``, torch.nn.utils.clip_grad_norm_ for a program
whose gradients are spread over ranks.

After ``train_step`` each parameter's ``.grad`` is a DTensor in the parameter's storage placements:
per mesh axis ``Shard`` (or ``_StridedShard``: the ranks along it hold different parts) or
``Replicate`` (they hold the same values); ``Partial`` (not yet reduced) never reaches ``.grad``
and is refused. A program whose parameters are all replicated (``ddp``) has plain parameters and
plain gradients (runtime/common.py ``plain_parameters``): each is held whole by every rank of the mesh. A pipeline rank holds only its stages' parameters (the others are meta tensors
with no gradient), on its stage's sub-mesh.

The norm of the whole gradient is computed with ONE all-reduce of three numbers over the world:

- ``p`` finite: each rank sums ``|g|^p`` over its local shards, each shard weighted by
  ``1 / (number of ranks holding the same values)``: the product of the mesh axis sizes on
  which the gradient is ``Replicate``. Summed over the world, every distinct element counts
  exactly once (a replicated norm weight under Megatron: once, not tp times; an FSDP shard: once;
  each pipeline stage's parameters: on the ranks of its stage only; a weight tied across pipeline
  stages: its k copies weighted 1/k more). The sum is kept in float64
  (the weights 1/k are not exact in float32), and the total norm is its ``1/p``-th power;
- ``p = inf`` / ``-inf``: the maximum (minimum) of ``|g|`` over the local shards, reduced with MAX
  (replicas do not matter for a maximum);
- with them: whether any rank found a gradient it cannot count (a ``Partial`` placement, a plain
  tensor on a DTensor parameter) and how many gradients there are (none anywhere: the norm is 0, as in torch).

Then every gradient is multiplied in place by ``clamp(max_norm / (total + 1e-6), max=1)``, exactly
as torch does (also when nothing is clipped: no host synchronisation on the device's value).
fp16 loss scaling: ``train_step`` has already unscaled the gradients in ``.grad``, so the norm is
the true one (a step that overflowed left ``.grad`` unchanged).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from autopar import torch_compat as tc
from autopar.errors import PlanError, TrainingError
from autopar.runtime.common import local_tensor


def _world_group(pm):
    """The process group spanning the program's whole mesh (every pipeline stage, every shard)."""
    mesh = pm.mesh
    if mesh.size() == dist.get_world_size():
        return None  # the default group
    group = getattr(pm, "_norm_group", None)
    if group is None:
        group = pm._norm_group = tc.whole_mesh_group(mesh) if mesh.ndim > 1 else mesh.get_group()
    return group


def _replicas(g: DTensor) -> int:
    """How many ranks of the gradient's mesh hold the same values as this one."""
    n = 1
    for i, pl in enumerate(g.placements):
        if isinstance(pl, Replicate):
            n *= g.device_mesh.size(i)
    return n


def _norms(tensors: list[torch.Tensor], p: float, foreach: bool | None) -> list[torch.Tensor]:
    """Per-tensor p-norms, with torch's foreach rules (clip_grad_norm_'s ``foreach``)."""
    if not tensors:
        return []
    if tc.foreach_ok(tensors, tensors[0].device, foreach):
        return list(tc.foreach_norm(tensors, p))
    return [torch.linalg.vector_norm(t, p) for t in tensors]


def _scale_(tensors: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), ts in groups.items():
        c = coef.to(device)
        if tc.foreach_ok(ts, device, foreach):
            tc.foreach_mul_(ts, c)
        else:
            for t in ts:
                t.mul_(c)


@torch.no_grad()
def clip_grad_norm_(pm, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """See the module docstring. Returns the total norm (a plain 0-dim tensor on the program's
    device, the same on every rank). Call on every rank."""
    where = f"{type(pm).__name__}.clip_grad_norm_"
    p = float(norm_type)
    if p == 0 or math.isnan(p):
        raise PlanError(f"norm_type {norm_type!r} is not a norm autopar clips by", where=where,
                        fix="use 2.0 (the usual), any p > 0, or float('inf') / float('-inf')")
    if pm.steps == 0:
        raise TrainingError("clip_grad_norm_ was called before any train_step: there are no gradients to clip",
                            where=where, fix="call pm.train_step(...) first, then clip, then optimizer.step()")
    device = pm.ctx.device
    acc_dtype = torch.float32 if device.type == "mps" else torch.float64
    grads, bad = [], []
    weighted: dict[int, list[torch.Tensor]] = {}  # replicas -> local shards
    out_dtype = None
    for name, param in pm.named_parameters():
        g = param.grad
        if g is None:
            continue
        if not isinstance(param, DTensor):  # replicated on every axis: each rank of the mesh holds it whole
            if isinstance(g, DTensor):
                bad.append(f"{name}: .grad is a DTensor on a plain (replicated) parameter")
                continue
            replicas = pm.mesh.size()
            local = g
        elif not isinstance(g, DTensor):
            bad.append(f"{name}: .grad is a plain {type(g).__name__}, not a DTensor in the parameter's placements")
            continue
        else:
            partial = [i for i, pl in enumerate(g.placements) if isinstance(pl, Partial)]
            if partial:
                axes = [g.device_mesh.mesh_dim_names[i] if g.device_mesh.mesh_dim_names else str(i) for i in partial]
                bad.append(f"{name}: its gradient is Partial (not reduced) on mesh axis {', '.join(axes)}")
                continue
            replicas = _replicas(g)
            local = g.to_local()
        out_dtype = out_dtype or local.dtype
        grads.append(local)
        # a pipeline's tied weight (embedding / LM head) has a copy on each pp rank holding it,
        # with the same summed gradient: counted once too
        copies = len(getattr(pm, "tied", {}).get(name, ())) or 1
        weighted.setdefault(replicas * copies, []).append(local)
    infinite = math.isinf(p)
    if infinite:  # max |g| (min |g| for -inf, as -max(-|g|)), reduced with MAX
        sign = 1.0 if p > 0 else -1.0
        value = torch.full((), -math.inf, dtype=acc_dtype, device=device)
        for ts in weighted.values():
            for n in _norms(ts, p, foreach):
                value = torch.maximum(value, sign * n.to(acc_dtype))
    else:
        value = torch.zeros((), dtype=acc_dtype, device=device)
        for k, ts in weighted.items():
            norms = _norms(ts, p, foreach)
            if norms:
                value = value + torch.stack([n.to(acc_dtype) for n in norms]).pow(p).sum() / k
    vec = torch.stack([value, torch.tensor(float(bool(bad)), dtype=acc_dtype, device=device),
                       torch.tensor(float(len(grads)), dtype=acc_dtype, device=device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        from autopar.runtime import failure

        # bounded by pm.timeout and woken by a peer's failure record, as a step's waits are
        # (autopar/runtime/failure.py): a peer that died between steps is named, not waited for
        failure.wait(dist.all_reduce(vec, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM,
                                     group=_world_group(pm), async_op=True),
                     "clip_grad_norm_'s all_reduce of the norm", getattr(pm, "timeout", None),
                     guard=getattr(pm, "guard", True))
    value, any_bad, count = vec[0], vec[1].item() > 0, vec[2].item()
    if any_bad:
        raise TrainingError("some gradients cannot be counted in the global norm:"
                            + "".join(f"\n  - {b}" for b in _everyone(bad, pm)), where=where,
                            fix="clip the gradients train_step wrote (in the parameters' placements); "
                                "do not replace .grad by hand")
    out_dtype = out_dtype or torch.float32
    if count == 0:
        return torch.zeros((), dtype=out_dtype, device=device)
    total = (sign * value if infinite else value.pow(1.0 / p)).to(out_dtype)
    if error_if_nonfinite and not torch.isfinite(total).item():
        names = [n for n, q in pm.named_parameters() if q.grad is not None
                 and not torch.isfinite(local_tensor(q.grad)).all()]
        holders = _everyone([f"{n} (rank {dist.get_rank() if dist.is_initialized() else 0})" for n in names], pm)
        raise TrainingError(f"the total norm of order {p:g} of the gradients is {total.item()}: non-finite gradients "
                            f"in {', '.join(holders[:6]) or '?'}" + (f" ... ({len(holders) - 6} more)"
                                                                      if len(holders) > 6 else ""),
                            where=where, fix="lower the learning rate or use a loss scale (fp16), look for the "
                                             "step's bad batch; or pass error_if_nonfinite=False to scale anyway")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    _scale_(grads, coef, foreach)
    return total


def _everyone(items: list[str], pm) -> list[str]:
    """``items`` of every rank (an error's details, gathered so that every rank raises the same)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return items
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items, group=_world_group(pm))
    return list(dict.fromkeys(x for xs in out for x in xs))
