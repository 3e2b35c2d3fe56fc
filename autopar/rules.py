"""autopar's own sharding rules: overrides and ops DTensor lacks.

DTensor's registered op strategies are the default rule source (see passes/propagate.py).
A rule here takes precedence for its ops. Each rule is a function

    rule(node, in_specs, ctx) -> RuleResult | None

that returns ``None`` when it does not apply (the propagator then asks DTensor). A result
names the placements each tensor input must have (the collectives pass makes it so), the
placements of each output, and, when the op cannot simply run on local shards, a local
implementation. An implementation may contain collectives; they are traced into the per-rank
graph like any other and tagged with the rule's name as their reason.

Every rule is checked against the unsharded op by tests/test_rules.py; those for parts of a
sharded dim (autopar/rules_parts.py) by tests/test_hf_breadth.py's GPT-2 and gpt-oss cases.
"""

from __future__ import annotations


import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autopar import torch_compat as tc
from autopar.errors import PlanError
from autopar.ir import RuleResult, ShardSpec, source_line
from autopar.experts import MOE_OPS, ep_impl, expert_axes
from autopar.layout import ring_axes, ulysses_axes
from autopar.rule_registry import RULES, norm_dim, rule  # noqa: F401 (RULES: re-exported for propagate)
from autopar import rules_parts  # noqa: F401,E402 - registers its rules in RULES
from autopar.ring import kv_repeat, ring_impl

aten = torch.ops.aten
R = Replicate()
PSUM = Partial("sum")


# (the registry is shared with autopar/rules_parts.py: split / cat / slice of a sharded dim's parts)
_norm = norm_dim


def _shard_dim(p: Placement) -> int | None:
    return p.dim if isinstance(p, Shard) else None


def _offset(ctx, axes: list[int], local_size: int) -> int:
    """Global index of this rank's first element along a dim sharded over ``axes``."""
    idx = 0
    for a in axes:
        idx = idx * ctx.axis_sizes[a] + ctx.coord[a]
    return idx * local_size


def _all_reduce(ctx, x: torch.Tensor, op: str, axes: list[int]) -> torch.Tensor:
    for a in axes:
        x = ctx.all_reduce(x, op, a)
    return x


# ---------------------------------------------------------------------------------------
# attention: shards over batch and heads


def _attention_rule(q_pos: int, n_tensor_in: int, n_out: int | None):
    def attention_rule(node: fx.Node, in_specs: list[ShardSpec], ctx) -> RuleResult | None:
        """Keeps Shard(0) (batch) and Shard(1) (heads) of q on every tensor input and output;
        anything else (sequence shards, Partial) is replicated first: attention mixes the
        sequence, and softmax is not linear. An attn_mask follows q's batch/head shards on
        the dims it does not broadcast, and is replicated on the others."""
        q = in_specs[q_pos]
        want = tuple(p if isinstance(p, Shard) and p.dim in (0, 1) else R for p in q.placements)
        cp = ulysses_axes(ctx)
        if cp:  # {"cp": "ulysses"}: heads sharded over the axis (autopar/layout.py), whatever q holds
            _check_heads_divide(node, in_specs[q_pos:q_pos + 3], cp, ctx)
            want = tuple(Shard(1) if a in cp else p for a, p in enumerate(want))
        ring = ring_axes(ctx)
        if ring:  # {"cp": "context"}: the sequence stays sharded, the ring runs inside (autopar/ring.py)
            _check_ring(node, ctx)
            want = tuple(Shard(2) if a in ring else p for a, p in enumerate(want))
        ins = [want] * n_tensor_in
        for mask in in_specs[n_tensor_in:]:  # attn_mask [B|1, H|1, S, S]: shard where not broadcast
            m = tuple(p if isinstance(p, Shard) and mask.shape[p.dim] == q.shape[p.dim] and len(mask.shape) == 4
                      and a not in ring else R for a, p in enumerate(want))
            ins.append(m)
        outs = want if n_out is None else tuple(want for _ in range(n_out))
        if ring:
            name = ctx.axis_names[ring[0]]
            return RuleResult(ins, outs, ring_impl(node.target, ring[0], kv_repeat(node)),
                              f"ring attention ({name}=context)")
        return RuleResult(ins, outs, None, "attention over batch/heads")

    return attention_rule


