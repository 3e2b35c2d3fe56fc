"""The torch boundary: every private torch name autopar reads, and every change it makes to torch.

Supported: torch 2.11 to 2.13 (``SUPPORTED``). Nothing here is imported from torch when autopar is
imported: a name is looked up on first use, by ``_lookup`` (the one place that reads torch's
private namespace), with feature detection. Where a name is missing, ``PRIVATE`` says what
autopar does instead; where nothing can stand in, using the feature raises ``TorchVersionError``
(a PlanError) naming the running torch. tests/test_torch_compat.py hides each name in turn;
tests/test_layout.py fails on a private torch import (or ``torch._x`` use) anywhere else.

Private names: ``PRIVATE`` below, each with what autopar needs it for and what it does without it;
docs/architecture.md ("The torch boundary's names") has them as a table with the versions that lack
some, and the names autopar chose not to read.

Changes to torch's process-wide state (autopar/scoped.py's rules: in force only while autopar's step
runs, seen only by the thread that runs it), all made here: DTensor's strategy selector
(``strategy_selector``: choosing from DTensor's list in autopar would re-implement what
``propagate_op_sharding_non_cached`` does after the choice, which differs by version), the view split
fix (``fixed_views``), export's constraint check and dynamo's debug-log function names
(``static_export``) and compiled-function globals
(``no_compiled_fn_globals``), nll_loss's AutogradMeta kernel on meta (``dispatcher_kernel``),
``nn.Module.register_parameter`` (``register_parameter_hook``); with public API only,
``nn.Module.__setattr__`` during a capture (``autopar.scoped.buffer_assignments``). One is seen by
every thread while a compile traces, being a module-level flag torch reads: the lazy GraphModule
switch (``lazy_tracers``), which changes when another thread's new GraphModules generate their code
(at their first call), not what they do.

Not counted as private: ``torch.ops.<namespace>.<op>`` (the dispatcher's op registry, e.g.
``torch.ops._c10d_functional``, ``aten._to_copy``) and attributes of objects autopar holds
(``._schema``, ``._parameters``, ``graph._codegen``, ``DTensor._local_tensor``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from autopar.errors import TorchVersionError
from autopar.scoped import SharedPatch, setting

SUPPORTED = ("2.11", "2.13")  # the oldest and the newest torch minor version autopar is tested on


def torch_version() -> str:
    return torch.__version__


def unavailable(what: str, needed_for: str, since: str | None = None) -> TorchVersionError:
    """The error for a missing private torch name nothing stands in for (``since``: the first torch with it)."""
    lo, hi = SUPPORTED
    return TorchVersionError(
        f"{needed_for} needs torch's {what}, which torch {torch_version()} does not have",
        where="autopar/torch_compat.py",
        fix=f"use torch {since} to {hi}" if since else f"use a torch from {lo} to {hi} (autopar's supported range)")


@dataclass(frozen=True)
class Private:
    module: str
    attr: str | None  # a dotted path inside ``module``; None: the module itself
    needed_for: str
    fallback: str | None = None  # what autopar does without it; None: TorchVersionError

    @property
    def what(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


_DT = "torch.distributed.tensor"
_FE = "torch._dynamo.functional_export"
_VIEW = f"{_DT}._ops._view_ops._ViewShardingPropagator"
_GP = "torch.fx._graph_pickler"
PRIVATE: dict[str, Private] = {
    "dynamo_graph_capture_for_export": Private(_FE, "_dynamo_graph_capture_for_export", "capturing a model"),
    "constraint_check": Private(_FE, "_suggest_or_raise_constraint_violation", "a fast capture",
                                "torch's constraint check runs"),
    "functional_export": Private(_FE, None, "freeing a capture's compiled-function globals", "they are kept"),
    "get_funcname": Private("torch._dynamo.symbolic_convert", "get_funcname", "a fast first capture",
                            "dynamo names each traced line's function for its debug log"),
    "assert_async": Private("torch", "_assert_async", "checking a model's assert on a tensor's value",
                            "such a model is not captured"),
    "dynamo_config": Private("torch._dynamo", "config", "capturing an assert on a tensor's value",
                             "such a model is not captured"),
    "aot_export_joint_with_descriptors": Private("torch._functorch.aot_autograd", "aot_export_joint_with_descriptors",
                                                 "the joint forward+backward trace"),
    "aot_descriptors": Private("torch._functorch._aot_autograd.descriptors", None, "naming the traced graph's inputs"),
    "FakeTensorMode": Private("torch._subclasses.fake_tensor", "FakeTensorMode", "fake-tensor tracing"),
    "FakeTensor": Private("torch._subclasses.fake_tensor", "FakeTensor", "fake-tensor tracing"),
    "reparametrize_module": Private("torch.nn.utils.stateless", "_reparametrize_module",
                                    "a mixed-precision generation step"),
    "library_destroy": Private("torch.library", "Library._destroy", "removing a dispatcher registration",
                               "dropped with its last reference"),
    "c_nn": Private("torch._C._nn", None, "recognising torch.nn.functional's builtins", "torch.nn.functional's"),
    "select_min_cost_strategy": Private(f"{_DT}._sharding_prop", "_select_min_cost_strategy",
                                        "autopar's choice among DTensor's strategies"),
    "op_dispatcher": Private(_DT, "DTensor._op_dispatcher", "DTensor's sharding strategies"),
    "random_ops": Private(_DT, "DTensor._op_dispatcher._random_ops", "localize's fast path", "no fast path"),
    "custom_op_handlers": Private(_DT, "DTensor._op_dispatcher._custom_op_handlers", "localize's fast path",
                                  "no fast path"),
    "DTensorSpec": Private(f"{_DT}._dtensor_spec", "DTensorSpec", "DTensor's sharding specs"),
    "TensorMeta": Private(f"{_DT}._dtensor_spec", "TensorMeta", "DTensor's sharding specs"),
    "OpSchema": Private(f"{_DT}._op_schema", "OpSchema", "asking DTensor for a strategy"),
    "compute_local_shape_and_global_offset": Private(f"{_DT}._utils", "compute_local_shape_and_global_offset",
                                                     "a shard's shape and offset"),
    "find_shard_for_split": Private(_VIEW.rpartition(".")[0], "_ViewShardingPropagator._find_shard_for_split",
                                    "the view split fix", "torch's own view propagation"),
    "expected_split_factor": Private(_VIEW.rpartition(".")[0], "_ViewShardingPropagator._expected_split_factor",
                                     "the view split fix", "torch's own view propagation"),
    "StridedShard": Private(f"{_DT}.placement_types", "_StridedShard", "strided shards",
                            "a class nothing is an instance of"),
    "TorchDispatchMode": Private("torch.utils._python_dispatch", "TorchDispatchMode", "measuring a program"),
    "autograd_would_have_decomposed": Private("torch.utils._python_dispatch", "autograd_would_have_decomposed",
                                              "localize's light trace (autopar/record.py)", "make_fx traces it"),
    "fast_detach": Private("torch._subclasses.fake_impls", "fast_detach", "localize's light trace (autopar/record.py)",
                           "make_fx traces it"),
    "dispatch_mode_key": Private("torch._C", "_TorchDispatchModeKey", "localize's light trace (autopar/record.py)",
                                 "make_fx traces it"),
    "get_dispatch_mode": Private("torch._C", "_get_dispatch_mode", "localize's light trace (autopar/record.py)",
                                 "make_fx traces it"),
    "copy_meta_fields": Private("torch.fx.proxy", "_COPY_META_FIELDS", "localize's light trace (autopar/record.py)",
                                "autopar's copy of torch 2.13's list"),
    "get_current_dispatch_mode": Private("torch.utils._python_dispatch", "_get_current_dispatch_mode",
                                         "reusing a gradient bucket's buffer", "a fresh buffer each step"),
    "has_foreach_support": Private("torch.utils._foreach_utils", "_has_foreach_support", "foreach gradient clipping",
                                   "per-tensor loops"),
    "device_has_foreach_support": Private("torch.utils._foreach_utils", "_device_has_foreach_support",
                                          "foreach gradient clipping", "per-tensor loops"),
    "foreach_norm": Private("torch", "_foreach_norm", "foreach gradient clipping", "per-tensor loops"),
    "foreach_mul_": Private("torch", "_foreach_mul_", "foreach gradient clipping", "per-tensor loops"),
    "resolve_process_group": Private("torch._C._distributed_c10d", "_resolve_process_group",
                                     "running a program's collectives"),
    "storage_use_count": Private("torch._C", "_storage_Use_Count", "reusing a gradient bucket's buffer",
                                 "a fresh buffer each step"),
    "has_kernel_for_dispatch_key": Private("torch._C", "_dispatch_has_kernel_for_dispatch_key",
                                           "counting collectives (pm.measure())"),
    "DispatchKey": Private("torch._C", "DispatchKey", "counting collectives (pm.measure())"),
    "compile_fx_inner": Private("torch._inductor.compile_fx", "compile_fx_inner", "inductor=True"),
    "select_decomp_table": Private("torch._inductor.decomposition", "select_decomp_table", "inductor=True"),
    "inductor_config": Private("torch._inductor.config", None, "the cost model's Inductor realize thresholds",
                               "torch 2.13's defaults"),
    "TracingContext": Private("torch._guards", "TracingContext", "inductor=True"),
    "tracing": Private("torch._guards", "tracing", "inductor=True"),
    "OpOverload": Private("torch._ops", "OpOverload", "telling ATen ops apart"),
    "OpOverloadPacket": Private("torch._ops", "OpOverloadPacket", "keying the capture cache",
                                "the capture cache keeps nothing (every compile traces)"),
    "WrappedCall": Private("torch.fx.graph_module", "_WrappedCall", "cloning a GraphModule's class"),
    "LazyGraphModule": Private("torch.fx._lazy_graph_module", "_LazyGraphModule", "generating a program's code once",
                               "GraphModule (its code generated again on each change)"),
    "lazy_graph_modules": Private("torch.fx._lazy_graph_module", None, "tracers' graphs generating their code when "
                                  "first run", "their code generated as they are made"),
    "mesh_flatten": Private("torch.distributed.device_mesh", "DeviceMesh._flatten", "a whole-mesh process group",
                            "a new group over the mesh's ranks"),
    **{name: Private(_GP, attr, "sharing a trace between ranks", "each rank traces for itself")
       for name, attr in (("GraphPickler", "GraphPickler"), ("GraphPicklerOptions", "Options"))},
    "default_store": Private("torch.distributed.distributed_c10d", "_get_default_store", "failures", "fake only"),
    **{name: Private("torch.distributed.distributed_c10d", attr, "plan='auto' beside a real process group (the "
                     "search's forked child forgets its parent's groups)")
       for name, attr in (("c10d_world", "_world"), ("update_default_pg", "_update_default_pg"),
                          ("unregister_all_process_groups", "_unregister_all_process_groups"))},
    "fake_pg": Private("torch.testing._internal.distributed.fake_pg", None, "fake process groups"),
    "FakeStore": Private("torch.testing._internal.distributed.fake_pg", "FakeStore", "fake process groups",
                         "a HashStore"),
}
_MISSING = object()


def _lookup(module: str, attr: str | None):
    """torch's ``module`` or the attribute ``attr`` of it; ImportError / AttributeError where this
    torch lacks it. Every private name autopar uses is read through here (nowhere else)."""
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def find(name: str, default=_MISSING):
    """``PRIVATE[name]`` from torch; ``default`` where this torch lacks it (a TorchVersionError
    if no default is given)."""
    p = PRIVATE[name]
    try:
        return _lookup(p.module, p.attr)
    except (ImportError, AttributeError):
        if default is _MISSING:
            raise unavailable(p.what, p.needed_for) from None
        return default


def has(name: str) -> bool:
    return find(name, None) is not None


class _NoStridedShard:
    """Stands in for ``_StridedShard`` on a torch without it: nothing is an instance of it."""


class _NoDispatchMode:
    """Stands in for ``TorchDispatchMode`` on a torch without it (a subclass cannot be used)."""

    def __init__(self, *args, **kwargs):
        p = PRIVATE["TorchDispatchMode"]
        raise unavailable(p.what, p.needed_for)


# names other modules read as attributes (``torch_compat.DTensorSpec``), looked up on first use
_FALLBACKS: dict[str, Any] = {"StridedShard": _NoStridedShard, "TorchDispatchMode": _NoDispatchMode}
_ATTRIBUTES = {"FakeTensorMode", "FakeTensor", "DTensorSpec", "TensorMeta", "OpSchema",
               "compute_local_shape_and_global_offset", "StridedShard", "TorchDispatchMode", "OpOverload",
               "OpOverloadPacket", "WrappedCall", "compile_fx_inner", "select_decomp_table", "TracingContext",
               "tracing", "aot_export_joint_with_descriptors", "aot_descriptors", "dynamo_graph_capture_for_export",
               "reparametrize_module"}


def __getattr__(name: str):
    if name not in _ATTRIBUTES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = find(name, _FALLBACKS.get(name, _MISSING))
    globals()[name] = value  # found once (forget() drops it again)
    return value


def forget() -> None:
    """Drop what was looked up (tests that hide a name, then show it again)."""
    for name in _ATTRIBUTES:
        globals().pop(name, None)
    _dispatcher_special.cache_clear()
    native_nn.cache_clear()


# ---------------------------------------------------------------- small helpers with fallbacks
@functools.cache
def native_nn(name: str) -> frozenset:
    """torch.nn.functional's ``name`` and the builtin behind it (``torch._C._nn``): the targets a
    traced graph (or a torch function mode) may name it by."""
    import torch.nn.functional as F

    return frozenset(f for f in (getattr(F, name, None), getattr(find("c_nn", None), name, None)) if f is not None)


def graph_module(root, graph) -> torch.fx.GraphModule:
    """``GraphModule(root, graph)`` whose code is generated when first called or read (torch's lazy
    kind, as dynamo's), not on each ``recompile()``: passes rewrite a program several times, and
    ``autopar plan`` never runs it (0.5 s of a Llama-3-8B plan went there)."""
    return find("LazyGraphModule", torch.fx.GraphModule)(root, graph)


def _lazy_tracers():
    module = find("lazy_graph_modules", None)
    if module is None or not hasattr(module, "_use_lazy_graph_module_flag"):
        return None
    prior, module._use_lazy_graph_module_flag = module._use_lazy_graph_module_flag, True
    return module, prior


# ``with lazy_tracers():`` the GraphModules torch's tracers make (make_fx's, AOTAutograd's) are its lazy
# kind, as dynamo's are: their code is made when first run or read, and autopar reads only the graphs
# of these (localize's trace, the joint one: making localize's code alone was 0.5% of the test
# suite's CPU). Counted: torch's own switch would leave its flag set after concurrent compiles.
lazy_tracers = SharedPatch(_lazy_tracers, lambda undo: undo and setattr(undo[0], "_use_lazy_graph_module_flag",
                                                                       undo[1]))


def contiguous_strides(shape) -> tuple[int, ...]:
    """A contiguous ``shape``'s strides (torch's ``make_contiguous_strides_for``: a 0 counts as 1)."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def storage_use_count(t: torch.Tensor) -> int:  # references to t's storage (C++); many if torch cannot say
    count = find("storage_use_count", None)
    return count(t.untyped_storage()._cdata) if count is not None else 1 << 30


