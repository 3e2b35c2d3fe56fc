"""gather: parameter all-gathers grouped per block and issued ahead of use (called by the overlap
pass, before gradient reductions are bucketed).

Under ZeRO-1/2/3 (FSDP) ``localize`` gathers each parameter on its own, just before its first
use, and waits at once: one collective per parameter per phase, and the compute stalls for each.
FSDP2 gathers per block (one flat all-gather per ``fully_shard`` unit) and prefetches: the next
block's gather is issued when the current block starts, so it arrives while the current block
computes. This step does the same on the per-rank graph:

- a *parameter gather* is an ``all_gather_into_tensor`` whose input is a parameter placeholder
  through local unary ops only (its mixed-precision cast, a layout move for a sharded dim other
  than 0): nothing computed from activations, so it can be issued as early as wanted;
- gathers are grouped in graph order into runs of the same block (``layers.3``; the parameters
  outside every block form runs of their own, so the embedding is gathered at the start and the
  LM head at the end, not both at the start), phase, process group, dtype and group size;
- a run of two or more becomes ONE all-gather of one flat buffer (each rank's shards
  concatenated), and each parameter is copied out of the result (FSDP2's copy-out), right
  after the bucket's wait, which sits where the run's first wait was (the block's first use);
- ``prefetch=d`` (compile option, default 1 like FSDP2; 0: off): bucket ``k`` is issued right
  after bucket ``k-d``'s wait, i.e. when block ``k-d`` starts computing, so it is on the wire
  while ``d`` blocks compute; the first ``d`` are issued where their first gather was. In the
  backward the graph order is the reverse block order, so the same rule is FSDP2's backward
  prefetch of the previous block. A gather is never moved into another phase (the forward /
  backward boundary is where a pipeline stage's program is cut into parts).
- with ``prefetch=1`` at most one all-gather is in flight per process group: bucket ``k`` is
  issued after bucket ``k-1``'s wait, and not moved over any other all-gather of its group. On
  gloo this is required, not only tidy: torch 2.13's functional ``all_gather_into_tensor`` with
  two or more in flight on one gloo group corrupts the heap (SIGSEGV / "malloc(): unaligned
  tcache chunk" within a few thousand calls, any dtype; reduce-scatters, all-reduces and
  ``dist.all_gather_into_tensor(async_op=True)`` in flight the same way survive), so
  ``compile`` refuses ``prefetch > 1`` on a gloo mesh.

Memory: at most ``d`` blocks' gathered parameters more than without prefetch (FSDP2's cost), plus
each bucket's flat result until its copy-outs. The cost model's liveness walk over the per-rank
graph sees both: it reads this graph.

After it: every collective still has one wait and a CommRecord (a bucket's: the bytes of its
parameters summed, their names in the reason); each gathered parameter has the value and local
shape its own wait had; collectives on one process group are issued in the same order on every
rank (the graph is the same program on every rank of a group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autopar.ir import info
from autopar.modpath import block_of
from autopar.passes.bucket import _contiguous, _emit, _record
from autopar.passes.localize import c10d

aten = torch.ops.aten
DEFAULT_PREFETCH = 1  # FSDP2's: one block ahead
# unary local ops that may lie between a parameter placeholder and its gather (they move with it)
MOVABLE = {aten._to_copy.default, aten.view.default, aten.clone.default, aten.permute.default,
           aten.t.default, aten.alias.default, aten.transpose.int, aten.reshape.default}


@dataclass
class Gather:
    """One parameter's all-gather, as localize emitted it."""

    coll: fx.Node
    wait: fx.Node
    chain: list[fx.Node]  # the local ops from the placeholder to the gather's input, in order
    name: str  # the parameter
    key: tuple  # (phase, block, process group, dtype, group size): what one bucket shares