def _check_ring(node, ctx) -> None:
    """Ring attention takes what the fused CPU op takes, without dropout."""
    names = [a.name for a in node.target._schema.arguments]
    args = {**dict(zip(names, node.args)), **node.kwargs}
    if args.get("dropout_p", 0.0) or args.get("enable_gqa", False):
        what = "attention dropout" if args.get("dropout_p", 0.0) else "enable_gqa"
        raise PlanError(f"ring attention ({{'cp': 'context'}}) does not run {what}", where=source_line(node) or node.name,
                        fix="set the attention dropout to 0 / repeat the KV heads, or use {'cp': 'ulysses'}")


def _check_heads_divide(node, qkv: list[ShardSpec], axes: list[int], ctx) -> None:
    """Ulysses shards attention's heads over its axes: q's heads and k's / v's (grouped-query
    attention's KV heads, when the model hands them to attention without repeating them) must divide."""
    k = ctx.prod(axes)
    names = ", ".join(f"'{ctx.axis_names[a]}'" for a in axes)
    for what, spec in zip(("query", "key", "value"), qkv):
        heads = spec.shape[1]
        # heads other axes already shard (tensor parallelism: megatron splits the heads over tp)
        # leave fewer for the Ulysses axes to split
        other = [a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim == 1 and a not in axes]
        by = ctx.prod(other) if other else 1
        if heads % (k * by):
            also = (f" after mesh axis {', '.join(repr(ctx.axis_names[a]) for a in other)} ({by} ranks) sharded "
                    f"them ({heads // by if heads % by == 0 else heads / by:g} per rank)" if other else "")
            raise PlanError(
                f"Ulysses context parallelism shards attention heads over mesh axis {names} ({k} ranks), but the "
                f"{what} has {heads} heads (shape {list(spec.shape)}){also}, not divisible by {k}",
                where=source_line(node) or node.name,
                fix=f"use a context-parallel size that divides the number of heads ({heads}) and of KV heads "
                "(a model that repeats its KV heads before attention needs only the heads to divide)"
                + (" per tensor-parallel rank: cp x tp must divide them" if other else ""))


rule(aten._scaled_dot_product_flash_attention_for_cpu.default)(_attention_rule(0, 3, 2))
rule(aten.scaled_dot_product_attention.default)(_attention_rule(0, 3, None))  # the eval program's (one output)
rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)(_attention_rule(1, 6, 3))

# autopar's own kernels (autopar/kernels/ops.py; the lower pass puts them in the graph): the same
# batch/head rule; flash_attention(q, k, v, bias?) -> (out, lse), its backward
# (do, q, k, v, out, lse, bias?) -> (dq, dk, dv)
import autopar.kernels.ops  # noqa: E402,F401 - registers torch.ops.autopar.*

autopar_ops = torch.ops.autopar
rule(autopar_ops.flash_attention.default)(_attention_rule(0, 3, 2))
rule(autopar_ops.flash_attention_backward.default)(_attention_rule(1, 6, 3))
ATTENTION_OPS = {aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                 aten.scaled_dot_product_attention.default,
                 autopar_ops.flash_attention.default, autopar_ops.flash_attention_backward.default}


@rule(autopar_ops.linear_act.default)
def linear_act_rule(node, in_specs, ctx):
    """y = act(x @ w.T + b), per mesh axis: a batch-like shard of x (not its last dim) passes
    through with w replicated; a column-parallel w (Shard(0)) gives a last-dim-sharded output with
    x replicated; anything else (a row-parallel w would need the sum before the activation) runs
    replicated."""
    x, w = in_specs[0], in_specs[1]
    nd = len(x.shape)
    xs, ws, bs, out = [], [], [], []
    for a in range(len(ctx.axis_sizes)):
        px, pw = x.placements[a], w.placements[a]
        if isinstance(px, Shard) and px.dim < nd - 1:
            xs.append(px), ws.append(R), bs.append(R), out.append(px)
        elif isinstance(pw, Shard) and pw.dim == 0:
            xs.append(R), ws.append(pw), bs.append(pw), out.append(Shard(nd - 1))
        else:
            xs.append(R), ws.append(R), bs.append(R), out.append(R)
    ins = [tuple(xs), tuple(ws)] + ([tuple(bs)] if len(in_specs) > 2 else [])
    return RuleResult(ins, (tuple(out), tuple(out)), None, "linear + activation (batch or column parallel)")


