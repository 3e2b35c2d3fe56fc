"""Megatron's tensor-parallel plan, derived from the captured program (not from layer names).

``derive(gm, model, tp)`` reads the torch-level graph of model + loss (the capture pass's) and
decides, for every parameter, its placement on a tensor-parallel axis of ``tp`` ranks and the
graph fact that decided it:

- **column-parallel**: a matmul with a weight (``linear``, ``addmm``/``mm``/``matmul`` with a
  weight stored either way round: what is contracted decides, not the class) whose output
  dim can be followed, op by op, to a matmul with another weight that contracts it, through ops
  that need no communication when that dim is sharded: casts, views that split it into heads
  (the heads dim is then the one sharded), transposes, elementwise ops and activations,
  attention over heads, norms over other dims, ``split`` into parts. Where a view or a split
  needs each of k parts to be split by heads (a fused ``[q | k | v]`` or ``[gate | up]``
  projection), the weight is strided-sharded (DTensor's ``_StridedShard``, split factor k):
  each rank holds its share of every part, never a range crossing a part boundary.
- **row-parallel**: the matmul that contracts that dim (its weight sharded on the contracted
  dim: its output is a partial sum, all-reduced where the residual stream needs it).
- Flows that meet (q, k and v at attention; gate and up at their product) form one region,
  sharded together or not at all.
- **vocabulary-parallel**: a weight matmul whose output dim reaches the loss's class dim
  (``cross_entropy``, ``log_softmax`` + ``nll_loss``): the LM head; an embedding lookup indexed
  by a program input (the tokens). A lookup indexed by values the program computes (positions)
  is replicated.
- Parameters combined elementwise with a sharded value along that dim (a column bias added
  apart, per-head attention sinks) are sharded with it.
- Everything else is replicated, with the reason: the flow that failed (a router's output
  reduced over the sharded dim by softmax, a norm over the whole projected dim, an op autopar
  does not know), norms and biases over the residual stream, positions.

Decisions are returned as data (``Derived``); autopar/plan.py places parameters with them and
the reports print ``why``. Nothing here looks at a module's or parameter's name.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autopar.ir import source_line

R = Replicate()


def strided(dim: int, outer: int) -> Placement:
    """Shard(dim), or dim strided-sharded with ``outer`` parts (each rank holds 1/tp of each)."""
    if outer == 1:
        return Shard(dim)
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=outer)


@dataclass
class Decision:
    placement: Placement
    role: str  # column | row | vocab | embedding | with-column | replicated
    why: str


@dataclass
class Derived:
    """Per parameter (the user's name), its placement on the tensor-parallel axis and why."""

    tp: int
    decisions: dict[str, Decision] = field(default_factory=dict)

    def sharded(self) -> dict[str, Decision]:
        return {n: d for n, d in self.decisions.items() if not isinstance(d.placement, Replicate)}


# --------------------------------------------------------------------------------- op tables
_SAME = {"to", "type", "float", "half", "bfloat16", "double", "contiguous", "clone", "detach", "dropout",
         "alpha_dropout", "feature_alpha_dropout", "type_as", "requires_grad_", "_to_copy", "cpu", "cuda"}
_RESHAPE = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "_unsafe_view", "view_as",
            "reshape_as"}
_EXPAND = {"expand", "expand_as", "broadcast_to"}
_PERMUTE = {"transpose", "swapaxes", "swapdims", "permute", "t", "movedim", "moveaxis"}
_SPLIT = {"split", "chunk", "split_with_sizes", "tensor_split", "unbind"}
_REDUCE = {"softmax", "log_softmax", "sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp",
           "cumsum", "cumprod", "argmax", "argmin", "topk", "sort", "prod", "all", "any", "var_mean", "std_mean",
           "normalize", "_softmax", "_log_softmax"}
_NORM = {"layer_norm", "rms_norm"}
_STATISTICS = {"mean", "sum", "var", "amax", "norm"}  # reductions whose result is small and linear-ish to combine
_MATMUL = {"linear", "addmm", "mm", "matmul", "bmm", "baddbmm"}
_CAT = {"cat", "concat", "concatenate", "stack"}
_OPERATOR = {"truediv": "div", "floordiv": "floor_divide", "iadd": "add", "isub": "sub", "imul": "mul",
             "itruediv": "div", "ipow": "pow", "and_": "bitwise_and", "or_": "bitwise_or", "invert": "bitwise_not",
             "getitem": "getitem", "matmul": "matmul", "neg": "neg", "pos": "positive"}


def op_name(n: fx.Node) -> str:
    if n.op == "call_method":
        return n.target
    if n.op != "call_function":
        return n.op
    name = getattr(n.target, "__name__", str(n.target))
    if getattr(n.target, "__module__", "") in ("_operator", "operator"):
        return _OPERATOR.get(name, name)
    return name.split(".")[0]  # an aten overload in a torch-level graph: add.Tensor


