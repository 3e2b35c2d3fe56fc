"""capture and autograd: the user's model + loss as graphs (autopar/capture.py does the tracing).

- ``capture``: dynamo traces ``loss_fn(model(*inputs[:-1]), inputs[-1])`` (or the model's own
  loss) at one micro-batch's GLOBAL shapes into a torch-level FX graph: every node keeps its
  module path and the user's source line. Mixed precision is part of the trace (each
  parameter cast to the compute dtype where it is used).
- ``autograd``: AOTAutograd turns each stage's torch-level graph into one joint forward +
  backward ATen graph (``primals`` in, loss / activations and gradients out), with roles for
  every placeholder and output (``Program.inputs`` / ``outputs``: parameters by their user
  names). A pipeline stage also returns the gradients of its inputs.

The torch-level graph is where rewrites that want autograd's help happen (lower, split); the
ATen graph is where sharding happens (propagate onwards).
"""

from __future__ import annotations

from autopar import value_checks
from autopar.capture import capture_graph, joint_program
from autopar.experts import expert_plan
from autopar.ir import CompileState


def capture_pass(state: CompileState) -> CompileState:
    """After it: ``state.gm`` is the torch-level graph of model + loss on one micro-batch."""
    o = state.options
    state.gm = capture_graph(state.model, state.micro_inputs, o.given.loss_fn, o.compute_dtype, dropless=expert_plan(o.plan))
    state.value_checks = value_checks.checks(state.gm)  # (autopar/value_checks.py)
    return state


def autograd_pass(state: CompileState) -> CompileState:
    """After it: every stage has ``program``, its joint forward + backward ATen graph, every
    placeholder and output with a role (param / buffer / input / tangent; loss / act / grad /
    input_grad), parameters named as the user names them."""
    pipelined = state.options.pipeline is not None
    for st in state.stages:
        if st.twin_of is not None:  # a copy of its twin's program, made after the per-stage passes
            continue
        role = ("last" if st.spec.is_last else "middle") if pipelined else None
        st.program = joint_program(st.gm, st.example, state.model, stage=role, device=st.ctx.device)
    return state
