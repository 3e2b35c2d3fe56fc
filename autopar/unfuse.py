"""A fused projection whose output is cut into unequal parts becomes one parameter per part.

Grouped-query attention fused into one projection (Phi-3's ``qkv_proj``: ``[q | k | v]`` with
fewer key / value heads), multi-query attention fused (GPTBigCode's ``c_attn``: q by heads, one
key / value head) and the Mamba-2 hybrids' ``in_proj`` (``[z | x | B | C | dt]``) multiply the
residual stream by one weight and then cut the output into parts of different sizes. Tensor
parallelism wants each part split by its own heads (or, for a part with fewer heads than ranks,
held whole): rank r holds heads 2r, 2r+1 of q and head r of k and v. No DTensor placement
describes those rows of one tensor (``_StridedShard`` needs equal parts; a placement of our own
was tried and rejected: torch's op rules rebuild it and drop the parts, docs/tensor-parallel.md).

So, before the tensor-parallel derivation (passes/split.py), under a derived tensor-parallel
strategy on an axis of more than one rank:

1. **Found from the graph**, not from names: a matmul by a parameter stored [out, in] and read
   nowhere else (``linear(x, W, b)``, or ``x @ W.T``: Falcon's), whose output (through
   shape-keeping ops: ``unsqueeze``, casts; or viewed as [.., heads, head_dim] first) is read only
   by slices of that dim (``x[..., a:b]``, ``x[..., [i], :]``, ``split`` with sizes) that cut it
   into contiguous parts, not all of one size (equal parts are a strided shard already).
2. **The module**: the weight (and its bias) gets torch's own parametrization
   (``torch.nn.utils.parametrize``, ``unsafe=True``), ``Parts``: the fused tensor is the
   concatenation of one parameter per part, ``<module>.parametrizations.weight.original<i>``.
   The module's own forward still reads ``self.weight`` (now the concatenation), so an eval
   capture or the user's own call works unchanged.
3. **The graph**: the one linear becomes one linear per part, each reading its part's parameter,
   and every slice reads its part's output; the derivation then sees ordinary column-parallel
   starts, and places each part as its flow allows.
4. **Undone** where no part ends up column-parallel (nothing gained, three matmuls for one; a
   row-parallel weight whole has one partial sum to reduce, cut it would have one per part): the
   module gets its own parameter back and the graph its one linear.

What the user sees (the views: autopar/parts.py): ``pm.parameters()`` lists the parts (the optimizer steps them: its state is
per part); the global views give the fused tensor under its own name: ``pm.state_dict()``,
checkpoints (written as the whole fused tensor, so any plan and any mesh reads them),
``pm.load_pretrained`` (each part's slice of the file's tensor), and ``pm.report()`` says which
weights were cut and where.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from autopar.analysis.tp_graph import op_name, val_of
from autopar.ir import source_line
from autopar.parts import Parts

SAME = {"to", "type", "float", "half", "bfloat16", "contiguous", "_to_copy"}  # casts on the way to the linear
KEEP_LAST = SAME | {"unsqueeze"}  # between the linear and its slices: the sliced dim stays the last one


@dataclass
class Cut:
    """One fused weight found in the graph, cut into parts."""

    weight: str  # the user's name of the fused weight (``...qkv_proj.weight``)
    bias: str | None
    sizes: list[int]
    where: str  # the user's source line of the slices
    linear: fx.Node = field(repr=False, default=None)
    source: fx.Node = field(repr=False, default=None)  # what the slices read: the linear or a shape-keeping op after it
    readers: list[list[fx.Node]] = field(repr=False, default_factory=list)  # per part: the nodes that read it
    unit: int = 1  # rows per index of the sliced dim (head_dim where the output is viewed as heads first)

    def part_names(self, of: str) -> list[str]:
        mod, _, attr = of.rpartition(".")
        return [f"{mod}.parametrizations.{attr}.original{i}" for i in range(len(self.sizes))]



def describe(cuts: list[Cut]) -> list[str]:
    """One line per kind of cut (the same sizes, sliced at the same source line: a block's
    projection in every block), naming the first weight and how many there are."""
    kinds: dict[tuple, list[Cut]] = {}
    for c in cuts:
        kinds.setdefault((tuple(c.sizes), c.where), []).append(c)
    out = []
    for (sizes, where), cs in kinds.items():
        more = f" and {len(cs) - 1} more like it" if len(cs) > 1 else ""
        bias = " (and its bias)" if cs[0].bias else ""
        out.append(f"{cs[0].weight}{bias}{more}: one parameter per part, {len(sizes)} parts of {list(sizes)} rows "
                   f"(its output is sliced so{where}; each part placed on its own)")
    return out


# ------------------------------------------------------------------------------- the graph
TRANSPOSE = {"t", "transpose", "swapaxes", "swapdims"}


def _through_casts(a, params: dict) -> tuple[fx.Node | None, int]:
    """The parameter ``get_attr`` that ``a`` reads through casts and transposes (each read by one
    node), and how many transposes (``W.T``, ``W.t()``) it went through."""
    flips = 0
    while isinstance(a, fx.Node) and a not in params:
        name = op_name(a)
        flip = name in TRANSPOSE or (name == "getattr" and len(a.args) > 1 and a.args[1] in ("T", "mT"))
        if not (name in SAME or flip) or len(a.users) != 1:
            return None, 0
        flips += flip
        a = a.args[0]
    return (a, flips) if isinstance(a, fx.Node) else (None, 0)


def _weight_of(mm: fx.Node, params: dict):
    """(weight, bias) arguments of a matmul by a parameter stored [out, in]: ``linear(x, W, b)``,
    or ``x @ W.T`` (``matmul``); None otherwise."""
    name = op_name(mm)
    if name != "linear" and not (name == "matmul" and len(mm.args) == 2):
        return None
    w, b = _weight_args(mm)
    want = 0 if name == "linear" else 1
    wnode, flips = _through_casts(w, params)
    if wnode is None or flips != want:
        return None
    return w, b


def _range(reader: fx.Node, src: fx.Node, n: int, nd: int, back: int):
    """(start, stop) that ``reader`` takes of ``src`` along its dim ``nd - back`` (of size n)
    and nothing else, or None: ``x[..., a:b]``; with ``back`` 2, ``x[..., a:b, :]`` or
    ``x[..., [i], :]`` (Falcon's one key head, kept as a dim)."""
    if reader.op != "call_function" or reader.target is not operator.getitem or reader.args[0] is not src:
        return None
    idx = reader.args[1]
    if not isinstance(idx, tuple) or len(idx) < back:
        return None
    head, at, tail = idx[:len(idx) - back], idx[len(idx) - back], idx[len(idx) - back + 1:]
    if any(t != slice(None) for t in tail):
        return None
    if not (head == (Ellipsis,) or (len(idx) == nd and all(t == slice(None) for t in head))):
        return None
    if isinstance(at, list) and len(at) == 1 and type(at[0]) is int:
        i = at[0] % n
        return i, i + 1
    if not isinstance(at, slice) or not all(v is None or type(v) is int for v in (at.start, at.stop, at.step)):
        return None  # a bound the program computes: not a fixed cut
    start, stop, step = at.indices(n)
    return (start, stop) if step == 1 and stop > start else None


def _split_parts(sp: fx.Node, src: fx.Node, nd: int, back: int):
    """``src.split([sizes], dim=nd - back)`` read only by ``getitem``: [(start, stop, getitem)]."""
    if op_name(sp) not in ("split", "split_with_sizes") or sp.args[0] is not src:
        return None
    sizes = sp.args[1] if len(sp.args) > 1 else sp.kwargs.get("split_size_or_sections", sp.kwargs.get("split_sizes"))
    dim = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) for s in sizes) or dim % nd != nd - back:
        return None
    out, at = [], 0
    starts = []
    for s in sizes:
        starts.append((at, at + s))
        at += s
    for u in sp.users:
        if u.op != "call_function" or u.target is not operator.getitem or not isinstance(u.args[1], int):
            return None
        a, b = starts[u.args[1]]
        out.append((a, b, u))
    return out