def _pointwise(name: str) -> bool:
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    p = getattr(torch.ops.aten, base, None)
    try:
        return p is not None and any(torch.Tag.pointwise in getattr(p, o).tags for o in p.overloads())
    except Exception:  # noqa: BLE001 - not an op packet
        return False


def _val(a):
    return a.meta.get("example_value", a.meta.get("val")) if isinstance(a, fx.Node) else None


def _shape(a) -> tuple[int, ...] | None:
    v = _val(a)
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _dims_arg(n: fx.Node, pos: int, ndim: int, key: str = "dim"):
    d = n.args[pos] if len(n.args) > pos else n.kwargs.get(key)
    if d is None:
        return None
    ds = d if isinstance(d, (list, tuple)) else [d]
    return {int(x) % ndim for x in ds}


def _where(n: fx.Node) -> str:
    line = source_line(n)
    return f" at {line}" if line else ""


class _Fail(Exception):
    def __init__(self, why: str, outer: int | None = None, indivisible: bool = False):
        super().__init__(why)
        self.why, self.outer = why, outer  # outer: the split factor that would make it hold
        self.indivisible = indivisible  # it would hold on an axis whose size divides the dims


# --------------------------------------------------------------------------------- the graph
class _Graph:
    """What the analysis needs of the torch-level graph: node order, parameters (through casts
    and transposes), which values depend on a parameter (need a gradient), inputs' descendants."""

    def __init__(self, gm: fx.GraphModule, model: torch.nn.Module):
        from autopar.capture import _tensor_names
        from autopar.modpath import get_attr

        ids = _tensor_names(model)
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.param: dict[fx.Node, str] = {}
        for n in self.nodes:
            if n.op == "get_attr":
                t = get_attr(gm, n.target)
                kind, name = ids.get(id(t), (None, None))
                if kind == "param":
                    self.param[n] = name
        self.params = {n for n, _ in model.named_parameters()}
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.grad: set[fx.Node] = set()
        self.from_input: set[fx.Node] = set()
        for n in self.nodes:
            ins = n.all_input_nodes
            if n in self.param or any(a in self.grad for a in ins):
                self.grad.add(n)
            if n.op == "placeholder" or any(a in self.from_input for a in ins):
                self.from_input.add(n)

    def param_view(self, a) -> tuple[str, list[int]] | None:
        """(parameter name, perm) if ``a`` is a parameter seen through casts / transposes: dim i
        of ``a`` is dim perm[i] of the parameter."""
        chain = []
        while isinstance(a, fx.Node) and a not in self.param:
            name = op_name(a)
            if name in _SAME or name in ("t", "transpose", "permute", "swapaxes", "swapdims") or \
                    (name == "getattr" and len(a.args) > 1 and a.args[1] in ("T", "mT")):
                chain.append(a)
                a = a.args[0]
            else:
                return None
        if not isinstance(a, fx.Node):
            return None
        nd = len(_shape(a) or ())
        perm = list(range(nd))
        for v in reversed(chain):
            perm = _apply_permute(v, perm)
            if perm is None:
                return None
        return self.param[a], perm


def _apply_permute(n: fx.Node, dims: list) -> list | None:
    """``dims`` (per dim of n's input, any labels) reordered as n reorders its input's dims."""
    name = op_name(n)
    nd = len(dims)
    if name in _SAME:
        return dims
    if name in ("t",) or (name == "getattr" and n.args[1] in ("T", "mT")):
        if nd < 2:
            return dims
        return dims[:-2] + [dims[-1], dims[-2]] if name != "t" or nd == 2 else None
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (int(x) % nd for x in _pair(n))
        out = list(dims)
        out[a], out[b] = out[b], out[a]
        return out
    if name == "permute":
        order = n.args[1] if isinstance(n.args[1], (list, tuple)) else n.args[1:]
        return [dims[int(i) % nd] for i in order]
    if name in ("movedim", "moveaxis"):
        src, dst = n.args[1], n.args[2]
        src, dst = ([src], [dst]) if isinstance(src, int) else (list(src), list(dst))
        src, dst = [s % nd for s in src], [d % nd for d in dst]
        rest = [dims[i] for i in range(nd) if i not in src]
        out = [None] * nd
        for s, d in zip(src, dst):
            out[d] = dims[s]
        it = iter(rest)
        return [x if x is not None else next(it) for x in out]
    return None


def _pair(n: fx.Node):
    args = list(n.args[1:3])
    for k in ("dim0", "dim1"):
        if k in n.kwargs:
            args.append(n.kwargs[k])
    return args[:2]


