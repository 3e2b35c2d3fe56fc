"""The pass pipeline, in the order the program is processed.

    propagate    a ShardSpec on every value, from the plan's compute placements and the op rules
    recompute    activation checkpointing: which forward values backward recomputes
    state        parameters take their storage layout (ZeRO shards) and are gathered where
                 used; mixed-precision casts run on the shard; gradients reduced in reduce_dtype
    collectives  a redistribute node wherever a producer's placements differ from what its
                 consumer needs, each tagged with axis, bytes, reason and source line
    localize     trace the per-rank program: global shapes become local ones and every
                 redistribute becomes explicit _c10d_functional collectives + wait_tensor

Every pass has the signature ``pass(program, ctx) -> program``; ``run_passes`` runs them in
order, can skip passes by name, and in debug mode checks the IR invariants (autopar/ir.py)
after each pass. Later passes (pipeline, overlap, lower) slot into PASSES.
"""

from __future__ import annotations

import time

from autopar.ir import check_invariants
from autopar.passes.collectives import collectives_pass
from autopar.passes.localize import localize_pass
from autopar.passes.propagate import propagate_pass
from autopar.passes.recompute import recompute_pass
from autopar.passes.state import state_pass

PASSES = [
    ("propagate", propagate_pass),
    ("recompute", recompute_pass),
    ("state", state_pass),
    ("collectives", collectives_pass),
    ("localize", localize_pass),
]


def run_passes(program, ctx, *, skip=(), debug=False, label=""):
    for name, fn in PASSES:
        if name in skip:
            continue
        if getattr(ctx, "progress", None):
            ctx.progress(f"{label}{name}")
        t0 = time.perf_counter()
        program = fn(program, ctx)
        ctx.timings[f"{label}{name}"] = time.perf_counter() - t0
        if debug:
            graph = program.graph if hasattr(program, "graph") else program
            check_invariants(graph, name)
    return program
