"""bucket: gradient reductions grouped into flat buffers, one collective per bucket (called by
the overlap pass, before it decides where the waits go).

localize emits one collective per parameter gradient. Each call costs a fixed latency (gloo on
CPU, NCCL's launch and ring setup on GPUs), so a model with hundreds of parameters spends more
time starting collectives than moving bytes. DDP's reducer and FSDP2 reduce gradients in
buckets instead; this step does the same on the per-rank graph:

- a *gradient reduction* is an ``all_reduce`` (DDP, Megatron's replicated parameters) or a
  ``reduce_scatter_tensor`` (ZeRO-2/3, FSDP) whose waited result reaches only gradient outputs
  of the program (through the local ops ``_defer_output_waits`` moves with a wait);
- they are assigned to buckets in issue order (the backward's order), DDP's way: a bucket
  closes once it holds ``bucket_mb`` MiB (the first one at 1 MiB, so communication starts
  early), and never mixes collective kinds, process groups (mesh axes), reduce ops or dtypes;
- a reduce-scatter bucket also stays within one repeated block (``layers.3``; the parameters
  outside every block form one more unit): the unit FSDP2 reduce-scatters. Bucketing holds
  each gradient whole until its bucket is issued, and ZeRO-2/3 exist to not hold gradients
  whole: at most one block's (up to ``bucket_mb``) is, as under FSDP2. An all-reduce bucket
  needs no such bound: DDP's gradients are whole anyway;
- a bucket of two or more becomes ONE collective on one flat buffer, issued where its last
  gradient is produced::

      all-reduce:      cat([g.view(-1) ...])          -> all_reduce -> wait -> slice + view per gradient
      reduce-scatter:  cat([g.view(world, -1) ...], 1) -> reduce_scatter -> wait -> slice + view per gradient

  A reduce-scatter splits its input's dim 0 evenly over the ranks (localize has already moved a
  sharded dim other than 0 to the front), so each gradient viewed as ``world`` rows and the rows
  laid side by side (FSDP2's layout) leaves every rank's shard of every gradient contiguous in
  the result: rank r's output is the concatenation of rank r's shards.
- a gradient reduced over two axes in turn (HSDP: all-reduce over the replicas, then
  reduce-scatter over the shards; DDP over two axes) is bucketed at both: the earlier
  all-reduces, whose results only feed the bucket, run once on the concatenation instead
  (an all-reduce commutes with concatenation).

After it: every bucket collective has one wait and one CommRecord whose bytes are the sum of
its gradients' (so predicted bytes stay those counted at the process group) and whose reason
names the gradients; each gradient's value is a view of the bucket's result with the local
shape its unbucketed wait had, and names its global node (``autopar_origin``) as that wait did.
The flat buffer, its collective and its wait hold several global values and name none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from autopar.ir import CommRecord, info
from autopar.modpath import block_of
from autopar.passes.localize import COLLECTIVES, c10d

aten = torch.ops.aten
FIRST_BUCKET_MB = 1  # DDP's first bucket: the first reduction starts early in the backward
# local ops that move with a gradient's wait (a cast, a layout fix-up, a bucket's slices)
PASS_THROUGH = {aten._to_copy.default, aten.view.default, aten.t.default, aten.cat.default,
                aten.clone.default, aten.slice.Tensor}


@dataclass
class Reduction:
    """One gradient's collective, as localize emitted it."""

    coll: fx.Node
    wait: fx.Node
    name: str  # the parameter whose gradient it reduces
    key: tuple  # (kind, process group, reduce op, dtype, group size): what a bucket may not mix
    nbytes: int  # bytes handed to the collective
    unit: str | None = None  # reduce-scatter: the block it belongs to (a bucket stays in one)


def bucket_gradient_reductions(gm: fx.GraphModule, roles, bucket_mb: float,
                               recompile: bool = True) -> list[list[str]]:
    """After it: the gradient reductions of ``gm`` (a per-rank program whose outputs have
    ``roles``) are bucketed as the module docstring says; ``bucket_mb=0`` changes nothing.
    Returns the parameter names of each rewritten bucket, in issue order. ``recompile=False``:
    the caller regenerates ``gm``'s code (and lints the graph) itself."""
    if not bucket_mb:
        return []
    reductions = gradient_reductions(gm, roles)
    buckets = assign_buckets(reductions, bucket_mb * 2**20)
    done = []
    for b in buckets:
        if len(b) > 1:
            _rewrite(gm.graph, b)
            done.append([r.name for r in b])
    if done and recompile:
        gm.graph.lint()
        gm.recompile()
    return done


