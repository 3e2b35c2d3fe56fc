"""Sharding rules for ops nobody wrote one for, derived by running them.

An op that neither autopar (autopar/rules.py) nor DTensor has a rule for, and that is not tagged
elementwise (a third-party custom op, a new aten op), used to stop the compile with "no sharding
rule". Under a data-parallel axis that is no reason to refuse: every rank may well run the op on
its own rows, as DDP would. ``derive`` decides it per mesh axis from what the op does:

1. the inputs as they arrive on that axis (each sharded on its dim, strided-sharded as a fused
   projection's weight is, or whole): the op runs on random inputs of the traced shapes whole,
   and on each rank's pieces of them one rank at a time; each output must be the pieces' outputs
   put together: concatenated on one dim (sharded there), in the strided layout of an input
   (strided-sharded), all equal to the whole (replicated) or summing to it (a partial sum).
   Checked with two seeds, so a coincidence does not pass. An input that arrives as a pending
   partial sum is reduced first (the op is not known to be linear in it), the others kept.
   Inputs past ``MAX_ELEMENTS`` (planning at scale) are run on shapes scaled down, each distinct
   large size to its own small one;
2. else (or where it cannot be run here: a mutating op, a non-tensor input, an op that raises on
   random values) the inputs are gathered whole on that axis, the op runs replicated, and the
   reason says so; propagate then inserts the collective, which the program's communication
   lists like any other.

What was derived is cached per op, torch version, shapes, dtypes and input placements for the
process, and each decision is recorded in ``ctx.derived_rules`` (``pm.report()``, ``autopar
explain``). The derived rule runs the op itself on each rank's local values (localize runs ops
that no DTensor rule decided as they are).
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import torch_compat as tc
from autopar.ir import RuleResult, fmt_placements, tensor_args

MAX_ELEMENTS = 1 << 20  # per input: larger traced shapes (planning at scale) are run scaled down
_SMALL = 64  # sizes up to this are kept when scaling down
SEEDS = (0, 1)
DERIVED = "derived by running the op: "  # the RuleResult's name starts so
_CACHE: dict = {}


def derive(n: fx.Node, in_specs, ctx) -> RuleResult:
    """The rule for ``n`` (an op with no rule) given its inputs' specs on ``ctx``'s mesh."""
    args = tensor_args(n)
    placements = tuple(tuple(s.placements) for s in in_specs)
    key = (n.target, torch.__version__, tuple(ctx.axis_sizes), placements,
           tuple(_sig(a.meta.get("val")) for a in args), _constants(n))
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE[key] = _derive(n, args, placements, ctx)
    inputs, outputs, why = hit
    return RuleResult([tuple(p) for p in inputs], outputs, None, f"{DERIVED}{n.target}: {why}")


def record(ctx, rule: RuleResult) -> None:
    """Note a derived rule in ``ctx.derived_rules`` (once per decision), also when propagate's
    cache answered for it."""
    if rule.name.startswith(DERIVED) and rule.name[len(DERIVED):] not in ctx.derived_rules:
        ctx.derived_rules.append(rule.name[len(DERIVED):])


def _sig(v):
    return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(type(v))


def _constants(n: fx.Node):
    def c(x):
        if isinstance(x, fx.Node):
            return "node"
        if isinstance(x, (list, tuple)):
            return tuple(c(i) for i in x)
        return x if isinstance(x, (int, float, bool, str, type(None))) else repr(type(x))
    return c(tuple(n.args)), tuple((k, c(v)) for k, v in n.kwargs.items())


def _derive(n: fx.Node, args, placements, ctx):
    """(input placements, output placements, the reason in words)."""
    val = n.meta.get("val")
    multi = isinstance(val, (tuple, list))
    outs = list(val) if multi else [val]
    n_axes = len(ctx.axis_sizes)
    ins = [list(p) for p in placements]
    out_p = [[None if not isinstance(o, torch.Tensor) else Replicate() for _ in range(n_axes)] for o in outs]
    said = []
    for axis in range(n_axes):
        given = [p[axis] for p in placements]
        if all(isinstance(p, Replicate) for p in given):
            continue  # whole on this axis: the op runs as is
        name = ctx.axis_names[axis]
        pending = [i for i, p in enumerate(given) if isinstance(p, Partial)]
        if pending:  # a pending partial sum is reduced first (the op is not known to be linear in it)
            given = [Replicate() if i in pending else p for i, p in enumerate(given)]
            for i in pending:
                ins[i][axis] = Replicate()
        found, why = _check(n, args, given, ctx.axis_sizes[axis], outs)
        aligned = aligned_indices([a.meta.get("val") for a in args], given) if found is None else {}
        if aligned:  # an index (no gradient) as long as the split dim: split it too
            given = [aligned[i] if i in aligned else p for i, p in enumerate(given)]
            found, why = _check(n, args, given, ctx.axis_sizes[axis], outs)
            if found is not None:
                for i, p in aligned.items():
                    ins[i][axis] = p
                why += "; the index inputs split with it"
        if found is None:  # gathered whole on this axis
            for p in ins:
                p[axis] = Replicate()
            said.append(f"on {name}: inputs gathered whole, the op replicated ({why})")
            continue
        for o, pl in zip(out_p, found):
            if pl is not None:
                o[axis] = pl
        if pending:
            why += "; its partial-sum inputs reduced first"
        said.append(f"on {name}: inputs {', '.join(_fmt(p) for p in given)} -> outputs "
                    f"{', '.join(_fmt(p) for p in found if p is not None)} ({why})")
    outputs = tuple(tuple(o) if o[0] is not None else None for o in out_p)
    return [tuple(p) for p in ins], (outputs if multi else outputs[0]), "; ".join(said) or "replicated"


def aligned_indices(vals, given) -> dict:
    """{i: the placement} for the integer / bool inputs (an index: no gradient) that arrive whole
    but have as many dims as an input split on one dim, and the same size there: splitting them
    the same way is free (each rank slices its copy), and is what an op such as
    ``gather(x, -1, idx)`` with ``x`` split by heads needs to run where it is."""
    split = [(p, v) for p, v in zip(given, vals) if isinstance(p, (Shard, tc.StridedShard))
             and isinstance(v, torch.Tensor)]
    if len({(p.dim, _factor(p)) for p, _ in split}) != 1:
        return {}
    p, ref = split[0]
    return {i: p for i, (q, v) in enumerate(zip(given, vals)) if isinstance(q, Replicate) and isinstance(v, torch.Tensor)
            and not (v.dtype.is_floating_point or v.dtype.is_complex) and v.dim() == ref.dim()
            and v.shape[p.dim] == ref.shape[p.dim]}


def _fmt(p) -> str:
    return fmt_placements((p,))[1:-1]  # one placement, without the tuple's parentheses


def _check(n: fx.Node, args, given, size: int, outs):
    """Output placements that make chunk-wise runs equal the whole run, or (None, why not)."""
    return measure(n, args, [a.meta.get("val") for a in args], given, size)


def measure(n: fx.Node, args, vals, given, size: int):
    """How ``n``'s outputs come out when its tensor inputs ``args`` (traced values ``vals``) are
    split as ``given`` over ``size`` ranks: (a placement per output, None for a non-tensor, in
    words how it was checked), or (None, why it could not be). Also used by the tensor-parallel
    derivation (autopar/analysis/tp_measured.py) to follow an op it has no table entry for.

    Inputs past ``MAX_ELEMENTS`` are checked on shapes scaled down (each distinct large size to
    its own small one, divisible as the split needs), the reason says so."""
    schema = getattr(n.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return None, "it writes to an input"
    if any(isinstance(p, Partial) for p in given):
        return None, "an input is a pending partial sum"
    if any(not isinstance(v, torch.Tensor) for v in vals):
        return None, "an input is not a tensor"
    factors = sorted({p.split_factor for p in given if isinstance(p, tc.StridedShard)})
    for p, v in zip(given, vals):
        if _split_dim(p) is not None and v.shape[p.dim] % (size * _factor(p)):
            return None, f"a sharded dim ({v.shape[p.dim]}) does not split into {size}"
    shapes, scaled = _shapes(vals, given, size)
    if shapes is None:
        return None, f"inputs larger than {MAX_ELEMENTS} elements that cannot be scaled down to check it"
    found = None
    for seed in SEEDS:
        try:
            whole_in = _random(shapes, [v.dtype for v in vals], seed)
            whole = _outputs(n, args, whole_in)
            parts = [_outputs(n, args, [_local(x, p, i, size) for x, p in zip(whole_in, given)])
                     for i in range(size)]
        except Exception as e:  # noqa: BLE001 - the op cannot be checked on random values
            return None, f"running it on random inputs raised {type(e).__name__}"
        got = [_placement(w, [pt[j] for pt in parts], factors) if isinstance(w, torch.Tensor) else None
               for j, w in enumerate(whole)]
        if any(g is False for g in got):
            return None, "its chunk-wise results do not make up the whole"
        if found is not None and got != found:
            return None, "the seeds disagree"
        found = got
    how = f"checked by running it whole and in {size} chunks on random inputs, {len(SEEDS)} seeds"
    return found, how + (f", on shapes scaled down to {', '.join(str(list(s)) for s in shapes)}" if scaled else "")


def _split_dim(p):
    return p.dim if isinstance(p, (Shard, tc.StridedShard)) else None


def _factor(p) -> int:
    return p.split_factor if isinstance(p, tc.StridedShard) else 1


def _local(x: torch.Tensor, p, i: int, size: int) -> torch.Tensor:
    """Rank i's piece of the whole ``x`` placed as ``p`` (a strided shard: its i-th chunk of every
    part), contiguous as a rank's own tensor is: a chunk of the whole is a view that is not dense
    (every other head of a batch), which no rank ever hands the op (autopar's attention backward
    once wrote past its buffers on such views)."""
    if isinstance(p, tc.StridedShard):  # (before Shard: on some torch versions a subclass of it)
        return torch.cat([q.chunk(size, p.dim)[i] for q in x.chunk(p.split_factor, p.dim)], p.dim)
    if isinstance(p, Shard):
        return x.chunk(size, p.dim)[i].contiguous()
    return x


def _shapes(vals, given, size: int):
    """The shapes to run on: the traced ones, or where an input is past ``MAX_ELEMENTS``, each
    distinct size above ``_SMALL`` mapped to its own small size (divisible by every split it
    takes); (shapes, scaled) or (None, False) where even that is too large."""
    shapes = [tuple(v.shape) for v in vals]
    if all(v.numel() <= MAX_ELEMENTS for v in vals):
        return shapes, False
    unit = 2  # room for an op that halves a dim (gate | up)
    for p in given:  # a strided dim splits into size pieces of each of its parts
        unit = math.lcm(unit, size * _factor(p))
    large = sorted({s for sh in shapes for s in sh if s > _SMALL})
    small = {s: unit * (_SMALL // unit + 1 + i) for i, s in enumerate(large)}  # distinct, above every kept size
    out = [tuple(small.get(s, s) for s in sh) for sh in shapes]
    if any(math.prod(sh) > MAX_ELEMENTS for sh in out):
        return None, False
    return out, True


def _random(shapes, dtypes, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in zip(shapes, dtypes):
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype))
        elif dtype == torch.bool:
            out.append(torch.rand(shape, generator=g) < 0.5)
        else:  # small non-negative integers: valid as indices into any dim of size >= 2
            out.append(torch.randint(0, 2, shape, generator=g).to(dtype))
    return out


def _outputs(n: fx.Node, args, values) -> list:
    env = dict(zip(args, values))

    def sub(x):
        if isinstance(x, fx.Node):
            return env[x]
        if isinstance(x, (list, tuple)):
            return type(x)(sub(i) for i in x)
        return x
    args, kwargs = sub(tuple(n.args)), {k: sub(v) for k, v in n.kwargs.items()}
    with torch.no_grad():
        out = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _placement(whole: torch.Tensor, parts: list, factors=()):
    """Shard(d) / a strided shard of one of the inputs' split ``factors`` / Replicate() /
    Partial() for how ``parts`` make up ``whole``, or False."""
    if any(not isinstance(p, torch.Tensor) for p in parts):
        return False
    tol = dict(rtol=1e-2, atol=1e-2) if whole.dtype in (torch.bfloat16, torch.float16) else dict(rtol=1e-4, atol=1e-5)

    def same(a, b):
        return a.shape == b.shape and (torch.equal(a, b) if not a.dtype.is_floating_point
                                       else torch.allclose(a.float(), b.float(), **tol))
    for d in range(whole.dim()):
        try:
            if same(torch.cat(parts, d), whole):
                return Shard(d)
        except RuntimeError:  # shapes that do not concatenate on d
            continue
    for k in factors:
        for d in range(whole.dim()):
            if all(p.dim() == whole.dim() and p.shape[d] % k == 0 for p in parts) and \
                    same(torch.cat([torch.cat([p.chunk(k, d)[j] for p in parts], d) for j in range(k)], d), whole):
                return tc.StridedShard(d, split_factor=k)
    if all(same(p, whole) for p in parts):
        return Replicate()
    if whole.dtype.is_floating_point and same(torch.stack(parts).sum(0), whole):
        return Partial()
    return False
