"""collectives: make every consumer see the placements it asked for.

Wherever a value's placements differ from what an op (or the program's output) needs, insert
one ``redistribute`` marker node. Its ``CommRecord``s predict each collective step: kind,
mesh axis, bytes per rank, the reason, and the user source line of the consumer that caused
it. ``localize`` lowers the markers to ``_c10d_functional`` collectives with the same steps.

The step plan (``plan_steps``) is the one place that decides how a change of placements is
carried out; localize executes exactly these steps.
"""

from __future__ import annotations

import math

import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autopar import torch_compat as tc
from autopar.layout import sequence_reason, ulysses_reason
from autopar.ir import CommRecord, Program, ShardSpec, fmt_placements, info, phase_of, redistribute, source_line, spec_of


def plan_steps(src, dst) -> list[tuple[int, object, object]]:
    """(axis, from, to) steps: reductions/gathers innermost axis first, then new shards
    outermost first, so nested shards of one dim stay in DTensor's order. A strided shard
    (``_StridedShard``: a view merged the sharded dim with the dims before it) is only ever made
    from, or turned into, Replicate: any other move to or from one goes through Replicate."""
    src, dst = tuple(src), tuple(dst)
    steps = []
    cur = list(src)
    for a in reversed(range(len(src))):
        if cur[a] != dst[a] and not isinstance(cur[a], Replicate) and (
                isinstance(cur[a], tc.StridedShard) or isinstance(dst[a], tc.StridedShard)):
            steps.append((a, cur[a], Replicate()))
            cur[a] = Replicate()
        if cur[a] != dst[a] and not (isinstance(cur[a], Replicate) and isinstance(dst[a], (Shard, tc.StridedShard))):
            steps.append((a, cur[a], dst[a]))
            cur[a] = dst[a]
    for a in range(len(src)):
        if cur[a] != dst[a]:
            steps.append((a, cur[a], dst[a]))
            cur[a] = dst[a]
    return steps


def step_kind(p, q) -> str:
    if isinstance(p, Partial) and isinstance(q, Replicate):
        return "all_reduce"
    if isinstance(p, Partial) and isinstance(q, Shard):
        return "reduce_scatter"
    if isinstance(p, (Shard, tc.StridedShard)) and isinstance(q, (Replicate, Partial)):
        return "all_gather"
    if isinstance(p, Shard) and isinstance(q, Shard):
        return "all_to_all" if p.dim != q.dim else "local"  # localize: one all-to-all
    return "local"  # Replicate -> Shard or strided shard (chunk), Replicate -> Partial (mask)


def predict_records(spec: ShardSpec, dst, ctx, reason: str, source: str, phase: str,
                    producer: str = "") -> list[CommRecord]:
    records = []
    cur = list(spec.placements)
    for a, p, q in plan_steps(spec.placements, dst):
        kind = step_kind(p, q)
        local = ShardSpec(tuple(cur), spec.shape, spec.dtype).local_shape(ctx.axis_sizes)
        nbytes = math.prod(local) * spec.dtype.itemsize
        if kind != "local" and ctx.axis_sizes[a] > 1:  # a 1-rank axis moves nothing
            records.append(CommRecord(kind, ctx.axis_names[a], ctx.axis_sizes[a], nbytes, reason, source, phase,
                                      producer=producer))
        cur[a] = q
    return records


def collectives_pass(program: Program, ctx) -> Program:
    """After it: every input of every op has the placements the op needs: each mismatch got a
    ``redistribute`` node with its predicted CommRecords, reason and source line."""
    graph = program.graph
    cache: dict[tuple[fx.Node, tuple], fx.Node] = {}
    for n in list(graph.nodes):
        wants = info(n).wants
        if wants is None:
            continue
        if n.op == "output":
            new = [_fix(graph, o, w, n, ctx, cache, _output_reason(role), before=_grad_point(o, n, role, ctx))
                   if isinstance(o, fx.Node) and w is not None else o
                   for o, w, role in zip(n.args[0], wants, program.outputs)]
            n.args = (type(n.args[0])(new),)
            continue
        it = iter(wants)

        def repl(a):
            if isinstance(a, fx.Node):
                w = next(it)
                return _fix(graph, a, w, n, ctx, cache, None) if w is not None else a
            if isinstance(a, (list, tuple)):
                return type(a)(repl(x) for x in a)
            return a

        n.args = tuple(repl(a) for a in n.args)
        n.kwargs = {k: repl(v) for k, v in n.kwargs.items()}
    return program


