"""Peak bytes of one per-rank program by liveness over its nodes (the cost model's memory walk,
autopar/analysis/cost.py; the measured side is autopar/runtime/memory.py), and the graph-side
definitions both sides share: the memory categories (``categorize``) and which all-reduces run
in place (``reduces_in_place``: the runtime's guarded programs do it, this walk counts it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from autopar.ir import tensor_args

CATEGORIES = ("param_copies", "grads_in_flight", "activations")


def categorize(gm: fx.GraphModule, roles: list[tuple[str, object]], outputs: list[tuple[str, object]]) -> dict[str, str]:
    """node name -> category, from the per-rank graph's structure."""
    cat: dict[str, str] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {n for n, r in zip(placeholders, roles) if r[0] == "param"}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            ins = tensor_args(n)
            if ins and all(a in params or cat.get(a.name) == "param_copies" for a in ins):
                cat[n.name] = "param_copies"
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for o, role in zip(out.args[0], outputs):
        # walk back from a gradient output through single-input ops (casts, views, collectives)
        # to the op that computed it
        while isinstance(o, fx.Node) and role[0] == "grad" and o.op == "call_function":
            cat[o.name] = "grads_in_flight"
            ins = tensor_args(o)
            if len(ins) != 1 and "wait_tensor" not in str(o.target):
                break
            o = ins[0]
    return cat