def dispatch_mode_active() -> bool:  # whether a TorchDispatchMode is watching (True where torch cannot say)
    current = find("get_current_dispatch_mode", None)
    return current is None or current() is not None


def foreach_ok(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """clip_grad_norm_'s ``foreach`` rule: ``None``: where torch supports it; ``True``: required."""
    ok_all, ok_device = find("has_foreach_support", None), find("device_has_foreach_support", None)
    usable = None not in (ok_all, ok_device, find("foreach_norm", None), find("foreach_mul_", None))
    if foreach is None:
        return usable and ok_all(tensors, device)
    if foreach and not (usable and ok_device(device)):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return bool(foreach)


def foreach_norm(tensors, p):
    return find("foreach_norm")(tensors, p)


def foreach_mul_(tensors, c) -> None:
    find("foreach_mul_")(tensors, c)


def resolve_process_group(name: str):
    return find("resolve_process_group")(name)


def composite_kernel(func):
    """``func``'s CompositeExplicitAutograd kernel as a callable, or None if it has none."""
    key = find("DispatchKey").CompositeExplicitAutograd
    if not find("has_kernel_for_dispatch_key")(func.name(), key):
        return None
    return functools.partial(func._op_dk, key)


def whole_mesh_group(mesh):
    """A process group over every rank of ``mesh`` (collective: call on every rank)."""
    import torch.distributed as dist

    flatten = find("mesh_flatten", None)
    return flatten(mesh).get_group() if flatten is not None else dist.new_group(mesh.mesh.flatten().tolist())


def fake_store():  # a store for init_process_group("fake")
    import torch.distributed as dist

    find("fake_pg")  # (importing it registers the backend; TorchVersionError without it)
    store = find("FakeStore", None)
    return store() if store is not None else dist.HashStore()


def preload() -> None:
    """Import what every compile imports on first use (a server's workers fork after this)."""
    for module in ("torch._dynamo", "torch._functorch.aot_autograd"):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


# ---------------------------------------------------------------- DTensor's sharding propagator
def sharding_propagator():
    return find("op_dispatcher").sharding_propagator


def dtensor_knows(op) -> bool:  # whether DTensor has a strategy (or a rule) for op
    prop = sharding_propagator()
    return any(op in getattr(prop, table, {}) for table in
               ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs"))


def dtensor_schema_info(op):
    """What DTensor's dispatch passes as an OpSchema's ``schema_info`` for ``op``: ops with a
    single-dim strategy keep theirs apart (without it, list arguments such as index.Tensor's
    indices are not flattened and no strategy matches)."""
    prop = sharding_propagator()
    return (getattr(prop, "op_to_schema_info", {}).get(op)
            or getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}).get(op))


