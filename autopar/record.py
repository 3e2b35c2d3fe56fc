"""A light recorder of the ATen ops a function runs on fake tensors: localize's trace.

``make_fx(f, tracing_mode="fake")`` builds its graph through proxies: each op pays for a proxy
object, pytree flattening, a tracker per tensor, constant propagation and a metadata snapshot,
more than the fake tensor's own dispatch costs (localize's trace of a 4-layer Llama on dp x tp:
0.6-0.7 s, of which the ops on fake tensors are 0.2 s). What localize traces needs none of it:
static shapes, no autograd, every input a fake tensor it made. ``record(fn, example)`` runs
``fn`` on fake tensors of the example's shapes under a dispatch mode, entered in make_fx's slot of
the mode stack, that appends each ATen op to an FX graph as it runs: the graph make_fx makes (tests/test_record.py compares the two node
for node, their values' shapes, strides and dtypes and the metadata autopar reads, on the test
models' plans).

As make_fx does: an op with a tensor subclass argument (a DTensor) is left to the subclass,
whose ops on its local tensors are recorded then; an op whose CompositeImplicitAutograd kernel
autograd would have run is decomposed (torch's own test of it); ``lift_fresh`` is recorded as
``lift_fresh_copy`` of a constant kept on the module (``_tensor_constant0``...); each node is named
by its op and copies the fields of fx_traceback's current meta make_fx's tracer copies (stack
trace, ``custom``, ``nn_module_stack``, ``from_node``...; ``original_aten`` the outermost op);
``val`` is a detached snapshot of the op's fake output; the table from tensors to nodes is weak. Not as
make_fx does: a data-dependent op (``.item()``) raises (make_fx burns small constants in), and a
fake tensor the trace did not see made raises; a functional collective or wait seen before on
operands of the same metadata gets fresh outputs made to the metadata it gave then, without its
fake kernel (``_SEEN``: torch's fake tensor cache keeps ATen ops only); the graph has no ``tensor_meta`` or ``seq_nr``
(nothing after localize reads them; Inductor re-traces each program it compiles). A torch without
one of the names it reads through the boundary (``_NEEDS``) traces with make_fx, as
``AUTOPAR_RECORD=make_fx`` does.
"""

from __future__ import annotations

import copy
import operator
import os

import torch
import torch.fx.traceback as fx_traceback
from torch import fx
from torch.utils.weak import WeakTensorKeyDictionary

from autopar import torch_compat as tc

_NOT_DECOMPOSED = {torch.ops.aten.size.default, torch.ops.aten.stride.default,
                   torch.ops.aten.storage_offset.default}
# the fields of the replayed node's meta each recorded node gets: torch's tracer's list (make_fx
# copies those), this copy of torch 2.13's where a torch has none; original_aten is set per op below
_FIELDS = ("nn_module_stack", "torch_fn", "source_fn_stack", "recompute", "ac_graph_id", "has_backward_hook",
           "from_node", "quantization_tag", "_numeric_debug_handle", "custom", "partitioner_tag")


class RecordError(RuntimeError):
    """An op the recorder does not record as make_fx would (an internal error of localize)."""


_NEEDS = ("autograd_would_have_decomposed", "TorchDispatchMode", "fast_detach", "dispatch_mode_key",
          "get_dispatch_mode")


def available() -> bool:
    """Whether ``record`` is used: not with ``AUTOPAR_RECORD=make_fx``, nor on a torch without
    the names it needs, nor inside another proxy trace (make_fx's: the recorder takes its place
    on the dispatch mode stack); then localize traces with make_fx: the same graph, slower."""
    return os.environ.get("AUTOPAR_RECORD", "") != "make_fx" and all(tc.has(n) for n in _NEEDS) \
        and tc.find("get_dispatch_mode")(tc.find("dispatch_mode_key").PROXY) is None


def record(fn, example: list[torch.Tensor]) -> fx.GraphModule:
    """``fn(*fakes)`` recorded as a GraphModule whose placeholders are ``fakes`` (fake tensors of the
    example's shapes, strides, dtypes and devices, made here) and whose output is what ``fn``
    returns (a list of tensors and Nones)."""
    graph = fx.Graph()
    root = torch.nn.Module()
    mode = tc.FakeTensorMode()
    rec = _recorder_class()(graph, root, mode)
    fakes = []
    for i, x in enumerate(example):
        with mode:
            f = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        node = graph.placeholder(f"arg{i}_1")  # (make_fx's names)
        node.meta["val"] = rec.snapshot(f)
        rec.track(f, node)
        fakes.append(f)
    with mode, rec:
        out = fn(*fakes)
    graph.output([rec.node_of(o) if isinstance(o, torch.Tensor) else o for o in out])
    return tc.graph_module(root, graph)


