"""propagate: give every value a ShardSpec.

Placeholders take the plan's placements (parameters), the input layout (batch dims sharded on
data-parallel axes) or Replicate. Each op then asks, in order:

1. autopar's own rules (autopar/rules.py), for overrides and ops DTensor lacks;
2. DTensor's registered strategies (``sharding_propagator.propagate_op_sharding``), which pick
   the cheapest strategy given the inputs' placements;
3. if neither has a rule and every input is replicated, the op runs as is (replicated);
4. an op torch tags pointwise that DTensor does not know runs on aligned shards (rules.pointwise_rule).

Otherwise it is an error naming the op and the user's source line.
"""

from __future__ import annotations

import functools
import math
import os
import contextlib
import contextvars
import operator

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autopar import disk_cache, trace_share
from autopar import torch_compat as tc
from autopar.analysis.ops import VIEW_OPS
from autopar.derived_rules import DERIVED, derive, record
from autopar.errors import ShardingError, TorchVersionError
from autopar.experts import check_expert_parallel
from autopar.layout import SequenceDims, check_context_parallel, heads_to_sequence, sequence_axes
from autopar.passes.partials import (narrower, partial_through_a_copy, reduced_elsewhere, reduced_first,
                                     returned, widens_a_partial)
from autopar.ir import Program, ShardSpec, drop_unread, fmt_placements, info, source_line, spec_of, tensor_args
from autopar.indexing import index_put_layout, sound_indexing
from autopar.passes.view_errors import check_view_keeps_shards, view_error
from autopar.rules import ATTENTION_OPS, RULES, RuleResult, kept_layout, pointwise_rule
from autopar.scoped import setting


def propagate_pass(program: Program, ctx) -> Program:
    """After it: every value has a ShardSpec (``info(n).spec``) and every op the placements its
    inputs must have (``info(n).wants``) and the rule that decided (``info(n).rule``)."""
    graph = program.graph
    _drop_legacy_empty_cat_inputs(graph)
    # what the trace left unread (torch.export's eval programs have some), and the empty tensors the
    # line above took out of cat (a DynamicCache's ``torch.tensor([])``: a lift_fresh_copy nothing
    # reads any more): dropped after the rewrite, so that propagate leaves no node unread
    drop_unread(graph)
    for n in graph.nodes:  # (a graph propagated before: an op's wants say it was decided in this run)
        rec = n.meta.get("autopar")
        if rec is not None:
            rec.wants = None
    out = next(n for n in graph.nodes if n.op == "output")
    # what the program's outputs must be (gradients: their parameter's placements) is known
    # up front, so rules can produce a value directly in the layout its consumer wants
    info(out).wants = [
        ctx.output_placements(role, o) if isinstance(o, fx.Node) else None
        for role, o in zip(program.outputs, out.args[0])]
    ctx.output_roles = list(program.outputs)
    ctx.strategy_cache = {}  # repeated blocks ask DTensor the same question: answer it once
    seq = SequenceDims(program, ctx)  # the activation layout of a sequence-parallel axis (autopar/layout.py)
    check_context_parallel(program, ctx)  # the sequence length divides over the context-parallel axes
    check_expert_parallel(program, ctx)  # expert weights sharded over ep are computed by the expert op
    # the ranks of a real process group ask DTensor the same questions: one asks, the others take
    # its answers from the store (autopar/trace_share.py; none that carries code)
    # and another process's answers for this graph on a mesh of this shape, kept on disk
    # (autopar/disk_cache.py; those ``_kept_on_disk`` allows)
    with trace_share.memo("strategies", lambda: ("strategies", tuple(ctx.axis_sizes), str(graph)),
                          _SHARED_STRATEGIES, lambda res: res.impl is None), \
            disk_cache.memo("strategies", (_memo_prefix(ctx), str(graph)),
                            _SHARED_STRATEGIES, _kept_on_disk) as used, setting(_USED, used):
        _propagate_nodes(program, ctx, seq)
    return program


def _kept_on_disk(key, res: RuleResult) -> bool:
    """Which answers another process may read: not one that carries code, not one for a user's
    op (a sharding rule for it lives in a file no key names), not a derived rule (it depends on
    autopar/derived_rules.py's limits, which a caller may set at run time: the test that lowers
    them read the default's answer from disk)."""
    return res.impl is None and disk_cache.own_op(key[1][0]) and not res.name.startswith(DERIVED)


