"""A deep model's capture for the price of a shallow one: planning only.

dynamo traces the user's Python block by block, so capturing Llama-3-70B's 80 blocks costs 80
times one block (about 0.2 s each on this machine), and the planner captures deep models again
and again (every confirmed candidate at two depths). Inside ``spliced()`` (entered by the planner,
``autopar/planner/search.py``), ``capture_graph`` captures a model whose block list (``find_blocks``:
an ``nn.ModuleList`` or ``nn.Sequential`` of alike blocks) has more than three blocks with only its
first three, and builds the graph of all L blocks from
that one: the prologue, block 0 and block 1 as captured, then block 2's nodes repeated for blocks
2 .. L-1 (each copy reading its own block's parameters and the previous copy's values where block
2 read block 1's), then the epilogue reading the last copy.

What is checked first (any failure: the whole model is captured as usual, nothing is guessed):

- every block of the list has the same class and the same parameters and buffers (names within
  the block, shapes, dtypes, requires_grad; buffer values where they have values) and the same
  plain attributes in every submodule but a layer index (``_difference``: Hugging Face's
  per-layer attention type and sliding window are such attributes);
- in the three-block capture, the blocks' nodes are contiguous runs in block order, nothing but
  block 2 reads block 1, nothing but block 1 reads block 0 (beyond the prologue), the epilogue
  reads nothing of blocks 0 and 1, and block 2 is block 1 node for node (op, target, arguments,
  shapes; a read of block 0 in block 1 is the same position's read of block 1 in block 2).

It is for planning: the planner's figures already assume identical blocks (its composition
multiplies one block's). A model whose blocks differ by their index alone, in code rather than in
an attribute (``if i % 4 == 3`` in the model's loop), passes the checks above but not that assumption;
``autopar.compile`` never splices. ``tests/test_splice.py`` compares spliced captures with whole
ones and the compiled figures of both.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import re

import torch
from torch import fx, nn

from autopar import torch_compat as tc
from autopar.modpath import block_of as _block
from autopar.modpath import get_attr as _get_attr
from autopar.modpath import module_path as _path
from autopar.scoped import setting

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_splice", default=False)
KEEP = 3  # blocks captured: the first (after the prologue), one inner, and the one repeated
STATS: dict[str, int] = {}


@contextlib.contextmanager
def spliced():
    """Captures inside splice deep block lists (module docstring)."""
    with setting(_ON, True):
        yield


def active() -> bool:
    return _ON.get()


def block_list(model: nn.Module, min_blocks: int = KEEP + 1) -> tuple[str, nn.Module] | None:
    """The model's repeated block list with its path (``find_blocks``), if it has at least
    ``min_blocks`` blocks; None if not."""
    found = find_blocks(model, min_blocks)
    return None if isinstance(found, str) else found


def find_blocks(model: nn.Module, min_blocks: int = KEEP + 1) -> tuple[str, nn.Module] | str:
    """The model's repeated block list and its path, or why it has none (one line).

    A block list is an ``nn.ModuleList`` or ``nn.Sequential`` of at least ``min_blocks`` blocks
    alike (``_alike``: one class, the same parameters and buffers, the same plain attributes but
    a layer index): Hugging Face's ``model.layers``, GPT-2's ``transformer.h``, torchtitan's
    ``layers``, a user's own. A list inside a block of another list of blocks of one class (the
    experts of a decoder layer) is part of that block, not the model's list. Of several (an
    encoder's and a decoder's), the one holding the most parameters."""
    outer = _outer_lists(model)
    alike = [(n, m) for n, m in outer if all(_alike(m[0], b, 0, i) for i, b in enumerate(m))]
    deep = [(n, m) for n, m in alike if len(m) >= min_blocks]
    if deep:
        return max(deep, key=lambda nm: (sum(p.numel() for p in nm[1].parameters()), len(nm[1])))
    if alike:
        n, m = max(alike, key=lambda nm: len(nm[1]))
        return f"its longest list of alike blocks, {n or '(the model)'}, has {len(m)} (fewer than {min_blocks})"
    if outer:
        n, m = max(outer, key=lambda nm: len(nm[1]))
        i = next(i for i, b in enumerate(m) if not _alike(m[0], b, 0, i))
        return (f"the blocks of its list {n or '(the model)'} are not alike: block {i} ({type(m[i]).__name__}) differs "
                f"from block 0 ({type(m[0]).__name__}) in {_difference(m[0], m[i], 0, i)}")
    return "no nn.ModuleList or nn.Sequential of blocks (one class, the same parameter shapes)"


def _outer_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's lists of two or more modules that are not inside a block of another list of
    blocks of one class (``find_blocks``)."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2]
    inner = set()  # paths of the blocks of lists whose children share a class
    for name, m in lists:
        kinds = [type(b) for b in m]
        for k, b in zip(m._modules, m):
            if kinds.count(type(b)) > 1:
                inner.add(f"{name}.{k}" if name else k)
    return [(n, m) for n, m in lists if not any(n.startswith(p + ".") for p in inner)]


def find_period(model: nn.Module, min_units: int) -> tuple[str, nn.Module, int] | None:
    """A block list whose blocks are not all alike but repeat with a period: (path, the list,
    the period p), p the smallest with every block alike the one p before it (``_alike``), the
    list a whole number of at least ``min_units`` such units (Gemma 2 and gpt-oss alternate a
    sliding-window and a full attention layer: p = 2; Cohere 2 three and one: p = 4). Of
    several, the one holding the most parameters; None if none."""
    found = []
    for n, m in _outer_lists(model):
        blocks = list(m)
        for p in range(2, len(blocks) // min_units + 1):
            if len(blocks) % p == 0 and all(_alike(blocks[j - p], blocks[j], j - p, j) for j in range(p, len(blocks))):
                found.append((n, m, p))
                break
    if not found:
        return None
    return max(found, key=lambda f: (sum(x.numel() for x in f[1].parameters()), len(f[1])))


def _alike(a: nn.Module, b: nn.Module, i: int = 0, j: int = 0) -> bool:
    """Blocks ``i`` and ``j`` of a list are alike (``_difference`` is empty)."""
    return not _difference(a, b, i, j)


def _difference(a: nn.Module, b: nn.Module, i: int, j: int) -> str:
    """How block ``j`` differs from block ``i`` ("" where it does not): class, parameters and
    buffers (names, shapes, dtypes, requires_grad; buffer values where they have values), and
    the plain attributes of each submodule (numbers, strings: a per-layer attention type or
    sliding window), except an integer that differs by the blocks' distance (a layer index)."""
    if type(a) is not type(b):
        return "class"
    ta = list(a.named_parameters()) + list(a.named_buffers())
    tb = list(b.named_parameters()) + list(b.named_buffers())
    if [n for n, _ in ta] != [n for n, _ in tb]:
        return "parameter names"
    for (n, x), (_, y) in zip(ta, tb):
        if (x.shape, x.dtype, x.requires_grad, x.device.type) != (y.shape, y.dtype, y.requires_grad, y.device.type):
            return f"{n}'s shape or dtype"
        if not isinstance(x, nn.Parameter) and x.device.type != "meta" and not torch.equal(x, y):
            return f"{n}'s values"
    ma, mb = dict(a.named_modules()), dict(b.named_modules())
    if ma.keys() != mb.keys():
        return "submodules"
    for name, sa in ma.items():
        sb = mb[name]
        if type(sa) is not type(sb):
            return f"{name or 'the block'}'s class"
        va, vb = _plain(sa), _plain(sb)
        for k in va.keys() | vb.keys():
            x, y = va.get(k), vb.get(k)
            if x != y and not (type(x) is int and type(y) is int and y - x == j - i):
                return f"{name + '.' if name else ''}{k} ({x!r} / {y!r})"
    return ""


