"""ParallelModule: runs the per-rank program on torch.distributed process groups.

The user's module keeps its structure; its parameters are replaced by DTensors with the
plan's placements (so an unchanged torch.optim.AdamW works on them and its state is sharded
with them). ``train_step`` slices the global batch, runs the per-rank joint graph and
writes gradients to ``param.grad`` (accumulating, as autograd does).

Bytes communicated are counted as the program runs: every ``_c10d_functional`` collective
in the per-rank graph is called through a counter that reads the real tensor's size and the
real group's size.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Shard

from autopar.errors import InputError
from autopar.ir import CommRecord, bytes_by_collective, fmt_placements, ring_bytes
from autopar.passes.localize import COLLECTIVES


class CommCounter:
    """Bytes per (kind, axis), counted at each collective call."""

    def __init__(self):
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.payload: dict[tuple[str, str], int] = defaultdict(int)
        self.wire: dict[tuple[str, str], float] = defaultdict(float)

    def reset(self):
        self.calls.clear(), self.payload.clear(), self.wire.clear()

    def summary(self) -> dict:
        return {f"{k}@{a}": {"calls": self.calls[(k, a)], "payload_bytes": self.payload[(k, a)],
                             "wire_bytes": self.wire[(k, a)]} for (k, a) in sorted(self.calls)}


def _counted(op, kind: str, axis: str, n: int, counter: CommCounter):
    def call(x, *args):
        nbytes = x.numel() * x.element_size()
        counter.calls[(kind, axis)] += 1
        counter.payload[(kind, axis)] += nbytes
        counter.wire[(kind, axis)] += ring_bytes(kind, nbytes, n)
        return op(x, *args)

    call.__name__ = f"counted_{kind}"
    call._autopar_collective = op
    return call


def instrument(gm: fx.GraphModule, counter: CommCounter, ctx) -> fx.GraphModule:
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in COLLECTIVES:
            axis = ctx.axis_names[ctx.axis_of_group(n.args[-1])]
            size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(n.args[-1]))
            n.target = _counted(n.target, COLLECTIVES[n.target], axis, size, counter)
    gm.recompile()
    return gm


class ParallelModule:
    """The compiled program. ``parameters()`` are DTensors; ``train_step`` runs fwd+bwd."""

    def __init__(self, module: nn.Module, ctx, program, example_inputs, has_loss, inputs, forward_builder):
        self.module = module
        self.ctx = ctx
        self.mesh = ctx.mesh
        self.program = program
        self.has_loss = has_loss
        self.input_mode = inputs
        self.example_shapes = [(tuple(x.shape), x.dtype) for x in example_inputs]
        self.counter = CommCounter()
        self._forward_builder = forward_builder
        self._forward_program = None
        self._distribute_parameters()
        self._gm = instrument(program.local, self.counter, ctx)
        self._loss_dtype = next((n.meta["val"].dtype for n in program.graph.nodes if n.op == "placeholder"
                                 and n.meta.get("autopar_role", ("",))[0] == "tangent"), torch.float32)
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
        if len(inputs) != n_expected:
            raise InputError(f"expected {n_expected} inputs (as compiled), got {len(inputs)}",
                             where="ParallelModule.train_step / __call__")
        out = []
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self.example_shapes)):
            if not isinstance(x, torch.Tensor):
                raise InputError(f"input #{i} must be a tensor, got {type(x).__name__}")
            pl = self.ctx.input_placements(shape)
            local_shape = list(shape)
            for p, n in zip(pl, self.ctx.axis_sizes):
                if isinstance(p, Shard):
                    local_shape[p.dim] //= n
            want = tuple(local_shape) if self.input_mode == "local" else shape
            if tuple(x.shape) != want or x.dtype != dtype:
                hint = ""
                if self.input_mode == "global" and tuple(x.shape) == tuple(local_shape):
                    hint = " (this looks like a per-rank batch: compile with inputs='local' if your loader shards)"
                elif self.input_mode == "local" and tuple(x.shape) == shape:
                    hint = " (this looks like the global batch: compile with inputs='global')"
                raise InputError(
                    f"input #{i} has shape {list(x.shape)} {x.dtype}, but the program was compiled for "
                    f"{self.input_mode} shape {list(want)} {dtype}{hint}",
                    where=f"input #{i}", fix="pass batches of the compiled shape, or compile again for this one")
            x = x.to(self.ctx.device)
            if self.input_mode == "global":
                for a, p in enumerate(pl):
                    if isinstance(p, Shard):
                        x = torch.chunk(x, self.ctx.axis_sizes[a], dim=p.dim)[self.ctx.coord[a]]
            out.append(x.contiguous())
        return out

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
        """Forward + backward on the global batch; gradients land on ``parameters()``."""
        local = self._local_inputs(inputs, len(self.example_shapes))
        tangent = torch.ones((), dtype=self._loss_dtype, device=self.ctx.device)
        outs = self._gm(*self._args(self.program, local, (tangent,)))
        params = dict(self.module.named_parameters())
        loss = None
        for (kind, what), o in zip(self.program.outputs, outs):
            if kind == "loss":
                loss = o
            elif kind == "grad" and o is not None:
                p = params[what]
                g = DTensor(o.detach(), DTensorSpec(self.mesh, p.placements, TensorMeta(p.shape, p.stride(), p.dtype)),
                            requires_grad=False)
                p.grad = g if p.grad is None else p.grad + g
        self.steps += 1
        return loss.detach()

    def __call__(self, *inputs):
        """Forward only (eval): returns the model's output, replicated on every rank."""
        if self._forward_program is None:
            self._forward_program = self._forward_builder()
            self._fwd_gm = instrument(self._forward_program.local, self.counter, self.ctx)
        n = len(self.example_shapes) - (1 if self.has_loss else 0)
        local = self._local_inputs(inputs, n)
        with torch.no_grad():
            outs = self._fwd_gm(*self._args(self._forward_program, local))
        return outs[0] if len(outs) == 1 else tuple(outs)

    forward = __call__

    # ---------------------------------------------------------------- visibility
    def collectives(self, program=None) -> list[CommRecord]:
        """Every collective in the per-rank training program, in execution order."""
        gm = (program or self.program).local
        return [n.meta["autopar_comm"] for n in gm.graph.nodes if "autopar_comm" in n.meta]

    def predicted_bytes(self) -> dict[str, float]:
        """Bytes per rank per step the compiler predicts, keyed like ``counter.summary()``."""
        return bytes_by_collective(self.collectives())

    def report(self) -> str:
        ctx = self.ctx
        lines = [f"autopar program on mesh {dict(zip(ctx.axis_names, ctx.axis_sizes))}, rank coord {ctx.coord}",
                 f"plan: {ctx.plan.describe()}", "", "parameters:"]
        for name, p in self.module.named_parameters():
            local = p.to_local().shape if isinstance(p, DTensor) else p.shape
            lines.append(f"  {name:48s} {str(list(p.shape)):>14s} {fmt_placements(p.placements):>12s}"
                         f" local {list(local)}")
        for axis, names in ctx.placed.unplaced.items():
            lines.append(f"  note: the {axis} strategy did not recognise {len(names)} parameter(s), replicated: "
                         + ", ".join(names))
        recs = self.collectives()
        lines += ["", f"collectives per step ({len(recs)}):"]
        for r in recs:
            lines.append(f"  {r.phase:8s} {r.kind:14s} {r.axis:>4s} {r.payload_bytes:>10,d} B  {r.reason}")
            lines.append(f"{'':12s}needed at {r.source}")
            if r.producer and r.producer != r.source:
                lines.append(f"{'':12s}value from {r.producer}")
        lines.append("")
        lines.append("predicted bytes sent per rank per step (ring): " + ", ".join(
            f"{k}={v:,.0f}" for k, v in sorted(self.predicted_bytes().items())))
        if self.counter.calls:
            lines.append("measured (counted at the collectives, since start): " + ", ".join(
                f"{k}={v['wire_bytes']:,.0f}" for k, v in self.counter.summary().items()))
        lines.append("compile time: " + ", ".join(f"{k} {v:.2f}s" for k, v in ctx.timings.items()))
        return "\n".join(lines)