def _readers(src: fx.Node, n: int, back: int) -> dict | None:
    """{(start, stop): the nodes reading that range of ``src``'s dim ``-back``}, when slices and
    splits are all that read it; else None."""
    v = val_of(src)
    if not isinstance(v, torch.Tensor) or v.ndim < back:
        return None
    ranges: dict[tuple[int, int], list[fx.Node]] = {}
    for u in src.users:
        r = _range(u, src, n, v.ndim, back)
        if r is not None:
            ranges.setdefault(r, []).append(u)
            continue
        sp = _split_parts(u, src, v.ndim, back)
        if sp is None:
            return None
        for a, b_, g in sp:
            ranges.setdefault((a, b_), []).append(g)
    return ranges


def _heads_view(u: fx.Node, n_out: int) -> int:
    """``u`` views its input's last dim (n_out) as [heads, head_dim], nothing else: head_dim; else 0."""
    if op_name(u) not in ("view", "reshape"):
        return 0
    vi, vo = val_of(u.args[0]), val_of(u)
    if not isinstance(vi, torch.Tensor) or not isinstance(vo, torch.Tensor) or vo.ndim != vi.ndim + 1:
        return 0
    if tuple(vo.shape[:-2]) != tuple(vi.shape[:-1]) or vo.shape[-2] * vo.shape[-1] != n_out:
        return 0
    return int(vo.shape[-1])


