"""masks: an attention mask that no input decides, and that is the causal mask, becomes ``is_causal``.

Traced, a model often builds its attention mask where eager PyTorch would not: Hugging Face's
masking utilities, under dynamo, cannot take the data-dependent shortcut that hands SDPA
``is_causal=True``, so the captured graph computes a boolean ``[batch, 1, seq, seq]`` mask from
``arange``s and position ids every step and attends with it. The joint program then pays for the
mask's ops, reads it in every attention (forward and backward), and SDPA cannot skip the masked
half of the blocks (nor, on a GPU, use the flash kernel, which takes no mask).

This pass looks at the torch-level graph's structure, not at who built the mask: for every
``scaled_dot_product_attention`` whose ``attn_mask`` is computed from no placeholder (no input,
parameter or buffer of the model: only factories such as ``arange`` and constants the trace
made), it evaluates that subgraph on the CPU (again under another seed where the first evaluation ran
an op that draws random numbers, seen by ATen's ``nondeterministic_seeded`` tag, so a random
mask is never taken for a constant) and, where the value is exactly the causal mask SDPA's ``is_causal=True``
means (bool: ``True`` on and below the diagonal; additive: 0 there and ``-inf`` or the dtype's
lowest value above), for every batch row and head, rewrites the call to ``attn_mask=None, is_causal=True``.
The mask's nodes that nothing else reads leave the graph (with any constant nothing read).
A mask computed from a tensor that an in-place op outside its own computation writes (``m[:, 0] =
True`` after ``m`` is made, possibly through a view) is kept: the value SDPA reads is not the one
evaluated. Any other mask is left as it was.

Then, grouped-query attention written out: an SDPA without a mask or dropout whose keys and
values are the KV heads repeated to the query heads (``repeat_interleave(k, G, dim=1)``, or Hugging
Face's ``repeat_kv``: expand + reshape) becomes ``enable_gqa=True`` over the KV heads themselves, the
same attention (KV head j serves query heads jG ... jG + G - 1 either way). Transformers makes this
call itself when it has no mask; traced, it built one and repeated the heads, and the repeated
copies were what the backward kept (G times the keys' and values' bytes per layer). Kept where
the plan splits heads over more ranks than there are KV heads (the attention rule shards K and V
by heads with Q), with one KV head, or under user rules; ``state.masks`` says which.

A mask whose subgraph would hold more than ``EVAL_BYTES`` (planning a long sequence on meta
tensors: Llama-3-70B's batch 128 x 4096 makes Hugging Face's mask 14 GiB to evaluate) is evaluated
one batch row only, where that row stands for every row: its large values are pointwise ops,
casts and expands over the batch rows, and the small values they read (evaluated whole) have
identical rows (``_one_row``). Otherwise it stays, and the pass says so. What it did and did not rewrite is
recorded, one line per mask (with how many attentions read it), in ``state.masks``
(``pm.ctx.masks``; ``pm.report()``, ``autopar plan`` and ``autopar dump`` print it).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autopar import torch_compat as tc
from autopar.ir import CompileState, source_line

_SDPA = tc.native_nn("scaled_dot_product_attention")
EVAL_BYTES = 256 << 20  # the most the mask's subgraph may hold, summed over its values, to be evaluated


def _val(n):
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _constant_nodes(gm: fx.GraphModule, model_tensors: set[int]) -> set[fx.Node]:
    """The nodes whose every input is a constant or another such node: no placeholder, and no
    parameter or buffer of the model (``model_tensors``: their ids), which training or the user
    may change; only the constants the trace itself made."""
    const: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if id(_attr(gm, n.target)) not in model_tensors:
                const.add(n)
        elif n.op in ("call_function", "call_method"):
            ins = n.all_input_nodes
            if all(a in const for a in ins) and not _effectful(n):
                const.add(n)
    return const


def _effectful(n: fx.Node) -> bool:
    """Grad-mode switches, profiler records and the like: nodes kept for their effect, not a value."""
    return n.op == "call_function" and n.is_impure() and not isinstance(_val(n), torch.Tensor)


_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.ipow}


def _mutates(n: fx.Node) -> bool:
    """``n`` writes into a tensor it is given (dynamo's graph keeps the user's in-place ops):
    ``x.masked_fill_(...)``, ``x[i] = v``, ``x &= m``, ``out=`` arguments, a mutable ATen op."""
    if n.op == "call_method":
        return n.target.endswith("_") and not n.target.startswith("__")
    if n.op != "call_function":
        return False
    if n.target in _INPLACE_OPERATORS or "out" in n.kwargs:
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    if getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return False  # (operator.and_ / or_ are not in place: the in-place ones are listed above)
    name = getattr(n.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")  # torch.relu_, torch.Tensor.add_, ...


def _written(graph: fx.Graph) -> list[tuple[fx.Node, set[fx.Node]]]:
    """Every in-place op in the graph, with what the tensor it writes is computed from (itself
    included): a mask computed from any of those may be one the write changes (through a view),
    unless the write is one of the ops the mask is computed from (replayed when it is evaluated)."""
    return [(n, set(_ancestors(n.args[0]))) for n in graph.nodes
            if _mutates(n) and n.args and isinstance(n.args[0], fx.Node)]


def _ancestors(n: fx.Node) -> list[fx.Node]:
    seen, stack = {n}, [n]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    order = {m: i for i, m in enumerate(n.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _on_cpu(x):
    if isinstance(x, torch.device):
        return torch.device("cpu")
    if isinstance(x, str) and x.split(":")[0] in ("cuda", "meta", "xpu", "mps", "hpu"):
        return "cpu"
    return x


def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node], env: dict | None = None, rows=None) -> torch.Tensor:
    """The value of the last of ``nodes`` (a subgraph closed over constants), computed on the CPU.
    ``env``: values already computed (nodes outside ``nodes``), filled with those of ``nodes``;
    ``rows``: (count, n) to compute the first n of ``count`` batch rows only (see ``_one_row``)."""
    env = {} if env is None else env

    def load(a):
        if not isinstance(a, fx.Node):
            return _on_cpu(a)
        v = env[a]
        if rows is not None and isinstance(v, torch.Tensor) and v.ndim == rank and v.shape[0] == rows[0] > rows[1]:
            return v[:rows[1]]  # a value with every batch row: the rows computed
        return v

    rank = _val(nodes[-1]).ndim if rows is not None else 0
    for n in nodes:
        args = fx.node.map_aggregate(n.args, load)
        kwargs = fx.node.map_aggregate(n.kwargs, load)
        if rows is not None and n.op == "call_method" and n.target == "expand":
            sizes = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
            sizes[0] = rows[1] if sizes[0] == rows[0] else sizes[0]
            args = (args[0], *sizes)
        if n.op == "get_attr":
            obj = _attr(gm, n.target)
            env[n] = obj.to("cpu") if isinstance(obj, torch.Tensor) else obj
        elif n.op == "call_method":
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        else:
            env[n] = n.target(*args, **kwargs)
    return env[nodes[-1]]


ROW_OPS = {"to", "bool", "float", "int", "long", "half", "bfloat16", "double", "expand"}  # besides pointwise ops


def _one_row(gm: fx.GraphModule, nodes: list[fx.Node]):
    """A mask whose every batch row is provably the same computation: its large values (each at
    least one of the mask's rows in bytes) are pointwise ops, casts and expands of the batch rows
    (Hugging Face's ``[batch, 1, seq, seq]`` mask from per-row position ids), and the small values
    they read (evaluated whole) have identical rows. Then row 0 computed is every row:
    ``(mask's row 0, rows)``; None where that does not hold. (Tried first for every mask: Llama-3-8B's
    ``[8, 1, 2048, 2048]`` takes 0.01 s so, 0.1-0.2 s whole; over ``EVAL_BYTES`` the only way.)"""
    from autopar.analysis.tp_graph import op_name, pointwise

    out = _val(nodes[-1])
    if not isinstance(out, torch.Tensor) or out.ndim < 3 or out.shape[0] < 2:
        return None
    count = int(out.shape[0])
    row = _bytes([nodes[-1]]) // count
    big = {n for n in nodes if isinstance(_val(n), torch.Tensor) and _bytes([n]) >= max(row, 1)}
    if nodes[-1] not in big:
        return None
    for n in big:
        v = _val(n)
        if v.ndim != out.ndim or v.shape[0] != count or not (op_name(n) in ROW_OPS or pointwise(op_name(n))):
            return None
    small = [n for n in nodes if n not in big]
    if any(a in big for n in small for a in n.all_input_nodes) or _bytes(small) > EVAL_BYTES:
        return None
    env: dict = {}
    if small:
        _evaluate(gm, small, env)
    for n in big:  # the rows the large values read: each the same
        for a in n.all_input_nodes:
            v = env.get(a)
            if isinstance(v, torch.Tensor) and v.ndim == out.ndim and v.shape[0] == count and \
                    not bool((v == v[:1]).all()):
                return None
    return _evaluate(gm, [n for n in nodes if n in big], env, rows=(count, 1)), count


def _bytes(nodes) -> int:
    total = 0
    for n in nodes:
        v = _val(n)
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def is_causal_mask(mask: torch.Tensor, lq: int, lk: int) -> bool:
    """Whether ``mask`` (bool, or additive float) is SDPA's ``is_causal=True`` for an ``lq x lk``
    attention, in every batch row and head it broadcasts over."""
    if mask.ndim < 2 or mask.shape[-2:] != (lq, lk):
        return False
    allowed = torch.ones(lq, lk, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == allowed).all())
    if not mask.is_floating_point():
        return False
    low = torch.finfo(mask.dtype).min
    blocked = (mask == float("-inf")) | (mask == low)
    return bool(((mask == 0) == allowed).all() and (blocked == ~allowed).all())


def _arg(n: fx.Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _rewrite(n: fx.Node) -> None:
    q, k, v = (_arg(n, i, name) for i, name in enumerate(("query", "key", "value")))
    kwargs = {name: _arg(n, i, name) for i, name in ((4, "dropout_p"), (6, "scale"), (7, "enable_gqa"))
              if _arg(n, i, name) is not None}
    kwargs.update(attn_mask=None, is_causal=True)
    n.args, n.kwargs = (q, k, v), kwargs


def _drop_dead(graph: fx.Graph, candidates: set[fx.Node], masks: set[fx.Node]) -> int:
    """Remove the ``candidates`` nothing reads any more (the rewritten masks' subgraphs). An
    in-place op goes only where it is part of a dropped mask (``masks``: their nodes) and
    nothing outside them reads what it writes."""
    dropped = 0
    for n in reversed(list(graph.nodes)):
        if _mutates(n) and not (n in masks and all(u in masks for u in n.args[0].users)):
            continue
        if n in candidates and not n.users and not _effectful(n):
            graph.erase_node(n)
            dropped += 1
    return dropped


def _verdict(gm: fx.GraphModule, mask: fx.Node, const: set, lq: int, lk: int,
             written: list[tuple[fx.Node, set[fx.Node]]]) -> tuple[bool, str]:
    """(rewrite?, why) for one mask node read by an lq x lk attention."""
    if mask not in const:
        return False, "depends on an input, parameter or buffer"
    nodes = _ancestors(mask)
    mine = set(nodes)
    if any(w not in mine and sources & mine for w, sources in written):
        return False, "is computed from a tensor that an in-place op writes (the value seen would not be the mask)"
    key = (_signature(gm, nodes), lq, lk)
    hit = _VERDICTS.get(key)
    if hit is None:
        hit = _VERDICTS[key] = _evaluated(gm, nodes, lq, lk)
        while len(_VERDICTS) > 64:
            _VERDICTS.pop(next(iter(_VERDICTS)))
    return hit


# verdicts by the mask subgraph's structure: a planner's or a test's repeated compiles (the same
# model at depths 1, 2, 3) evaluate a mask once per process
_VERDICTS: dict[tuple, tuple[bool, str]] = {}


def _signature(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple:
    """The subgraph as data: each node's op, target, constant arguments (nodes by position),
    and value's shape and dtype; a constant tensor by its contents."""
    pos = {n: i for i, n in enumerate(nodes)}

    def arg(a):
        if isinstance(a, fx.Node):
            return ("node", pos[a])
        if isinstance(a, torch.Tensor):
            small = not a.is_meta and a.numel() <= 1 << 20
            data = a.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if small else id(a)
            return ("tensor", a.dtype, tuple(a.shape), data)
        return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device)) else repr(a)

    out = []
    for n in nodes:
        v = _val(n)
        const = _attr(gm, n.target) if n.op == "get_attr" else None
        out.append((n.op, str(n.target), fx.node.map_aggregate(n.args, arg), fx.node.map_aggregate(n.kwargs, arg),
                    (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None, arg(const)))
    return tuple(repr(x) for x in out)


def _watched(fn):
    """``(fn(), whether it ran an ATen op that draws random numbers)``: ops tagged
    ``nondeterministic_seeded``, seen by a dispatch mode; True where this torch has no dispatch
    modes to watch with (the mask is then evaluated twice, with two seeds, as before)."""
    try:
        class Watch(tc.TorchDispatchMode):
            drew = False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                    self.drew = True
                return func(*args, **(kwargs or {}))

        watch = Watch()
    except Exception:  # noqa: BLE001 - TorchVersionError: no watching
        return fn(), True
    with watch:
        out = fn()
    return out, watch.drew


def _evaluated(gm: fx.GraphModule, nodes: list[fx.Node], lq: int, lk: int) -> tuple[bool, str]:
    size = _bytes(nodes)
    rows = None
    try:
        values = []
        seeded = True  # (a second evaluation, with another seed, only where the first drew random numbers)
        while len(values) < (2 if seeded else 1):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(len(values))
                one, drew = _watched(lambda: _one_row(gm, nodes))
                if one is None and size <= EVAL_BYTES:  # (rows not provably alike: every row evaluated)
                    got, drew = _watched(lambda: _evaluate(gm, nodes))
                    values.append(got)
                    seeded = seeded and drew
                    continue
                if one is None:
                    return False, (f"is computed from no input but was not checked for causality ({size / 2**20:.0f} "
                                   f"MiB to evaluate, more than {EVAL_BYTES >> 20}, and its batch rows not provably "
                                   "alike)")
                values.append(one[0])
                seeded = seeded and drew
                rows = one[1]
    except Exception as e:  # noqa: BLE001 - an op the CPU cannot run: the mask stays
        return False, f"could not be evaluated on the CPU ({type(e).__name__}: {e})"
    a, b = values if len(values) == 2 else values * 2
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and torch.equal(a, b)):
        return False, "differs between two evaluations (random)"
    if not is_causal_mask(a, lq, lk):
        return False, "is not the causal mask"
    shape = list(a.shape) if rows is None else [rows, *a.shape[1:]]
    whole = f"{size / 2**20:.0f} MiB" if size >= 1 << 20 else f"{size / 2**10:.0f} KiB"
    how = "" if rows is None else (f"; {whole} whole, so one batch row evaluated: the rows are the same ops on "
                                   "identical values")
    return True, f"is computed from no input and is the causal mask ({shape} {str(a.dtype)[6:]}{how})"


def _at(n: fx.Node) -> str:
    return (source_line(n) or n.name).split("  ")[0]


def causal_masks(gm: fx.GraphModule, model: torch.nn.Module) -> list[str]:
    """Rewrite, in ``gm`` (``model``'s torch-level graph), every SDPA whose mask is a constant
    equal to the causal mask (module docstring); returns what was done, one line per mask and
    verdict (with how many attentions)."""
    graph = gm.graph
    const = _constant_nodes(gm, {id(t) for t in [*model.parameters(), *model.buffers()]})
    written = _written(graph)
    verdicts: dict[tuple, tuple[bool, str]] = {}
    counts: dict[tuple, list] = {}
    removable: set[fx.Node] = set()
    for n in list(graph.nodes):
        if not (n.op == "call_function" and n.target in _SDPA):
            continue
        mask = _arg(n, 3, "attn_mask")
        qv, kv = _val(_arg(n, 0, "query")), _val(_arg(n, 1, "key"))
        if not isinstance(mask, fx.Node) or _arg(n, 5, "is_causal", False) is not False or qv is None or kv is None:
            continue
        key = (mask, qv.shape[-2], kv.shape[-2])
        if key not in verdicts:
            verdicts[key] = _verdict(gm, mask, const, *key[1:], written)
        ok, why = verdicts[key]
        if ok:
            _rewrite(n)
            removable.update(_ancestors(mask))
        counts.setdefault(key, [0, _at(n)])[0] += 1
    lines = []
    for key, (ok, why) in verdicts.items():
        k, where = counts[key]
        lines.append(f"{k} attention(s) at {where}: the mask from {_at(key[0])} {why}: "
                     + ("is_causal=True, the mask dropped" if ok else "kept"))
    if removable:
        _drop_dead(graph, removable | const, removable)  # (with the constants nothing read before either)
        graph.lint()
        gm.recompile()
    return lines


# ------------------------------------------------------------------------ grouped-query attention
def _is(n, op: str, targets) -> bool:
    return isinstance(n, fx.Node) and n.op == op and n.target in targets


def _method(n, *names) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


def ungroup(k: fx.Node) -> fx.Node:
    """GQA written out -> the KV heads themselves (query head h reads KV head h // G): k =
    repeat_interleave(k0, G, dim=1), or Hugging Face's repeat_kv, k = k0[:, :, None].expand(b, hkv,
    G, s, d).reshape(b, hkv * G, s, d); else ``k``."""
    if _method(k, "reshape", "view") and _method(k.args[0], "expand"):
        g = k.args[0].args[0]
        idx = g.args[1] if _is(g, "call_function", {operator.getitem}) else None
        if isinstance(idx, tuple) and len(idx) == 5 and idx[2] is None and all(
                isinstance(i, slice) and i == slice(None) for i in idx[:2] + idx[3:]):
            k0, kv = g.args[0], _val(k)
            v0 = _val(k0)
            if (isinstance(v0, torch.Tensor) and v0.ndim == 4 and kv.ndim == 4 and kv.shape[0] == v0.shape[0]
                    and kv.shape[2:] == v0.shape[2:] and kv.shape[1] % v0.shape[1] == 0):
                return k0
    if _method(k, "repeat_interleave") and (_arg(k, 2, "dim") == 1) and isinstance(_arg(k, 1, "repeats"), int):
        return k.args[0]
    if _is(k, "call_function", {torch.repeat_interleave}) and _arg(k, 2, "dim") == 1 \
            and isinstance(_arg(k, 1, "repeats"), int):
        return k.args[0]
    return k


def _head_ranks(plan: dict, mesh) -> int | None:
    """Over how many ranks the plan splits attention's heads (the product of its axes under a
    derived tensor-parallel strategy or Ulysses, autopar/plan.py's sets); None under user rules
    (their attention layout is theirs)."""
    from autopar.plan import DERIVED_TP

    if not isinstance(plan, dict) or plan.get("rules"):
        return None
    head_splitting = DERIVED_TP | {"ulysses"}  # (the ring, "context", keeps every head on each rank)
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape)) if mesh is not None else {}
    n = 1
    for axis, strategy in plan.items():
        if isinstance(strategy, str) and strategy in head_splitting:
            n *= sizes.get(axis, 1)
    return n