def _propagate_nodes(program: Program, ctx, seq: SequenceDims) -> None:
    graph = program.graph
    for n in graph.nodes:
        if n.op == "placeholder":
            val = n.meta["val"]
            placements = ctx.placeholder_placements(info(n).role, tuple(val.shape))
            info(n).spec = ShardSpec(tuple(placements), tuple(val.shape), val.dtype)
            seq.label(n, info(n).role)
        elif n.op == "call_function":
            seq.label(n)  # from shapes and the inputs' labels: known before the op is decided
            try:
                _propagate_node(n, ctx, seq)
            except ShardingError:
                mid = _refined_view(n, graph)  # a view that both splits and merges: in two steps
                if mid is None:
                    raise
                seq.label(mid)
                _propagate_node(mid, ctx, seq)
                seq.label(n)
                _propagate_node(n, ctx, seq)
        elif n.op == "get_attr":
            raise ShardingError(f"unexpected get_attr node {n.target} in the captured graph")


def refined_shape(a, b) -> list[int] | None:
    """The finest shape both ``a`` and ``b`` are merges of (each of their prefix products is one
    of its prefix products), or None where there is none ([6, 4] and [4, 6]). [4, 16, 4096] and
    [2048, 128]: [4, 16, 32, 128]."""
    def prefixes(shape):
        out, p = set(), 1
        for d in shape:
            p *= int(d)
            out.add(p)
        return out

    total = math.prod(int(d) for d in a)
    if total == 0 or total != math.prod(int(d) for d in b):
        return None
    cuts = sorted(prefixes(a) | prefixes(b) | {1})
    if any(y % x for x, y in zip(cuts, cuts[1:])):
        return None
    return [y // x for x, y in zip(cuts, cuts[1:])]


def _refined_view(n: fx.Node, graph: fx.Graph) -> fx.Node | None:
    """A view whose one step both splits a sharded dim and merges it under another (functionalization
    writes ``x.view(b, s, h, d).reshape(-1, d)`` as one view of x: [b, s, h * d] -> [b * s * h, d], h
    sharded), which DTensor's view rule cannot keep sharded in one step but can in two: split to the
    finest shape both are merges of, then merge (a strided shard). Rewrites ``n`` so and returns the
    new first step; None where that changes nothing."""
    if n.target not in VIEW_OPS or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    x = n.args[0]
    a, b = list(x.meta["val"].shape), list(n.meta["val"].shape)
    c = refined_shape([d for d in a if d != 1], [d for d in b if d != 1])
    if c is None or c in ([d for d in a if d != 1], [d for d in b if d != 1]):
        return None
    try:
        val = n.target(x.meta["val"], c)
    except RuntimeError:  # (strides that do not allow the first step as a view: the original error stands)
        return None
    with graph.inserting_before(n):
        mid = graph.call_function(n.target, (x, c))
    mid.meta.update({k: v for k, v in n.meta.items() if k not in ("val", "autopar")})
    mid.meta["val"] = val
    n.args = (mid, *n.args[1:])
    return mid


def _drop_legacy_empty_cat_inputs(graph: fx.Graph) -> None:
    """``torch.cat`` skips a 1-D tensor of size 0 among higher-dimensional ones (Hugging Face's
    DynamicCache starts every layer's keys as ``torch.tensor([])`` and concatenates onto it, when
    a model is traced with ``use_cache=True``). Such an input holds nothing and has no dim to
    shard, so it is removed from the op before placements are chosen; the result is the same. The
    removed inputs are left unread: the caller drops them (``drop_unread``) after this."""
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.cat.default:
            continue
        tensors = list(n.args[0])
        vals = [t.meta.get("val") if isinstance(t, fx.Node) else None for t in tensors]
        empty = [isinstance(v, torch.Tensor) and v.ndim == 1 and v.shape[0] == 0 for v in vals]
        if any(empty) and not all(empty) and any(isinstance(v, torch.Tensor) and v.ndim > 1 for v in vals):
            n.args = ([t for t, e in zip(tensors, empty) if not e],) + tuple(n.args[1:])


_aten = torch.ops.aten
# ops that only view their input (no arithmetic) and may hand it to several readers
_FAN_OUT_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.transpose.int,
                  _aten.t.default, _aten.permute.default, _aten.select.int, _aten.slice.Tensor,
                  _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.default, _aten.alias.default,
                  _aten.split.Tensor, _aten.split_with_sizes.default}