@functools.lru_cache(maxsize=1)
def _dispatcher_special() -> frozenset | None:
    random_ops, handlers = find("random_ops", None), find("custom_op_handlers", None)
    if random_ops is None or handlers is None:
        return None
    return frozenset(random_ops) | frozenset(handlers)


def dtensor_handles_itself(op) -> bool:
    """Ops DTensor's dispatcher handles itself (random ops: its RNG offsets; custom handlers:
    convolution, argmax, as_strided...); every op, where torch does not list them."""
    special = _dispatcher_special()
    return special is None or op in special


# ---------------------------------------------------------------- patches of torch
def strategy_selector(choose: Callable) -> SharedPatch:
    """While applied, DTensor's module-level ``_select_min_cost_strategy`` (which it calls with no
    hook to pass another) asks ``choose(strategy, op_schema)`` first; a None answer (every other
    caller: ``choose`` consults state only autopar's step sets) gets DTensor's own choice.
    Without the name (another torch), a TorchVersionError: DTensor's choice alone is not
    program-aware, and gave plans that localize could not run."""
    def apply():
        dtensor_select = find("select_min_cost_strategy")
        module = _lookup(PRIVATE["select_min_cost_strategy"].module, None)

        def select(strategy, op_schema=None):
            picked = choose(strategy, op_schema)
            return dtensor_select(strategy, op_schema) if picked is None else picked

        module._select_min_cost_strategy = select
        return module, dtensor_select

    return SharedPatch(apply, lambda undo: setattr(undo[0], "_select_min_cost_strategy", undo[1]))


