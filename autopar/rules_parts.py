"""autopar's sharding rules for parts of a sharded dim (registered in autopar/rule_registry.py's
``RULES``, as autopar/rules.py's are): a fused projection's ``[q | k | v]`` or ``[gate | up]`` split after a column-parallel
matmul whose weight is strided-sharded (autopar/analysis/tensor_parallel.py) and the gradients'
cat back; interleaved parts (``x[..., 0::2]``, ``x[..., 1::2]``: gpt-oss's gate and up) taken
from a dim sharded in pieces that hold whole strides, and their backward; a buffer filled by
``slice_scatter`` with values sharded along another dim, sharded like them; a convolution with
one filter per channel over input sharded on its channels (Mamba's conv1d), and its backward."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autopar import torch_compat as tc
from autopar.ir import RuleResult, ShardSpec
from autopar.rule_registry import norm_dim, rule

aten = torch.ops.aten
_norm = norm_dim


# ---------------------------------------------------------------------------------------
# fused projections: [q | k | v] (or [gate | up]) split after a column-parallel matmul whose
# weight is strided-sharded (autopar/analysis/tensor_parallel.py), and the gradients' cat back


def _split_parts(node, x: ShardSpec) -> tuple[int, list[int]]:
    """(dim, part sizes) of aten.split.Tensor / split_with_sizes on ``x``."""
    dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(x.shape))
    size = node.args[1]
    if isinstance(size, int):
        n = x.shape[dim]
        return dim, [min(size, n - i) for i in range(0, n, size)]
    return dim, list(size)


@rule(aten.split.Tensor, aten.split_with_sizes.default)
def strided_split_rule(node, in_specs, ctx):
    """A dim strided-sharded with split factor k (each rank holds its 1/tp of every k-th part),
    split into k equal parts: each part is plainly sharded on that dim, and each rank's local
    tensor splits into its k local parts (no communication). Any other split: DTensor's rule."""
    (x,) = in_specs[:1]
    dim, parts = _split_parts(node, x)
    k = len(parts)
    axes = [a for a, p in enumerate(x.placements)
            if isinstance(p, tc.StridedShard) and p.dim == dim and p.split_factor == k]
    if not axes or len(set(parts)) != 1 or any(
            isinstance(p, (Shard, tc.StridedShard)) and p.dim == dim and a not in axes for a, p in enumerate(x.placements)):
        return None
    out = tuple(Shard(dim) if a in axes else p for a, p in enumerate(x.placements))

    def impl(ctx, x, *_):
        return tuple(torch.split(x, x.shape[dim] // k, dim))

    return RuleResult([tuple(x.placements)], tuple(out for _ in parts), impl, "split of a strided shard into its parts")


@rule(aten.cat.default)
def strided_cat_rule(node, in_specs, ctx):
    """k equal tensors each sharded on the cat dim over the same axes: the result is that dim
    strided-sharded with split factor k (each rank's local parts, concatenated: no
    communication). The inverse of ``strided_split_rule`` (a fused projection's gradient).
    Anything else: DTensor's rule."""
    specs = [s for s in in_specs if s is not None]
    if len(specs) < 2 or any(len(s.shape) != len(specs[0].shape) for s in specs):
        return None
    dim = _norm(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(specs[0].shape))
    first = specs[0].placements
    axes = [a for a, p in enumerate(first) if isinstance(p, Shard) and p.dim == dim]
    if not axes or any(tuple(s.placements) != tuple(first) or s.shape != specs[0].shape for s in specs):
        return None
    if any(isinstance(p, tc.StridedShard) or isinstance(p, Partial) for p in first) or len(axes) > 1:
        return None
    out = tuple(tc.StridedShard(dim, split_factor=len(specs)) if a in axes else p for a, p in enumerate(first))
    return RuleResult([tuple(first) for _ in in_specs], out, None, "cat of shards into a strided shard")


def _strides_kept(ctx, placements, dim: int, n: int, start, end, step) -> bool:
    """``[start:end:step]`` of a dim of ``n`` split in contiguous pieces over the axes that shard
    it (plainly) takes each piece's own ``[start::step]``: it runs to the end, starts within the
    first stride, and every piece holds whole strides."""
    axes = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]
    if not isinstance(step, int) or step <= 1 or not axes or any(
            isinstance(p, tc.StridedShard) and p.dim == dim for p in placements):
        return False
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None or end >= n else (end + n if end < 0 else end)
    pieces = math.prod(ctx.axis_sizes[a] for a in axes)
    return 0 <= start < step and end == n and n % pieces == 0 and (n // pieces) % step == 0


def _slice_args(args, first: int):
    dim, start, end, step = (list(args[first:first + 4]) + [0, None, None, 1][len(args) - first:])[:4]
    return dim, start, end, step


@rule(aten.slice.Tensor)
def strided_slice_rule(node, in_specs, ctx):
    """``x[..., start::step]`` over a dim sharded in pieces that hold whole strides: each rank's
    slice of its piece is its piece of the result (no communication). Anything else: DTensor's."""
    x = in_specs[0]
    dim, start, end, step = _slice_args(node.args, 1)
    dim = _norm(dim, len(x.shape))
    if any(isinstance(p, Partial) for p in x.placements):
        return None
    part = _whole_part(x.placements, dim, x.shape[dim], start, end, step)
    if part is not None:  # one of a strided shard's parts (a cat's backward): each rank's piece of it
        j, k, axes = part
        out = tuple(Shard(dim) if a in axes else p for a, p in enumerate(x.placements))

        def impl(ctx, x, *_):
            m = x.shape[dim] // k
            return x.narrow(dim, j * m, m)

        return RuleResult([tuple(x.placements)], out, impl, "a part of a strided shard")
    if not _strides_kept(ctx, x.placements, dim, x.shape[dim], start, end, step):
        return None
    return RuleResult([tuple(x.placements)], tuple(x.placements), None, "strided slice of a sharded dim")


def _whole_part(placements, dim: int, n: int, start, end, step):
    """(j, k, axes) where ``[start:end]`` (step 1) is exactly the j-th of the k parts of a dim
    strided-sharded with split factor k on ``axes``, and no other axis splits that dim; else None."""
    axes = [a for a, p in enumerate(placements) if isinstance(p, tc.StridedShard) and p.dim == dim]
    if not axes or step not in (None, 1) or any(
            isinstance(p, Shard) and p.dim == dim and a not in axes for a, p in enumerate(placements)):
        return None
    if len(axes) != 1:
        return None
    k = placements[axes[0]].split_factor
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None or end >= n else (end + n if end < 0 else end)
    if n % k or start % (n // k) or end - start != n // k:
        return None
    return start // (n // k), k, axes


@rule(aten.tril.default, aten.triu.default)
def triangle_rule(node, in_specs, ctx):
    """``tril`` / ``triu`` mask the last two dims: a value split (or partial) along any other dim
    is masked where it is (a chunked scan's per-head scores). Anything else: DTensor's rule."""
    x = in_specs[0]
    nd = len(x.shape)
    if any(isinstance(p, (Shard, tc.StridedShard)) and _norm(p.dim, nd) >= nd - 2 for p in x.placements):
        return None
    if all(isinstance(p, Replicate) for p in x.placements):
        return None
    return RuleResult([tuple(x.placements)], tuple(x.placements), None, "triangle mask of the last two dims, split elsewhere")


@rule(aten.slice_backward.default)
def strided_slice_backward_rule(node, in_specs, ctx):
    """The gradient of ``strided_slice_rule``'s slice: each rank scatters its piece of the
    gradient into its piece of the input's shape."""
    g = in_specs[0]
    sizes = list(node.args[1])
    dim, start, end, step = _slice_args(node.args, 2)
    dim = _norm(dim, len(sizes))
    if any(isinstance(p, Partial) for p in g.placements) or \
            not _strides_kept(ctx, g.placements, dim, sizes[dim], start, end, step):
        return None

    def impl(ctx, grad, input_sizes, dim_, start_, end_, step_):
        local = list(grad.shape)
        local[dim] = grad.shape[dim] * step
        return aten.slice_backward(grad, local, dim_, start_, local[dim], step_)

    return RuleResult([tuple(g.placements)], tuple(g.placements), impl, "strided slice of a sharded dim, backward")


@rule(aten.slice_scatter.default)
def sharded_slice_scatter_rule(node, in_specs, ctx):
    """``slice_scatter(buffer, src, dim, ...)`` with ``src`` sharded along another dim on axes where
    the buffer is whole: the buffer is taken sharded the same way (each rank's part of it: no
    communication) and so is the result, rather than gathering ``src`` (DeepSeek's keys:
    ``k = new_empty(...); k[..., :a].copy_(k_nope)``, k_nope sharded by heads). Anything else:
    DTensor's rule."""
    base, src = in_specs[:2]
    if base is None or src is None or len(base.shape) != len(src.shape):
        return None
    dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(base.shape))
    outs, moved = [], False
    for pb, ps in zip(base.placements, src.placements):
        plain = isinstance(ps, Shard) and not isinstance(ps, tc.StridedShard)
        if plain and ps.dim != dim and isinstance(pb, Replicate) and base.shape[ps.dim] == src.shape[ps.dim]:
            outs.append(ps)
            moved = True
        elif pb == ps and (isinstance(pb, Replicate) or (plain and ps.dim != dim)):
            outs.append(pb)
        else:
            return None
    if not moved:
        return None
    return RuleResult([tuple(outs), tuple(outs)], tuple(outs), None, "slice_scatter into a buffer sharded like its source")


def _depthwise_layout(x, w, groups, transposed):
    """Per mesh axis, how a one-filter-per-channel convolution's input is split: "c" (its
    channels; also in k parts, each split: a ``cat`` of q, k, v before one conv), "b" (its batch:
    data parallelism), "r" (whole), each with the channels' split factor; None where the rule does
    not apply (not such a convolution, another split, or no axis splitting the channels)."""
    if transposed or groups != x.shape[1] or w.shape[0] != x.shape[1] or w.shape[1] != 1:
        return None
    kinds = []
    for p in x.placements:
        if isinstance(p, tc.StridedShard) and p.dim == 1:
            kinds.append(("c", p.split_factor))
        elif isinstance(p, Shard) and not isinstance(p, tc.StridedShard) and p.dim in (0, 1):
            kinds.append(("cb"[p.dim == 0], 1))
        elif isinstance(p, Replicate):
            kinds.append(("r", 1))
        else:
            return None
    return kinds if any(k == "c" for k, _ in kinds) else None


def _on(kinds, dim: int):
    """The placements per axis of a value split on the channels at ``dim`` as ``kinds`` say."""
    return tuple((tc.StridedShard(dim, split_factor=f) if f > 1 else Shard(dim)) if k == "c" else
                 Shard(0) if k == "b" else _R for k, f in kinds)


_R = Replicate()


def _channel_layouts(kinds):
    """(the input's placements: channels on dim 1, the per-channel tensors' (weight, bias): on dim
    0, replicated on the batch axes)."""
    return _on(kinds, 1), tuple(_R if k == "b" else p for (k, _), p in zip(kinds, _on(kinds, 0)))


@rule(aten.convolution.default)
def depthwise_conv_rule(node, in_specs, ctx):
    """A convolution with one filter per channel (``groups`` = channels: Mamba's causal conv1d)
    on input sharded on its channels: each rank convolves its channels with its filters (weight
    and bias sharded on dim 0 the same way; ``groups`` = its channel count); on a data-parallel
    axis, its rows with the whole filters. Anything else: DTensor's rule."""
    x, w = in_specs[:2]
    has_bias = len(in_specs) > 2 and in_specs[2] is not None
    kinds = _depthwise_layout(x, w, node.args[8], node.args[6])
    if kinds is None:
        return None
    on, per_channel = _channel_layouts(kinds)

    def impl(ctx, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
        return aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, x.shape[1])

    ins = [on, per_channel] + ([per_channel] if has_bias else [])
    return RuleResult(ins, on, impl, "convolution per channel, sharded on the channels")


@rule(aten.convolution_backward.default)
def depthwise_conv_backward_rule(node, in_specs, ctx):
    """The backward of ``depthwise_conv_rule``'s convolution: the input's gradient split as the
    input, the weight's and the bias's on dim 0 where the channels are split and partial sums
    where the batch is."""
    g, x, w = in_specs[:3]
    kinds = _depthwise_layout(x, w, node.args[9], node.args[7])
    if kinds is None or tuple(g.placements) != tuple(x.placements):
        return None
    on, per_channel = _channel_layouts(kinds)
    grads = tuple(Partial() if k == "b" else p for (k, _), p in zip(kinds, per_channel))
    mask = node.args[10]

    def impl(ctx, g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask):
        sizes = [w.shape[0]] if bias_sizes is not None else None
        return aten.convolution_backward(g, x, w, sizes, stride, padding, dilation, transposed, output_padding,
                                         x.shape[1], output_mask)

    outs = (on if mask[0] else None, grads if mask[1] else None, grads if mask[2] else None)
    return RuleResult([on, on, per_channel], outs, impl, "convolution per channel, sharded on the channels, backward")
