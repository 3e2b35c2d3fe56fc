"""overlap: how many collectives the gradients take, when each wait runs, and the buffer
lifetimes that makes safe.

localize leaves one collective per gradient and every ``wait_tensor`` right after its
collective (a synchronous program). This pass, in order:

0. gathers parameters per block and ahead of use (passes/gather.py): under ZeRO/FSDP the
   gathers of one block's parameters share ONE all-gather of one flat buffer, issued
   ``prefetch`` blocks ahead (compile option, default 1 like FSDP2; 0: where first used);
1. buckets the gradient reductions (passes/bucket.py): gradients in backward order share one
   flat buffer and ONE all-reduce / reduce-scatter per ``bucket_mb`` MiB (DDP's 25 by default,
   the first bucket 1 MiB; 0: one collective per gradient), issued where the bucket's last
   gradient is produced, never mixing mesh axes, reduce ops or dtypes (a reduce-scatter bucket
   stays within one repeated block, FSDP2's unit);
2. defers the waits of gradient reductions (below): functional collectives run asynchronously
   until their wait, so the compute in between runs while the bytes are on the wire; DDP's
   reducer and FSDP2 overlap the same way;
3. issues the other all-reduces / all-to-alls (tensor parallelism's) right after their input is
   made, a small all-reduce of the batch alone (the loss's token count) at the program's start,
   and moves their waits down to their first use;
4. keeps every collective's input alive until its wait.

After it, on the per-rank graphs: every collective still has exactly one wait and a CommRecord
(a bucket's: its gradients' bytes summed, their names in the reason), every wait comes before
the first use of its result, and every input a collective may still read or write (gloo's
reduce-scatter writes its input) stays alive until the wait.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar import torch_compat as tc
from autopar.ir import Program, info
from autopar.passes.bucket import PASS_THROUGH, bucket_gradient_reductions
from autopar.passes.gather import bucket_parameter_gathers
from autopar.passes.localize import COLLECTIVES, c10d


def overlap_pass(program: Program, ctx) -> Program:
    """After it: ZeRO parameter gathers are one per block and issued ``prefetch`` blocks ahead,
    gradient reductions are bucketed (``bucket_mb`` MiB per collective) and waited
    for as late as their use allows (all-reduce at the end, reduce-scatter before the next
    one), and every collective's input stays alive until its wait."""
    bucket_mb, prefetch = ctx.bucket_mb, ctx.prefetch
    for gm in _local_graphs(program):
        bucket_parameter_gathers(gm, program.inputs, prefetch, bucket=bool(bucket_mb), recompile=False)
        bucket_gradient_reductions(gm, program.outputs, bucket_mb, recompile=False)
        _defer_output_waits(gm)
        _issue_early(gm)
        _issue_batch_statistics_first(gm, program.inputs)
        _defer_waits_to_first_use(gm)
        _keep_inputs_until_wait(gm)
        gm.graph.lint()  # once for all the steps above: regenerating a large program's code costs
        gm.recompile()  # about a second
    return program


def _local_graphs(program: Program):
    return [program.local] if program.local is not None else []


def _defer_output_waits(gm: fx.GraphModule) -> None:
    """Waits for gradient reductions move later, so the rest of the backward runs while the
    gradient is on the wire (functional collectives are asynchronous until ``wait_tensor``;
    DDP's reducer and FSDP2 overlap the same way). The wait and the local ops after it (the fp32
    cast of a bf16-reduced gradient, a layout fix-up; a bucket's slices and views) move together:

    - all-reduce (DDP, tp; the step's loss summed over the data-parallel ranks): to the end of
      the program; it reduces a copy of its input, and its output is a program output anyway,
      so this costs no memory (the loss's all-reduce then runs during the backward instead of
      holding every rank at the end of the forward);
    - reduce-scatter (ZeRO): to just before the next reduce-scatter is issued, so one is in
      flight at a time and a whole gradient is freed one layer later, not at the end (ZeRO-2/3
      never hold all gradients whole).
    """
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    issued = [n for n in graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]
    nxt = {a: b for a, b in zip([n for n in issued if COLLECTIVES[n.target] == "reduce_scatter"],
                                [n for n in issued if COLLECTIVES[n.target] == "reduce_scatter"][1:])}
    pos = {n: i for i, n in enumerate(graph.nodes)}
    moves = []
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not c10d.wait_tensor.default:
            continue
        coll = n.args[0]
        kind = COLLECTIVES.get(getattr(coll, "target", None))
        if kind not in ("all_reduce", "reduce_scatter"):
            continue
        chain = _after_wait(n, out, pos)
        before = out if kind == "all_reduce" else nxt.get(coll, out)
        # what the moved ops read besides each other must exist where they land
        if chain is None or any(pos[a] >= pos[before] for c in chain for a in c.all_input_nodes
                                if a not in chain):
            continue
        moves.append((chain, before))
    for chain, before in moves:
        for node in chain:
            before.prepend(node)


def _issue_early(gm: fx.GraphModule) -> None:
    """Each all-reduce and all-to-all (tensor parallelism's partial sums, Ulysses' swaps) is
    issued right after the op that produces its input, not where localize put it (just before
    the consumer that wanted the new layout): the ops in between then run while it is on the
    wire. Only the collective moves; every rank runs the same program, so the order of
    collectives on each process group stays the same on every rank."""
    graph = gm.graph
    for c in list(graph.nodes):
        if c.op != "call_function" or COLLECTIVES.get(c.target) not in ("all_reduce", "all_to_all"):
            continue
        x = c.args[0]
        if not isinstance(x, fx.Node) or x.op == "placeholder" or x.next is c:
            continue
        x.append(c)


