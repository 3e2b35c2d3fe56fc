"""One flow of the tensor-parallel derivation (autopar/analysis/tensor_parallel.py): a weight's
output dim followed op by op until a matmul contracts it, the loss reads it as classes, or an op
would need it whole."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
from torch import fx

from autopar.analysis.tp_graph import (CAT, CONV, EXPAND, FRESH, MATMUL, NORM, PERMUTE, REDUCE, RESHAPE, SAME, SPLIT,
                                       STATISTICS, Fail, Graph, apply_permute, dims_arg, op_name, pointwise,
                                       reshape_track, shape_of, val_of, where_of)
from autopar.analysis.tp_measured import measured_step
from autopar.analysis.tp_operands import broadcast, param_back
from autopar.analysis.tp_starts import parse_einsum, matmul_weight, weight_first


# --------------------------------------------------------------------------------- one flow
@dataclass
class Flow:
    start: fx.Node
    weight: str
    out_pdim: int  # the weight's dim the start's output dim comes from
    bias: str | None
    outer: int
    out_dim: int = -1  # the start's output dim that holds it (einsum: where the equation puts it)
    tracks: dict = field(default_factory=dict)  # node -> (dim, outer) | list of those (tuples)
    rows: list = field(default_factory=list)  # (node, param, param dim, outer)
    vocab: list = field(default_factory=list)  # nodes: the loss reading the sharded class dim
    extra: dict = field(default_factory=dict)  # param -> (param dim, outer, node): biases, sinks
    needs: list = field(default_factory=list)  # (node, operand, track) another flow must provide
    fail: Fail | None = None
    trail: list = field(default_factory=list)  # the graph facts worth printing
    logp: set = field(default_factory=set)  # log_softmax over the sharded dim (nll_loss may read them)
    written: list = field(default_factory=list)  # (buffer, track): fresh buffers a copy_ fills with the sharded values
    # matmuls that contract the sharded dim between two values sharded alike (the second pass):
    # their output is a partial sum, all-reduced where it is needed whole
    partial: list = field(default_factory=list)
    # a statistic over the sharded dim (a norm's mean of squares) allowed: each rank reduces its
    # part and the small result is all-reduced (the second pass, for starts the first left out)
    relaxed: bool = False


def run_flow(g: Graph, flow: Flow, tp: int) -> None:
    """Follow the start's sharded output dim through the graph (see the module docstring)."""
    start = flow.start
    out = val_of(start)
    shape = tuple(out[0].shape) if isinstance(out, (tuple, list)) else shape_of(start)
    d = flow.out_dim % len(shape)
    n_out = shape[d]
    if (n_out // flow.outer) % tp or n_out % flow.outer:
        raise Fail(f"its output dim {n_out} does not divide into {tp} shards"
                    + (f" of each of {flow.outer} parts" if flow.outer > 1 else ""), indivisible=True)
    flow.tracks[start] = (d, flow.outer)
    if isinstance(out, (tuple, list)):  # linear_act: (activation, pre-activation), both [.., out]
        flow.tracks[start] = [(d, flow.outer)] * len(out)
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
        try:
            out = _step(g, flow, u, tp)
        except Fail:
            raise
        except Exception as e:  # noqa: BLE001 - an op's arguments this analysis did not expect: not followed
            raise Fail(f"{op_name(u)}{where_of(u)}: arguments the analysis cannot read ({type(e).__name__})") from None
        if out is not None:
            flow.tracks[u] = out
            push(u)
        while flow.written:  # a buffer filled in place: its later readers read the sharded values
            buf, t = flow.written.pop()
            if buf not in flow.tracks:
                flow.tracks[buf] = t
                push(buf)


def _track(flow: Flow, a):
    return flow.tracks.get(a) if isinstance(a, fx.Node) else None


def _step(g: Graph, flow: Flow, u: fx.Node, tp: int):
    """The track of ``u``'s output given its tracked inputs; None when u ends the flow."""
    name = op_name(u)
    if u.op == "output":
        raise Fail("the sharded values reach the program's output")
    x = u.args[0] if u.args else None
    tx = _track(flow, x)
    val = val_of(u)
    if name == "getitem" and isinstance(tx, list):
        return tx[u.args[1]]
    if name == "setitem" and len(u.args) == 3:
        return _setitem(g, flow, u, tp)
    if not isinstance(val, (torch.Tensor, tuple, list)) or name in FRESH:
        return None  # metadata (x.size(), x.dim()), or a fresh tensor of its shape: no data moves
    if name in ("view_as", "reshape_as", "expand_as", "type_as") and tx is None:
        return None  # the sharded value gives only its shape or dtype (gate.view_as(attn_output)): no data moves
    if name == "copy_":
        return _copy_into(g, flow, u)
    if name in SAME and tx is not None:
        return tx
    if name == "getattr" and tx is not None and u.args[1] in ("T", "mT"):
        return _permuted(u, tx)
    if name in RESHAPE and tx is not None:
        try:
            d, o = reshape_track(shape_of(x), shape_of(u), *tx, tp)
        except Fail as e:
            raise Fail(e.why + where_of(u), e.outer, e.indivisible) from None
        if shape_of(u)[d] != shape_of(x)[tx[0]] and len(flow.trail) < 4:
            flow.trail.append(f"viewed as {list(shape_of(u))} (sharded dim {d}){where_of(u)}")
        return d, o
    if (name in EXPAND or name == "repeat") and tx is not None:  # new leading dims; the sharded one kept
        src, dst = shape_of(x), shape_of(u)
        d = tx[0] + len(dst) - len(src)
        if dst[d] != src[tx[0]]:
            raise Fail(f"{name} along the sharded dim{where_of(u)}")
        return d, tx[1]
    if name == "repeat_interleave" and tx is not None:
        dim = dims_arg(u, 2, len(shape_of(x)))
        if dim is None or (tx[0] in dim and tx[1] != 1):
            raise Fail(f"repeat_interleave over the sharded dim{where_of(u)}")
        return tx
    if name in PERMUTE and tx is not None:
        return _permuted(u, tx)
    if name in SPLIT and tx is not None:
        return _split(u, name, tx, tp)
    if name == "getitem" and tx is not None:
        return _index(u, tx, tp)
    if name in NORM and tx is not None:
        ns = u.args[1] if len(u.args) > 1 else u.kwargs.get("normalized_shape")
        k = len(ns) if isinstance(ns, (list, tuple)) else 1
        if tx[0] >= len(shape_of(x)) - k:
            raise Fail(f"{name} normalizes over the sharded dim{where_of(u)}")
        return tx
    if name in ("cross_entropy", "nll_loss") and tx is not None:
        if tx[0] == 1 and tx[1] == 1 and x is u.args[0] and _track(flow, u.args[1]) is None:
            if name == "nll_loss" and x not in flow.logp:
                raise Fail(f"nll_loss over values that are not log-probabilities{where_of(u)}")
            flow.vocab.append(u)
            return None
        raise Fail(f"{name} reads the sharded values other than as classes{where_of(u)}")
    if name in ("max", "min") and len(u.args) > 1 and isinstance(u.args[1], fx.Node):  # torch.max(a, b)
        return _elementwise(g, flow, u)
    if name in REDUCE and tx is not None:
        nd = len(shape_of(x))
        dims = dims_arg(u, 1, nd)
        if name == "normalize":
            dims = dims_arg(u, 2, nd) or {nd - 1}
        elif name in ("norm", "linalg_vector_norm"):  # (x, ord, dim): None is every dim
            dims = dims_arg(u, 2, nd)
        if dims is not None and tx[0] in dims and flow.relaxed and name in STATISTICS:
            if len(flow.trail) < 4:
                flow.trail.append(f"{name} over the sharded dim{where_of(u)} (each rank's part, then all-reduced)")
            return None
        if dims is None or tx[0] in dims:
            if name in ("log_softmax", "_log_softmax") and dims == {tx[0]} and tx[1] == 1 and tx[0] == nd - 1:
                flow.logp.add(u)  # a vocab-parallel log_softmax, if nll_loss reads it
                return tx
            raise Fail(f"{name} reduces over the sharded dim{where_of(u)}")
        out = val_of(u)
        res = out[0] if isinstance(out, (tuple, list)) else out
        d = tx[0] - sum(1 for q in dims if q < tx[0]) if res.dim() < nd else tx[0]
        return [(d, tx[1])] * len(out) if isinstance(out, (tuple, list)) else (d, tx[1])
    if name == "embedding":
        raise Fail(f"an embedding lookup indexed by the sharded values{where_of(u)}")
    if name in MATMUL:
        return _matmul(g, flow, u, name, tp)
    if name in CONV and tx is not None:
        return _depthwise(g, flow, u, tx)
    if name == "einsum":
        return _einsum_step(g, flow, u)
    if name in ("scaled_dot_product_attention", "flash_attention"):  # (autopar::flash_attention: (out, lse))
        t = _attention(g, flow, u)
        return [t, t] if name == "flash_attention" else t
    if name in CAT:
        return _cat(g, flow, u, name)
    if _elementwise_function(g, u):
        t = _elementwise(g, flow, u)
        return [t] * len(val) if isinstance(val, (tuple, list)) else t
    if pointwise(name) or name in ("where", "masked_fill"):
        return _elementwise(g, flow, u)
    return measured_step(g, flow, u, flow.tracks)  # no table entry: how it splits, found by running it


def _elementwise_function(g: Graph, u: fx.Node) -> bool:
    """A custom autograd function (``autograd_function_apply``) whose forward body is elementwise
    ops only (BLOOM's GeLUFunction): an elementwise op."""
    if op_name(u) != "autograd_function_apply" or not u.args or not isinstance(u.args[0], fx.Node):
        return False
    from autopar.modpath import get_attr

    body = get_attr(g.gm, u.args[0].target) if u.args[0].op == "get_attr" else None
    if not isinstance(body, fx.GraphModule):
        return False
    ops = [n for n in body.graph.nodes if n.op in ("call_function", "call_method")]
    return bool(ops) and all(pointwise(op_name(n)) or op_name(n) in SAME or op_name(n) == "_set_grad_enabled"
                             for n in ops)


def _permuted(u: fx.Node, tx):
    nd = len(shape_of(u))
    labels = [None] * nd
    labels[tx[0]] = "S"
    out = apply_permute(u, labels)
    if out is None:
        raise Fail(f"{op_name(u)}{where_of(u)}: a permutation autopar cannot follow")
    return out.index("S"), tx[1]


def _split(u: fx.Node, name: str, tx, tp: int):
    src = shape_of(u.args[0])
    nd = len(src)
    if name == "unbind":
        dim = dims_arg(u, 1, nd) or {0}
        (dim,) = dim
        if dim == tx[0]:
            raise Fail(f"unbind over the sharded dim{where_of(u)}")
        return [(tx[0] - (dim < tx[0]), tx[1])] * src[dim]
    dim = dims_arg(u, 2, nd) or {0}
    (dim,) = dim
    parts = [int(v.shape[dim]) for v in val_of(u)]
    if dim != tx[0]:
        return [tx] * len(parts)
    n, o = src[dim], tx[1]
    m = n // o
    if all(p % m == 0 for p in parts):
        return [(dim, p // m) for p in parts]
    unit = math.gcd(math.gcd(*parts), m)
    raise Fail(f"{name} into parts {parts}{where_of(u)} crosses the shards", outer=n // unit // o)


def _index(u: fx.Node, tx, tp: int):
    """x[idx] with slices, None, ints and Ellipsis: the sharded dim must be kept whole."""
    idx = u.args[1] if isinstance(u.args[1], tuple) else (u.args[1],)
    src = shape_of(u.args[0])
    lists = [i for i in idx if isinstance(i, list)]
    if any(isinstance(i, (fx.Node, torch.Tensor)) for i in idx) or len(lists) > 1 or \
            any(type(j) is not int for i in lists for j in i):
        raise Fail(f"indexing with tensors{where_of(u)}")  # (one list of ints keeps its dim in place: qkv[..., [-2], :])
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
            n, o = src[d_in], tx[1]
            if isinstance(i, slice) and i.step not in (None, 1) and o == 1:  # [..., ::2]: interleaved parts
                lo, hi, step = i.indices(n)
                if lo < step and hi == n and (n // tp) % step == 0:  # each rank's part holds whole strides
                    return d_out, 1
            if type(i) is int and n % o == 0 and n // o > 1:  # one of n parts: ([gate | up] viewed [.., 2, f], h[..., 0, :])
                raise Fail(f"an index into the sharded dim{where_of(u)} picks one of {n} parts", outer=n // o)
            if not isinstance(i, slice) or i.step not in (None, 1):
                raise Fail(f"indexing into the sharded dim{where_of(u)}")  # (an int or a list of them too)
            lo, hi, _ = i.indices(n)
            m = n // o
            if lo % m == 0 and hi % m == 0 and hi > lo:  # whole parts: [q | k | v][..., :q_size]
                return d_out, (hi - lo) // m
            unit = math.gcd(math.gcd(lo, hi), math.gcd(n, m))
            raise Fail(f"a slice [{lo}:{hi}] of the sharded dim{where_of(u)} crosses the shards", outer=n // unit // o)
        d_in += 1
        if not isinstance(i, int):  # (a slice, or the one list: its dim stays)
            d_out += 1
    raise Fail(f"indexing autopar cannot follow{where_of(u)}")


def _copy_into(g: Graph, flow: Flow, u: fx.Node):
    """``dst.copy_(src)``: sharded values written into a slice of a fresh buffer (DeepSeek's
    keys, ``k = new_empty(...); k[..., :a].copy_(k_nope); k[..., a:].copy_(k_rope)``) make the
    buffer sharded the same way, when the slice keeps the sharded dim whole; a value written
    into a sharded buffer must be sharded the same way (or broadcast along that dim)."""
    dst, src = u.args[0], u.args[1]
    td, ts = _track(flow, dst), _track(flow, src)
    if td is not None:
        if ts is None:
            _operand_needs(g, flow, u, src, td[0] - (len(shape_of(dst)) - len(shape_of(src))), td[1])
        elif ts != td:
            raise Fail(f"copy_{where_of(u)} writes values sharded differently")
        return td
    base = dst
    while isinstance(base, fx.Node) and op_name(base) == "getitem" and not isinstance(base.args[1], fx.Node):
        base = base.args[0]
    d, o = ts
    if base is dst or op_name(base) not in FRESH or shape_of(dst) != shape_of(src) or \
            len(shape_of(base)) != len(shape_of(dst)) or shape_of(base)[d] != shape_of(dst)[d]:
        raise Fail(f"copy_{where_of(u)}: the sharded values written in place into a tensor autopar cannot follow")
    flow.written.append((base, (d, o)))
    return d, o


def _setitem(g: Graph, flow: Flow, u: fx.Node, tp: int):
    """``buf[idx] = value`` (a chunked scan filling its output chunk by chunk): as ``copy_`` into
    ``buf[idx]``. Sharded values written where the index keeps the sharded dim whole make a
    fresh buffer sharded the same way; a value written into a sharded buffer must be sharded the
    same way (or broadcast along that dim). Ends nothing: the buffer's readers carry on."""
    dst, idx, src = u.args
    td, ts = _track(flow, dst), _track(flow, src)
    view = _view_shape(u)
    if view is None:
        raise Fail(f"setitem{where_of(u)}: values written at positions a tensor indexes, along a sharded dim")
    if td is not None:
        d, o = _index(u, td, tp)  # the sharded dim in buf[idx] (u's args are getitem's: buf, idx)
        if ts is None:
            if isinstance(src, fx.Node):
                _operand_needs(g, flow, u, src, d - (len(view) - len(shape_of(src))), o)
        elif ts != (d - (len(view) - len(shape_of(src))), o):
            raise Fail(f"setitem{where_of(u)} writes values sharded differently")
        return None
    if ts is None or not isinstance(dst, fx.Node) or op_name(dst) not in FRESH:
        raise Fail(f"setitem{where_of(u)}: the sharded values written in place into a tensor autopar cannot follow")
    if tuple(shape_of(src)) != tuple(view):
        raise Fail(f"setitem{where_of(u)} broadcasts the sharded values")
    for d_in in range(len(shape_of(dst))):  # the buffer's dim that holds the value's sharded dim whole
        try:
            if _index(u, (d_in, ts[1]), tp) == ts and shape_of(dst)[d_in] == view[ts[0]]:
                flow.written.append((dst, (d_in, ts[1])))
                return None
        except Fail:
            continue
    raise Fail(f"setitem{where_of(u)}: the sharded values written across the buffer's dims")


def _view_shape(u: fx.Node) -> tuple | None:
    """The shape of ``buf[idx]`` for ``setitem(buf, idx, value)``; None where a tensor indexes."""
    return tuple(val_of(u.args[0])[u.args[1]].shape) if not any(
        isinstance(i, fx.Node) for i in (u.args[1] if isinstance(u.args[1], tuple) else (u.args[1],))) else None


def _operand_needs(g: Graph, flow: Flow, u: fx.Node, a, dim: int, o: int) -> None:
    """An untracked operand ``a`` holding the sharded dim's full extent at its dim ``dim``: a
    parameter is sharded with it; a value that needs no gradient (a mask, rotary tables) is
    sliced locally, as is a value broadcast along that dim (its gradient: a partial sum); a
    value that needs one must come sharded the same way from another flow."""
    if broadcast(a, dim):
        return
    pv = param_back(g, a, dim, o)
    if pv is not None:
        pname, pdim, o = pv
        prev = flow.extra.setdefault(pname, (pdim, o, u))
        if prev[:2] != (pdim, o):
            raise Fail(f"parameter {pname} combined with the sharded values along two different dims")
        return
    if a in g.grad:
        flow.needs.append((u, a, (dim, o)))


def _depthwise(g: Graph, flow: Flow, u: fx.Node, tx):
    """A convolution with one filter per channel (``groups`` = channels: Mamba's causal conv1d)
    over values sharded on the channels: each rank convolves its channels, the weight and bias
    sharded with them."""
    args = list(u.args) + [None] * 7
    x, w, b = args[0], args[1] if args[1] is not None else u.kwargs.get("weight"), \
        args[2] if args[2] is not None else u.kwargs.get("bias")
    groups = args[6] if len(u.args) > 6 else u.kwargs.get("groups", 1)
    sx, sw = shape_of(x), shape_of(w)
    if x is not u.args[0] or tx[0] != 1 or groups != sx[1] or sw[0] != sx[1] or sw[1] != 1:
        raise Fail(f"{op_name(u)}{where_of(u)} mixes the sharded channels")
    for a in (w, b):
        if isinstance(a, fx.Node):
            _operand_needs(g, flow, u, a, 0, tx[1])
    return 1, tx[1]


def _elementwise(g: Graph, flow: Flow, u: fx.Node):
    v = val_of(u)
    out = tuple(v[0].shape) if isinstance(v, (tuple, list)) else shape_of(u)
    nd = len(out)
    tensors = [a for a in list(u.args) + list(u.kwargs.values()) if isinstance(a, fx.Node)
               and isinstance(val_of(a), torch.Tensor)]
    tracked = [(a, flow.tracks[a]) for a in tensors if _track(flow, a) is not None]
    outs = {(t[0] + nd - len(shape_of(a)), t[1]) for a, t in tracked}
    if len(outs) != 1:
        raise Fail(f"{op_name(u)}{where_of(u)} combines values sharded along different dims")
    ((d, o),) = outs
    for a in tensors:
        if _track(flow, a) is not None:
            continue
        s = shape_of(a)
        da = d - (nd - len(s))
        if da >= 0 and s[da] == out[d] and out[d] > 1:
            _operand_needs(g, flow, u, a, da, o)
    return d, o


def _cat(g: Graph, flow: Flow, u: fx.Node, name: str):
    tensors = u.args[0]
    ref = next(a for a in tensors if _track(flow, a) is not None)
    src = shape_of(ref)
    nd = len(src)
    dim = (dims_arg(u, 1, nd + (name == "stack")) or {0}).pop()
    d, o = flow.tracks[ref]
    if name != "stack" and dim == d:
        return _cat_parts(g, flow, u, name, tensors, d, o)
    for a in tensors:
        t = _track(flow, a)
        if t is None:
            _operand_needs(g, flow, u, a, d, o)
        elif t != (d, o):
            raise Fail(f"{name}{where_of(u)} joins values sharded differently")
    return (d + (1 if name == "stack" and dim <= d else 0)), o


def _cat_parts(g: Graph, flow: Flow, u: fx.Node, name: str, tensors, d: int, o: int):
    """``cat`` of k equal parts along their sharded dim (``cat((q, k, v), -1)`` before a shared
    depthwise conv): each rank holds its share of every part, side by side (a strided layout of k
    parts, as a fused projection's); the parts not this flow's must come sharded so from another."""
    sizes = {shape_of(a)[d] for a in tensors}
    if o != 1 or len(sizes) != 1:
        raise Fail(f"{name} along the sharded dim{where_of(u)}"
                   + (" of unequal parts" if len(sizes) > 1 else " of values already in parts"))
    for a in tensors:
        t = _track(flow, a)
        if t is None:
            if a not in g.grad:  # a constant part (no gradient) has no shards to match
                raise Fail(f"{name} along the sharded dim with a value no flow shards{where_of(u)}")
            flow.needs.append((u, a, (d, 1)))
        elif t != (d, 1):
            raise Fail(f"{name}{where_of(u)} joins values sharded differently")
    if len(flow.trail) < 4:
        flow.trail.append(f"{name} of {len(tensors)} parts, each sharded{where_of(u)}")
    return d, len(tensors)


def _matmul(g: Graph, flow: Flow, u: fx.Node, name: str, tp: int):
    if parse_einsum(u) is not None and any(g.param_view(a) is not None for a in u.args):
        return _einsum_step(g, flow, u)  # a batched matmul with a stacked weight (bmm(x, W_experts))
    mw = matmul_weight(g, u)
    if mw is not None:
        x, wname, contracted, _, _ = mw
        tx = _track(flow, x)
        if tx is None:
            raise Fail(f"a weight{where_of(u)} multiplied by the sharded values")
        nd = len(shape_of(x))
        if tx[0] == nd - 1:  # contracts the sharded dim: row-parallel, the flow ends here
            flow.rows.append((u, wname, contracted, tx[1]))
            return None
        return tx  # the matmul acts along another dim (per head): the sharded dim passes through
    wf = weight_first(g, u)
    if wf is not None:
        x, wname, contracted, _ = wf
        tx = _track(flow, x)
        if tx is None:
            raise Fail(f"a weight{where_of(u)} multiplied by the sharded values")
        nx, no = len(shape_of(x)), len(shape_of(u))
        if tx[0] == nx - 2:  # W @ x contracts x's rows: row-parallel
            flow.rows.append((u, wname, contracted, tx[1]))
            return None
        return tx[0] + no - nx, tx[1]
    args = [a for a in list(u.args) + [u.kwargs.get(k) for k in ("input", "batch1", "batch2", "other")]
            if isinstance(a, fx.Node)]
    if name == "baddbmm":
        inp, a, b = args[:3]
        for v in (a, b):
            if _track(flow, v) is None:
                _operand_needs(g, flow, u, v, 0, (_track(flow, a) or _track(flow, b))[1])
        ta, tb = _track(flow, a), _track(flow, b)
        t = ta or tb
        if t[0] != 0 or (ta and tb and ta != tb):
            raise Fail(f"{name}{where_of(u)} over the sharded dim")
        if _track(flow, inp) is None and shape_of(inp)[0] == shape_of(u)[0]:
            _operand_needs(g, flow, u, inp, 0, t[1])
        return t
    a, b = args[:2]
    sa, sb, so = shape_of(a), shape_of(b), shape_of(u)
    ta, tb = _track(flow, a), _track(flow, b)
    if len(sa) < 3 or len(sb) < 3:
        raise Fail(f"{name}{where_of(u)}: a matmul of the sharded values autopar cannot follow")
    outs = set()
    # per operand: its dim the product contracts, and its matrix dim the output keeps (a's rows, b's columns)
    gones = (len(sa) - 1, len(sb) - 2)
    for t, s, gone, kept, at in ((ta, sa, gones[0], len(sa) - 2, len(so) - 2), (tb, sb, gones[1], len(sb) - 1, len(so) - 1)):
        if t is not None:
            if t[0] == gone:
                return _contracted(g, flow, u, [(a, gones[0]), (b, gones[1])], t[1])
            outs.add((at, t[1]) if t[0] == kept else (t[0] + len(so) - len(s), t[1]))
    if len(outs) != 1:
        raise Fail(f"{name}{where_of(u)} multiplies values sharded differently")
    ((d, o),) = outs
    for v, t, s in ((a, ta, sa), (b, tb, sb)):
        if t is None and d < len(so) - 2:  # a batch dim: the other operand holds it too
            dv = d - (len(so) - len(s))
            if dv >= 0 and s[dv] == so[d]:
                _operand_needs(g, flow, u, v, dv, o)
    return d, o


def _contracted(g: Graph, flow: Flow, u: fx.Node, operands, o: int):
    """A matmul (or einsum) contracting the sharded dim between values that are not a weight (a
    sparse-attention indexer's ``sum_h w[b,s,h] * relu(q[b,s,h] . k[t])``: both heads-sharded).
    In the second pass only: every operand holding that dim is this flow's, or comes sharded the
    same way from another flow (a value without a gradient is sliced locally); each rank
    contracts its share and the output is a partial sum, all-reduced where it is needed whole
    (one all-reduce of the output's size, the price against computing the whole on every rank).
    The flow ends there. In the first pass: refused, so Megatron's own regions come first; and
    where the output is more than half the largest sharded operand (Mamba-2's ``C . B`` over the
    state, [.., chunk, chunk, heads] from [.., chunk, heads, state]): its all-reduce would move more
    than gathering that operand, so the operands are better held whole."""
    if not flow.relaxed:
        raise Fail(f"{op_name(u)}{where_of(u)} contracts the sharded dim between values that are not a weight")
    biggest = max(math.prod(shape_of(a)) for a, _ in operands)
    if 2 * math.prod(shape_of(u)) > biggest:
        raise Fail(f"{op_name(u)}{where_of(u)} contracts the sharded dim into a partial sum of "
                   f"{list(shape_of(u))}, more than half its operand's size (the all-reduce would cost more)")
    for a, dim in operands:
        t = _track(flow, a)
        if t is None:
            if g.param_view(a) is not None:
                raise Fail(f"{op_name(u)}{where_of(u)} contracts the sharded dim with a weight read another way")
            _operand_needs(g, flow, u, a, dim, o)
        elif t != (dim, o):
            raise Fail(f"{op_name(u)}{where_of(u)} contracts values sharded differently")
    flow.partial.append(u)
    return None


def _einsum_step(g: Graph, flow: Flow, u: fx.Node):
    """An einsum reading the sharded values: a letter the output keeps passes through (the other
    operands holding it follow, as in an elementwise op); a letter contracted with a weight's
    ends the flow there (row-parallel, that weight sharded on the letter's dim)."""
    parsed = parse_einsum(u)
    if parsed is None:
        raise Fail(f"einsum{where_of(u)}: an equation autopar cannot follow (ellipsis or implicit output)")
    ins, out, ops = parsed
    tracked = {(ins[i][flow.tracks[a][0]], flow.tracks[a][1]) for i, a in enumerate(ops) if _track(flow, a) is not None}
    if len(tracked) != 1:
        raise Fail(f"einsum{where_of(u)} combines values sharded along different letters")
    ((letter, o),) = tracked
    if letter not in out:
        weights = [(g.param_view(a), s) for a, s in zip(ops, ins) if letter in s and _track(flow, a) is None]
        if len(weights) != 1 or weights[0][0] is None:
            return _contracted(g, flow, u, [(a, s.index(letter)) for a, s in zip(ops, ins) if letter in s], o)
        (wname, perm), letters = weights[0]
        flow.rows.append((u, wname, perm[letters.index(letter)], o))
        return None
    for a, s in zip(ops, ins):
        if _track(flow, a) is None and letter in s:
            _operand_needs(g, flow, u, a, s.index(letter), o)
    return out.index(letter), o


def _attention(g: Graph, flow: Flow, u: fx.Node):
    q, k, v = u.args[:3]
    mask = u.args[3] if len(u.args) > 3 else u.kwargs.get("attn_mask")
    nd = len(shape_of(q))
    heads = None  # the mask's heads dim, where it has one of more than one head
    if isinstance(mask, fx.Node):
        h = nd - 3 - (nd - len(shape_of(mask)))
        heads = h if h >= 0 and shape_of(mask)[h] > 1 else None
    tm = _track(flow, mask) if isinstance(mask, fx.Node) else None
    if tm is not None and (heads is None or tm[0] != heads):
        raise Fail(f"the attention mask is sharded{where_of(u)} other than by heads")
    ts = [_track(flow, a) for a in (q, k, v)]
    t = next((x for x in ts if x is not None), None) or (nd - 3, tm[1])
    if t[0] != nd - 3 or any(x is not None and x != t for x in ts) or (tm is not None and tm[1] != t[1]):
        raise Fail(f"attention{where_of(u)} over values not sharded by heads")
    for a, x in zip((q, k, v), ts):
        if x is None and not (a is not q and shape_of(a)[nd - 3] == 1):  # one K/V head broadcast: whole on each rank
            _operand_needs(g, flow, u, a, nd - 3, t[1])
    if len(flow.trail) < 4:
        flow.trail.append(f"attention over heads{where_of(u)}")
    if tm is None and heads is not None and mask in g.grad:  # a trained bias per head: split by heads with them
        _operand_needs(g, flow, u, mask, heads, t[1])
    return t


