"""Finding fused projections in the captured graph (autopar/unfuse.py cuts them): a matmul by a
parameter read nowhere else whose output, through per-channel ops (casts, transposes, a depthwise
convolution), is read only by slices that cut it into contiguous parts of unequal sizes; and parts
of unequal sizes joined by ``cat`` before such a convolution and sliced back after it (the
convolution's filters are what is cut)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from autopar.analysis.tp_graph import op_name, pointwise, val_of, where_of
from autopar.ir import source_line

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
    # depthwise convolutions between the linear and the slices (a GDN / Mamba block's causal conv1d
    # over [q | k | v]): (the conv node, its weight's name, its bias's name or None), cut alike
    convs: list[tuple[fx.Node, str, str | None]] = field(repr=False, default_factory=list)
    # ``linear`` is a ``cat`` of the parts along the channels (OLMo-hybrid's q, k, v projections,
    # Qwen3-Next's regrouped heads) rather than a matmul: the convolution's weight (and bias) is the
    # one cut, and there is no fused projection
    joined: bool = False
    # a part itself cut after a depthwise convolution (Mamba-2's [z | xBC | dt], xBC convolved and
    # then split into x | B | C): per final part, the nodes from the linear's part to what its slice
    # reads (the outer slice first: it stands for the part); and per convolution, the final parts
    # it convolves. None / empty: every part goes through ``source``'s chain and every convolution
    refined: list[list[fx.Node]] | None = field(repr=False, default=None)
    covers: dict = field(repr=False, default_factory=dict)

    def conv_parts(self, conv: fx.Node) -> list[int]:
        """The final parts ``conv`` convolves (its weight is cut into their sizes)."""
        return self.covers.get(conv, list(range(len(self.sizes))))

    def names(self) -> list[str]:
        """Every parameter this cut holds as parts: the weight, its bias, the convolutions' own."""
        names = (self.weight, self.bias, *(x for _, w, b in self.convs for x in (w, b)))
        return list(dict.fromkeys(n for n in names if n is not None))

    def pays(self, decisions: dict) -> bool:
        """Whether the derivation sharded a part: a projection's part column-parallel, or (a joined
        cut) a convolution's filters sharded with their channels."""
        if self.joined:
            return any(not decisions[p].placement.is_replicate() for p in self.part_names(self.weight))
        return any(decisions[p].role == "column" for p in self.part_names(self.weight))

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
        if cs[0].joined:
            out.append(f"{cs[0].weight}{bias}{more}: one parameter per part, {len(sizes)} parts of {list(sizes)} "
                       f"channels (the per-channel convolution reads a cat of them{where_of(cs[0].linear)} and its "
                       f"output is sliced so{where}; each part convolved and placed on its own)")
            continue
        conv = "".join(f"; {'' if n not in cs[0].covers else 'parts ' + ', '.join(map(str, cs[0].covers[n])) + ' '}"
                       f"through the per-channel convolution {w}{' (and its bias)' if b else ''}{where_of(n)}, "
                       "cut alike" for n, w, b in cs[0].convs)
        out.append(f"{cs[0].weight}{bias}{more}: one parameter per part, {len(sizes)} parts of {list(sizes)} rows "
                   f"(its output is sliced so{where}; each part placed on its own{conv})")
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
    buffers = set()
    uses: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            kind, name = ids.get(id(get_attr(gm, n.target)), (None, None))
            if kind == "param":
                params[n] = name
                uses[name] = uses.get(name, 0) + 1
            elif kind == "buffer":
                buffers.add(n)
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
        src, convs = _per_channel_chain(lin, n_out, params, uses, buffers)
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
        c = Cut(params[wnode], params[bnode] if bnode is not None else None, sizes,
                f" at {line}" if line else "", lin, src, [ranges[r] for r in cuts_at], unit, convs)
        if unit == 1 and not convs:
            _refine(c, params, uses, buffers)
        cuts.append(c)
    return cuts + _joined_cuts(gm, params, uses, buffers)


