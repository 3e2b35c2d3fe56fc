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

1. **Found from the graph** (autopar/unfuse_find.py), not from names: a matmul by a parameter
   stored [out, in] and read nowhere else (``linear(x, W, b)``, or ``x @ W.T``: Falcon's), whose
   output (through ops that act on each channel apart: casts, ``unsqueeze``, transposes, an
   activation, a depthwise convolution whose filters are parameters read nowhere else, as Qwen3.5's
   gated delta net convolves ``[q | k | v]`` before it splits them; or viewed as [.., heads,
   head_dim] first) is read only by slices of that dim (``x[..., a:b]``, ``x[..., [i], :]``,
   ``split`` with sizes) that cut it into contiguous parts, not all of one size (equal parts are a
   strided shard already). Such a convolution's weight and bias are cut into the same parts.
   An elementwise op of the chain may also read buffers with one value per channel (Falcon-H1's
   muP vector): each part's copy reads its own channels of them. Also, with no fused projection: parts of unequal sizes joined by ``cat`` before such a
   convolution and split back into the same parts after it (OLMo-hybrid, Qwen3-Next): the
   convolution's weight and bias alone are cut, each part convolved on its own (``Cut.joined``).
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

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from autopar.analysis.tp_graph import op_name, val_of
from autopar.parts import Parts
from autopar.unfuse_find import SHAPE, Cut, _conv_args, _per_channel_buffer, _weight_args, find_cuts


def _copy(graph: fx.Graph, n: fx.Node, env: dict, args: tuple | None = None, groups: int | None = None) -> fx.Node:
    """``n`` copied with its inputs mapped by ``env`` (or with ``args``; a convolution with
    ``groups``: one part's channels), its example value computed on the copies'."""
    new = graph.node_copy(n, lambda a: env.get(a, a))
    if args is not None:
        new.args = args
    if groups is not None:
        if len(new.args) > 6:
            new.args = (*new.args[:6], groups, *new.args[7:])
        else:
            new.kwargs = {**new.kwargs, "groups": groups}
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
            if name is None or c.joined:  # (a joined cut's weight is its convolution's: below)
                continue
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            parametrize.register_parametrization(mod, attr, Parts(c.sizes, 0), unsafe=True)
            originals = getattr(mod.parametrizations, attr)
            parts[which] = [getattr(originals, f"original{i}") for i in range(len(c.sizes))]
        w, b = _weight_args(lin) if not c.joined else (None, None)
        wdone = _part_chain(gm, lin, w, parts["weight"], c.sizes) if "weight" in parts else [None] * len(c.sizes)
        bdone = _part_chain(gm, lin, b, parts["bias"], c.sizes) if "bias" in parts else [None] * len(c.sizes)
        conv_env = [{} for _ in c.sizes]  # per part: each convolution's weight / bias argument -> the part's
        conv_args = []
        for conv, wname, bname in c.convs:
            cw, cb = _conv_args(conv)
            conv_args += [cw, cb]
            covered = c.conv_parts(conv)
            sizes = [c.sizes[i] for i in covered]
            for arg, name in ((cw, wname), (cb, bname)):
                if name is None:
                    continue
                mod_name, _, attr = name.rpartition(".")
                mod = model.get_submodule(mod_name)
                parametrize.register_parametrization(mod, attr, Parts(sizes, 0), unsafe=True)
                originals = getattr(mod.parametrizations, attr)
                done = _part_chain(gm, lin, arg, [getattr(originals, f"original{i}") for i in range(len(sizes))], sizes)
                for i, d in zip(covered, done):
                    conv_env[i][arg] = d
        keep = []  # the per-channel ops between the linear and the slices
        src = lin
        while src is not c.source:
            (src,) = src.users
            keep.append(src)
        convs = {conv for conv, _, _ in c.convs}
        for i, readers in enumerate(c.readers):
            chain = keep if c.refined is None else keep + c.refined[i][1:]  # (a refined chain's first: the part's slice)
            alias = [] if c.refined is None else c.refined[i][:1]
            at = sum(c.sizes[:i])
            with graph.inserting_before(lin):
                env = {w: wdone[i], **conv_env[i]} if w is not None else dict(conv_env[i])
                if b is not None:
                    env[b] = bdone[i]
                out = _copy(graph, lin, env) if not c.joined else lin.args[0][i]  # (a joined cut: the part itself)
                for k in chain:
                    shape = None
                    if k is c.source and c.unit > 1:  # the view as heads: this part's heads
                        shape = list(val_of(k).shape)
                        shape[-2] = c.sizes[i] // c.unit
                        shape = (out, *shape) if k.op == "call_method" else (out, tuple(shape))
                    scale = _buffer_parts(graph, k, out, at, c.sizes[i]) if k in keep else {}
                    out = _copy(graph, k, {**env, **scale, lin: out, **{kk: out for kk in (*alias, *chain)}}, shape,
                                groups=c.sizes[i] if k in convs else None)
            for r in readers:
                r.replace_all_uses_with(out)
        dead = {lin, *keep, *_chain(w), *_chain(b), *(n for a in conv_args for n in _chain(a)),
                *(n for ch in (c.refined or []) for n in ch), *(ch[0].args[0] for ch in (c.refined or []) if ch)}
        for readers in c.readers:
            for r in readers:
                dead.add(r)
                if r.args[0] not in (lin, *keep):  # a split's getitem: the split too
                    dead.add(r.args[0])
        # a reshape of a cut parameter that nothing reads (Bamba's `conv1d.weight.squeeze(1)` for the
        # cached-decode path, left in the trace): it would keep the fused parameter in the graph
        dead |= {u for n in list(dead) if n.op == "get_attr" for u in n.users if not u.users and op_name(u) in SHAPE}
        stale = {a for k in keep for a in k.all_input_nodes if a.op == "get_attr"}  # (buffers read afresh per part)
        for n in reversed(list(graph.nodes)):
            if n in dead and not n.users:
                if n.op == "get_attr":
                    _drop_attr(gm, n.target)
                graph.erase_node(n)
            elif n in stale and not n.users:
                graph.erase_node(n)
    graph.lint()
    gm.recompile()


def _buffer_parts(graph: fx.Graph, k: fx.Node, x: fx.Node, at: int, size: int) -> dict:
    """For an elementwise op ``k`` of the chain whose other operands are buffers holding a value per
    channel (Falcon-H1's muP vector): each such buffer -> its ``size`` channels from ``at``
    (``torch.narrow``), for the part's copy of ``k`` reading ``x``."""
    out = {}
    vx = val_of(x)
    for a in (*k.args[1:], *k.kwargs.values()):
        if not isinstance(a, fx.Node) or a.op != "get_attr":
            continue
        d = _per_channel_buffer(a, vx.ndim, vx.ndim - 1, int(val_of(k.args[0]).shape[-1]))
        if d is not None and d >= 0:
            out[a] = _narrow(graph, a, d, at, size)
    return out


def _narrow(graph: fx.Graph, a: fx.Node, d: int, at: int, size: int) -> fx.Node:
    """``torch.narrow`` of buffer ``a`` read afresh here (its own ``get_attr`` may come later)."""
    key = "example_value" if "example_value" in a.meta else "val"
    g = graph.get_attr(a.target)
    g.meta.update(a.meta)
    n = graph.call_function(torch.narrow, (g, d, at, size))
    n.meta.update({k: v for k, v in a.meta.items() if k != key})
    n.meta[key] = torch.narrow(val_of(a), d, at, size)
    return n


def _part_chain(gm, lin: fx.Node, arg: fx.Node, part_params: list, sizes: list[int]) -> list[fx.Node]:
    """For each part (of ``sizes`` rows): a ``get_attr`` of its parameter and the casts / transposes
    ``arg`` went through."""
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
            a = sum(sizes[:i])
            g.meta.update({k: v for k, v in node.meta.items() if k != key})
            g.meta[key] = ev[a:a + sizes[i]] if isinstance(ev, torch.Tensor) else None
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
    cuts = [c for c in find_cuts(gm, model) if not any(keep_whole(n) for n in c.names())]
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
    useless = {c.weight for c in cuts if not c.pays(d.decisions)}
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
    params = {name: model.get_parameter(name) for c in cuts for name in c.names()}
    return {"graph": graph, "attrs": attrs, "params": params}


def _restore(gm: fx.GraphModule, model: nn.Module, cuts: list[Cut], saved: dict) -> None:
    """``cut`` undone: the module's fused parameters, the graph module's attributes, its graph."""
    for c in cuts:
        for name in c.names():
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