def parameter_gathers(gm: fx.GraphModule, roles) -> list[Gather]:
    """Every all-gather of a parameter (through MOVABLE ops only), in graph order."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param = {n: what for n, (kind, what) in zip(placeholders, roles) if kind == "param"}
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not c10d.all_gather_into_tensor.default:
            continue
        if len(n.users) != 1 or info(n).comm is None or not isinstance(n.args[0], fx.Node):
            continue
        wait = next(iter(n.users))
        if wait.target is not c10d.wait_tensor.default:
            continue
        chain, x = [], n.args[0]
        while x.op == "call_function" and x.target in MOVABLE and len(x.all_input_nodes) == 1:
            chain.append(x)
            x = x.all_input_nodes[0]
        if x not in param:
            continue
        _, size, group = n.args
        val = n.args[0].meta["val"]
        key = (info(n).comm.phase, block_of(param[x]), group, val.dtype, size)
        found.append(Gather(n, wait, chain[::-1], param[x], key))
    return found


def runs(gathers: list[Gather]) -> list[list[Gather]]:
    """Maximal runs of consecutive gathers (graph order) with one key."""
    out: list[list[Gather]] = []
    for g in gathers:
        if out and out[-1][-1].key == g.key:
            out[-1].append(g)
        else:
            out.append([g])
    return out


def bucket_parameter_gathers(gm: fx.GraphModule, roles, prefetch: int = DEFAULT_PREFETCH,
                             bucket: bool = True, recompile: bool = True) -> list[list[str]]:
    """After it: ``gm``'s parameter gathers are bucketed per run (``bucket=False``: one per
    parameter, still prefetched) and issued ``prefetch`` buckets ahead. Returns the parameter
    names of each bucket, in issue order."""
    gathers = parameter_gathers(gm, roles)
    if not gathers or (not bucket and not prefetch):
        return []
    buckets = runs(gathers) if bucket else [[g] for g in gathers]
    graph = gm.graph
    waits: list[fx.Node] = []
    last: fx.Node | None = None  # the collective issued last
    for k, b in enumerate(buckets):
        pos = {n: i for i, n in enumerate(graph.nodes)}
        phase = b[0].key[0]
        first_wait = min((g.wait for g in b), key=pos.__getitem__)
        own = min((g.chain[0] if g.chain else g.coll for g in b), key=pos.__getitem__)
        if prefetch and k >= prefetch and buckets[k - prefetch][0].key[0] == phase:
            issue_at = waits[k - prefetch].next  # right after bucket k-d's wait: when that block starts
        elif prefetch and k and buckets[k - 1][0].key[0] == phase:
            issue_at = last.next  # one of a phase's first d buckets: right after the one before it
        else:
            issue_at = own
        if pos[issue_at] > pos[own]:  # never later than it was
            issue_at = own
        if prefetch == 1 and issue_at is not own and _other_gather_between(graph, b, issue_at, first_wait):
            issue_at = own  # one all-gather in flight per process group (gloo needs it: module docstring)
        if issue_at is own:  # the inputs' own ops stay where they are; the gather goes after them
            issue_at = min((g.coll for g in b), key=pos.__getitem__)
        for g in b:  # the inputs (casts, layout moves of a placeholder) are computed at the issue point
            for node in g.chain:
                if pos[node] > pos[issue_at]:
                    issue_at.prepend(node)
        if len(b) == 1:
            g = b[0]
            if pos[g.coll] > pos[issue_at]:
                issue_at.prepend(g.coll)
            waits.append(g.wait)
            last = g.coll
            continue
        wait = _rewrite(graph, b, issue_at, first_wait)
        waits.append(wait)
        last = wait.args[0]
    if recompile:  # (False: the caller regenerates the code and lints the graph itself)
        graph.lint()
        gm.recompile()
    return [[g.name for g in b] for b in buckets]


def _other_gather_between(graph: fx.Graph, bucket: list[Gather], start: fx.Node, end: fx.Node) -> bool:
    """Whether an all-gather on the bucket's process group other than its own members lies
    between ``start`` and ``end``."""
    mine = {g.coll for g in bucket}
    group = bucket[0].key[2]
    n = start
    while n is not end and n.op != "output":
        if n.target is c10d.all_gather_into_tensor.default and n not in mine and n.args[-1] == group:
            return True
        n = n.next
    return False


def _rewrite(graph: fx.Graph, bucket: list[Gather], issue_at: fx.Node, first_wait: fx.Node) -> fx.Node:
    """One bucket: flat buffer and one all-gather before ``issue_at``; one wait before
    ``first_wait``; then every parameter copied out of the result. Returns the new wait."""
    _, _, group, _, world = bucket[0].key
    names = [g.name for g in bucket]
    first = bucket[0].coll
    with graph.inserting_before(issue_at):
        pieces = [_emit(graph, aten.view.default, (_contiguous(graph, g.coll.args[0], g.coll), [-1]), g.coll)
                  for g in bucket]
        flat = _emit(graph, aten.cat.default, (pieces,), first)
        coll = _emit(graph, c10d.all_gather_into_tensor.default, (flat, world, group), first)
    _record(coll, [g.coll for g in bucket], names, "parameters")
    with graph.inserting_before(first_wait):
        wait = _emit(graph, c10d.wait_tensor.default, (coll,), first, val=torch.empty_like(coll.meta["val"]))
        rows = _emit(graph, aten.view.default, (wait, [world, -1]), first)
        start = 0
        outs = []
        for g in bucket:
            shard = g.coll.args[0].meta["val"]
            end = start + shard.numel()
            origin = (g.wait.meta.get("custom") or {}).get("autopar_origin", "")
            cols = _emit(graph, aten.slice.Tensor, (rows, 1, start, end), g.wait)
            own = _emit(graph, aten.clone.default, (cols,), g.wait, kwargs={"memory_format": torch.contiguous_format})
            outs.append(_emit(graph, aten.view.default, (own, list(g.wait.meta["val"].shape)), g.wait, origin))
            start = end
    for g, o in zip(bucket, outs):
        g.wait.replace_all_uses_with(o)
        graph.erase_node(g.wait)
        graph.erase_node(g.coll)
    return wait

