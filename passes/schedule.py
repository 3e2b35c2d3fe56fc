"""schedule: what the runtime runs per step, on each rank.

A step is a list of actions per rank (autopar/analysis/schedules.py: F, B, or B split into I and
W, per stage and micro-batch); an SPMD plan is one stage whose list is F+B per micro-batch
(``accumulate=K``: K of them). This pass prepares every stage for its actions:

- gradients that the stage's program does not reduce itself (micro-batches are summed first:
  ``accumulate=K``, and every pipeline) get ``stage.sync``, the per-rank program that reduces
  them once per step (passes/state.py ``grad_sync_program``, localized and overlapped here);
- a pipeline stage's per-rank program is cut into F (what its activations and loss need),
  I (its input gradients) and W (its weight gradients) (passes/partition.py), with the
  bytes one micro-batch saves between them, so the executor can run ZB-H1's split backward and
  the planner can count activations in flight.

The pipeline's action lists themselves are built and validated with the options, before
anything is traced (autopar/pipeline_plan.py): a bad schedule is a plan error, not a trace.
"""

from __future__ import annotations

from torch import fx

from autopar.ir import CompileState, Stage
from autopar.passes.overlap import overlap_pass
from autopar.passes.partition import _prologue_bytes, _saved_bytes, partition
from autopar.passes.state import grad_sync_program
from autopar.passes.twins import copy_schedule


def schedule_pass(state: CompileState) -> CompileState:
    """After it: every stage whose program leaves gradients unreduced has ``sync``; every
    pipeline stage has its F / I / W ``parts`` and the names and bytes the executor reads."""
    o = state.options
    done = {}
    for st in state.stages:
        done[st.index] = st
        if st.twin_of in done:  # a twin (passes/twins.py): its original's, renamed
            copy_schedule(done[st.twin_of], st)
            st.ctx.sync_grads = True
            continue
        if not st.ctx.sync_grads:
            st.sync = grad_sync_program(st.program, st.ctx, debug=o.given.debug)
            if "overlap" not in o.skip:
                overlap_pass(st.sync, st.ctx)
        st.ctx.sync_grads = True  # what later programs of this context (the eval forward) assume
        _names(st)
        if o.pipeline is not None:
            _cut(st)
    return state


def _names(st: Stage) -> None:
    """What the executor reads: each program input's placeholder and each output's node name."""
    gm = st.program.local
    st.ph_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    st.out_names = [a.name if isinstance(a, fx.Node) else None for a in out.args[0]]
    st.ph_vals = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"}


def _cut(st: Stage) -> None:
    gm, program = st.program.local, st.program
    st.parts = partition(gm, program.outputs, program.inputs, gathers_once=st.ctx.plan.zero in (1, 2))
    st.saved_bytes = _saved_bytes(gm, program.inputs, st.parts)
    st.saved_after_i = _saved_bytes(gm, program.inputs, st.parts, after="I")
    st.prologue = st.parts.pop("P", None)
    st.prologue_bytes = _prologue_bytes(gm, program.inputs, st.prologue)
