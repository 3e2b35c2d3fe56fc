"""Activation layouts: how a strategy wants the activations BETWEEN its parallel regions laid out.

Each tensor-parallel strategy places parameters (autopar/plan.py); the propagation then gives
every activation the placements its ops produce. Where a value must be resolved (a Partial sum
that an op cannot take as is), Megatron resolves it to Replicate: an all-reduce, after which
norms, residual adds and dropout run on the whole activation on every tensor-parallel rank.

The ``sequence`` strategy (Megatron-LM's ``--sequence-parallel``, Korthikanti et al. 2022)
places parameters as ``megatron`` but resolves such a Partial to Shard(sequence dim) instead:
a reduce-scatter, after which the ops between the tensor-parallel regions (elementwise, norms:
row-wise over the last dim) keep the sequence shard, and the column-parallel matmuls that need
the whole activation all-gather it (the propagation's ordinary Shard -> Replicate want). An
all-reduce is a reduce-scatter + an all-gather in the ring model, so the bytes stay Megatron's
while the activations between the regions are divided by the axis size.

The sequence dim is found by data flow (``seq_dim``): the program's token inputs ``[b, s, ...]``
have it at dim 1; an op's output keeps it where a transpose / permute moves it, a view that
merges ``b`` and ``s`` makes a flat ``[b*s, ...]`` value ("flat") that a later view splits back,
and any other op keeps dim d when an input had it there and the output still has the batch at
dim 0 and the sequence length at dim d.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autopar.errors import PlanError
from autopar.ir import ShardSpec, fmt_placements, info, tensor_args

aten = torch.ops.aten

# strategy name -> how it lays out activations between its parallel regions
ACTIVATION_LAYOUT = {"sequence": "sequence", "ulysses": "ulysses", "context": "ring"}
FLAT = "flat"  # a value whose dim 0 is batch x sequence merged


def sequence_axes(ctx) -> list[int]:
    """Mesh axes (of size > 1) whose strategy shards activations over the sequence."""
    return [i for i, ap in enumerate(ctx.plan.axes)
            if ACTIVATION_LAYOUT.get(ap.strategy) == "sequence" and ctx.axis_sizes[i] > 1]


class SequenceDims:
    """Per program: the batch and sequence length of its token inputs, and each value's sequence
    dim (``info(n).seq_dim``: an int, FLAT, or None)."""

    def __init__(self, program, ctx):
        self.axes = sequence_axes(ctx)
        self.batch = self.seq = None
        if not self.axes:
            return
        for n, role in zip((n for n in program.graph.nodes if n.op == "placeholder"), program.inputs):
            val = n.meta.get("val")
            if role[0] == "input" and isinstance(val, torch.Tensor) and val.ndim >= 2:
                self.batch, self.seq = int(val.shape[0]), int(val.shape[1])
                break
        if self.seq is None:
            return
        k = ctx.prod(self.axes)
        if self.seq % k:
            names = ", ".join(f"'{ctx.axis_names[a]}'" for a in self.axes)
            raise PlanError(
                f"sequence parallelism needs the sequence length (dim 1 of the inputs: {self.seq}) to be divisible "
                f"by the ranks of mesh axis {names} ({k})",
                where=", ".join(f"plan[{ctx.axis_names[a]!r}] = 'sequence'" for a in self.axes),
                fix=f"use a sequence length that is a multiple of {k}, or the 'megatron' strategy on that axis")

    @property
    def active(self) -> bool:
        return bool(self.axes) and self.seq is not None

    def label(self, n: fx.Node, role=None) -> None:
        """Set ``info(n).seq_dim`` from n's inputs (placeholders: from their role)."""
        if not self.active:
            return
        info(n).seq_dim = self._label(n, role)

    def _label(self, n: fx.Node, role):
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        shape = tuple(val.shape)
        if n.op == "placeholder":
            ok = role is not None and role[0] == "input" and len(shape) >= 2
            return 1 if ok and shape[:2] == (self.batch, self.seq) else None
        if n.op != "call_function":
            return None
        src = n.args[0] if n.target is operator.getitem else n  # a multi-output op's outputs: from its inputs
        labels = [info(a).seq_dim for a in tensor_args(src)]
        if not any(lab is not None for lab in labels):
            return None
        x = labels[0]
        if src is not n:
            n = src
        if n.target is aten.transpose.int and isinstance(x, int):
            d0, d1 = (int(d) % len(shape) for d in n.args[1:3])
            return d1 if x == d0 else d0 if x == d1 else x
        if n.target is aten.permute.default and isinstance(x, int):
            return [int(d) % len(shape) for d in n.args[1]].index(x)
        for lab in labels:
            if isinstance(lab, int) and len(shape) > lab and shape[0] == self.batch and shape[lab] == self.seq:
                return lab
        bs = self.batch * self.seq
        if any(lab == 1 or lab == FLAT for lab in labels) and len(shape) >= 1 and shape[0] == bs:
            return FLAT
        if any(lab == FLAT for lab in labels) and len(shape) >= 2 and shape[:2] == (self.batch, self.seq):
            return 1
        return None

    def gathered(self, n: fx.Node, in_specs) -> dict[fx.Node, ShardSpec]:
        """A view that merges the batch and sequence dims (``[b, s, h] -> [b*s, h]``, what a linear
        layer does before its matmul) enters a tensor-parallel region: its input is read whole on
        the sequence axes (an all-gather), never carried into the matmul as a strided shard (which
        would all-gather the weight instead and leave attention with part of the sequence)."""
        out: dict[fx.Node, ShardSpec] = {}
        if not self.active or info(n).seq_dim != FLAT:
            return out
        for a, have in zip(tensor_args(n), in_specs):
            d = info(a).seq_dim
            if have is None or not isinstance(d, int):
                continue
            pl = [Replicate() if ax in self.axes and p == Shard(d) else p for ax, p in enumerate(have.placements)]
            if tuple(pl) != tuple(have.placements):
                out[a] = ShardSpec(tuple(pl), have.shape, have.dtype)
        return out

    def resolved(self, n: fx.Node, in_specs, wants) -> dict[fx.Node, ShardSpec]:
        """The inputs of ``n`` that the first choice resolves from Partial to Replicate on a sequence
        axis and that have a sequence dim: each with the spec it is read in instead (Shard(seq) on
        those axes). Empty when nothing is to change. An input whose own sequence dim was lost on
        the way (a causal convolution's padding, a scan over chunks) is read by its sequence dim
        when it has n's shape and n has one (a residual add after such a block), and labelled so."""
        out: dict[fx.Node, ShardSpec] = {}
        if not self.active:
            return out
        nd, shape = info(n).seq_dim, tuple(getattr(n.meta.get("val"), "shape", ()))
        for a, have, want in zip(tensor_args(n), in_specs, wants):
            d = info(a).seq_dim
            if not isinstance(d, int) and isinstance(nd, int) and have is not None and tuple(have.shape) == shape:
                d = info(a).seq_dim = nd  # (learnt from its reader: the reason for its move says so)
            if have is None or want is None or not isinstance(d, int):
                continue
            pl = list(out[a].placements) if a in out else list(have.placements)
            for ax in self.axes:
                taken = any(isinstance(p, Shard) and p.dim == d for i, p in enumerate(pl) if i != ax)
                if isinstance(have.placements[ax], Partial) and isinstance(want[ax], Replicate) and not taken:
                    pl[ax] = Shard(d)
            if tuple(pl) != tuple(have.placements):
                out[a] = ShardSpec(tuple(pl), have.shape, have.dtype)
        return out


