"""state: where parameters and gradients live, and in which dtype (after propagate).

``propagate`` sees every parameter in its COMPUTE layout (replicated on data-parallel axes).
This pass applies the plan's STORAGE layout (``Placed.placements``; sharded on ZeRO axes):

- a parameter placeholder takes its storage placements; its mixed-precision cast (if any) runs
  on the shard, just before its first use, so only the compute-dtype copy is communicated;
- one ``redistribute`` marker gathers it back to the compute layout: before its first use
  under ZeRO-1/2 (the gathered copy then serves forward and backward), and separately for its
  forward users and its backward users under ZeRO-3 (``recompute`` gave the backward its own
  view/cast chain, so the forward copy is freed after the forward), except for the parameters
  ``reshard_after_forward`` keeps gathered (``reshard_policy``; by default FSDP2's: those
  outside every repeated block), which are gathered once for both;
- gradients leave the program in the storage layout (``Context.output_placements``): a
  reduce-scatter on ZeRO axes, an all-reduce under DDP; with ``reduce_dtype`` equal to the
  compute dtype, the reduction runs before the cast back to fp32 (half the bytes).

When gradients are not synchronised (micro-batches before the last one under
``accumulate=K``), gradients leave as produced and the fp32 cast stays where autograd put it.
"""

from __future__ import annotations

import math

import torch
from autopar.passes.collectives import insert_redistribute
from torch import fx
from torch.distributed.tensor.placement_types import Partial

from autopar.ir import Program, ShardSpec, info, phase_of, spec_of

aten = torch.ops.aten


