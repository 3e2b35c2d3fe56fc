"""``autopar.compile``: validate the options, run the pass list (passes/__init__.py), build the runtime.

    compile = validate -> run_pipeline(capture, lower, split, autograd, propagate, recompute,
              state, collectives, localize, overlap, schedule) -> ParallelModule | PipelineModule
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar import disk_cache, trace_share
from autopar.capture import capture_forward, forward_later
from autopar.experts import expert_plan
from autopar.errors import PlanError
from autopar.ir import CompileState
from autopar.options import CompileOptions, Options, compile_signature
from autopar.pipeline_plan import is_pipeline_strategy, pipeline_setup
from autopar.plan import Plan, parse_plan
from autopar.runtime import failure, steptimes
from autopar.scoped import paused_collector


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def _dtype_option(v, what: str):
    if v is None or isinstance(v, torch.dtype):
        return v
    if v not in _DTYPES:
        raise PlanError(f"unknown {what} {v!r}", where=f"autopar.compile({what}=...)",
                        fix='use "fp32", "bf16" or "fp16"')
    return _DTYPES[v]


def compile(model: nn.Module | Callable | None = None, mesh: DeviceMesh | None = None, **options):
    """Compile ``model`` for ``mesh`` under ``plan``; returns a ParallelModule (a PipelineModule,
    autopar/runtime/pipeline.py, when an axis's strategy is a pipeline schedule: ``{"pp": "1f1b", ...}``).

    ``precision``: "fp32", or "bf16" / "fp16" to compute in that dtype from fp32 master
    parameters (the optimizer sees fp32 parameters and gradients); ``reduce_dtype``: the dtype
    gradients are reduced in (default: the compute dtype); ``loss_scale`` (fp16 only):
    "dynamic" or a fixed scale. ``accumulate=K`` splits each global batch into K micro-batches
    and synchronises gradients once per step. ``recompute``: "none" | "full" | "selective".
    ``progress``: called with the name of each stage as it starts (the command line shows it).
    ``capture_eval``: the forward-only program (``pm(x)``) is captured on its first call (True,
    the default), at compile (``"compile"``: for a forward that creates tensor constants from
    data), or never (False: planning without running).
    ``pipeline_stages="all"`` (with a pipeline axis) also compiles the stages other ranks hold, so
    planning tools can show and cost the whole pipeline from one rank.
    ``kernels``: "on" lowers attention and linear + activation to autopar's Triton kernels
    (compiled on CUDA; on CPU through Triton's interpreter: slow), "off" keeps PyTorch's ops,
    "auto" (the default) rewrites each op only where autopar's kernel measured faster than
    PyTorch's at that op's per-rank shape on this CUDA device (timed at compile, cached per device,
    torch and Triton versions: kernels/choice.py), and keeps PyTorch's ops on other devices.
    ``pm.ctx.lowered`` counts what was rewritten, ``pm.ctx.kernel_choices`` says why, per op.
    ``bucket_mb``: gradient reductions share one collective per this many MiB of gradients, in
    backward order (DDP's bucket_cap_mb; the first bucket 1 MiB); 0: one collective per gradient
    (and per gathered parameter). ``prefetch``: under ZeRO/FSDP, each block's parameters are
    gathered in one all-gather issued this many blocks ahead of their use (FSDP2's 1); 0: where
    first used. ``reshard_after_forward`` (ZeRO-3 / fsdp, as FSDP2's): None (the default) frees
    each block's gathered parameters after its forward and gathers them again for its backward,
    but keeps the parameters outside every repeated block (embeddings, final norm, LM head)
    gathered from forward to backward, as FSDP2 does for the root; True re-gathers every
    parameter in backward; False none (one gather per step, the whole model's parameters held
    from forward to backward). Pipeline stages always re-gather. ``memory_budget``: bytes per rank
    (an int, or a string: "80GiB", "512MiB", "1.5GB"); after the passes, before the parameters are
    distributed, a rank whose predicted step peak (the cost model's ``predict_memory``: parameters +
    optimizer state (AdamW's) + the program's peak, gradients included) exceeds it raises
    ``MemoryBudgetError`` (a ``PlanError``) naming the peak, its biggest parts, the budget and what
    to do, and every other rank raises one naming that rank (autopar/analysis/budget.py).
    ``timeout``: seconds any wait of a step (a collective, a pipeline transfer) may
    block before the step fails on every rank with an error naming the rank that failed, stopped
    responding or never came (autopar/runtime/failure.py); a rank that raises in a step tells
    the others at once through the default group's c10d store, so they fail within a fraction
    of a second, not after the timeout. ``straggler_window`` / ``straggler_threshold``: every
    this many steps the ranks compare their compute times (one small all-gather), and a rank
    slower than its peers by more than this factor in the median step gets a
    ``StragglerWarning`` naming it (None: no check); ``pm.step_times()`` gathers them on request
    (autopar/runtime/steptimes.py). ``inductor=True``: each per-rank program's compute is
    compiled with Inductor (C++ on CPU) when the program is built, between its collectives and
    waits, which stay where the overlap pass put them (autopar/runtime/inductor.py); random and
    custom ops stay uncompiled. The compile seconds are ``pm.ctx.timings["inductor"]``, apart from
    the step's; ``pm.inductor`` says what was compiled.

    ``plan="auto"``: autopar chooses the plan on ``mesh`` (its axes, named among pp, dp, ep, cp,
    tp, and their sizes as given), the recompute policy (unless ``recompute`` is "selective" or "full":
    the default "none" lets the search choose) and
    ``accumulate``, by predicted step time under ``memory_budget`` (default: the device's memory),
    as ``autopar.plan`` ranks them (rank 0 searches, the others take its choice); it prints what it
    chose and why in one line, which ``pm.report()`` repeats. The device row is the mesh's (a
    CUDA device's name: h100 / h200 / a100; "cpu").

    As a decorator (``@autopar.compile(mesh=..., example_inputs=..., plan=...)``) on a model
    class or a model-building function, the class/function then returns ParallelModules.
    """
    opts = CompileOptions.of(options)  # (the keywords, their defaults and types: autopar/options.py)
    if model is None or (isinstance(model, type) or (callable(model) and not isinstance(model, nn.Module))):
        return _decorator(model, mesh, opts)
    return compile_with(model, mesh, opts)


compile.__signature__ = compile_signature([  # what help(autopar.compile) shows: model, mesh, then every option
    inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                      annotation="nn.Module | Callable | None"),
    inspect.Parameter("mesh", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation="DeviceMesh | None")])


def compile_with(model: nn.Module, mesh: DeviceMesh | None, options: CompileOptions):
    """``autopar.compile`` for callers that built their ``CompileOptions`` (the command line, the
    planner)."""
    chose = None
    if options.plan == "auto" and mesh is not None and options.example_inputs is not None:
        options, mesh, chose = _auto(model, mesh, options)
    # the traces every rank would make alike made once, on the mesh's first rank (autopar/trace_share.py)
    with trace_share.sharing(mesh, _wait_s(options.timeout)):
        try:
            state = build(model, mesh, options)
        except BaseException as e:
            # every rank learns that this one cannot compile, before anyone waits for it in the
            # first collective (distributing the parameters): autopar/runtime/failure.py
            failure.agree(e, _wait_s(options.timeout))
            raise
        pm = runtime_for(state, capture_eval=options.capture_eval)
    if chose is not None:
        pm.auto_plan = chose
    return pm


# plan="auto": the planner's entry, registered by autopar/planner/api.py when it is imported (as
# ``import autopar`` does). The planner compiles through this module, so this module does not import
# it: a hook keeps the layers one-way (tests/test_layout.py: no import cycles).
AUTO_PLANNER: Callable | None = None


def _auto(model, mesh, options: CompileOptions) -> tuple[CompileOptions, DeviceMesh, str]:
    """``plan="auto"``: the options with the search's choice on ``mesh`` (plan, recompute,
    accumulate), the mesh to compile on (made again where the search remade the process group),
    and the line that says the choice (printed on rank 0): autopar/planner/api.py ``resolve_auto``."""
    return AUTO_PLANNER(model, mesh, options)  # (set whenever autopar is imported: autopar/__init__.py imports the planner)


def _wait_s(timeout) -> float:
    return float(timeout) if isinstance(timeout, (int, float)) and 0 < timeout < math.inf else 60.0


def build(model: nn.Module, mesh: DeviceMesh, options: CompileOptions | None = None, *,
          stop_after: str | None = None, **changes) -> CompileState:
    """Validate everything that can be checked without tracing (``options``, with ``changes``: compile's
    keywords), then run the pass list (passes/__init__.py) up to ``stop_after`` (all of it by default)."""
    from autopar.passes import run_pipeline

    t0 = time.perf_counter()
    given = replace(options or CompileOptions(), **changes)
    opts, micro = validate(model, mesh, given)
    state = CompileState(model, mesh, opts, tuple(given.example_inputs), micro)
    with paused_collector(), disk_cache.noting(state.from_disk):  # (scoped.py: a trace's objects live to its end)
        state = run_pipeline(state, skip=opts.skip, debug=given.debug, stop_after=stop_after)
    state.timings["total"] = time.perf_counter() - t0
    return state


def validate(model, mesh, g: CompileOptions) -> tuple[Options, tuple]:
    """Every check that needs no trace: options, plan against mesh and model, batch against
    the data-parallel ranks and the pipeline's micro-batches. Returns the options and one
    micro-batch of the example inputs (what capture traces)."""
    from autopar.analysis.budget import parse_budget

    if mesh is None:
        raise PlanError("autopar.compile needs a mesh", fix="pass mesh=autopar.mesh(dp=2)")
    if g.example_inputs is None:
        raise PlanError("autopar.compile needs example_inputs (global shapes)",
                        fix="pass example_inputs=(tokens, targets)")
    if g.inputs not in ("global", "local"):
        raise PlanError(f"inputs must be 'global' or 'local', got {g.inputs!r}")
    compute_dtype = _dtype_option(g.precision, "precision")
    compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
    reduce = _dtype_option(g.reduce_dtype, "reduce_dtype") if g.reduce_dtype is not None else compute_dtype
    _check_numbers(g, compute_dtype, mesh)
    budget = parse_budget(g.memory_budget)
    example_inputs = tuple(g.example_inputs)
    lower = _kernels_option(g.kernels, mesh)
    if g.capture_eval not in (True, False, "compile"):
        raise PlanError(f"unknown capture_eval option {g.capture_eval!r}", where="autopar.compile(capture_eval=...)",
                        fix="True (the eval program captured on its first call), \"compile\" (at compile) or False")
    already = [n for n, p in model.named_parameters()
               if isinstance(p, DTensor) or getattr(p, "_autopar_placed", False)]
    if already:
        raise PlanError(f"the model's parameters were already placed by autopar ({already[0]}, ...): it was compiled "
                        "before, and autopar.compile replaces a module's parameters in place",
                        where="autopar.compile(model)", fix="build a fresh model (or deep-copy it) for each compile")
    plan = g.plan
    if isinstance(plan, str):
        parse_plan(plan, ())  # plan="auto" and other strings: the plan parser's error
    pp_axes = [a for a, v in (plan or {}).items() if a != "rules" and is_pipeline_strategy(v)]
    if len(pp_axes) > 1:
        raise PlanError(f"more than one pipeline axis in the plan: {pp_axes}", where="plan",
                        fix="pipeline over one mesh axis")
    pipeline = None
    if pp_axes:
        if pp_axes[0] not in (mesh.mesh_dim_names or ()):
            raise PlanError(f"plan names mesh axis {pp_axes[0]!r}, which the mesh does not have", where="plan",
                            fix=f"mesh axes are {list(mesh.mesh_dim_names)}")
        pipeline = pipeline_setup(mesh, plan, pp_axes[0], example_inputs, g.accumulate)
        parsed, m = pipeline.parsed, pipeline.microbatches
        micro = tuple(x[: x.shape[0] // m] if isinstance(x, torch.Tensor) and x.ndim > 0 else x
                      for x in example_inputs)
    else:
        parsed = parse_plan(plan, tuple(mesh.mesh_dim_names))
        micro = _micro_batch(example_inputs, g.accumulate, parsed, mesh)
    deferred = deferred_weights(model, example_inputs)
    if deferred:  # traced on meta like a planning compile; the program runs on the mesh's device
        micro = tuple(_meta_like(x) for x in micro)
    options = Options(given=g, plan=plan or {}, parsed=parsed, compute_dtype=compute_dtype, reduce_dtype=reduce,
                      loss_scale=g.loss_scale if compute_dtype == torch.float16 else None, lower=lower,
                      skip=tuple(g.skip_passes), pipeline=pipeline, memory_budget=budget, deferred=deferred,
                      timeout=float(g.timeout),
                      straggler_threshold=g.straggler_threshold and float(g.straggler_threshold))
    return options, micro


def _check_numbers(g: CompileOptions, compute_dtype, mesh) -> None:
    """The scalar options' types and ranges (a PlanError naming the option)."""
    from autopar.passes import check_names
    from autopar.passes.recompute import POLICIES

    if g.recompute not in POLICIES:
        raise PlanError(f"unknown recompute policy {g.recompute!r}", where="autopar.compile(recompute=...)",
                        fix=f"use one of {list(POLICIES)}")
    if compute_dtype == torch.float16 and not (g.loss_scale == "dynamic" or isinstance(g.loss_scale, (int, float))):
        raise PlanError(f"loss_scale must be 'dynamic' or a number, got {g.loss_scale!r}",
                        where="autopar.compile(loss_scale=...)")
    if not isinstance(g.accumulate, int) or g.accumulate < 1:
        raise PlanError(f"accumulate must be a positive int, got {g.accumulate!r}",
                        where="autopar.compile(accumulate=...)")
    check_names(g.skip_passes, "autopar.compile(skip_passes=...)")
    if type(g.bucket_mb) is bool or not isinstance(g.bucket_mb, (int, float)) or not 0 <= g.bucket_mb < math.inf:
        raise PlanError(f"bucket_mb must be a non-negative number of MiB, got {g.bucket_mb!r}",
                        where="autopar.compile(bucket_mb=...)",
                        fix="use 25 (DDP's bucket size), or 0 for one collective per gradient")
    if type(g.prefetch) is not int or g.prefetch < 0:
        raise PlanError(f"prefetch must be a non-negative int (blocks ahead), got {g.prefetch!r}",
                        where="autopar.compile(prefetch=...)",
                        fix="use 1 (FSDP2's default), 0 for none, or 2 (NCCL) for more overlap at one more block's memory")
    if type(g.timeout) is bool or not isinstance(g.timeout, (int, float)) or not 0 < g.timeout < math.inf:
        raise PlanError(f"timeout must be a positive number of seconds, got {g.timeout!r}",
                        where="autopar.compile(timeout=...)",
                        fix="use 60 (the default), more if a step can legitimately wait that long")
    threshold = g.straggler_threshold
    if threshold is not None and (type(threshold) is bool or not isinstance(threshold, (int, float))
                                  or not 1 < threshold < math.inf):
        raise PlanError(f"straggler_threshold must be a number above 1 (or None), got {threshold!r}",
                        where="autopar.compile(straggler_threshold=...)",
                        fix="use 1.2 (the default: a rank 20% slower than its peers), or None for no check")
    if type(g.straggler_window) is not int or g.straggler_window < 2:
        raise PlanError(f"straggler_window must be an int of at least 2 steps, got {g.straggler_window!r}",
                        where="autopar.compile(straggler_window=...)", fix="use 100 (the default)")
    if g.reshard_after_forward not in (None, True, False):
        raise PlanError(f"reshard_after_forward must be None, True or False, got {g.reshard_after_forward!r}",
                        where="autopar.compile(reshard_after_forward=...)",
                        fix="None (FSDP2's default: blocks re-gathered in backward, the root's parameters kept), "
                            "True (all re-gathered) or False (none)")
    if g.prefetch > 1 and _backend(mesh) == "gloo":
        # torch 2.13's functional all_gather_into_tensor corrupts the heap on gloo when two are in
        # flight on one process group (tests/test_gather.py documents the reproduction)
        raise PlanError(f"prefetch={g.prefetch} keeps {g.prefetch} parameter all-gathers in flight, which gloo's "
                        "functional all-gather does not survive (heap corruption in torch 2.13)",
                        where="autopar.compile(prefetch=...)",
                        fix="use prefetch=1 (one gather in flight, as FSDP2) on a gloo mesh")
    if type(g.inductor) is not bool:
        raise PlanError(f"inductor must be True or False, got {g.inductor!r}", where="autopar.compile(inductor=...)",
                        fix="inductor=True compiles each per-rank program's compute with Inductor; False runs it op by op")


def deferred_weights(model: nn.Module, example_inputs: tuple) -> bool:
    """Whether ``model`` was built on the meta device to be loaded after compiling
    (``pm.load_pretrained`` / ``pm.load``): its parameters are meta but the example batch is real.
    Meta parameters with a meta batch are a planning compile (the program stays on meta)."""
    params = list(model.named_parameters())
    meta = [n for n, p in params if p.is_meta]
    if not meta:
        return False
    if len(meta) < len(params):
        real = next(n for n, p in params if not p.is_meta)
        raise PlanError(f"{len(meta)} of the model's {len(params)} parameters are on the meta device ({meta[0]}, ...) "
                        f"and the others are not ({real}, ...)", where="autopar.compile(model)",
                        fix="build the whole model on meta (autopar.init_empty_weights(), or with torch.device('meta')) "
                            "and load its weights after compiling with pm.load_pretrained(path), or build it all real")
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return bool(tensors) and not all(x.is_meta for x in tensors)


def _meta_like(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") \
        if isinstance(x, torch.Tensor) and not x.is_meta else x


def _backend(mesh) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(mesh.get_group(0)))
    except Exception:  # noqa: BLE001 - no process group (planning): no backend restriction
        return ""


def _micro_batch(example_inputs: tuple, accumulate: int, parsed: Plan, mesh) -> tuple:
    """One of the ``accumulate`` micro-batches, checked against the data-parallel ranks."""
    micro = example_inputs
    if accumulate > 1:
        for i, x in enumerate(example_inputs):
            if x.ndim == 0 or x.shape[0] % accumulate:
                raise PlanError(f"input #{i} has batch size {x.shape[0] if x.ndim else 'none'}, not divisible "
                                f"by accumulate={accumulate}", where=f"example_inputs[{i}]",
                                fix="pick a global batch that is a multiple of accumulate (x the data-parallel size)")
        micro = tuple(x[: x.shape[0] // accumulate] for x in example_inputs)
    dp_axes = [i for i, a in enumerate(parsed.axes) if a.data_parallel]
    dp = math.prod(mesh.shape[i] for i in dp_axes)
    for i, x in enumerate(micro):
        if x.ndim > 0 and dp > 1 and x.shape[0] % dp:
            names = "x".join(mesh.mesh_dim_names[a] for a in dp_axes)
            raise PlanError(f"input #{i} has batch size {x.shape[0]}" + (f" per micro-batch (accumulate={accumulate})"
                            if accumulate > 1 else "") + f", which the data-parallel axes ({names}, {dp} ranks) "
                            "cannot split evenly", where=f"example_inputs[{i}]",
                            fix=f"use a global batch that is a multiple of {dp * accumulate}")
    return micro


def runtime_for(state: CompileState, capture_eval: bool = True):
    """The runtime object for a compiled state: ParallelModule (one stage) or PipelineModule."""
    from autopar import generation
    from autopar.analysis.budget import check_budget
    from autopar.runtime.common import index_checks
    from autopar.runtime.module import ParallelModule
    from autopar.runtime.pipeline import PipelineModule

    o, g = state.options, state.options.given
    forward_builder = None
    try:
        # the predicted step peak against memory_budget: before anything is distributed or run
        check_budget(state, o.memory_budget)
        checks = index_checks(state.gm, state.model)  # (before the parameters become DTensors)
        if o.pipeline is None and capture_eval:
            # the eval program: captured on the first forward call (capture.forward_later),
            # or now, while the parameters are still plain tensors (capture_eval="compile"); its
            # passes run on the first forward call either way
            ctx = state.stages[0].ctx
            fwd_inputs = state.example_inputs[:-1] if g.loss_fn is not None else state.example_inputs
            if o.deferred:
                fwd_inputs = tuple(_meta_like(x) for x in fwd_inputs)
            dropless = expert_plan(o.plan)
            if capture_eval == "compile":
                if g.progress:
                    g.progress("capture (eval forward)")
                t0 = time.perf_counter()
                fwd_program = capture_forward(state.model, fwd_inputs, o.compute_dtype, dropless=dropless)
                ctx.timings["capture_forward"] = time.perf_counter() - t0
                def fwd_capture(program=fwd_program):
                    return program
            else:
                fwd_capture = forward_later(state.model, fwd_inputs, o.compute_dtype, ctx.device, dropless)
            forward_builder = functools.partial(_eval_program, fwd_capture, ctx, g.debug, tuple(o.skip))
    except BaseException as e:
        failure.agree(e, o.timeout)
        raise
    # every rank compiled: only now the first collective (the parameters distributed)
    failure.agree(None, max(o.timeout, 2 * state.timings.get("total", 0.0)))
    if o.pipeline is not None:
        pl = o.pipeline
        rt = PipelineModule(state.model, state.mesh, pl.axis, pl.stage_mesh, pl.schedule, pl.options, state.specs,
                            state.stages, state.example_inputs, g.inputs, stage_plan=pl.parsed)
    else:
        # (the eval and generation programs' passes run later, on the first call: DTensor's answers
        # shared as in the compile, autopar/trace_share.py)
        rt = ParallelModule(state.model, state.stages[0], state.example_inputs, g.loss_fn is not None, g.inputs,
                            trace_share.later(forward_builder),
                            trace_share.later(functools.partial(generation.build, skip=o.skip, debug=g.debug)))
    rt.timeout = o.timeout
    rt.clock = steptimes.StepClock(o.straggler_threshold, g.straggler_window)
    rt.index_checks = checks
    if g.inductor:
        _compile_programs(rt)
    return _materialize_buffers(rt, o)


def _compile_programs(rt) -> None:
    """Every per-rank program of the step compiled with Inductor now, not in the first step, so
    the compile time is the compile's (``ctx.timings["inductor"]``); the eval program is
    compiled when it is built (its first call). A program on meta (planning) is not compiled."""
    from autopar.runtime.inductor import InductorStats

    ex = rt.executor
    ex.inductor = InductorStats()
    if rt.ctx.device.type == "meta":
        return
    t0 = time.perf_counter()
    for gm in ex.programs():
        ex.compiled(gm)
    rt.ctx.timings["inductor"] = time.perf_counter() - t0


def _materialize_buffers(pm, o: Options):
    """A model built on meta (``o.deferred``): its buffers on the program's device (non-persistent ones
    recomputed, persistent ones left for ``load_pretrained`` / ``load``: autopar/runtime/weights.py)."""
    if o.deferred:
        from autopar.runtime.weights import materialize_buffers

        materialize_buffers(pm)
    return pm


def _eval_program(capture: Callable, ctx, debug: bool, skip: tuple):
    """The eval program (on the first forward call): captured (``capture``), then the per-stage passes."""
    from autopar.passes import run_stage_passes

    t0 = time.perf_counter()
    program = capture()
    ctx.timings.setdefault("capture_forward", time.perf_counter() - t0)
    return run_stage_passes(program, ctx, debug=debug, label="eval ", skip=skip + ("recompute",))


def _kernels_option(kernels: str, mesh) -> str:
    """What the lower pass does (autopar's Triton kernels): "off" nothing; "on" every match;
    "auto" each match where autopar's kernel measured faster than PyTorch's op at that shape on
    this device (kernels/choice.py: timed at compile, kept in a cache). On a mesh that is not CUDA
    "auto" is "off": Triton would run through its interpreter there, a correctness path."""
    from autopar.kernels.ops import available

    if kernels not in ("auto", "on", "off"):
        raise PlanError(f"unknown kernels option {kernels!r}", where="autopar.compile(kernels=...)",
                        fix='use "auto", "on" or "off"')
    if kernels == "off":
        return "off"
    ok, how = available()
    if kernels == "on":
        if not ok:
            raise PlanError(f"kernels='on' but {how}", where="autopar.compile(kernels='on')",
                            fix="pip install triton, or compile with kernels='off'")
        return "on"
    return "auto" if ok and how == "cuda" and mesh.device_type == "cuda" else "off"


def _decorator(target, mesh, options: CompileOptions):
    def wrap(t):
        @functools.wraps(t)
        def build(*args, **kwargs):
            return compile_with(t(*args, **kwargs), mesh, options)

        return build

    return wrap(target) if target is not None else wrap