def grouped_attention(gm: fx.GraphModule, heads_split: int | None) -> list[str]:
    """Rewrite, in ``gm``, every mask-free SDPA over repeated KV heads into ``enable_gqa=True``
    over the heads themselves, where ``heads_split`` (``_head_ranks``) divides their number
    (module docstring); returns one line per attention site kept or rewritten."""
    done: dict[str, list] = {}
    dead: set[fx.Node] = set()
    for n in list(gm.graph.nodes):
        if not (n.op == "call_function" and n.target in _SDPA) or _arg(n, 3, "attn_mask") is not None \
                or _arg(n, 7, "enable_gqa", False) or _arg(n, 4, "dropout_p", 0.0) != 0.0:
            continue  # (with dropout: SDPA's math path, which repeats the heads itself)
        q, k, v = (_arg(n, i, name) for i, name in enumerate(("query", "key", "value")))
        k0, v0 = ungroup(k), ungroup(v)
        qv, kv, k0v, v0v = (_val(x) for x in (q, k, k0, v0))
        if k0 is k or v0 is v or not all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in (qv, kv, k0v, v0v)):
            continue
        h, hkv = qv.shape[1], k0v.shape[1]
        if kv.shape[1] != h or v0v.shape[1] != hkv or h % hkv:
            continue
        why = ("user rules" if heads_split is None else "one KV head" if hkv == 1 else
               f"the plan splits the heads over {heads_split} ranks, more than divide its {hkv} KV heads"
               if hkv % heads_split else "")
        if not why:
            kwargs = {name: _arg(n, i, name) for i, name in ((4, "dropout_p"), (5, "is_causal"), (6, "scale"))
                      if _arg(n, i, name) is not None}
            n.args, n.kwargs = (q, k0, v0), {**kwargs, "enable_gqa": True}
            for r, r0 in ((k, k0), (v, v0)):  # the repeat's nodes, from its output up to the KV heads
                while isinstance(r, fx.Node) and r is not r0:
                    dead.add(r)
                    r = r.args[0]
        line = (f"grouped-query attention: {hkv} KV heads read as they are (enable_gqa=True), not repeated to {h}"
                if not why else f"grouped-query attention: its KV heads repeated to the query heads kept ({why})")
        done.setdefault(line, []).append(n)
    if dead:
        _drop_dead(gm.graph, dead, set())
        gm.graph.lint()
        gm.recompile()
    return [f"{len(ns)} attention(s) at {_at(ns[0])}{' and after' if len(ns) > 1 else ''}: {line}"
            for line, ns in done.items()]


def masks_pass(state: CompileState) -> CompileState:
    """After it: an SDPA whose mask no input decides and which is the causal mask is
    ``is_causal=True`` without the mask; a mask-free SDPA over repeated KV heads reads the KV
    heads with ``enable_gqa=True`` where the plan allows (state.masks says, per attention, what
    was done)."""
    state.masks = causal_masks(state.gm, state.model)
    state.masks += grouped_attention(state.gm, _head_ranks(state.options.plan, state.mesh))
    return state