@rule(autopar_ops.linear_act_backward.default)
def linear_act_backward_rule(node, in_specs, ctx):
    """(dy, x, w, z) -> (dx, dw, db), mirroring the forward's choice on each axis: batch-sharded
    -> dx sharded, dw / db partial sums; column-parallel -> dx a partial sum, dw / db sharded."""
    dy, x, w, z = in_specs
    nd = len(x.shape)
    ins: list[list] = [[], [], [], []]
    dx, dw, db = [], [], []
    for a in range(len(ctx.axis_sizes)):
        px, pw = x.placements[a], w.placements[a]
        if isinstance(px, Shard) and px.dim < nd - 1:
            for i, p in enumerate((px, px, R, px)):
                ins[i].append(p)
            dx.append(px), dw.append(PSUM), db.append(PSUM)
        elif isinstance(pw, Shard) and pw.dim == 0:
            for i, p in enumerate((Shard(nd - 1), R, pw, Shard(nd - 1))):
                ins[i].append(p)
            dx.append(PSUM), dw.append(pw), db.append(Shard(0))
        else:
            for i in range(4):
                ins[i].append(R)
            dx.append(R), dw.append(R), db.append(R)
    return RuleResult([tuple(p) for p in ins], (tuple(dx), tuple(dw), tuple(db)), None,
                      "linear + activation backward")


# ---------------------------------------------------------------------------------------
# vocab-parallel log-softmax / nll-loss: the class dim stays sharded, logits are never gathered


def _rows_or_classes(x: ShardSpec) -> tuple[Placement, ...]:
    """Shard(class) and Shard(row) survive, and rows strided-sharded (``[b, s, V]`` flattened with
    its sequence sharded: context parallelism); Partial must be reduced first (log is not linear)."""
    return tuple(p if isinstance(p, Shard) or (isinstance(p, tc.StridedShard) and p.dim < len(x.shape) - 1)
                 else R for p in x.placements)


@rule(aten._log_softmax.default)
def log_softmax_rule(node, in_specs, ctx):
    """Keeps any Shard. On axes that shard the softmax dim it computes max and sum-of-exp
    locally and all-reduces them (max, then sum): two small all-reduces instead of gathering
    the logits. Partial inputs are reduced first."""
    (x,) = in_specs
    dim = _norm(node.args[1], len(x.shape))
    want = _rows_or_classes(x)
    axes = [a for a, p in enumerate(want) if _shard_dim(p) == dim]
    if not axes:
        return RuleResult([want], want, None, "log_softmax on local rows")

    def impl(ctx, x, dim_, half_to_float):
        xf = x.float() if half_to_float else x
        m = _all_reduce(ctx, xf.amax(dim, keepdim=True), "max", axes)
        s = _all_reduce(ctx, (xf - m).exp().sum(dim, keepdim=True), "sum", axes)
        return xf - m - s.log()

    return RuleResult([want], want, impl, "vocab-parallel log_softmax")


@rule(aten._log_softmax_backward_data.default)
def log_softmax_backward_rule(node, in_specs, ctx):
    """grad_in = grad - exp(out) * sum(grad): the sum over a sharded softmax dim is all-reduced."""
    grad, out = in_specs
    dim = _norm(node.args[2], len(out.shape))
    want = _rows_or_classes(out)
    axes = [a for a, p in enumerate(want) if _shard_dim(p) == dim]
    if not axes:
        return RuleResult([want, want], want, None, "log_softmax backward on local rows")

    def impl(ctx, grad, out, dim_, dtype):
        s = _all_reduce(ctx, grad.sum(dim, keepdim=True), "sum", axes)
        return (grad - out.exp() * s).to(dtype)

    return RuleResult([want, want], want, impl, "vocab-parallel log_softmax backward")