_CLASS: list = []


def _recorder_class():
    """The dispatch mode (made on first use: its base class is read through the boundary)."""
    if _CLASS:
        return _CLASS[0]
    would_decompose = tc.find("autograd_would_have_decomposed")
    detached = tc.find("fast_detach")
    fake_tensor = tc.FakeTensor
    fields = tuple(f for f in tc.find("copy_meta_fields", _FIELDS) if f != "original_aten")

    class Recorder(tc.find("TorchDispatchMode")):
        """Entered where make_fx's proxy mode would be (torch's PROXY slot of the dispatch mode
        stack, above the fake tensor mode): what torch keeps out of proxy traces
        (``disable_proxy_modes_tracing``: DTensor running an op on fake tensors of global shapes to
        learn its output's metadata, the device mesh's own bookkeeping) is kept out of this one."""

        @classmethod
        def is_infra_mode(cls) -> bool:
            return True

        def __init__(self, graph: fx.Graph, root: torch.nn.Module, fake_mode):
            super().__init__()
            self._mode_key = tc.find("dispatch_mode_key").PROXY
            self.graph, self.root, self.fake_mode = graph, root, fake_mode
            # weak, as make_fx's tracker: a factory op's output that Python still holds when it returns
            # is detached by torch's binding (``make_variable``), an op more in the graph
            self.nodes = WeakTensorKeyDictionary()
            self.outer = None  # the op whose dispatch is under way (its decomposition's ops name it)
            self.constants = 0

        def track(self, t: torch.Tensor, node: fx.Node) -> None:
            self.nodes[t] = node

        def node_of(self, t: torch.Tensor) -> fx.Node:
            hit = self.nodes.get(t)
            if hit is not None:
                return hit
            if isinstance(t, fake_tensor):
                raise RecordError(f"internal: a fake tensor of shape {tuple(t.shape)} and dtype {t.dtype} that the "
                                  "trace did not see made reached an op; report it, and meanwhile set "
                                  "AUTOPAR_RECORD=make_fx (localize then traces with make_fx)")
            # a real tensor (torch.tensor(...)'s, lifted): a constant on the module, as make_fx keeps it
            name = f"_tensor_constant{self.constants}"
            self.constants += 1
            setattr(self.root, name, t)
            node = self.graph.get_attr(name)
            # a fake of its own: the fake mode's memo of ``t`` is what lifting it returns, and the
            # lifted copy does not share the constant's storage
            with self.fake_mode:
                node.meta["val"] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            self.track(t, node)
            return node

        def _arg(self, a):
            if isinstance(a, torch.Tensor):
                return self.node_of(a)
            if isinstance(a, (list, tuple)):
                return type(a)(self._arg(x) for x in a)
            if isinstance(a, dict):
                return {k: self._arg(v) for k, v in a.items()}
            return a

        def _node(self, target, args, kwargs, name: str, original) -> fx.Node:
            node = self.graph.create_node("call_function", target, args, kwargs, name=name)
            if not fx_traceback.has_preserved_node_meta():  # (make_fx copies nothing then)
                return node
            current = fx_traceback.get_current_meta()
            meta = node.meta
            for k in fields:
                if k in current:
                    meta[k] = copy.copy(current[k])
            meta["original_aten"] = original
            trace = current.get("stack_trace")
            if trace:
                node.stack_trace = trace
            return node

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(t is not fake_tensor and t is not torch.Tensor for t in types):
                return NotImplemented  # a DTensor: its dispatch runs the op on local tensors, recorded then
            if func is torch.ops.prim.device.default:
                return func(*args, **kwargs)
            outer = self.outer is None
            if outer:
                self.outer = func
            try:
                return self._dispatch(func, args, kwargs)
            finally:
                if outer:
                    self.outer = None

        def _dispatch(self, func, args, kwargs):
            if func not in _NOT_DECOMPOSED and would_decompose(func, _flat(args, kwargs)):
                with self:
                    r = func.decompose(*args, **kwargs)
                if r is not NotImplemented:
                    return r
            if torch.Tag.data_dependent_output in func.tags:
                raise RecordError(f"internal: {func} reads a tensor's value while localizing; report it, and "
                                  "meanwhile set AUTOPAR_RECORD=make_fx (localize then traces with make_fx)")
            if func is torch.ops.aten.lift_fresh.default:
                func = torch.ops.aten.lift_fresh_copy.default
            # the node made before the op runs, as make_fx makes it: an op that raises (a view the
            # strides refuse, retried by localize on a copy) has used its name
            node = self._node(func, self._arg(args), self._arg(kwargs), _op_name(func), self.outer)
            try:
                out = self._run(func, args, kwargs)
            except BaseException:
                self.graph.erase_node(node)
                raise
            if isinstance(out, (list, tuple)):
                node.meta["val"] = type(out)(self.snapshot(o) for o in out)
                for i, o in enumerate(out):  # (make_fx's getitem for each tensor, in order)
                    if isinstance(o, torch.Tensor):
                        item = self._node(operator.getitem, (node, i), {}, "getitem", self.outer)
                        item.meta["val"] = node.meta["val"][i]
                        self.track(o, item)
            else:
                node.meta["val"] = self.snapshot(out)
                if isinstance(out, torch.Tensor):
                    self.track(out, node)
            return out

        def _run(self, func, args, kwargs):
            """``func(*args, **kwargs)`` on the fake tensors; a functional collective or wait
            (``_c10d_functional``) seen before on operands of the same metadata gets fresh outputs
            of the metadata it gave then (``_SEEN``), without its fake kernel."""
            if func.namespace != "_c10d_functional":
                return func(*args, **kwargs)
            key = _key(func, args, kwargs)
            known = _SEEN.get(key) if key is not None else None
            if known is not None:
                with self.fake_mode:
                    return _made(known)
            out = func(*args, **kwargs)
            if key is not None and key not in _SEEN:  # (None kept too: an output not to make afresh)
                if len(_SEEN) >= _SEEN_MAX:
                    _SEEN.clear()
                _SEEN[key] = _described(out, _flat(args, kwargs))
            return out

        def snapshot(self, t):
            """The value as it is now, as make_fx keeps it: another tensor object of the same fake
            value (an in-place op's later changes do not show in it, and the op's output is left
            with no other Python reference: see ``nodes``)."""
            return detached(self.fake_mode, t) if isinstance(t, fake_tensor) else t

    _CLASS.append(Recorder)
    return Recorder


