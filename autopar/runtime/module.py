"""ParallelModule: an SPMD program on torch.distributed process groups: one stage, run by the
executor (autopar/runtime/executor.py) as its joint forward + backward per micro-batch.

The user's module keeps its structure; its parameters are replaced by DTensors with the
plan's placements (so an unchanged torch.optim.AdamW works on them and its state is sharded
with them), or, where the plan replicates every parameter on every mesh axis (``ddp``), by plain
``nn.Parameter``s holding the whole tensor (runtime/common.py ``plain_parameters``). ``train_step`` (autopar/runtime/base.py, shared with pipelines) slices the global
batch, runs the per-rank joint graph and writes gradients to ``param.grad`` (accumulating, as
autograd does). ``pm(x)`` runs the forward-only program.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.errors import InputError
from autopar.ir import CommRecord, Stage, bytes_by_collective, fmt_dtype, fmt_placements, info
from autopar.plan import replicated_lines
from autopar.runtime.base import Runtime
from autopar.context import compile_notes
from autopar.runtime import failure
from autopar.runtime.common import bytes_lines, check_indices, local_inputs, local_tensor, plain_parameters
from autopar.runtime.executor import Executor, call
from autopar.runtime.measure import CommMeter, mesh_axes
from autopar.runtime.p2p import P2P


class ParallelModule(Runtime):
    """The compiled SPMD program. ``parameters()`` are DTensors (plain tensors where every parameter
    is replicated: ``plain``); ``train_step`` runs fwd+bwd."""

    def __init__(self, module: nn.Module, stage: Stage, example_inputs, has_loss, inputs, forward_builder,
                 generation_builder=None):
        ctx = stage.ctx
        super().__init__(module, ctx, example_inputs, inputs, CommMeter(mesh_axes(ctx.mesh)))
        self.mesh = ctx.mesh
        self.stage = stage
        self.program = stage.program
        self.sync_program = stage.sync  # accumulate=K: reduces the summed gradients once per step
        self.has_loss = has_loss
        self.accumulate = ctx.accumulate
        self._forward_builder = forward_builder
        self._forward_program = None
        # the compiler's: (pm, cache path, batch, prompt, cache length) -> generation's programs
        # (autopar/generation.py), built on the first pm.generate for each and kept here
        self._generation_builder = generation_builder
        self._generation = {}  # (batch, prompt, cache length) -> generation's programs (runtime/generate.py)
        self.generate_stats = None
        self.plain = plain_parameters(ctx.placed.placements)  # every parameter replicated: plain tensors
        for full_name, p in list(self.module.named_parameters()):
            self._place(full_name, p, self.mesh, ctx.placed.placements[full_name], plain=self.plain)
        actions = [("FB", stage.index, mb) for mb in range(self.accumulate)]
        self.executor = Executor({stage.index: stage}, actions, self.accumulate, ctx.device,
                                 P2P([], None, 0, None, ctx.device))

    def load_state_dict(self, sd, strict: bool = True):
        return self.module.load_state_dict(sd, strict=strict)

    def __call__(self, *inputs):
        """Forward only (eval): returns the model's output, replicated on every rank."""
        if self._forward_program is None:
            if self._forward_builder is None:
                raise InputError("this program was compiled with capture_eval=False: it has no forward-only "
                                 "program", where="ParallelModule.__call__", fix="compile with capture_eval=True")
            self._forward_program = self._forward_builder()
        n = len(self.example_shapes) - (1 if self.has_loss else 0)
        with failure.call(self, "forward") as call:
            local = local_inputs(inputs, n, self.example_shapes, self.input_mode, self.ctx, "ParallelModule.__call__")
            if self.guard:
                check_indices(inputs, self.index_checks, "ParallelModule.__call__")
            call.communicating()
            outs = self._run_program(self._forward_program, local)
        return outs[0] if len(outs) == 1 else tuple(outs)

    forward = __call__

    def _run_program(self, program, inputs):
        """Run a forward-only per-rank program (eval, generation's steps) on this rank's parameter
        shards, the module's buffers and ``inputs`` (this rank's, by user input index); returns its
        outputs whose role is ``"output"``."""
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        args = [local_tensor(params[what]) if kind == "param" else
                buffers.get(what, program.buffers.get(what)).to(self.ctx.device) if kind == "buffer" else
                inputs[what] for kind, what in program.inputs]
        gm = self.executor.runnable(program.local)
        with torch.no_grad(), self._measuring(memory=False):
            outs = call(gm, args)
        return [o for o, (kind, _) in zip(outs, program.outputs) if kind == "output"]

    def generate(self, input_ids, max_new_tokens: int, *, eos_token_id: int | None = None,
                 pad_token_id: int | None = None, attention_mask=None):
        """Greedy decoding with a static KV cache (autopar/runtime/generate.py): ``input_ids`` [B, L]
        (equal-length prompts, the same on every rank) -> [B, L + n] token ids, n <= max_new_tokens,
        the same on every rank. ``eos_token_id``: a sequence that produced it is padded with
        ``pad_token_id`` (default: eos) from then on, and the call stops once every sequence has
        (as Hugging Face's ``generate``). Two programs (prefill, decode step) are compiled under this
        program's plan on the first call for each (batch, prompt length, cache length);
        ``pm.generate_stats`` says what the last call did."""
        from autopar.runtime.generate import generate

        return generate(self, input_ids, max_new_tokens, eos_token_id, pad_token_id, attention_mask)

    # ---------------------------------------------------------------- visibility
    def collectives(self, program=None) -> list[CommRecord]:
        """Every collective in the per-rank training program, in execution order."""
        programs = [program] if program is not None else [self.program] * self.accumulate + (
            [self.sync_program] if self.sync_program is not None else [])
        recs = [info(n).comm for p in programs for n in p.local.graph.nodes if info(n).comm is not None]
        if program is None and self.loss_scale is not None and dist.get_world_size() > 1:
            recs.append(CommRecord("all_reduce", self.counter.axis_of(dist.group.WORLD), dist.get_world_size(), 4,
                                   "fp16 loss scaling: did any rank's gradients overflow?", "", "backward"))
        return recs

    def predicted_bytes(self) -> dict[str, float]:
        """Bytes per rank per step the compiler predicts, keyed like ``counter.summary()``."""
        return bytes_by_collective(self.collectives())

    def report(self, optimizer=None) -> str:
        ctx = self.ctx
        opts = [f"precision {fmt_dtype(ctx.compute_dtype or torch.float32)}"]
        if ctx.compute_dtype is not None:
            opts.append(f"gradients reduced in {fmt_dtype(ctx.reduce_dtype)}")
        if self.loss_scale is not None:
            opts.append(f"loss scale {self.loss_scale:g} ({self.skipped_steps} steps skipped)")
        opts += [f"accumulate {ctx.accumulate}", f"recompute {ctx.recompute}"
                 + (f" ({self.program.recomputed} values recomputed)" if self.program.recomputed else "")]
        lines = [f"autopar program on mesh {dict(zip(ctx.axis_names, ctx.axis_sizes))}, rank coord {ctx.coord}",
                 f"plan: {ctx.plan.describe()}; " + ", ".join(opts)]
        if getattr(self, "auto_plan", None):  # autopar.compile(plan="auto"): what it chose, and why
            lines.append(self.auto_plan)
        lines += compile_notes([ctx])
        lines += ["", "parameters (as stored):"]
        for name, p in self.module.named_parameters():
            local = local_tensor(p).shape
            lines.append(f"  {name:48s} {list(p.shape)!s:>14s} {fmt_placements(ctx.placed.placements[name]):>12s}"
                         f" local {list(local)}" + ("" if isinstance(p, DTensor) else " (plain tensor)"))
        lines += replicated_lines(ctx.placed, dict(self.module.named_parameters()))
        recs = self.collectives()
        lines += ["", f"collectives per step ({len(recs)}):"]
        for r in recs:
            lines.append(f"  {r.phase:8s} {r.kind:14s} {r.axis:>4s} {r.payload_bytes:>10,d} B  {r.reason}")
            lines.append(f"{'':12s}needed at {r.source}")
            if r.producer and r.producer != r.source:
                lines.append(f"{'':12s}value from {r.producer}")
        lines.append("")
        lines += bytes_lines(self.predicted_bytes(), self.counter)
        for axis, names in ctx.placed.unsharded.items():
            lines.append(f"  note: {len(names)} parameter(s) have no dim divisible by '{axis}' and are stored whole: "
                         + ", ".join(names))
        lines += self.memory_lines(optimizer)
        lines += self.clock.lines()
        lines.append("compile time: " + ", ".join(f"{k} {v:.2f}s" for k, v in ctx.timings.items()))
        if self.inductor is not None:
            lines.append(self.inductor.line())
        return "\n".join(lines)
