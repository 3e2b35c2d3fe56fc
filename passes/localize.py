"""localize: trace the per-rank program.

The annotated global graph is executed symbolically on fake tensors of LOCAL shapes, each ATen op
recorded (autopar/record.py: the graph make_fx would trace, at about half its cost; make_fx
itself where the recorder cannot run):

- a ``redistribute`` marker runs ``plan_steps`` with explicit ``_c10d_functional``
  collectives, each followed by its ``wait_tensor``;
- an op whose rule has a local implementation runs it (its collectives are traced too);
- any other op runs through DTensor on the placements propagate chose, which turns global
  shape arguments (view sizes, expand sizes...) into local ones; its inputs already have the
  placements DTensor asked for, so DTensor inserts nothing (checked: every collective in the
  result must come from a marker or a rule). Where what DTensor would run is the op itself on
  the local shards (an op whose arguments hold no sizes; a view given its output's local shape),
  it runs so directly (``_FAST``; tests/test_localize_fast.py: the same program as DTensor's).

Every per-rank node keeps the stack trace and forward/backward tag of the global node it
came from (and its name, ``meta["custom"]["autopar_origin"]``); collective nodes get a
``CommRecord`` (``info(n).comm``). Each collective's wait follows it at once: when
they run is the overlap pass's decision (passes/overlap.py).
"""

from __future__ import annotations

import math
import operator
import os

import torch
import torch.fx.traceback as fx_traceback
from autopar.passes.collectives import plan_steps
from torch import fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autopar import record
from autopar import torch_compat as tc
from autopar.analysis.ops import VIEW_OPS, is_view
from autopar.errors import ShardingError
from autopar.rules import elementwise
from autopar.experts import EP_KIND, ep_record_bytes
from autopar.layout import ring_axes, zigzag_order, zigzag_take, zigzag_unorder
from autopar.ir import (
    drop_unread,
    CommRecord,
    Program,
    fmt_placements,
    info,
    phase_of,
    redistribute,
    source_line,
    spec_of,
    tensor_args,
)

c10d = torch.ops._c10d_functional
COLLECTIVES = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
}


def localize_pass(program: Program, ctx) -> Program:
    """After it: ``program.local`` is the per-rank program (local shapes), every redistribute an
    explicit ``_c10d_functional`` collective with a CommRecord, each followed by its wait.
    Traced, or (``autopar plan``'s depths 4 and 5) spliced from depth 3's (autopar/local_splice.py)."""
    from autopar import local_splice

    local_splice.localized(program, ctx, trace_local, _annotate_collectives)
    return program


def trace_local(program: Program, ctx) -> Program:
    """``program.local`` traced: the placed graph run on fake tensors of local shapes (recorded, or
    make_fx's trace)."""
    graph = program.graph
    for n in graph.nodes:
        n.meta["custom"] = {"autopar_origin": n.name}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    example = [_local_example(n, ctx) for n in placeholders]
    origins = {n.name: n for n in graph.nodes}

    def run(*args):
        env: dict[fx.Node, object] = {}
        it = iter(args)
        for n in graph.nodes:
            with fx_traceback.set_current_meta(n):
                if n.op == "placeholder":
                    env[n] = next(it)
                elif n.op == "output":
                    return [env[o] if isinstance(o, fx.Node) else None for o in n.args[0]]
                else:
                    env[n] = _run_node(n, env, ctx)

    with fx_traceback.preserve_node_meta(), torch.no_grad(), tc.fixed_views(), tc.lazy_tracers():
        if record.available():  # (autopar/record.py: make_fx's graph, recorded without its proxies)
            gm = record.record(run, example)
        else:
            gm = make_fx(run, tracing_mode="fake")(*example)
            gm = tc.graph_module(gm, gm.graph)  # (its code generated when it first runs: passes rewrite it)
    _annotate_collectives(gm.graph, origins, ctx)
    changed = _reshape_views_of_mixed_layouts(gm.graph)
    if drop_unread(gm.graph) or changed:  # (views a local op replaced: ring attention's, sequence parallelism's)
        gm.recompile()
    program.local = gm
    return program


