"""The errors a view of a sharded value raises where its layout cannot be kept (propagate's
``_dtensor_rule_uncached``): a dim that does not split across its axis (more ranks than heads), or,
on a torch whose DTensor lacks the view fix (2.11), a view it refuses, named as that."""

from __future__ import annotations

import math

import torch.fx as fx
from torch.distributed.tensor.placement_types import Shard

from autopar import torch_compat as tc
from autopar.errors import ShardingError
from autopar.ir import ShardSpec, source_line


def check_view_keeps_shards(n: fx.Node, have: ShardSpec, want, ctx) -> None:
    """A reshape that must gather a sharded dim means the dim does not split across the axis
    (e.g. 4 heads on tp=8): that silently replicates the activation, so it is an error."""
    for a, (p, q) in enumerate(zip(have.placements, want)):
        if isinstance(p, Shard) and not isinstance(q, Shard):
            view_error(n, have, ctx, None, axis=a)


def flattened_behind(shape, out_shape, dim: int) -> bool:
    """Whether a view of ``shape`` as ``out_shape`` merges input dim ``dim`` into one output dim
    behind an input dim of size > 1 ([b, s, d] -> [b * s, d] for dim 1): the rank's rows of the
    merged dim are then strided, which torch 2.12's DTensor expresses (_StridedShard) and 2.11's
    refuses."""
    if math.prod(shape) != math.prod(out_shape) or 0 in shape:
        return False
    i = o = 0
    while i < len(shape) and o < len(out_shape):
        i0, a, b = i, shape[i], out_shape[o]
        i, o = i + 1, o + 1
        while a != b:
            if a < b:
                a, i = a * shape[i], i + 1
            else:
                b, o = b * out_shape[o], o + 1
        if i0 <= dim < i:
            return math.prod(shape[i0:dim]) > 1
    return False


def view_error(n: fx.Node, have: ShardSpec, ctx, cause, axis: int | None = None):
    if cause is not None and not tc.views_fixed() and (
            sum(isinstance(p, (Shard, tc.StridedShard)) for p in have.placements) > 1
            or any(isinstance(p, Shard) and flattened_behind(tuple(have.shape), tuple(n.meta["val"].shape), p.dim)
                   for p in have.placements)):
        # torch 2.11's view propagation refuses a view of a dim sharded on several mesh axes (dp x cp),
        # and a flatten of a sharded dim behind another (the sequence dim of [b, s, d] -> [b * s, d] under cp)
        what = f"reshaping {have} -> {list(n.meta['val'].shape)} at {source_line(n) or n.name}"
        raise tc.unavailable("DTensor view propagation (_ViewShardingPropagator)", what, since="2.12") from cause
    if axis is None:
        axis = next((a for a, p in enumerate(have.placements) if isinstance(p, Shard)), 0)
    p = have.placements[axis]
    out_shape = tuple(n.meta["val"].shape)
    size = have.shape[p.dim] if isinstance(p, Shard) else "?"
    name, k = ctx.axis_names[axis], ctx.axis_sizes[axis]
    raise ShardingError(
        f"reshape {list(have.shape)} -> {list(out_shape)} cannot keep dim {p.dim if isinstance(p, Shard) else '?'} "
        f"(size {size}) sharded over mesh axis '{name}' of size {k}: the leading dimension it splits into "
        f"is not divisible by {k} (typically: the number of attention heads or KV heads is not divisible by {name})",
        where=source_line(n) or n.name,
        fix=f"use a '{name}' size that divides the head counts, or replicate these projections with a "
        "plan rule (plan['rules'])",
    ) from cause
