"""The cut of a pipeline stage's per-rank joint program into the parts its schedule runs (the
schedule pass calls it; passes/split.py's docstring, step 4): ``F`` (what the stage's outputs
need), ``I`` (what its input gradients need beyond F), ``W`` (the rest: weight gradients), and
``P``, the prologue run once per step; with the bytes a micro-batch holds between them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autopar import torch_compat as tc


@dataclass
class Part:
    """One of a stage's three graphs (F, I, W): reads ``args`` (names of the joint program's
    placeholders or of values earlier parts produced), writes ``outs``."""

    name: str
    gm: fx.GraphModule | None
    args: list[str]
    outs: list[str]
    nodes: int = 0
    members: frozenset = frozenset()  # the names of the joint program's nodes it runs


def partition(gm: fx.GraphModule, roles: list[tuple], in_roles: list[tuple] | None = None,
              gathers_once: bool = False) -> dict[str, Part]:
    """Split a stage's per-rank joint program into F (everything its activations / loss need),
    I (what its input gradients need beyond F) and W (what its weight gradients need beyond
    both). Collectives go with the values they produce; recomputed values land in I/W.

    With ``in_roles`` (the program's input roles) also P, the prologue, run once per step: the
    values made from parameters and buffers alone by local ops (no collective, nothing random)
    that one part hands to another, e.g. the compute-dtype casts of the weights under mixed
    precision, which the backward reads; with their parameter-only ancestors. Per micro-batch
    they would be made again by every forward and held by every micro-batch in flight.
    ``gathers_once`` (ZeRO-1/2, whose parameters are gathered once per step): their all-gathers
    and waits join the prologue too."""
    nodes = list(gm.graph.nodes)
    out = nodes[-1]
    outs = list(out.args[0])

    def targets(kinds):
        return [o for o, r in zip(outs, roles) if r[0] in kinds and isinstance(o, fx.Node)]

    def ancestors(ts, exclude):
        seen: set[fx.Node] = set()
        stack = list(ts)
        while stack:
            n = stack.pop()
            if n in seen or n in exclude or n.op == "placeholder":
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        return seen

    f = ancestors(targets(("act", "loss")), set())
    i = ancestors(targets(("input_grad",)), f)
    w = ancestors(targets(("grad",)), f | i)
    p = _prologue(nodes, in_roles, [f, i, w], gathers_once) if in_roles is not None else set()
    f, i, w = f - p, i - p, w - p
    groups = [("P", p), ("F", f), ("I", i), ("W", w)] if p else [("F", f), ("I", i), ("W", w)]
    needed_by_later: list[set[fx.Node]] = []
    for k, (_, g) in enumerate(groups):
        later = set()
        for _, h in groups[k + 1:]:
            for n in h:
                later.update(a for a in n.all_input_nodes if a in g)
        later.update(o for o in outs if isinstance(o, fx.Node) and o in g)
        needed_by_later.append(later)
    parts = {}
    for (name, g), later in zip(groups, needed_by_later):
        if not g:
            parts[name] = Part(name, None, [], [])
            continue
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        args = []
        for n in nodes:
            if n not in g:
                continue
            for a in n.all_input_nodes:
                if a not in env and a not in g:
                    ph = graph.placeholder(a.name)
                    ph.meta.update({k: a.meta[k] for k in ("val", "autopar") if k in a.meta})
                    env[a] = ph
                    args.append(a.name)
            env[n] = graph.node_copy(n, env.__getitem__)
        keep = [n for n in nodes if n in later]
        graph.output(tuple(env[n] for n in keep))
        parts[name] = Part(name, tc.graph_module(gm, graph), args, [n.name for n in keep], len(g),
                           frozenset(n.name for n in g))
    return parts


def _prologue(nodes: list[fx.Node], in_roles: list[tuple], groups: list[set], gathers_once: bool) -> set[fx.Node]:
    """The nodes ``partition`` runs once per step (see there)."""
    state = {n for n, r in zip((n for n in nodes if n.op == "placeholder"), in_roles) if r[0] in ("param", "buffer")}
    only: set[fx.Node] = set()  # made from parameters / buffers alone, locally, deterministically
    for n in nodes:
        target = str(n.target)
        comm_ok = "c10d" not in target or (gathers_once and ("all_gather_into_tensor" in target
                                                              or "wait_tensor" in target))
        if n.op == "get_attr":
            only.add(n)
        elif (n.op == "call_function" and n.all_input_nodes and comm_ok
              and torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ())
              and all(a in only or a in state for a in n.all_input_nodes)):
            only.add(n)
    group_of = {n: k for k, g in enumerate(groups) for n in g}
    crossing = {n for n in only if n in group_of and any(group_of.get(u, group_of[n]) != group_of[n] for u in n.users)}
    out: set[fx.Node] = set()
    stack = list(crossing)
    while stack:  # with their parameter-only ancestors
        n = stack.pop()
        if n in out or n not in only or n.op == "get_attr":
            continue
        out.add(n)
        stack.extend(n.all_input_nodes)
    return out


def _prologue_bytes(gm: fx.GraphModule, roles, part: Part | None) -> int:
    """Bytes of the distinct storages the prologue's outputs hold (views of parameters and
    buffers do not count): held from the step's start to its end."""
    from autopar.analysis.cost import _storages

    if part is None or part.gm is None:
        return 0
    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    seen = {sid for n, (kind, _) in zip(placeholders, roles) if kind in ("param", "buffer")
            for sid, _ in _storages(n.meta.get("val"))}
    total = 0
    for name in part.outs:
        for sid, nbytes in _storages(nodes[name].meta.get("val")):
            if sid not in seen:
                seen.add(sid)
                total += nbytes
    return total


def _saved_bytes(gm: fx.GraphModule, roles, parts: dict[str, Part], after: str = "F") -> int:
    """Bytes of the distinct storages a micro-batch holds between its parts, from the trace's fake
    tensors: ``after="F"``: what F leaves for I and W (the stage's activations in flight);
    ``after="I"``: what W still needs (with the output gradients). Views of parameters and
    buffers do not count."""
    from autopar.analysis.cost import _storages

    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state = {sid for n, (kind, _) in zip(placeholders, roles) if kind in ("param", "buffer")
             for sid, _ in _storages(n.meta.get("val"))}
    skip = {n.name for n, (kind, _) in zip(placeholders, roles) if kind in ("param", "buffer")}
    skip |= set(parts["P"].outs) if "P" in parts else set()  # the prologue's: once per step, not per micro-batch
    if after == "F":
        skip |= {n.name for n, (kind, _) in zip(placeholders, roles) if kind == "tangent"} | set(parts["I"].outs)
        names = set(parts["I"].args) | set(parts["W"].args)
    else:
        names = set(parts["W"].args)
    seen, total = set(state), 0
    for name in sorted(names - skip):
        for sid, nbytes in _storages(nodes[name].meta.get("val")):
            if sid not in seen:
                seen.add(sid)
                total += nbytes
    return total