def gradient_reductions(gm: fx.GraphModule, roles) -> list[Reduction]:
    """Every all-reduce / reduce-scatter whose waited result (through PASS_THROUGH ops, one user
    each) is used only as gradient outputs, in graph (issue) order."""
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    outs = list(out.args[0])
    found = []
    for n in graph.nodes:
        kind = COLLECTIVES.get(n.target) if n.op == "call_function" else None
        if kind not in ("all_reduce", "reduce_scatter") or len(n.users) != 1 or info(n).comm is None:
            continue
        wait = next(iter(n.users))
        if wait.target is not c10d.wait_tensor.default or not isinstance(n.args[0], fx.Node):
            continue
        cur = (_chain(wait) or [wait])[-1]
        names = {roles[i][1] for i, o in enumerate(outs) if o is cur and roles[i][0] == "grad"}
        if len(names) != 1 or list(cur.users) != [out] or any(o is cur and roles[i][0] != "grad"
                                                                for i, o in enumerate(outs)):
            continue
        x = n.args[0].meta["val"]
        if kind == "all_reduce":
            _, op, group = n.args
            size = 1
        else:
            _, op, size, group = n.args
            if x.dim() == 0 or x.shape[0] % size:  # not an even split of dim 0: left alone
                continue
        name = names.pop()
        unit = block_of(name) if kind == "reduce_scatter" else None
        key = (kind, group, op, x.dtype, size)
        found.append(Reduction(n, wait, name, key, x.numel() * x.dtype.itemsize, unit))
    return found


def assign_buckets(reductions: list[Reduction], cap_bytes: float) -> list[list[Reduction]]:
    """DDP's assignment by size, in issue order: one open bucket per key; a bucket closes when it
    holds ``cap_bytes`` (the first of each key: ``FIRST_BUCKET_MB``, or the cap if smaller), or
    before a reduction of another unit joins it."""
    first = min(FIRST_BUCKET_MB * 2**20, cap_bytes)
    open_: dict[tuple, list[Reduction]] = {}
    limit: dict[tuple, float] = {}
    closed: list[list[Reduction]] = []
    for r in reductions:
        if r.key in open_ and open_[r.key][-1].unit != r.unit:
            closed.append(open_.pop(r.key))
            limit[r.key] = cap_bytes
        b = open_.setdefault(r.key, [])
        b.append(r)
        if sum(m.nbytes for m in b) >= limit.setdefault(r.key, first):
            closed.append(open_.pop(r.key))
            limit[r.key] = cap_bytes
    closed += open_.values()
    pos = {id(r): i for i, r in enumerate(reductions)}
    return sorted(closed, key=lambda b: pos[id(b[-1])])  # issue order: where the last one is produced


def _rewrite(graph: fx.Graph, bucket: list[Reduction]) -> None:
    """One bucket: flat buffer, one collective and one wait where the last gradient's collective
    was, then each gradient a view of the result; each gradient's old wait chain (casts,
    fix-ups) follows its view. Old collectives and waits are erased."""
    last = bucket[-1]
    kind, group, op, _, world = last.key
    names = [r.name for r in bucket]
    doomed: list[fx.Node] = []
    with graph.inserting_before(last.coll):
        flat = _flatten(graph, [r.coll for r in bucket], 1 if kind == "all_reduce" else world, names, doomed)
        if kind == "all_reduce":
            coll = _emit(graph, c10d.all_reduce.default, (flat, op, group), last.coll,
                         val=torch.empty_like(flat.meta["val"]))
        else:
            coll = _emit(graph, c10d.reduce_scatter_tensor.default, (flat, op, world, group), last.coll,
                         val=flat.meta["val"].new_empty((1, flat.meta["val"].shape[1])))
        wait = _emit(graph, c10d.wait_tensor.default, (coll,), last.coll,
                     val=torch.empty_like(coll.meta["val"]))
        views, start = [], 0
        for r in bucket:
            shape = list(r.wait.meta["val"].shape)
            end = start + math.prod(shape)
            origin = (r.wait.meta.get("custom") or {}).get("autopar_origin", "")
            piece = _emit(graph, aten.slice.Tensor, (wait, wait.meta["val"].dim() - 1, start, end), r.wait)
            views.append(_emit(graph, aten.view.default, (piece, shape), r.wait, origin))
            start = end
    _record(coll, [r.coll for r in bucket], names)
    anchor = views[-1]
    for r, v in zip(bucket, views):
        chain = _chain(r.wait)
        r.wait.replace_all_uses_with(v)
        for node in chain:  # the gradient's cast / fix-up now runs on its view, after the wait
            anchor.append(node)
            anchor = node
        graph.erase_node(r.wait)
        graph.erase_node(r.coll)
    for n in doomed:  # an absorbed earlier all-reduce step: its waits, then its collectives
        graph.erase_node(n)


