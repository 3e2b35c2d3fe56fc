"""A deep model's per-rank program from a three-block one: ``autopar plan``'s depths 4 and 5.

``autopar plan`` compiles a model with a repeated block list at depths 3, 4 and 5 and extrapolates
(autopar/tools/extrapolate.py); their joint graphs are already depth 3's spliced
(autopar/joint_splice.py). localize (passes/localize.py: a make_fx retrace of the placed graph,
largely through DTensor) was the largest step left per depth. Inside ``recording(path)`` the
first localize records its placed graph (after collectives) and its per-rank program: depth 3's,
compiled before the fork. Every later localize inside it (depths 4 and 5) splices its per-rank
program from that record instead of tracing, where that is what a trace would give:

- the deeper placed graph must be depth 3's with block 1 repeated, node for node: op, target,
  arguments (each copy reading the previous copy where block 1 read block 0, the next where it
  read block 2: joint_splice's shift checks, run over the placed graph's own block labels), shapes,
  every node's placements, the placements its inputs were wanted in, and the rule that decided
  (its name, its placements and its local implementation: code and captured values); placeholders
  by their role, renumbered; the outputs by role;
- no dropout anywhere (its mask is keyed by the node's name);
- depth 3's per-rank program must pass the same shift checks under the block of the global node
  each local node came from (``meta["custom"]["autopar_origin"]``).

Then the deep per-rank program is depth 3's with block 1's local nodes repeated (as the joint
splice repeats them), named as a trace names them, each naming its own global node as origin
(module stacks renumbered), with what a plain copy would get wrong made right:

- fake values: each copy gets its own storages, with the aliasing of depth 3's (a view of its
  block's value views the copy's; of the previous block's, the previous copy's): the liveness
  analysis keys buffers by storage, and shared values would merge every copy's buffers into one;
- the collectives' CommRecords are made against the deeper graph's nodes (``_annotate_collectives``,
  as localize makes them).

Anything failing: traced in full, and why is kept (``log()``; the plan's analysis line says it).
``tests/test_splice.py`` compares spliced per-rank programs with traced ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import re

import torch
from torch import fx

from autopar import torch_compat as tc
from autopar.analysis.liveness import storage_key
from autopar.capture_cache import copy_graph
from autopar.ir import info
from autopar.joint_splice import KEEP, Shift, _labels, _renamed
from autopar.scoped import setting
from autopar.splice import _renumber, _shape

_BASE: contextvars.ContextVar = contextvars.ContextVar("autopar_local_base", default=None)


class _Record:
    def __init__(self, path: str):
        self.path = path
        self.g3: fx.Graph | None = None  # depth 3's placed graph (a copy)
        self.l3: fx.GraphModule | None = None  # its per-rank program (a copy)
        self.roles: list = []
        self.why = ""  # why nothing was recorded
        self.log: list[str] = []  # one line per localize inside: "recorded", "spliced" or why traced


@contextlib.contextmanager
def recording(path: str):
    """The first localize inside records its graphs; the later ones splice from them."""
    with setting(_BASE, _Record(path)):
        yield


def log() -> list[str]:
    """One line per localize inside the current ``recording`` ("recorded", "spliced" or why it was
    traced); [] outside one."""
    rec = _BASE.get()
    return rec.log if rec is not None else []


def localized(program, ctx, trace, annotate) -> None:
    """``trace(program, ctx)`` (localize's own) unless spliced from the record (its collectives'
    CommRecords made by ``annotate``, localize's); records the first."""
    rec = _BASE.get()
    if rec is None:
        trace(program, ctx)
        return
    if rec.why:
        rec.log.append(f"traced: depth 3's program was not recorded ({rec.why})")
        trace(program, ctx)
        return
    if rec.g3 is None:
        trace(program, ctx)
        rec.why = _record(rec, program)
        rec.log.append(f"depth 3 not recorded: {rec.why}" if rec.why else "recorded")
        return
    try:
        got = splice_local(rec, program, ctx, annotate)
    except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as e:  # a mapping the checks missed
        got = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    if isinstance(got, str):
        rec.log.append(f"traced: {got}")
        trace(program, ctx)
        return
    for n in program.graph.nodes:
        n.meta["custom"] = {"autopar_origin": n.name}
    program.local = got
    rec.log.append("spliced")


def _record(rec: _Record, program) -> str:
    why = _random(program.graph)
    if why:
        return why
    if any(n.op == "get_attr" for n in program.local.graph.nodes):
        return "the per-rank program reads attributes"
    rec.g3 = copy_graph(program.graph)
    lg = copy_graph(program.local.graph)
    rec.l3 = tc.graph_module(program.local, lg)
    rec.roles = list(program.outputs)
    return ""


def _random(graph: fx.Graph) -> str:
    """Why a graph is not spliced for its dropout, or "": localize draws each training dropout's mask
    from a key made of its node's name (autopar/dropout.py) and bakes it into the per-rank program, so
    a copy would reuse depth 3's key. Other seeded ops are copied as a trace lays them out (the same
    ops in the same order: the splice's test compares them), and SDPA, tagged seeded for its
    ``dropout_p``, is deterministic at 0: torch's ``nondeterministic_seeded`` tag is too wide here."""
    if any(n.target is torch.ops.aten.native_dropout.default for n in graph.nodes):
        return "a dropout (its mask is keyed by its node's name)"
    return ""


def _same_impl(a, b) -> bool:
    if a is b:
        return True
    if a is None or b is None or getattr(a, "__code__", None) is not getattr(b, "__code__", 0):
        return False
    ca, cb = a.__closure__ or (), b.__closure__ or ()
    if len(ca) != len(cb) or a.__defaults__ != b.__defaults__:
        return False
    for x, y in zip(ca, cb):
        p, q = x.cell_contents, y.cell_contents
        if callable(p) and hasattr(p, "__code__"):
            if not _same_impl(p, q):
                return False
        elif isinstance(p, fx.Node) or isinstance(q, fx.Node) or type(p) is not type(q) or not bool(p == q):
            return False
    return True


def _same_rule(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.name == b.name and a.inputs == b.inputs and a.outputs == b.outputs and _same_impl(a.impl, b.impl)


def _placed_map(rec: _Record, program, layers: int):
    """key -> the deep placed graph's node, where it is depth 3's with block 1 repeated; else why not."""
    path, gd = rec.path, program.graph
    g3 = list(rec.g3.nodes)
    label = _labels(rec.g3, path, KEEP)
    if label is None:
        return "depth 3's placed graph has nodes of no block it can name"

    sh = Shift(g3, label, layers, lambda n: info(n).role, path)
    if sh.why:
        return f"depth 3's placed graph: {sh.why}"
    deep = [n for n in gd.nodes if n.op != "output"]
    out: dict = {}
    k = 0
    for x, j, src in sh.order():
        if k >= len(deep):
            return "the deeper placed graph has fewer nodes than depth 3's with block 1 repeated"
        y = deep[k]
        k += 1
        why = _differs(x, y, j, src, sh, out, path)
        if why:
            return f"the deeper placed graph's {y.name} is not depth 3's {x.name} as block {j}: {why}"
        out[(x, j)] = y
    if k != len(deep):
        return "the deeper placed graph has more nodes than depth 3's with block 1 repeated"
    want = sh.outputs(list(g3[-1].args[0]), rec.roles, path)
    if isinstance(want, str):
        return want
    got = list(next(n for n in reversed(gd.nodes) if n.op == "output").args[0])
    if len(got) != len(want) or [r for _, r in want] != list(program.outputs):
        return "the outputs differ"
    for (v, _r), g in zip(want, got):
        if (out[v] if isinstance(v, tuple) else v) is not g:
            return "the outputs differ"
    return sh, out


def _differs(x, y, j, src, sh, out, path) -> str:
    if x.op != y.op:
        return "op"
    if x.op == "placeholder":
        rx, ry = info(x).role, info(y).role
        if rx is None or ry is None or rx[0] != ry[0] or \
                (_renamed(str(rx[1]), path, src, j) if src is not None else rx[1]) != ry[1]:
            return "role"
    elif x.target != y.target:
        return "target"
    else:
        bad = []

        def same(p, q):
            if isinstance(p, fx.Node) or isinstance(q, fx.Node):
                if not (isinstance(p, fx.Node) and isinstance(q, fx.Node) and out.get(sh.read(p, j, src)) is q):
                    bad.append(1)
            elif isinstance(p, (list, tuple)):
                if type(p) is not type(q) or len(p) != len(q):
                    bad.append(1)
                else:
                    for a, b in zip(p, q):
                        same(a, b)
            elif isinstance(p, dict):
                if not isinstance(q, dict) or p.keys() != q.keys():
                    bad.append(1)
                else:
                    for kk in p:
                        same(p[kk], q[kk])
            elif type(p) is not type(q) or p != q:
                bad.append(1)
        same(x.args, y.args)
        same(x.kwargs, y.kwargs)
        if bad:
            return "arguments"
    if _shape(x.meta.get("val")) != _shape(y.meta.get("val")):
        return "shape"
    ix, iy = info(x), info(y)
    if ix.has_spec != iy.has_spec or (ix.has_spec and ix.spec != iy.spec):
        return "placements"
    if ix.wants != iy.wants:
        return "wanted placements"
    if not _same_rule(ix.rule, iy.rule):
        return "rule"
    if ix.seq_dim != iy.seq_dim:
        return "sequence dim"
    return ""


_SUFFIX = re.compile(r"_\d+$")


def splice_local(rec: _Record, program, ctx, annotate):
    """The per-rank program of ``program`` (a deeper depth's, after collectives) spliced from the
    record, or why not (module docstring); ``annotate``: localize's ``_annotate_collectives``."""

    why = _random(program.graph)
    if why:
        return why
    deep_label = _labels(program.graph, rec.path, 10 ** 6)
    if deep_label is None:
        return "the deeper placed graph has nodes of no block it can name"
    layers = max(deep_label.values(), default=-1) + 1
    got = _placed_map(rec, program, layers)
    if isinstance(got, str):
        return got
    gsh, gmap = got
    # depth 3's per-rank program, each node labelled with its global node's block
    by_name = {n.name: n for n in rec.g3.nodes}
    lnodes = list(rec.l3.graph.nodes)
    origin3, label = {}, {}
    ph3 = iter([n for n in rec.g3.nodes if n.op == "placeholder"])  # make_fx's inputs, in their order
    for n in lnodes:
        if n.op == "output":
            continue
        o = next(ph3, None) if n.op == "placeholder" else \
            by_name.get((n.meta.get("custom") or {}).get("autopar_origin", ""))
        if o is None:
            return f"depth 3's per-rank {n.name} names no node of its placed graph"
        origin3[n] = o
        if o in gsh.label:
            label[n] = gsh.label[o]

    sh = Shift(lnodes, label, layers, lambda n: info(origin3[n]).role, rec.path)
    if sh.why:
        return f"depth 3's per-rank program: {sh.why}"
    # storages: depth 3's (node, position) owning each, in order
    owner: dict = {}
    for n in lnodes[:-1]:
        for pos, t in _tensors(n.meta.get("val")):
            owner.setdefault(storage_key(t), (n, pos))
    fake = next((t.fake_mode for n in lnodes for _, t in _tensors(n.meta.get("val")) if hasattr(t, "fake_mode")), None)
    if fake is None:
        return "depth 3's per-rank program holds no fake values"
    g = fx.Graph()
    new: dict = {}
    bases: dict = {}  # (deep node, owning output position) -> a tensor on the deep program's storage
    ph = 0
    with fake:
        for n, j, src in sh.order():
            key = (n, j)
            if n.op == "placeholder":
                m = g.placeholder(f"arg{ph}_1")
                ph += 1
            else:
                args = fx.map_arg(n.args, lambda a: new[sh.read(a, j, src)])
                kwargs = fx.map_arg(n.kwargs, lambda a: new[sh.read(a, j, src)])
                m = g.create_node(n.op, n.target, args, kwargs, _SUFFIX.sub("", n.name))
            meta = {k: v for k, v in n.meta.items() if k != "autopar"}
            o = origin3[n]
            gnode = gmap[(o, j if o in gsh.label else None)]
            if "custom" in n.meta:
                meta["custom"] = {**n.meta["custom"], "autopar_origin": gnode.name}
            if src is not None and j != src:
                for mk in ("nn_module_stack", "fwd_nn_module_stack"):
                    st = n.meta.get(mk)
                    if st:
                        meta[mk] = {k: (_renumber(v[0], rec.path, j, src), *v[1:]) if isinstance(v, tuple) else v
                                    for k, v in st.items()}
            meta["val"] = _fresh(n, key, j, src, sh, owner, bases, new)
            m.meta = meta
            new[key] = m
    out_node = lnodes[-1]
    want = sh.outputs(list(out_node.args[0]), rec.roles, rec.path)
    if isinstance(want, str):
        return f"depth 3's per-rank program: {want}"
    out = g.output([new[v] if isinstance(v, tuple) else v for v, _ in want])
    out.meta = dict(out_node.meta)
    annotate(g, {n.name: n for n in program.graph.nodes}, ctx)
    return tc.graph_module(rec.l3, g)


def _tensors(val):
    if isinstance(val, torch.Tensor):
        yield 0, val
    elif isinstance(val, (list, tuple)):
        for pos, t in enumerate(val):
            if isinstance(t, torch.Tensor):
                yield pos, t


def _fresh(n, key, j, src, sh, owner, bases, new):
    """``n``'s fake value as deep node ``key``'s: its own storages where it is a copy, aliased as
    depth 3's are (a view of an argument: of that argument's deep node's storage)."""
    val = n.meta.get("val")
    if not any(True for _ in _tensors(val)):
        return val
    outs = list(val) if isinstance(val, (list, tuple)) else [val]
    for pos, t in _tensors(val):
        sid = storage_key(t)
        o, opos = owner[sid]
        base = None
        if o is not n:  # a view: of an argument's storage (its deep node's), else of the storage's first node's
            for a in n.all_input_nodes:
                hit = next((q for q, u in _tensors(a.meta.get("val")) if storage_key(u) == sid), None)
                if hit is not None:
                    base = dict(_tensors(new[sh.read(a, j, src)].meta["val"]))[hit]
                    break
            if base is None:
                okey = sh.read(o, j, src)
                base = dict(_tensors(new[okey].meta["val"]))[opos]
        elif key[1] == sh.canon(n):
            continue  # depth 3's own node: its own value
        else:  # a copy's own storage (one per storage: outputs of ``n`` sharing one share the copy's)
            base = bases.get((key, opos))
            if base is None:
                s = t.untyped_storage().nbytes()
                if s % t.element_size():
                    raise ValueError(f"{n.name}'s storage holds {s} bytes, not whole {t.dtype} elements")
                base = bases[(key, opos)] = torch.empty((s // t.element_size(),), dtype=t.dtype, device=t.device)
        if storage_key(base) == sid:
            continue  # depth 3's storage: the value as it is
        if base.dtype != t.dtype:
            raise ValueError(f"{n.name} views a {base.dtype} storage as {t.dtype}")
        outs[pos] = base.as_strided(t.shape, t.stride(), t.storage_offset())
    return type(val)(outs) if isinstance(val, (list, tuple)) else outs[0]
