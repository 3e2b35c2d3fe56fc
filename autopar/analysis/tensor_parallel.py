"""Megatron's tensor-parallel plan, derived from the captured program (not from layer names).

``derive(gm, model, tp)`` reads the torch-level graph of model + loss (the capture pass's) and
decides, for every parameter, its placement on a tensor-parallel axis of ``tp`` ranks and the
graph fact that decided it:

- **column-parallel**: a matmul with a weight (``linear``, ``addmm``/``mm``/``matmul`` with a
  weight stored either way round: what is contracted decides, not the class; an ``einsum`` that
  keeps one of the weight's letters, as stacked experts ``becd,edf->becf``) whose output
  dim can be followed, op by op, to a matmul with another weight that contracts it, through ops
  that need no communication when that dim is sharded: casts, views that split it into heads
  (the heads dim is then the one sharded), transposes, elementwise ops and activations,
  attention over heads, norms over other dims, ``split`` into parts. Where a view or a split
  needs each of k parts to be split by heads (a fused ``[q | k | v]`` or ``[gate | up]``
  projection), the weight is strided-sharded (DTensor's ``_StridedShard``, split factor k):
  each rank holds its share of every part, never a range crossing a part boundary.
- **row-parallel**: the matmul that contracts that dim (its weight sharded on the contracted
  dim: its output is a partial sum, all-reduced where the residual stream needs it).
- Flows that meet (q, k and v at attention; gate and up at their product) form one region,
  sharded together or not at all.
- **vocabulary-parallel**: a weight matmul whose output dim reaches the loss's class dim
  (``cross_entropy``, ``log_softmax`` + ``nll_loss``): the LM head; an embedding lookup indexed
  by a program input (the tokens). A lookup indexed by values the program computes (positions)
  is replicated.
- Parameters combined elementwise with a sharded value along that dim (a column bias added
  apart, per-head attention sinks) are sharded with it.
- Everything else is replicated, with the reason: the flow that failed (a router's output
  reduced over the sharded dim by softmax, a norm over the whole projected dim, an op autopar
  does not know), norms and biases over the residual stream, positions.

Decisions are returned as data (``Derived``); autopar/plan.py places parameters with them and
the reports print ``why``. Nothing here looks at a module's or parameter's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autopar.analysis.tp_flow import Flow, run_flow
from autopar.analysis.tp_starts import start_of
from autopar.analysis.tp_graph import Fail, Graph, NORM, op_name, pointwise, shape_of, strided, where_of

R = Replicate()
NOT_READ = "not read by the program"  # (a vision tower a text-only batch never reaches)


@dataclass
class Decision:
    placement: Placement
    role: str  # column | row | vocab | with-column | replicated
    why: str


@dataclass
class Derived:
    """Per parameter (the user's name), its placement on the tensor-parallel axis and why."""

    tp: int
    decisions: dict[str, Decision] = field(default_factory=dict)


# --------------------------------------------------------------------------------- regions
def derive(gm: fx.GraphModule, model: torch.nn.Module, tp: int, axis: str = "tp") -> Derived:
    """Every parameter's placement on a ``tp``-rank tensor-parallel axis, from the graph. Two
    passes: Megatron's regions as such; then, for the starts left out, regions that also reduce
    a statistic over the sharded dim (a norm over the whole projected q: one small all-reduce)."""
    g = Graph(gm, model)
    out = Derived(tp)
    failed: dict[str, str] = {}  # weight -> why it is no column
    indivisible: dict[str, str] = {}  # weight -> the dim the axis size does not divide
    used: set[fx.Node] = set()
    for relaxed in (False, True):
        flows = _flows(g, tp, relaxed, used, failed, indivisible)
        _accept(g, flows, used, failed, out)
    _decide_rest(g, out, failed, indivisible)
    left = {n: why for n, why in indivisible.items() if isinstance(out.decisions[n].placement, Replicate)}
    if left:
        from autopar.errors import PlanError

        first = next(iter(left))
        raise PlanError(f"tensor parallelism on mesh axis '{axis}' ({tp} ranks) cannot shard {len(left)} "
                        "parameter(s) that it would shard on an axis whose size divides their dims:\n" + "\n".join(
                            f"    {n} {list(g.shapes[n])}: {why}" for n, why in left.items()),
                        where="the tensor-parallel axis size",
                        fix=f"use a tensor-parallel size that divides them (heads, hidden and vocabulary sizes), or "
                        f"replicate them with plan['rules'], e.g. {{'{first}': {{'tp': 'R'}}}}")
    return out


def _flows(g: Graph, tp: int, relaxed: bool, used: set, failed: dict, indivisible: dict) -> list[Flow]:
    flows = []
    for n in g.nodes:
        start = start_of(g, n) if n.op in ("call_function", "call_method") and n not in used else None
        if start is None:
            continue
        fl, first = _follow(g, n, start, tp, relaxed)
        if fl.fail is not None and first.indivisible:  # parts tried in vain: the axis size was the problem
            fl.fail = first
        if fl.fail is None and not fl.rows and not fl.vocab and not fl.partial:
            fl.fail = Fail("nothing that contracts it back")
        if fl.fail is not None and fl.fail.indivisible and tp > 1 and not relaxed and _holds(g, n, start):
            indivisible.setdefault(fl.weight, fl.fail.why)
        flows.append(fl)
        if fl.fail is not None:
            failed.setdefault(fl.weight, f"not sharded: as a column-parallel weight its output would reach {fl.fail.why}")
    return flows


def _follow(g: Graph, n: fx.Node, start: tuple, tp: int, relaxed: bool = False) -> tuple[Flow, Fail | None]:
    """The flow from ``n``, run again with the split factor a failure asks for (a fused projection's
    parts) until it holds or asks nothing new; and its first failure."""
    wname, out_pdim, bias, out_dim = start
    outer, tried, first = 1, set(), None
    while outer not in tried:
        tried.add(outer)
        fl = Flow(n, wname, out_pdim, bias, outer, out_dim=out_dim, relaxed=relaxed)
        try:
            run_flow(g, fl, tp)
        except Fail as e:
            fl.fail = e
            first = first or e
            if e.outer and e.outer > 1:
                outer *= e.outer
                continue
        break
    return fl, first


def _holds(g: Graph, n: fx.Node, start: tuple) -> bool:
    """The flow from ``n`` holds on an axis whose size divides every dim (tp = 1)."""
    fl, _ = _follow(g, n, start, 1)
    return fl.fail is None and bool(fl.rows or fl.vocab)


def _accept(g: Graph, flows: list[Flow], used: set, failed: dict, out: Derived) -> None:
    """Link the flows that need each other's values into regions; decide every region whose flows
    all hold and whose matmuls no earlier region took."""
    ok = [f for f in flows if f.fail is None]
    parent = {id(f): id(f) for f in ok}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    unmet: dict[int, str] = {}
    holders: dict[fx.Node, list] = {}  # value -> the flows that track it, with its track
    for f in ok:
        for node, t in f.tracks.items():
            holders.setdefault(node, []).append((f, t))
    for f in ok:
        for u, a, t in f.needs:
            other = next((h for h, th in holders.get(a, ()) if h is not f and th == t), None)
            if other is None:
                unmet[id(f)] = (f"not sharded: its output meets a value that is not sharded the same way "
                                f"({op_name(u)}{where_of(u)})")
            else:
                parent[find(id(f))] = find(id(other))
    regions: dict[int, list[Flow]] = {}
    for f in ok:
        regions.setdefault(find(id(f)), []).append(f)
    for r, fs in sorted(regions.items(), key=lambda kv: min(g.index[f.start] for f in kv[1])):
        why = next((unmet[id(f)] for f in fs if id(f) in unmet), None)
        if why is not None:
            for f in fs:
                failed.setdefault(f.weight, why)
            continue
        nodes = {f.start for f in fs} | {row[0] for f in fs for row in f.rows}
        if nodes & used:
            continue
        used |= nodes
        _decide_region(g, fs, out)


def _names(items) -> str:
    items = sorted(set(items))
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def _decide_region(g: Graph, fs: list[Flow], out: Derived) -> None:
    starts = [f.weight for f in fs]
    rows = [row[1] for f in fs for row in f.rows]
    dec = out.decisions
    for f in fs:
        line = where_of(f.start)
        if f.vocab:
            why = f"vocabulary-parallel: its output dim is the classes of {op_name(f.vocab[0])}{where_of(f.vocab[0])}"
            _put(dec, f.weight, Decision(Shard(f.out_pdim), "vocab", why))
            if f.bias:
                _put(dec, f.bias, Decision(Shard(0), "with-column", f"bias of vocabulary-parallel {f.weight}"))
            continue
        facts = "; ".join(f.trail[:3])
        pl = strided(f.out_pdim, f.outer)
        split = f", split into {f.outer} parts, each sharded" if f.outer > 1 else ""
        back = f"; contracted back by {_names(rows)}" if rows else ""
        if not rows and any(f.partial for f in fs):
            u = next(p for f in fs for p in f.partial)
            back = f"; contracted with another sharded value by {op_name(u)}{where_of(u)} (all-reduced there)"
        why = f"column-parallel: output dim sharded{split}{line}" + (f"; {facts}" if facts else "") + back
        _put(dec, f.weight, Decision(pl, "column", why))
        if f.bias:
            _put(dec, f.bias, Decision(strided(0, f.outer), "with-column", f"bias of column-parallel {f.weight}"))
        for node, wname, pdim, o in f.rows:
            _put(dec, wname, Decision(strided(pdim, o), "row",
                                      f"row-parallel: contracts the dim {_names(starts)} shard{where_of(node)}; "
                                      "its output is a partial sum, all-reduced where it is needed whole"))
        for pname, (pdim, o, node) in f.extra.items():
            _put(dec, pname, Decision(strided(pdim, o), "with-column",
                                      f"combined with the sharded values of {f.weight} ({op_name(node)}{where_of(node)})"))


def _put(dec: dict, name: str, d: Decision) -> None:
    """Record ``d``; a parameter two regions want placed differently is replicated, with both reasons."""
    prev = dec.setdefault(name, d)
    if prev.placement != d.placement:
        dec[name] = Decision(R, "replicated", f"used two ways: {prev.why} / {d.why}")


def _decide_rest(g: Graph, out: Derived, failed: dict[str, str], indivisible: dict[str, str]) -> None:
    dec = out.decisions
    first_use: dict[str, fx.Node] = {}
    lookups: dict[str, list[fx.Node]] = {}
    for n in g.nodes:
        for a in n.all_input_nodes:
            pv = g.param_view(a) if n.op in ("call_function", "call_method") else None
            if pv is None:
                continue
            first_use.setdefault(pv[0], n)
            if op_name(n) == "embedding" and (n.args[1] if len(n.args) > 1 else None) is a:
                lookups.setdefault(pv[0], []).append(n)
    for name, uses in lookups.items():
        if name in dec and dec[name].role != "vocab":
            continue
        if all(u.args[0] in g.from_input for u in uses):
            rows = shape_of(uses[0].args[1])[0] if shape_of(uses[0].args[1]) else 0
            if rows % out.tp == 0:
                why = f"vocabulary-parallel lookup: indexed by the program's input{where_of(uses[0])}"
                if name in dec:
                    why = dec[name].why + "; and " + why
                dec[name] = Decision(Shard(0), "vocab", why)
            elif rows < out.tp and name not in dec:  # (RoBERTa's one-row token-type table)
                dec[name] = Decision(R, "replicated", f"a lookup of {rows} row(s), fewer than the {out.tp} ranks: "
                                     f"nothing to split{where_of(uses[0])}")
            elif name not in dec and len(g.shapes[name]) == 2 and g.shapes[name][1] % out.tp == 0:
                # (Moshi's table of vocab + 1 rows): split by its columns instead, the looked-up
                # rows all-gathered where the residual stream needs them whole
                dec[name] = Decision(Shard(1), "column", f"a lookup indexed by the program's input{where_of(uses[0])} "
                                     f"of {rows} rows, which {out.tp} ranks do not divide: split by its "
                                     f"{g.shapes[name][1]} columns, each rank looking up its share of every row")
            else:
                indivisible.setdefault(name, f"a lookup indexed by the program's input (vocabulary-parallel) of {rows} "
                                             f"rows, not divisible by {out.tp}")
                dec.setdefault(name, Decision(R, "replicated", indivisible[name]))
        elif name not in dec:
            dec[name] = Decision(R, "replicated", f"lookup indexed by values the program computes (positions), "
                                 f"not by an input{where_of(uses[0])}")
    for name in g.shapes:
        if name in dec:
            continue
        if name in failed:
            dec[name] = Decision(R, "replicated", failed[name])
            continue
        n = first_use.get(name)
        if n is None:
            dec[name] = Decision(R, "replicated", NOT_READ)
            continue
        what = op_name(n)
        if what in NORM:
            why = f"norm weight over dims no region shards ({what}{where_of(n)})"
        elif what in ("linear", "addmm") and _is_bias(g, n, name):
            why = f"bias added to a whole (reduced) output ({what}{where_of(n)})"
        elif pointwise(what):
            why = f"combined elementwise with a replicated value ({what}{where_of(n)}; e.g. a norm's scale)"
        else:
            why = f"read by {what}{where_of(n)}, which the sharded regions do not reach"
        dec[name] = Decision(R, "replicated", why)


def _is_bias(g: Graph, n: fx.Node, name: str) -> bool:
    b = (n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")) if op_name(n) == "linear" else n.args[0]
    pv = g.param_view(b) if isinstance(b, fx.Node) else None
    return pv is not None and pv[0] == name