def known_output_meta(meta_of: Callable) -> SharedPatch:
    """While applied, DTensor's sharding propagator takes an op's output ``TensorMeta`` from
    ``meta_of(op_schema)`` (a one-element tuple holding it) instead of running the op on fake
    tensors of a fresh ``FakeTensorMode``; ``meta_of`` answering None (every caller but autopar's
    propagation, which knows each output from the traced graph) gets DTensor's own. A torch whose
    propagator has no such method: nothing replaced (DTensor computes it; the same answer, slower)."""
    def apply():
        prop = sharding_propagator()
        own = getattr(type(prop), "_propagate_tensor_meta_non_cached", None)
        if own is None:
            return None

        def meta(op_schema):
            got = meta_of(op_schema)
            return own(prop, op_schema) if got is None else got[0]

        prop._propagate_tensor_meta_non_cached = meta
        return prop

    return SharedPatch(apply, lambda prop: prop and prop.__dict__.pop("_propagate_tensor_meta_non_cached", None))


def _same_split_factor(expected, actual) -> bool:
    """torch 2.13's ``_split_factor_matches`` for static shapes (2.12 compares with ``==``; 2.11: neither)."""
    if expected is None:
        return False
    try:
        return int(expected) == int(actual)
    except (TypeError, ValueError):
        return bool(expected == actual)