def _refine(c: Cut, params: dict, uses: dict, buffers: set) -> None:
    """Cut a part of ``c`` again where it goes through a depthwise convolution and is then sliced
    into parts (Mamba-2's ``xBC``: convolved, then split into x, B and C): its slices become parts of
    their own, each convolved by its own filters."""
    sizes, readers, chains, covers = [], [], [], {}
    for size, rs in zip(c.sizes, c.readers):
        sub = None
        if len(rs) == 1:
            src, convs = _per_channel_chain(rs[0], size, params, uses, buffers)
            ranges = _readers(src, size, 1) if len(convs) == 1 and src is not rs[0] else None
            at = sorted(ranges) if ranges else []
            if len(at) >= 2 and at[0][0] == 0 and at[-1][1] == size and all(x[1] == y[0] for x, y in zip(at, at[1:])):
                sub = (src, convs, at, ranges)
        if sub is None:
            sizes.append(size)
            readers.append(rs)
            chains.append([])
            continue
        src, convs, at, ranges = sub
        chain, node = [rs[0]], rs[0]
        while node is not src:
            (node,) = node.users
            chain.append(node)
        covers[convs[0][0]] = list(range(len(sizes), len(sizes) + len(at)))
        c.convs.append(convs[0])
        for a, b in at:
            sizes.append(b - a)
            readers.append(ranges[(a, b)])
            chains.append(chain)
    if covers:
        c.sizes, c.readers, c.refined, c.covers = sizes, readers, chains, covers


def _joined_cuts(gm: fx.GraphModule, params: dict, uses: dict, buffers: set) -> list[Cut]:
    """A ``cat`` of parts of unequal sizes along the last dim, read through a per-channel chain with
    a depthwise convolution (``_per_channel_chain``) by slices that cut it back into exactly those
    parts: the convolution's weight and bias are cut into the parts (OLMo-hybrid's and Qwen3-Next's
    ``conv1d(cat(q, k, v))``), so that each part, sharded by its own heads, is convolved on its own."""
    cuts = []
    for cat in gm.graph.nodes:
        if cat.op != "call_function" or op_name(cat) != "cat" or not isinstance(cat.args[0], (list, tuple)):
            continue
        ins, v = list(cat.args[0]), val_of(cat)
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if not isinstance(v, torch.Tensor) or len(ins) < 2 or not isinstance(dim, int) or dim % v.ndim != v.ndim - 1:
            continue
        vals = [val_of(a) if isinstance(a, fx.Node) else None for a in ins]
        if not all(isinstance(x, torch.Tensor) and x.ndim == v.ndim for x in vals):
            continue
        sizes = [int(x.shape[-1]) for x in vals]
        n_out = int(v.shape[-1])
        if len(set(sizes)) == 1:
            continue  # equal parts: a strided shard holds them (the derivation's own case)
        src, convs = _per_channel_chain(cat, n_out, params, uses, buffers)
        if len(convs) != 1:
            continue
        ranges = _readers(src, n_out, 1)
        bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        if not ranges or sorted(ranges) != bounds:
            continue  # read otherwise than as the same parts
        (_, wname, bname), = convs
        line = source_line(ranges[bounds[0]][0])
        cuts.append(Cut(wname, bname, sizes, f" at {line}" if line else "", cat, src, [ranges[r] for r in bounds], 1,
                        convs, joined=True))
    return cuts


CONV = {"conv1d", "conv2d", "conv3d"}
SHAPE = SAME | {"squeeze", "unsqueeze", "view", "reshape"}  # between a convolution's weight and the convolution


