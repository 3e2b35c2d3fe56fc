"""What an operand of a sharded value is, seen back through the ops that made it (the
tensor-parallel derivation, autopar/analysis/tp_flow.py): the same on every rank's part (an
expand of size 1, one key / value head repeated for every query head), or a parameter seen
through views, casts, elementwise functions and constants."""

from __future__ import annotations

import math
from torch import fx

from autopar.analysis.tp_graph import (EXPAND, PERMUTE, RESHAPE, SAME, Fail, Graph, apply_permute, op_name, pointwise,
                                       reshape_track, shape_of)


def broadcast(a, dim: int) -> bool:
    """``a`` is an expand of a value of size 1 at ``dim`` (the same on every rank's part), or a
    reshape merging such expanded dims (one key / value head repeated for every query head:
    ``repeat_kv`` with one KV head, multi-query attention); seen through casts, padding of other
    dims, ``repeat_interleave`` of a size-1 dim, and einsums whose operands holding that letter
    are all broadcast along it (Mamba-2's B and C, one group repeated for every head, and their
    product per head ``einsum("bclhn,bcshn->bclsh", C, B)``)."""
    if not isinstance(a, fx.Node):
        return False
    name = op_name(a)
    if name in SAME and a.args and isinstance(a.args[0], fx.Node) and shape_of(a.args[0]) == shape_of(a):
        return broadcast(a.args[0], dim)
    if name == "pad" and len(a.args) > 1 and isinstance(a.args[1], (list, tuple)) and isinstance(a.args[0], fx.Node):
        nd = len(shape_of(a))
        return tuple(a.args[1][2 * (nd - 1 - dim):2 * (nd - dim)]) in ((), (0, 0)) and broadcast(a.args[0], dim)
    if name == "repeat_interleave" and isinstance(a.args[0], fx.Node):
        d = a.args[2] if len(a.args) > 2 else a.kwargs.get("dim")
        src = shape_of(a.args[0])
        return isinstance(d, int) and d % len(src) == dim and src[dim] == 1
    if name in PERMUTE and isinstance(a.args[0], fx.Node):  # (repeat_kv's keys, transposed for q @ k^T)
        d = permuted_from(a, dim)
        return d is not None and broadcast(a.args[0], d)
    if name == "einsum":
        from autopar.analysis.tp_starts import parse_einsum

        parsed = parse_einsum(a)
        if parsed is None:
            return False
        ins, out, ops = parsed
        letter = out[dim]
        holding = [(op, s.index(letter)) for s, op in zip(ins, ops) if letter in s]
        return bool(holding) and all(broadcast(op, i) for op, i in holding)
    if name in RESHAPE and isinstance(a.args[0], fx.Node):
        src, out = shape_of(a.args[0]), shape_of(a)
        group = merged_into(src, out, dim) or _same_dim(src, out, dim)
        return bool(group) and all(broadcast(a.args[0], j) for j in group)
    if not isinstance(a, fx.Node) or op_name(a) not in EXPAND or not isinstance(a.args[0], fx.Node):
        return False
    src, out = shape_of(a.args[0]), shape_of(a)
    ds = dim - (len(out) - len(src))
    return ds < 0 or src[ds] == 1


def permuted_from(a: fx.Node, dim: int) -> int | None:
    """The dim of ``a``'s input that a permutation (transpose, permute, movedim) puts at ``dim``."""
    nd = len(shape_of(a))
    out = apply_permute(a, list(range(nd)))
    return None if out is None else out[dim]


def _same_dim(src, out, dim: int) -> list[int]:
    """[i] where a reshape from ``src`` to ``out`` keeps ``out[dim]`` as ``src``'s dim i whole (the
    dims before it hold as many elements: Mamba-2's [b, s, h, n] -> [b, chunks, l, h, n]); else []."""
    before = math.prod(out[:dim])
    for i in range(len(src)):
        if math.prod(src[:i]) == before and src[i] == out[dim]:
            return [i]
    return []


def merged_into(src, out, dim: int) -> list[int]:
    """The dims of ``src`` that a reshape to ``out`` merges into its dim ``dim`` (of size > 1),
    or [] where the reshape does not map whole dims onto it."""
    i = j = 0
    while i < len(src) and j < len(out):
        group, a, b = [i], src[i], out[j]
        while a != b and i + 1 < len(src) and a < b:
            i += 1
            group.append(i)
            a *= src[i]
        if a != b:
            return []
        if j == dim:
            return group if b > 1 else []
        i, j = i + 1, j + 1
    return []


def param_back(g: Graph, a, dim: int, o: int):
    """(parameter, its dim, outer parts) if ``a`` is a parameter seen through casts, transposes,
    views and expands (per-head attention sinks broadcast to [B, H, S, 1]) whose dim ``dim`` comes
    from that parameter dim; else None."""
    pv = g.param_view(a)
    if pv is not None:
        return pv[0], pv[1][dim], o
    if not isinstance(a, fx.Node) or a.op not in ("call_function", "call_method") or not a.args:
        return None
    name, src = op_name(a), a.args[0]
    if not isinstance(src, fx.Node) or shape_of(src) is None:
        return None
    s_in, s_out = shape_of(src), shape_of(a)
    try:
        if name == "getitem" and only_new_dims(a.args[1]):  # p[None, :, None]
            d, o2 = reshape_track(s_out, s_in, dim, o, 1)
            return param_back(g, src, d, o2)
        if pointwise(name) and [x for x in a.all_input_nodes] == [src] and s_in == s_out:  # -exp(A_log)
            return param_back(g, src, dim, o)
        grads = [x for x in a.all_input_nodes if x in g.grad]
        if pointwise(name) and len(grads) == 1 and shape_of(grads[0]) is not None:
            # constant + param (RWKV's max_state + time_decay): the parameter's dim, broadcast as it is
            s_p = shape_of(grads[0])
            d = dim - (len(s_out) - len(s_p))
            return param_back(g, grads[0], d, o) if d >= 0 and s_p[d] == s_out[dim] else None
        if name == "getitem" and isinstance(a.args[1], fx.Node) and shape_of(a.args[1]) is not None:
            k = len(shape_of(a.args[1]))  # param[idx]: rows picked per token (a bias per expert)
            return param_back(g, src, dim - k + 1, o) if dim >= k else None
        if name in SAME:
            return param_back(g, src, dim, o)
        if name in PERMUTE:  # (a grouped weight: W.view(groups, -1, k).transpose(1, 2), DeepSeek-V4's o_a_proj)
            d = permuted_from(a, dim)
            return param_back(g, src, d, o) if d is not None else None
        if name in EXPAND:
            d = dim - (len(s_out) - len(s_in))
            return param_back(g, src, d, o) if d >= 0 and s_in[d] == s_out[dim] else None
        if name in RESHAPE:
            d, o2 = reshape_track(s_out, s_in, dim, o, 1)
            return param_back(g, src, d, o2)
    except Fail:
        return None
    return None


def only_new_dims(idx) -> bool:
    idx = idx if isinstance(idx, tuple) else (idx,)
    return any(i is None for i in idx) and all(i is None or i is Ellipsis or i == slice(None) for i in idx)
