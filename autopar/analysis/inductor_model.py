"""A per-rank program as ``compile(inductor=True)`` runs it: which of its values Inductor makes
buffers, so that the cost model's liveness (peak memory) and roofline (bytes moved) count those
alone.

The runtime (autopar/runtime/inductor.py) cuts the program into ``segments``, runs of nodes it
hands to Inductor, and leaves the rest (``opaque``: collectives, waits, random and custom ops,
attention, a gradient bucket's ``cat``) as calls; both sides use the definitions here. Inside a
segment each op is first decomposed with Inductor's own table (``_to_copy`` into a cast,
``_log_softmax`` into amax / sub / exp / sum / log / sub, SiLU into exp and a division,
``embedding_dense_backward`` into an accumulating index-put...), then every op of the
decomposition is one of:

- a view: no data, the value of its base;
- an extern kernel (a matmul, attention: an op with a FLOP formula, autopar/analysis/ops.py): its
  inputs are buffers, its output is one;
- a reduction (sum, mean, amax...): its output is a buffer (Inductor realises reductions), its
  input is computed inside it, never stored;
- a scatter, an index-put, a concatenation, and any other op with no pointwise tag: its output
  is a buffer, its inputs computed inside;
- elementwise (ATen's pointwise tag, casts, constants, gathers): no buffer of its own. Its
  consumers compute it where they read it, from the buffers it reads ("reads"), as Inductor
  inlines a pointwise value into each of its users. It is stored (a buffer) where Inductor
  realises it: read outside its segment; read by an extern kernel; read by several ops when its
  expression reads more than ``reuse_reads`` buffers, has more than ``opcount`` ops, or (CPU)
  uses exp / log / sigmoid / tanh; or when it has accumulated more than ``acc_reads`` reads.
  (torch/_inductor/graph.py and ir.py ``should_realize_on_reuse``; the thresholds per device
  are read from Inductor's config, ``thresholds``.)

A value stored this way is recomputed wherever it is not: in a joint forward+backward segment an
elementwise activation the backward reads is recomputed there from the buffers it reads, which
then live until the backward (Inductor's choice inside one graph; which activations the joint
program keeps at all is autopar's, before Inductor).

The kernels that store values are then fused as Inductor's scheduler fuses them (``_fuse``:
producer and consumer first, then kernels that read the same buffer; same loop size, no cycle;
scatters and index-puts alone): a buffer only its fused kernel reads is never allocated, and the
fused kernel's bytes are what it reads from outside and writes for outside. A fused kernel's
output writes over a same-sized buffer of its segment that dies at it (``inplace_buffers``;
segment inputs are never reused), and a dead buffer is held until a later allocation of its
segment with its size takes it over (the generated code's ``# reuse``, ``_pooled``).

Not modelled: where the scheduler places a fused kernel beyond "where its first kernel ran",
fusions across loop shapes (a reduction into a pointwise of its output's size), and Triton's
reduction strategies (persistent, split), which change bytes and launches, not buffers.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from autopar import torch_compat as tc
from autopar.analysis.liveness import (CATEGORIES, ProgramMemory, _storages, categorize, reduces_in_place,
                                      summarize)
from autopar.analysis.ops import flop_formula, is_view, val_bytes

aten = torch.ops.aten
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int, aten.permute.default,
         aten.expand.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
         aten.squeeze.default, aten.detach.default, aten.alias.default, aten.reshape.default,
         aten.split.Tensor, aten.as_strided.default, operator.getitem}


# ------------------------------------------------------------------------------------ segments
def opaque(n: fx.Node) -> bool:
    """Whether node ``n`` stays a Python call of the stitched program (never compiled)."""
    if n.op != "call_function":
        return True
    t = n.target
    if t is operator.getitem:
        return False
    if not isinstance(t, tc.OpOverload) or t.namespace not in ("aten", "prims"):
        return True  # collectives, waits, autopar's custom ops (dropout masks, kernels), Python functions
    if torch.Tag.nondeterministic_seeded in t.tags or t._schema.is_mutable:
        return True
    if t is aten.cat.default and any(reduces_in_place(u) for u in n.users):
        return True  # a gradient bucket: guarded.py fills last step's buffer and reduces it in place
    return False


def segments(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Maximal runs of compilable nodes in program order (a getitem joins its producer's side)."""
    runs, cur, members = [], [], set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] not in members:
            ok = False
        else:
            ok = not opaque(n)
        if ok:
            cur.append(n)
            members.add(n)
        elif cur:
            runs.append(cur)
            cur, members = [], set()
    if cur:
        runs.append(cur)
    return runs