def _per_channel_chain(lin: fx.Node, n_out: int, params: dict, uses: dict, buffers: set = frozenset()):
    """From the linear's output, the ops read by one user each that act on each of its n_out
    channels apart, as far as the channels are the last dim again: (the last such node, the
    depthwise convolutions on the way as (node, weight name, bias name)). Per channel: casts and
    ``unsqueeze`` keeping the channels last; transposes (the channels move); slices and padding of
    the other dims; an elementwise op of this value alone (an activation); a convolution with one filter
    per channel (``groups`` = channels, the channels on dim 1) whose weight and bias are
    parameters read nowhere else (Gated DeltaNet's and Mamba's causal conv1d over [q | k | v])."""
    cd, convs = val_of(lin).ndim - 1, []
    best = (lin, [])
    node = lin
    while len(node.users) == 1:
        (u,) = node.users
        v, name = val_of(u), op_name(u)
        if not isinstance(v, torch.Tensor) or u.args[:1] != (node,):
            break
        nd = v.ndim
        if name in SAME and tuple(v.shape) == tuple(val_of(node).shape):
            pass  # a cast
        elif name == "unsqueeze" and cd == val_of(node).ndim - 1 and int(v.shape[-1]) == n_out:
            cd = nd - 1
        elif name in TRANSPOSE and len(u.args) == 3 and all(type(d) is int for d in u.args[1:]):
            d0, d1 = (d % nd for d in u.args[1:])
            cd = d1 if cd == d0 else d0 if cd == d1 else cd
        elif name == "getitem" and isinstance(u.args[1], tuple) and len(u.args[1]) == nd and \
                all(isinstance(i, slice) for i in u.args[1]) and u.args[1][cd] == slice(None):
            pass  # slices of the other dims (the causal conv's padding cut off)
        elif name == "pad" and len(u.args) > 1 and isinstance(u.args[1], (list, tuple)) and \
                tuple(u.args[1][2 * (nd - 1 - cd):2 * (nd - cd)]) in ((), (0, 0)):
            pass  # padding of the other dims (the causal conv's, on the left of the sequence)
        elif name in CONV and cd == 1:
            conv = _depthwise(u, n_out, params, uses)
            if conv is None:
                break
            convs.append(conv)
        elif pointwise(name) and all(a in buffers and cd == nd - 1 and _per_channel_buffer(a, nd, cd, n_out) is not None
                                     for a in list(u.args[1:]) + list(u.kwargs.values()) if isinstance(a, fx.Node)):
            pass  # an activation, or a scale per channel held in a buffer (Falcon-H1's muP vector): sliced per part
        else:
            break
        if int(v.shape[cd]) != n_out:
            break
        node = u
        if cd == nd - 1:
            best = (u, list(convs))
    return best


def _per_channel_buffer(a: fx.Node, nd: int, cd: int, n_out: int) -> int | None:
    """The dim of buffer ``a`` that lines up with the channels (dim ``cd`` of an ``nd``-dim value)
    when it holds all n_out of them; -1 where it broadcasts over them (size 1 or no such dim);
    None where it holds some other number."""
    v = val_of(a)
    if not isinstance(v, torch.Tensor):
        return None
    d = cd - (nd - v.ndim)
    if d < 0 or v.shape[d] == 1:
        return -1
    return d if int(v.shape[d]) == n_out else None


def _depthwise(u: fx.Node, n_out: int, params: dict, uses: dict):
    """(u, its weight's name, its bias's name) where ``u`` convolves each of n_out channels with
    its own filter, a parameter (through reshapes) read only here; else None."""
    args = list(u.args) + [None] * 7
    w = args[1] if args[1] is not None else u.kwargs.get("weight")
    b = args[2] if args[2] is not None else u.kwargs.get("bias")
    groups = args[6] if len(u.args) > 6 else u.kwargs.get("groups", 1)
    names = []
    for a in (w, b):
        node = a
        while isinstance(node, fx.Node) and node not in params and op_name(node) in SHAPE and len(node.users) == 1:
            node = node.args[0]
        if a is None:
            names.append(None)
        elif node not in params or uses[params[node]] != 1 or int(val_of(node).shape[0]) != n_out:
            return None
        else:
            names.append(params[node])
    if groups != n_out or names[0] is None:
        return None
    return u, names[0], names[1]


def _weight_args(mm: fx.Node) -> tuple:
    """(weight, bias) arguments of ``linear(x, W, b)`` or ``matmul(x, W.T)`` (bias None)."""
    if op_name(mm) == "linear":
        args = list(mm.args) + [None] * 3
        return (args[1] if args[1] is not None else mm.kwargs.get("weight"),
                args[2] if args[2] is not None else mm.kwargs.get("bias"))
    return mm.args[1], None


def _conv_args(conv: fx.Node) -> tuple:
    """(weight, bias) arguments of ``conv1d(x, weight, bias, ...)``."""
    args = list(conv.args) + [None] * 3
    return (args[1] if args[1] is not None else conv.kwargs.get("weight"),
            args[2] if args[2] is not None else conv.kwargs.get("bias"))