def sequence_reason(a: fx.Node, have, want, ctx) -> str | None:
    """Why a move of ``a`` from ``have`` to ``want`` exists, when the sequence layout made it: the
    reduce-scatter out of a tensor-parallel region, or the all-gather into one. None otherwise."""
    d = info(a).seq_dim
    if not isinstance(d, int):
        return None
    for ax in sequence_axes(ctx):
        p, q = have[ax], want[ax]
        name = ctx.axis_names[ax]
        if isinstance(p, Partial) and q == Shard(d):
            return (f"sequence parallel ({name}=sequence): partial sums leave the tensor-parallel region "
                    f"reduce-scattered over the sequence (dim {d}), {fmt_placements(have)} -> {fmt_placements(want)}")
        if p == Shard(d) and isinstance(q, Replicate):
            return (f"sequence parallel ({name}=sequence): the sequence-sharded activation is all-gathered to enter "
                    f"a tensor-parallel region, {fmt_placements(have)} -> {fmt_placements(want)}")
    return None


# ---------------------------------------------------------------------------------------
# context parallelism: {"cp": "ulysses"} (DeepSpeed-Ulysses, Jacobs et al. 2023)
#
# The inputs' sequence dim (dim 1) is sharded over the axis (Context.input_placements), so every
# op runs on its rank's tokens: embeddings, norms, MLPs (a view merging batch and sequence gives
# DTensor's strided shard, which the matmuls keep), RoPE (the replicated cos/sin tables are read
# Shard(seq): rank r takes positions r*s/cp..., a local slice) and the loss (the nll rule reduces
# the sum and the token count over the axis: the global mean). Parameters are replicated on the
# axis; their gradients come out Partial and are all-reduced, as under data parallelism.
# Attention (rules._attention_rule) wants q, k, v sharded on the HEADS (dim 1) instead: the
# collectives pass turns Shard(2) (the sequence of [b, heads, s, d]) into Shard(1) with one
# all-to-all each, and the attention's outputs are read back as Shard(2) by the first op that is
# not attention (``heads_to_sequence``): one more all-to-all. The backward mirrors it: the
# gradient of the attention output is all-to-all'ed to heads, dq, dk, dv back to the sequence;
# q, k, v and the output are saved for the backward in their heads layout (no communication).