def _plain(m: nn.Module) -> dict:
    return {k: v for k, v in vars(m).items()
            if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str, type(None)))}


@contextlib.contextmanager
def truncated(model: nn.Module, path: str, blocks: nn.Module, keep: int = KEEP):
    """``model`` with its block list ``path`` cut to its first ``keep`` blocks (the same modules,
    in a shallow copy of the list: its class and attributes kept)."""
    kept = dict(list(blocks._modules.items())[:keep])
    if not path:  # the model is the list
        whole, model._modules = model._modules, kept
        try:
            yield
        finally:
            model._modules = whole
        return
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    attr = path.rpartition(".")[2]
    short = copy.copy(blocks)
    short._modules = kept
    setattr(parent, attr, short)
    try:
        yield
    finally:
        setattr(parent, attr, blocks)


def splice(gm: fx.GraphModule, model: nn.Module, path: str, blocks: nn.ModuleList) -> fx.GraphModule | None:
    """The graph of ``model`` with all of ``blocks`` from ``gm``, its capture with the first KEEP;
    None where a check of the module docstring fails."""
    nodes = list(gm.graph.nodes)
    ids = {id(t): name for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    names = _attr_names(gm, ids)
    keys = {f"{path}.{i}": i for i in range(KEEP)}  # module paths as the model names them (split's _path)
    which: dict[fx.Node, int] = {}  # block -> its nodes
    for n in nodes:
        b = _block(_path(n)) if n.op not in ("placeholder", "output") else ""
        if b in keys:
            which[n] = keys[b]
    runs = [[n for n in nodes if which.get(n) == i] for i in range(KEEP)]
    if any(not r for r in runs):
        return None
    pos = {n: k for k, n in enumerate(nodes)}
    first, last = pos[runs[0][0]], pos[runs[-1][-1]]
    if nodes[first:last + 1] != [n for r in runs for n in r]:
        return None  # other nodes between the blocks, or blocks interleaved
    prologue, epilogue = nodes[:first], nodes[last + 1:]
    # prologue nodes made from one block's tensors alone (mixed precision's casts of its weights)
    # belong to that block: ``owned``
    owned: dict[fx.Node, int] = {}
    for n in prologue:
        if n.op == "get_attr":
            i = _index_in(names.get(n.target, ""), path)
        elif n.op in ("call_function", "call_method") and n.all_input_nodes:
            owners = {owned.get(a) for a in n.all_input_nodes}
            i = owners.pop() if len(owners) == 1 else None
        else:
            i = None
        if i is not None and i < KEEP:
            owned[n] = i
    own = [[n for n in prologue if owned.get(n) == i] for i in range(KEEP)]
    if len(own[1]) != len(own[2]) or (own[2] and [pos[n] for n in own[2]] != list(
            range(pos[own[2][0]], pos[own[2][0]] + len(own[2])))):
        return None
    part = {**{n: (i, "own") for i, r in enumerate(own) for n in r}, **{n: (i, "run") for n, i in which.items()}}
    idx = {n: k for r in runs + own for k, n in enumerate(r)}
    # who reads what: block i (and what it owns) reads only itself, block i - 1 and the shared prologue;
    # the epilogue reads none of blocks 0 and 1
    for n in list(part) + epilogue:
        mine = part[n][0] if n in part else KEEP
        for a in n.all_input_nodes:
            if a in part and part[a][0] not in ((mine, mine - 1) if n in part else (KEEP - 1,)):
                return None
            if n in part and part[n][1] == "own" and a in part and part[a] != (mine, "own"):
                return None

    def same_arg(a, b) -> bool:
        if isinstance(a, fx.Node) != isinstance(b, fx.Node):
            return False
        if isinstance(a, fx.Node):
            if a not in part or b not in part:
                return a is b  # the shared prologue's values: the same node
            (ia, ka), (ib, kb) = part[a], part[b]
            return ib == ia + 1 and ka == kb and idx[a] == idx[b]
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same_arg(x, y) for x, y in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same_arg(a[k], b[k]) for k in a)
        return type(a) is type(b) and a == b

    for a, b in zip(own[1] + runs[1], own[2] + runs[2]):
        if a.op != b.op or not same_arg(a.args, b.args) or not same_arg(a.kwargs, b.kwargs):
            return None
        if a.op == "get_attr":
            na, nb = names.get(a.target), names.get(b.target)
            if na is None or nb is None or na.replace(f"{path}.1.", f"{path}.2.", 1) != nb:
                return None
        elif a.target != b.target:
            return None
        if _shape(a.meta.get("example_value")) != _shape(b.meta.get("example_value")):
            return None
    if len(runs[1]) != len(runs[2]):
        return None

    # ---- the spliced graph: block 2 (and what it owns) once per block 2 .. L-1
    full = dict(model.named_parameters())
    full.update(dict(model.named_buffers()))
    g = fx.Graph()
    g._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    copies: list[dict[fx.Node, fx.Node]] = []  # per block j >= 2: block 2's node -> its copy
    attrs: dict[str, object] = {}

    def emit(template: list[fx.Node], j: int, here: dict, before: dict) -> bool:
        for n in template:
            if n.op == "get_attr":
                user = names[n.target].replace(f"{path}.2.", f"{path}.{j}.", 1)
                if user not in full:
                    return False
                target = "autopar_spliced__" + re.sub(r"\W", "_", user)
                attrs[target] = full[user]
                new = g.get_attr(target)
            else:
                new = g.node_copy(n, lambda a: here[a] if a in here else before[a] if a in before else env[a])
            new.meta = dict(n.meta)
            stack = n.meta.get("nn_module_stack")
            if stack:
                new.meta["nn_module_stack"] = {k: (_renumber(v[0], path, j), *v[1:]) if isinstance(v, tuple) else v
                                               for k, v in stack.items()}
            here[n] = new
        return True

    L = len(blocks)
    for n in prologue:
        if owned.get(n) == 2:
            if n is own[2][0]:
                for j in range(KEEP - 1, L):
                    copies.append({})
                    if not emit(own[2], j, copies[-1], {}):
                        return None
            continue
        env[n] = g.node_copy(n, env.__getitem__)
    for n in runs[0] + runs[1]:
        env[n] = g.node_copy(n, env.__getitem__)
    if not own[2]:
        copies = [{} for _ in range(KEEP - 1, L)]
    pairs = list(zip(own[1] + runs[1], own[2] + runs[2]))
    before = {a: env[a] for a, _ in pairs}  # block 1's values as block 2 reads them
    here: dict[fx.Node, fx.Node] = {}
    for k, j in enumerate(range(KEEP - 1, L)):
        here = copies[k]
        if not emit(runs[2], j, here, before):
            return None
        before = {a: here[b] for a, b in pairs}  # what the next copy reads where block 2 read block 1
    for n in epilogue:
        env[n] = g.node_copy(n, lambda a: here[a] if a in here else env[a])
    for n in g.nodes:
        if n.op == "get_attr" and n.target not in attrs:
            attrs[n.target] = _get_attr(gm, n.target)
    out = tc.graph_module(attrs, g)
    out.meta.update(gm.meta)
    out.__dict__.update({k: gm.__dict__[k] for k in ("_in_spec", "_out_spec", "shape_env") if k in gm.__dict__})
    out.graph.lint()
    out.recompile()
    STATS["spliced"] = STATS.get("spliced", 0) + 1
    return out


def _index_in(name: str, path: str) -> int | None:
    """``layers.7.mlp.w1.weight`` -> 7 (the block of list ``path`` a tensor belongs to)."""
    if not name.startswith(path + "."):
        return None
    head = name[len(path) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _attr_names(gm: fx.GraphModule, ids: dict[int, str]) -> dict[str, str]:
    """get_attr target -> the model's name of the tensor it reads (``layers.1.mlp.w1.weight``)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = _get_attr(gm, n.target)
            if id(t) in ids:
                out[n.target] = ids[id(t)]
    return out


def _shape(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_shape(x) for x in v)
    return type(v).__name__


def _renumber(p: str, path: str, j: int, src: int = 2) -> str:
    """A module path of block ``src`` as block ``j``'s (dotted, indexed or getattr form)."""
    attr = re.escape(path.rpartition(".")[2])
    p = re.sub(rf"({attr})\.{src}(?=\D|$)", rf"\g<1>.{j}", p)
    p = re.sub(rf"({attr})\[{src}\]", rf"\g<1>[{j}]", p)
    return re.sub(rf"({attr}), '{src}'\)", rf"\g<1>, '{j}')", p)