def _reshape_views_of_mixed_layouts(graph: fx.Graph) -> int:
    """A view of a value whose layout at run time the trace cannot promise becomes a reshape.
    Which layout an elementwise op's output takes when its inputs of the output's shape have
    different layouts is the kernel's choice, and fake tensors do not always make the same one:
    softplus_backward(grad (256, 1, 16), input (256, 16, 1)) traces as (256, 16, 1) and runs as
    (256, 1, 16) on CPU (torch 2.13), so a view the trace allowed fails at run time. Such an output
    is uncertain, and so is what takes its layout from an uncertain input (elementwise ops and
    reductions, views, cat, copies); a matmul's or any other op's fresh output is not. A view of an
    uncertain value becomes a reshape: that same view where the run-time strides allow it, else a
    copy. Returns how many views it turned."""
    aten = torch.ops.aten
    uncertain: set = set()
    done = 0

    def layout(v):
        return tuple(st for st, sz in zip(v.stride(), v.shape) if sz > 1)

    for n in graph.nodes:
        out = n.meta.get("val")
        if n.op != "call_function" or not isinstance(out, torch.Tensor):
            continue
        flat = [x for a in n.args for x in (a if isinstance(a, (list, tuple)) else [a])]  # (cat's list)
        ins = [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        if n.target == aten.view.default and ins and ins[0] in uncertain:
            n.target = aten.reshape.default
            done += 1
        if elementwise(n.target):
            same = [a for a in ins if tuple(a.meta["val"].shape) == tuple(out.shape) and out.dim() > 1]
            if len({layout(a.meta["val"]) for a in same}) > 1:
                uncertain.add(n)
        if any(a in uncertain for a in ins) and _follows_layout(n.target):
            uncertain.add(n)
    return done


def _follows_layout(target) -> bool:
    """Whether an op's output takes its layout from its input's (TensorIterator's ops, views, cat,
    copies that preserve the format), rather than being laid out fresh (a matmul's, attention's)."""
    aten = torch.ops.aten
    tags = getattr(target, "tags", ())
    return (elementwise(target) or torch.Tag.reduction in tags or is_view(target)
            or target in (aten.cat.default, aten.clone.default, aten._to_copy.default, aten.reshape.default))


def _local_example(n: fx.Node, ctx) -> torch.Tensor:
    spec = spec_of(n)
    for p, size, name in zip(spec.placements, ctx.axis_sizes, ctx.axis_names):
        if isinstance(p, Shard) and spec.shape[p.dim] % size:
            raise ShardingError(
                f"dimension {p.dim} of size {spec.shape[p.dim]} is not divisible by mesh axis '{name}' ({size})",
                where=_role_str(n),
                fix=f"pick a '{name}' size that divides {spec.shape[p.dim]}, or replicate it with a plan rule",
            )
    return torch.empty(spec.local_shape(ctx.axis_sizes), dtype=spec.dtype, device=ctx.device)


def _role_str(n: fx.Node) -> str:
    kind, what = info(n).role or ("value", n.name)
    return {"param": f"parameter '{what}'", "input": f"input #{what}"}.get(kind, f"{kind} {what}")


def _map(a, f):
    if isinstance(a, fx.Node):
        return f(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_map(x, f) for x in a)
    if isinstance(a, dict):
        return {k: _map(v, f) for k, v in a.items()}
    return a


def _off_meta(a, device: torch.device):
    """``a`` with every ``torch.device("meta")`` in it replaced by ``device`` (factory ops traced
    from a model built on meta: ``arange(..., device=meta)``). The identity when ``device`` is meta."""
    if isinstance(a, torch.device):
        return device if a.type == "meta" else a
    if isinstance(a, (list, tuple)):
        return type(a)(_off_meta(x, device) for x in a)
    if isinstance(a, dict):
        return {k: _off_meta(v, device) for k, v in a.items()}
    return a


def _run_node(n: fx.Node, env, ctx):
    if n.target is redistribute:
        x, src, dst = n.args
        return apply_redistribute(env[x], src, dst, spec_of(n), ctx)
    if n.target is torch.ops.aten.native_dropout.default and (len(n.args) < 3 or n.args[2] is not False):
        return _dropout(n, env[n.args[0]], ctx)
    if n.target is operator.getitem:
        return env[n.args[0]][n.args[1]]
    rule = info(n).rule
    args = _map(n.args, lambda a: env[a])
    kwargs = _map(n.kwargs, lambda a: env[a])
    if ctx.device.type != "meta":  # a model built on meta, traced there, runs on the mesh's device
        args, kwargs = _off_meta(args, ctx.device), _off_meta(kwargs, ctx.device)
    if rule is not None and rule.impl is not None:
        return rule.impl(ctx, *args, **kwargs)
    in_specs = [spec_of(a) for a in tensor_args(n)]
    if rule is None or rule.name != "dtensor" or all(
            all(isinstance(p, Replicate) for p in s.placements) for s in in_specs):
        if n.target is torch.ops.aten.view.default and not args[0].is_contiguous():
            # the global trace's strides may allow a view that the local value's do not (a rule's
            # local implementation or a redistribution laid it out otherwise): reshape is the view
            # where the strides allow one, else the same values copied
            return torch.ops.aten.reshape.default(*args)
        return n.target(*args, **kwargs)  # local shards need no shape changes
    if _FAST and _local_as_is(n, in_specs):
        return _checked(n, n.target(*args, **kwargs), ctx)
    if _FAST and _shaped_as_is(n, args, in_specs):
        return _checked(n, _shaped(n, args, kwargs, ctx), ctx)
    def call(contiguous: bool):
        def wrap(a: fx.Node):
            s, v = spec_of(a), a.meta["val"]
            dspec = tc.DTensorSpec(ctx.mesh, s.placements, tc.TensorMeta(v.shape, v.stride(), v.dtype))
            local = env[a].contiguous() if contiguous else env[a]
            return DTensor(local, dspec, requires_grad=False)
        return n.target(*_off_meta(_map(n.args, wrap), ctx.device), **_off_meta(_map(n.kwargs, wrap), ctx.device))
    try:
        out = call(contiguous=False)
    except (RuntimeError, ValueError):  # (the local op's refusal, or DTensor's view rule's)
        # a view the local strides do not allow (they can differ from the global value's: a rule's
        # local implementation, a kernel's own layout): the same values made contiguous first. Tried
        # as they are before, not always copied: a copy kept for the backward costs a layer's bytes.
        # (Decided by the op, not by the error's wording, which differs between torch versions; a
        # view that fails contiguous too raises its own error.)
        if n.target not in VIEW_OPS:
            raise
        out = call(contiguous=True)
    want = spec_of(n)
    def unwrap(o, w):
        if isinstance(o, DTensor):
            if w is not None and tuple(o.placements) != tuple(w.placements):
                raise ShardingError(
                    f"internal: DTensor produced {fmt_placements(o.placements)} for {n.name}, "
                    f"propagate predicted {fmt_placements(w.placements)}", where=source_line(n))
            return o._local_tensor
        return o
    if isinstance(out, (tuple, list)):
        return type(out)(unwrap(o, w) for o, w in zip(out, want))
    return unwrap(out, want)


# DTensor's own dispatch (below) costs about a millisecond an op while tracing. Most ops need
# none of what it does: their arguments hold no sizes (no SymInt in the schema: view / expand /
# slice / new_empty sizes are the ones DTensor rewrites to local ones), their inputs already
# have the placements the op's strategy takes (propagate chose them, collectives inserted the
# redistributes), and their placements are plain Shard / Replicate / Partial sums, so what
# DTensor would run is the op itself on the local shards. Those run directly; the result's
# local shape is checked against the placements propagate gave it. AUTOPAR_LOCALIZE_FAST=0
# sends every op through DTensor (its placement check included).
_FAST = os.environ.get("AUTOPAR_LOCALIZE_FAST", "1") != "0"
_PLAIN = (Replicate, Shard, Partial)
_SIZE_FREE: dict = {}


def _size_free(op) -> bool:
    """No argument of the op's schema holds a size (a SymInt, alone, in a list or optional)."""
    if op not in _SIZE_FREE:
        schema = getattr(op, "_schema", None)
        # not the ops DTensor's dispatcher handles itself (read from it, not copied), nor views
        # (they reshape local strides)
        special = op in VIEW_OPS or tc.dtensor_handles_itself(op)
        _SIZE_FREE[op] = schema is not None and not schema.is_mutable and not special and \
            not getattr(torch.Tag, "nondeterministic_seeded", None) in getattr(op, "tags", ()) and \
            "SymInt" not in str(schema).split(") ->")[0]
    return _SIZE_FREE[op]


def _plain(spec) -> bool:
    """Shard / Replicate / Partial sums, and strided shards (whose local block is a plain shard's);
    the strided class looked up here, on first use, as the boundary does its names."""
    return all((type(p) in _PLAIN or isinstance(p, tc.StridedShard))
               and (type(p) is not Partial or p.reduce_op in ("sum", "avg")) for p in spec.placements)


def _local_as_is(n: fx.Node, in_specs) -> bool:
    if not isinstance(n.target, tc.OpOverload) or not _size_free(n.target):
        return False
    out = spec_of(n)
    outs = out if isinstance(out, (tuple, list)) else [out]
    return all(_plain(s) for s in in_specs) and all(s is None or _plain(s) for s in outs)


# Views whose size argument is the output's shape: what DTensor runs for them, once propagate has
# given the input the placements its view rule takes, is the same view with the output's local
# shape (its rule computes that shape from the placements). Run so directly: 1.3-1.5 ms an op
# through DTensor while tracing, about 0.6 ms so (localize 6-9% faster over the test models).
_SHAPED = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
           torch.ops.aten.expand.default}