def _nll_layout(x: ShardSpec, target: ShardSpec | None):
    """Per axis: 'row' (batch-sharded), 'class' (vocab-sharded) or 'rep'."""
    kinds, xs, ts = [], [], []
    for p in x.placements:
        if isinstance(p, Shard) and p.dim == 0 and len(x.shape) == 2:
            kinds.append("row"), xs.append(Shard(0)), ts.append(Shard(0))
        elif isinstance(p, tc.StridedShard) and p.dim == 0 and len(x.shape) == 2:
            # rows of a flattened [b, s, V] whose sequence is sharded (context parallelism): the
            # targets, flattened the same way, hold the same rows
            kinds.append("row"), xs.append(p), ts.append(p)
        elif isinstance(p, Shard) and p.dim == len(x.shape) - 1:
            kinds.append("class"), xs.append(p), ts.append(R)
        else:
            kinds.append("rep"), xs.append(R), ts.append(R)
    return kinds, tuple(xs), tuple(ts)


def _picked(ctx, x, target, ignore_index, class_axes):
    """-x[i, target[i]] where this rank holds class target[i], else 0; and the valid mask."""
    c_local = x.shape[-1]
    offset = _offset(ctx, class_axes, c_local) if class_axes else 0
    valid = target != ignore_index
    t = target - offset
    here = valid & (t >= 0) & (t < c_local)
    idx = torch.where(here, t, torch.zeros_like(t)).unsqueeze(-1)
    return idx, here, valid


@rule(aten.nll_loss_forward.default)
def nll_loss_forward_rule(node, in_specs, ctx):
    """Batch-sharded rows and/or vocab-sharded classes, exact with ignore_index.

    DTensor's own rule reduces a batch-sharded mean with Partial("avg"), which is wrong when
    ranks hold different numbers of ignored tokens; this one all-reduces the loss sum and the
    token count separately. On vocab-sharded axes each rank picks the target logit only where
    it owns the class, so the logits are never gathered. Class weights are supported on
    batch-sharded axes only (a weight with vocab-sharded logits replicates the logits)."""
    x, target = in_specs[0], in_specs[1]
    weight = in_specs[2] if len(in_specs) > 2 else None
    reduction, ignore_index = node.args[3], node.args[4]
    if len(x.shape) not in (1, 2):
        return None
    kinds, xs, ts = _nll_layout(x, target)
    if weight is not None and "class" in kinds:
        kinds = ["rep" if k == "class" else k for k in kinds]
        xs = tuple(R if k == "rep" else p for k, p in zip(kinds, xs))
    row_axes = [a for a, k in enumerate(kinds) if k == "row"]
    class_axes = [a for a, k in enumerate(kinds) if k == "class"]
    ins = [xs, ts] + ([tuple(R for _ in xs)] if weight is not None else [])
    if reduction == 0:  # none: per-row loss, partial over the class axes
        out = tuple(t if k == "row" else PSUM if k == "class" else R for k, t in zip(kinds, ts))
    else:  # sum and mean: reduced inside (the mean needs the global count first)
        out = tuple(R for _ in kinds)
    tw_out = tuple(R for _ in kinds)

    def impl(ctx, x, target, weight, reduction_, ignore_index_):
        idx, here, valid = _picked(ctx, x, target, ignore_index, class_axes)
        picked = torch.where(here, x.gather(-1, idx).squeeze(-1), torch.zeros((), dtype=x.dtype))
        w = valid.to(x.dtype)
        if weight is not None:
            w = w * weight[torch.where(valid, target, torch.zeros_like(target))]
        loss = -picked * w
        if reduction == 0:
            return loss, torch.zeros((), dtype=x.dtype)
        s = _all_reduce(ctx, loss.sum(), "sum", row_axes + class_axes)
        tw = _all_reduce(ctx, w.sum(), "sum", row_axes)
        return (s / tw if reduction == 1 else s), tw

    return RuleResult(ins, (out, tw_out), impl, "nll_loss over sharded rows/classes")


