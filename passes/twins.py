"""Twin stages: pipeline stages that compile to the same program are compiled once.

A pipeline cut at block boundaries has many stages that differ only in which parameters they
hold: with one block per (virtual) stage, every stage between the first and the last runs the
same ops on the same shapes with the same placements. The per-stage passes (autograd through
overlap) cost the same for each, and a 16-stage pipeline of Llama-3-70B spent 80% of its
compile there. So ``split`` (``find_twins``) gives every stage a *signature*, and a stage whose
signature equals an earlier stage's is that stage's *twin*: ``autograd`` and the per-stage
passes skip it, and ``materialize`` (run by the pass list after the last per-stage pass) gives
it a copy of its original's program with the names changed.

The signature is checked, not assumed. Two stages are twins only if all of this is equal:

- their torch-level graphs node by node: op, target, arguments (nodes by position, constants by
  value), the shape / dtype / stride / requires_grad of every value, and each node's module path
  with its block (``layers.5``) numbered by its order in the stage (``layers.#0``);
- their parameters and buffers in order of use, named the same way (``layers.#0.mlp.w1.weight``),
  with their shapes, dtypes and the placements the plan gives them on this stage's mesh, and
  their values where they have values (a buffer per block could hold different numbers);
- what the stage exchanges: which inputs are the user's batch (by index) and which come from
  other stages, which inputs and outputs are batch-first, whether it is the last stage.

A stage that draws random numbers (dropout) has no twin: its masks are keyed by its own nodes
(autopar/dropout.py). ``AUTOPAR_STAGE_TWINS=0`` compiles every stage.

The copy: the original's joint and per-rank graphs (node names and metadata kept; fake values
shared: nothing rewrites them after localize), with every parameter and buffer name, block path
and CommRecord reason rewritten from the original's blocks to the twin's (``layers.5`` ->
``layers.9``), and the program's buffers the twin's own tensors. Later passes (``schedule``) and
the runtime treat it like any other stage. tests/test_twins.py compiles pipelines with and
without twins and compares every stage's programs and figures.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re

import torch
from torch import fx

from autopar import torch_compat as tc
from autopar.ir import CommRecord, NodeInfo, Program
from autopar.modpath import block_of, get_attr, module_path

_RANDOM = ("dropout", "rand", "bernoulli", "multinomial", "normal", "uniform", "exponential", "geometric",
           "cauchy", "log_normal", "random_")


def enabled() -> bool:
    return os.environ.get("AUTOPAR_STAGE_TWINS", "1") not in ("0", "false", "off")


def find_twins(state, ids: dict) -> None:
    """``stage.twin_of`` = the index of the earlier stage it is a twin of (None: compiled).
    ``ids``: the model's tensors' (kind, name) by ``id`` (``modpath.tensor_names``)."""
    if not enabled() or len(state.stages) < 2:
        return
    seen: dict[tuple, int] = {}
    for st in state.stages:
        sig = signature(st, ids)
        if sig is None:
            continue
        if sig in seen:
            st.twin_of = seen[sig]
        else:
            seen[sig] = st.index


def _canonical(name: str, blocks: dict[str, int]) -> str:
    """``layers.5.mlp.w1.weight`` -> ``layers.#0.mlp.w1.weight`` (its block's order in the stage)."""
    b = block_of(name)
    if not b:
        return name
    if b not in blocks:
        blocks[b] = len(blocks)
    head = b.rstrip("0123456789")
    return f"{head}#{blocks[b]}{name[len(b):]}"


def value_key(v):
    """A value as a hashable key: tensors by shape, dtype, stride and requires_grad; lists
    element-wise; plain constants, dtypes and devices by value; anything else by identity (it
    only equals itself: two different objects of one type never make two stages twins, or two
    ops one FLOP count)."""
    if isinstance(v, torch.Tensor):
        return ("t", tuple(v.shape), str(v.dtype), tuple(v.stride()), v.requires_grad)
    if isinstance(v, (list, tuple)):
        return tuple(value_key(x) for x in v)
    if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return repr(v)
    return ("id", id(v))


def args_key(a, node_key):
    """A node's arguments as a hashable key: each argument node by ``node_key(node)``, constants by
    value, any other object by identity (it only equals itself). Also the split pass's memo of FLOP
    counts (passes/split.py), with nodes keyed by their values."""
    if isinstance(a, fx.Node):
        return node_key(a)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(args_key(x, node_key) for x in a)
    if isinstance(a, dict):
        return ("dict",) + tuple((k, args_key(v, node_key)) for k, v in a.items())
    if a is None or isinstance(a, (bool, int, float, complex, str, slice, torch.dtype, torch.device,
                                   torch.layout, torch.memory_format)) or a is Ellipsis:
        return repr(a)
    return ("id", id(a))