def boundary(run: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(inputs, outputs) of a segment: the values it reads from outside, those read outside it."""
    inside = set(run)
    inputs: list[fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    return inputs, [n for n in run if any(u not in inside for u in n.users)]


def compiled_segments(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The segments the runtime compiles: not views alone, something read outside, tensors across."""
    out = []
    for run in segments(gm):
        inputs, outputs = boundary(run)
        if all(n.target in VIEWS for n in run) or not outputs:
            continue
        if all(isinstance(a.meta.get("val"), torch.Tensor) for a in inputs + outputs):
            out.append(run)
    return out


# ------------------------------------------------------------------------------------ decomposition
@dataclass(frozen=True)
class Thresholds:
    """When Inductor stores an elementwise value (torch/_inductor/config.py defaults)."""
    reuse_reads: int = 4  # realize_reads_threshold
    opcount: int = 30  # _realize_opcount_threshold_default (CPU: realize_cpu_opcount_threshold)
    acc_reads: int = 8  # _realize_acc_reads_threshold_default (CPU: realize_cpu_acc_reads_threshold)
    heavy_on_reuse: bool = False  # CPU: a reused value computed with a transcendental op is stored


# torch 2.13's defaults, taken where this torch's Inductor config lacks a name (``thresholds``)
DEFAULT_THRESHOLDS = {"gpu": Thresholds(), "cpu": Thresholds(4, 50, 12, True)}


def thresholds(device: str) -> Thresholds:
    """Inductor's realize thresholds on ``device`` ("gpu" / "cpu") as this process's Inductor config
    has them (its defaults, or what the user set), read as torch/_inductor/ir.py reads them: an
    explicit ``realize_*_threshold`` wins, else the CPU or the default one."""
    d = DEFAULT_THRESHOLDS[device]
    cfg = tc.find("inductor_config", None)
    if cfg is None:
        return d
    cpu = device == "cpu"

    def pick(name: str, fallback: int) -> int:
        v = getattr(cfg, f"realize_{name}_threshold", None)
        if v is None:
            v = getattr(cfg, f"realize_cpu_{name}_threshold" if cpu else f"_realize_{name}_threshold_default", None)
        return fallback if v is None else int(v)
    return Thresholds(int(getattr(cfg, "realize_reads_threshold", d.reuse_reads)), pick("opcount", d.opcount),
                      pick("acc_reads", d.acc_reads), d.heavy_on_reuse)
HEAVY = {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}
REDUCTIONS = {"amax", "amin", "argmax", "argmin", "prod", "any", "all", "var", "var_mean", "std", "logsumexp"}
LAZY = {"full", "scalar_tensor", "iota", "arange", "embedding", "gather", "index", "clone", "convert_element_type",
        "_to_copy", "where", "empty_like", "zeros_like", "ones_like", "full_like"}
INDEXED_WRITES = {"scatter", "scatter_add", "scatter_reduce", "index_put", "_unsafe_index_put", "index_add",
                  "index_copy", "_unsafe_masked_index_put_accumulate", "_index_put_impl"}
_DECOMPOSED: dict = {}


def _meta_key(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type)
    return repr(v)


def _decomposition(n: fx.Node) -> fx.GraphModule | None:
    """Node ``n``'s op decomposed with Inductor's table on fake tensors of its inputs' shapes (cached
    by op and shapes), or None when the table leaves it whole. Matmuls stay whole: Inductor's
    table decomposes a few small or CPU-only cases, which depend on the device it runs on."""
    table = tc.select_decomp_table()
    if n.target not in table or flop_formula(n.target) is not None or not all(isinstance(a.meta.get("val"), torch.Tensor) for a in n.all_input_nodes):
        return None
    args = fx.node.map_aggregate((n.args, n.kwargs), lambda a: _meta_key(a.meta["val"]) if isinstance(a, fx.Node) else a)
    key = (n.target, repr(args))
    if key in _DECOMPOSED:
        return _DECOMPOSED[key]
    from torch.fx.experimental.proxy_tensor import make_fx

    order = n.all_input_nodes
    mode = tc.FakeTensorMode()
    with mode:
        fakes = [torch.empty_strided(a.meta["val"].shape, a.meta["val"].stride(), dtype=a.meta["val"].dtype,
                                     device="meta" if a.meta["val"].device.type == "meta" else "cpu") for a in order]

    def call(*ts):
        env = dict(zip(order, ts))
        a, k = fx.node.map_arg((n.args, n.kwargs), lambda x: env[x])
        return n.target(*a, **k)

    try:
        gm = make_fx(call, decomposition_table=table, tracing_mode="fake")(*fakes)
    except Exception:  # noqa: BLE001 - a decomposition that cannot run on these shapes: the op stays whole
        gm = None
    ops = [m for m in gm.graph.nodes if m.op == "call_function"] if gm is not None else []
    if len(ops) == 1 and ops[0].target is n.target:
        gm = None
    _DECOMPOSED[key] = gm
    return gm


def expanded(gm: fx.GraphModule) -> tuple[fx.Graph, dict, dict]:
    """``gm``'s graph with the ops of its compiled segments decomposed as Inductor decomposes them:
    (graph, node -> the original node it comes from, node -> its segment's number or None)."""
    seg_of = {n: i for i, run in enumerate(compiled_segments(gm)) for n in run}
    g = fx.Graph()
    env: dict = {}
    parent: dict = {}
    seg: dict = {}

    def add(new, orig, val):
        new.meta = {"val": val}
        parent[new], seg[new] = orig, seg_of.get(orig)
        return new

    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem and isinstance(env.get(n.args[0]), list):
            env[n] = env[n.args[0]][n.args[1]]
            continue
        sub = _decomposition(n) if n in seg_of else None
        multi = isinstance(n.meta.get("val"), (list, tuple))
        if sub is not None and multi and any(u.target is not operator.getitem for u in n.users):
            sub = None
        if sub is None:
            env[n] = add(g.node_copy(n, lambda a: env[a]), n, n.meta.get("val"))
            continue
        local = dict(zip([m for m in sub.graph.nodes if m.op == "placeholder"], [env[a] for a in n.all_input_nodes]))
        for m in sub.graph.nodes:
            if m.op == "call_function":
                local[m] = add(g.node_copy(m, lambda a: local[a]), n, m.meta.get("val"))
            elif m.op == "output":
                res = m.args[0]
                env[n] = [local[r] for r in res] if multi else local[res[0] if isinstance(res, (list, tuple)) else res]
    return g, parent, seg


# ------------------------------------------------------------------------------------ buffers
def _name(t) -> str:
    return getattr(getattr(t, "overloadpacket", t), "__name__", str(t))


def _is_view(n: fx.Node) -> bool:
    return n.target is operator.getitem or is_view(n.target)


def _kind(n: fx.Node) -> str:
    """view / extern / reduction / stored (a scatter, a concatenation...) / lazy (elementwise)."""
    t = n.target
    if _is_view(n):
        return "view"
    if not isinstance(t, tc.OpOverload) or flop_formula(t) is not None:
        return "extern"
    name = _name(t)
    if torch.Tag.reduction in t.tags or name in REDUCTIONS or t in (aten.max.dim, aten.min.dim):
        return "reduction"
    if torch.Tag.pointwise in t.tags or name in LAZY:
        return "lazy"
    return "stored"


@dataclass
class Buffers:
    """The buffers of one per-rank program as Inductor runs it (``plan``)."""
    graph: fx.Graph
    parent: dict  # node of ``graph`` -> node of the program
    stored: dict = field(default_factory=dict)  # node -> position where its buffer is written
    base: dict = field(default_factory=dict)  # view -> the node whose value it is
    reads: dict = field(default_factory=dict)  # lazy node -> buffers its expression reads
    kernels: list = field(default_factory=list)  # (node, position, bytes read + written, buffers read)
    extern: set = field(default_factory=set)  # extern kernels and ops left as calls
    last: dict = field(default_factory=dict)  # buffer -> last position read
    same: dict = field(default_factory=dict)  # buffer -> the buffer whose memory it reuses (in place)
    events: list = field(default_factory=list)  # (buffer, position, the kernel reading it or None)
    groups: list = field(default_factory=list)  # kernels fused into one ([nodes], position)
    seg: dict = field(default_factory=dict)  # node -> its compiled segment's number (None: a call)


def plan(gm: fx.GraphModule, device: str = "gpu") -> Buffers:
    """Which values of ``gm`` Inductor stores, where, and which it recomputes (module docstring);
    ``device``: "gpu" or "cpu" (Inductor's thresholds differ: ``thresholds``)."""
    th = thresholds(device)
    g, parent, seg = expanded(gm)
    b = Buffers(g, parent, seg=seg)
    nodes = list(g.nodes)
    # positions: node k runs at 2k + 1; a value its inputs need stored is computed at 2k, just
    # before it (its kernel reads what it reads there, not while node k runs)
    pos = {n: 2 * i + 1 for i, n in enumerate(nodes)}
    ops: dict = {}  # lazy -> (op count, heavy)
    seg_end: dict = {}
    for n in nodes:
        if seg.get(n) is not None:
            seg_end[seg[n]] = pos[n] + 1

    def root(x):
        while x in b.base:
            x = b.base[x]
        return x

    def read_set(x) -> set:
        r = root(x)
        return set(b.reads[r]) if r in b.reads else {r}

    def store(x, at):
        r = root(x)
        if r in b.reads:
            reads = b.reads.pop(r)
            b.stored[r] = at
            b.kernels.append((r, at, 0, reads))
            b.events += [(y, at, r) for y in reads]

    def read(x, at):
        b.events += [(y, at, None) for y in read_set(x)]

    def inside(u, n):
        return u.op != "output" and seg.get(u) is not None and seg.get(u) == seg.get(n)

    for n in nodes:
        i = pos[n]
        if n.op == "placeholder":
            b.stored[n] = i
            continue
        if n.op == "output":
            for a in n.all_input_nodes:
                store(a, i - 1)
                read(a, i)
            continue
        compiled = seg.get(n) is not None
        if compiled and _is_view(n) and n.args and isinstance(n.args[0], fx.Node):
            b.base[n] = n.args[0]
            continue
        if not compiled and n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) \
                and ("wait_tensor" in str(n.target) or reduces_in_place(n) or _is_view(n)):
            b.base[n] = n.args[0]  # the same storage (liveness.py folds these too)
            read(n.args[0], i)
            continue
        kind = _kind(n) if compiled else "extern"  # a call left outside the compiled code: an extern
        if kind == "extern":
            for a in n.all_input_nodes:
                store(a, i - 1)
                read(a, i)
            b.stored[n] = i
            b.extern.add(n)
            continue
        reads = set().union(*[read_set(a) for a in n.all_input_nodes]) if n.all_input_nodes else set()
        if kind in ("reduction", "stored"):
            b.stored[n] = i
            b.kernels.append((n, i, 0, reads))
            b.events += [(y, i, n) for y in reads]
            continue
        count = 1 + sum(ops.get(root(a), (0, False))[0] for a in n.all_input_nodes)
        heavy = _name(n.target) in HEAVY or any(ops.get(root(a), (0, False))[1] for a in n.all_input_nodes)
        b.reads[n], ops[n] = reads, (count, heavy)
        users = len(n.users)
        if users > 1 and (count > th.opcount or len(reads) > th.reuse_reads or (th.heavy_on_reuse and heavy)):
            store(n, i)
        elif len(reads) > th.acc_reads:
            store(n, i)
        elif any(not inside(u, n) for u in n.users):
            store(n, seg_end[seg[n]])  # a segment's output: stored when the segment's graph ends
    _fuse(b, seg)
    _in_place(b, seg)
    return b


