"""A deep model's joint graph from a three-block one: ``autopar plan``'s depths 4 and 5.

``autopar plan`` compiles a model with a repeated block list at depths 3, 4 and 5 and extrapolates
(autopar/tools/extrapolate.py). AOTAutograd's joint forward + backward trace is the largest part
of each of those compiles. Inside ``based_on(gm3, joint3)`` (the depth-3 compile's torch-level
graph after the passes before autograd, and its joint graph), the autograd pass of a deeper
model takes its joint graph from depth 3's instead of tracing it, where that is what a trace
would give:

- the deeper model's torch-level graph must be depth 3's spliced (autopar/splice.py) to its
  depth, node for node (op, target, arguments, shapes): the same program, more blocks;
- in depth 3's joint graph every node is labelled with its block (forward nodes by their module
  stack, backward nodes by their forward's, parameters by name, a gradient sum without a module
  by the block of its latest input), and the blocks' nodes must come in runs 0, 1, 2 (prologue
  casts, forward, parameters) or 2, 1, 0 (backward), with nothing between;
- block 1 (the inner block) must be block 0 node for node (op, target, shapes, dtypes), each
  argument shifted by one block: its own nodes at the same position, a read of block 2 where block
  0 reads block 1 (the next block's gradients), a read of block 0 where block 0 reads the prologue
  (the previous block's output), the prologue's and epilogue's values the same node. Nothing but
  block 1 and the epilogue reads block 2, nothing but block 1 and the prologue's backward reads
  block 0.

Then the deep joint graph is depth 3's with block 1's nodes repeated for blocks 1 .. L-2 (each
copy reading the previous copy where block 1 read block 0, and the next copy where it read block
2) and block 2's as block L-1: in the order a trace emits them (forward ascending, backward
descending). Any check failing: traced as usual. Planning only: the graph keeps no pytree codegen,
and a copy's ``from_node`` (which keys dropout's random stream in a real run) still names block 1's.
``tests/test_splice.py`` compares spliced joint graphs with traced ones node for node.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy

import torch
from torch import fx

from autopar.modpath import block_of, stack_path
from autopar.splice import KEEP, _index_in, _renumber, _shape
from autopar.scoped import setting

_BASE: contextvars.ContextVar = contextvars.ContextVar("autopar_joint_base", default=None)
STATS: dict[str, int] = {}


@contextlib.contextmanager
def based_on(gm3: fx.GraphModule, joint3, model3):
    """Deeper models' joint graphs from ``joint3`` (the joint Program of ``gm3``, the torch-level
    graph of ``model3``, the model cut to 3 blocks) where the checks allow (module docstring)."""
    from autopar.capture_cache import gm_template, program_template

    with setting(_BASE, (gm_template(gm3, model3), program_template(joint3, model3))):
        yield


def joint_for(gm: fx.GraphModule, model, stage) -> object | None:
    """The joint Program of ``gm`` (``model``'s torch-level graph) spliced from the base, or None."""
    from autopar import splice
    from autopar.capture_cache import gm_from_template

    base = _BASE.get()
    if base is None or stage is not None:
        return None
    found = splice.block_list(model, splice.KEEP + 1)
    if found is None:
        return None
    gm3, joint3 = base
    if gm3 is None:
        return None
    path, blocks = found
    with torch.no_grad():  # depth 3's graph read as the first three blocks of ``model``, spliced to its depth
        expected = splice.splice(gm_from_template(gm3, model), model, path, blocks)
    if expected is None or not same_graph(expected.graph, gm.graph):
        STATS["refused"] = STATS.get("refused", 0) + 1
        return None
    out = splice_joint(joint3, model, path, len(blocks))
    STATS["spliced" if out is not None else "refused"] = STATS.get("spliced" if out is not None else "refused", 0) + 1
    return out


def same_graph(a: fx.Graph, b: fx.Graph) -> bool:
    """Node for node the same program (op, target, arguments by position, shapes, module paths);
    names aside."""
    na, nb = list(a.nodes), list(b.nodes)
    if len(na) != len(nb):
        return False
    pos = {n: i for i, n in enumerate(na)}
    posb = {n: i for i, n in enumerate(nb)}
    ok = True

    def same(x, y):
        nonlocal ok
        if isinstance(x, fx.Node) or isinstance(y, fx.Node):
            ok = ok and isinstance(x, fx.Node) and isinstance(y, fx.Node) and pos[x] == posb[y]
        elif isinstance(x, (list, tuple)):
            ok = ok and type(x) is type(y) and len(x) == len(y)
            if ok:
                for p, q in zip(x, y):
                    same(p, q)
        elif isinstance(x, dict):
            ok = ok and isinstance(y, dict) and x.keys() == y.keys()
            if ok:
                for k in x:
                    same(x[k], y[k])
        else:
            ok = ok and type(x) is type(y) and x == y
    for x, y in zip(na, nb):
        if x.op != y.op or (x.op not in ("get_attr", "placeholder") and x.target != y.target):
            return False
        same(x.args, y.args)
        same(x.kwargs, y.kwargs)
        if not ok or any(_shape(x.meta.get(k)) != _shape(y.meta.get(k)) for k in ("example_value", "val")):
            return False
        if any(stack_path(x.meta.get(k)) != stack_path(y.meta.get(k)) for k in ("nn_module_stack", "fwd_nn_module_stack")):
            return False
    return True


def _labels(graph: fx.Graph, path: str, keep: int) -> dict[fx.Node, int] | None:
    """node -> its block (0 .. keep-1); nodes of no block are absent."""
    from autopar.ir import info

    out: dict[fx.Node, int] = {}
    pos = {n: k for k, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder":
            role = info(n).role
            i = _index_in(str(role[1]), path) if role and role[0] in ("param", "buffer") else None
        else:
            st = n.meta.get("nn_module_stack") if "nn_module_stack" in n.meta else n.meta.get("fwd_nn_module_stack")
            p = stack_path(st)
            b = block_of(p) if p else ""
            if b:
                i = _index_in(b + ".", path)
                if i is None:
                    return None  # another module list (not the one spliced)
            elif p:
                i = None  # the prologue's or epilogue's own module
            else:  # no module (a gradient sum, a cast): the block of its latest input
                ins = [a for a in n.all_input_nodes if a in out]
                i = out[max(ins, key=pos.__getitem__)] if ins else None
        if i is not None:
            if not 0 <= i < keep:
                return None
            out[n] = i
    return out


def splice_joint(template, model, path: str, layers: int):
    """The joint Program of ``model`` (``layers`` blocks) from ``template``, its 3-block one; None
    where a check of the module docstring fails."""
    from autopar.ir import NodeInfo, Program, info

    g3 = template.graph
    nodes = list(g3.nodes)
    label = _labels(g3, path, KEEP)
    if label is None:
        return None

    sh = Shift(nodes, label, layers, lambda n: info(n).role, path)
    if sh.why:
        return None

    # ---- emit: the expansion in the trace's order (Shift.order), each node reading what Shift.read says
    g = fx.Graph()
    new: dict[tuple, fx.Node] = {}  # (template node, deep block j or None) -> its copy
    for n, j, src in sh.order():
        if n.op == "placeholder":
            m = g.placeholder(n.name if src is None or j == src else f"{n.name}_b{j}")
            m.meta = dict(n.meta)
            rec = copy.copy(info(n))
            if src is not None and j != src:
                rec.role = (rec.role[0], _renamed(rec.role[1], path, src, j))
            m.meta["autopar"] = rec
        else:
            m = g.node_copy(n, lambda a: new[sh.read(a, j, src)])
            rec = m.meta.get("autopar")
            if isinstance(rec, NodeInfo):
                m.meta["autopar"] = copy.copy(rec)
            if src is not None and j != src:  # the module stacks name the deep model's block
                for key in ("nn_module_stack", "fwd_nn_module_stack"):
                    st = n.meta.get(key)
                    if st:
                        m.meta[key] = {k: (_renumber(v[0], path, j, src), *v[1:]) if isinstance(v, tuple) else v
                                       for k, v in st.items()}
        new[(n, j)] = m
    out_node = nodes[-1]
    if out_node.op != "output":
        return None
    flat, roles = list(out_node.args[0]), list(template.outputs)
    want = sh.outputs(flat, roles, path)
    if isinstance(want, str):
        return None
    new_flat = [new[v] if isinstance(v, tuple) else v for v, _ in want]
    new_roles = [r for _, r in want]
    if len(new_flat) != len(flat) + (layers - KEEP) * [_grad_block(r, path) for r in roles].count(1):
        return None
    out = g.output(type(out_node.args[0])(new_flat))
    out.meta = {k: v for k, v in out_node.meta.items() if k != "desc"}
    inputs = [info(p).role for p in g.nodes if p.op == "placeholder"]
    bufs = dict(model.named_buffers(remove_duplicate=False))
    buffers = {}
    for kind, name in inputs:
        if kind == "buffer":
            v = template.buffers.get(name)
            if v is None and name not in bufs:
                return None
            buffers[name] = bufs[name] if v is None else v
    g.lint()
    return Program(graph=g, inputs=inputs, outputs=new_roles, buffers=buffers)


def _grad_block(role, path: str) -> int | None:
    if role[0] != "grad":
        return None
    return _index_in(str(role[1]), path)


# ---- the shift checks and the expansion, over any graph with block labels


class Shift:
    """Block labels of a 3-block graph checked to repeat (block 1 = block 0 shifted by one), and
    the order and reads of its expansion to ``layers`` blocks. A node of the expansion is a key
    ``(node, j)``: ``node`` of the 3-block graph as deep block ``j`` (None: of no block)."""

    def __init__(self, nodes, label, layers: int, role_of, path: str):
        """``role_of(placeholder)``: its role, ("param", name)...; block 1's inputs must be block 0's
        renamed by one block (``path``: the block list's)."""
        self.nodes, self.label, self.layers, self.last = nodes, label, layers, layers - 1
        self.why = self._check(role_of, path)

    def _check(self, role_of, path: str) -> str:
        nodes, label = self.nodes, self.label
        if self.layers < KEEP:
            return f"{self.layers} blocks"
        blocks = self.blocks = [[n for n in nodes if label.get(n) == i] for i in range(KEEP)]
        if any(not b for b in blocks) or len(blocks[0]) != len(blocks[1]):
            return "blocks 0 and 1 differ in node count"
        self.idx = idx = {n: k for b in blocks for k, n in enumerate(b)}
        groups: list[list[int]] = []
        prev = None
        for n in nodes:
            b = label.get(n)
            if b is None:
                prev = None
                continue
            if prev is None:
                groups.append([b])
            elif b != groups[-1][-1]:
                groups[-1].append(b)
            prev = b
        if any(gr not in ([0, 1, 2], [2, 1, 0]) for gr in groups):
            return "the blocks' nodes do not come in runs 0, 1, 2 or 2, 1, 0"
        for n in nodes:
            if n.op == "output":
                continue
            mine = label.get(n)
            for a in n.all_input_nodes:
                ba = label.get(a)
                if ba is None or ba == mine:
                    continue
                if (ba == 2 and mine != 1 and mine is not None) or (ba == 1 and mine not in (0, 2)) or \
                        (ba == 0 and mine not in (1, None)):
                    return f"{n.name} (block {mine}) reads {a.name} (block {ba})"
        self.nxt = nxt = {}

        def same_arg(x, y) -> bool:
            if isinstance(x, fx.Node) != isinstance(y, fx.Node):
                return False
            if isinstance(x, fx.Node):
                bx, by = label.get(x), label.get(y)
                if bx is None:
                    return x is y
                if bx == 1:
                    return by == 0 and idx[x] == idx[y]
                if bx == 0:
                    return by is None
                return by == 1 and nxt.setdefault(x, y) is y
            if isinstance(x, (list, tuple)):
                return type(x) is type(y) and len(x) == len(y) and all(same_arg(p, q) for p, q in zip(x, y))
            if isinstance(x, dict):
                return x.keys() == y.keys() and all(same_arg(x[k], y[k]) for k in x)
            return type(x) is type(y) and x == y

        for a, b in zip(blocks[1], blocks[0]):
            if a.op != b.op or _shape(a.meta.get("val")) != _shape(b.meta.get("val")):
                return f"block 1's {a.name} is not block 0's {b.name} (op or shape)"
            if a.op == "placeholder":
                ra, rb = role_of(a), role_of(b)
                if ra is None or rb is None or ra[0] != rb[0] or _renamed(str(ra[1]), path, 1, 0) != rb[1]:
                    return f"block 1's input {a.name} is not block 0's {b.name}"
                continue
            if a.target != b.target or not same_arg(a.args, b.args) or not same_arg(a.kwargs, b.kwargs):
                return f"block 1's {a.name} is not block 0's {b.name} shifted by one block"
        if len(set(nxt.values())) != len(nxt):
            return "block 1 reads block 2's values where block 0 reads one of block 1's"
        return ""

    def canon(self, n) -> int | None:
        b = self.label.get(n)
        return self.last if b == 2 else b

    def read(self, a: fx.Node, j: int | None, src: int | None) -> tuple:
        """The key deep block ``j`` (made from block ``src``; None: no block) reads for ``a``."""
        ba = self.label.get(a)
        if ba is None:
            return (a, None)
        if src is None or (ba == src and src != 1):
            return (a, self.canon(a))
        if src != 1:  # block 0 or block 2 (as block L-1) reading block 1: its first or last copy
            return (a, 1 if src == 0 else self.last - 1)
        if ba == 1:
            return (a, j)
        if ba == 0:  # the previous copy where block 1 read block 0
            return (a, 0) if j == 1 else (self.blocks[1][self.idx[a]], j - 1)
        return (a, self.last) if j == self.last - 1 else (self.nxt[a], j + 1)

    def order(self):
        """(node, j, src) of the expansion in a trace's order (forward ascending, backward
        descending), the output node left out."""
        nodes, label = self.nodes, self.label
        k = 0
        while k < len(nodes):
            n = nodes[k]
            if n.op == "output":
                k += 1
                continue
            if label.get(n) is None:
                yield n, None, None
                k += 1
                continue
            e = k
            while e < len(nodes) and label.get(nodes[e]) is not None:
                e += 1
            run = {i: [m for m in nodes[k:e] if label[m] == i] for i in range(KEEP)}
            for j in (range(self.layers) if label[n] == 0 else range(self.layers - 1, -1, -1)):
                src = 0 if j == 0 else (2 if j == self.last else 1)
                for m in run[src]:
                    yield m, j, src
            k = e

    def outputs(self, flat, roles, path: str):
        """[(value key or constant, role)] of the expansion's output node, or why not."""
        if len(flat) != len(roles):
            return "the outputs and their roles differ in count"
        blocked = [_index_in(str(r[1]), path) if r[0] == "grad" else None for r in roles]
        out = []
        for pos, (v, r) in enumerate(zip(flat, roles)):
            i = blocked[pos]
            if i is None:
                out.append(((v, self.canon(v)) if isinstance(v, fx.Node) else v, r))
            elif i == 0 and (pos == 0 or blocked[pos - 1] is None):
                e = pos
                while e < len(flat) and blocked[e] is not None:
                    e += 1
                if [blocked[q] for q in range(pos, e)] != sorted(blocked[q] for q in range(pos, e)):
                    return "the blocks' gradients are not in block order"
                run = {b: [q for q in range(pos, e) if blocked[q] == b] for b in range(KEEP)}
                for j in range(self.layers):
                    src = 0 if j == 0 else (2 if j == self.last else 1)
                    for q in run[src]:
                        v2 = flat[q]
                        out.append(((v2, j) if isinstance(v2, fx.Node) else v2,
                                    (roles[q][0], _renamed(roles[q][1], path, src, j))))
            elif pos == 0 or blocked[pos - 1] is None:
                return "a run of the blocks' gradients does not start at block 0"
        return out


def _renamed(name: str, path: str, i: int, j: int) -> str:
    return name.replace(f"{path}.{i}.", f"{path}.{j}.", 1)