# A functional collective's (or wait's) fake kernel is not in the fake tensor cache (torch caches
# ATen ops only): about 1 ms a call, against 0.5 ms for an ATen op, a fifth of a localize of Llama
# on dp x tp (152 of them: the collectives and their waits). Its outputs are fresh tensors whose
# metadata follows from the operands' metadata and the op's other arguments (sizes, group names),
# so the recorder keeps what each such call gave, keyed by those (``_key``), and later calls get
# fresh fake tensors made to it. An output that is not a fresh, contiguous-from-zero tensor of its
# own storage (a view, an operand returned) is not kept: that call runs the kernel every time.
_SEEN: dict = {}
_SEEN_MAX = 4096


def _key(func, args, kwargs):
    def one(a):
        if isinstance(a, torch.Tensor):
            shape = tuple(a.shape)
            if not all(type(d) is int for d in shape):
                raise TypeError  # (a symbolic size: not kept)
            return ("tensor", shape, a.stride(), a.dtype, str(a.device), a.storage_offset(), a.requires_grad)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(one(x) for x in a))
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format)):
            return a
        raise TypeError  # (anything else: not kept)

    try:
        return func, one(args), tuple(sorted((k, one(v)) for k, v in kwargs.items()))
    except TypeError:
        return None


def _described(out, operands):
    """What ``_made`` makes ``out`` from, or None (an output not to make afresh)."""
    from autopar.analysis.liveness import storage_key

    storages = {storage_key(t) for t in operands if isinstance(t, torch.Tensor)}

    def one(t):
        if not isinstance(t, torch.Tensor) or t.storage_offset() != 0 or t.requires_grad:
            raise TypeError
        key = storage_key(t)
        if key in storages or t.untyped_storage().nbytes() != _extent(t) * t.element_size():
            raise TypeError  # (an operand returned, a view, an over-allocated storage)
        storages.add(key)
        return tuple(t.shape), t.stride(), t.dtype, t.device

    try:
        return (type(out), tuple(one(t) for t in out)) if isinstance(out, (list, tuple)) else ("tensor", one(out))
    except TypeError:
        return None


def _extent(t: torch.Tensor) -> int:
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0


def _made(known):
    kind, what = known
    if kind == "tensor":
        return torch.empty_strided(what[0], what[1], dtype=what[2], device=what[3])
    return kind(torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in what)


def _flat(args, kwargs) -> list:
    out = []

    def walk(a):
        if isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)
        else:
            out.append(a)

    walk(args)
    walk(kwargs)
    return out


def _op_name(func) -> str:
    """make_fx's node name for an op: its packet's name, a magic method's without its underscores."""
    name = func.overloadpacket.__name__
    return name[2:-2] if name.startswith("__") and name.endswith("__") else name