def _shaped_as_is(n: fx.Node, args, in_specs) -> bool:
    out = spec_of(n)
    return (n.target in _SHAPED and len(args) == 2 and not isinstance(out, (tuple, list)) and out is not None
            and len(in_specs) == 1 and _plain(in_specs[0]) and _plain(out))


def _shaped(n: fx.Node, args, kwargs, ctx):
    local = list(spec_of(n).local_shape(ctx.axis_sizes))
    if n.target is torch.ops.aten.expand.default:  # (never refused for its input's strides)
        return n.target(args[0], local, **kwargs)
    try:
        return n.target(args[0], local, **kwargs)
    except (RuntimeError, ValueError):  # a view the local strides do not allow (as on DTensor's path below)
        return n.target(args[0].contiguous(), local, **kwargs)


def _checked(n: fx.Node, out, ctx):
    want = spec_of(n)
    for o, w in zip(out, want) if isinstance(out, (tuple, list)) else [(out, want)]:
        if isinstance(o, torch.Tensor) and w is not None and tuple(o.shape) != tuple(w.local_shape(ctx.axis_sizes)):
            raise ShardingError(
                f"internal: {n.name} ({n.target}) gave a local shape {tuple(o.shape)}, its placements "
                f"{fmt_placements(w.placements)} of {tuple(w.shape)} say {tuple(w.local_shape(ctx.axis_sizes))}",
                where=source_line(n), fix="report it; AUTOPAR_LOCALIZE_FAST=0 traces every op through DTensor")
    return out