def find_cuts(gm: fx.GraphModule, model: nn.Module) -> list[Cut]:
    """Every fused weight of the graph whose output is cut into unequal parts (see the module
    docstring): what the graph shows, never a name."""
    from autopar.modpath import get_attr, tensor_names

    ids = tensor_names(model)
    params = {}
    uses: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            kind, name = ids.get(id(get_attr(gm, n.target)), (None, None))
            if kind == "param":
                params[n] = name
                uses[name] = uses.get(name, 0) + 1
    cuts = []
    for lin in gm.graph.nodes:
        wb = _weight_of(lin, params) if lin.op == "call_function" else None
        if wb is None:
            continue
        w, b = wb
        wnode, _ = _through_casts(w, params)
        if uses[params[wnode]] != 1:
            continue
        bnode = None
        if b is not None:
            bnode, flips = _through_casts(b, params)
            if bnode is None or flips or uses[params[bnode]] != 1:
                continue
        wv = val_of(wnode)
        if not isinstance(wv, torch.Tensor) or wv.ndim != 2:
            continue
        n_out = int(wv.shape[0])
        src = lin  # through shape-keeping ops read by one user each
        while len(src.users) == 1:
            (u,) = src.users
            v = val_of(u)
            if op_name(u) not in KEEP_LAST or not isinstance(v, torch.Tensor) or int(v.shape[-1]) != n_out:
                break
            src = u
        unit, ranges = 1, _readers(src, n_out, 1)
        if ranges is None and len(src.users) == 1:  # viewed as [.., heads, head_dim], then cut by heads
            (u,) = src.users
            unit = _heads_view(u, n_out)
            if unit:
                src = u
                ranges = _readers(u, n_out // unit, 2)
        if not ranges or len(ranges) < 2:
            continue
        cuts_at = sorted(ranges)
        if cuts_at[0][0] != 0 or cuts_at[-1][1] * unit != n_out or any(x[1] != y[0] for x, y in zip(cuts_at, cuts_at[1:])):
            continue  # overlapping or leaving rows unread: not a partition
        sizes = [(b_ - a) * unit for a, b_ in cuts_at]
        if len(set(sizes)) == 1:
            continue  # equal parts: a strided shard holds them (the derivation's own case)
        first = ranges[cuts_at[0]][0]
        line = source_line(first)
        cuts.append(Cut(params[wnode], params[bnode] if bnode is not None else None, sizes,
                        f" at {line}" if line else "", lin, src, [ranges[r] for r in cuts_at], unit))
    return cuts


def _copy(graph: fx.Graph, n: fx.Node, env: dict, args: tuple | None = None) -> fx.Node:
    """``n`` copied with its inputs mapped by ``env`` (or with ``args``), its example value computed
    on the copies'."""
    new = graph.node_copy(n, lambda a: env.get(a, a))
    if args is not None:
        new.args = args
    args = fx.node.map_arg(new.args, val_of)
    kwargs = fx.node.map_arg(new.kwargs, val_of)
    if n.op == "call_function":
        val = n.target(*args, **kwargs)
    elif n.op == "call_method":
        val = getattr(args[0], n.target)(*args[1:], **kwargs)
    else:
        val = None
    key = "example_value" if "example_value" in n.meta else "val"
    new.meta[key] = val
    return new


def cut(gm: fx.GraphModule, model: nn.Module, cuts: list[Cut]) -> None:
    """Apply ``cuts``: parametrize each fused weight (and bias) on the user's module, and rewrite
    the graph so that each part is its own linear reading its own parameter."""
    graph = gm.graph
    for c in cuts:
        lin = c.linear
        parts = {}
        for which, name in (("weight", c.weight), ("bias", c.bias)):
            if name is None:
                continue
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            parametrize.register_parametrization(mod, attr, Parts(c.sizes, 0), unsafe=True)
            originals = getattr(mod.parametrizations, attr)
            parts[which] = [getattr(originals, f"original{i}") for i in range(len(c.sizes))]
        w, b = _weight_args(lin)
        wdone = _part_chain(gm, lin, w, parts["weight"], c)
        bdone = _part_chain(gm, lin, b, parts["bias"], c) if "bias" in parts else [None] * len(c.sizes)
        keep = []  # the shape-keeping ops between the linear and the slices
        src = lin
        while src is not c.source:
            (src,) = src.users
            keep.append(src)
        for i, readers in enumerate(c.readers):
            with graph.inserting_before(lin):
                env = {w: wdone[i]}
                if b is not None:
                    env[b] = bdone[i]
                out = _copy(graph, lin, env)
                for k in keep:
                    shape = None
                    if k is c.source and c.unit > 1:  # the view as heads: this part's heads
                        shape = list(val_of(k).shape)
                        shape[-2] = c.sizes[i] // c.unit
                        shape = (out, *shape) if k.op == "call_method" else (out, tuple(shape))
                    out = _copy(graph, k, {**env, lin: out, **{kk: out for kk in keep}}, shape)
            for r in readers:
                r.replace_all_uses_with(out)
        dead = {lin, *keep, *_chain(w), *_chain(b)}
        for readers in c.readers:
            for r in readers:
                dead.add(r)
                if r.args[0] not in (lin, *keep):  # a split's getitem: the split too
                    dead.add(r.args[0])
        for n in reversed(list(graph.nodes)):
            if n in dead and not n.users:
                if n.op == "get_attr":
                    _drop_attr(gm, n.target)
                graph.erase_node(n)
    graph.lint()
    gm.recompile()


def _weight_args(mm: fx.Node) -> tuple:
    """(weight, bias) arguments of ``linear(x, W, b)`` or ``matmul(x, W.T)`` (bias None)."""
    if op_name(mm) == "linear":
        args = list(mm.args) + [None] * 3
        return (args[1] if args[1] is not None else mm.kwargs.get("weight"),
                args[2] if args[2] is not None else mm.kwargs.get("bias"))
    return mm.args[1], None


def _part_chain(gm, lin: fx.Node, arg: fx.Node, part_params: list, c: Cut) -> list[fx.Node]:
    """For each part: a ``get_attr`` of its parameter and the casts / transposes ``arg`` went through."""
    node, chain = arg, []
    while node.op != "get_attr":
        chain.append(node)
        node = node.args[0]
    chain.reverse()
    outs = []
    for i, p in enumerate(part_params):
        target = f"{node.target}__part{i}"
        setattr(gm, target, p)
        with gm.graph.inserting_before(lin):
            g = gm.graph.get_attr(target)
            key = "example_value" if "example_value" in node.meta else "val"
            ev = val_of(node)
            a = sum(c.sizes[:i])
            g.meta.update({k: v for k, v in node.meta.items() if k != key})
            g.meta[key] = ev[a:a + c.sizes[i]] if isinstance(ev, torch.Tensor) else None
            env = {node: g}
            for ch in chain:
                env[ch] = _copy(gm.graph, ch, env)
            outs.append(env[chain[-1]] if chain else g)
    return outs


def _chain(a) -> list[fx.Node]:
    """``a`` and the nodes it reads through casts down to its ``get_attr``."""
    out = []
    while isinstance(a, fx.Node):
        out.append(a)
        a = a.args[0] if a.op != "get_attr" else None
    return out


def _drop_attr(gm: fx.GraphModule, target: str) -> None:
    """The fused parameter off the graph module (AOTAutograd lifts every parameter it holds)."""
    mod_name, _, attr = target.rpartition(".")
    owner = gm.get_submodule(mod_name) if mod_name else gm
    if hasattr(owner, attr):
        delattr(owner, attr)


def derive_with_cuts(gm: fx.GraphModule, model: nn.Module, derive, keep_whole) -> tuple[object, list[Cut], list[str]]:
    """``derive()`` (the tensor-parallel derivation on ``gm``) after cutting every fused weight the
    graph shows (``find_cuts``) but those ``keep_whole(name)`` holds (a user's rule names them);
    the cuts that left no part column-parallel undone and the derivation run again. Returns the
    derivation, the cuts kept, and a line for the report where cutting was tried and given up."""
    cuts = [c for c in find_cuts(gm, model) if not keep_whole(c.weight) and not (c.bias and keep_whole(c.bias))]
    if not cuts:
        return derive(), [], []
    from autopar.errors import PlanError

    saved = _save(gm, model, cuts)
    cut(gm, model, cuts)
    try:
        d = derive()
    except PlanError as e:  # (a part the axis size does not divide): the weights as the user wrote them, and their error
        _restore(gm, model, cuts, saved)
        why = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        return derive(), [], [f"{cuts[0].weight}{f' and {len(cuts) - 1} more' if len(cuts) > 1 else ''} not cut into "
                              f"one parameter per part: a part would not divide by the axis ({why}); kept as written"]
    # a cut pays where a part's output is sharded (column-parallel); a weight that contracts a
    # sharded dim (row-parallel, Mamba's x_proj into [dt | B | C]) is better whole: one partial sum,
    # reduced once where it is sliced, rather than one per part
    useless = {c.weight for c in cuts if not any(d.decisions[p].role == "column" for p in c.part_names(c.weight))}
    if not useless:
        return d, cuts, []
    _restore(gm, model, cuts, saved)
    cuts = [c for c in find_cuts(gm, model) if c.weight in {x.weight for x in cuts} - useless]
    if cuts:
        cut(gm, model, cuts)
    return derive(), cuts, []


def _save(gm: fx.GraphModule, model: nn.Module, cuts: list[Cut]) -> dict:
    """What ``cut`` changes: a copy of the graph, the graph module's parameter attributes, the
    module's fused parameters."""
    from autopar.modpath import get_attr

    graph = fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    graph._codegen = gm.graph._codegen
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    old_out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    new_out = graph.output(out)
    new_out.meta = dict(old_out.meta)
    attrs = {n.target: get_attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    params = {name: model.get_parameter(name) for c in cuts for name in (c.weight, c.bias) if name is not None}
    return {"graph": graph, "attrs": attrs, "params": params}


def _restore(gm: fx.GraphModule, model: nn.Module, cuts: list[Cut], saved: dict) -> None:
    """``cut`` undone: the module's fused parameters, the graph module's attributes, its graph."""
    for c in cuts:
        for name in (c.weight, c.bias):
            if name is None:
                continue
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            parametrize.remove_parametrizations(mod, attr, leave_parametrized=True)
            mod.register_parameter(attr, saved["params"][name])
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target not in saved["attrs"]:
            _drop_attr(gm, n.target)
    for target, value in saved["attrs"].items():
        mod_name, _, attr = target.rpartition(".")
        owner = gm.get_submodule(mod_name) if mod_name else gm
        if getattr(owner, attr, None) is not value:
            setattr(owner, attr, value)
    gm.graph = saved["graph"]
    gm.recompile()


# ------------------------------------------------------------------ the exported (eval) programs
def cut_exported(graph: fx.Graph, params: dict, model: nn.Module) -> int:
    """The same rewrite in a program torch.export captured from the module (the eval forward,
    generation's prefill and decode), where a cut weight is the ``cat`` of its parts: ``cat(parts)``
    transposed into an ``mm`` / ``addmm`` (through a view of its leading dims) whose output only
    slices at the parts' bounds read becomes one matmul per part, so each part keeps its own
    placement (else DTensor's ``cat`` of parts sharded with different sizes gathers them whole).
    ``params``: placeholder -> parameter name. Returns how many were rewritten."""
    from autopar.parts import part_of

    aten = torch.ops.aten
    where = part_of(model)
    done = 0
    for cat in [n for n in graph.nodes if n.op == "call_function" and n.target == aten.cat.default]:
        phs = cat.args[0]
        dim = cat.args[1] if len(cat.args) > 1 else 0
        names = [params.get(p) for p in phs]
        if dim != 0 or len(phs) < 2 or any(n not in where for n in names) or \
                len({where[n][0] for n in names}) != 1 or [where[n][1] for n in names] != sorted(where[n][1] for n in names):
            continue
        if len(cat.users) != 1:
            continue
        (tr,) = cat.users
        if not (tr.target == aten.t.default or (tr.target == aten.permute.default and list(tr.args[1]) == [1, 0])) \
                or len(tr.users) != 1:
            continue
        (mm,) = tr.users
        bias = None
        if mm.target == aten.mm.default and mm.args[1] is tr:
            x = mm.args[0]
        elif mm.target == aten.addmm.default and mm.args[2] is tr and isinstance(mm.args[0], fx.Node) \
                and mm.args[0].target == aten.cat.default:
            x, bias = mm.args[1], mm.args[0]
            bnames = [params.get(p) for p in bias.args[0]]
            if len(bias.users) != 1 or len(bnames) != len(names) or any(b not in where for b in bnames) or \
                    len({where[b][0] for b in bnames}) != 1 or [where[b][1] for b in bnames] != [where[n][1] for n in names]:
                continue  # the bias's parts, in the weight's order
        else:
            continue
        out = mm
        if len(mm.users) == 1 and next(iter(mm.users)).target == aten.view.default:
            out = next(iter(mm.users))
        sizes = [int(val_of(p).shape[0]) for p in phs]
        n_out = sum(sizes)
        bounds = {}
        at = 0
        for i, s in enumerate(sizes):
            bounds[(at, at + s)] = i
            at += s
        nd = val_of(out).ndim
        readers: list[list[fx.Node]] = [[] for _ in phs]
        ok = len(out.users) > 0
        for u in out.users:
            args = list(u.args) + [0, None, None, 1][len(u.args) - 1:]
            if u.target != aten.slice.Tensor or args[1] % nd != nd - 1 or args[4] != 1:
                ok = False
                break
            lo = 0 if args[2] is None else (args[2] + n_out if args[2] < 0 else args[2])
            hi = n_out if args[3] is None or args[3] >= n_out else (args[3] + n_out if args[3] < 0 else args[3])
            if (lo, hi) not in bounds:
                ok = False
                break
            readers[bounds[(lo, hi)]].append(u)
        if not ok:
            continue
        for i, ph in enumerate(phs):
            with graph.inserting_before(mm):
                t = _run(graph, aten.permute.default, (ph, [1, 0]))
                part = (_run(graph, aten.mm.default, (x, t)) if bias is None else
                        _run(graph, aten.addmm.default, (bias.args[0][i], x, t)))
                if out is not mm:
                    part = _run(graph, aten.view.default, (part, list(val_of(out).shape[:-1]) + [sizes[i]]))
            for r in readers[i]:
                r.replace_all_uses_with(part)
        for n in dict.fromkeys([*out.users, out, mm, tr, cat] + ([bias] if bias is not None else [])):
            if not n.users:
                graph.erase_node(n)
        done += 1
    if done:
        graph.lint()
    return done


def _run(graph: fx.Graph, target, args: tuple) -> fx.Node:
    """A new ``call_function`` node, its ``val`` computed on its inputs' fake values."""
    n = graph.call_function(target, args)
    n.meta["val"] = target(*fx.node.map_arg(args, val_of))
    return n