def _apply_split_fix():
    """torch 2.12/2.13's view propagation, unflattening a dim that one mesh axis shards plainly and
    a later one strided ([b*s] with the batch on dp and the sequence on cp -> [b, s]), matches the
    plain Shard again for the second split and never the strided one, so the strided axis is
    judged by the first split's size alone and the view refused (dp=2 x cp=4 on 2 sequences). A
    plain Shard of a flattened dim splits its leading output dim only: for the later splits it is
    skipped, inside autopar's steps (``fixed_views``); every other caller gets torch's method.
    torch 2.11 has no ``_ViewShardingPropagator``: its views are left as they are."""
    torch_find = find("find_shard_for_split", None)
    if torch_find is None or not has("expected_split_factor"):
        return None
    cls = _lookup(PRIVATE["find_shard_for_split"].module, "_ViewShardingPropagator")
    strided = find("StridedShard", _NoStridedShard)

    def find_shard(self, current_dim, cmd, placements):
        if not _VIEW_FIX.get() or cmd.split_id == 0:
            return torch_find(self, current_dim, cmd, placements)
        for mesh_dim, p in enumerate(placements):
            if (isinstance(p, strided) and p.dim == current_dim
                    and mesh_dim not in getattr(self, "matched_strided_mesh_dims", ())):
                if _same_split_factor(self._expected_split_factor(cmd, current_dim, mesh_dim, placements),
                                      p.split_factor):
                    return mesh_dim, p
        return None, None

    cls._find_shard_for_split = find_shard
    return cls, torch_find