def _dropout(n: fx.Node, x: torch.Tensor, ctx):
    """A training dropout on this rank's block, its mask drawn from the global positions of the
    block's elements (autopar/dropout.py): replicas draw the same mask, shards their part
    of one mask. The key names the dropout by its node in the torch-level capture, which every
    rank, stage and plan shares."""
    from autopar.dropout import local_dropout, node_key

    spec = spec_of(n.args[0])
    odd = [p for p in spec.placements if isinstance(p, (Partial, tc.StridedShard))]
    if odd:
        raise ShardingError(f"dropout on a value placed {fmt_placements(spec.placements)}: its mask cannot be "
                            "drawn by position on this layout", where=source_line(n),
                            fix="report it; meanwhile compile with a plan that keeps this value sharded "
                                "by plain Shard or replicated, or set the dropout to 0")
    shape = tuple(spec.shape)
    # this rank's block: mesh axes split their dim in order, as torch.chunk (DTensor's layout)
    starts, extent = [0] * len(shape), list(shape)
    for a, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            piece = -(-extent[p.dim] // ctx.axis_sizes[a])
            lo = min(ctx.coord[a] * piece, extent[p.dim])
            starts[p.dim] += lo
            extent[p.dim] = min(piece, extent[p.dim] - lo)
    strides = list(tc.contiguous_strides(shape))  # the element's global linear index
    src = n.meta.get("from_node") or []
    origin = src[0].name if src and getattr(src[0], "name", None) else n.name
    return local_dropout(x, float(n.args[1]), [int(v) for v in starts], strides, node_key(origin))


def apply_redistribute(x: torch.Tensor, src, dst, spec, ctx) -> torch.Tensor:
    """Carry out collectives.plan_steps with explicit functional collectives."""
    ring = ring_axes(ctx)
    for a, p, q in plan_steps(src, dst):
        n, group = ctx.axis_sizes[a], ctx.group_name(a)
        if n == 1:  # one rank on this axis: every placement change is the identity
            continue
        if a in ring:  # a ring axis's shards are the load-balanced layout (autopar/layout.py)
            x = _ring_redistribute(x, p, q, n, a, group, ctx)
            continue
        if isinstance(p, Partial) and isinstance(q, Replicate):
            x = c10d.wait_tensor(c10d.all_reduce(x, _reduce_op(p), group))
        elif isinstance(p, Partial) and isinstance(q, Shard):
            d = q.dim
            if d != 0:  # the n pieces along d, stacked along dim 0 (one copy, however large n is)
                shape = tuple(x.shape)
                x = x.reshape(*shape[:d], n, shape[d] // n, *shape[d + 1:]).movedim(d, 0).reshape(
                    n * shape[0], *shape[1:d], shape[d] // n, *shape[d + 1:])
            x = c10d.wait_tensor(c10d.reduce_scatter_tensor(x.contiguous(), _reduce_op(p), n, group))
        elif isinstance(p, tc.StridedShard) and isinstance(q, Replicate):
            # each rank holds its 1/n of every one of the split_factor blocks of dim d: gathered
            # pieces [n, ..., sf, block/n, ...] interleave back to [..., sf, n, block/n, ...]
            d, sf, local = p.dim, p.split_factor, tuple(x.shape)
            g = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), n, group))
            g = g.view(n, *local[:d], sf, local[d] // sf, *local[d + 1:]).movedim(0, d + 1)
            x = g.reshape(*local[:d], n * local[d], *local[d + 1:])
        elif isinstance(p, Replicate) and isinstance(q, tc.StridedShard):
            d, sf, shape = q.dim, q.split_factor, tuple(x.shape)
            blocks = x.reshape(*shape[:d], sf, shape[d] // sf, *shape[d + 1:])
            x = torch.chunk(blocks, n, dim=d + 1)[ctx.coord[a]].reshape(*shape[:d], shape[d] // n, *shape[d + 1:])
            x = x.clone(memory_format=torch.contiguous_format)
        elif isinstance(p, Shard) and isinstance(q, Shard) and p.dim != q.dim:
            x = _all_to_all(x, p.dim, q.dim, n, group)
        elif isinstance(p, Shard):
            d = p.dim
            g = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), n, group))
            if d != 0:  # the n gathered pieces (stacked along dim 0) laid side by side along d
                local = tuple(x.shape)
                g = g.view(n, *local).movedim(0, d).reshape(*local[:d], n * local[d], *local[d + 1:])
            x = g
            if isinstance(q, Shard):  # a copy: a view would keep the whole gathered tensor alive
                x = torch.chunk(x, n, dim=q.dim)[ctx.coord[a]].clone(memory_format=torch.contiguous_format)
            elif isinstance(q, Partial):
                x = x if ctx.coord[a] == 0 else torch.zeros_like(x)
        elif isinstance(p, Replicate) and isinstance(q, Shard):
            x = torch.chunk(x, n, dim=q.dim)[ctx.coord[a]].clone(memory_format=torch.contiguous_format)
        elif isinstance(p, Replicate) and isinstance(q, Partial):
            x = x if ctx.coord[a] == 0 else torch.zeros_like(x)
        else:
            raise ShardingError(f"cannot redistribute {fmt_placements(src)} -> {fmt_placements(dst)}")
    return x


