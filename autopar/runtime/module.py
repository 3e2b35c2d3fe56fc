"""ParallelModule: runs the per-rank program on torch.distributed process groups.

The user's module keeps its structure; its parameters are replaced by DTensors with the
plan's placements (so an unchanged torch.optim.AdamW works on them and its state is sharded
with them). ``train_step`` slices the global batch, runs the per-rank joint graph and
writes gradients to ``param.grad`` (accumulating, as autograd does).

Measuring is opt-in (it costs Python time on every op): while ``measure()`` is on, ``counter``
counts what the process hands to the process group (autopar/runtime/measure.py: every ``c10d``
op, independent of the graph); while ``track_memory()`` is on, the allocator's peak, the live
storages by category and the FLOPs of each step (autopar/runtime/memory.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from autopar.errors import InputError
from autopar.ir import CommRecord, bytes_by_collective, fmt_dtype, fmt_placements, info
from autopar.plan import replicated_lines
from autopar.runtime.common import LossScaler, bytes_lines, local_inputs
from autopar.runtime.measure import CommMeter, both, mesh_axes, switch
from autopar.runtime.memory import MemoryTracker, optimizer_state_bytes, tensor_bytes


class ParallelModule:
    """The compiled program. ``parameters()`` are DTensors; ``train_step`` runs fwd+bwd."""

    pipelined = False  # (PipelineModule: True) what tools branch on

    def __init__(self, module: nn.Module, ctx, program, example_inputs, has_loss, inputs, forward_builder,
                 sync_program=None):
        self.module = module
        self.ctx = ctx
        self.mesh = ctx.mesh
        self.program = program
        self.has_loss = has_loss
        self.input_mode = inputs
        self.example_shapes = [(tuple(x.shape), x.dtype) for x in example_inputs]
        self.counter = CommMeter(mesh_axes(self.mesh))  # counts while measure() is on
        self._counting = False
        self._forward_builder = forward_builder
        self._forward_program = None
        self._distribute_parameters()
        self._gm = program.local
        self.sync_program = sync_program  # accumulate=K: reduces the summed gradients once per step
        self._sync_gm = sync_program.local if sync_program is not None else None
        self.accumulate = ctx.accumulate
        # fp16: dynamic loss scaling (torch.amp.GradScaler's constants)
        self.scaler = LossScaler(ctx.loss_scale)
        self.memory: MemoryTracker | None = None
        self._loss_dtype = next((n.meta["val"].dtype for n in program.graph.nodes if n.op == "placeholder"
                                 and (info(n).role or ("",))[0] == "tangent"), torch.float32)
        self.steps = 0

    # ---------------------------------------------------------------- parameters
    def _distribute_parameters(self):
        placements = self.ctx.placed.placements
        for full_name, p in list(self.module.named_parameters()):
            mod_name, _, attr = full_name.rpartition(".")
            mod = self.module.get_submodule(mod_name) if mod_name else self.module
            dt = distribute_tensor(p.detach().to(self.ctx.device), self.mesh, placements[full_name])
            mod.register_parameter(attr, nn.Parameter(dt, requires_grad=p.requires_grad))

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, sd, strict: bool = True):
        return self.module.load_state_dict(sd, strict=strict)

    # ---------------------------------------------------------------- inputs
    def _local_inputs(self, inputs, n_expected):
        return local_inputs(inputs, n_expected, self.example_shapes, self.input_mode, self.ctx,
                            "ParallelModule.train_step / __call__")

    def _args(self, program, local_inputs, tangents=()):
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        args = []
        for kind, what in program.inputs:
            if kind == "param":
                args.append(params[what].to_local())
            elif kind == "buffer":
                b = buffers.get(what, program.buffers.get(what))
                args.append(b.to(self.ctx.device))
            elif kind == "input":
                args.append(local_inputs[what])
            else:
                args.append(tangents[what])
        return args

    # ---------------------------------------------------------------- running
    def train_step(self, *inputs) -> torch.Tensor:
        """Forward + backward on the global batch; gradients land on ``parameters()``.

        With ``accumulate=K`` the batch runs as K micro-batches whose gradients are summed
        locally and synchronised once; the loss returned is the mean of the micro-batch losses.
        With fp16 dynamic loss scaling, a step whose gradients overflow leaves ``.grad`` untouched
        (so ``optimizer.step()`` changes nothing), halves the scale and counts ``skipped_steps``.
        """
        with self._measuring(memory=True):
            return self._train_step(inputs)

    def _train_step(self, inputs) -> torch.Tensor:
        local = self._local_inputs(inputs, len(self.example_shapes))
        k = self.accumulate
        scale = self.loss_scale or 1.0
        tangent = torch.full((), scale / k, dtype=self._loss_dtype, device=self.ctx.device)
        micro = [[torch.chunk(x, k, dim=0)[i] for x in local] for i in range(k)] if k > 1 else [local]
        losses, acc = [], None
        for mb in micro:
            outs = self._run(self._gm, self.program, self._args(self.program, mb, (tangent,)))
            grads = [o for (kind, _), o in zip(self.program.outputs, outs) if kind == "grad"]
            losses += [o for (kind, _), o in zip(self.program.outputs, outs) if kind == "loss"]
            acc = grads if acc is None else [a.add_(g) if a is not None else g for a, g in zip(acc, grads)]
            del outs, grads
        names = [what for kind, what in self.program.outputs if kind == "grad"]
        if self._sync_gm is not None:
            # (a parameter the loss does not depend on has no gradient, and no sync input)
            acc = list(self._run(self._sync_gm, self.sync_program, [a.contiguous() for a in acc if a is not None]))
            names = [what for _, what in self.sync_program.outputs]
        self.steps += 1
        if self.loss_scale is not None and not self.scaler.unscale(acc, self.ctx.device):
            return (sum(losses) / len(losses)).detach()
        params = dict(self.module.named_parameters())
        for name, o in zip(names, acc):
            if o is None:
                continue
            p = params[name]
            g = DTensor(o.detach(), DTensorSpec(self.mesh, p.placements, TensorMeta(p.shape, p.stride(), p.dtype)),
                        requires_grad=False)
            p.grad = g if p.grad is None else p.grad + g
        return (sum(losses) / len(losses)).detach()

    def _run(self, gm, program, args):
        # the program IS the backward: autograd must not also record it (parameters are
        # requires_grad DTensors, so it would, and keep every activation a second time)
        with torch.no_grad():
            if self.memory is None:
                return gm(*args)
            return self.memory.run(gm, args, program)

    # fp16 loss scaling (runtime/common.py LossScaler), read and set as before
    loss_scale = property(lambda self: self.scaler.scale, lambda self, v: setattr(self.scaler, "scale", v))
    skipped_steps = property(lambda self: self.scaler.skipped_steps)
    _growth_tracker = property(lambda self: self.scaler.growth_tracker,
                               lambda self, v: setattr(self.scaler, "growth_tracker", v))

    # ---------------------------------------------------------------- measuring
    def measure(self, on: bool = True) -> contextlib.AbstractContextManager:
        """Count the bytes this rank hands to the process group (``counter``) on the following
        steps and eval calls. Costs Python time on every op: off by default. As a context
        manager (``with pm.measure(): ...``) it restores the previous setting on exit."""
        return switch(self, "_counting", on)

    def track_memory(self, on: bool = True) -> contextlib.AbstractContextManager:
        """Measure per-rank memory and FLOPs on the following steps (``memory_report``); also
        counts bytes, as ``measure()``. As a context manager it restores the previous settings."""
        mem = switch(self, "memory", MemoryTracker(self.ctx.device) if on else None)
        count = switch(self, "_counting", on or self._counting)
        return both(mem, count)

    def _measuring(self, memory: bool):
        stack = contextlib.ExitStack()
        if self._counting:
            stack.enter_context(self.counter)  # outermost: it sees the c10d ops under the others
        if memory and self.memory is not None:
            stack.enter_context(self.memory.step())
        return stack

    def memory_report(self, optimizer=None) -> dict:
        """Bytes this rank holds, measured (the maximum over the steps tracked since
        ``track_memory()``). ``optimizer``: include its state (exp_avg, exp_avg_sq...).

        - ``parameters``, ``gradients``, ``optimizer_state``: the tensors held now;
        - ``program_peak``: the allocator's peak during a step above its level at the step's start;
          ``step_peak`` = parameters + optimizer state + program_peak; on CPU
          ``program_peak_without_backend``: the same without the process group's own buffers;
        - ``tensor_peak``, ``peak_<category>``, ``max_<category>``, ``model_states_peak``
          (parameters + optimizer state + the most parameter copies and gradients in flight held at
          once): the storages the programs' ops created, alive op by op (memory.ProgramMeter);
        - ``flops_per_step``: torch's FLOP formulas on the ops the programs ran.
        """
        params = tensor_bytes(p for p in self.module.parameters())
        grads = tensor_bytes(p.grad for p in self.module.parameters())
        opt = optimizer_state_bytes(optimizer)
        m = self.memory or MemoryTracker(self.ctx.device)
        out = {"parameters": params, "gradients": grads, "optimizer_state": opt,
               "program_peak": m.program_peak, "step_peak": params + opt + m.program_peak,
               "program_peak_without_backend": m.program_peak_without_backend,
               "tensor_peak": m.tensor_peak, **{f"peak_{k}": v for k, v in m.at_peak.items()},
               **{f"max_{k}": v for k, v in m.max_by.items()},
               "model_states_peak": params + opt + m.model_state_peak, "flops_per_step": m.flops / max(1, m.steps)}
        if self.ctx.device.type == "cuda":
            out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return out

    def __call__(self, *inputs):
        """Forward only (eval): returns the model's output, replicated on every rank."""
        if self._forward_program is None:
            if self._forward_builder is None:
                raise InputError("this program was compiled with capture_eval=False: it has no forward-only "
                                 "program", where="ParallelModule.__call__", fix="compile with capture_eval=True")
            self._forward_program = self._forward_builder()
            self._fwd_gm = self._forward_program.local
        n = len(self.example_shapes) - (1 if self.has_loss else 0)
        local = self._local_inputs(inputs, n)
        with torch.no_grad(), self._measuring(memory=False):
            outs = self._fwd_gm(*self._args(self._forward_program, local))
        return outs[0] if len(outs) == 1 else tuple(outs)

    forward = __call__

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
                 + (f" ({self.program.recomputed} values recomputed)" if getattr(self.program, "recomputed", 0) else "")]
        lines = [f"autopar program on mesh {dict(zip(ctx.axis_names, ctx.axis_sizes))}, rank coord {ctx.coord}",
                 f"plan: {ctx.plan.describe()}; " + ", ".join(opts), "", "parameters (as stored):"]
        for name, p in self.module.named_parameters():
            local = p.to_local().shape if isinstance(p, DTensor) else p.shape
            lines.append(f"  {name:48s} {list(p.shape)!s:>14s} {fmt_placements(p.placements):>12s}"
                         f" local {list(local)}")
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
        if self.memory is not None:
            m = self.memory_report(optimizer)
            lines += ["", "memory on this rank (measured; bytes):",
                      f"  parameters {m['parameters']:,}  gradients {m['gradients']:,}  "
                      f"optimizer state {m['optimizer_state']:,}" + ("" if optimizer else " (pass the optimizer)"),
                      f"  step peak {m['step_peak']:,} = parameters + optimizer state + the allocator's peak during "
                      f"the step {m['program_peak']:,}",
                      f"  the programs' tensors at their peak {m['tensor_peak']:,}: parameter copies "
                      f"{m['peak_param_copies']:,}, gradients in flight {m['peak_grads_in_flight']:,}, activations "
                      f"{m['peak_activations']:,}",
                      f"  FLOPs per step {m['flops_per_step']:,.0f}"]
        lines.append("compile time: " + ", ".join(f"{k} {v:.2f}s" for k, v in ctx.timings.items()))
        return "\n".join(lines)