def _tensor_key(t, fp) -> object:
    """A parameter or buffer by its description (capture_cache's fingerprint), a buffer's values too
    where it has values; a parameter's values are trained, not part of the program."""
    if not isinstance(t, torch.Tensor):
        return ("id", id(t))
    return fp.tensor(t, values=not isinstance(t, (torch.nn.Parameter, tc.FakeTensor)))


def _random(n: fx.Node) -> bool:
    if n.op not in ("call_function", "call_method", "call_module"):
        return False
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    if not any(r in str(name).lower() for r in _RANDOM):
        return False
    if "dropout" in str(name).lower():  # F.dropout(x, p, training): deterministic at p = 0 or in eval
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        training = n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True)
        return not (p == 0 or training is False)
    return True


def signature(st, ids) -> tuple | None:
    """What makes a stage's compiled program what it is (module docstring), or None: no twin."""
    from autopar.capture_cache import _Fingerprint

    gm, spec, ctx = st.gm, st.spec, st.ctx
    nodes = list(gm.graph.nodes)
    index = {n: ("n", i) for i, n in enumerate(nodes)}
    blocks: dict[str, int] = {}
    fp = _Fingerprint()  # (one per stage: which tensors are the same one, in order of use)
    out = []
    for n in nodes:
        if _random(n):
            return None
        if n.op == "get_attr":
            t = get_attr(gm, n.target)
            kind, name = ids.get(id(t), ("const", None))
            target = (kind, _canonical(name, blocks) if name else None, _tensor_key(t, fp))
            if kind == "param":
                target += (tuple(str(p) for p in ctx.placed.placements.get(name, ())),
                           tuple(str(p) for p in ctx.placed.compute.get(name, ())))
        elif n.op in ("call_method", "call_module"):
            target = n.target
        else:
            target = n.target if n.op == "call_function" else n.op
        path = module_path(n) if n.op not in ("placeholder", "output") else ""
        out.append((n.op, target, args_key((n.args, n.kwargs), index.__getitem__),
                    value_key(n.meta.get("example_value")), _canonical(path, blocks) if path else ""))
    inputs = tuple(i if i[0] == "user" else ("stage",) for i in spec.inputs)
    example = tuple(value_key(x) for x in st.example)
    return (tuple(out), inputs, example, tuple(spec.in_batched), tuple(spec.out_batched), spec.is_last)


# ------------------------------------------------------------------------------------ copies
def materialize(state) -> None:
    """Every twin gets its original's program as the passes left it, renamed (module docstring)."""
    stages = {st.index: st for st in state.stages}
    named_buffers = dict(state.model.named_buffers(remove_duplicate=False))
    for st in state.stages:
        if st.twin_of is None or st.program is not None:
            continue
        rep = stages[st.twin_of]
        if rep.program is None:
            continue
        rename = _renamer(_name_map(rep, st))
        st.program = _copy_program(rep.program, rename, named_buffers)
        # (ctx.kept_gathered stays empty: a pipeline stage re-gathers every parameter, context.py)


def copy_schedule(rep, st) -> None:
    """What the schedule pass made of ``rep`` (its gradient-sync program, its F / I / W / P parts
    and their byte counts), renamed for its twin ``st``."""
    rename = _renamer(_name_map(rep, st))
    st.sync = None if rep.sync is None else _copy_program(rep.sync, rename, {})
    st.ph_names, st.out_names = list(rep.ph_names), list(rep.out_names)
    st.ph_vals = {n.name: n.meta["val"] for n in st.program.local.graph.nodes if n.op == "placeholder"}

    def part(p):
        if p is None or p.gm is None:
            return p
        return dataclasses.replace(p, gm=_clone_gm(p.gm, _copy_graph(p.gm.graph, rename)))

    st.parts = {k: part(p) for k, p in rep.parts.items()}
    st.prologue = part(rep.prologue)
    st.saved_bytes, st.saved_after_i, st.prologue_bytes = rep.saved_bytes, rep.saved_after_i, rep.prologue_bytes