def _issue_batch_statistics_first(gm: fx.GraphModule, inputs) -> None:
    """A small all-reduce computed from the batch alone (the loss's count of target tokens: a
    mean over the global batch divides by it, and the backward's first op needs it) is issued at
    the start of the program, its ops with it, instead of between the forward and the backward:
    there every rank would wait for the slowest to finish its forward before any could start its
    backward (a synchronisation DDP's local mean does not have). Its wait stays at the first use.
    Only ops of the batch's placeholders and constants, deterministic, no collective among them;
    every rank runs the same program, so the order of collectives stays the same on every rank."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders or inputs is None:
        return
    data = {n for n, (kind, _) in zip(placeholders, inputs) if kind == "input"}
    pos = {n: i for i, n in enumerate(graph.nodes)}
    anchor = placeholders[-1]
    moved: set[fx.Node] = set()  # (two statistics may share ops: XLM's two asserts on one lengths.max())
    for c in list(graph.nodes):
        if c.op != "call_function" or COLLECTIVES.get(c.target) != "all_reduce":
            continue
        val = c.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() > 64 or not isinstance(c.args[0], fx.Node):
            continue
        chain, todo, ok = set(), [c.args[0]], True
        while todo and ok:
            n = todo.pop()
            if n in chain or n in data:
                continue
            target = n.target
            ok = (n.op == "call_function" and isinstance(target, tc.OpOverload) and target not in COLLECTIVES
                  and target is not c10d.wait_tensor.default and not target._schema.is_mutable
                  and torch.Tag.nondeterministic_seeded not in target.tags)
            chain.add(n)
            todo += [a for a in n.all_input_nodes]
        if not ok or not chain:
            continue
        for n in sorted(chain - moved, key=pos.__getitem__) + [c]:
            anchor.append(n)
            anchor = n
            moved.add(n)


def _defer_waits_to_first_use(gm: fx.GraphModule) -> None:
    """The remaining all-reduce and all-to-all waits (tensor parallelism's, the loss statistics',
    Ulysses') move down to just before the first op that reads their result, so the ops in
    between that do not need it run while it is on the wire: in a column-parallel linear's
    backward, the weight's gradient (dY^T X) is computed while dX is all-reduced. Moving a wait
    later never breaks an input (its only input is its collective) and costs no memory (the
    result is allocated when the collective is issued). All-gathers and reduce-scatters keep the
    places steps 0-2 gave them (one all-gather in flight per group on gloo: passes/gather.py)."""
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    moves = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not c10d.wait_tensor.default or not n.users:
            continue
        if COLLECTIVES.get(getattr(n.args[0], "target", None)) not in ("all_reduce", "all_to_all"):
            continue
        first = min(n.users, key=pos.__getitem__)
        if pos[first] > pos[n] + 1:
            moves.append((n, first))
    for wait, first in moves:
        first.prepend(wait)


def _after_wait(wait: fx.Node, out: fx.Node, pos) -> list[fx.Node] | None:
    """The wait and the local ops (PASS_THROUGH, or elementwise on small values: the loss's
    division by the global token count) that lead from it only to the program's outputs, in graph
    order; None if anything else reads them, or nothing reaches the outputs."""
    group, todo = {wait}, [wait]
    while todo:
        for u in todo.pop().users:
            if u is out or u in group:
                continue
            if u.op != "call_function" or (u.target not in PASS_THROUGH and not _small_pointwise(u)):
                return None
            group.add(u)
            todo.append(u)
    if not any(out in g.users for g in group):
        return None
    return sorted(group, key=pos.__getitem__)


SMALL = 4096  # elements: a value this small costs nothing to keep until the program's end


def _small_pointwise(n: fx.Node) -> bool:
    """An elementwise op on small values only (the step's loss divided by the global token count):
    moved to the end of the program with a wait, it keeps nothing large alive any longer."""
    tags = getattr(n.target, "tags", ())
    if torch.Tag.pointwise not in tags:
        return False
    vals = [n.meta.get("val")] + [a.meta.get("val") for a in n.all_input_nodes]
    return all(isinstance(v, torch.Tensor) and v.numel() <= SMALL for v in vals)


def _keep_inputs_until_wait(gm: fx.GraphModule) -> None:
    """A collective may read (and, in gloo's reduce-scatter, write) its input until it is waited
    for: an ``alias`` of the input right after the wait keeps the input alive that long (the
    generated code frees every value after its last use). All-reduce works on a copy."""
    graph = gm.graph
    for n in list(graph.nodes):
        # functional all_reduce reduces a copy of its input: nothing to keep
        if (n.op == "call_function" and n.target in COLLECTIVES and COLLECTIVES[n.target] != "all_reduce"
                and isinstance(n.args[0], fx.Node)):
            wait = next((u for u in n.users if u.target is c10d.wait_tensor.default), None)
            if wait is None or n.args[0].op == "placeholder":
                continue
            with graph.inserting_after(wait):
                keep = graph.call_function(torch.ops.aten.alias.default, (n.args[0],))
            keep.meta["val"] = n.args[0].meta.get("val")
            info(keep).keep = True  # read by nothing on purpose (passes/checks.py: not dangling)
