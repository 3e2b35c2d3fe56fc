"""Where a Partial sum is reduced: the facts propagation's choices read (passes/propagate.py's
``_select_strategy``, ``_dtensor_rule_uncached`` and ``_cache_key``) and the ops it decides
itself rather than take DTensor's one strategy for (docs/design-notes.md: each with the model that
showed why).

- ``narrower`` / ``widens_a_partial``: an op that widens a Partial input (a cast up, an add into a
  wider residual, a broadcast to more elements) should have it reduced first, at its own size;
- ``reduced_elsewhere``: the axes on which another reader decided before reads a Partial value
  all-reduced (it is reduced there in any case), in the backward;
- ``reduced_first``: a Partial expanded to more elements is reduced first (``reduced_before_expand``),
  and so is one a seeded random op reads (``reduced_before_random``);
- ``partial_through_a_copy``: a clone of a Partial sum is a Partial sum (off sequence-parallel axes);
- ``returned``: the program returns the value (a gradient: the data-parallel passes' choice).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate

from autopar.ir import phase_of, tensor_args
from autopar.layout import sequence_axes
from autopar.rules import RuleResult


def reduced_first(n: fx.Node, in_specs) -> RuleResult | None:
    """The layout of an op whose Partial input autopar reduces first; None where none applies."""
    return reduced_before_expand(n, in_specs) or reduced_before_random(n, in_specs)


def reduced_before_random(n: fx.Node, in_specs) -> RuleResult | None:
    """A seeded random op (dropout, bernoulli...) reading a Partial sum reads it reduced: sampling
    from a partial sum is not sampling from the sum. Every output keeps the input's layout, reduced
    (DTensor's strategy for these ops: the output follows the input; torch 2.12+ offers Replicate
    or a Shard for a Partial input, and ``_select_strategy`` takes Replicate, no Shard invented;
    torch 2.11 raised "native_dropout with Partial is not supported yet": GPT-2's dropout after
    its attention's and MLP's row-parallel projections under megatron). None where that does not
    apply."""
    if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()) or not in_specs or in_specs[0] is None:
        return None
    have = in_specs[0].placements
    if not any(isinstance(p, Partial) for p in have) or any(s is not None for s in in_specs[1:]):
        return None
    reduced = tuple(Replicate() if isinstance(p, Partial) else p for p in have)
    val = n.meta.get("val")
    outputs = tuple(reduced for _ in val) if isinstance(val, (tuple, list)) else reduced
    return RuleResult([reduced], outputs, None, "dtensor")


def reduced_before_expand(n: fx.Node, in_specs) -> RuleResult | None:
    """A Partial sum expanded to more elements is reduced first, at its own size (the preference
    ``_select_strategy`` states, where DTensor offers ``expand`` no choice: it keeps the input's
    placements, so the Partial would be reduced, or its sharded partner gathered, at the expanded
    size later); None where that does not apply."""
    if n.target is not torch.ops.aten.expand.default or not in_specs or in_specs[0] is None:
        return None
    have = in_specs[0].placements
    if not any(isinstance(p, Partial) for p in have) or returned(n) or not narrower(n.args[0], n):
        return None
    reduced = tuple(Replicate() if isinstance(p, Partial) else p for p in have)
    return RuleResult([reduced], reduced, None, "dtensor")


# (clone alone: DTensor registers it as pointwise, whose single-dim strategy has no Partial; alias and
# detach go through its one-to-one passthrough, which keeps a Partial already)
COPIES = (torch.ops.aten.clone.default,)


def partial_through_a_copy(n: fx.Node, in_specs, ctx) -> RuleResult | None:
    """A copy of a Partial sum (``clone``: dropout with p = 0 in training, GPT-J's after each of
    its side-by-side branches) is a Partial sum: DTensor's strategy for it offers only the input
    reduced, which cost GPT-J a reduction per branch where the sum of both needs one. None where
    the input holds no Partial, or holds one on a sequence-parallel axis (where the reduction is
    a reduce-scatter into the sequence layout, autopar/layout.py: carried on instead, the built-in
    MoE's backward reduce-scattered its dispatch buffers, 4x the tp bytes)."""
    if n.target not in COPIES or not in_specs or in_specs[0] is None:
        return None
    have = tuple(in_specs[0].placements)
    partial = [a for a, p in enumerate(have) if isinstance(p, Partial)]
    if not partial or set(partial) & set(sequence_axes(ctx)):
        return None
    return RuleResult([have], have, None, "dtensor")


def reduced_elsewhere(x: fx.Node, node: fx.Node, spec) -> tuple[int, ...]:
    """The mesh axes on which ``x`` is Partial now and another reader of it, decided before
    ``node``, reads it reduced to Replicate: it is all-reduced there in any case. In the backward
    only (none in the forward): there, keeping such a value Partial carries the residual stream
    Partial from block to block (Llama's: as many reductions, at the norms instead of the adds),
    and a block recomputed in full then reduces its saved Partial input again, one all-reduce more
    per block (tests/test_state_plans.py::test_recompute_reruns_block_forward)."""
    if spec is None or len(x.users) < 2 or not any(isinstance(p, Partial) for p in spec.placements) \
            or phase_of(node) != "backward":
        return ()
    axes = set()
    for u in x.users:
        rec = u.meta.get("autopar") if u is not node else None
        wants = rec.wants if rec is not None else None
        if not wants:
            continue
        for a, w in zip(tensor_args(u), wants):
            if a is x and w is not None:
                axes.update(i for i, (p, q) in enumerate(zip(spec.placements, w))
                            if isinstance(p, Partial) and isinstance(q, Replicate))
    return tuple(sorted(axes))


def returned(node: fx.Node) -> bool:
    """Whether the program returns ``node`` (``widens_a_partial`` leaves such values alone)."""
    return any(u.op == "output" for u in node.users)


def narrower(a, node: fx.Node) -> bool:
    """Whether tensor ``a`` is narrower than ``node``'s output: fewer bytes per element (a cast up,
    an add into a wider residual), or, where ``node`` broadcasts (``expand``, an elementwise op),
    fewer elements and no more bytes per element (the backward of a mean over a sharded dim: a
    per-token sum expanded to the whole width)."""
    v, out = a.meta.get("val") if isinstance(a, fx.Node) else None, node.meta.get("val")
    if not (isinstance(v, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    if v.dtype.itemsize < out.dtype.itemsize:
        return True
    broadcasts = node.target is torch.ops.aten.expand.default or torch.Tag.pointwise in getattr(node.target, "tags", ())
    return broadcasts and v.dtype.itemsize == out.dtype.itemsize and v.numel() < out.numel()


def widens_a_partial(node: fx.Node, ins: list, cur) -> bool:
    """Whether ``node``'s output is wider than one of its inputs that is a Partial sum now
    (``narrower``: bytes per element, or elements where ``node`` broadcasts); not where the program returns it (a gradient cast to its parameter's dtype:
    where and in which dtype gradients are reduced is the data-parallel passes' choice, by
    ``reduce_dtype``)."""
    if returned(node):
        return False
    return any(narrower(a, node) and any(isinstance(p, Partial) for p in c.placements) for a, c in zip(ins, cur))
