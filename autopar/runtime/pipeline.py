"""PipelineModule: the schedule executor of a pipelined program (see passes/split.py)."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import InputError
from autopar.runtime.common import LossScaler, bytes_lines, local_inputs
from autopar.ir import Stage, info
from autopar.passes.split import _val_bytes

class PipelineModule:
    """The compiled pipeline on one rank: the stages it holds, the schedule, the executor.

    ``parameters()`` are this rank's stages' parameters (DTensors on the stage's sub-mesh); the
    other stages' parameters are dropped from the module (meta tensors), so an unchanged
    optimizer built on ``parameters()`` steps what this rank owns. ``train_step`` runs the
    schedule over the global batch and returns the global-batch loss on every rank."""

    pipelined = True  # (ParallelModule: False) what tools branch on

    def __init__(self, module, mesh, pp_axis, stage_mesh, sched, opts, specs, stages, example_inputs, inputs,
                 stage_plan):
        from autopar.runtime.measure import CommMeter, mesh_axes

        self.module = module
        self.mesh = mesh
        self.pp_axis = pp_axis
        self.stage_mesh = stage_mesh
        self.schedule = sched
        self.options = opts
        self.microbatches = sched.microbatches
        self.specs = specs
        self.stages = {sp.spec.index: sp for sp in stages}  # compiled here (all of them when planning)
        self.local = {s: sp for s, sp in self.stages.items() if sched.rank_of(s) == mesh.get_local_rank(pp_axis)}
        self.ctx = stages[0].ctx  # the sub-mesh's view (every stage of this rank shares it)
        self.plan = stage_plan
        self.input_mode = inputs
        self.example_shapes = [(tuple(x.shape), x.dtype) for x in example_inputs]
        # counts what this rank hands to the process group while measure() is on; sends go to a
        # global rank on the default group, and are counted on the pipeline axis
        self.counter = CommMeter({**mesh_axes(stage_mesh), **mesh_axes(mesh)}, p2p_axis=pp_axis)
        self._counting = False
        self.pp_rank = mesh.get_local_rank(pp_axis)
        self.pp_size = sched.ranks
        self.pp_group = mesh.get_group(pp_axis)
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        # fp16 loss scaling: the scale enters as the last stage's tangent, the overflow check is one
        # all-reduce over the world (runtime/common.py)
        self.scaler = LossScaler(self.ctx.loss_scale)
        self.steps = 0
        self.accumulate = 1
        self.timeline: list[tuple[float, float, tuple]] = []  # last step, this rank: (start once its inputs arrived, end, action)
        self.in_flight: dict = {}
        self.recv_wait: list[float] = []
        # seconds a receive may wait before the step fails (a peer that died must not hang the rest)
        self.p2p_timeout = float(os.environ.get("AUTOPAR_P2P_TIMEOUT", "600"))
        self._edges = {}
        for spec in specs:
            for k, src in enumerate(spec.inputs):
                if src[0] == "stage":
                    self._edges[(spec.index, k)] = len(self._edges)
        # the tags of input gradients a consumer stage does not produce (no gradient for that input)
        self._no_grad = {self._tag(spec.index, k, mb, True) for spec in specs for k, src in enumerate(spec.inputs)
                         if src[0] == "stage" and not spec.example[k].requires_grad
                         for mb in range(self.microbatches)}
        self._distribute()

    # ------------------------------------------------------------ parameters
    def _distribute(self):
        from torch.distributed.tensor import distribute_tensor

        owned = {}
        for sp in self.stages.values():
            for name in sp.param_names:
                owned[name] = sp.ctx.placed.placements[name]
        self._owned = {n for sp in self.local.values() for n in sp.param_names}
        for full_name, p in list(self.module.named_parameters()):
            mod_name, _, attr = full_name.rpartition(".")
            mod = self.module.get_submodule(mod_name) if mod_name else self.module
            if full_name in owned:
                dt = distribute_tensor(p.detach().to(self.ctx.device), self.stage_mesh, owned[full_name])
                mod.register_parameter(attr, nn.Parameter(dt, requires_grad=p.requires_grad))
            else:  # another rank's stage: not held here
                mod.register_parameter(attr, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                          requires_grad=False))

    def named_parameters(self):
        return ((n, p) for n, p in self.module.named_parameters() if n in self._owned)

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def state_dict(self):
        return {k: v for k, v in self.module.state_dict().items() if k in self._owned}

    def __call__(self, *inputs):
        raise InputError("the eval forward (pm(x)) is not built for pipelined programs yet",
                         where="PipelineModule.__call__",
                         fix="compile the model without the pipeline axis for evaluation, or use train_step's loss")

    forward = __call__

    def measure(self, on: bool = True):
        """Count the bytes this rank hands to the process group (``counter``) on the following
        steps (as ParallelModule.measure; a context manager restores the previous setting)."""
        from autopar.runtime.measure import switch

        return switch(self, "_counting", on)

    def track_memory(self, on: bool = True):
        raise InputError("memory tracking by category is not built for pipelined programs yet",
                         where="PipelineModule.track_memory",
                         fix="read pm.in_flight (activations held, measured every step) and `autopar plan` "
                         "(predicted per-rank memory)")

    # ------------------------------------------------------------ inputs
    def _local_inputs(self, inputs, n_expected):
        return local_inputs(inputs, n_expected, self.example_shapes, self.input_mode, self.ctx,
                            "PipelineModule.train_step")

    # fp16 loss scaling (runtime/common.py LossScaler)
    loss_scale = property(lambda self: self.scaler.scale, lambda self, v: setattr(self.scaler, "scale", v))
    skipped_steps = property(lambda self: self.scaler.skipped_steps)

    # ------------------------------------------------------------ the executor
    def _tag(self, stage: int, k: int, mb: int, backward: bool) -> int:
        return (self._edges[(stage, k)] * self.microbatches + mb) * 2 + int(backward)

    def _send(self, t: torch.Tensor, stage_to: int, tag: int):
        dst = self.pp_ranks[self.schedule.rank_of(stage_to)]
        t = t.contiguous()
        self._pending.append((dist.isend(t, dst=dst, tag=tag), t))

    def _incoming(self, action) -> list[tuple]:
        """(value metadata, producing stage, tag) of what ``action`` receives from other ranks."""
        kind, s, mb = action
        sp = self.stages[s]
        out = []
        if kind == "F":
            for (role, what), name in zip(sp.program.inputs, sp.ph_names):
                src = sp.spec.inputs[what] if role == "input" else None
                if src is not None and src[0] == "stage" and self.schedule.rank_of(src[1]) != self.pp_rank:
                    out.append((sp.ph_vals[name], src[1], self._tag(s, what, mb, False)))
        elif kind in ("B", "I") and not sp.spec.is_last:
            for (role, what), name in zip(sp.program.inputs, sp.ph_names):
                if role != "tangent":
                    continue
                for t, k in sp.spec.consumers[what]:
                    tag = self._tag(t, k, mb, True)
                    if tag not in self._no_grad and self.schedule.rank_of(t) != self.pp_rank:
                        out.append((sp.ph_vals[name], t, tag))
        return out

    def _post_recvs(self, action):
        """Post ``action``'s receives now (irecv), so the transfers run while this rank computes."""
        for like, stage_from, tag in self._incoming(action):
            self._post_recv(like, stage_from, tag)

    def _post_recv(self, like, stage_from: int, tag: int):
        if tag not in self._posted:
            buf = torch.empty(like.shape, dtype=like.dtype, device=self.ctx.device)
            src = self.pp_ranks[self.schedule.rank_of(stage_from)]
            self._posted[tag] = (dist.irecv(buf, src=src, tag=tag), buf)

    def _recv(self, like, stage_from: int, tag: int) -> torch.Tensor:
        self._post_recv(like, stage_from, tag)
        work, buf = self._posted.pop(tag)
        t0 = time.perf_counter()
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.p2p_timeout))
        except RuntimeError as e:  # a peer that failed (or never sends) must not hang this rank
            src = self.pp_ranks[self.schedule.rank_of(stage_from)]
            raise RuntimeError(
                f"autopar pipeline: rank {dist.get_rank()} waited {self.p2p_timeout:g}s for a transfer from stage "
                f"{stage_from} (rank {src}, tag {tag}) that never came: that rank probably failed; its own "
                f"error says why (raise the limit with AUTOPAR_P2P_TIMEOUT=seconds if a step is that slow)") from e
        self._waited += time.perf_counter() - t0
        return buf

    def _deliver(self, value: torch.Tensor, stage_from: int, stage_to: int, tag: int):
        if self.schedule.rank_of(stage_to) == self.pp_rank:
            self._mailbox[tag] = value
        else:
            self._send(value, stage_to, tag)

    def _collect(self, like, stage_from: int, tag: int) -> torch.Tensor:
        if self.schedule.rank_of(stage_from) == self.pp_rank:
            return self._mailbox.pop(tag)
        return self._recv(like, stage_from, tag)

    def _run_part(self, sp: Stage, name: str, env: dict):
        part = sp.parts[name]
        if part.gm is None:
            return
        with torch.no_grad():
            outs = part.gm(*[env[a] if a in env else self._shared[sp.spec.index][a] for a in part.args])
        env.update(zip(part.outs, outs))

    def _keep_only(self, sp: Stage, env: dict, later: list[str]):
        need = set()
        for name in later:
            need.update(sp.parts[name].args)
        need.update(o for (kind, _), o in zip(sp.program.outputs, sp.out_names) if o is not None and kind == "grad")
        for k in list(env):
            if k not in need:
                del env[k]

    def _forward(self, s: int, mb: int, micro):
        sp = self.stages[s]
        env = {}
        for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
            if kind != "input":
                continue
            src = sp.spec.inputs[what]
            if src[0] == "user":
                env[name] = micro[mb][src[1]]
            else:
                env[name] = self._collect(sp.ph_vals[name], src[1], self._tag(s, what, mb, False))
        self._ready = time.perf_counter()  # inputs are here: compute starts
        self._run_part(sp, "F", env)
        for (kind, what), o in zip(sp.program.outputs, sp.out_names):
            if kind == "loss":
                self._losses.append(env[o] if o in env else self._shared[s][o])
            elif kind == "act":
                value = env[o] if o in env else self._shared[s][o]
                for t, k in sp.spec.consumers[what]:
                    self._deliver(value, s, t, self._tag(t, k, mb, False))
        self._keep_only(sp, env, ["I", "W"])
        self._env[(s, mb)] = env

    def _input_grad(self, s: int, mb: int):
        sp = self.stages[s]
        env = self._env[(s, mb)]
        for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
            if kind != "tangent":
                continue
            like = sp.ph_vals[name]
            if sp.spec.is_last:  # d(global loss)/d(micro-batch loss), times the fp16 loss scale
                env[name] = torch.full(like.shape, (self.loss_scale or 1.0) / self.microbatches, dtype=like.dtype,
                                       device=self.ctx.device)
                continue
            total = None
            for t, k in sp.spec.consumers[what]:
                tag = self._tag(t, k, mb, True)
                if tag not in self._no_grad:
                    g = self._collect(like, t, tag)
                    total = g if total is None else total + g
            env[name] = total if total is not None else torch.zeros(like.shape, dtype=like.dtype,
                                                                    device=self.ctx.device)
        self._ready = time.perf_counter()
        self._run_part(sp, "I", env)
        for (kind, what), o in zip(sp.program.outputs, sp.out_names):
            if kind == "input_grad" and o is not None:
                src = sp.spec.inputs[what]
                if src[0] == "stage":
                    value = env[o] if o in env else self._shared[s][o]
                    self._deliver(value, s, src[1], self._tag(s, what, mb, True))
        self._keep_only(sp, env, ["W"])

    def _weight_grad(self, s: int, mb: int):
        sp = self.stages[s]
        env = self._env.pop((s, mb))
        self._run_part(sp, "W", env)
        acc = self._acc[s]
        for (kind, what), o in zip(sp.program.outputs, sp.out_names):
            if kind == "grad" and o is not None:
                g = env[o] if o in env else self._shared[s][o]
                acc[what] = g.clone() if what not in acc else acc[what].add_(g)

    def train_step(self, *inputs) -> torch.Tensor:
        """Run the schedule on the global batch; gradients land on ``parameters()``; returns the
        global-batch loss (the mean of the micro-batch losses) on every rank."""
        if self._counting:
            with self.counter:
                return self._train_step(inputs)
        return self._train_step(inputs)

    def _train_step(self, inputs) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        local = self._local_inputs(inputs, len(self.example_shapes))
        m = self.microbatches
        micro = [[torch.chunk(x, m, dim=0)[i] if x.ndim > 0 else x for x in local] for i in range(m)]
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        self._shared = {}
        for s, sp in self.local.items():
            vals = {}
            for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
                if kind == "param":
                    vals[name] = params[what].to_local()
                elif kind == "buffer":
                    vals[name] = buffers.get(what, sp.program.buffers.get(what)).to(self.ctx.device)
            self._shared[s] = vals
        self._env, self._mailbox, self._pending, self._losses = {}, {}, [], []
        self._acc = {s: {} for s in self.local}
        events, waits = [], []
        live, peak, peak_bytes = 0, 0, 0
        state = {t.untyped_storage().data_ptr() for vals in self._shared.values() for t in vals.values()
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        actions = self.schedule.actions[self.pp_rank]
        self._posted = {}
        for i, (kind, s, mb) in enumerate(actions):
            self._post_recvs((kind, s, mb))
            if i + 1 < len(actions):  # one action ahead: its inputs arrive while this one computes
                self._post_recvs(actions[i + 1])
            self._ready = time.perf_counter()  # (F, B and I move it past their receives)
            self._waited = 0.0
            if kind == "F":
                self._forward(s, mb, micro)
                live += 1
            elif kind in ("B", "I"):
                self._input_grad(s, mb)
                if kind == "B":
                    self._weight_grad(s, mb)
                    live -= 1
            elif kind == "W":
                self._weight_grad(s, mb)
                live -= 1
            events.append((self._ready, time.perf_counter(), (kind, s, mb)))
            waits.append(self._waited)
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]  # release sent buffers
            peak = max(peak, live)
            peak_bytes = max(peak_bytes, _held_bytes(self._env.values(), state))
        for work, _ in self._pending:  # (a peer that died cannot take them: fail, do not hang)
            work.wait(timeout=datetime.timedelta(seconds=self.p2p_timeout))
        self._pending = []
        # the gradients, summed over micro-batches, synchronised once per step
        synced = []
        for s, sp in self.local.items():
            acc = self._acc[s]
            names = [what for _, what in sp.sync.inputs]
            outs = sp.sync.local(*[acc[n].contiguous() for n in names]) if names else []
            synced += list(zip([name for _, name in sp.sync.outputs], outs))
        if self.loss_scale is None or self.scaler.unscale([g for _, g in synced], self.ctx.device):
            for name, g in synced:
                p = params[name]
                d = DTensor(g.detach(), DTensorSpec(self.stage_mesh, p.placements,
                                                    TensorMeta(p.shape, p.stride(), p.dtype)), requires_grad=False)
                p.grad = d if p.grad is None else p.grad + d  # (an overflowing fp16 step leaves .grad as it was)
        loss = (sum(self._losses) / m).detach().reshape(()) if self._losses else torch.zeros((), device=self.ctx.device)
        loss = loss.float()
        if self.pp_size > 1:
            dist.broadcast(loss, src=self.pp_ranks[self.schedule.rank_of(len(self.specs) - 1)], group=self.pp_group,
                           async_op=True).wait(timeout=datetime.timedelta(seconds=self.p2p_timeout))
        self.timeline = events
        self.recv_wait = waits  # per action: seconds blocked receiving its inputs / output gradients
        self.in_flight = {"peak_microbatches": peak, "peak_bytes": peak_bytes}
        self.steps += 1
        assert not self._posted, "a posted receive was never used"
        del self._env, self._mailbox, self._acc, self._shared, self._posted
        return loss

    # ------------------------------------------------------------ visibility
    def gather_timeline(self) -> list[list[tuple[float, float, tuple]]]:
        """The last step's action timings of every rank on this rank's pipeline (same non-pp
        coordinates), in seconds from the earliest start; call on every rank."""
        out = [None] * self.pp_size
        dist.all_gather_object(out, (self.timeline, self.recv_wait), group=self.pp_group)
        t0 = min(ev[0][0] for ev, _ in out if ev)
        self.gathered_recv_wait = [sum(w) for _, w in out]
        return [[(a - t0, b - t0, act) for a, b, act in ev] for ev, _ in out]

    def collectives(self):
        """Every collective (and point-to-point transfer) this rank performs per step."""
        from autopar.ir import CommRecord

        recs = []
        for s, sp in sorted(self.local.items()):
            recs += StageView(self, sp).collectives()  # its program's collectives x M + its gradient sync
            node_of = {n.name: n for n in sp.program.local.graph.nodes}
            for (kind, what), o in zip(sp.program.outputs, sp.out_names):
                if o is None:
                    continue
                if kind == "act":
                    for t, _ in sp.spec.consumers[what]:
                        if self.schedule.rank_of(t) != self.pp_rank:
                            recs += [CommRecord("send", self.pp_axis, 2, _val_bytes(node_of[o].meta["val"]),
                                                f"activation {what} of stage {s} to stage {t}", sp.spec.modules[1],
                                                "forward")] * self.microbatches
                elif kind == "input_grad":
                    src = sp.spec.inputs[what]
                    if src[0] == "stage" and self.schedule.rank_of(src[1]) != self.pp_rank:
                        recs += [CommRecord("send", self.pp_axis, 2, _val_bytes(node_of[o].meta["val"]),
                                            f"gradient of stage {s}'s input {what} back to stage {src[1]}",
                                            sp.spec.modules[0], "backward")] * self.microbatches
        if self.loss_scale is not None and dist.get_world_size() > 1:
            recs.append(CommRecord("all_reduce", self.counter.axis_of(dist.group.WORLD), dist.get_world_size(), 4,
                                   "fp16 loss scaling: did any rank's gradients overflow?", "", "backward"))
        if self.pp_size > 1 and self.pp_rank == self.schedule.rank_of(len(self.specs) - 1):
            recs.append(CommRecord("broadcast", self.pp_axis, self.pp_size, 4, "the global-batch loss to every stage",
                                   "", "backward"))
        return recs

    def predicted_bytes(self) -> dict[str, float]:
        from autopar.ir import bytes_by_collective

        out = bytes_by_collective(self.collectives())
        key = f"broadcast@{self.pp_axis}"
        if key in out:  # the root sends the loss to each of the other P - 1 ranks
            out[key] *= self.pp_size - 1
        elif self.pp_size > 1:
            out[key] = 0.0  # (the counter records the receiving side's call with 0 bytes)
        return out

    def predicted_in_flight(self) -> dict:
        """What this rank's action list holds at most: (stage, micro-batch) activation sets and
        their bytes (each stage's ``saved_bytes``), for comparison with ``in_flight``."""
        live, peak, held, peak_bytes = 0, 0, 0, 0
        for kind, s, _ in self.schedule.actions[self.pp_rank]:
            sp = self.stages[s]
            if kind == "F":
                live, held = live + 1, held + sp.saved_bytes
            elif kind == "B":
                live, held = live - 1, held - sp.saved_bytes
            elif kind == "I":
                held += sp.saved_after_i - sp.saved_bytes
            elif kind == "W":
                live, held = live - 1, held - sp.saved_after_i
            peak, peak_bytes = max(peak, live), max(peak_bytes, held)
        return {"peak_microbatches": peak, "peak_bytes": peak_bytes}

    def describe_stages(self) -> list[dict]:
        rows = []
        for spec in self.specs:
            rows.append({"stage": spec.index, "rank": self.schedule.rank_of(spec.index), "first": spec.modules[0],
                         "last": spec.modules[1], "parameters": spec.param_bytes})
        return rows

    def report(self, optimizer=None) -> str:
        head = (f"autopar pipeline on mesh {dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))}: "
                f"{self.schedule.name}, {len(self.specs)} stages on {self.pp_size} ranks, {self.microbatches} "
                f"micro-batches; inside each stage: {self.plan.describe()}")
        lines = [head, "", "stages:"]
        for r in self.describe_stages():
            lines.append(f"  stage {r['stage']} (pp rank {r['rank']}): {r['first']} .. {r['last']}, "
                         f"{r['parameters']:,} B of parameters")
        lines.append("")
        lines += bytes_lines(self.predicted_bytes(), self.counter)
        if self.in_flight:
            lines.append(f"saved activations in flight (last step): {self.in_flight['peak_microbatches']} "
                         f"(stage, micro-batch) sets, {self.in_flight['peak_bytes']:,} B")
        return "\n".join(lines)


