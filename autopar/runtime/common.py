"""What every runtime program shares, SPMD or pipelined: fp16 loss scaling, the batch slicing
that turns the user's (global or local) batch into this rank's inputs, and the two views of a
parameter or gradient that is a DTensor (sharded somewhere) or a plain tensor (replicated on
every mesh axis: see ``plain_parameters``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from autopar.errors import InputError
from autopar.layout import ring_axes, zigzag_take


# ------------------------------------------------------------------------ parameters
def plain_parameters(placements: dict) -> bool:
    """Whether a program's parameters are stored as plain ``nn.Parameter``s: when every one of
    them is ``Replicate`` on every mesh axis (``ddp``; a plan that shards nothing). Each rank then
    holds the whole tensor, which is what a DTensor would hold too, without DTensor's dispatch on
    every op of the user's optimizer (torch's default AdamW on CPU: a for-loop of ~8 ops per
    parameter, each ~0.3 ms slower on a DTensor). All or nothing: torch's foreach optimizers and
    ``clip_grad_norm_`` group tensors by device and dtype, not by type, and a list mixing DTensors
    with plain tensors is an error in DTensor's dispatch."""
    return bool(placements) and all(all(isinstance(pl, Replicate) for pl in pls) for pls in placements.values())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole (global) value of a parameter or gradient, the same on every rank: a DTensor's
    ``full_tensor()`` (a collective where it is sharded), a plain (replicated) tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


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
            from autopar.runtime import failure

            failure.wait(dist.all_reduce(found, op=dist.ReduceOp.MAX, async_op=True),
                         "the fp16 overflow check (a 4-byte all_reduce over the world)")
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
            if tuple(x.shape) == want:  # (only the dtype differs)
                pass
            elif input_mode == "global" and tuple(x.shape) == tuple(local_shape):
                hint = " (this looks like a per-rank batch: compile with inputs='local' if your loader shards)"
            elif input_mode == "local" and tuple(x.shape) == shape:
                hint = " (this looks like the global batch: compile with inputs='global')"
            raise InputError(
                f"input #{i} has shape {list(x.shape)} {x.dtype}, but the program was compiled for "
                f"{input_mode} shape {list(want)} {dtype}{hint}",
                where=f"input #{i}", fix="pass batches of the compiled shape, or compile again for this one")
        x = x.to(ctx.device)
        if input_mode == "global":
            ring = ring_axes(ctx)
            for a, p in enumerate(pl):
                if isinstance(p, Shard) and a in ring:  # the ring's load-balanced layout (autopar/layout.py)
                    x = zigzag_take(x, p.dim, ctx.axis_sizes[a], ctx.coord[a])
                elif isinstance(p, Shard):
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


# ---------------------------------------------------------------- values (token ids)
_PASS_METHODS = {"view", "reshape", "flatten", "contiguous", "to", "long", "int", "clone", "unsqueeze", "squeeze",
                 "__getitem__", "expand", "permute", "transpose", "t", "narrow", "detach", "view_as", "reshape_as"}
_PASS_FUNCTIONS = {"getitem", "flatten", "reshape", "clone", "narrow", "squeeze", "unsqueeze", "transpose",
                   "permute", "detach"}


@dataclass(frozen=True)
class IndexCheck:
    """User input ``input`` holds indices into ``rows`` rows (an embedding's table, or a loss's
    classes), ``ignore``: a value allowed besides them (cross-entropy's ignore_index)."""

    input: int
    rows: int
    what: str  # "embedding embed_tokens (models/llama.py:170)"
    ignore: int | None = None


def index_checks(gm, model) -> list[IndexCheck]:
    """The user inputs that index an embedding (``F.embedding``) or are a loss's class targets
    (``F.cross_entropy`` / ``F.nll_loss``), through views, casts and slices, in the captured
    torch-level graph of model + loss (passes/capture.py): what ``check_indices`` checks per step.
    An id outside the table would otherwise fail on one rank in the middle of a step (an
    IndexError in its forward) or, under a vocab-parallel embedding, read zeros silently."""
    import torch.nn.functional as F

    from autopar.ir import source_line

    if gm is None:
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    out: list[IndexCheck] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, ph in enumerate(placeholders):
        seen, todo = set(), [ph]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for u in n.users:
                tgt = u.target
                name = tgt if u.op == "call_method" else getattr(tgt, "__name__", "")
                if (u.op == "call_method" and name in _PASS_METHODS) or (
                        u.op == "call_function" and name in _PASS_FUNCTIONS and u.args and u.args[0] is n):
                    todo.append(u)
                elif u.op == "call_function" and tgt in (F.embedding, torch.embedding):
                    ids, weight = (u.args[0], u.args[1]) if tgt is F.embedding else (u.args[1], u.args[0])
                    if ids is not n or getattr(weight, "op", None) != "get_attr":
                        continue
                    w = gm.get_parameter(weight.target) if weight.target in dict(gm.named_parameters()) \
                        else getattr(gm, weight.target, None)
                    if not isinstance(w, torch.Tensor) or w.ndim != 2:
                        continue
                    pname = names.get(id(w), weight.target).removesuffix(".weight")
                    src = source_line(u).split("  ")[0]
                    out.append(IndexCheck(i, int(w.shape[0]), f"embedding {pname}" + (f" ({src})" if src else "")))
                elif u.op == "call_function" and tgt in (F.cross_entropy, F.nll_loss) and len(u.args) > 1 \
                        and u.args[1] is n:
                    logits = u.args[0].meta.get("example_value") if hasattr(u.args[0], "meta") else None
                    if logits is None or logits.ndim == 0:
                        continue
                    classes = int(logits.shape[1] if logits.ndim > 1 else logits.shape[0])
                    ignore = u.kwargs.get("ignore_index", u.args[4] if len(u.args) > 4 else -100)
                    src = source_line(u).split("  ")[0]
                    out.append(IndexCheck(i, classes, f"the {tgt.__name__} targets ({classes} classes"
                                          + (f", {src})" if src else ")"), int(ignore)))
    return out


def check_indices(inputs, checks: list[IndexCheck], where: str) -> None:
    """Raise InputError if an input holds an index outside its table (before anything is sent)."""
    for c in checks:
        if c.input >= len(inputs):
            continue
        x = inputs[c.input]
        if not isinstance(x, torch.Tensor) or x.numel() == 0 or x.is_floating_point() or x.is_complex():
            continue
        lo, hi = torch.aminmax(x)
        lo, hi = int(lo), int(hi)
        if lo >= 0 and hi < c.rows:
            continue
        bad = (x < 0) | (x >= c.rows)
        if c.ignore is not None:
            bad &= x != c.ignore
        if not bool(bad.any()):
            continue
        pos = [int(v) for v in bad.nonzero()[0]]
        val = int(x[tuple(pos)])
        allowed = f"[0, {c.rows})" + (f" or {c.ignore}" if c.ignore is not None else "")
        raise InputError(f"input #{c.input} holds {val} at {pos}, outside {allowed}: it indexes {c.what}",
                         where=f"{where}, input #{c.input}",
                         fix="check the tokenizer / vocabulary size against the model's (an id outside the table "
                         "would fail in the middle of the step, or read zeros under a vocab-parallel embedding)")