def _reduced_before_fan_out(n: fx.Node, in_specs, seq) -> dict:
    """A pending partial sum viewed by an op whose result several ops read (a row-parallel
    output split into parts, a tensor read once per loop step) is reduced once, there, rather than
    by each reader on its part; and the backward then reads the reduced value, not a partial sum
    that it would combine with sharded values by gathering them (Mamba's scan, which reads x_proj's
    B and C once per token). Not on sequence-parallel axes, where a partial sum is reduce-scattered
    (autopar/layout.py)."""
    if n.target not in _FAN_OUT_VIEWS or len(n.users) < 2:
        return {}
    skip = set(seq.axes) if seq is not None and seq.active else set()
    out = {}
    for a, have in zip(tensor_args(n), in_specs):
        if have is None:
            continue
        pl = tuple(Replicate() if isinstance(p, Partial) and ax not in skip else p for ax, p in enumerate(have.placements))
        if pl != tuple(have.placements):
            out[a] = ShardSpec(pl, have.shape, have.dtype)
    return out


def _spec_from_val(val, placements) -> ShardSpec | None:
    if isinstance(val, torch.Tensor):
        return ShardSpec(tuple(placements), tuple(val.shape), val.dtype)
    return None


def _propagate_node(n: fx.Node, ctx, seq: SequenceDims | None = None) -> None:
    if n.target is operator.getitem:
        parent, idx = n.args
        info(n).spec = spec_of(parent)[idx]
        return
    args = tensor_args(n)
    in_specs = [spec_of(a) for a in args]
    # a sequence-parallel axis (autopar/layout.py): a view that merges batch and sequence (entering a
    # tensor-parallel region) reads its sequence-sharded input whole
    read_as = seq.gathered(n, in_specs) if seq is not None else {}
    # a "ulysses" axis: attention's head-sharded outputs are read back sequence-sharded (an all-to-all)
    read_as.update(heads_to_sequence(n, in_specs, ctx, ATTENTION_OPS))
    read_as.update(_reduced_before_fan_out(n, in_specs, seq))
    in_specs = [read_as.get(a, s) for a, s in zip(args, in_specs)]
    res = _decide(n, in_specs, ctx, read_as)
    # ... and a Partial activation the choice above resolves to Replicate is resolved to Shard(seq)
    # instead: the op is decided again with that input read sequence-sharded (the collectives pass
    # then reduce-scatters it instead of all-reducing it)
    resolved = seq.resolved(n, in_specs, res.inputs) if seq is not None else {}
    if resolved:
        read_as = {**read_as, **resolved}
        in_specs = [read_as.get(a, s) for a, s in zip(args, in_specs)]
        res = _decide(n, in_specs, ctx, read_as)
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        info(n).spec = tuple(
            _spec_from_val(v, p) if p is not None else None for v, p in zip(val, res.outputs))
    else:
        info(n).spec = _spec_from_val(val, res.outputs)
    info(n).wants = [tuple(p) if p is not None else None for p in res.inputs]
    info(n).rule = res


def _decide(n: fx.Node, in_specs, ctx, read_as=None) -> RuleResult:
    """autopar's rule for the op if it has one that applies, else DTensor's choice; ``read_as``:
    inputs to be seen in another layout than their producer's (node -> ShardSpec)."""
    res = None
    if n.target in RULES:
        res = RULES[n.target](n, in_specs, ctx)
    if res is None:
        res = _dtensor_rule(n, in_specs, ctx, read_as or {})
    return res


def _cache_key(n: fx.Node, read_as):
    """What DTensor's choice for ``n`` depends on: the op, every argument (a tensor by its
    placements, shape, stride, dtype, whether it has other users and on which axes one of them
    reduces it, which _select_strategy weighs), whether the program returns ``n`` (which it weighs
    too), nothing else (the mesh's axis sizes: the caller's). Returns (key, shareable): key
    None if an argument is not hashable; not shareable beyond this graph if an argument is a
    node that is not a plain tensor (named by the node: a name means nothing in another graph)."""
    local = []

    def key(x):
        if isinstance(x, fx.Node):
            s, v = read_as.get(x) or spec_of(x), x.meta.get("val")
            if not isinstance(v, torch.Tensor) or s is None:
                local.append(x)
                return ("node", x.name)  # not a plain tensor: never shared
            return (tuple(s.placements), tuple(v.shape), tuple(v.stride()), v.dtype, len(x.users) > 1,
                    reduced_elsewhere(x, n, s))
        if isinstance(x, (list, tuple)):
            return tuple(key(i) for i in x)
        return x

    k = (n.target, key(tuple(n.args)), tuple((name, key(v)) for name, v in n.kwargs.items()), returned(n))
    try:
        hash(k)
    except TypeError:
        return None, False
    return k, not local