# --------------------------------------------------------------------------------- reshapes
def _reshape_track(src: tuple, dst: tuple, d: int, o: int, tp: int) -> tuple[int, int]:
    """Where the sharded dim goes through a reshape ``src`` -> ``dst``. Dim d of src is (o, m):
    o outer parts, each sharded in m contiguously. Returns (dim of dst, its outer parts); a
    _Fail when the shards would cross a dst dim's boundary (its ``outer``: the split factor the
    weight needs instead)."""
    digits: list[list] = []  # [size, is_sharded]
    for i, s in enumerate(src):
        if i == d:
            if o > 1:
                digits.append([o, False])
            digits.append([s // o, True])
        elif s != 1:
            digits.append([s, False])
    out_dim, out_outer = None, 1
    k = 0
    for j, size in enumerate(dst):
        rem, before = size, 1
        while rem > 1:
            if k >= len(digits):
                raise _Fail("a reshape autopar cannot follow")
            dsz, sh = digits[k]
            if dsz <= rem:
                if rem % dsz:
                    raise _Fail(f"a reshape from {list(src)} to {list(dst)} that mixes the sharded dim with others")
                if sh:
                    out_dim, out_outer = j, before
                before *= dsz
                rem //= dsz
                k += 1
            else:
                if dsz % rem:
                    raise _Fail(f"a reshape from {list(src)} to {list(dst)} that mixes the sharded dim with others")
                if sh:  # the sharded digit is split: its outer part (rem) lands in dim j
                    if rem % tp:
                        raise _Fail(f"a view from {list(src)} to {list(dst)} that would put the shards across a "
                                    f"dim of size {rem}, not divisible by {tp}", outer=rem, indivisible=True)
                    out_dim, out_outer = j, before
                digits[k] = [dsz // rem, False]
                rem = 1
    if out_dim is None:
        raise _Fail("a reshape autopar cannot follow")
    return out_dim, out_outer


# --------------------------------------------------------------------------------- one flow
@dataclass
class _Flow:
    start: fx.Node
    weight: str
    out_pdim: int  # the weight's dim the start's output dim comes from
    bias: str | None
    outer: int
    tracks: dict = field(default_factory=dict)  # node -> (dim, outer) | list of those (tuples)
    rows: list = field(default_factory=list)  # (node, param, param dim, outer)
    vocab: list = field(default_factory=list)  # nodes: the loss reading the sharded class dim
    extra: dict = field(default_factory=dict)  # param -> (param dim, outer, node): biases, sinks
    needs: list = field(default_factory=list)  # (node, operand, track) another flow must provide
    fail: _Fail | None = None
    trail: list = field(default_factory=list)  # the graph facts worth printing
    logp: set = field(default_factory=set)  # log_softmax over the sharded dim (nll_loss may read them)
    # a statistic over the sharded dim (a norm's mean of squares) allowed: each rank reduces its
    # part and the small result is all-reduced (the second pass, for starts the first left out)
    relaxed: bool = False


def _matmul_weight(g: _Graph, n: fx.Node):
    """(activation, weight name, the weight's contracted dim, its output dim, bias name) of a
    matmul with a 2-D weight; None for others."""
    name = op_name(n)
    if name == "linear":
        x, w = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        pv = g.param_view(w)
        if pv is None or len(pv[1]) != 2:
            return None
        bias = g.param_view(b) if isinstance(b, fx.Node) else None
        return x, pv[0], pv[1][1], pv[1][0], bias[0] if bias else None
    if name in ("addmm", "mm", "matmul"):
        args = list(n.args)
        b = args.pop(0) if name == "addmm" else None
        if len(args) < 2:
            return None
        x, w = args[0], args[1]
        pv = g.param_view(w)
        if pv is None or len(pv[1]) != 2 or g.param_view(x) is not None:
            return None
        bias = g.param_view(b) if isinstance(b, fx.Node) else None
        return x, pv[0], pv[1][0], pv[1][1], bias[0] if bias else None
    return None


def _run_flow(g: _Graph, flow: _Flow, tp: int) -> None:
    """Follow the start's sharded output dim through the graph (see the module docstring)."""
    start = flow.start
    shape = _shape(start)
    n_out = shape[-1]
    if (n_out // flow.outer) % tp or n_out % flow.outer:
        raise _Fail(f"its output dim {n_out} does not divide into {tp} shards"
                    + (f" of each of {flow.outer} parts" if flow.outer > 1 else ""), indivisible=True)
    flow.tracks[start] = (len(shape) - 1, flow.outer)
    heap = []
    seen = set()

    def push(v):
        for u in v.users:
            if u not in seen:
                seen.add(u)
                heapq.heappush(heap, (g.index[u], u))

    push(start)
    while heap:
        _, u = heapq.heappop(heap)
        out = _step(g, flow, u, tp)
        if out is not None:
            flow.tracks[u] = out
            push(u)


def _track(flow: _Flow, a):
    return flow.tracks.get(a) if isinstance(a, fx.Node) else None


def _step(g: _Graph, flow: _Flow, u: fx.Node, tp: int):
    """The track of ``u``'s output given its tracked inputs; None when u ends the flow."""
    name = op_name(u)
    if u.op == "output":
        raise _Fail("the sharded values reach the program's output")
    x = u.args[0] if u.args else None
    tx = _track(flow, x)
    val = _val(u)
    if name == "getitem" and isinstance(tx, list):
        return tx[u.args[1]]
    if not isinstance(val, (torch.Tensor, tuple, list)):
        return None  # metadata (x.size(), x.dim()): no data moves
    if name in _SAME and tx is not None:
        return tx
    if name == "getattr" and tx is not None and u.args[1] in ("T", "mT"):
        return _permuted(u, tx)
    if name in _RESHAPE and tx is not None:
        d, o = _reshape_track(_shape(x), _shape(u), *tx, tp)
        if _shape(u)[d] != _shape(x)[tx[0]] and len(flow.trail) < 4:
            flow.trail.append(f"viewed as {list(_shape(u))} (sharded dim {d}){_where(u)}")
        return d, o
    if (name in _EXPAND or name == "repeat") and tx is not None:  # new leading dims; the sharded one kept
        src, dst = _shape(x), _shape(u)
        d = tx[0] + len(dst) - len(src)
        if dst[d] != src[tx[0]]:
            raise _Fail(f"{name} along the sharded dim{_where(u)}")
        return d, tx[1]
    if name == "repeat_interleave" and tx is not None:
        dim = _dims_arg(u, 2, len(_shape(x)))
        if dim is None or (tx[0] in dim and tx[1] != 1):
            raise _Fail(f"repeat_interleave over the sharded dim{_where(u)}")
        return tx
    if name in _PERMUTE and tx is not None:
        return _permuted(u, tx)
    if name in _SPLIT and tx is not None:
        return _split(u, name, tx, tp)
    if name == "getitem" and tx is not None:
        return _index(u, tx)
    if name in _NORM and tx is not None:
        ns = u.args[1] if len(u.args) > 1 else u.kwargs.get("normalized_shape")
        k = len(ns) if isinstance(ns, (list, tuple)) else 1
        if tx[0] >= len(_shape(x)) - k:
            raise _Fail(f"{name} normalizes over the sharded dim{_where(u)}")
        return tx
    if name in ("cross_entropy", "nll_loss") and tx is not None:
        if tx[0] == 1 and tx[1] == 1 and x is u.args[0] and _track(flow, u.args[1]) is None:
            if name == "nll_loss" and x not in flow.logp:
                raise _Fail(f"nll_loss over values that are not log-probabilities{_where(u)}")
            flow.vocab.append(u)
            return None
        raise _Fail(f"{name} reads the sharded values other than as classes{_where(u)}")
    if name in _REDUCE and tx is not None:
        nd = len(_shape(x))
        dims = _dims_arg(u, 1, nd)
        if name == "normalize":
            dims = _dims_arg(u, 2, nd) or {nd - 1}
        if dims is not None and tx[0] in dims and flow.relaxed and name in _STATISTICS:
            if len(flow.trail) < 4:
                flow.trail.append(f"{name} over the sharded dim{_where(u)} (each rank's part, then all-reduced)")
            return None
        if dims is None or tx[0] in dims:
            if name in ("log_softmax", "_log_softmax") and dims == {tx[0]} and tx[1] == 1 and tx[0] == nd - 1:
                flow.logp.add(u)  # a vocab-parallel log_softmax, if nll_loss reads it
                return tx
            raise _Fail(f"{name} reduces over the sharded dim{_where(u)}")
        out = _val(u)
        res = out[0] if isinstance(out, (tuple, list)) else out
        d = tx[0] - sum(1 for q in dims if q < tx[0]) if res.dim() < nd else tx[0]
        return [(d, tx[1])] * len(out) if isinstance(out, (tuple, list)) else (d, tx[1])
    if name == "embedding":
        raise _Fail(f"an embedding lookup indexed by the sharded values{_where(u)}")
    if name in _MATMUL:
        return _matmul(g, flow, u, name, tp)
    if name == "scaled_dot_product_attention":
        return _attention(g, flow, u)
    if name in _CAT:
        return _cat(g, flow, u, name)
    if _elementwise_function(g, u):
        t = _elementwise(g, flow, u)
        return [t] * len(val) if isinstance(val, (tuple, list)) else t
    if _pointwise(name) or name in ("where", "masked_fill"):
        return _elementwise(g, flow, u)
    raise _Fail(f"{name}{_where(u)}: an op whose sharding autopar does not derive")


def _elementwise_function(g: _Graph, u: fx.Node) -> bool:
    """A custom autograd function (``autograd_function_apply``) whose forward body is elementwise
    ops only (BLOOM's GeLUFunction): an elementwise op."""
    if op_name(u) != "autograd_function_apply" or not u.args or not isinstance(u.args[0], fx.Node):
        return False
    from autopar.modpath import get_attr

    body = get_attr(g.gm, u.args[0].target) if u.args[0].op == "get_attr" else None
    if not isinstance(body, fx.GraphModule):
        return False
    ops = [n for n in body.graph.nodes if n.op in ("call_function", "call_method")]
    return bool(ops) and all(_pointwise(op_name(n)) or op_name(n) in _SAME or op_name(n) == "_set_grad_enabled"
                             for n in ops)


def _permuted(u: fx.Node, tx):
    nd = len(_shape(u))
    labels = [None] * nd
    labels[tx[0]] = "S"
    out = _apply_permute(u, labels)
    if out is None:
        raise _Fail(f"{op_name(u)}{_where(u)}: a permutation autopar cannot follow")
    return out.index("S"), tx[1]


def _split(u: fx.Node, name: str, tx, tp: int):
    src = _shape(u.args[0])
    nd = len(src)
    if name == "unbind":
        dim = _dims_arg(u, 1, nd) or {0}
        (dim,) = dim
        if dim == tx[0]:
            raise _Fail(f"unbind over the sharded dim{_where(u)}")
        return [(tx[0] - (dim < tx[0]), tx[1])] * src[dim]
    dim = _dims_arg(u, 2, nd) or {0}
    (dim,) = dim
    parts = [int(_shape_of(v)[dim]) for v in _val(u)]
    if dim != tx[0]:
        return [tx] * len(parts)
    n, o = src[dim], tx[1]
    m = n // o
    if all(p % m == 0 for p in parts):
        return [(dim, p // m) for p in parts]
    unit = math.gcd(math.gcd(*parts), m)
    raise _Fail(f"{name} into parts {parts}{_where(u)} crosses the shards", outer=n // unit // o)


def _shape_of(v):
    return tuple(v.shape)


def _index(u: fx.Node, tx):
    """x[idx] with slices, None, ints and Ellipsis: the sharded dim must be kept whole."""
    idx = u.args[1] if isinstance(u.args[1], tuple) else (u.args[1],)
    src = _shape(u.args[0])
    if any(isinstance(i, (fx.Node, list, torch.Tensor)) for i in idx):
        raise _Fail(f"indexing with tensors{_where(u)}")
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    expanded = []
    for i in idx:
        if i is Ellipsis:
            expanded += [slice(None)] * (len(src) - n_real)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (len(src) - sum(1 for i in expanded if i is not None))
    d_in, d_out = 0, 0
    for i in expanded:
        if i is None:
            d_out += 1
            continue
        if d_in == tx[0]:
            if isinstance(i, slice) and i == slice(None):
                return d_out, tx[1]
            if not isinstance(i, slice) or i.step not in (None, 1):
                raise _Fail(f"indexing into the sharded dim{_where(u)}")
            n, o = src[d_in], tx[1]
            lo, hi, _ = i.indices(n)
            m = n // o
            if lo % m == 0 and hi % m == 0 and hi > lo:  # whole parts: [q | k | v][..., :q_size]
                return d_out, (hi - lo) // m
            unit = math.gcd(math.gcd(lo, hi), math.gcd(n, m))
            raise _Fail(f"a slice [{lo}:{hi}] of the sharded dim{_where(u)} crosses the shards", outer=n // unit // o)
        d_in += 1
        if not isinstance(i, int):
            d_out += 1
    raise _Fail(f"indexing autopar cannot follow{_where(u)}")


def _operand_needs(g: _Graph, flow: _Flow, u: fx.Node, a, dim: int, o: int, what: str) -> None:
    """An untracked operand ``a`` holding the sharded dim's full extent at its dim ``dim``: a
    parameter is sharded with it; a value that needs no gradient (a mask, rotary tables) is
    sliced locally; a value that needs one must come sharded the same way from another flow."""
    pv = _param_back(g, a, dim, o)
    if pv is not None:
        pname, pdim, o = pv
        perm = {dim: pdim}
        prev = flow.extra.get(pname)
        if prev is not None and prev[:2] != (perm[dim], o):
            raise _Fail(f"parameter {pname} combined with the sharded values along two different dims")
        flow.extra[pname] = (perm[dim], o, u)
        return
    if a in g.grad:
        flow.needs.append((u, a, (dim, o)))


def _param_back(g: _Graph, a, dim: int, o: int):
    """(parameter, its dim, outer parts) if ``a`` is a parameter seen through casts, transposes,
    views and expands (per-head attention sinks broadcast to [B, H, S, 1]) whose dim ``dim`` comes
    from that parameter dim; else None."""
    pv = g.param_view(a)
    if pv is not None:
        return pv[0], pv[1][dim], o
    if not isinstance(a, fx.Node) or a.op not in ("call_function", "call_method") or not a.args:
        return None
    name, src = op_name(a), a.args[0]
    if not isinstance(src, fx.Node) or _shape(src) is None:
        return None
    s_in, s_out = _shape(src), _shape(a)
    try:
        if name in _SAME:
            return _param_back(g, src, dim, o)
        if name in _EXPAND:
            d = dim - (len(s_out) - len(s_in))
            return _param_back(g, src, d, o) if d >= 0 and s_in[d] == s_out[dim] else None
        if name in _RESHAPE:
            d, o2 = _reshape_track(s_out, s_in, dim, o, 1)
            return _param_back(g, src, d, o2)
    except _Fail:
        return None
    return None


def _elementwise(g: _Graph, flow: _Flow, u: fx.Node):
    v = _val(u)
    out = tuple(v[0].shape) if isinstance(v, (tuple, list)) else _shape(u)
    nd = len(out)
    tensors = [a for a in list(u.args) + list(u.kwargs.values()) if isinstance(a, fx.Node)
               and isinstance(_val(a), torch.Tensor)]
    tracked = [(a, flow.tracks[a]) for a in tensors if _track(flow, a) is not None]
    outs = {(t[0] + nd - len(_shape(a)), t[1]) for a, t in tracked}
    if len(outs) != 1:
        raise _Fail(f"{op_name(u)}{_where(u)} combines values sharded along different dims")
    ((d, o),) = outs
    for a in tensors:
        if _track(flow, a) is not None:
            continue
        s = _shape(a)
        da = d - (nd - len(s))
        if da >= 0 and s[da] == out[d] and out[d] > 1:
            _operand_needs(g, flow, u, a, da, o, op_name(u))
    return d, o


def _cat(g: _Graph, flow: _Flow, u: fx.Node, name: str):
    tensors = u.args[0]
    ref = next(a for a in tensors if _track(flow, a) is not None)
    src = _shape(ref)
    nd = len(src)
    dim = (_dims_arg(u, 1, nd + (name == "stack")) or {0}).pop()
    d, o = flow.tracks[ref]
    if name != "stack" and dim == d:
        raise _Fail(f"{name} along the sharded dim{_where(u)}")
    for a in tensors:
        t = _track(flow, a)
        if t is None:
            _operand_needs(g, flow, u, a, d, o, name)
        elif t != (d, o):
            raise _Fail(f"{name}{_where(u)} joins values sharded differently")
    return (d + (1 if name == "stack" and dim <= d else 0)), o


def _matmul(g: _Graph, flow: _Flow, u: fx.Node, name: str, tp: int):
    mw = _matmul_weight(g, u)
    if mw is not None:
        x, wname, contracted, _, _ = mw
        tx = _track(flow, x)
        if tx is None:
            raise _Fail(f"a weight{_where(u)} multiplied by the sharded values")
        nd = len(_shape(x))
        if tx[0] == nd - 1:  # contracts the sharded dim: row-parallel, the flow ends here
            flow.rows.append((u, wname, contracted, tx[1]))
            return None
        return tx  # the matmul acts along another dim (per head): the sharded dim passes through
    args = [a for a in list(u.args) + [u.kwargs.get(k) for k in ("input", "batch1", "batch2", "other")]
            if isinstance(a, fx.Node)]
    if name == "baddbmm":
        inp, a, b = args[:3]
        for v in (a, b):
            if _track(flow, v) is None:
                _operand_needs(g, flow, u, v, 0, (_track(flow, a) or _track(flow, b))[1], name)
        ta, tb = _track(flow, a), _track(flow, b)
        t = ta or tb
        if t[0] != 0 or (ta and tb and ta != tb):
            raise _Fail(f"{name}{_where(u)} over the sharded dim")
        if _track(flow, inp) is None and _shape(inp)[0] == _shape(u)[0]:
            _operand_needs(g, flow, u, inp, 0, t[1], name)
        return t
    a, b = args[:2]
    sa, sb, so = _shape(a), _shape(b), _shape(u)
    ta, tb = _track(flow, a), _track(flow, b)
    if len(sa) < 3 or len(sb) < 3:
        raise _Fail(f"{name}{_where(u)}: a matmul of the sharded values autopar cannot follow")
    outs = set()
    for v, t, s in ((a, ta, sa), (b, tb, sb)):
        if t is not None:
            if t[0] >= len(s) - 2:
                raise _Fail(f"{name}{_where(u)} contracts or keeps the sharded dim as a matrix dim")
            outs.add((t[0] + len(so) - len(s), t[1]))
    if len(outs) != 1:
        raise _Fail(f"{name}{_where(u)} multiplies values sharded differently")
    ((d, o),) = outs
    for v, t, s in ((a, ta, sa), (b, tb, sb)):
        if t is None:
            dv = d - (len(so) - len(s))
            if dv >= 0 and s[dv] == so[d]:
                _operand_needs(g, flow, u, v, dv, o, name)
    return d, o


def _attention(g: _Graph, flow: _Flow, u: fx.Node):
    q, k, v = u.args[:3]
    mask = u.args[3] if len(u.args) > 3 else u.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node) and _track(flow, mask) is not None:
        raise _Fail(f"the attention mask is sharded{_where(u)}")
    ts = [_track(flow, a) for a in (q, k, v)]
    t = next(x for x in ts if x is not None)
    nd = len(_shape(q))
    if t[0] != nd - 3 or any(x is not None and x != t for x in ts):
        raise _Fail(f"attention{_where(u)} over values not sharded by heads")
    for a, x in zip((q, k, v), ts):
        if x is None:
            _operand_needs(g, flow, u, a, nd - 3, t[1], "attention")
    if len(flow.trail) < 4:
        flow.trail.append(f"attention over heads{_where(u)}")
    if isinstance(mask, fx.Node) and mask in g.grad and _shape(mask)[nd - 3 - (nd - len(_shape(mask)))] > 1:
        raise _Fail(f"a trained attention bias per head{_where(u)}")
    return t


# --------------------------------------------------------------------------------- regions
def derive(gm: fx.GraphModule, model: torch.nn.Module, tp: int) -> Derived:
    """Every parameter's placement on a ``tp``-rank tensor-parallel axis, from the graph. Two
    passes: Megatron's regions as such; then, for the starts left out, regions that also reduce
    a statistic over the sharded dim (a norm over the whole projected q: one small all-reduce)."""
    g = _Graph(gm, model)
    out = Derived(tp)
    failed: dict[str, str] = {}  # weight -> why it is no column
    indivisible: dict[str, str] = {}  # weight -> the dim the axis size does not divide
    used: set[fx.Node] = set()
    for relaxed in (False, True):
        flows = _flows(g, tp, relaxed, used, failed, indivisible)
        _accept(g, flows, used, failed, out)
    _decide_rest(g, out, failed, indivisible)
    left = {n: why for n, why in indivisible.items() if isinstance(out.decisions[n].placement, Replicate)}
    if left:
        from autopar.errors import PlanError

        first = next(iter(left))
        raise PlanError(f"tensor parallelism over {tp} ranks cannot shard {len(left)} parameter(s) that it would "
                        "shard over a size that divides their dims:\n" + "\n".join(
                            f"    {n} {list(g.shapes[n])}: {why}" for n, why in left.items()),
                        where="the tensor-parallel axis size",
                        fix=f"use a tensor-parallel size that divides them (heads, hidden and vocabulary sizes), or "
                        f"replicate them with plan['rules'], e.g. {{'{first}': {{'tp': 'R'}}}}")
    return out


def _flows(g: _Graph, tp: int, relaxed: bool, used: set, failed: dict, indivisible: dict) -> list[_Flow]:
    flows = []
    for n in g.nodes:
        mw = _matmul_weight(g, n) if n.op in ("call_function", "call_method") and n not in used else None
        if mw is None:
            continue
        x, wname, _, out_pdim, bias = mw
        outer, tried = 1, set()
        while outer not in tried:
            tried.add(outer)
            fl = _Flow(n, wname, out_pdim, bias, outer, relaxed=relaxed)
            try:
                _run_flow(g, fl, tp)
            except _Fail as e:
                fl.fail = e
                if e.outer and e.outer > 1:
                    outer *= e.outer
                    continue
            break
        if fl.fail is None and not fl.rows and not fl.vocab:
            fl.fail = _Fail("nothing that contracts it back")
        if fl.fail is not None and fl.fail.indivisible and tp > 1 and not relaxed and _holds(g, n, wname, out_pdim, bias):
            indivisible.setdefault(wname, fl.fail.why)
        flows.append(fl)
        if fl.fail is not None:
            failed.setdefault(wname, f"not sharded: as a column-parallel weight its output would reach {fl.fail.why}")
    return flows


def _holds(g: _Graph, n: fx.Node, wname: str, out_pdim: int, bias) -> bool:
    """The flow from ``n`` holds on an axis whose size divides every dim (tp = 1)."""
    outer, tried = 1, set()
    while outer not in tried:
        tried.add(outer)
        fl = _Flow(n, wname, out_pdim, bias, outer)
        try:
            _run_flow(g, fl, 1)
            return bool(fl.rows or fl.vocab)
        except _Fail as e:
            if e.outer and e.outer > 1:
                outer *= e.outer
                continue
            return False
    return False


def _accept(g: _Graph, flows: list[_Flow], used: set, failed: dict, out: Derived) -> None:
    """Link the flows that need each other's values into regions; decide every region whose flows
    all hold and whose matmuls no earlier region took."""
    ok = [f for f in flows if f.fail is None]
    parent = {id(f): id(f) for f in ok}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    unmet: dict[int, str] = {}
    for f in ok:
        for u, a, t in f.needs:
            other = next((h for h in ok if h is not f and h.tracks.get(a) == t), None)
            if other is None:
                unmet[id(f)] = (f"not sharded: its output meets a value that is not sharded the same way "
                                f"({op_name(u)}{_where(u)})")
            else:
                parent[find(id(f))] = find(id(other))
    regions: dict[int, list[_Flow]] = {}
    for f in ok:
        regions.setdefault(find(id(f)), []).append(f)
    for r, fs in sorted(regions.items(), key=lambda kv: min(g.index[f.start] for f in kv[1])):
        why = next((unmet[id(f)] for f in fs if id(f) in unmet), None)
        if why is not None:
            for f in fs:
                failed.setdefault(f.weight, why)
            continue
        nodes = {f.start for f in fs} | {row[0] for f in fs for row in f.rows}
        if nodes & used:
            continue
        used |= nodes
        _decide_region(g, fs, out)


def _names(items) -> str:
    items = sorted(set(items))
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def _decide_region(g: _Graph, fs: list[_Flow], out: Derived) -> None:
    starts = [f.weight for f in fs]
    rows = [row[1] for f in fs for row in f.rows]
    dec = out.decisions
    for f in fs:
        line = _where(f.start)
        if f.vocab:
            why = f"vocabulary-parallel: its output dim is the classes of {op_name(f.vocab[0])}{_where(f.vocab[0])}"
            _put(dec, f.weight, Decision(Shard(f.out_pdim), "vocab", why))
            if f.bias:
                _put(dec, f.bias, Decision(Shard(0), "with-column", f"bias of vocabulary-parallel {f.weight}"))
            continue
        facts = "; ".join(f.trail[:3])
        pl = strided(f.out_pdim, f.outer)
        split = f", split into {f.outer} parts, each sharded" if f.outer > 1 else ""
        why = (f"column-parallel: output dim sharded{split}{line}" + (f"; {facts}" if facts else "")
               + f"; contracted back by {_names(rows)}")
        _put(dec, f.weight, Decision(pl, "column", why))
        if f.bias:
            _put(dec, f.bias, Decision(strided(0, f.outer), "with-column", f"bias of column-parallel {f.weight}"))
        for node, wname, pdim, o in f.rows:
            _put(dec, wname, Decision(strided(pdim, o), "row",
                                      f"row-parallel: contracts the dim {_names(starts)} shard{_where(node)}; "
                                      "its output is a partial sum, all-reduced where it is needed whole"))
        for pname, (pdim, o, node) in f.extra.items():
            _put(dec, pname, Decision(strided(pdim, o), "with-column",
                                      f"combined with the sharded values of {f.weight} ({op_name(node)}{_where(node)})"))


def _put(dec: dict, name: str, d: Decision) -> None:
    prev = dec.get(name)
    if prev is None or prev.placement == d.placement:
        if prev is None:
            dec[name] = d
        return
    dec[name] = Decision(R, "replicated", f"used two ways: {prev.why} / {d.why}")


def _decide_rest(g: _Graph, out: Derived, failed: dict[str, str], indivisible: dict[str, str]) -> None:
    dec = out.decisions
    first_use: dict[str, fx.Node] = {}
    lookups: dict[str, list[fx.Node]] = {}
    for n in g.nodes:
        for a in n.all_input_nodes:
            pv = g.param_view(a) if n.op in ("call_function", "call_method") else None
            if pv is None:
                continue
            first_use.setdefault(pv[0], n)
            if op_name(n) == "embedding" and (n.args[1] if len(n.args) > 1 else None) is a:
                lookups.setdefault(pv[0], []).append(n)
    for name, uses in lookups.items():
        if name in dec and dec[name].role != "vocab":
            continue
        ids = uses[0].args[0]
        if all(u.args[0] in g.from_input for u in uses):
            rows = _shape(uses[0].args[1])[0] if _shape(uses[0].args[1]) else 0
            if rows % out.tp == 0:
                why = f"vocabulary-parallel lookup: indexed by the program's input{_where(uses[0])}"
                if name in dec:
                    why = dec[name].why + "; and " + why
                dec[name] = Decision(Shard(0), "vocab", why)
            else:
                indivisible.setdefault(name, f"a lookup indexed by the program's input (vocabulary-parallel) of {rows} "
                                             f"rows, not divisible by {out.tp}")
                dec.setdefault(name, Decision(R, "replicated", indivisible[name]))
        elif name not in dec:
            dec[name] = Decision(R, "replicated", f"lookup indexed by values the program computes (positions), "
                                 f"not by an input{_where(uses[0])}")
        del ids
    for name in g.params:
        if name in dec:
            continue
        if name in failed:
            dec[name] = Decision(R, "replicated", failed[name])
            continue
        n = first_use.get(name)
        if n is None:
            dec[name] = Decision(R, "replicated", "not read by the program")
            continue
        what = op_name(n)
        if what in _NORM:
            why = f"norm weight over the whole hidden dim ({what}{_where(n)})"
        elif what in ("linear", "addmm") and _is_bias(g, n, name):
            why = f"bias added to a whole (reduced) output ({what}{_where(n)})"
        elif _pointwise(what):
            why = f"combined elementwise with a replicated value ({what}{_where(n)}; e.g. a norm's scale)"
        else:
            why = f"read by {what}{_where(n)}, which the sharded regions do not reach"
        dec[name] = Decision(R, "replicated", why)


def _is_bias(g: _Graph, n: fx.Node, name: str) -> bool:
    b = (n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")) if op_name(n) == "linear" else n.args[0]
    pv = g.param_view(b) if isinstance(b, fx.Node) else None
    return pv is not None and pv[0] == name


def fraction_sharded(derived: Derived, params: dict[str, torch.Tensor], names=None) -> float:
    """The share of ``names``' elements (default: every parameter) that the derivation shards."""
    names = list(params) if names is None else names
    total = sum(params[n].numel() for n in names)
    sh = sum(params[n].numel() for n in names if not isinstance(derived.decisions[n].placement, Replicate))
    return sh / total if total else 0.0