def _grad_point(o: fx.Node, out: fx.Node, role, ctx) -> fx.Node:
    """Where a gradient's reduction goes: right after the gradient is complete (so it can be
    freed, or overlapped), except under ZeRO-1, which holds gradients whole until the end."""
    if role[0] != "grad" or ctx.plan.zero == 1 or o.op == "placeholder":
        return out
    return o.next


def _output_reason(role) -> str:
    kind, what = role
    if kind == "grad":
        return f"gradient of {what} to its parameter's placement"
    return f"program {kind} {what} replicated"


def _fix(graph, a: fx.Node, want, consumer: fx.Node, ctx, cache, reason, before=None) -> fx.Node:
    have = spec_of(a)
    if have is None or tuple(have.placements) == tuple(want):
        return a
    # under recompute="full" a recomputed op gets its own copy of a communicated value (the
    # forward's copy is freed after the forward: only block inputs are kept); "selective" keeps
    # communicated values like other expensive ones and reuses the forward's copy
    key = (a, tuple(want), ctx.recompute == "full" and bool(info(consumer).recomputed))
    if key in cache:
        return cache[key]
    if reason is None and info(consumer).why:
        reason = info(consumer).why  # a pass said why this consumer needs the layout
    if reason is None:  # a sequence-parallel axis's reduce-scatter out of / all-gather into a region
        reason = sequence_reason(a, have.placements, want, ctx)
    if reason is None:  # a ulysses axis's all-to-all into / out of attention
        reason = ulysses_reason(a, have.placements, want, ctx)
    if reason is None:
        reason = (f"{fmt_placements(have.placements)} -> {fmt_placements(want)} for "
                  f"{getattr(consumer.target, '__name__', consumer.target)} ({consumer.name})")
    src = source_line(consumer) or source_line(a)
    phase = phase_of(consumer) if consumer.op != "output" else "backward" if "gradient" in reason else "forward"
    r = insert_redistribute(graph, a, want, before or consumer, ctx, reason, phase, src,
                            stack=consumer.meta.get("stack_trace"))
    cache[key] = r
    return r


def insert_redistribute(graph, a: fx.Node, want, before: fx.Node, ctx, reason: str, phase: str,
                        src: str = "", stack: str | None = None) -> fx.Node:
    """A ``redistribute`` marker moving ``a`` to ``want``, inserted before ``before``."""
    have = spec_of(a)
    src = src or source_line(before) or source_line(a)
    with graph.inserting_before(before):
        r = graph.call_function(redistribute, (a, tuple(have.placements), tuple(want)))
    r.meta["val"] = a.meta["val"]
    info(r).spec = ShardSpec(tuple(want), have.shape, have.dtype)
    r.meta["stack_trace"] = stack or a.meta.get("stack_trace") or before.meta.get("stack_trace")
    r.meta["partitioner_tag"] = "is_backward" if phase == "backward" else "is_forward"
    info(r).reason = reason
    info(r).producer = source_line(a)
    info(r).predicted = tuple(predict_records(have, want, ctx, reason, src, phase, source_line(a)))
    return r


def predicted_records(program: Program) -> list[CommRecord]:
    """What this pass predicted, before lowering: the CommRecords on the program's global graph's
    redistribute nodes (localize leaves that graph as it is; tests compare these records with the
    collectives of the per-rank program)."""
    return [r for n in program.graph.nodes if n.target is redistribute for r in info(n).predicted]