# DTensor's answers shared by every compile in the process (the tests' pools compile the same
# blocks under the same plans many times; so does a planner): keyed by ``_memo_prefix`` (the
# mesh) and _cache_key's key, which is everything else the answer depends on; bounded, emptied
# when full
_SHARED_STRATEGIES: dict = {}
# the keys of it this propagate read or wrote (autopar/disk_cache.py writes those to disk)
_USED: contextvars.ContextVar[set | None] = contextvars.ContextVar("autopar_strategies_used", default=None)
_SHARED_MAX = 200_000


def _memo_prefix(ctx) -> tuple:
    """What a DTensor answer depends on beyond ``_cache_key``: the mesh's axis sizes, its
    sequence-parallel axes (``partials.partial_through_a_copy`` reads them), and its device type
    with the devices per host (DTensor's redistribution costs read the host's topology)."""
    kind = ctx.mesh.device_type
    return (tuple(ctx.axis_sizes), tuple(sequence_axes(ctx)), kind, _devices_per_host(kind))


@functools.cache
def _devices_per_host(kind: str) -> int:
    module = getattr(torch, kind, None)
    return module.device_count() if kind not in ("cpu", "meta") and hasattr(module, "device_count") else 1


_CHECK_KEPT = os.environ.get("AUTOPAR_CHECK_KEPT_LAYOUT", "0") == "1"


def _dtensor_rule(n: fx.Node, in_specs, ctx, read_as=None) -> RuleResult:
    read_as = read_as or {}
    kept = kept_layout(n, in_specs, ctx) if tc.dtensor_knows(n.target) else None
    if kept is not None and not _CHECK_KEPT:
        return kept
    if kept is not None:  # (the check: DTensor's own answer must be the same)
        asked = _dtensor_rule_uncached(n, in_specs, ctx, read_as)
        if (asked.inputs, asked.outputs) != (kept.inputs, kept.outputs):
            raise AssertionError(f"the kept layout for {n.format_node()} ({kept.inputs} -> {kept.outputs}) is not "
                                 f"DTensor's ({asked.inputs} -> {asked.outputs})")
        return kept
    cache = ctx.strategy_cache
    k, shareable = _cache_key(n, read_as) if cache is not None else (None, False)
    if k is not None and k in cache:
        return cache[k]
    gk = (_memo_prefix(ctx), k) if k is not None and shareable else None
    res = _SHARED_STRATEGIES.get(gk) if gk is not None else None
    used = _USED.get() if gk is not None else None
    if used is not None:
        used.add(gk)
    if res is None:
        res = _dtensor_rule_uncached(n, in_specs, ctx, read_as)
        if gk is not None:
            if len(_SHARED_STRATEGIES) >= _SHARED_MAX:
                _SHARED_STRATEGIES.clear()
                disk_cache.forget_memos()  # (what it read from disk is gone too: read again when asked)
            _SHARED_STRATEGIES[gk] = res
    if k is not None:
        cache[k] = res
    if res.name.startswith(DERIVED):
        record(ctx, res)
    return res


