"""overlap: when each collective's wait runs, and the buffer lifetimes that makes safe.

localize leaves every ``wait_tensor`` right after its collective (a synchronous program).
Functional collectives run asynchronously until their wait, so moving a wait later lets the
compute in between run while the bytes are on the wire; DDP's reducer and FSDP2 overlap the
same way. Today this pass defers the waits of gradient reductions (below); bucketing, FSDP
prefetch and moving collective starts earlier come with the overlap issue, here.

After it, on the per-rank graphs: every collective still has exactly one wait, every wait
comes before the first use of its result, and every input a collective may still read or
write (gloo's reduce-scatter writes its input) stays alive until the wait.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.ir import Program
from autopar.passes.localize import COLLECTIVES, c10d


def overlap_pass(program: Program, ctx) -> Program:
    """After it: gradient reductions are waited for as late as their use allows (all-reduce at
    the end, reduce-scatter before the next one), and every collective's input stays alive
    until its wait."""
    for gm in _local_graphs(program):
        _defer_output_waits(gm)
        _keep_inputs_until_wait(gm)
    return program


def _local_graphs(program: Program):
    return [program.local] if getattr(program, "local", None) is not None else []


_PASS_THROUGH = {torch.ops.aten._to_copy.default, torch.ops.aten.view.default, torch.ops.aten.t.default,
                 torch.ops.aten.cat.default, torch.ops.aten.clone.default}


def _defer_output_waits(gm: fx.GraphModule) -> None:
    """Waits for gradient reductions move later, so the rest of the backward runs while the
    gradient is on the wire (functional collectives are asynchronous until ``wait_tensor``;
    DDP's reducer and FSDP2 overlap the same way). The wait and the local ops after it (the fp32
    cast of a bf16-reduced gradient, a layout fix-up) move together:

    - all-reduce (DDP, tp): to the end of the program; it reduces a copy of its input, and its
      output is a program output anyway, so this costs no memory;
    - reduce-scatter (ZeRO): to just before the next reduce-scatter is issued, so one is in
      flight at a time and a whole gradient is freed one layer later, not at the end (ZeRO-2/3
      never hold all gradients whole).
    """
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    issued = [n for n in graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]
    nxt = {a: b for a, b in zip([n for n in issued if COLLECTIVES[n.target] == "reduce_scatter"],
                                [n for n in issued if COLLECTIVES[n.target] == "reduce_scatter"][1:])}
    moves = []
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not c10d.wait_tensor.default:
            continue
        coll = n.args[0]
        kind = COLLECTIVES.get(getattr(coll, "target", None))
        if kind not in ("all_reduce", "reduce_scatter"):
            continue
        chain, cur = [n], n
        while len(cur.users) == 1 and all(u.op == "call_function" and u.target in _PASS_THROUGH for u in cur.users):
            cur = next(iter(cur.users))
            chain.append(cur)
        if not cur.users or not all(u is out for u in cur.users):
            continue
        moves.append((chain, out if kind == "all_reduce" else nxt.get(coll, out)))
    for chain, before in moves:
        for node in chain:
            before.prepend(node)
    if moves:
        graph.lint()
        gm.recompile()


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
    gm.recompile()