_SPLIT_FIX = SharedPatch(_apply_split_fix, lambda undo: undo and setattr(undo[0], "_find_shard_for_split", undo[1]))
_VIEW_FIX: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_view_fix", default=False)


def views_fixed() -> bool:  # whether ``fixed_views`` fixes anything on this torch (2.12 and later)
    return has("find_shard_for_split") and has("expected_split_factor")


def fixed_views():
    """DTensor's view propagation with the split fix above, in this thread, inside the block
    (propagate's strategy choice; localize's trace, which dispatches views through DTensor)."""
    return setting(_VIEW_FIX, True, _SPLIT_FIX)


_STATIC_CAPTURE: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_static_capture", default=False)


def _apply_static_capture() -> list:  # ``static_export``'s two patches; what ``setattr`` puts back
    undo = []
    module = find("functional_export", None)
    orig = getattr(module, "_suggest_or_raise_constraint_violation", None) if has("constraint_check") else None
    if orig is not None:
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def check(*args, **kwargs):
            if _STATIC_CAPTURE.get():
                try:
                    static = sig.bind(*args, **kwargs).arguments.get("dynamic_shapes") is None
                except TypeError:  # (another torch's signature: check, as torch would)
                    static = False
                if static:
                    return None
            return orig(*args, **kwargs)

        module._suggest_or_raise_constraint_violation = check
        undo.append((module, "_suggest_or_raise_constraint_violation", orig))
    names = find("get_funcname", None)
    if names is not None:
        logs = [logging.getLogger(f"torch._dynamo.{m}.__trace_call") for m in ("output_graph", "symbolic_convert")]

        @functools.wraps(names)
        def get_funcname(*args, **kwargs):
            quiet = _STATIC_CAPTURE.get() and not any(log.isEnabledFor(logging.DEBUG) for log in logs)
            return None if quiet else names(*args, **kwargs)

        sc = _lookup(PRIVATE["get_funcname"].module, None)
        sc.get_funcname = get_funcname
        undo.append((sc, "get_funcname", names))
    return undo


