"""A per-process cache of the three traces a compile starts with: the dynamo capture of model +
loss, the AOTAutograd joint graph, and the forward-only export. Together they are about 70% of a
warm compile of a small model (Llama-tiny under fsdp: 3.2 of 4.6 s), and they do not depend on
the plan: compiling the same model again under another plan or mesh (a test suite, a planner
trying plans, ``autopar.verify`` then ``compile``) reuses them.

The key is checked, not assumed: a model's fingerprint is every module's class (by identity),
every attribute of every module that is not a tensor slot, walked into configs and containers
(functions and other objects by identity, held alive by the entry so their ids cannot be reused),
every parameter's and buffer's shape / dtype / stride / device / requires_grad and which of them
are the same tensor (tied weights), every buffer's and tensor attribute's VALUES (a trace may
bake a value into the graph as a constant), the loss function (by identity, its closure by
value), the example inputs' shapes / dtypes / strides, the compute dtype and the few global
switches a trace reads (default dtype, grad mode, deterministic algorithms). A joint graph is
keyed by the torch-level graph's own text, the tensors its attributes name and the inputs. An
object the fingerprint cannot see into makes the compile trace afresh (no entry), never a guess.

A hit hands out a COPY: a fresh graph (node names, metadata and autopar's NodeInfo records
copied; fake values shared, they are read-only) bound to the NEW model's parameters and buffers,
so later passes rewrite their own program and train the new model's tensors.

``AUTOPAR_CAPTURE_CACHE=0`` switches it off; ``clear()`` empties it; ``STATS`` counts hits and
misses per kind (the tests read it).
"""

from __future__ import annotations

import contextvars
import copy
import enum
import functools
import hashlib
import os
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from autopar import disk_cache as disk
from autopar import torch_compat as tc
from autopar import trace_share as share

_SIZE = 8  # entries kept per kind (least recently used dropped)
_DEPTH = 8  # how deep the fingerprint walks into attribute objects before it gives up (no caching)
STATS: dict[str, int] = {}


_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_capture_cache_off", default=False)


def enabled() -> bool:
    return not _OFF.get() and os.environ.get("AUTOPAR_CAPTURE_CACHE", "1") not in ("0", "false", "off")


def bypassed():
    """No lookups and no entries inside (this thread / context): for a caller that traces each
    model once (``autopar plan`` of one rank), where keying a graph and keeping a copy of it cost
    0.05-0.1 s a compile and nothing would ever read them."""
    from autopar.scoped import setting

    return setting(_OFF, True)


def used():
    """Lookups and entries inside even where ``bypassed`` (``autopar plan``'s depths: the deeper
    ones capture the shallowest's blocks again)."""
    from autopar.scoped import setting

    return setting(_OFF, False)


class _Unkeyable(Exception):
    """The fingerprint met something it cannot compare by value or identity: trace afresh."""


@dataclass
class _Entry:
    value: Any
    refs: list = field(default_factory=list)  # objects keyed by identity, kept alive with the entry


_CACHES: dict[str, OrderedDict] = {"capture": OrderedDict(), "joint": OrderedDict(), "forward": OrderedDict()}


def clear() -> None:
    for c in _CACHES.values():
        c.clear()
    STATS.clear()


def _lookup(kind: str, key):
    c = _CACHES[kind]
    e = c.get(key)
    if e is not None:
        c.move_to_end(key)
    what = f"{kind}_{'hit' if e is not None else 'miss'}"
    STATS[what] = STATS.get(what, 0) + 1
    return e


def _store(kind: str, key, entry: _Entry) -> None:
    c = _CACHES[kind]
    c[key] = entry
    while len(c) > _SIZE:
        c.popitem(last=False)


# ---- fingerprints ------------------------------------------------------------------------------

_SKIP = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