@rule(aten.nll_loss_backward.default)
def nll_loss_backward_rule(node, in_specs, ctx):
    """The gradient is local: each rank scatters -grad/total_weight into the rows and classes
    it holds. Needs the global total_weight, which the forward rule returns replicated."""
    _grad_out, x, target = in_specs[0], in_specs[1], in_specs[2]
    has_weight = len(in_specs) == 5
    reduction, ignore_index = node.args[4], node.args[5]
    if len(x.shape) not in (1, 2):
        return None
    kinds, xs, ts = _nll_layout(x, target)
    if has_weight and "class" in kinds:
        kinds = ["rep" if k == "class" else k for k in kinds]
        xs = tuple(R if k == "rep" else p for k, p in zip(kinds, xs))
    class_axes = [a for a, k in enumerate(kinds) if k == "class"]
    rep = tuple(R for _ in kinds)
    g = tuple(t if k == "row" else R for k, t in zip(kinds, ts)) if reduction == 0 else rep
    ins = [g, xs, ts] + ([rep] if has_weight else []) + [rep]

    def impl(ctx, grad_out, x, target, weight, reduction_, ignore_index_, total_weight):
        idx, here, valid = _picked(ctx, x, target, ignore_index, class_axes)
        w = valid.to(x.dtype)
        if weight is not None:
            w = w * weight[torch.where(valid, target, torch.zeros_like(target))]
        g = grad_out / total_weight if reduction == 1 else grad_out
        val = torch.where(here, -g * w, torch.zeros((), dtype=x.dtype))
        return torch.zeros_like(x).scatter(-1, idx, val.unsqueeze(-1))

    return RuleResult(ins, xs, impl, "nll_loss backward over sharded rows/classes")


# ---------------------------------------------------------------------------------------
# vocab-parallel embedding