def _flatten(graph: fx.Graph, colls: list[fx.Node], world: int, names: list[str], doomed: list[fx.Node]):
    """The bucket's flat buffer from the inputs of ``colls``: each flattened (``world`` = 1), or
    viewed as ``world`` rows laid side by side (a reduce-scatter's layout), concatenated.

    When every input is the waited result of an all-reduce that nothing else reads, all on one
    process group with one op and dtype (a gradient reduced over one mesh axis before another:
    HSDP, DDP over two axes), those all-reduces become one too: an all-reduce commutes with
    concatenation, so the buffer is built from THEIR inputs and all-reduced once (appending
    the old all-reduces and waits to ``doomed``)."""
    xs = [c.args[0] for c in colls]
    inner = [x.args[0] if _is_sole_wait_of_all_reduce(x) else None for x in xs]
    if all(inner) and len({(c.args[1], c.args[2], c.args[0].meta["val"].dtype) for c in inner}) == 1:
        flat = _flatten(graph, inner, world, names, doomed)
        _, op, group = inner[-1].args
        coll = _emit(graph, c10d.all_reduce.default, (flat, op, group), inner[-1],
                     val=torch.empty_like(flat.meta["val"]))
        _record(coll, inner, names)
        doomed[:0] = xs + inner  # the outer bucket's old nodes go first: these are their inputs
        return _emit(graph, c10d.wait_tensor.default, (coll,), inner[-1],
                     val=torch.empty_like(coll.meta["val"]))
    shape = [-1] if world == 1 else [world, -1]
    pieces = [_emit(graph, aten.view.default, (_contiguous(graph, x, c), shape), c)
              for x, c in zip(xs, colls)]
    return _emit(graph, aten.cat.default, (pieces, len(shape) - 1), colls[-1])


def _is_sole_wait_of_all_reduce(x: fx.Node) -> bool:
    c = x.args[0] if x.op == "call_function" and x.target is c10d.wait_tensor.default else None
    return (len(x.users) == 1 and isinstance(c, fx.Node) and c.target is c10d.all_reduce.default
            and len(c.users) == 1 and info(c).comm is not None and isinstance(c.args[0], fx.Node))


def _record(coll: fx.Node, old: list[fx.Node], names: list[str], what: str = "gradients") -> None:
    """The bucket collective's CommRecord: the old ones' bytes summed, the ``what`` (gradients,
    parameters) named, the last one's source line and phase."""
    rec = info(old[-1]).comm
    payload = sum(info(c).comm.payload_bytes for c in old)
    reason = f"bucket of {len(names)} {what} ({', '.join(names)})"
    info(coll).comm = CommRecord(rec.kind, rec.axis, rec.group_size, payload, reason, rec.source, rec.phase,
                                 coll.name)


def _chain(wait: fx.Node) -> list[fx.Node]:
    """The single-user PASS_THROUGH ops after a gradient's wait, in order."""
    out, cur = [], wait
    while len(cur.users) == 1:
        u = next(iter(cur.users))
        if u.op != "call_function" or u.target not in PASS_THROUGH:
            break
        out.append(cur := u)
    return out


def _contiguous(graph: fx.Graph, x: fx.Node, like: fx.Node) -> fx.Node:
    """``x`` itself when its memory is in row-major order (a view of it flattens), else a copy."""
    if x.meta["val"].is_contiguous():
        return x
    return _emit(graph, aten.clone.default, (x,), like, kwargs={"memory_format": torch.contiguous_format})


def _emit(graph: fx.Graph, target, args, like: fx.Node, origin: str = "", val=None, kwargs=None) -> fx.Node:
    """A new per-rank node at the insertion point: its fake value (computed from its inputs' unless
    given), ``like``'s stack trace and phase tag, and ``origin`` as the global node it names."""
    kwargs = kwargs or {}
    n = graph.call_function(target, args, kwargs)
    if val is None:
        fake = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        val = target(*fake[0], **fake[1])
    n.meta["val"] = val
    for k in ("stack_trace", "partitioner_tag", "nn_module_stack"):
        if k in like.meta:
            n.meta[k] = like.meta[k]
    n.meta["custom"] = {"autopar_origin": origin}
    return n