def _dtensor_rule_uncached(n: fx.Node, in_specs, ctx, read_as=None) -> RuleResult:
    prop = tc.sharding_propagator()
    op = n.target
    known = tc.dtensor_knows(op)
    if all(all(isinstance(p, Replicate) for p in s.placements) for s in in_specs if s):
        # every rank holds the whole value: any op runs as is (also ops DTensor lacks)
        return RuleResult([s.placements for s in in_specs], _replicated_outputs(n, ctx), None,
                          "replicated")
    kept = reduced_first(n, in_specs) or partial_through_a_copy(n, in_specs, ctx)
    if kept is not None:
        return kept
    if not known and torch.Tag.pointwise in getattr(op, "tags", ()):  # elementwise: shards line up
        return pointwise_rule(n, in_specs, ctx)
    if not known:  # nobody wrote a rule: derived by running the op (autopar/derived_rules.py)
        return derive(n, in_specs, ctx)

    spec_type, meta_type = tc.DTensorSpec, tc.TensorMeta

    def to_dspec(a):
        s = (read_as or {}).get(a) or spec_of(a)
        v = a.meta["val"]
        return spec_type(ctx.mesh, s.placements, meta_type(v.shape, v.stride(), v.dtype))

    def conv(x):
        if isinstance(x, fx.Node):
            return to_dspec(x)
        if isinstance(x, (list, tuple)):
            return type(x)(conv(i) for i in x)
        return x

    schema = tc.OpSchema(op, tuple(conv(a) for a in n.args), {k: conv(v) for k, v in n.kwargs.items()},
                         schema_info=tc.dtensor_schema_info(op))
    try:
        with _choose_with(n), setting(_KNOWN, (schema, _output_meta(n.meta.get("val"))), _OUTPUT_META):
            out = prop.propagate_op_sharding_non_cached(schema)
    except TorchVersionError:
        raise
    except Exception as e:  # noqa: BLE001
        if n.target in VIEW_OPS:
            view_error(n, in_specs[0], ctx, e)
        if (own := index_put_layout(n, in_specs)) is not None:  # (torch 2.11: an index that is None)
            return own
        raise ShardingError(
            f"DTensor has no strategy for {op} with inputs "
            + ", ".join(fmt_placements(s.placements) for s in in_specs if s) + f": {e}",
            where=source_line(n) or n.name,
            fix="change the plan so this op's inputs are replicated, or add a rule in autopar/rules.py",
        ) from e
    if out.redistribute_schema is not None:
        wanted = [s.placements for s in _flat_specs(out.redistribute_schema.args_schema)
                  + _flat_specs(list(out.redistribute_schema.kwargs_schema.values()))]
    else:
        wanted = [s.placements for s in in_specs]
    if n.target in VIEW_OPS:
        check_view_keeps_shards(n, in_specs[0], wanted[0], ctx)
    outs = out.output_spec
    if isinstance(outs, (tuple, list)):
        outputs = tuple(o.placements if o is not None else None for o in outs)
    else:
        outputs = outs.placements
    return sound_indexing(n, RuleResult(wanted, outputs, None, "dtensor"))


# DTensor computes an op's output shape, stride and dtype by running it on fake tensors of a new
# FakeTensorMode (a third of its strategy choices' time); the traced graph has them already. Only
# for the schema autopar asks about, in this thread; None: the node's value is not known.
_KNOWN: contextvars.ContextVar = contextvars.ContextVar("autopar_output_meta", default=None)


def _output_meta(val):
    """What DTensor's ``_propagate_tensor_meta_non_cached`` returns for an op whose output is
    ``val`` (as a one-element tuple); None where ``val`` is not a tensor or a sequence of them."""
    def one(v):
        return tc.TensorMeta(v.shape, v.stride(), v.dtype) if isinstance(v, torch.Tensor) else None
    if isinstance(val, torch.Tensor):
        return (one(val),)
    if isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val):
        return (type(val)(one(v) for v in val),)
    return None


def _known_output_meta(op_schema):
    known = _KNOWN.get()
    return known[1] if known is not None and known[0] is op_schema else None


_OUTPUT_META = tc.known_output_meta(lambda schema: _known_output_meta(schema))  # (looked up per call: tests wrap it)


# Penalty (in DTensor's cost units, which are ~microseconds) for choices that are cheap for
# one op but costly for the program: they make DTensor's greedy choice program-aware.
INVENT = 1e6


# The node autopar is choosing a strategy for; set only inside ``_choose_with`` (per thread).
_CHOOSING: contextvars.ContextVar[fx.Node | None] = contextvars.ContextVar("autopar_choosing", default=None)


def _autopars_choice(strategy, op_schema):
    """DTensor's selector asks this first (torch_compat.strategy_selector): ``_select_strategy``
    for the node autopar is choosing for in this thread, None (DTensor's own) for every other caller."""
    node = _CHOOSING.get()
    return None if node is None else _select_strategy(node, strategy, op_schema)


_SELECTOR = tc.strategy_selector(_autopars_choice)


@contextlib.contextmanager
def _choose_with(node: fx.Node):
    """DTensor picks ``node``'s strategy with ``_select_strategy`` inside the block.

    DTensor calls its module-level ``_select_min_cost_strategy`` with no hook to pass our own,
    so the module attribute is replaced, but only while a node is being propagated (undone on
    exit, also when a rule raises; nested and concurrent propagations share one replacement),
    and the replacement consults a ContextVar: other threads, and DTensor's own dispatch outside
    this block, get DTensor's selector."""
    with setting(_CHOOSING, node, _SELECTOR), tc.fixed_views():
        yield