@rule(aten.embedding.default)
def embedding_rule(node, in_specs, ctx):
    """weight Shard(0) (vocab) with replicated indices: each rank looks up the tokens it owns
    and zeroes the rest, giving Partial(sum). weight Shard(1) (hidden) gives a hidden-sharded
    output. Sharded indices (batch) give the same sharding of the output. Every other
    combination replicates the weight on that axis."""
    weight, idx = in_specs
    ws, xs, outs = [], [], []
    nd = len(idx.shape)
    for pw, pi in zip(weight.placements, idx.placements):
        if isinstance(pw, Shard) and pw.dim == 0:
            ws.append(pw), xs.append(R), outs.append(PSUM)
        elif isinstance(pw, Shard) and pw.dim == 1 and not isinstance(pi, Shard):
            ws.append(pw), xs.append(R), outs.append(Shard(nd))
        elif isinstance(pi, Shard):
            ws.append(R), xs.append(pi), outs.append(pi)
        else:
            ws.append(R), xs.append(R), outs.append(R)
    vocab_axes = [a for a, p in enumerate(outs) if isinstance(p, Partial)]
    ins = [tuple(ws), tuple(xs)]
    if not vocab_axes:
        return RuleResult(ins, tuple(outs), None, "embedding")

    def impl(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
        v_local = weight.shape[0]
        t = indices - _offset(ctx, vocab_axes, v_local)
        here = (t >= 0) & (t < v_local)
        out = aten.embedding(weight, torch.where(here, t, torch.zeros_like(t)))
        return out * here.unsqueeze(-1).to(out.dtype)

    return RuleResult(ins, tuple(outs), impl, "vocab-parallel embedding")


@rule(aten.embedding_dense_backward.default)
def embedding_backward_rule(node, in_specs, ctx):
    """Produces the weight gradient in the layout its consumer wants (the parameter's
    placement, known from the plan): Shard(0) from replicated tokens by masking, Partial(sum)
    from batch-sharded tokens (reduced by the collectives pass), Shard(1) from hidden-sharded
    gradients."""
    grad, idx = in_specs
    scale_by_freq = node.args[4] if len(node.args) > 4 else False
    hint = ctx.output_hint(node)
    gs, xs, outs = [], [], []
    for a, (pg, pi) in enumerate(zip(grad.placements, idx.placements)):
        want = hint[a] if hint else R
        if isinstance(pi, Shard) and isinstance(pg, Shard) and pg.dim == pi.dim and not scale_by_freq:
            gs.append(pg), xs.append(pi), outs.append(PSUM)
        elif isinstance(want, Shard) and want.dim == 0 and not scale_by_freq:
            gs.append(R), xs.append(R), outs.append(Shard(0))
        elif isinstance(pg, Shard) and pg.dim == len(grad.shape) - 1:
            gs.append(pg), xs.append(R), outs.append(Shard(1))
        else:
            gs.append(R), xs.append(R), outs.append(R)
    vocab_axes = [a for a, p in enumerate(outs) if p == Shard(0)]
    ins = [tuple(gs), tuple(xs)]
    if not vocab_axes:
        return RuleResult(ins, tuple(outs), None, "embedding backward")

    def impl(ctx, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
        v_local = num_weights // ctx.prod(vocab_axes)
        off = _offset(ctx, vocab_axes, v_local)
        t = indices - off
        here = (t >= 0) & (t < v_local)
        g = grad * here.unsqueeze(-1).to(grad.dtype)
        pad = padding_idx - off if 0 <= padding_idx - off < v_local else -1
        return aten.embedding_dense_backward(g, torch.where(here, t, torch.zeros_like(t)), v_local, pad, False)

    return RuleResult(ins, tuple(outs), impl, "vocab-parallel embedding backward")


# ---------------------------------------------------------------------------------------
# elementwise ops DTensor has no strategy for


def _elementwise(node, in_specs, ctx, out_shape, name, first=0):
    """Inputs broadcast to ``out_shape``. Per mesh axis, the first input (from ``in_specs[first]``
    on) sharded on a dim it does not broadcast gives the output that shard; every input follows it
    (Shard of that dim, or Replicate where the input broadcasts it); Partial is reduced first (the
    op need not be linear)."""
    nd = len(out_shape)
    specs = [s for s in in_specs if s is not None]
    ins: list[list] = [[] for _ in specs]
    outs = []

    def full_dim(s, d):  # the output dim of input dim d, if the input does not broadcast it
        od = d + nd - len(s.shape)
        return od if 0 <= od < nd and s.shape[d] == out_shape[od] else None

    for a in range(len(ctx.axis_sizes)):
        od = next((full_dim(s, p.dim) for s in specs[first:] + specs[:first] for p in [s.placements[a]]
                   if isinstance(p, Shard) and full_dim(s, p.dim) is not None), None)
        for i, s in enumerate(specs):
            d = od - (nd - len(s.shape)) if od is not None else None
            ins[i].append(Shard(d) if d is not None and d >= 0 and full_dim(s, d) == od else R)
        outs.append(Shard(od) if od is not None else R)
    it = iter(tuple(p) for p in ins)
    return RuleResult([next(it) if s is not None else None for s in in_specs], tuple(outs), None, name)


# not tagged pointwise in torch, and so unknown to DTensor's pointwise strategies
POINTWISE_UNTAGGED = {aten.softplus_backward.default}


def elementwise(op) -> bool:
    """An elementwise aten op: torch's pointwise tag, or one of ``POINTWISE_UNTAGGED``."""
    return torch.Tag.pointwise in getattr(op, "tags", ()) or op in POINTWISE_UNTAGGED


def pointwise_rule(node, in_specs, ctx):
    """Any elementwise op (torch's pointwise tag, or ``POINTWISE_UNTAGGED``) DTensor lacks."""
    return _elementwise(node, in_specs, ctx, tuple(node.meta["val"].shape), "elementwise")


for _op in POINTWISE_UNTAGGED:
    rule(_op)(pointwise_rule)


def kept_layout(n: fx.Node, in_specs, ctx) -> RuleResult | None:
    """DTensor's choice for an elementwise op whose tensor inputs all have the output's shape and
    one layout (the same placements, Shard and Replicate only, each sharded dimension divisible
    by its ranks), found without asking DTensor: that layout kept, in and out. DTensor's strategies
    for such an op include it at zero redistribution cost, ``_select_strategy`` adds no penalty to
    it (no Partial, no Shard invented) and prefers it to any other zero-cost one (which would move
    an input): so it is the answer DTensor's expansion, 4-10 ms an op on a 2-D mesh, ends in (40 of
    the 177 DTensor queries of Hugging Face Llama-3-8B on dp=8 x tp=8; ``AUTOPAR_CHECK_KEPT_LAYOUT=1``
    asks DTensor too and compares, as tests/test_rules.py does; passes/propagate.py asks this first
    for an op DTensor knows). ``_to_copy`` (a cast) is elementwise but not tagged pointwise. None
    where that does not hold."""
    op = n.target
    if not (op is _TO_COPY or torch.Tag.pointwise in getattr(op, "tags", ())) or \
            torch.Tag.nondeterministic_seeded in op.tags or op._schema.is_mutable or not in_specs:
        return None
    out = n.meta.get("val")
    first = in_specs[0]
    if not isinstance(out, torch.Tensor) or any(s is None or s.placements != first.placements
                                                or tuple(s.shape) != tuple(out.shape) for s in in_specs):
        return None
    if any(isinstance(v, fx.Node) for v in n.kwargs.values()):
        return None
    ways: dict[int, int] = {}
    for a, p in enumerate(first.placements):
        if type(p) is Shard:
            ways[p.dim] = ways.get(p.dim, 1) * ctx.axis_sizes[a]
        elif type(p) is not Replicate:
            return None
    if not ways or any(d >= out.ndim or out.shape[d] % k for d, k in ways.items()):
        return None
    kept = tuple(first.placements)
    return RuleResult([kept] * len(in_specs), kept, None, "dtensor")


_TO_COPY = torch.ops.aten._to_copy.default


@rule(aten.copy.default)
def copy_rule(node, in_specs, ctx):
    """copy(dst, src): the functional form of ``dst.copy_(src)`` (src broadcast to dst's shape and
    dtype; dst's values are not read): elementwise in src, with dst following its layout."""
    return _elementwise(node, in_specs, ctx, in_specs[0].shape, "copy (elementwise)", first=1)


@rule(*MOE_OPS)
def moe_rule(node, in_specs, ctx):
    """autopar::moe_experts(x, idx, w, w_gate, w_up, w_down) and its backward (g first; outputs
    dx, dw, and the three expert weights' gradients). Per mesh axis: on an "expert" axis every
    input is Shard(0) (tokens: this rank's batch; weights: its experts) and so is every output,
    the weights' gradients complete (the tokens came to their expert's owner; autopar/experts.py
    runs the all-to-alls); on an axis where the tokens are Shard(0) (data parallel) the weights
    are replicated, their gradients Partial sums; elsewhere everything is replicated (the tokens'
    Partial is reduced first: the experts are not linear)."""
    backward = node.target is MOE_OPS[1]
    n_tok = 4 if backward else 3  # (g), x, idx, w: one row per token
    ep = expert_axes(ctx)
    ins: list[list] = [[] for _ in in_specs]
    outs: list[list] = [[] for _ in range(5 if backward else 1)]
    for a, p in enumerate(in_specs[0].placements):
        if a in ep:
            tok, weight, grad = Shard(0), Shard(0), Shard(0)
        elif isinstance(p, Shard) and p.dim == 0:
            tok, weight, grad = Shard(0), R, PSUM
        else:
            tok, weight, grad = R, R, R
        for i, s in enumerate(ins):
            s.append(tok if i < n_tok else weight)
        for i, s in enumerate(outs):
            s.append(tok if i < (2 if backward else 1) else grad)
    outputs = tuple(tuple(o) for o in outs) if backward else tuple(outs[0])
    if ep:
        return RuleResult([tuple(i) for i in ins], outputs, ep_impl(ep[0], backward),
                          f"expert parallel ({ctx.axis_names[ep[0]]}=expert)")
    return RuleResult([tuple(i) for i in ins], outputs, None, "experts over tokens")
