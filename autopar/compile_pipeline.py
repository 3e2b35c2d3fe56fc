"""``autopar.compile`` with a pipeline axis: split, then every stage through the passes."""

from __future__ import annotations

import math
import time
import warnings

import torch
from torch import fx, nn

from autopar.errors import PlanError
from autopar.passes.split import (StageProgram, PipelineOptions, _saved_bytes, capture_whole, default_microbatches,
                                  partition, split_stages)

def compile_pipeline(model: nn.Module, mesh, *, example_inputs: tuple, loss_fn, plan: dict, pp_axis: str,
                     compute_dtype, reduce_dtype, recompute: str, accumulate: int, inputs: str, debug: bool,
                     skip_passes, progress, stages: str = "local", lower: bool = False,
                     loss_scale="dynamic"):
    """``autopar.compile`` with a pipeline axis; ``stages="all"`` also compiles the stages other
    ranks hold (planning: ``autopar dump`` shows every stage)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.context import Context
    from autopar.runtime.pipeline import PipelineModule
    from autopar.capture import _tensor_names, capture_stage
    from autopar.passes import run_passes
    from autopar.passes.state import grad_sync_program
    from autopar.plan import parse_plan, place_parameters
    from autopar.analysis.schedules import SCHEDULES, ScheduleError, interleaved, validate

    opts = PipelineOptions.parse(plan[pp_axis], pp_axis)
    if accumulate != 1:
        raise PlanError("accumulate=K with a pipeline axis: the pipeline's micro-batches already accumulate "
                        "gradients", where="autopar.compile(accumulate=...)",
                        fix=f'drop accumulate and set plan["{pp_axis}"] = {{"schedule": "{opts.schedule}", '
                        f'"microbatches": M}}')
    names = tuple(mesh.mesh_dim_names)
    p = mesh.shape[names.index(pp_axis)]
    others = tuple(a for a in names if a != pp_axis)
    stage_plan = {k: v for k, v in plan.items() if k != pp_axis}
    for glob, per_axis in (plan.get("rules") or {}).items():
        if isinstance(per_axis, dict) and pp_axis in per_axis:
            raise PlanError(f"rule {glob!r} places parameters on the pipeline axis {pp_axis!r}: a stage's parameters "
                            "live on its own ranks only", where=f"plan['rules'][{glob!r}]",
                            fix=f"drop '{pp_axis}' from the rule")
    if others:
        stage_mesh = mesh[others] if len(others) > 1 else mesh[others[0]]
    else:  # pipeline only: each stage is one rank
        stage_mesh = init_device_mesh(mesh.device_type, (p, 1), mesh_dim_names=(pp_axis, "dp"))["dp"]
        stage_plan = {"dp": "ddp", **({"rules": plan["rules"]} if "rules" in plan else {})}
    parsed = parse_plan(stage_plan, tuple(stage_mesh.mesh_dim_names))
    dp_axes = [i for i, a in enumerate(parsed.axes) if a.data_parallel]
    dp = math.prod(stage_mesh.shape[i] for i in dp_axes)
    batched = [x for x in example_inputs if isinstance(x, torch.Tensor) and x.ndim > 0]
    b = batched[0].shape[0] if batched else 0
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] != b:
            raise PlanError(f"input #{i} has batch size {x.shape[0]}, input #0 {b}: a pipeline splits every input "
                            "along dim 0 into micro-batches", where=f"example_inputs[{i}]")
    if b % dp:
        raise PlanError(f"batch size {b} cannot be split over {dp} data-parallel ranks", where="example_inputs",
                        fix=f"use a batch that is a multiple of {dp}")
    m = opts.microbatches or default_microbatches(opts, p, b // dp)
    where = f"plan[{pp_axis!r}]['microbatches']"
    if m < p:
        raise PlanError(f"{m} micro-batch(es) cannot fill a {p}-stage pipeline: every stage but one would idle "
                        "the whole step", where=where, fix=f"use microbatches >= {p}")
    if b % (m * dp):
        raise PlanError(f"the batch ({b}) does not split into {m} micro-batches x {dp} data-parallel ranks",
                        where=where, fix=f"use a batch that is a multiple of {m * dp}, or microbatches dividing "
                        f"{b // dp}")
    try:
        sched = interleaved(p, m, opts.virtual) if opts.schedule == "interleaved" else SCHEDULES[opts.schedule](p, m)
        validate(sched)
    except ScheduleError as e:
        raise PlanError(str(e), where=f"plan[{pp_axis!r}]") from e
    n_stages = p * opts.virtual
    micro = tuple(x[: x.shape[0] // m] if isinstance(x, torch.Tensor) and x.ndim > 0 else x for x in example_inputs)
    t0 = time.perf_counter()
    if progress:
        progress(f"capture (whole model, micro-batch of {b // m}) and split into {n_stages} stages")
    gm = capture_whole(model, micro, loss_fn, compute_dtype, lower=lower)
    lowered = dict(gm.meta.get("autopar_lowered", {}))
    device = next((q.device for q in model.parameters()), torch.device("cpu"))
    specs = split_stages(gm, n_stages, opts.split, device=device)
    capture_s = time.perf_counter() - t0
    pp_rank = mesh.get_local_rank(pp_axis)
    wanted = range(n_stages) if stages == "all" else [s for s in range(n_stages) if sched.rank_of(s) == pp_rank]
    ids = _tensor_names(model)
    compiled = []
    for s in wanted:
        spec = specs[s]
        params = {ids[id(getattr(spec.gm, t))][1]: getattr(spec.gm, t) for t in spec.params}
        placed = place_parameters(parsed, params, tuple(stage_mesh.shape))
        for axis, pnames in placed.unplaced.items():
            warnings.warn(f"autopar: the '{axis}' strategy did not recognise {len(pnames)} parameter(s) of stage {s}, "
                          f"replicated on '{axis}': {', '.join(pnames)} (place them with plan['rules'])", stacklevel=3)
        ctx = Context(stage_mesh, parsed, placed, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                      recompute=recompute, accumulate=m)
        ctx.loss_scale = loss_scale if compute_dtype == torch.float16 else None
        ctx.progress = progress
        ctx.boundary = (spec.in_batched, spec.out_batched)
        ctx.stage = s
        ctx.lowered = lowered
        if device.type == "meta":
            ctx.device = device
        ctx.timings["capture"] = capture_s
        t1 = time.perf_counter()
        if progress:
            progress(f"stage {s}: capture joint")
        program = capture_stage(spec.gm, spec.example, model, spec.is_last)
        ctx.timings["capture_stage"] = time.perf_counter() - t1
        ctx.sync_grads = False
        program = run_passes(program, ctx, skip=skip_passes, debug=debug, label=f"stage {s} ")
        sync = grad_sync_program(program, ctx, debug=debug)
        ctx.sync_grads = True
        gmod = program.local
        parts = partition(gmod, program.outputs)
        sp = StageProgram(spec, ctx, program, sync, parts, list(params))
        sp.ph_names = [n.name for n in gmod.graph.nodes if n.op == "placeholder"]
        out = next(n for n in gmod.graph.nodes if n.op == "output")
        sp.out_names = [o.name if isinstance(o, fx.Node) else None for o in out.args[0]]
        sp.ph_vals = {n.name: n.meta["val"] for n in gmod.graph.nodes if n.op == "placeholder"}
        sp.saved_bytes = _saved_bytes(gmod, program.inputs, parts)
        sp.saved_after_i = _saved_bytes(gmod, program.inputs, parts, after="I")
        ctx.timings["total"] = time.perf_counter() - t0
        compiled.append(sp)
    return PipelineModule(model, mesh, pp_axis, stage_mesh, sched, opts, specs, compiled, example_inputs, inputs,
                          stage_plan=parsed)

