"""``autopar.compile(..., memory_budget=...)``: a per-rank memory budget checked before anything runs.

After the passes, and before the parameters are distributed (the first collective), each rank
predicts its step peak with the cost model (``cost.predict_memory``: parameters + optimizer
state + the program's peak, gradients included) from the compiled state alone: parameter shards
from their storage placements, no runtime built. A rank over the budget raises
``MemoryBudgetError`` (a ``PlanError``) naming the predicted peak, its biggest parts, the budget
and what to do; ``failure.agree`` hands it to every other rank, which raise the same kind of error
(naming the rank) instead of waiting for it in the first broadcast. A fake-mesh (planning) compile
raises it the same way.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import torch

from autopar.errors import MemoryBudgetError, PlanError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_WHERE = "autopar.compile(memory_budget=...)"
_FIX = 'pass bytes as an int (e.g. 80 * 2**30) or a string such as "80GiB", "512MiB", "1.5GB"; None for no budget'


def parse_budget(value) -> int | None:
    """``memory_budget`` -> bytes (None: no budget). Ints are bytes; strings take B, KB/MB/GB/TB
    (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024), case-insensitive."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise PlanError(f"memory_budget must be a number of bytes or a size string, got {value!r}", where=_WHERE,
                        fix=_FIX)
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise PlanError(f"memory_budget must be finite, got {value!r}", where=_WHERE, fix=_FIX)
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise PlanError(f"memory_budget {value!r} is not a size", where=_WHERE, fix=_FIX)
        f = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(f):
            raise PlanError(f"memory_budget {value!r} is not a finite size", where=_WHERE, fix=_FIX)
        n = int(f)
    else:
        raise PlanError(f"memory_budget must be an int or a string, got {type(value).__name__} {value!r}",
                        where=_WHERE, fix=_FIX)
    if n <= 0:
        raise PlanError(f"memory_budget must be positive, got {value!r}", where=_WHERE, fix=_FIX)
    return n


def _local_param(p: torch.Tensor, mesh, placements) -> torch.Tensor:
    """A meta tensor of this rank's shard of ``p`` under ``placements`` (what the runtime will hold)."""
    from autopar import torch_compat as tc

    shape, _ = tc.compute_local_shape_and_global_offset(p.shape, mesh, placements)
    t = torch.empty(shape, dtype=p.dtype, device="meta")
    t.requires_grad_(p.requires_grad)
    return t


def _params(state, names_meshes: dict) -> list[torch.Tensor]:
    out, seen = [], set()
    for name, p in state.model.named_parameters():  # tied weights: listed once, as the runtime holds them
        if name in names_meshes and id(p) not in seen:
            seen.add(id(p))
            mesh, placements = names_meshes[name]
            out.append(_local_param(p, mesh, placements))
    return out


def predicted_memory(state, optimizer: str = "adamw") -> dict:
    """``cost.predict_memory`` for a compiled state (``compiler.build``'s), before its runtime is
    built: the runtime's view of this rank (its parameter shards, programs, pipeline actions) from
    the state alone."""
    from autopar.analysis.cost import predict_memory
    from autopar.analysis.schedules import saved_in_flight

    o = state.options
    if o.pipeline is None:
        stage = state.stages[0]
        ctx = stage.ctx
        params = _params(state, {n: (ctx.mesh, pl) for n, pl in ctx.placed.placements.items()})
        view = SimpleNamespace(pipelined=False, program=stage.program, sync_program=stage.sync,
                               accumulate=ctx.accumulate, parameters=lambda: iter(params))
        return predict_memory(view, optimizer)
    pl = o.pipeline
    stages = {sp.spec.index: sp for sp in state.stages}
    pp_rank = state.mesh.get_local_rank(pl.axis)
    local = {s: sp for s, sp in stages.items() if pl.schedule.rank_of(s) == pp_rank}
    owned = {n: (pl.stage_mesh, sp.ctx.placed.placements[n]) for sp in local.values() for n in sp.param_names}
    params = _params(state, owned)
    view = SimpleNamespace(pipelined=True, schedule=pl.schedule, pp_rank=pp_rank, stages=stages, local=local,
                           parameters=lambda: iter(params))
    view.predicted_in_flight = lambda: saved_in_flight(pl.schedule.actions[pp_rank], stages)
    return predict_memory(view, optimizer)


def _b(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def advice(state) -> str:
    """What can bring the step peak down, given the mesh and plan."""
    o = state.options
    names = dict(zip(state.mesh.mesh_dim_names or (), state.mesh.shape))
    strategies = {a: v for a, v in o.plan.items() if a != "rules"}
    tips = ["more ranks on a context-parallel axis ({'cp': 'ulysses'}: activations / cp)",
            "tensor parallelism ({'tp': 'megatron'} or 'sequence': parameters and activations / tp)",
            "fsdp on a data-parallel axis (parameters, gradients and optimizer state / dp)",
            f"recompute='selective' or 'full' (activations; now {o.given.recompute!r})",
            "a smaller micro-batch (accumulate=K) or a shorter sequence"]
    if o.compute_dtype is None:
        tips.append('precision="bf16" (activations in half the bytes)')
    have = ", ".join(f"{a}={names.get(a, '?')}:{v}" for a, v in strategies.items()) or "no plan"
    return f"(mesh {names}, plan {have}) " + "; ".join(tips)


def check_budget(state, budget: int | None) -> dict | None:
    """Raise ``MemoryBudgetError`` if this rank's predicted step peak exceeds ``budget`` bytes;
    returns the prediction (None: no budget)."""
    if budget is None:
        return None
    m = predicted_memory(state)
    if m["step_peak"] <= budget:
        return m
    parts = {"parameters": m["parameters"], "optimizer state": m["optimizer_state"],
             **{f"{k.replace('_', ' ')} at the program's peak": m.get(f"peak_{k}", 0)
                for k in ("activations", "grads_in_flight", "param_copies")}}
    other = m["program_peak"] - sum(m.get(f"peak_{k}", 0) for k in ("activations", "grads_in_flight", "param_copies"))
    if other > 0:
        parts["other program values at the peak"] = other
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    mine = ", ".join(f"{k} {_b(v)}" for k, v in top)
    err = MemoryBudgetError(
        f"predicted step peak {_b(m['step_peak'])} ({m['step_peak']:,} B) per rank exceeds memory_budget "
        f"{_b(budget)} ({budget:,} B) by {_b(m['step_peak'] - budget)}; biggest parts: {mine}",
        where=_WHERE + " (the cost model's prediction for this rank, before anything ran)",
        fix="bring the peak down with " + advice(state) + "; or raise memory_budget")
    err.predicted = m
    err.budget = budget
    raise err