def reduces_in_place(n: fx.Node) -> bool:
    """An all-reduce whose input is a ``cat`` (a fresh buffer: a gradient bucket) that nothing
    else uses: the guarded program reduces it in place (autopar/runtime/guarded.py
    ``all_reduce_in_place``); the memory walk below folds the two storages the same way."""
    src = n.args[0] if n.args else None
    return (n.op == "call_function" and n.target is torch.ops._c10d_functional.all_reduce.default
            and isinstance(src, fx.Node) and src.op == "call_function" and src.target is torch.ops.aten.cat.default
            and len(src.users) == 1)


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (tensors that alias share it; fake tensors' storages too)."""
    return t.untyped_storage()._cdata


def _storages(val):
    for t in val if isinstance(val, (list, tuple)) else (val,):
        if isinstance(t, torch.Tensor):
            yield storage_key(t), t.untyped_storage().nbytes()


@dataclass
class ProgramMemory:
    peak: int = 0
    at_peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    max_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    peak_node: str = ""
    alive_at_peak: list[tuple[int, str, str]] = field(default_factory=list)  # (bytes, node, category)
    curve: dict[str, int] = field(default_factory=dict)  # node -> bytes alive while it runs
    by_node: list[dict[str, int]] = field(default_factory=list)  # per node, in order: bytes alive by category
    # the most bytes alive at once outside the gradients (activations + parameter copies): the
    # forward-to-backward peak, whatever the gradients do at the end
    peak_without_grads: int = 0
    # bytes by category at the three points that can hold a program's peak at another depth
    # (``branches``): the peak itself, the most bytes outside the gradients (the end of the forward,
    # which grows by one block's saved activations per block) and the most gradients in flight
    # (the end of the backward, which grows by one block's gradients per block)
    branches: dict[str, dict[str, int]] = field(default_factory=dict)


def program_memory(gm: fx.GraphModule, inputs, outputs, held: frozenset = frozenset()) -> ProgramMemory:
    """Peak bytes of the per-rank program by liveness over its nodes (parameters excluded: they
    are persistent state). Mirrors what MemoryTracker measures when the program runs. Inputs are
    freed after their last use: the executor runs every program boxed (it takes its argument
    list over), so nothing outside keeps them (what else holds them, e.g. a pipeline's saved
    activations between parts, the callers add). ``held``: names of nodes whose storages are
    held outside the program, counted by the caller as parameters are (a pipeline's prologue)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    cats = categorize(gm, inputs, outputs)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    params = {n for n, (kind, _) in zip(placeholders, inputs) if kind == "param"}
    persistent = {k for n in params for k, _ in _storages(n.meta.get("val"))}
    persistent |= {k for n in nodes if n.name in held for k, _ in _storages(n.meta.get("val"))}
    # storage -> [first index, last index, bytes, category, defining node]
    live: dict[int, list] = {}
    for n in nodes:
        if n.op == "output" or n in params:
            continue
        val = n.meta.get("val")
        if val is None:
            continue
        i = index[n]
        last = max((index[u] for u in n.users), default=i)
        if n.op == "placeholder" and not n.users:
            last = i
        for key, nbytes in _storages(val):
            if key in persistent or nbytes == 0:
                continue
            if key not in live:
                live[key] = [i, last, nbytes, cats.get(n.name, "activations"), n.name]
            else:
                rec = live[key]
                rec[1] = max(rec[1], last)
                rec[2] = max(rec[2], nbytes)
    # a collective's output is waited for by wait_tensor, whose fake value is a new storage that
    # at runtime is the same tensor: fold the two
    for n in nodes:
        if n.op == "call_function" and "wait_tensor" in str(n.target):
            src = n.args[0]
            ks = [k for k, _ in _storages(src.meta.get("val"))]
            kd = [k for k, _ in _storages(n.meta.get("val"))]
            if ks and kd and ks[0] != kd[0] and ks[0] in live and kd[0] in live:
                a, b = live[ks[0]], live.pop(kd[0])
                a[1] = max(a[1], b[1])
    # a gradient bucket (an all-reduce of a cat nothing else reads) is reduced in place by the
    # guarded program that runs by default (runtime/guarded.py): one storage, not two
    for n in nodes:
        if n.op == "call_function" and reduces_in_place(n):
            ks = [k for k, _ in _storages(n.args[0].meta.get("val"))]
            kd = [k for k, _ in _storages(n.meta.get("val"))]
            if ks and kd and ks[0] != kd[0] and ks[0] in live and kd[0] in live:
                a, b = live[ks[0]], live.pop(kd[0])
                a[1] = max(a[1], b[1])
    delta = [dict.fromkeys(CATEGORIES, 0) for _ in range(len(nodes) + 1)]
    for first, last, nbytes, cat, _ in live.values():
        delta[first][cat] += nbytes
        delta[last + 1][cat] -= nbytes
    out = ProgramMemory()
    cur = dict.fromkeys(CATEGORIES, 0)
    for i in range(len(nodes)):
        for c in CATEGORIES:
            cur[c] += delta[i][c]
            out.max_by[c] = max(out.max_by[c], cur[c])
        total = sum(cur.values())
        out.curve[nodes[i].name] = total
        out.by_node.append(dict(cur))
        out.peak_without_grads = max(out.peak_without_grads, total - cur["grads_in_flight"])
        if total > out.peak:
            out.peak, out.at_peak, out.peak_node = total, dict(cur), nodes[i].name
    peak_at = index[next(n for n in nodes if n.name == out.peak_node)] if out.peak_node else None
    return summarize(out, live, peak_at)


def summarize(out: ProgramMemory, live: dict, peak_at: int | None) -> ProgramMemory:
    """Fill ``out``'s branches (the categories at the peak, where activations and where gradients
    in flight are largest) from its per-step curve ``by_node``, and the values alive at the peak
    step ``peak_at`` from ``live`` (key -> [first, last, bytes, category, name])."""
    if out.by_node:
        totals = [sum(b.values()) for b in out.by_node]
        act = max(range(len(totals)), key=lambda i: (totals[i] - out.by_node[i]["grads_in_flight"], totals[i]))
        grads = max(range(len(totals)), key=lambda i: (out.by_node[i]["grads_in_flight"], totals[i]))
        out.branches = {"peak": dict(out.at_peak), "activations": dict(out.by_node[act]),
                        "gradients": dict(out.by_node[grads])}
    if peak_at is not None:
        out.alive_at_peak = sorted(((b, name, c) for f, last, b, c, name in live.values() if f <= peak_at <= last),
                                   reverse=True)
    return out


def peak_in_depth(mems: list[ProgramMemory], depths: tuple[int, ...], layers: int) -> dict[str, dict[str, int]]:
    """A program's peak at ``layers`` identical blocks from the same program compiled at ``depths``
    (two or more, equally spaced): each of the three points that can hold it (``branches``)
    carried along its own line, the largest taken. One line through the peaks would not do: at a
    few blocks the end of the backward can hold the peak (the gradients of a bf16 fsdp program:
    Llama-3-8B dp=8 x tp=8 peaks at 2.0 GiB there at 1-3 blocks) while at 32 blocks the end of the
    forward does (4.7 GiB, growing 10 times faster per block). Returns ``{"at_peak": bytes by
    category at the predicted peak, "max_by": each category's most}``."""
    step = (layers - depths[0]) / (depths[1] - depths[0])

    def line(a: dict, b: dict) -> dict:
        return {c: round(a[c] + step * (b[c] - a[c])) for c in a}

    carried = {k: line(mems[0].branches[k], mems[1].branches[k]) for k in mems[0].branches}
    at_peak = max(carried.values(), key=lambda cats: sum(cats.values()))
    max_by = line(mems[0].max_by, mems[1].max_by)
    return {"at_peak": at_peak, "max_by": {c: max(max_by[c], at_peak[c]) for c in max_by}}