class StageView:
    """One compiled stage seen the way ``autopar dump`` / ``explain`` read a ParallelModule: its
    joint per-rank program, its gradient sync program, its context and parameters."""

    pipelined = False  # one stage's SPMD program

    def __init__(self, pm: PipelineModule, sp: Stage):
        self.pipeline, self.stage = pm, sp
        self.program, self.sync_program, self.ctx = sp.program, sp.sync, sp.ctx
        self.example_shapes = pm.example_shapes
        self.accumulate = pm.microbatches
        self.module = self

    def named_parameters(self):
        mine = set(self.stage.param_names)
        return ((n, p) for n, p in self.pipeline.module.named_parameters() if n in mine)

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def part_of(self) -> dict[str, str]:
        """Node name of the joint per-rank program -> "F" | "I" | "W" (the part that runs it)."""
        out = {}
        for name, part in self.stage.parts.items():
            if part.gm is not None:
                for n in part.gm.graph.nodes:
                    if n.op == "call_function":
                        out[n.name] = name
        return out

    def collectives(self):
        per_mb = [info(n).comm for n in self.program.local.graph.nodes if info(n).comm is not None]
        return per_mb * self.accumulate + [info(n).comm for n in self.sync_program.local.graph.nodes
                                           if info(n).comm is not None]


def _held_bytes(envs, exclude=()) -> int:
    """Bytes of the distinct storages the saved values use; views of parameters/buffers
    (``exclude``: their storages) are not activations."""
    seen, total = set(exclude), 0
    for env in envs:
        for v in env.values():
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
    return total