class _Fingerprint:
    def __init__(self):
        self.refs: list = []
        self.memo: dict[int, Any] = {}
        self.tensor_ids: dict[int, int] = {}  # tensor identity -> first index (ties are part of the key)

    def ident(self, obj) -> tuple:
        self.refs.append(obj)
        return ("id", type(obj).__qualname__, id(obj))

    def tensor(self, t: torch.Tensor, values: bool) -> tuple:
        # (by description and value, not identity: an entry keeps no tensor of the model alive)
        tie = self.tensor_ids.setdefault(id(t), len(self.tensor_ids))
        meta = (tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad, tie,
                tuple(t.stride()) if t.layout == torch.strided else str(t.layout), type(t).__name__)
        if values and t.device.type != "meta" and t.layout == torch.strided:
            data = t.detach().contiguous().cpu()
            if data.dtype == torch.bfloat16:  # numpy has no bf16: hash its bit pattern
                data = data.view(torch.int16)
            meta += (hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest(),)
        return ("tensor",) + meta

    def value(self, obj, depth: int = 0):
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return (type(obj).__name__, repr(obj))
        if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)):
            return (type(obj).__name__, str(obj))
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, values=True)
        if isinstance(obj, nn.Module):  # a module held outside the module tree: by identity
            return self.ident(obj)
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                            types.ModuleType, tc.OpOverload, tc.OpOverloadPacket)):
            fp = self.ident(getattr(obj, "__func__", obj))
            if isinstance(obj, types.MethodType):
                fp += (self.value(obj.__self__, depth + 1),)
            if isinstance(obj, types.FunctionType) and obj.__closure__:
                fp += tuple(self.value(c.cell_contents, depth + 1) if _filled(c) else ("empty",)
                            for c in obj.__closure__)
            return fp
        if isinstance(obj, functools.partial):
            return ("partial", self.value(obj.func, depth + 1), self.value(obj.args, depth + 1),
                    self.value(obj.keywords, depth + 1))
        if depth > _DEPTH:
            raise _Unkeyable(type(obj).__qualname__)
        if id(obj) in self.memo:
            return self.memo[id(obj)]
        self.memo[id(obj)] = ("cycle", id(obj))
        if isinstance(obj, (list, tuple)):
            out = (type(obj).__name__, tuple(self.value(x, depth + 1) for x in obj))
        elif isinstance(obj, (set, frozenset)):  # (ordered by their text; kept as values: disk_cache names them)
            out = (type(obj).__name__, tuple(sorted((self.value(x, depth + 1) for x in obj), key=repr)))
        elif isinstance(obj, dict):
            out = (type(obj).__name__, tuple(sorted(((self.value(k, depth + 1), self.value(v, depth + 1))
                                                     for k, v in obj.items()), key=lambda kv: repr(kv[0]))))
        elif hasattr(obj, "__dict__"):
            attrs = vars(obj)
            own = _own_hash(obj, attrs)
            if own:
                attrs = {k: v for k, v in attrs.items() if k not in own}
            out = ("object", self.ident(type(obj)), self.value(attrs, depth + 1))
        else:
            raise _Unkeyable(type(obj).__qualname__)
        self.memo[id(obj)] = out
        return out

    def module(self, root: nn.Module) -> tuple:
        out = []
        for name, m in root.named_modules(remove_duplicate=False):
            attrs = tuple(sorted((k, self.value(v, 1)) for k, v in vars(m).items() if k not in _SKIP))
            params = tuple((k, None if p is None else self.tensor(p, values=False)) for k, p in m._parameters.items())
            bufs = tuple((k, None if b is None else self.tensor(b, values=True),
                          k in m._non_persistent_buffers_set) for k, b in m._buffers.items())
            out.append((name, self.ident(type(m)), attrs, params, bufs))
        return tuple(out)


def _own_hash(obj, attrs: dict) -> set[str]:
    """The attributes of ``obj`` that hold its own hash (Hugging Face's GenerationConfig keeps one
    to tell whether it was changed): the rest of the object decides them, and a hash of strings
    differs from process to process, so they are left out of the key. Only where ``obj`` hashes
    by content: an identity hash stays in (and keys nothing across processes)."""
    big = [k for k, v in attrs.items() if type(v) is int and abs(v) >= 1 << 32]
    if not big or type(obj).__hash__ in (None, object.__hash__):
        return set()
    try:
        h = hash(obj)
    except Exception:  # noqa: BLE001 - unhashable after all: nothing left out
        return set()
    return {k for k in big if attrs[k] == h}


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _globals() -> tuple:
    autocast = tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda"))
    return (str(torch.get_default_dtype()), str(torch.get_default_device()), torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled(), autocast)


def _inputs(fp: _Fingerprint, inputs) -> tuple:
    return tuple(fp.tensor(x, values=False) if isinstance(x, torch.Tensor) else fp.value(x) for x in inputs)


def module_key(kind: str, module: nn.Module, inputs, *extra):
    """(key, refs), or None when something in the model cannot be fingerprinted."""
    fp = _Fingerprint()
    try:
        key = (kind, fp.module(module), _inputs(fp, inputs), tuple(fp.value(x) for x in extra), _globals())
    except Exception:  # noqa: BLE001 - _Unkeyable, or a tensor subclass that cannot be read: no entry
        return None
    return key, fp.refs


# ---- copies bound to a new model ---------------------------------------------------------------

def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A fresh graph with the same nodes (names kept), metadata copied one level down and
    autopar's NodeInfo records copied (passes write into them)."""
    from autopar.ir import NodeInfo

    g = fx.Graph()
    g._codegen = copy.deepcopy(graph._codegen)
    remap: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        new = g.node_copy(n, lambda x: remap[x])
        rec = new.meta.get("autopar")
        if isinstance(rec, NodeInfo):
            new.meta["autopar"] = copy.copy(rec)
        remap[n] = new
    return g


def _tensors_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


@dataclass
class _GraphModuleTemplate:
    graph: fx.Graph
    attrs: dict[str, tuple[str, Any]]  # get_attr target -> ("model", name under the wrapper) | ("const", tensor)
    meta: dict
    extra: dict  # _in_spec / _out_spec / shape_env


