"""``autopar.compile``: the driver. Reads top to bottom as the pipeline it runs."""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.context import Context
from autopar.errors import PlanError
from autopar.capture import capture_forward, capture_joint
from autopar.ir import Program
from autopar.plan import parse_plan, place_parameters


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def _dtype_option(v, what: str):
    if v is None or isinstance(v, torch.dtype):
        return v
    if v not in _DTYPES:
        raise PlanError(f"unknown {what} {v!r}", where=f"autopar.compile({what}=...)",
                        fix='use "fp32", "bf16" or "fp16"')
    return _DTYPES[v]


def compile(
    model: nn.Module | Callable | None = None,
    mesh: DeviceMesh | None = None,
    *,
    example_inputs: tuple | None = None,
    loss_fn: Callable | None = None,
    plan: dict | None = None,
    inputs: str = "global",
    precision: str = "fp32",
    reduce_dtype: str | None = None,
    loss_scale: str | float = "dynamic",
    accumulate: int = 1,
    recompute: str = "none",
    debug: bool = False,
    skip_passes: tuple[str, ...] = (),
    progress: Callable[[str], None] | None = None,
    capture_eval: bool = True,
    pipeline_stages: str = "local",
    kernels: str = "auto",
):
    """Compile ``model`` for ``mesh`` under ``plan``; returns a ParallelModule (a PipelineModule,
    autopar/runtime/pipeline.py, when an axis's strategy is a pipeline schedule: ``{"pp": "1f1b", ...}``).

    ``precision``: "fp32", or "bf16" / "fp16" to compute in that dtype from fp32 master
    parameters (the optimizer sees fp32 parameters and gradients); ``reduce_dtype``: the dtype
    gradients are reduced in (default: the compute dtype); ``loss_scale`` (fp16 only):
    "dynamic" or a fixed scale. ``accumulate=K`` splits each global batch into K micro-batches
    and synchronises gradients once per step. ``recompute``: "none" | "full" | "selective".
    ``progress``: called with the name of each stage as it starts (the command line shows it).
    ``capture_eval=False`` skips capturing the forward-only program (planning without running).
    ``pipeline_stages="all"`` (with a pipeline axis) also compiles the stages other ranks hold, so
    planning tools can show and cost the whole pipeline from one rank.
    ``kernels``: "auto" (lower attention and linear + activation to autopar's Triton kernels on a
    CUDA mesh when Triton is installed), "on" (also on CPU, through Triton's interpreter: slow),
    "off". ``pm.ctx.lowered`` counts what was rewritten.

    As a decorator (``@autopar.compile(mesh=..., example_inputs=..., plan=...)``) on a model
    class or a model-building function, the class/function then returns ParallelModules.
    """
    opts = dict(mesh=mesh, example_inputs=example_inputs, loss_fn=loss_fn, plan=plan, inputs=inputs,
                precision=precision, reduce_dtype=reduce_dtype, loss_scale=loss_scale, accumulate=accumulate,
                recompute=recompute, debug=debug, skip_passes=skip_passes, progress=progress,
                capture_eval=capture_eval, pipeline_stages=pipeline_stages, kernels=kernels)
    if model is None or (isinstance(model, type) or (callable(model) and not isinstance(model, nn.Module))):
        return _decorator(model, **opts)
    from autopar.passes import run_passes
    from autopar.passes.recompute import POLICIES
    from autopar.runtime.module import ParallelModule

    if mesh is None:
        raise PlanError("autopar.compile needs a mesh", fix="pass mesh=autopar.mesh(dp=2)")
    if example_inputs is None:
        raise PlanError("autopar.compile needs example_inputs (global shapes)",
                        fix="pass example_inputs=(tokens, targets)")
    if inputs not in ("global", "local"):
        raise PlanError(f"inputs must be 'global' or 'local', got {inputs!r}")
    compute_dtype = _dtype_option(precision, "precision")
    compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
    reduce = _dtype_option(reduce_dtype, "reduce_dtype") if reduce_dtype is not None else compute_dtype
    if recompute not in POLICIES:
        raise PlanError(f"unknown recompute policy {recompute!r}", where="autopar.compile(recompute=...)",
                        fix=f"use one of {list(POLICIES)}")
    if compute_dtype == torch.float16 and not (loss_scale == "dynamic" or isinstance(loss_scale, (int, float))):
        raise PlanError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}",
                        where="autopar.compile(loss_scale=...)")
    example_inputs = tuple(example_inputs)
    lower = _kernels_option(kernels, mesh)
    if not isinstance(accumulate, int) or accumulate < 1:
        raise PlanError(f"accumulate must be a positive int, got {accumulate!r}", where="autopar.compile(accumulate=...)")
    from autopar.compile_pipeline import compile_pipeline
    from autopar.passes.split import is_pipeline_strategy

    pp_axes = [a for a, v in (plan or {}).items() if a != "rules" and is_pipeline_strategy(v)]
    if len(pp_axes) > 1:
        raise PlanError(f"more than one pipeline axis in the plan: {pp_axes}", where="plan",
                        fix="pipeline over one mesh axis")
    if pp_axes:
        if pp_axes[0] not in (mesh.mesh_dim_names or ()):
            raise PlanError(f"plan names mesh axis {pp_axes[0]!r}, which the mesh does not have", where="plan",
                            fix=f"mesh axes are {list(mesh.mesh_dim_names)}")
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise PlanError("the model's parameters are already DTensors: it was compiled before",
                            where="autopar.compile(model)", fix="build a fresh model for each compile")
        return compile_pipeline(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, plan=plan,
                                pp_axis=pp_axes[0], compute_dtype=compute_dtype, reduce_dtype=reduce,
                                recompute=recompute, accumulate=accumulate, inputs=inputs, debug=debug,
                                skip_passes=skip_passes, progress=progress, stages=pipeline_stages, lower=lower,
                                loss_scale=loss_scale)
    micro_inputs = example_inputs
    if accumulate > 1:
        for i, x in enumerate(example_inputs):
            if x.ndim == 0 or x.shape[0] % accumulate:
                raise PlanError(f"input #{i} has batch size {x.shape[0] if x.ndim else 'none'}, not divisible "
                                f"by accumulate={accumulate}", where=f"example_inputs[{i}]",
                                fix="pick a global batch that is a multiple of accumulate (x the data-parallel size)")
        micro_inputs = tuple(x[: x.shape[0] // accumulate] for x in example_inputs)
    t0 = time.perf_counter()
    parsed = parse_plan(plan, tuple(mesh.mesh_dim_names))
    params = dict(model.named_parameters())

    already = [n for n, p in params.items() if isinstance(p, DTensor)]
    if already:
        raise PlanError(f"the model's parameters are already DTensors ({already[0]}, ...): it was compiled "
                        "before, and autopar.compile replaces a module's parameters in place",
                        where="autopar.compile(model)", fix="build a fresh model (or deep-copy it) for each compile")
    placed = place_parameters(parsed, params, tuple(mesh.shape))
    for axis, names in placed.unplaced.items():
        warnings.warn(f"autopar: the '{axis}' strategy did not recognise {len(names)} parameter(s), "
                      f"replicated on '{axis}': {', '.join(names)} (place them with plan['rules'])",
                      stacklevel=2)
    ctx = Context(mesh, parsed, placed, compute_dtype=compute_dtype, reduce_dtype=reduce, recompute=recompute,
                  accumulate=accumulate)
    ctx.loss_scale = loss_scale if compute_dtype == torch.float16 else None
    dp = ctx.prod(ctx.dp_axes)
    for i, x in enumerate(micro_inputs):
        if x.ndim > 0 and dp > 1 and x.shape[0] % dp:
            names = "x".join(ctx.axis_names[a] for a in ctx.dp_axes)
            raise PlanError(f"input #{i} has batch size {x.shape[0]}" + (f" per micro-batch (accumulate={accumulate})"
                            if accumulate > 1 else "") + f", which the data-parallel axes ({names}, {dp} ranks) "
                            "cannot split evenly", where=f"example_inputs[{i}]",
                            fix=f"use a global batch that is a multiple of {dp * accumulate}")
    ctx.progress = progress
    if any(p.is_meta for p in params.values()):  # planning only (no data): the program stays on meta
        ctx.device = torch.device("meta")
    if progress:
        progress("capture (torch.export, joint forward + backward)")
    program: Program = capture_joint(model, micro_inputs, loss_fn, compute_dtype, lower=lower)
    ctx.lowered = program.lowered
    ctx.timings["capture"] = time.perf_counter() - t0
    ctx.sync_grads = accumulate == 1
    program = run_passes(program, ctx, skip=skip_passes, debug=debug)
    sync = None
    if accumulate > 1:
        from autopar.passes.state import grad_sync_program

        sync = grad_sync_program(program, ctx, debug=debug)
    ctx.sync_grads = True
    ctx.timings["total"] = time.perf_counter() - t0
    # the eval program is captured now, while the parameters are still plain tensors; its
    # passes run on the first forward call
    forward_builder = None
    if capture_eval:
        fwd_inputs = example_inputs[:-1] if loss_fn is not None else example_inputs
        if progress:
            progress("capture (eval forward)")
        fwd_program = capture_forward(model, fwd_inputs, compute_dtype)
        ctx.timings["capture_forward"] = time.perf_counter() - t0 - ctx.timings["total"]
        forward_builder = functools.partial(run_passes, fwd_program, ctx, debug=debug, label="eval ",
                                            skip=tuple(skip_passes) + ("recompute",))
    return ParallelModule(model, ctx, program, example_inputs, loss_fn is not None, inputs, forward_builder,
                          sync_program=sync)


def _kernels_option(kernels: str, mesh) -> bool:
    """Whether to run the lower pass (autopar's Triton kernels)."""
    from autopar.kernels.ops import available

    if kernels not in ("auto", "on", "off"):
        raise PlanError(f"unknown kernels option {kernels!r}", where="autopar.compile(kernels=...)",
                        fix='use "auto", "on" or "off"')
    ok, how = available()
    if kernels == "on" and not ok:
        raise PlanError(f"kernels='on' but {how}", where="autopar.compile(kernels='on')",
                        fix="pip install triton, or compile with kernels='off'")
    return kernels == "on" or (kernels == "auto" and ok and how == "cuda" and mesh.device_type == "cuda")


def _decorator(target, **kw):
    def wrap(t):
        @functools.wraps(t)
        def build(*args, **kwargs):
            return compile(t(*args, **kwargs), **kw)

        return build

    return wrap(target) if target is not None else wrap
