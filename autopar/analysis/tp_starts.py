"""Where a flow of the tensor-parallel derivation (autopar/analysis/tensor_parallel.py) starts: a
matmul with a 2-D weight (either way round, or weight first), an einsum keeping one of a
weight's letters, or an op with no table entry that splits its output when its weight is split
(autopar/analysis/tp_measured.py)."""

from __future__ import annotations

from torch import fx

from autopar.analysis.tp_graph import KNOWN, Graph, op_name, pointwise, shape_of
from autopar.analysis.tp_measured import measured_start


def matmul_weight(g: Graph, n: fx.Node):
    """(activation, weight name, the weight's contracted dim, its output dim, bias name) of a
    matmul with a 2-D weight; None for others."""
    name = op_name(n)
    if name in ("linear", "linear_act"):  # (autopar::linear_act: the lower pass's linear + activation)
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


def weight_first(g: Graph, n: fx.Node):
    """(activation, weight name, the weight's contracted dim, its output dim) of ``W @ x`` (``mm`` /
    ``matmul`` with a 2-D weight first: Mamba's ``dt_proj.weight @ x``, ``[out, in] @ [.., in, L]``);
    None for others."""
    if op_name(n) not in ("mm", "matmul") or len(n.args) < 2:
        return None
    w, x = n.args[0], n.args[1]
    pv = g.param_view(w)
    if pv is None or len(pv[1]) != 2 or g.param_view(x) is not None or len(shape_of(x) or ()) < 2:
        return None
    return x, pv[0], pv[1][1], pv[1][0]


def start_of(g: Graph, n: fx.Node) -> tuple | None:
    """(weight, its dim the output dim comes from, bias, the output's dim holding it) where ``n``
    multiplies an activation by a weight: a matmul (the output's last dim), or an einsum where
    exactly one of the weight's letters is kept and not the activation's (``becd,edf->becf``:
    ``f``, stacked experts); None for anything else."""
    mw = matmul_weight(g, n)
    if mw is not None:
        _, wname, _, out_pdim, bias = mw
        return wname, out_pdim, bias, -1
    wf = weight_first(g, n)
    if wf is not None:  # W @ x: the output's rows
        return wf[1], wf[3], None, -2
    parsed = parse_einsum(n)
    if parsed is None:
        name = op_name(n)
        return None if name in KNOWN or pointwise(name) else measured_start(g, n)
    if len(parsed[2]) != 2:
        return None
    ins, out, ops = parsed
    views = [g.param_view(a) for a in ops]
    if sum(v is not None for v in views) != 1:
        return None
    w = 0 if views[0] is not None else 1
    (wname, perm), x_letters = views[w], ins[1 - w]
    kept = [c for c in ins[w] if c in out and c not in x_letters]
    if len(kept) != 1:
        return None
    return wname, perm[ins[w].index(kept[0])], None, out.index(kept[0])


def parse_einsum(n: fx.Node) -> tuple[list[str], str, list] | None:
    """(the operands' subscripts, the output's, the operands) of ``torch.einsum(eq, *ops)``
    (explicit ``->``, no ellipsis), or of a batched matmul of two 3-D values (``bmm(x, W)``:
    Llama-4's stacked experts ``[E, T, H] @ [E, H, F]`` read as ``eth,ehf->etf``); None otherwise."""
    if op_name(n) in ("bmm", "matmul") and len(n.args) == 2 and not n.kwargs and \
            all(len(shape_of(a) or ()) == 3 for a in n.args):
        return ["bmk", "bkn"], "bmn", list(n.args)
    if op_name(n) != "einsum" or not n.args or not isinstance(n.args[0], str):
        return None
    eq = n.args[0].replace(" ", "")
    ops = list(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else list(n.args[1:])
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if len(ins) != len(ops) or any(len(s) != len(shape_of(a) or ()) for s, a in zip(ins, ops)):
        return None
    return ins, out, ops