def _select_strategy(node: fx.Node, strategy, op_schema=None):
    """DTensor's min-cost choice plus two program-level preferences:

    - do not invent a Shard on an axis where no input is sharded (a reduce-scatter of an
      activation that later needs an all-gather: sequence parallelism is a plan, not an
      accident of greedy choice);
    - reduce a Partial value that has several consumers once, instead of carrying it along
      each consumer and reducing each result; but in the backward, where a consumer decided
      before reads it reduced, another that combines it with a partial sum kept Partial keeps it
      Partial too (the same as reading the reduced value made Partial again, which is free; the
      result is Partial either way): OLMo 2's backward, where the residual's gradient feeds the
      previous block's norm backward (reduced) and the sum with the MLP's two input gradients,
      which then needed a reduction of their own (``partials.reduced_elsewhere``: why not in
      the forward);
    - reduce a Partial value before an op that widens it, in the dtype it was computed in, as
      Megatron does: a bf16 partial sum added to an fp32 residual (Mamba's blocks add theirs so),
      where DTensor would make the other input Partial too (free for it), or cast to fp32 (Gemma
      2's norm after each branch, and the backward of every norm that casts its output down),
      where DTensor would keep the cast Partial; either way the program then reduced the fp32
      value, twice the bytes, later; and before an op that broadcasts it to more elements (the
      backward of a norm over a width tensor parallelism shards, OLMo 2's q/k norms: the
      per-token sum of the statistics' gradient, expanded to the width, where DTensor kept it
      Partial, then gathered the sharded operand it meets and reduced the whole-width product).
    """
    specs = strategy.strategies
    if len(specs) == 1 or op_schema is None:
        return specs[0]
    cur = op_schema.args_spec
    ins = tensor_args(node)
    widens = widens_a_partial(node, ins, cur)
    many = [i < len(ins) and len(ins[i].users) > 1 for i in range(len(cur))]
    # (per input: the axes on which a reader decided before reduces it; the same for every strategy)
    reduced = [reduced_elsewhere(ins[i], node, c) if m else () for i, (c, m) in enumerate(zip(cur, many))]
    best, best_key = None, None
    for spec in specs:
        base = float(sum(sum(c) for c in spec.redistribute_cost)) if spec.redistribute_cost else 0.0
        penalty, moves = 0.0, False
        desired = spec.input_specs if spec.input_specs is not None else [spec.output_spec] * len(cur)

        def kept_by_another(i: int, a: int) -> bool:
            """whether this strategy keeps an input other than ``i`` Partial on axis ``a``"""
            return any(j != i and isinstance(c.placements[a], Partial) and isinstance(d.placements[a], Partial)
                       for j, (c, d) in enumerate(zip(cur, desired)))

        for i, (c, d) in enumerate(zip(cur, desired)):
            many_users = many[i]
            narrow = widens and i < len(ins) and narrower(ins[i], node)
            for a, (pc, pd) in enumerate(zip(c.placements, d.placements)):
                if pc != pd:
                    moves = True
                if isinstance(pc, Partial) and isinstance(pd, Shard):
                    penalty += INVENT
                if isinstance(pc, Partial) and isinstance(pd, Partial) and many_users \
                        and not (a in reduced[i] and kept_by_another(i, a)):
                    penalty += INVENT
                # (a Replicate made Partial beside it, or the narrower Partial kept Partial)
                if widens and isinstance(pd, Partial) and (isinstance(pc, Replicate) or narrow):
                    penalty += INVENT
        outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        for o in outs:
            if o is None:
                continue
            for a, po in enumerate(o.placements):
                if isinstance(po, Shard) and not any(isinstance(c.placements[a], Shard) for c in cur):
                    penalty += INVENT
        key = (base + penalty, moves)
        if best_key is None or key < best_key:
            best, best_key = spec, key
    return best


def _flat_specs(args) -> list:
    """The DTensorSpecs among ``args`` (lists flattened)."""
    spec_type = tc.DTensorSpec
    out = []
    for a in args:
        if isinstance(a, spec_type):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, spec_type))
    return out


def _replicated_outputs(n: fx.Node, ctx):
    val = n.meta.get("val")
    rep = tuple(Replicate() for _ in ctx.axis_names)
    if isinstance(val, (tuple, list)):
        return tuple(rep if isinstance(v, torch.Tensor) else None for v in val)
    return rep
