"""What a pipeline axis in the plan means, checked before anything is traced.

``plan={"pp": "1f1b", ...}`` or ``{"pp": {"schedule": "interleaved", "microbatches": 8,
"virtual": 2, "split": ["layers.2"], "balance": "h100"}}``: the schedule, the micro-batch count,
the stages per rank, the split points, and the device whose costs balance the stages where no
split points are given (default: this machine's: ``h100`` with CUDA, else ``cpu``; planning a
GPU job on a CPU names the GPU); ``pipeline_setup`` turns that, the mesh and the batch into the
sub-mesh every stage runs on, the stage plan and the validated action lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.errors import PlanError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


# ------------------------------------------------------------------------------------ options
@dataclass
class PipelineOptions:
    schedule: str
    microbatches: int | None = None  # None: the default (see default_microbatches)
    virtual: int = 1
    split: list[str] | None = None  # module names that start a stage (S - 1 of them)
    balance: str | None = None  # the device row whose costs balance the stages (None: this machine's)

    @classmethod
    def parse(cls, value, axis: str = "pp") -> PipelineOptions:
        where = f"plan[{axis!r}]"
        if isinstance(value, str):
            value = {"schedule": value}
        if not isinstance(value, dict):
            raise PlanError(f"the pipeline axis wants a schedule name or a dict, got {value!r}", where=where,
                            fix=f'e.g. "{axis}": "1f1b" or {{"schedule": "interleaved", "virtual": 2, '
                            '"microbatches": 8}')
        unknown = set(value) - {"schedule", "microbatches", "virtual", "split", "balance"}
        if unknown:
            raise PlanError(f"unknown pipeline option(s) {sorted(unknown)}", where=where,
                            fix="options are schedule, microbatches, virtual, split, balance")
        s = value.get("schedule")
        if s not in PP_SCHEDULES:
            raise PlanError(f"unknown pipeline schedule {s!r}", where=where, fix=f"use one of {list(PP_SCHEDULES)}")
        m = value.get("microbatches")
        if m is not None and (not isinstance(m, int) or m < 1):
            raise PlanError(f"microbatches must be a positive int, got {m!r}", where=f"{where}['microbatches']")
        v = value.get("virtual", 2 if s == "interleaved" else 1)
        if not isinstance(v, int) or v < 1 or (v > 1 and s != "interleaved"):
            raise PlanError(f"virtual={v!r}: only the interleaved schedule runs more than one stage per rank",
                            where=f"{where}['virtual']", fix='use "schedule": "interleaved" with virtual >= 2')
        split = value.get("split")
        if split is not None and (not isinstance(split, (list, tuple)) or not all(isinstance(x, str) for x in split)):
            raise PlanError(f"split must be a list of module names, got {split!r}", where=f"{where}['split']")
        balance = value.get("balance")
        if balance is not None:
            from autopar.analysis.devices import DEVICES

            if balance not in DEVICES:
                raise PlanError(f"unknown device {balance!r} to balance the pipeline's stages by",
                                where=f"{where}['balance']", fix=f"use one of {sorted(DEVICES)}")
        return cls(s, m, v, list(split) if split is not None else None, balance)


def default_microbatches(opts: PipelineOptions, p: int, batch_per_dp: int) -> int:
    """The largest M <= 4 * P that divides the per-data-parallel-rank batch (a multiple of P for
    the interleaved schedule), so the bubble (P-1)/(M+P-1) is at most ~20% when the batch
    allows; at least P."""
    for m in range(4 * p, p - 1, -1):
        if batch_per_dp % m == 0 and (opts.schedule != "interleaved" or m % p == 0):
            return m
    raise PlanError(f"a {p}-stage pipeline needs at least {p} micro-batches, and the batch per data-parallel "
                    f"rank ({batch_per_dp}) cannot be split into {p} or more equal micro-batches"
                    + (" (a multiple of P, interleaved)" if opts.schedule == "interleaved" else ""),
                    where="example_inputs", fix=f"use a batch per data-parallel rank that is a multiple of {p}")


def is_pipeline_strategy(v) -> bool:
    return (isinstance(v, str) and v in PP_SCHEDULES) or (isinstance(v, dict) and "schedule" in v)


@dataclass
class PipelineSetup:
    axis: str  # the pipeline mesh axis
    options: PipelineOptions
    ranks: int  # P
    microbatches: int  # M
    stage_mesh: object  # the mesh without the pipeline axis (a stage's SPMD mesh)
    stage_plan: dict  # the plan without the pipeline axis
    parsed: object  # autopar.plan.Plan of stage_plan on stage_mesh
    schedule: object  # autopar.analysis.schedules.Schedule, validated

    @property
    def n_stages(self) -> int:
        return self.ranks * self.options.virtual


def pipeline_setup(mesh, plan: dict, pp_axis: str, example_inputs: tuple, accumulate: int) -> PipelineSetup:
    """Validate the pipeline axis against the mesh, the plan and the batch; build the schedule."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.analysis.schedules import SCHEDULES, ScheduleError, interleaved, validate
    from autopar.plan import parse_plan

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
    if not others:  # pipeline only: each stage is one rank (its 1-rank mesh is made below)
        stage_plan = {"dp": "ddp", **({"rules": plan["rules"]} if "rules" in plan else {})}
    stage_axes = others or ("dp",)
    stage_shape = tuple(mesh.shape[names.index(a)] for a in others) if others else (1,)
    parsed = parse_plan(stage_plan, stage_axes)
    dp_axes = [i for i, a in enumerate(parsed.axes) if a.data_parallel]
    dp = math.prod(stage_shape[i] for i in dp_axes)
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
    # every check above ran before this, which may create process groups (pipeline only: the
    # stages' 1-rank meshes), so a bad plan fails on every rank before any rank waits in one
    if others:
        stage_mesh = mesh[others] if len(others) > 1 else mesh[others[0]]
    else:
        stage_mesh = init_device_mesh(mesh.device_type, (p, 1), mesh_dim_names=(pp_axis, "dp"))["dp"]
    return PipelineSetup(pp_axis, opts, p, m, stage_mesh, stage_plan, parsed, sched)
