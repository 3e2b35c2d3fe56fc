"""recompute: activation checkpointing decisions on the joint graph (after propagate).

The joint graph holds forward and backward; a forward value used by the backward stays alive
from its forward op to its last backward use. This pass decides which of those values are
kept and which are recomputed: a recomputed value gets a copy of its forward op (and of every
recomputed input it needs) inserted just before its first backward use, tagged backward, so
the passes after this one communicate and count it like any other backward op. A copy keeps the
original's placements (its inputs are the same values or copies of them).

Policies (``autopar.compile(..., recompute=...)``):

- ``"none"``: keep everything.
- ``"full"``: inside each repeated block (a module path ending in a list index, e.g.
  ``layers.3``), keep only what the block hands to later forward ops (its output); recompute
  the rest in backward. Ops outside blocks (embedding, final norm, head, loss) keep their
  values. About one extra forward of the blocks; under Megatron the block's forward all-reduces
  run again too (the ``collectives`` pass gives recomputed ops their own copies), as in
  Megatron-LM's full recompute.
- ``"selective"``: inside blocks, keep the outputs of the expensive ops (matmuls, attention)
  and of values that are communicated (a Partial sum, or one a consumer needs in another
  layout: recomputing it would repeat the collective), recompute the cheap ones (norms,
  activations, RoPE, casts, views).

Independently of the policy, under ZeRO-3 the view/cast chains that turn a parameter into what
a matmul consumes (``t``, casts) are recomputed in backward, so the backward uses its own
all-gather of the parameter instead of keeping the forward's gathered copy alive.

Random ops (dropout) are never recomputed: a second draw would differ.
"""

from __future__ import annotations

import dataclasses

import operator
import re

import torch
from torch import fx
from torch.distributed.tensor.placement_types import Partial

from autopar.ir import Program, ShardSpec, info, phase_of, spec_of, tensor_args

aten = torch.ops.aten
POLICIES = ("none", "full", "selective")

# ops whose output is worth storing rather than recomputing (compute-bound)
EXPENSIVE = {
    aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.matmul.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten.convolution.default,
}
# ops that only re-describe a parameter (no arithmetic worth storing)
PARAM_CHAIN = {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
    aten.reshape.default, aten.expand.default, aten.unsqueeze.default, aten._to_copy.default,
    aten.alias.default, aten.detach.default,
}
_BLOCK = re.compile(r"(\.\d+|, '\d+'\))$")


def _block_path(n: fx.Node) -> str | None:
    """The outermost repeated block (``...layers.3``) a forward node belongs to, if any."""
    for path, _ in (n.meta.get("nn_module_stack") or {}).values():
        if _BLOCK.search(path):
            return path
    return None


def _random(n: fx.Node) -> bool:
    tags = getattr(n.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    if "scaled_dot_product" in str(n.target):  # random only through dropout
        p = n.kwargs.get("dropout_p", n.args[3] if len(n.args) > 3 else 0.0)
        return p != 0.0
    return True


def param_chains(graph: fx.Graph) -> set[fx.Node]:
    """Forward nodes that are a view/cast chain of one parameter."""
    out: set[fx.Node] = set()
    params = {n for n in graph.nodes if n.op == "placeholder" and (info(n).role or ("",))[0] == "param"}
    for n in graph.nodes:
        if n.op != "call_function" or phase_of(n) != "forward":
            continue
        if n.target in PARAM_CHAIN:
            ins = tensor_args(n)
            if len(ins) == 1 and (ins[0] in params or ins[0] in out):
                out.add(n)
    return out


def choose(graph: fx.Graph, policy: str, zero3: bool) -> set[fx.Node]:
    """The forward nodes to recompute in backward."""
    chosen: set[fx.Node] = set(param_chains(graph)) if zero3 else set()
    if policy == "none":
        return chosen
    blocks = {n: _block_path(n) for n in graph.nodes if n.op == "call_function" and phase_of(n) == "forward"}
    for n, b in blocks.items():
        if b is None or _random(n) or n in chosen:
            continue
        leaves_block = any(u.op == "output" or (u in blocks and blocks[u] != b) for u in n.users)
        if leaves_block:
            continue
        if policy == "selective" and (n.target in EXPENSIVE or _communicated(n) or (
                n.target is operator.getitem and tensor_args(n)[0].target in EXPENSIVE)):
            continue
        chosen.add(n)
    return chosen


def _communicated(n: fx.Node) -> bool:
    """Will the value be moved by a collective (propagate has decided its placements)?"""
    spec = spec_of(n)
    if not isinstance(spec, ShardSpec):
        return False
    if any(isinstance(p, Partial) for p in spec.placements):
        return True
    for u in n.users:
        wants = info(u).wants or []
        for a, w in zip(tensor_args(u), wants):
            if a is n and w is not None and tuple(w) != tuple(spec.placements):
                return True
    return False


def recompute_pass(program: Program, ctx) -> Program:
    """After it: the backward reads no forward value the policy recomputes; it reads copies
    of the forward nodes, placed in the backward (``recompute="none"``: nothing changes)."""
    graph = program.graph
    chosen = choose(graph, ctx.recompute, ctx.plan.zero >= 3)
    clones: dict[fx.Node, fx.Node] = {}

    def clone(a: fx.Node, before: fx.Node) -> fx.Node:
        if a in clones:
            return clones[a]
        for x in tensor_args(a):
            if x in chosen:
                clone(x, before)
        with graph.inserting_before(before):
            c = graph.node_copy(a, lambda x: clones.get(x, x))
        c.meta = dict(a.meta)
        c.meta["partitioner_tag"] = "is_backward"
        c.meta["autopar"] = dataclasses.replace(info(a), recomputed=a.name)  # its own record
        clones[a] = c
        return c

    for n in list(graph.nodes):
        if n.op == "output" or phase_of(n) != "backward" or info(n).recomputed:
            continue
        if not any(a in chosen for a in tensor_args(n)):
            continue
        for a in tensor_args(n):
            if a in chosen:
                clone(a, n)
        n.args = _replace(n.args, clones)
        n.kwargs = _replace(n.kwargs, clones)
    graph.eliminate_dead_code()
    program.recomputed = len(clones)
    return program


def _replace(a, clones):
    if isinstance(a, fx.Node):
        return clones.get(a, a)
    if isinstance(a, (list, tuple)):
        return type(a)(_replace(x, clones) for x in a)
    if isinstance(a, dict):
        return {k: _replace(v, clones) for k, v in a.items()}
    return a
