"""The pass pipeline: every pass autopar runs, in order (``autopar dump --passes`` prints it).

    capture      dynamo: model + loss -> one torch-level FX graph at a micro-batch's global shapes
    masks        an attention mask computed from no input that is the causal mask -> is_causal=True
    lower        attention / linear + activation -> autopar's kernel ops (kernels="on")
    split        stages: a pipeline's cut at module boundaries; otherwise one stage, the whole graph;
                 a stage that compiles to an earlier stage's program is its twin (passes/twins.py):
                 compiled once, copied with its own names before ``schedule``
    autograd     per stage: AOTAutograd -> one joint forward + backward ATen graph
    propagate    per stage: a ShardSpec on every value (plan placements + op rules)
    recompute    per stage: activation checkpointing, which forward values backward recomputes
    state        per stage: ZeRO storage layouts, gathers where used, gradients in reduce_dtype
    collectives  per stage: a redistribute node wherever placements disagree, costed and explained
    localize     per stage: the per-rank program, explicit _c10d_functional collectives + waits
    overlap      per stage: ZeRO gathers per block, prefetched; gradient buckets; deferred waits; safe lifetimes
    schedule     per stage: gradient-sync programs; pipelines: F / I / W parts for the action lists

Every pass has one signature, ``pass(state: CompileState) -> CompileState`` (autopar/ir.py),
and reads its options from ``state.options``; per-stage passes are written as ``(program,
ctx) -> program`` over one stage's graph and lifted with ``per_stage``. ``run_pipeline`` runs
the list, skips the passes named in ``skip`` (only those a program can do without:
``required=False``), stops after ``stop_after`` (``autopar dump --after PASS``), times each
pass, and in debug mode checks the invariants of passes/README.md after each one: on the
global graphs up to ``collectives``, on the per-rank graphs from ``localize`` on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from autopar.errors import PlanError
from autopar.ir import CompileState, Program, check_invariants, check_local
from autopar.passes.capture import autograd_pass, capture_pass
from autopar.passes.collectives import collectives_pass
from autopar.passes.localize import localize_pass
from autopar.passes.masks import masks_pass
from autopar.passes.lower import lower_pass
from autopar.passes.overlap import overlap_pass
from autopar.passes.propagate import propagate_pass
from autopar.passes.recompute import recompute_pass
from autopar.passes.schedule import schedule_pass
from autopar.passes.split import split_pass
from autopar.passes.twins import materialize
from autopar.passes.state import state_pass


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[CompileState], CompileState]
    required: bool  # False: the program is complete without it (``skip_passes`` may name it)
    doc: str  # what holds after it (the first line of its docstring)
    stage_fn: Callable[[Program, object], Program] | None = None  # a per-stage pass, unlifted


def per_stage(name: str, fn: Callable[[Program, object], Program]) -> Callable[[CompileState], CompileState]:
    """Lift a pass over one stage's program to the whole state."""

    def run(state: CompileState) -> CompileState:
        for st in state.stages:
            if st.twin_of is not None and st.program is None:  # a twin: its program is copied after these passes
                continue
            if state.options.progress and len(state.stages) > 1:
                state.options.progress(f"stage {st.index}: {name}")
            st.program = fn(st.program, st.ctx)
        return state

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def _pass(name: str, fn, required: bool = True, stage: bool = False) -> Pass:
    run = per_stage(name, fn) if stage else fn
    doc = _first_sentence(fn.__doc__ or "")
    return Pass(name, run, required, doc, fn if stage else None)


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    return text.split(". ")[0].rstrip(".") + "."


PASSES: list[Pass] = [
    _pass("capture", capture_pass),
    _pass("masks", masks_pass, required=False),
    _pass("lower", lower_pass, required=False),
    _pass("split", split_pass),
    _pass("autograd", autograd_pass),
    _pass("propagate", propagate_pass, stage=True),
    _pass("recompute", recompute_pass, required=False, stage=True),
    _pass("state", state_pass, stage=True),
    _pass("collectives", collectives_pass, stage=True),
    _pass("localize", localize_pass, stage=True),
    _pass("overlap", overlap_pass, required=False, stage=True),
    _pass("schedule", schedule_pass),
]
NAMES = [p.name for p in PASSES]
GLOBAL_CHECKED = ("propagate", "recompute", "state", "collectives")


def check_names(names, what: str) -> None:
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise PlanError(f"unknown pass(es) {unknown}", where=what, fix=f"passes are {NAMES}")


def run_pipeline(state: CompileState, *, skip=(), debug: bool = False, stop_after: str | None = None) -> CompileState:
    """Run PASSES in order on ``state``; see the module docstring."""
    check_names(skip, "skip_passes")
    if stop_after is not None:
        check_names([stop_after], "stop_after")
    needed = [p.name for p in PASSES if p.required and p.name in skip]
    if needed:
        raise PlanError(f"pass(es) {needed} cannot be switched off: later passes and the runtime need what they "
                        "produce", where="skip_passes",
                        fix=f"switch off only {[p.name for p in PASSES if not p.required]}")
    progress = state.options.progress
    for p in PASSES:
        if p.name in skip:
            continue
        if p.name == "schedule":
            materialize(state)  # twin stages: their original's program, renamed (passes/twins.py)
        if progress:
            progress(p.name)
        t0 = time.perf_counter()
        state = p.run(state)
        state.timings[p.name] = state.timings.get(p.name, 0.0) + time.perf_counter() - t0
        state.done.append(p.name)
        if debug:
            check_state(state, p.name)
        if p.name == stop_after:
            break
    materialize(state)
    return state


def check_state(state: CompileState, after: str) -> None:
    """The invariants after pass ``after``, on every stage (passes/README.md)."""
    for st in state.stages:
        if st.program is None:
            continue
        check_program(st.program, st.ctx, after)
        if st.sync is not None:
            check_program(st.sync, st.ctx, after)


def check_program(program: Program, ctx, after: str) -> None:
    if after in GLOBAL_CHECKED:
        check_invariants(program.graph, after)
    local = getattr(program, "local", None)
    if local is not None:
        check_local(local, program, ctx.axis_sizes, after)


def run_stage_passes(program: Program, ctx, *, skip=(), debug: bool = False, label: str = "") -> Program:
    """The per-stage passes alone, on one program (the eval forward program; tests)."""
    check_names(skip, "skip_passes")
    for p in PASSES:
        if p.stage_fn is None or p.name in skip:
            continue
        fn = p.stage_fn
        if getattr(ctx, "progress", None):
            ctx.progress(f"{label}{p.name}")
        t0 = time.perf_counter()
        program = fn(program, ctx)
        ctx.timings[f"{label}{p.name}"] = time.perf_counter() - t0
        if debug:
            check_program(program, ctx, p.name)
    return program