def _is_cast(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is aten._to_copy.default


def state_pass(program: Program, ctx) -> Program:
    """After it: parameters carry their STORAGE placements (ZeRO shards) and are gathered to the
    compute layout where used; gradients are reduced in ``reduce_dtype``."""
    graph = program.graph
    for n in list(graph.nodes):
        if n.op == "placeholder" and (info(n).role or ("",))[0] == "param":
            _place_parameter(graph, n, ctx)
    if ctx.sync_grads and ctx.reduce_dtype is not None:
        out = next(n for n in graph.nodes if n.op == "output")
        for o, role in zip(out.args[0], program.outputs):
            if role[0] == "grad" and isinstance(o, fx.Node):
                _reduce_before_upcast(graph, o, out, ctx, role[1])
    return program


def _place_parameter(graph: fx.Graph, p: fx.Node, ctx) -> None:
    name = info(p).role[1]
    storage, compute = ctx.placed.placements[name], ctx.placed.compute[name]
    casts = [u for u in p.users if _is_cast(u)]
    for c in casts:  # cast just before first use: the compute-dtype copy lives no longer than needed
        first = min(c.users, key=_order(graph), default=None)
        if first is not None:
            first.prepend(c)
    if tuple(storage) == tuple(compute):
        return
    spec = spec_of(p)
    info(p).spec = ShardSpec(tuple(storage), spec.shape, spec.dtype)
    for c in casts:
        cs = spec_of(c)
        info(c).spec = ShardSpec(tuple(storage), cs.shape, cs.dtype)
        info(c).wants = [tuple(storage)]
    zero3 = ctx.plan.zero >= 3
    keep = zero3 and reshard_policy(ctx.reshard_after_forward)(name)
    order = _order(graph)
    if keep:  # autograd may cast again for the backward: one cast (and one gather) serves both phases
        casts.sort(key=order)
        same = [c for c in casts[1:] if c.args == casts[0].args and c.kwargs == casts[0].kwargs]
        for c in same:
            c.replace_all_uses_with(casts[0])
            graph.erase_node(c)
        casts = [c for c in casts if c not in same]
    for head in [p] + casts:
        users = sorted((u for u in head.users if u not in casts), key=order)
        groups: dict[str, list[fx.Node]] = {}
        for u in users:
            groups.setdefault(phase_of(u) if zero3 and not keep else "step", []).append(u)
        if keep and any(phase_of(u) == "backward" for u in users) and any(phase_of(u) != "backward" for u in users):
            local = ShardSpec(tuple(compute), spec_of(head).shape, spec_of(head).dtype).local_shape(ctx.axis_sizes)
            ctx.kept_gathered = [*(k for k in ctx.kept_gathered if k[0] != name),
                                 (name, math.prod(local) * spec_of(head).dtype.itemsize)]
        for phase, us in groups.items():
            why = {"forward": "its forward use", "backward": "its backward use (gathered again)",
                   "step": "forward and backward" + (" (kept gathered after the forward: reshard_after_forward)"
                                                     if keep else "")}[phase]
            reason = f"ZeRO-{ctx.plan.zero}: gather parameter {name} for {why}"
            r = insert_redistribute(graph, head, compute, us[0], ctx, reason,
                                    "backward" if phase_of(us[0]) == "backward" else "forward")
            for u in us:
                u.replace_input_with(head, r)


def reshard_policy(option):
    """``autopar.compile(reshard_after_forward=...)`` as a predicate over parameter names: which
    ZeRO-3 parameters are gathered once for forward and backward (kept gathered in between)
    instead of once per phase. None (the default, FSDP2's for a model wrapped per block plus the
    root): the parameters outside every repeated block (``block_of`` is "": embeddings, final
    norm, LM head; the backward starts with them right after the forward); True: none; False:
    all."""
    from autopar.modpath import block_of

    if option is True:
        return lambda name: False
    if option is False:
        return lambda name: True
    return lambda name: block_of(name) == ""


def _reduce_before_upcast(graph: fx.Graph, g: fx.Node, out: fx.Node, ctx, name: str) -> None:
    """grad (compute dtype, Partial) -> _to_copy(fp32): reduce first, then cast."""
    if not _is_cast(g):
        return
    src = g.args[0]
    have = spec_of(src)
    if have is None or have.dtype != ctx.reduce_dtype or not any(isinstance(p, Partial) for p in have.placements):
        return
    want = info(out).wants[list(out.args[0]).index(g)]
    if want is None:
        return
    info(g).wants = [tuple(want)]
    info(g).why = f"gradient of {name} reduced in {str(ctx.reduce_dtype).removeprefix('torch.')} before its fp32 cast"
    info(g).spec = ShardSpec(tuple(want), spec_of(g).shape, spec_of(g).dtype)
    if ctx.plan.zero == 1:  # ZeRO-1 reduces at the end of backward
        out.prepend(g)


def _order(graph: fx.Graph):
    pos = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: pos[n]


def grad_sync_program(program: Program, ctx, debug: bool = False) -> Program:
    """Under ``accumulate=K``: the program that reduces the accumulated gradients once per step.

    Its inputs are the per-rank gradient sums over the K micro-batches, in the layout the
    no-sync program produced them (Partial on data-parallel axes, fp32); its outputs are the
    gradients in their parameters' storage layout. With a lower ``reduce_dtype`` the sums are
    cast down for the reduction and back up after it.
    """
    from autopar.passes.checks import PLACED, verify_program
    from autopar.passes.localize import trace_local

    graph = fx.Graph()
    out_old = next(n for n in program.graph.nodes if n.op == "output")
    inputs, outputs, results = [], [], []
    for o, role in zip(out_old.args[0], program.outputs):
        if role[0] != "grad" or not isinstance(o, fx.Node):
            continue
        name = role[1]
        have = spec_of(o)
        a = graph.placeholder(f"acc_{len(inputs)}")
        a.meta.update(val=o.meta["val"], partitioner_tag="is_backward")
        info(a).spec, info(a).role = have, ("grad_acc", name)
        inputs.append(("grad_acc", name))
        want = ctx.placed.placements[name]
        x = a
        low = ctx.reduce_dtype is not None and ctx.reduce_dtype != have.dtype
        if low:
            x = _cast(graph, x, ctx.reduce_dtype)
        reason = f"gradient of {name} to its parameter's placement (once per {ctx.accumulate} micro-batches)"
        x = _append_redistribute(graph, x, want, ctx, reason)
        if low:
            x = _cast(graph, x, have.dtype)
        results.append(x)
        outputs.append(("grad", name))
    out = graph.output(tuple(results))
    info(out).wants = [None] * len(results)
    sync = Program(graph=graph, inputs=inputs, outputs=outputs)
    verify_program(sync, ctx, "schedule (the gradient-sync program before localize)", PLACED + ("placements",), debug)
    return trace_local(sync, ctx)


def _cast(graph: fx.Graph, x: fx.Node, dtype) -> fx.Node:
    c = graph.call_function(aten._to_copy.default, (x,), {"dtype": dtype})
    val = x.meta["val"]
    c.meta.update(val=val.to(dtype) if hasattr(val, "to") else val, partitioner_tag="is_backward")
    info(c).spec = ShardSpec(spec_of(x).placements, spec_of(x).shape, dtype)
    info(c).wants = [spec_of(x).placements]
    return c


def _append_redistribute(graph: fx.Graph, x: fx.Node, want, ctx, reason: str) -> fx.Node:
    anchor = graph.call_function(torch.ops.aten.alias.default, (x,))  # insertion point, removed below
    r = insert_redistribute(graph, x, want, anchor, ctx, reason, "backward")
    graph.erase_node(anchor)
    return r