def _numel(v) -> int:
    return sum(t.numel() for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor))


def _loop(k: fx.Node) -> tuple[int, int | None]:
    """A kernel's iteration: (elements it loops over, elements it reduces to: None if pointwise)."""
    out = _numel(k.meta.get("val"))
    if _kind(k) != "reduction":
        return out, None
    return max((_numel(a.meta.get("val")) for a in k.all_input_nodes), default=out), out


def _fuse(b: Buffers, seg: dict) -> None:
    """Inductor's scheduler fusion, greedily in program order: first vertically (a kernel joins
    the group of a kernel whose output it reads), then horizontally (a group joins an earlier
    one that reads a buffer it reads), as Inductor fuses the pairs that share the most bytes
    first (a producer and its consumer share the producer's output). Groups fuse when they are in
    the same segment and loop over as many elements (reductions: to as many), and everything the
    later one reads is written when the earlier one runs (no cycle). A scatter or an index-put
    writes its buffer by index: a kernel alone, its buffer always allocated. The group runs where its
    first kernel ran; a buffer only the group reads is never allocated; the group reads each
    outside buffer once and writes the buffers read outside it. Sets ``groups``, ``kernels``
    (one per group: bytes read + written), ``last``; drops the buffers never allocated from
    ``stored``."""
    def fits(g, h) -> bool:
        if g["alone"] or h["alone"]:
            return False
        same_loop = g["seg"] == h["seg"] and g["size"] == h["size"] and (None in (g["red"], h["red"])
                                                                          or g["red"] == h["red"])
        return same_loop and all(y in g["out"] or b.stored.get(y, 0) < g["at"] for y in h["reads"] - h["out"])

    def merge(g, h) -> None:
        g["nodes"] += h["nodes"]
        g["out"] |= h["out"]
        g["reads"] |= h["reads"]
        g["red"] = g["red"] if h["red"] is None else h["red"]

    groups: list[dict] = []
    for k, at, _, reads in b.kernels:
        size, red = _loop(k)
        h = {"seg": seg.get(k), "size": size, "red": red, "out": {k}, "reads": set(reads), "at": at, "nodes": [k],
             "alone": _name(k.target) in INDEXED_WRITES}
        g = next((g for g in groups if reads & g["out"] and fits(g, h)), None)
        if g is None:
            groups.append(h)
        else:
            merge(g, h)
    merged: list[dict] = []
    for h in groups:
        g = next((g for g in merged if (h["reads"] - h["out"]) & (g["reads"] - g["out"]) and fits(g, h)), None)
        if g is None:
            merged.append(h)
        else:
            merge(g, h)
    groups = merged
    of = {k: g for g in groups for k in g["nodes"]}
    readers: dict = {}
    for y, at, r in b.events:
        readers.setdefault(y, []).append(r)
    b.kernels, b.groups = [], []
    for g in groups:
        inner = {k for k in g["out"] if all(r is not None and of.get(r) is g for r in readers.get(k, ()))}
        for k in g["out"]:
            if k in inner:
                b.stored.pop(k, None)
            else:
                b.stored[k] = g["at"]
        outside = g["reads"] - g["out"]
        moved = sum(val_bytes(y.meta.get("val")) for y in outside)
        moved += sum(val_bytes(k.meta.get("val")) for k in g["out"] - inner)
        b.kernels.append((g["nodes"][0], g["at"], moved, outside))
        b.groups.append((g["nodes"], g["at"]))
    for y, at, r in b.events:
        if r is not None and r in of:
            if y in of[r]["out"]:
                continue
            at = of[r]["at"]
        b.last[y] = max(b.last.get(y, 0), at)