def ulysses_axes(ctx) -> list[int]:
    """Mesh axes (of size > 1) whose strategy is "ulysses"."""
    return [i for i, ap in enumerate(ctx.plan.axes)
            if ACTIVATION_LAYOUT.get(ap.strategy) == "ulysses" and ctx.axis_sizes[i] > 1]


def check_context_parallel(program, ctx) -> None:
    """A PlanError (before anything runs) when the context-parallel axes do not divide the
    sequence length of every input they shard (dim 1 of each input with two dims or more)."""
    axes = getattr(ctx, "cp_axes", [])
    if not axes or ctx.boundary is not None:
        return
    ring = ring_axes(ctx)
    if len(ring) > 1:
        raise PlanError("ring attention ({\"cp\": \"context\"}) runs on one mesh axis, the plan names "
                        f"{len(ring)}: {', '.join(repr(ctx.axis_names[a]) for a in ring)}",
                        where="plan", fix="merge them into one context-parallel axis")
    k = ctx.prod(axes) * (2 if ring else 1)  # the ring's load-balanced layout: 2·cp chunks
    for i, (n, role) in enumerate(zip((n for n in program.graph.nodes if n.op == "placeholder"), program.inputs)):
        val = n.meta.get("val")
        if role[0] != "input" or not isinstance(val, torch.Tensor) or val.ndim < 2 or val.shape[1] % k == 0:
            continue
        names = ", ".join(f"'{ctx.axis_names[a]}'" for a in axes)
        chunks = f"2 x the ranks of mesh axis {names} ({k}: the ring's load-balanced layout cuts the sequence " \
                 f"into 2·cp chunks)" if ring else f"the ranks of mesh axis {names} ({k})"
        raise PlanError(
            f"context parallelism needs the sequence length (dim 1 of input #{role[1]}, shape {list(val.shape)}: "
            f"{val.shape[1]}) to be divisible by {chunks}",
            where=", ".join(f"plan[{ctx.axis_names[a]!r}] = {ctx.plan.axes[a].strategy!r}" for a in axes),
            fix=f"use a sequence length that is a multiple of {k} (pad it), or fewer ranks on {names}")


_ALIASES = {aten.detach.default, aten.alias.default}


def _attention_source(a: fx.Node, attention_ops) -> bool:
    """Whether ``a`` is an output of an attention op (through getitem / detach / alias)."""
    while a.op == "call_function" and (a.target is operator.getitem or a.target in _ALIASES):
        a = a.args[0]
    return a.op == "call_function" and a.target in attention_ops


