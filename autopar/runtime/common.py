"""What every runtime program shares, SPMD or pipelined: fp16 loss scaling and the batch slicing
that turns the user's (global or local) batch into this rank's inputs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Shard

from autopar.errors import InputError


class LossScaler:
    """fp16 dynamic loss scaling with torch.amp.GradScaler's constants: start at 2^16, halve on
    an overflow anywhere in the world (the step is skipped), double after 2000 clean steps.
    ``option``: None (no scaling), "dynamic", or a fixed scale (never grows; halves on overflow)."""

    GROWTH_INTERVAL = 2000

    def __init__(self, option):
        self.dynamic = option == "dynamic"
        self.scale: float | None = (65536.0 if self.dynamic else float(option)) if option else None
        self.growth_tracker = 0
        self.skipped_steps = 0

    def unscale(self, grads, device) -> bool:
        """Divide ``grads`` by the scale in place; False (skip the step, back off) if any rank's
        gradients hold inf/NaN. One 4-byte all-reduce over the world decides for every rank."""
        scale = self.scale
        found = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            if g is not None:
                g.div_(scale)
                found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if found.item() > 0:
            self.scale = max(scale * 0.5, 1.0)
            self.growth_tracker = 0
            self.skipped_steps += 1
            return False
        self.growth_tracker += 1
        if self.dynamic and self.growth_tracker >= self.GROWTH_INTERVAL:
            self.scale, self.growth_tracker = scale * 2.0, 0
        return True


def local_inputs(inputs, n_expected: int, example_shapes, input_mode: str, ctx, where: str) -> list[torch.Tensor]:
    """This rank's slice of each input (``input_mode="global"``: every rank passes the whole
    batch), checked against the compiled shapes with a hint when global and local are confused.
    ``n_expected``: how many of the compiled inputs this call takes (eval: all but the target)."""
    if len(inputs) != n_expected:
        raise InputError(f"expected {n_expected} inputs (as compiled), got {len(inputs)}", where=where)
    out = []
    for i, (x, (shape, dtype)) in enumerate(zip(inputs, example_shapes)):
        if not isinstance(x, torch.Tensor):
            raise InputError(f"input #{i} must be a tensor, got {type(x).__name__}")
        pl = ctx.input_placements(shape)
        local_shape = list(shape)
        for p, n in zip(pl, ctx.axis_sizes):
            if isinstance(p, Shard):
                local_shape[p.dim] //= n
        want = tuple(local_shape) if input_mode == "local" else shape
        if tuple(x.shape) != want or x.dtype != dtype:
            hint = ""
            if input_mode == "global" and tuple(x.shape) == tuple(local_shape):
                hint = " (this looks like a per-rank batch: compile with inputs='local' if your loader shards)"
            elif input_mode == "local" and tuple(x.shape) == shape:
                hint = " (this looks like the global batch: compile with inputs='global')"
            raise InputError(
                f"input #{i} has shape {list(x.shape)} {x.dtype}, but the program was compiled for "
                f"{input_mode} shape {list(want)} {dtype}{hint}",
                where=f"input #{i}", fix="pass batches of the compiled shape, or compile again for this one")
        x = x.to(ctx.device)
        if input_mode == "global":
            for a, p in enumerate(pl):
                if isinstance(p, Shard):
                    x = torch.chunk(x, ctx.axis_sizes[a], dim=p.dim)[ctx.coord[a]]
        out.append(x.contiguous())
    return out


def bytes_lines(predicted: dict[str, float], counter) -> list[str]:
    """The report's bytes: the compiler's prediction, and what the meter counted (if it ran)."""
    lines = ["predicted bytes sent per rank per step (ring): " + ", ".join(
        f"{k}={v:,.0f}" for k, v in sorted(predicted.items()))]
    if counter.table:
        lines.append("measured (handed to the process group while measure() was on): " + ", ".join(
            f"{k}={v['wire_bytes']:,.0f}" for k, v in counter.summary().items()))
    return lines
