"""Ops the tensor-parallel derivation has no table entry for, followed by running them.

A third-party op (transformers' ``grouped_mm_fallback`` for stacked experts, a user's custom op)
or an ATen op the tables of autopar/analysis/tp_graph.py do not list is neither a known matmul
nor a known elementwise op. Rather than stop the flow there, the derivation asks what the op
does with a split: it runs the op on random inputs of the traced shapes, whole and in pieces
(autopar/derived_rules.py's ``measure``, the same check that gives such ops their sharding rule
when the program is placed), and reads the answer:

- **a start** (column-parallel): an op multiplying an activation by a weight of 2+ dims whose
  output comes out split on one dim when that weight is split on one of its dims (a grouped
  matmul ``[T, K] x [E, K, N] -> [T, N]``: the weight's N);
- **passing through**: the sharded value goes in split, the output comes out split;
- **row-parallel**: the sharded value and a weight split on one of its dims give a partial sum
  (the grouped matmul contracting the sharded K), and the flow ends there.

At compile time the derived rule checks each op again with the placements that then arrive, so a
decision here that the op does not honour in the strided layout gathers rather than computes
wrong (and says so in ``ctx.derived_rules``).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autopar.analysis.tp_graph import Graph, shape_of, strided, val_of

# where a python function that is an ATen op under another name lives (``torch.nn.functional.pad``)
_TORCH_NAMESPACES = ("torch", "torch.nn.functional", "torch._C._nn", "torch.functional", "torch._C._special")
_PROBE = 2  # ranks the op is split over to see what it does (a structural question: any size > 1 tells)


def runnable(n: fx.Node) -> bool:
    """An op that can be run here to see how it splits: a torch op with a schema that writes to
    none of its inputs (an ``OpOverload``, its packet, or a ``torch.*`` function naming an ATen op)."""
    if n.op == "call_method":  # x.tril(-1): the ATen op of the method's name
        packet = getattr(torch.ops.aten, n.target, None) if isinstance(n.target, str) else None
        return packet is not None and _pure(packet)
    if n.op != "call_function":
        return False
    t = n.target
    schema = getattr(t, "_schema", None)  # an OpOverload
    if schema is not None:
        return not schema.is_mutable
    if callable(getattr(t, "overloads", None)):  # an OpOverloadPacket (torch.ops.lib.op)
        packet = t
    elif getattr(t, "__module__", None) in _TORCH_NAMESPACES:
        packet = getattr(torch.ops.aten, getattr(t, "__name__", ""), None)
        if packet is None:
            return False
    else:
        return False
    return _pure(packet)


def _pure(packet) -> bool:
    """No overload of the ATen op writes to an input (an ``out=`` overload writes to its out
    argument only: not what the graph calls)."""
    schemas = [getattr(packet, o)._schema for o in packet.overloads() if "out" not in o]
    return bool(schemas) and not any(s.is_mutable for s in schemas)


def _tensors(n: fx.Node) -> list[fx.Node]:
    from autopar.ir import tensor_args

    return [a for a in tensor_args(n) if isinstance(val_of(a), torch.Tensor)]


def _run(g: Graph, n: fx.Node, args: list, given: tuple):
    """The op's output placement with its tensor inputs split as ``given``, or None (with why)."""
    from autopar.derived_rules import measure

    cache = g.measured
    key = (n, given)
    if key not in cache:
        found, why = measure(n, args, [val_of(a) for a in args], list(given), _PROBE)
        single = found[0] if found is not None and len(found) == 1 else None
        cache[key] = (single, why)
    return cache[key]


def _track_of(p) -> tuple[int, int] | None:
    from autopar import torch_compat as tc

    if isinstance(p, tc.StridedShard):
        return p.dim, p.split_factor
    if isinstance(p, Shard):
        return p.dim, 1
    return None


def measured_start(g: Graph, n: fx.Node) -> tuple | None:
    """(weight, its dim the output's split comes from, None, the output's split dim) where ``n``
    is an op with no table entry that multiplies an activation by one weight of 2+ dims and
    splits its output when that weight is split; None otherwise."""
    if not runnable(n):
        return None
    args = _tensors(n)
    views = [g.param_view(a) for a in args]
    weights = [i for i, v in enumerate(views) if v is not None and len(v[1]) >= 2]
    if len(weights) != 1 or len(args) < 2 or all(v is not None for v in views):
        return None
    w = weights[0]
    shape = shape_of(args[w])
    for j in reversed(range(len(shape))):
        if shape[j] % _PROBE:
            continue
        given = tuple(Shard(j) if i == w else Replicate() for i in range(len(args)))
        p, _ = _run(g, n, args, given)
        t = _track_of(p)
        if t is not None and t[1] == 1:
            name, perm = views[w]
            return name, perm[j], None, t[0]
    return None


def measured_step(g: Graph, flow, u: fx.Node, tracks: dict):
    """The track of ``u``'s output (an op with no table entry) given the flow's ``tracks``: a split
    output passes through; a partial sum with a weight split on one of its dims ends the flow
    there (``flow.rows``). None where it ends the flow; raises ``Fail`` where running it tells
    nothing usable."""
    from autopar.analysis.tp_graph import Fail, op_name, where_of

    name = op_name(u)
    if not runnable(u):
        raise Fail(f"{name}{where_of(u)}: an op whose sharding autopar does not derive")
    args = _tensors(u)
    base = [strided(*tracks[a]) if a in tracks and isinstance(tracks[a], tuple) else Replicate() for a in args]
    outer = {tracks[a][1] for a in args if a in tracks and isinstance(tracks[a], tuple)}
    o = outer.pop() if len(outer) == 1 else None
    p, why = _run(g, u, args, tuple(base))
    t = _track_of(p)
    if t is None and o is not None:  # an index (no gradient) as long as the split dim, split with it
        from autopar.derived_rules import aligned_indices

        aligned = aligned_indices([val_of(a) for a in args], base)
        if aligned:
            p2, _ = _run(g, u, args, tuple(aligned.get(i, b) for i, b in enumerate(base)))
            t = _track_of(p2)
    if t is not None:
        if len(flow.trail) < 4:
            flow.trail.append(f"{name} keeps the split (found by running it){where_of(u)}")
        return t
    views = [(i, g.param_view(a)) for i, a in enumerate(args) if a not in tracks]
    weights = [(i, v) for i, v in views if v is not None and len(v[1]) >= 2]
    if len(weights) == 1 and o is not None:
        i, (wname, perm) = weights[0]
        shape = shape_of(args[i])
        for j in range(len(shape)):
            if shape[j] % (_PROBE * o):
                continue
            given = list(base)
            given[i] = strided(j, o)
            q, why_j = _run(g, u, args, tuple(given))
            if isinstance(q, Partial):
                flow.rows.append((u, wname, perm[j], o))
                if len(flow.trail) < 4:
                    flow.trail.append(f"{name} contracts it with {wname} split on dim {perm[j]} (found by "
                                      f"running it){where_of(u)}")
                return None
    raise Fail(f"{name}{where_of(u)}: run whole and in pieces, it neither keeps the split nor contracts it "
               f"with a weight ({why})")
