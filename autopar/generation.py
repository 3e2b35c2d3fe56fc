"""Compiling generation's programs: the compiler's side of ``pm.generate``
(autopar/runtime/generate.py runs them).

``compile`` hands the runtime ``build`` (bound to its options) as ``ParallelModule``'s generation
builder; the runtime calls it on the first ``pm.generate`` for each (batch, prompt length, cache
length) and keeps the programs. Two programs, captured from the user's model (autopar/capture.py)
and compiled through the same per-stage passes (propagate ... overlap, passes/__init__.py) under
the training program's plan, mesh and Context, running on its placed parameters:

    prefill  (ids [B, L], positions [L], *cache) -> logits of the last position [B, V]
    decode   (ids [B, 1], positions [1], *cache) -> logits [B, V]

The cache's layout is the plan's, not a choice made here: propagation is run once with the
cache replicated, and each cache input takes the placements of the keys / values written into
it (under ``{"tp": "megatron"}``, K/V projections are column-parallel, so the heads are sharded
and each rank holds ``kv_heads / tp`` of them: 1/tp of the cache), minus any shard of the
positions' dimension. torch.export turns the in-place update of a cache input into an output
(role ``("cache", i)``); the per-rank program writes it back in place (``_in_place``).
"""

from __future__ import annotations

import time

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autopar.capture import capture_forward, swapped
from autopar.errors import CaptureError, PlanError
from autopar.ir import Program, info, spec_of
from autopar.passes import run_stage_passes
from autopar.passes.propagate import propagate_pass
from autopar.runtime.generate import WHERE, Programs, param_dtype


def build(pm, path, batch: int, prompt: int, max_len: int, *, skip=(), debug: bool = False) -> Programs:
    """Capture and compile the prefill and decode programs of ``pm`` (a ParallelModule) for
    ``path`` (its model's cache path: runtime/generate.py ``cache_path``); ``skip`` / ``debug``:
    the training compile's ``skip_passes`` / ``debug``."""
    ctx = pm.ctx
    t0 = time.perf_counter()
    shape = path.shape(pm.module)
    dtype = ctx.compute_dtype or param_dtype(pm.module)
    glob = (batch, shape.kv_heads, max_len, shape.head_dim)
    cache = [torch.empty(glob, dtype=dtype, device="meta") for _ in range(2 * shape.layers)]
    ids = torch.zeros((batch, prompt), dtype=torch.long, device="meta")
    pos = torch.zeros((prompt,), dtype=torch.long, device="meta")
    step = path.step
    buffers = dict(pm.module.named_buffers(remove_duplicate=False))

    def check(prog: Program) -> None:  # (before the capture cache keeps the trace)
        made = [name for name, t in prog.buffers.items() if name not in buffers and t.is_meta]
        if made:  # a tensor the model's code creates, traced on meta here: its value is lost
            raise CaptureError(f"{path.name}'s step creates tensor constant(s) {made} in forward, which generation "
                               "traces on the meta device (the parameters are sharded by now)", where=WHERE,
                               fix="register them as buffers of the model")

    with swapped(pm.module, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), False):
        prefill = capture_forward(pm.module, (ids, pos, *cache), ctx.compute_dtype, call=step, check=check)
        decode = capture_forward(pm.module, (ids[:, :1], pos[:1], *cache), ctx.compute_dtype, call=step, check=check)
    for prog in (prefill, decode):
        _check_updates(prog, 2 * shape.layers, path)
    layout = _infer_layout(decode, ctx)
    ctx.cache_layout = dict(layout)
    skip = tuple(skip) + ("recompute",)
    try:
        prefill = run_stage_passes(prefill, ctx, debug=debug, label="prefill ", skip=skip)
        decode = run_stage_passes(decode, ctx, debug=debug, label="decode ", skip=skip)
    finally:
        ctx.cache_layout = {}
    for prog in (prefill, decode):
        _in_place(prog)
    placements = tuple(layout[i] for i in sorted(layout))
    return Programs(prefill, decode, placements, tuple(_local(glob, p, ctx.axis_sizes) for p in placements),
                    time.perf_counter() - t0)


def _local(shape, placements, sizes) -> tuple[int, ...]:
    local = list(shape)
    for p, n in zip(placements, sizes):
        if isinstance(p, Shard):
            local[p.dim] //= n
    return tuple(local)


def _check_updates(program: Program, n: int, path) -> None:
    updated = sorted(what for kind, what in program.outputs if kind == "cache")
    if updated != list(range(2, 2 + n)):
        raise PlanError(f"{path.name}'s step updated cache inputs {updated}, expected every one of the {n} cache "
                        "tensors (inputs 2..) once", where=WHERE,
                        fix="the model must write each layer's keys and values into the cache it is given")


def _cache_writes(program: Program):
    """Per cache placeholder: the index_put that writes into it (its only use), or None."""
    for n in program.graph.nodes:
        if n.op != "placeholder" or (info(n).role or ("",))[0] != "cache":
            continue
        users = list(n.users)
        put = users[0] if len(users) == 1 and users[0].target is torch.ops.aten.index_put.default \
            and users[0].args[0] is n else None
        yield n, put


def _infer_layout(program: Program, ctx) -> dict[int, tuple[Placement, ...]]:
    """Each cache input's placements: those of the keys / values written into it under the plan
    (propagation run once with the cache replicated: the written values do not depend on it), with
    a shard of an indexed dimension (the positions) or a partial sum made replicated."""
    ctx.cache_layout = {}
    propagate_pass(program, ctx)
    rep = tuple(Replicate() for _ in ctx.axis_sizes)
    layout = {}
    for ph, put in _cache_writes(program):
        what = info(ph).role[1]
        if put is None:
            layout[what] = rep
            continue
        indexed = {d for d, ix in enumerate(put.args[1]) if ix is not None}
        layout[what] = tuple(Replicate() if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim in indexed)
                             else p for p in spec_of(put.args[2]).placements)
    return layout


def _in_place(program: Program) -> None:
    """In the per-rank program, each cache write ``index_put(cache, ...)`` becomes ``index_put_``:
    the cache input has no other reader, so a step writes its tokens' keys and values instead of
    copying the whole cache (the output is the input tensor, updated)."""
    gm = program.local
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, (kind, _) in zip(placeholders, program.inputs):
        users = list(n.users)
        if kind == "cache" and len(users) == 1 and users[0].target is torch.ops.aten.index_put.default \
                and users[0].args[0] is n:
            users[0].target = torch.ops.aten.index_put_.default
    gm.recompile()