def heads_to_sequence(n: fx.Node, in_specs, ctx, attention_ops) -> dict[fx.Node, ShardSpec]:
    """On a "ulysses" axis: the inputs of ``n`` that come out of attention sharded on the heads
    (dim 1), each with the spec ``n`` reads it in: sharded on the sequence (dim 2 of [b, heads, s,
    ...]), an all-to-all. Attention ops, getitem and aliases (detach) keep the heads layout: the
    attention backward reads the saved output and log-sum-exp as the forward produced them."""
    axes = ulysses_axes(ctx)
    if not axes or n.target in attention_ops or n.target is operator.getitem or n.target in _ALIASES:
        return {}
    out: dict[fx.Node, ShardSpec] = {}
    for a, have in zip(tensor_args(n), in_specs):
        if have is None or len(have.shape) < 3 or not _attention_source(a, attention_ops):
            continue
        pl = [Shard(2) if ax in axes and p == Shard(1) else p for ax, p in enumerate(have.placements)]
        if tuple(pl) != tuple(have.placements):
            out[a] = ShardSpec(tuple(pl), have.shape, have.dtype)
    return out


def ulysses_reason(a: fx.Node, have, want, ctx) -> str | None:
    """Why a move of ``a`` from ``have`` to ``want`` exists, when a "ulysses" axis made it."""
    for ax in ulysses_axes(ctx):
        p, q = have[ax], want[ax]
        name = ctx.axis_names[ax]
        if p == Shard(2) and q == Shard(1):
            return (f"ulysses ({name}=ulysses): all-to-all from sequence shards to head shards for attention, "
                    f"{fmt_placements(have)} -> {fmt_placements(want)}")
        if p == Shard(1) and q == Shard(2):
            return (f"ulysses ({name}=ulysses): all-to-all from head shards back to sequence shards after "
                    f"attention, {fmt_placements(have)} -> {fmt_placements(want)}")
    return None


# ---------------------------------------------------------------------------------------
# ring attention: {"cp": "context"} (Liu et al. 2023; the load-balanced causal layout of
# Brandon et al. 2023 / zigzag ring attention)
#
# The sequence is cut into 2·cp chunks; rank r of the axis holds chunks r and 2·cp-1-r, in that
# order, so that under a causal mask every rank has the same attention work. A Shard(d) on a ring
# axis MEANS this layout everywhere (not torch.chunk's contiguous one): the inputs are sliced so
# (runtime/common.py local_inputs), a replicated value read sharded takes the same two chunks (the
# RoPE tables, in-graph position ids: positions follow the layout), an all-gather puts the chunks
# back in order (eval logits), a reduce-scatter hands each rank its two chunks. Ops that keep the
# sequence position-wise (embeddings, norms, MLP, RoPE, the loss's sums) need nothing else;
# attention runs the ring (autopar/ring.py).


def ring_axes(ctx) -> list[int]:
    """Mesh axes (of size > 1) whose strategy is "context" (ring attention); none for a context
    without a plan (a lone redistribution)."""
    plan = getattr(ctx, "plan", None)
    if plan is None:
        return []
    return [i for i, ap in enumerate(plan.axes)
            if ACTIVATION_LAYOUT.get(ap.strategy) == "ring" and ctx.axis_sizes[i] > 1]


def zigzag_index(length: int, n: int, r: int) -> list[int]:
    """The positions rank ``r`` of ``n`` holds of a dim of ``length``: chunks r and 2n-1-r of 2n."""
    c = length // (2 * n)
    return list(range(r * c, (r + 1) * c)) + list(range((2 * n - 1 - r) * c, (2 * n - r) * c))


def zigzag_take(x: torch.Tensor, dim: int, n: int, r: int) -> torch.Tensor:
    """Rank ``r``'s part of ``x`` along ``dim`` (a copy): chunks r and 2n-1-r of 2n."""
    pieces = torch.chunk(x, 2 * n, dim=dim)
    return torch.cat([pieces[r], pieces[2 * n - 1 - r]], dim=dim)


def zigzag_order(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x`` whose ``dim`` holds the ranks' parts side by side in rank order (an all-gather's
    result), put back in sequence order."""
    pieces = torch.chunk(x, 2 * n, dim=dim)  # rank r's: pieces 2r (chunk r), 2r+1 (chunk 2n-1-r)
    return torch.cat([pieces[2 * i] for i in range(n)] + [pieces[2 * i + 1] for i in reversed(range(n))], dim=dim)


def zigzag_unorder(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The inverse of ``zigzag_order``: a whole ``dim`` laid out as the ranks' parts in rank order
    (what a reduce-scatter hands out in pieces)."""
    return torch.cat([zigzag_take(x, dim, n, r) for r in range(n)], dim=dim)
