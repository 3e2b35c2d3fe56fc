"""Runtime: what every compiled program does on its rank, SPMD or pipelined.

One training step, the same for both (``train_step``):

1. this rank's slice of the user's batch, checked against the compiled shapes and dtypes and its
   token ids / class targets against their tables (before anything is sent), cut into the
   step's micro-batches (``accumulate=K``, or the pipeline's M);
2. the executor runs this rank's action list (autopar/runtime/executor.py): an SPMD program is
   one stage whose actions are its joint forward + backward per micro-batch; a pipeline's are its
   schedule's F / B / I / W actions, with point-to-point transfers between stages;
3. each stage's gradient sync program reduces the gradients summed over the micro-batches;
4. fp16: the loss scaler unscales them and decides over the whole world whether the step
   overflowed (then ``.grad`` is left as it was);
5. the gradients land on the parameters' ``.grad`` (DTensors in their storage placements, or
   plain tensors on plain parameters; accumulating as autograd does).

Every wait of a step is bounded by ``timeout`` and woken by another rank's failure; an
exception on one rank is raised there as it is, and as ``RankFailure`` naming it on every other
rank (autopar/runtime/failure.py).

Each rank times its steps, compute against waiting, and every ``straggler_window`` steps the
ranks compare them (autopar/runtime/steptimes.py).

Parameters are the user's module's, replaced in place by DTensors with the plan's placements,
so an unchanged ``torch.optim`` optimizer steps them and shards its state with them; where the
plan replicates every parameter on every mesh axis (``ddp``), by plain ``nn.Parameter``s holding
the whole tensor, as DistributedDataParallel's are (``common.plain_parameters``: the optimizer's
ops then run at plain-tensor speed).

Measuring is opt-in (it costs Python time on every op): ``measure()`` counts what the process
hands to the process group (autopar/runtime/measure.py, at the ``c10d`` ops, independent of the
graphs); ``track_memory()`` adds the allocator's peak, the live storages by category and the FLOPs
of each step (autopar/runtime/memory.py).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar import dropout
from autopar import torch_compat as tc
from autopar.errors import TrainingError
from autopar.runtime import failure, steptimes
from autopar.runtime.common import LossScaler, check_indices, local_inputs, local_tensor
from autopar.runtime.executor import Executor
from autopar.runtime.measure import both, switch
from autopar.runtime.memory import MemoryTracker, optimizer_state_bytes, tensor_bytes
from autopar.runtime.weights import empty_dtensor, tied_names


def _agreed_seed(device) -> int:
    """Rank 0's ``torch.initial_seed()`` on every rank (one 8-byte broadcast when compiling)."""
    seed = torch.initial_seed() & ((1 << 63) - 1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([seed], dtype=torch.int64, device=device if device.type != "meta" else "cpu")
        dist.broadcast(t, src=0)
        seed = int(t.item())
    return seed


class Runtime:
    """The compiled program on one rank. Subclasses set ``executor`` (the stages this rank runs,
    its action list), ``counter`` (a CommMeter) and ``example_shapes`` / ``input_mode``."""

    pipelined = False  # what tools branch on (PipelineModule: True)
    executor: Executor
    where = "train_step"  # how errors about the inputs name the call

    def __init__(self, module: nn.Module, ctx, example_inputs, inputs: str, counter):
        self.module = module
        self.ctx = ctx
        self.input_mode = inputs
        self.example_shapes = [(tuple(x.shape), x.dtype) for x in example_inputs]
        self.counter = counter  # counts while measure() is on
        self._counting = False
        self.scaler = LossScaler(ctx.loss_scale)  # fp16: dynamic loss scaling (GradScaler's constants)
        self.steps = 0
        # dropout masks are drawn from this seed, the step and each element's global position
        # (autopar/dropout.py): rank 0's torch.initial_seed(), agreed here; set pm.seed to choose
        self.seed = _agreed_seed(ctx.device)
        self.draw = dropout.Draw()  # the step's dropout draw (seed, step, micro-batch), current during train_step
        self._tied = tied_names(module)  # {alias: name}: parameters registered under several names
        # parameters / buffers of a model built on meta, still empty (load_pretrained or load fills them)
        self._unloaded: set[str] = set()
        self._timeout = failure.DEFAULT_TIMEOUT_S
        self.index_checks = []  # inputs holding token ids / class targets, checked per step (common.py)
        self._guard = True
        self.clock = steptimes.StepClock()  # per step: compute / waiting on this rank (straggler_* options)

    @property
    def timeout(self) -> float:
        """Seconds any wait of a step may block before the step fails on every rank (compile's
        ``timeout=``; a pipeline's transfers: AUTOPAR_P2P_TIMEOUT where set)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = float(seconds)
        if not os.environ.get("AUTOPAR_P2P_TIMEOUT"):
            self.executor.p2p.timeout = float(seconds)

    @property
    def guard(self) -> bool:
        """Bounded waits, batch value checks and the failure side channel (autopar/runtime/failure.py);
        on by default. Off: the programs' own functional collectives and unbounded waits (what
        benchmarks/faults.py --overhead compares against)."""
        return self._guard

    @guard.setter
    def guard(self, on: bool) -> None:
        self._guard = self.executor.guard = self.executor.p2p.guard = bool(on)

    # ---------------------------------------------------------------- parameters
    def _place(self, full_name: str, p: torch.Tensor, mesh, placements, plain: bool = False) -> None:
        """Replace parameter ``full_name`` of the user's module by a DTensor (``mesh`` None: a
        meta tensor, a parameter this rank does not hold; ``plain``: a parameter replicated on
        every axis, as a plain tensor holding the whole value, rank 0's as distribute_tensor's)."""
        if mesh is None:
            new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
        elif p.is_meta:  # a model built on meta: this rank's shard, empty until load_pretrained / load
            value = empty_dtensor(p, mesh, placements, self.ctx.device)
            new = nn.Parameter(value.to_local() if plain else value, requires_grad=p.requires_grad)
            self._unloaded.add(full_name)
        else:
            value = distribute_tensor(p.detach().to(self.ctx.device), mesh, placements)  # (broadcasts rank 0's)
            new = nn.Parameter(value.to_local() if plain else value, requires_grad=p.requires_grad)
        new._autopar_placed = True  # (autopar.compile refuses a module compiled before)
        # tied weights (an LM head reading the embedding's weight): every module attribute that
        # holds this parameter gets the same new one, so the tie survives and named_parameters()
        # still lists it once, under its first name (the name the program uses)
        for alias in [full_name] + [a for a, c in self._tied.items() if c == full_name]:
            mod_name, _, attr = alias.rpartition(".")
            (self.module.get_submodule(mod_name) if mod_name else self.module).register_parameter(attr, new)

    def named_parameters(self):
        return self.module.named_parameters()

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def state_dict(self):
        """The module's state dict; a fused weight cut into parts (autopar/unfuse.py) under its own
        name, whole (gathered: call on every rank)."""
        from autopar.parts import to_fused

        out = self.module.state_dict()
        to_fused(out, self.module)
        return out

    # ---------------------------------------------------------------- checkpoints
    def save(self, path, optimizer=None, extra: dict | None = None, async_save: bool = False):
        """Write a checkpoint to the folder ``path`` (call on every rank): each rank writes its own
        shards (torch.distributed.checkpoint), with ``optimizer``'s state, every rank's RNG state,
        the loss scaler, ``steps`` and ``extra`` (JSON: e.g. the data loader's position). Atomic:
        written beside ``path`` and renamed once complete; an existing ``path`` is an error.
        ``async_save``: returns a Future and writes in the background from a staged CPU copy of the
        state (it costs that memory until the write ends). autopar/runtime/checkpoint.py."""
        from autopar.runtime import checkpoint

        return checkpoint.save(self, path, optimizer, extra, async_save)

    def load(self, path, optimizer=None) -> dict:
        """Load a checkpoint written by ``save`` under any mesh or plan (resharded to this one) on
        every rank; returns its ``extra``. A folder without its COMPLETE marker is refused."""
        from autopar.runtime import checkpoint

        return checkpoint.load(self, path, optimizer)

    def load_pretrained(self, path, strict: bool = True, verbose: bool = True):
        """Load a Hugging Face safetensors checkpoint (a folder with ``model.safetensors``, or the
        sharded files + ``model.safetensors.index.json``) into the parameters, each rank reading
        only the slices its shards hold; for a model built on meta (``autopar.init_empty_weights()``
        or ``torch.device("meta")``) and compiled. Returns a LoadReport (bytes read, peak memory per
        rank). autopar/runtime/weights.py."""
        from autopar.runtime import weights

        return weights.load_pretrained(self, path, strict=strict, verbose=verbose)

    # ---------------------------------------------------------------- gradients
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the norm of every gradient shard on
        every rank and pipeline stage (replicated values counted once), one all-reduce; scales
        ``.grad`` in place by ``min(1, max_norm / (total + 1e-6))``; returns the total norm (the same
        on every rank). Call on every rank, after ``train_step``. autopar/runtime/grads.py."""
        from autopar.runtime import grads

        return grads.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach)

    # ---------------------------------------------------------------- one step
    def train_step(self, *inputs) -> torch.Tensor:
        """Forward + backward on the global batch (``inputs="global"``; this rank's part with
        ``inputs="local"``); gradients land on ``parameters()``; returns the step's loss (the mean
        of the micro-batch losses).

        With ``accumulate=K`` (or a pipeline's M micro-batches) the gradients are summed locally
        and synchronised once. With fp16 dynamic loss scaling, a step whose gradients overflow
        leaves ``.grad`` untouched (so ``optimizer.step()`` changes nothing), halves the scale and
        counts ``skipped_steps``."""
        if self._unloaded:
            raise TrainingError(f"the model was built on the meta device and {len(self._unloaded)} of its parameters/"
                                f"buffers hold no weights yet: {', '.join(sorted(self._unloaded)[:4])}"
                                + (" ..." if len(self._unloaded) > 4 else ""), where=f"{type(self).__name__}.train_step",
                                fix="load them first: pm.load_pretrained(hf_folder) or pm.load(checkpoint)")
        where = f"{type(self).__name__}.{self.where}"
        self.clock.start()
        with failure.call(self, "train_step") as call:
            with self._measuring(memory=True):
                local = local_inputs(inputs, len(self.example_shapes), self.example_shapes, self.input_mode,
                                     self.ctx, where)
                if self._guard:
                    check_indices(inputs, self.index_checks, where)
                call.communicating()  # (a failure from here on breaks the program on every rank)
                m = self.executor.microbatches
                micro = [[torch.chunk(x, m, dim=0)[i] if x.ndim > 0 else x for x in local] for i in range(m)] \
                    if m > 1 else [local]
                del local
                self.draw.seed, self.draw.step = self.seed, self.steps
                with dropout.drawing(self.draw):  # (what this step's dropouts draw: autopar/dropout.py)
                    losses = self.executor.run(micro, self._shared_values(), self.loss_scale or 1.0, self.draw)
                del micro
                grads = self._sync_across_stages(self.executor.sync())
                self.steps += 1
                if self.loss_scale is None or self.scaler.unscale([g for _, g in grads], self.ctx.device):
                    self._write_grads(grads)
                del grads
                loss = self._step_loss(losses)
            self.clock.stop(self.steps - 1)  # (this rank's compute / waiting: nothing sent)
            if self.clock.due(self.steps):  # every straggler_window steps: one small all-gather
                steptimes.check(self)
            return loss

    def _shared_values(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per local stage: its parameters' local shards and its buffers, by placeholder name."""
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        out = {}
        for s, sp in self.executor.stages.items():
            vals = {}
            for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
                if kind == "param":
                    vals[name] = local_tensor(params[what])
                elif kind == "buffer":
                    vals[name] = buffers.get(what, sp.program.buffers.get(what)).to(self.ctx.device)
            out[s] = vals
        return out

    def _sync_across_stages(self, grads):
        """Gradients that stages on other ranks also hold (a pipeline's tied weights) summed."""
        return grads

    def _write_grads(self, grads) -> None:
        params = dict(self.module.named_parameters())
        for name, g in grads:
            p = params[name]
            d = g.detach() if not isinstance(p, DTensor) else DTensor(
                g.detach(), tc.DTensorSpec(p.device_mesh, p.placements, tc.TensorMeta(p.shape, p.stride(), p.dtype)),
                requires_grad=False)
            p.grad = d if p.grad is None else p.grad + d

    def _step_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        return (sum(losses) / len(losses)).detach()

    # fp16 loss scaling (runtime/common.py LossScaler), read and set on the runtime
    loss_scale = property(lambda self: self.scaler.scale, lambda self, v: setattr(self.scaler, "scale", v))
    skipped_steps = property(lambda self: self.scaler.skipped_steps)
    _growth_tracker = property(lambda self: self.scaler.growth_tracker,
                               lambda self, v: setattr(self.scaler, "growth_tracker", v))

    # ---------------------------------------------------------------- step times, stragglers
    def step_times(self, last: int = 100) -> dict:
        """The last ``last`` steps of every rank: ``{"steps", "compute", "wait"}`` (seconds, per rank
        per step; compute = the step's wall time minus the time blocked in waits). Call on every
        rank (one all-gather). autopar/runtime/steptimes.py."""
        return steptimes.step_times(self, last)

    stragglers = property(lambda self: self.clock.last_check,
                          doc="The last straggler check (every straggler_window steps), or None.")

    # what the executor recorded on the last step (autopar/runtime/executor.py)
    timeline = property(lambda self: self.executor.timeline)
    recv_wait = property(lambda self: self.executor.recv_wait)
    in_flight = property(lambda self: self.executor.in_flight)

    # ---------------------------------------------------------------- measuring
    memory = property(lambda self: self.executor.memory, lambda self, v: setattr(self.executor, "memory", v))
    inductor = property(lambda self: self.executor.inductor,
                        doc="What compile(inductor=True) compiled (autopar/runtime/inductor.py InductorStats), or None.")

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
          once): the storages the programs' ops created, alive op by op (memory.ProgramMeter; in a
          pipeline, per F / I / W part run);
        - ``flops_per_step``: torch's FLOP formulas on the ops the programs ran.
        """
        params = tensor_bytes(self.parameters())
        grads = tensor_bytes(p.grad for p in self.parameters())
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

    def memory_lines(self, optimizer=None) -> list[str]:
        """The report's measured-memory section (empty unless ``track_memory()`` is on)."""
        if self.memory is None:
            return []
        m = self.memory_report(optimizer)
        return ["", "memory on this rank (measured; bytes):",
                f"  parameters {m['parameters']:,}  gradients {m['gradients']:,}  "
                f"optimizer state {m['optimizer_state']:,}" + ("" if optimizer else " (pass the optimizer)"),
                f"  step peak {m['step_peak']:,} = parameters + optimizer state + the allocator's peak during "
                f"the step {m['program_peak']:,}",
                f"  the programs' tensors at their peak {m['tensor_peak']:,}: parameter copies "
                f"{m['peak_param_copies']:,}, gradients in flight {m['peak_grads_in_flight']:,}, activations "
                f"{m['peak_activations']:,}",
                f"  FLOPs per step {m['flops_per_step']:,.0f}"]