def _name_map(rep, st) -> dict[str, str]:
    """rep's block paths -> st's (``layers.5`` -> ``layers.9``), from their parameters in order."""
    out: dict[str, str] = {}
    for a, b in zip(rep.param_names, st.param_names):
        ba, bb = block_of(a), block_of(b)
        if ba and bb:
            out.setdefault(ba, bb)
    return out


def _renamer(blocks: dict[str, str]):
    """A function rewriting every rep block path in a string to the twin's."""
    moved = {a: b for a, b in blocks.items() if a != b}
    if not moved:
        return lambda s: s
    pattern = re.compile(r"(?<![\w])(" + "|".join(re.escape(k) for k in sorted(moved, key=len, reverse=True))
                         + r")(?![0-9])")

    def rename(s):
        return pattern.sub(lambda m: moved[m.group(1)], s) if isinstance(s, str) else s

    return rename


def _role(r, rename):
    """A program input's or output's role with the names in it renamed (param, buffer, grad,
    grad_acc: a parameter's name; input, tangent, loss, act...: an index, left as it is)."""
    kind, what = r
    return (kind, rename(what))


def _copy_program(p: Program, rename, named_buffers) -> Program:
    graph = _copy_graph(p.graph, rename)
    buffers = {}
    for k, v in p.buffers.items():
        k2 = rename(k)
        buffers[k2] = named_buffers.get(k2, v) if k2 != k else v
    local = p.local
    return Program(graph=graph, inputs=[_role(r, rename) for r in p.inputs],
                   outputs=[_role(r, rename) for r in p.outputs], buffers=buffers, recomputed=p.recomputed,
                   local=_clone_gm(local, _copy_graph(local.graph, rename)) if local is not None else None)


def _clone_gm(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule running ``graph``, a copy of ``gm``'s graph that differs in metadata only:
    ``gm``'s generated code is that graph's code too (the same nodes, names and targets), so the
    clone shares it (same class) instead of generating it again, which is most of a copy's cost."""
    new = object.__new__(_sibling_class(type(gm)))  # (GraphModule.__copy__ would generate the code again)
    new.__dict__.update(gm.__dict__)
    for k in ("_parameters", "_buffers", "_modules"):
        new.__dict__[k] = dict(gm.__dict__[k])
    new.__dict__["meta"] = dict(gm.meta)
    new.__dict__["_graph"] = graph
    graph.owning_module = new
    return new


def _sibling_class(cls: type) -> type:
    """A class of its own for a clone, with the original's generated ``forward``: a GraphModule's
    code lives on its class (one class per instance), so a later ``recompile()`` of the clone must
    not rewrite the original's. Set up as ``GraphModule.recompile`` sets up a class."""
    base = next(t for t in cls.__mro__ if t.__qualname__.split(".")[-1] != "GraphModuleImpl")
    sibling = type("GraphModuleImpl", (base,), {"forward": cls.forward})
    sibling._wrapped_call = tc.WrappedCall(sibling, None)

    def call_wrapped(self, *args, **kwargs):
        return self._wrapped_call(self, *args, **kwargs)

    sibling.__call__ = call_wrapped
    return sibling


def _copy_graph(graph: fx.Graph, rename) -> fx.Graph:
    g = fx.Graph()
    g._codegen = copy.deepcopy(graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        new = g.node_copy(n, env.__getitem__)
        new.meta = dict(n.meta)
        rec = n.meta.get("autopar")
        if isinstance(rec, NodeInfo):
            new.meta["autopar"] = _renamed_info(rec, rename)
        stack = n.meta.get("nn_module_stack")
        if stack:
            new.meta["nn_module_stack"] = {k: (rename(v[0]), *v[1:]) if isinstance(v, tuple) else v
                                           for k, v in stack.items()}
        env[n] = new
    return g


def _renamed_info(rec: NodeInfo, rename) -> NodeInfo:
    new = copy.copy(rec)
    if rec.role is not None:
        new.role = _role(rec.role, rename) if len(rec.role) == 2 else rec.role
    new.reason = rename(rec.reason)
    new.why = rename(rec.why)
    new.producer = rename(rec.producer)
    new.predicted = tuple(_renamed_comm(c, rename) for c in rec.predicted)
    new.comm = _renamed_comm(rec.comm, rename) if rec.comm is not None else None
    return new


def _renamed_comm(c: CommRecord, rename) -> CommRecord:
    return dataclasses.replace(c, reason=rename(c.reason), producer=rename(c.producer))
