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
ctx) -> program`` over one stage's graph and lifted with ``per_stage``. Each pass declares what
it ``requires`` and what it ``guarantees``: names of the checks in passes/checks.py (``autopar
dump --passes`` prints them). ``run_pipeline`` runs the list, skips the passes named in ``skip``
(only those a program can do without: ``required=False``), stops after ``stop_after``
(``autopar dump --after PASS``), times each pass, and after EVERY pass, always, verifies its
guarantees (passes/checks.py ``verify``: the cheap checks on every compile, all of them with
``debug=True``); a broken guarantee is an ``InternalCompilerError`` naming the pass.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass
from typing import Callable

from autopar.errors import InternalCompilerError, PlanError
from autopar.ir import CompileState, Program
from autopar.passes.capture import autograd_pass, capture_pass
from autopar.passes.checks import CHECKS, JOINT, LOCAL, PLACED, TORCH, verify, verify_program
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
    requires: tuple[str, ...]  # checks (passes/checks.py CHECKS) that must hold on what it reads
    guarantees: tuple[str, ...]  # checks that hold on what it leaves: verified after it, always
    stage_fn: Callable[[Program, object], Program] | None = None  # a per-stage pass, unlifted


def per_stage(name: str, fn: Callable[[Program, object], Program]) -> Callable[[CompileState], CompileState]:
    """Lift a pass over one stage's program to the whole state."""

    def run(state: CompileState) -> CompileState:
        for st in state.stages:
            if st.twin_of is not None and st.program is None:  # a twin: its program is copied after these passes
                continue
            if state.options.given.progress and len(state.stages) > 1:
                state.options.given.progress(f"stage {st.index}: {name}")
            st.program = fn(st.program, st.ctx)
        return state

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def _pass(name: str, fn, requires, guarantees, required: bool = True, stage: bool = False) -> Pass:
    run = per_stage(name, fn) if stage else fn
    doc = _first_sentence(fn.__doc__ or "")
    unknown = [c for c in (*requires, *guarantees) if c not in CHECKS]
    assert not unknown, f"pass {name} declares unknown checks {unknown}"
    return Pass(name, run, required, doc, tuple(requires), tuple(guarantees), fn if stage else None)


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    return text.split(". ")[0].rstrip(".") + "."


PASSES: list[Pass] = [
    _pass("capture", capture_pass, (), TORCH),
    _pass("masks", masks_pass, ("torch-graph",), TORCH, required=False),
    _pass("lower", lower_pass, ("torch-graph",), TORCH, required=False),
    _pass("split", split_pass, ("torch-graph",), TORCH),
    _pass("autograd", autograd_pass, ("torch-graph",), JOINT),
    _pass("propagate", propagate_pass, ("roles", "graph"), PLACED, stage=True),
    _pass("recompute", recompute_pass, ("specs", "wants"), PLACED, required=False, stage=True),
    _pass("state", state_pass, ("specs", "wants"), PLACED, stage=True),
    _pass("collectives", collectives_pass, ("specs", "wants"), PLACED + ("placements",), stage=True),
    _pass("localize", localize_pass, ("specs", "placements"), LOCAL, stage=True),
    _pass("overlap", overlap_pass, ("local-graph", "waited", "explained"), LOCAL, required=False, stage=True),
    _pass("schedule", schedule_pass, ("local-graph", "waited", "explained"), LOCAL),
]
NAMES = [p.name for p in PASSES]


def check_names(names, what: str) -> None:
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise PlanError(f"unknown pass(es) {unknown}", where=what, fix=f"passes are {NAMES}")


# (pass name, fn): ``fn(state)`` runs after that pass of every pipeline run inside ``after``
AFTER: contextvars.ContextVar[tuple[str, Callable] | None] = contextvars.ContextVar("autopar_after_pass", default=None)


@contextlib.contextmanager
def after(name: str, fn: Callable[[CompileState], None]):
    """Inside: ``fn(state)`` after the pass ``name`` of each pipeline run, once its guarantees are
    verified (it may raise, ending the compile there)."""
    check_names([name], "after")
    token = AFTER.set((name, fn))
    try:
        yield
    finally:
        AFTER.reset(token)


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
    progress = state.options.given.progress
    held: tuple[str, ...] = ()
    for p in PASSES:
        if p.name in skip:
            continue
        _requires(p, held)
        if p.name == "schedule":
            materialize(state)  # twin stages: their original's program, renamed (passes/twins.py)
        if progress:
            progress(p.name)
        t0 = time.perf_counter()
        state = p.run(state)
        t1 = time.perf_counter()
        state.timings[p.name] = state.timings.get(p.name, 0.0) + t1 - t0
        state.done.append(p.name)
        verify(state, p.name, p.guarantees, debug)
        state.timings["verify"] = state.timings.get("verify", 0.0) + time.perf_counter() - t1
        held = p.guarantees
        hook = AFTER.get()
        if hook is not None and hook[0] == p.name:
            hook[1](state)  # (autopar/tools/extrapolate.py: a fork here, the compile finished in the child)
        if p.name == stop_after:
            break
    materialize(state)
    return state


def _requires(p: Pass, held: tuple[str, ...]) -> None:
    """The declarations agree: what ``p`` requires is what the pass before it guaranteed."""
    missing = [c for c in p.requires if c not in held]
    if missing:
        raise InternalCompilerError(
            f"internal compiler error: pass '{p.name}' requires {missing}, which the pass before it does not "
            f"guarantee (it guarantees {list(held)})", where=f"autopar.passes.PASSES, pass '{p.name}'",
            fix="this is a bug in autopar's pass declarations: please report it with this message and the "
                "skip_passes / stop_after given")


def run_stage_passes(program: Program, ctx, *, skip=(), debug: bool = False, label: str = "") -> Program:
    """The per-stage passes alone, on one program (the eval forward program, generation's; tests),
    each verified after it like ``run_pipeline``'s."""
    check_names(skip, "skip_passes")
    held = next(p.guarantees for p in PASSES if p.name == "autograd")  # a program as captured
    for p in PASSES:
        if p.stage_fn is None or p.name in skip:
            continue
        _requires(p, held)
        fn = p.stage_fn
        if ctx.progress:
            ctx.progress(f"{label}{p.name}")
        t0 = time.perf_counter()
        program = fn(program, ctx)
        t1 = time.perf_counter()
        ctx.timings[f"{label}{p.name}"] = t1 - t0
        verify_program(program, ctx, f"{label}{p.name}", p.guarantees, debug)
        ctx.timings["verify"] = ctx.timings.get("verify", 0.0) + time.perf_counter() - t1
        held = p.guarantees
    return program