def _in_place(b: Buffers, seg: dict) -> None:
    """A generated kernel's output written over a buffer of its segment that it reads last
    (same size; not the segment's input): Inductor's in-place reuse."""
    taken = set()
    for (nodes, at), (_, _, _, reads) in zip(b.groups, b.kernels):
        k = next((k for k in nodes if k in b.stored and _kind(k) != "reduction"), None)
        if k is None:
            continue
        size = val_bytes(k.meta.get("val"))
        for y in sorted(reads, key=lambda y: y.name):
            if (y not in taken and y in b.stored and y.op != "placeholder" and seg.get(y) is not None
                    and seg.get(y) == seg.get(k) and b.last.get(y) == at and b.stored[y] < at
                    and val_bytes(y.meta.get("val")) == size and _dtype(y) == _dtype(k)):
                b.same[k] = y
                taken.add(y)
                break


def _dtype(n):
    return getattr(n.meta.get("val"), "dtype", None)


def _pooled(b: Buffers, live: dict) -> None:
    """Inductor's buffer reuse inside a compiled segment: a buffer the segment allocated is not
    freed after its last read when a later allocation of the same segment has its size and dtype;
    that allocation takes it over (the generated code's ``bufN = bufM  # reuse``; the most recently
    freed first), so the memory stays held from the one's write to the other's last read."""
    events = []
    for n, (first, last, nbytes, _, _) in live.items():
        s = b.seg.get(n)
        if s is not None and n.op != "placeholder":
            events.append((first, 1, n, s))
            events.append((last + 1, 0, n, s))
    pool: dict = {}
    owner: dict = {}  # buffer -> the record now holding its memory
    ends = {}
    for n in live:
        s = b.seg.get(n)
        if s is not None:
            ends[s] = max(ends.get(s, 0), live[n][1])
    for at, kind, n, s in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 0:  # freed: pooled if its segment is still running (a later allocation may take it)
            r = owner.get(n, n)
            if at <= ends[s] and r in live and live[r][1] + 1 == at:
                pool.setdefault((s, live[r][2], _dtype(r)), []).append(r)
            continue
        free = pool.get((s, live[n][2], _dtype(n)))
        if free:
            r = free.pop()
            live[r][1] = max(live[r][1], live.pop(n)[1])
            owner[n] = r