# For autopar's own captures only. An export builds guards after its trace only to find violated
# constraints on dynamic dimensions; autopar's have none (0.15 s of each 3-5 block Llama-3-8B
# capture). dynamo names the function around each traced line in a debug-log header, tokenizing
# each traced file once per process (0.11 s of a HF Llama's first capture): skipped while it is off.
_STATIC_PATCHES = SharedPatch(_apply_static_capture, lambda undo: [setattr(*u) for u in undo or ()])


def static_export():
    """Inside the block, this thread's export captures skip the dynamic-shape constraint check
    when they have no dynamic shapes, and the function names of dynamo's debug-log headers
    while that log is off."""
    return setting(_STATIC_CAPTURE, True, _STATIC_PATCHES)


def scalar_outputs():
    """Inside the block, dynamo traces ``tensor.item()`` into the graph instead of stopping there
    (``capture_scalar_outputs``): a model's ``assert t.max().item() <= n`` becomes part of the
    capture (autopar/value_checks.py keeps it on the device)."""
    config = find("dynamo_config", None)
    return config.patch(capture_scalar_outputs=True) if config is not None else contextlib.nullcontext()


@contextlib.contextmanager
def no_compiled_fn_globals():
    """dynamo installs each traced frame's compiled function as a global of the frame's module
    (``__compiled_fn_<n>_<uuid>`` in torch._dynamo.functional_export for an export capture), and
    that function holds the captured GraphModule with the model's parameters: every capture kept
    its model alive for the life of the process. autopar uses the graph, never that function, so
    the globals a capture adds are removed when it ends."""
    module = find("functional_export", None)
    before = set(vars(module)) if module is not None else set()
    try:
        yield
    finally:
        if module is not None:
            for k in [k for k in vars(module) if k not in before and k.startswith("__compiled_fn")]:
                delattr(module, k)


def dispatcher_kernel(namespace: str, op: str, fn: Callable, key: str) -> SharedPatch:
    """A kernel for ``namespace::op`` under dispatch ``key`` while applied. A registration on
    torch's dispatcher is process-wide while it exists (no thread-local form), so it is made on
    the first entry and destroyed on the last exit (``Library._destroy``; without it, by dropping
    the library, whose finalizer deregisters)."""
    def apply():
        lib = torch.library.Library(namespace, "IMPL")
        lib.impl(op, fn, key)
        return [lib]

    def undo(box):
        lib = box.pop()
        if has("library_destroy"):
            lib._destroy()
        del lib

    return SharedPatch(apply, undo)


def register_parameter_hook(after: Callable) -> SharedPatch:
    """While applied, ``nn.Module.register_parameter`` calls ``after(module, name, param)`` after
    torch's own (``after`` acts only for the thread that asked for it: it consults a ContextVar)."""
    def apply():
        orig = torch.nn.Module.register_parameter

        def register_parameter(module, name, param):
            orig(module, name, param)
            after(module, name, param)

        torch.nn.Module.register_parameter = register_parameter
        return orig

    return SharedPatch(apply, lambda orig: setattr(torch.nn.Module, "register_parameter", orig))


_KEPT_GROUPS: list = []  # a forked child's inherited process groups, never destroyed there


def forget_process_groups() -> None:
    """In a forked child: c10d's registries emptied without shutting the groups down (their
    threads are the parent's; ``autopar.compile(plan="auto")`` searches on fake groups there)."""
    w, set_default, unregister_all = [find(n) for n in ("c10d_world", "update_default_pg",
                                                        "unregister_all_process_groups")]  # (all before any change)
    maps = (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag, w.tags_to_pg,
            w.pg_coalesce_state)
    _KEPT_GROUPS.append((w.default_pg, [dict(m) for m in maps]))
    set_default(None)
    for m in maps:
        m.clear()
    unregister_all()
    w.group_count = 0
