"""A pipeline's cost from plain per-stage figures: what ``plan="auto"``'s confirmations carry
from stages of one and two blocks to the grouping the whole model's split makes
(``autopar.planner.search.confirm``), composed by the same walk and schedule simulation as a
compiled pipeline's (``cost._pipeline_makespan`` / ``cost._pipeline_peak``, which
``cost.predict_pipeline_time`` / ``predict_pipeline_memory`` use)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autopar.analysis.cost import (OPTIMIZER_STATE, Device, ProgramMemory, optimizer_seconds,
                                   _pipeline_links, _pipeline_makespan, _pipeline_peak, core_share, loaded_links,
                                   oversubscribed, pipeline_hop, simulate, stage_memory)


# ------------------------------------------------------------ pipelines from per-stage figures
@dataclass
class StageCosts:
    """What the pipeline's time and memory composition reads of one stage, as plain numbers that
    grow linearly with the blocks the stage holds (``autopar.planner.search.confirm`` carries
    them from stages of one and two blocks to the grouping the whole model's split makes).
    ``local``: held by this rank (the rest of the fields are 0 elsewhere)."""

    F: float = 0.0  # seconds per micro-batch of each part
    I: float = 0.0  # noqa: E741 - the schedules' name for the input-gradient part
    W: float = 0.0
    saved: int = 0  # bytes saved per micro-batch in flight, and after its I part
    saved_after_i: int = 0
    local: bool = False
    prologue_s: float = 0.0
    sync_s: float = 0.0
    elems: int = 0  # parameter elements on this rank (the optimizer step's)
    params: int = 0  # bytes of parameters as stored
    trans: int = 0  # the running action's transient beyond its saved values
    acc: int = 0  # gradient sums
    sync_peak: int = -1  # the gradient sync program's peak (-1: none)
    prologue_bytes: int = 0
    wire: dict = field(default_factory=dict)  # bytes this rank sends per step for the stage, per axis
    # the stage's joint and sync programs' liveness (this rank's stages): their peaks are carried
    # point by point (``liveness.peak_in_depth``), not along one line: which point holds a
    # program's peak can change with its blocks
    mem: ProgramMemory | None = None
    sync_mem: ProgramMemory | None = None

    def at(self, other: "StageCosts", blocks: float) -> "StageCosts":
        """This stage's figures (at one block) carried to ``blocks`` along the line through
        ``other`` (the same stage at two blocks)."""
        def line(a, b):
            v = a + (blocks - 1) * (b - a)
            return int(round(v)) if isinstance(a, int) and isinstance(b, int) else v

        out = StageCosts(**{f: line(getattr(self, f), getattr(other, f)) for f in (
            "F", "I", "W", "saved", "saved_after_i", "prologue_s", "sync_s", "elems", "params", "trans",
            "acc", "prologue_bytes")})
        out.local = self.local
        out.sync_peak = -1 if self.sync_peak < 0 else line(self.sync_peak, other.sync_peak)
        out.wire = {k: line(self.wire.get(k, 0), other.wire.get(k, 0)) for k in set(self.wire) | set(other.wire)}

        def peak(a, b):
            from autopar.analysis.liveness import peak_in_depth

            return sum(peak_in_depth([a, b], (1, 2), blocks)["at_peak"].values())

        if self.mem is not None and other.mem is not None:
            out.trans = max(0, peak(self.mem, other.mem) - out.saved)
        if self.sync_mem is not None and other.sync_mem is not None:
            out.sync_peak = peak(self.sync_mem, other.sync_mem)
        return out


def pipeline_stage_costs(pm, dev: Device, optimizer: str = "adamw", fused: bool = False):
    """(per-stage ``StageCosts``, what does not belong to one stage) of a compiled pipeline,
    every stage compiled (``pipeline_stages="all"``): what ``compose_pipeline`` reads. The second:
    ``hop``, the largest activation's transfer in seconds, and ``wire``, the bytes per axis this
    rank sends beyond its stages' own collectives (activations and their gradients between
    stages, tied parameters' sums)."""
    from torch.distributed.tensor import DTensor

    links = _pipeline_links(pm, dev)
    world = math.prod(pm.mesh.shape)
    share = core_share(dev, world)
    blocking = oversubscribed(dev, world)
    if blocking:
        links = loaded_links(links, dev)
    act_share = 1.0 if blocking else share
    out = [StageCosts() for _ in pm.specs]
    for s, sp in pm.stages.items():
        c = out[s]
        for kind, part in sp.parts.items():
            if part.gm is not None:
                setattr(c, kind, simulate(part.gm, dev, links, act_share, fused, blocking).step_s)
        c.saved, c.saved_after_i = sp.saved_bytes, sp.saved_after_i
    mine = dict(pm.named_parameters())
    counted: set = set()
    for s, sp in pm.local.items():
        c = out[s]
        c.local = True
        if sp.prologue is not None and sp.prologue.gm is not None:
            c.prologue_s = simulate(sp.prologue.gm, dev, links, share, fused, blocking).step_s
        c.sync_s = simulate(sp.sync.local, dev, links, share, fused, blocking).step_s
        for name in sp.param_names:
            p = mine.get(name)
            if p is None or id(p) in counted:  # (a tied parameter: with the first stage holding it)
                continue
            counted.add(id(p))
            local = p._local_tensor if isinstance(p, DTensor) else p
            c.elems += local.numel()
            c.params += local.numel() * local.element_size()
        c.mem, c.trans, c.acc, c.sync_mem = stage_memory(sp)
        if c.sync_mem is not None:
            c.sync_peak = c.sync_mem.peak
        c.prologue_bytes = sp.prologue_bytes
        for r in pm.stage_collectives(s):
            c.wire[r.axis] = c.wire.get(r.axis, 0) + r.wire_bytes
    wire: dict = {}
    for r in pm.collectives():
        wire[r.axis] = wire.get(r.axis, 0) + r.wire_bytes
    for c in out:
        for k, v in c.wire.items():
            wire[k] -= v
    return out, {"hop": pipeline_hop(pm, links), "wire": {k: v for k, v in wire.items() if v}}


def pipeline_shape(pm) -> dict:
    """What ``compose_pipeline`` reads of a compiled pipeline beyond its stages' figures (plain,
    picklable: a forked compile sends it back)."""
    return {"schedule": pm.schedule, "world": math.prod(pm.mesh.shape), "microbatches": pm.microbatches,
            "pp": pm.mesh.shape[list(pm.mesh.mesh_dim_names).index(pm.pp_axis)], "pp_rank": pm.pp_rank}


def compose_pipeline(shape: dict, stages: list, fixed: dict, dev: Device, optimizer: str = "adamw") -> dict:
    """Step time, bubble, step peak and bytes per axis of a pipeline's schedule and mesh
    (``shape``: ``pipeline_shape``) with the
    per-stage figures ``stages`` (``pipeline_stage_costs``, or carried to another grouping of the
    blocks; ``fixed``: the rest, as ``pipeline_stage_costs`` returns it): ``predict_pipeline_time``
    and ``predict_pipeline_memory`` on plain numbers (tests/test_planner.py checks the composition
    of a pipeline's own figures against those two)."""
    hop, world, schedule = fixed["hop"], shape["world"], shape["schedule"]
    share = core_share(dev, world)
    blocking = oversubscribed(dev, world)
    per = {k: [getattr(c, k) for c in stages] for k in ("F", "I", "W")}
    tl, makespan = _pipeline_makespan(schedule, per, hop, shape["microbatches"], dev, world, shape["pp"], blocking)
    mine = [c for c in stages if c.local]
    optimizer_s = optimizer_seconds(sum(c.elems for c in mine), optimizer, dev, share)
    step_s = sum(c.prologue_s for c in mine) + makespan + sum(c.sync_s for c in mine) + optimizer_s
    idx = {id(c): s for s, c in enumerate(stages)}
    saved = {s: (c.saved, c.saved_after_i) for s, c in enumerate(stages)}
    trans = {idx[id(c)]: c.trans for c in mine}
    acc = {idx[id(c)]: c.acc for c in mine}
    sync_peak = {idx[id(c)]: c.sync_peak for c in mine if c.sync_peak >= 0}
    peak, _, sync = _pipeline_peak(schedule.actions[shape["pp_rank"]], saved, trans, acc, sync_peak,
                                   sum(c.prologue_bytes for c in mine))
    params = sum(c.params for c in mine)
    wire = dict(fixed["wire"])
    for c in mine:
        for k, v in c.wire.items():
            wire[k] = wire.get(k, 0) + v
    return {"step_s": step_s, "bubble": tl.bubble, "wire": wire,
            "step_peak": int(params + params * OPTIMIZER_STATE[optimizer] + max(peak, sync))}
