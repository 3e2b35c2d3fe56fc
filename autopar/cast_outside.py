"""Mixed precision's parameter casts made outside dynamo's trace, then written into its graph.

With a compute dtype the capture (autopar/capture.py) traces the model with every floating-point
parameter cast to that dtype at the top of the step. Written in the traced code as
``functional_call(model, {name: p.to(dtype)})`` (``_WithLoss._model``), dynamo traces torch's
reparametrization along with the casts: the walk over every module, the map of tied names, the
swap of every tensor in and out. For Hugging Face's Llama that was 0.43 s of a 0.99 s capture at 3
blocks and half of every deeper one (1.46 of 2.94 s at 12 blocks), paid by every bf16 compile and
plan.

Here instead, for the length of the trace, each such parameter is swapped, in the module that holds
it, for a parameter of the compute dtype with the same shape, strides, device and ``requires_grad``
(uninitialised: dynamo reads a tensor's metadata, never its data), so the model's code sees what it
saw under ``functional_call``: tensors of the compute dtype, one per tied group. After the trace
each stand-in's ``get_attr`` reads the fp32 parameter again and is followed by its cast, placed
where dynamo put them (at the top, in ``named_parameters`` order), with the example values dynamo
would have recorded. ``tests/test_cast_outside.py`` checks that the graph is the traced one node
for node, and the joint graph after AOTAutograd too.

Only where every parameter is a plain ``nn.Parameter`` on the meta device or the CPU (where an
uninitialised tensor costs address space, not memory, unless deterministic mode fills it);
elsewhere (a model on an accelerator, whose stand-ins would be real allocations, CPU parameters
under ``torch.use_deterministic_algorithms`` with ``fill_uninitialized_memory``, or a tensor
subclass) the casts stay in the traced code.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import fx, nn

from autopar.modpath import get_attr

_DEVICES = ("meta", "cpu")


@contextlib.contextmanager
def stand_ins(model: nn.Module, dtype: torch.dtype):
    """Yields the originals in ``named_parameters`` order, each with its stand-in, as
    ``[(original, stand_in)]`` (floating-point ones only), with the stand-ins in the model for the
    block; None (the model untouched) where this does not apply."""
    params = list(model.named_parameters())
    # (deterministic mode fills an uninitialised CPU tensor: the stand-ins would cost the memory)
    filled = torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    if not all(type(p) is nn.Parameter and p.device.type in _DEVICES and not (filled and p.device.type == "cpu")
               for _, p in params):
        yield None
        return
    pairs = [(p, nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad))
             for _, p in params if p.is_floating_point()]
    swap = {id(p): s for p, s in pairs}
    slots = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()
             if p is not None and id(p) in swap]
    try:
        for m, name, p in slots:
            m._parameters[name] = swap[id(p)]
        yield pairs
    finally:
        for m, name, p in slots:
            m._parameters[name] = p


def insert_casts(gm: fx.GraphModule, model: nn.Module, pairs: list, dtype: torch.dtype,
                 wrapper: tuple[str, str]) -> None:
    """``gm`` (dynamo's graph of ``model`` with ``stand_ins``) as the traced casts would have made
    it. At the top, after the inputs, in ``named_parameters`` order: each floating-point parameter,
    read and cast to ``dtype`` (also one the graph does not use: the traced cast read it), and
    each other parameter the graph reads; then the buffers it reads (``named_buffers`` order:
    functional_call's walk read them there). All of them outside every module (empty
    ``nn_module_stack``), their stack trace ending in the wrapper's frame (``wrapper``: its file
    and function). ``gm``'s parameters and buffers registered in that order (AOTAutograd numbers
    the program's inputs by it)."""
    graph = gm.graph
    reads: dict[int, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            reads.setdefault(id(get_attr(gm, n.target)), []).append(n)
    stand_in = {id(p): s for p, s in pairs}
    named = list(model.named_parameters()) + list(model.named_buffers())
    moved = [n for _, t in named for n in reads.get(id(stand_in.get(id(t), t)), ())]
    kept = set(moved)
    anchor = next(n for n in graph.nodes if n.op != "placeholder" and n not in kept)
    trace = next((f for f in (_cut(n.meta.get("stack_trace"), *wrapper) for n in moved) if f), None)
    mode = next((v.fake_mode for n in graph.nodes if hasattr(v := n.meta.get("example_value"), "fake_mode")), None)
    rank: dict[int, int] = {}
    for fqn, t in named:
        s = stand_in.get(id(t))
        nodes = reads.get(id(s if s is not None else t), [])
        if (not nodes and s is None) or id(t) in rank:
            continue  # read by neither the graph nor a cast (dynamo drops such a read too), or seen
        rank[id(t)] = len(rank)
        if s is None:  # read as it is: moved up, one read for all
            anchor.prepend(nodes[0])
            for n in nodes[1:]:
                _merge(gm, n, nodes[0])
            made = [nodes[0]]
        else:
            target = nodes[0].target if nodes else _free(gm, re.sub(r"\W", "_", fqn))  # (an unused one's)
            _set_attr(gm, target, t)
            with graph.inserting_before(anchor):
                read = graph.get_attr(target)
                cast = graph.call_method("to", (read, dtype))
            cast.meta["source_fn_stack"] = [(cast.name, "to")]
            if mode is not None:
                fake = mode.from_tensor(t, static_shapes=True)
                read.meta["example_value"] = fake
                with mode:
                    cast.meta["example_value"] = fake.to(dtype)
            for n in nodes:
                _merge(gm, n, cast, keep=target)
            made = [read, cast]
        for n in made:
            n.meta["nn_module_stack"] = {}
            if trace:
                n.meta["stack_trace"] = trace
    for table in (gm._parameters, gm._buffers):
        items = sorted(table.items(), key=lambda kv: rank.get(id(kv[1]), len(rank)))
        table.clear()
        table.update(items)
    graph.lint()
    gm.recompile()


def _free(gm: fx.GraphModule, name: str) -> str:
    k, out = 0, name
    while hasattr(gm, out):
        k += 1
        out = f"{name}_{k}"
    return out


def _merge(gm: fx.GraphModule, node: fx.Node, into: fx.Node, keep: str | None = None) -> None:
    """``node`` (a read) replaced by ``into``; its attribute dropped if nothing else reads it."""
    node.replace_all_uses_with(into)
    gm.graph.erase_node(node)
    if node.target not in (keep, into.target) and not any(
            n.op == "get_attr" and n.target == node.target for n in gm.graph.nodes):
        owner, name = _owner(gm, node.target)
        delattr(owner, name)


def _cut(stack_trace: str | None, file: str, function: str) -> str | None:
    """A stack trace cut after the first frame of ``function`` in ``file``."""
    if not stack_trace:
        return None
    lines = stack_trace.splitlines(keepends=True)
    for i, ln in enumerate(lines):
        if f'File "{file}"' in ln and ln.rstrip().endswith(f" in {function}"):
            end = i + 1
            while end < len(lines) and not lines[end].lstrip().startswith('File "'):
                end += 1
            return "".join(lines[:end])
    return None


def _owner(gm: fx.GraphModule, target: str):
    path, _, name = target.rpartition(".")
    return gm.get_submodule(path), name


def _set_attr(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    owner, name = _owner(gm, target)
    if name in owner._parameters or (isinstance(value, nn.Parameter) and not hasattr(owner, name)):
        owner._parameters[name] = value
    else:
        setattr(owner, name, value)