def _ring_redistribute(x: torch.Tensor, p, q, n: int, a: int, group: str, ctx) -> torch.Tensor:
    """One step on a ring axis, whose Shard(d) is rank r's chunks r and 2n-1-r of 2n along d (a
    strided shard: of each of its split_factor blocks of d)."""
    r = ctx.coord[a]

    def blocks(t, d, sf):  # t's dim d as [sf, length/sf] (sf = 1: plain Shard)
        shape = tuple(t.shape)
        return t.reshape(*shape[:d], sf, shape[d] // sf, *shape[d + 1:])

    def sf_of(pl):
        return pl.split_factor if isinstance(pl, tc.StridedShard) else 1

    if isinstance(p, Replicate) and isinstance(q, (Shard, tc.StridedShard)):
        shape = list(x.shape)
        shape[q.dim] //= n
        return zigzag_take(blocks(x, q.dim, sf_of(q)), q.dim + 1, n, r).reshape(shape).contiguous()
    if isinstance(p, Partial) and isinstance(q, Shard):  # the chunks in rank order, then a plain reduce-scatter
        d = q.dim
        x = zigzag_unorder(x, d, n)
        if d != 0:  # the n pieces along d, stacked along dim 0
            shape = tuple(x.shape)
            x = x.reshape(*shape[:d], n, shape[d] // n, *shape[d + 1:]).movedim(d, 0).reshape(
                n * shape[0], *shape[1:d], shape[d] // n, *shape[d + 1:])
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(x.contiguous(), _reduce_op(p), n, group))
    if isinstance(p, (Shard, tc.StridedShard)) and isinstance(q, (Replicate, Partial)):
        d, sf, local = p.dim, sf_of(p), tuple(x.shape)
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), n, group))
        # [n, ..., sf, block/n, ...] -> [..., sf, n·block/n, ...] with the ranks' parts in rank order
        g = g.view(n, *local[:d], sf, local[d] // sf, *local[d + 1:]).movedim(0, d + 1)
        g = g.reshape(*local[:d], sf, n * local[d] // sf, *local[d + 1:])
        out = zigzag_order(g, d + 1, n).reshape(*local[:d], n * local[d], *local[d + 1:])
        return out if isinstance(q, Replicate) or r == 0 else torch.zeros_like(out)
    if isinstance(p, Replicate) and isinstance(q, Partial):
        return x if r == 0 else torch.zeros_like(x)
    if isinstance(p, Partial) and isinstance(q, Replicate):  # a sum: the layout does not matter
        return c10d.wait_tensor(c10d.all_reduce(x, _reduce_op(p), group))
    raise ShardingError(f"cannot move {p} -> {q} on mesh axis '{ctx.axis_names[a]}' (ring attention's "
                        "load-balanced layout)", fix="report it; meanwhile use {'cp': 'ulysses'} on that axis")


def _all_to_all(x: torch.Tensor, gather_dim: int, split_dim: int, n: int, group: str) -> torch.Tensor:
    """Shard(gather_dim) -> Shard(split_dim) on one mesh axis of ``n`` ranks: one all-to-all (what
    DTensor does; Ulysses' sequence <-> heads swap). The ``n`` pieces of ``split_dim`` are stacked
    along a new dim 0 (piece j goes to rank j); what comes back from rank j is its block of
    ``gather_dim``, laid side by side in rank order."""
    shape = tuple(x.shape)
    q, p = split_dim, gather_dim
    pieces = x.reshape(*shape[:q], n, shape[q] // n, *shape[q + 1:]).movedim(q, 0).contiguous()
    y = c10d.wait_tensor(c10d.all_to_all_single(pieces, [1] * n, [1] * n, group))
    out = list(shape)
    out[q] //= n
    out[p] *= n
    return y.movedim(0, p).reshape(out)


def _reduce_op(p: Partial) -> str:
    op = p.reduce_op
    return {"sum": "sum", "avg": "avg", "max": "max", "min": "min"}.get(op, op)


def _annotate_collectives(graph: fx.Graph, origins, ctx) -> None:
    """Attach a CommRecord to every collective node of the per-rank graph."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _EP_BACKWARD:
            _annotate_ep(n, origins, ctx)
        if n.op != "call_function" or n.target not in COLLECTIVES:
            continue
        kind = COLLECTIVES[n.target]
        if kind == "all_to_all" and len(set(n.args[2] or [])) > 1:  # input to one peer: a ring shift
            kind = "shift"
        group = n.args[-1]
        a = ctx.axis_of_group(group)
        inp = n.args[0].meta["val"]
        payload = math.prod(inp.shape) * inp.dtype.itemsize
        origin = origins.get((n.meta.get("custom") or {}).get("autopar_origin", ""))
        producer = ""
        if origin is None:
            reason, src, phase = "unattributed", "", "forward"
        elif origin.target is redistribute:
            reason, src, phase = info(origin).reason, source_line(origin), phase_of(origin)
            producer = info(origin).producer
        else:
            rule = info(origin).rule
            reason = f"inside rule: {rule.name}" if rule else "unattributed"
            src, phase = source_line(origin), phase_of(origin)
        info(n).comm = CommRecord(kind, ctx.axis_names[a], ctx.axis_sizes[a], payload,
                                            reason, src, phase, n.name, producer)


_EP_BACKWARD = {torch.ops.autopar.moe_experts_ep.default: False, torch.ops.autopar.moe_experts_ep_backward.default: True}


def _annotate_ep(n: fx.Node, origins, ctx) -> None:
    """The uneven all-to-alls inside an expert-parallel op (autopar/experts.py) as one CommRecord
    of kind ``all_to_all_v``: what they send off-rank under balanced routing (their real size is
    the data's; the meter counts what ran)."""
    backward = _EP_BACKWARD[n.target]
    x, idx = (n.args[1], n.args[2]) if backward else (n.args[0], n.args[1])
    xv, iv = x.meta["val"], idx.meta["val"]
    size = n.args[-1]
    payload = ep_record_bytes((tuple(xv.shape), iv.shape[1]), size, backward, xv.dtype.itemsize)
    origin = origins.get((n.meta.get("custom") or {}).get("autopar_origin", ""))
    axis = ctx.axis_of_group(n.args[-3])
    why = "backward: x, output gradient, weight out; dx, weight gradient back" if backward else \
        "forward: tokens to their experts' ranks and results back"
    info(n).comm = CommRecord(EP_KIND, ctx.axis_names[axis], size, payload,
                              f"expert parallel ({ctx.axis_names[axis]}=expert), {why} (balanced-routing estimate)",
                              source_line(origin) if origin is not None else "",
                              phase_of(origin) if origin is not None else ("backward" if backward else "forward"),
                              n.name)