def memory(gm: fx.GraphModule, inputs, outputs, device: str = "gpu", held: frozenset = frozenset()) -> ProgramMemory:
    """``liveness.program_memory`` over the buffers Inductor allocates (``plan``): each alive from
    where it is written to its last read (an unread one dies at once), parameters and ``held``
    values excluded, in-place reuse folded."""
    b = plan(gm, device)
    cats = categorize(gm, inputs, outputs)
    placeholders = [n for n in b.graph.nodes if n.op == "placeholder"]
    skip = {n for n, (kind, _) in zip(placeholders, inputs) if kind == "param"}
    skip |= {n for n in b.stored if b.parent[n].name in held}
    nodes = list(b.graph.nodes)
    slots = 2 * len(nodes) + 1
    live: dict = {}
    for n, first in b.stored.items():
        if n in skip:
            continue
        nbytes = sum(dict(_storages(n.meta.get("val"))).values())
        if nbytes == 0:
            continue
        last = max(first, b.last.get(n, first))
        live[n] = [first, last, nbytes, cats.get(b.parent[n].name, "activations"), b.parent[n].name]
    for k, y in b.same.items():
        if k in live and y in live:
            live[y][1] = max(live[y][1], live.pop(k)[1])
    _pooled(b, live)
    delta = [dict.fromkeys(CATEGORIES, 0) for _ in range(slots + 1)]
    for first, last, nbytes, cat, _ in live.values():
        delta[first][cat] += nbytes
        delta[last + 1][cat] -= nbytes
    out = ProgramMemory()
    cur = dict.fromkeys(CATEGORIES, 0)
    at_peak = 0
    for i in range(slots):
        n = nodes[min(i // 2, len(nodes) - 1)]
        for c in CATEGORIES:
            cur[c] += delta[i][c]
            out.max_by[c] = max(out.max_by[c], cur[c])
        total = sum(cur.values())
        out.curve[b.parent[n].name] = max(out.curve.get(b.parent[n].name, 0), total)
        out.by_node.append(dict(cur))
        out.peak_without_grads = max(out.peak_without_grads, total - cur["grads_in_flight"])
        if total > out.peak:
            out.peak, out.at_peak, out.peak_node, at_peak = total, dict(cur), b.parent[n].name, i
    return summarize(out, live, at_peak if out.by_node else None)