def gm_template(gm: fx.GraphModule, wrapper: nn.Module) -> _GraphModuleTemplate | None:
    names = {id(t): n for n, t in _tensors_by_name(wrapper).items()}
    attrs = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or n.target in attrs:
            continue
        t = _get(gm, n.target)
        if not isinstance(t, torch.Tensor):
            return None  # a submodule or other object: not rebindable
        attrs[n.target] = ("model", names[id(t)]) if id(t) in names else ("const", t.detach().clone())
    extra = {k: gm.__dict__[k] for k in ("_in_spec", "_out_spec", "shape_env") if k in gm.__dict__}
    return _GraphModuleTemplate(copy_graph(gm.graph), attrs, dict(gm.meta), extra)


def gm_from_template(t: _GraphModuleTemplate, wrapper: nn.Module) -> fx.GraphModule:
    tensors = _tensors_by_name(wrapper)
    root = {target: (tensors[v] if kind == "model" else v) for target, (kind, v) in t.attrs.items()}
    gm = tc.graph_module(root, copy_graph(t.graph))
    gm.meta.update(t.meta)
    gm.__dict__.update(t.extra)
    return gm


def _get(mod, target: str):
    for part in target.split("."):
        mod = getattr(mod, part, None)
    return mod


def program_copy(template, model: nn.Module):
    """A cached Program for ``model``: its own graph, the model's buffers read from ``model`` by
    name (constants the trace created keep their cached value)."""
    from autopar.ir import Program

    bufs = dict(model.named_buffers(remove_duplicate=False))
    buffers = {n: bufs[n] if v is None else v for n, v in template.buffers.items()}
    return Program(graph=copy_graph(template.graph), inputs=list(template.inputs), outputs=list(template.outputs),
                   buffers=buffers)


def program_template(program, model: nn.Module):
    """What the cache keeps of a Program: a graph nobody else will rewrite, and the trace's own
    constants; the model's buffers by name only (an entry keeps no tensor of the model alive)."""
    from autopar.ir import Program

    own = dict(model.named_buffers(remove_duplicate=False))
    buffers = {n: None if n in own and v is own[n] else v for n, v in program.buffers.items()}
    return Program(graph=copy_graph(program.graph), inputs=list(program.inputs), outputs=list(program.outputs),
                   buffers=buffers)


def graph_key(gm: fx.GraphModule, model: nn.Module, inputs, *extra):
    """A joint graph's key: the torch-level graph's text, the model tensors its attributes are
    (by the model's names, with shapes and dtypes), constants by value, the inputs."""
    names = {id(t): n for n, t in _tensors_by_name(model).items()}
    fp = _Fingerprint()
    try:
        attrs = []
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                t = _get(gm, n.target)
                if not isinstance(t, torch.Tensor):
                    return None
                attrs.append((n.target, names.get(id(t)), fp.tensor(t, values=id(t) not in names)))
        # (a Python function the graph calls, or an operator of a user's (also as a higher-order op's
        # argument): its code decides the joint graph, the text names it only)
        called = tuple(fp.value(t) for n in gm.graph.nodes if n.op == "call_function"
                       for t in (n.target, *n.args, *n.kwargs.values())
                       if isinstance(t, types.FunctionType) or not disk.own_op(t))
        key = ("joint", str(gm.graph), tuple(attrs), called, _inputs(fp, inputs), tuple(fp.value(x) for x in extra),
               _globals())
    except Exception:  # noqa: BLE001 - as module_key
        return None
    return key, fp.refs


def cached(kind: str, keyed: Callable[[], Any], build: Callable[[], Any], template: Callable[[Any], Any],
           restore: Callable[[Any], Any]):
    """``build()`` on a miss (its result stored as ``template(result)``), ``restore(stored)`` on a
    hit; ``keyed()``: (key, refs) or None (do not cache), computed only when the cache is on."""
    keyed = keyed() if enabled() else None
    if keyed is None:
        return build()
    key, refs = keyed
    e = _lookup(kind, key)
    on_disk = disk.key_of(key, refs) if e is None and disk.directory() is not None else None
    if on_disk is not None:  # (another process's trace: autopar/disk_cache.py)
        got = disk.load(kind, on_disk)
        if got is not None:
            e = _Entry(got, refs)
            _store(kind, key, e)
    # between ranks (autopar/trace_share.py): the leader says which trace this is and shares its
    # copy; another rank without one waits for it instead of tracing
    peers = share.active() if kind in share.KINDS else None
    slot = share.slot(peers, kind) if peers is not None else None
    announced = share.announce(peers, slot, key, refs) if peers is not None and peers.leader else None
    if e is not None:
        if announced is not None:
            share.publish(peers, announced, e.value)
        return restore(e.value)
    if peers is not None and not peers.leader:
        got = share.follow(peers, slot, key, refs)
        if got is not None:
            _store(kind, key, _Entry(got, refs))
            STATS[f"{kind}_shared"] = STATS.get(f"{kind}_shared", 0) + 1
            return restore(got)
    try:
        out = build()
    except BaseException:
        if announced is not None:
            share.publish(peers, announced, None)  # (the others trace, and raise, for themselves)
        raise
    kept = template(out)
    if kept is not None:
        _store(kind, key, _Entry(kept, refs))
        disk.save(kind, on_disk, kept)
    if announced is not None:
        share.publish(peers, announced, kept)
    return out
