"""PipelineModule: a pipelined program (passes/split.py) on one rank: the stages it holds and
its schedule's action list, run by the same executor as SPMD programs
(autopar/runtime/executor.py), with point-to-point transfers between stages
(autopar/runtime/p2p.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.analysis.ops import val_bytes
from autopar.analysis.schedules import saved_in_flight
from autopar.errors import InputError, PlanError
from autopar.ir import Stage, info
from autopar.plan import replicated_lines
from autopar.runtime.base import Runtime
from autopar.context import compile_notes
from autopar.runtime.common import bytes_lines
from autopar.runtime import failure
from autopar.runtime.executor import Executor
from autopar.runtime.measure import CommMeter, mesh_axes
from autopar.runtime.p2p import P2P


class PipelineModule(Runtime):
    """The compiled pipeline on one rank: the stages it holds, the schedule, the executor.

    ``parameters()`` are this rank's stages' parameters (DTensors on the stage's sub-mesh); the
    other stages' parameters are dropped from the module (meta tensors), so an unchanged
    optimizer built on ``parameters()`` steps what this rank owns. ``train_step`` runs the
    schedule over the global batch and returns the global-batch loss on every rank."""

    pipelined = True

    def __init__(self, module, mesh, pp_axis, stage_mesh, sched, opts, specs, stages, example_inputs, inputs,
                 stage_plan):
        # counts what this rank hands to the process group while measure() is on; sends go to a
        # global rank on the default group, and are counted on the pipeline axis
        counter = CommMeter({**mesh_axes(stage_mesh), **mesh_axes(mesh)}, p2p_axis=pp_axis)
        super().__init__(module, stages[0].ctx, example_inputs, inputs, counter)  # (every stage's sub-mesh view)
        self.mesh = mesh
        self.pp_axis = pp_axis
        self.stage_mesh = stage_mesh
        self.schedule = sched
        self.options = opts
        self.microbatches = sched.microbatches
        self.specs = specs
        self.stages = {sp.spec.index: sp for sp in stages}  # compiled here (all of them when planning)
        self.pp_rank = mesh.get_local_rank(pp_axis)
        self.local = {s: sp for s, sp in self.stages.items() if sched.rank_of(s) == self.pp_rank}
        self.plan = stage_plan
        self.pp_size = sched.ranks
        self.pp_group = mesh.get_group(pp_axis)
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.accumulate = 1
        owned = {name: sp.ctx.placed.placements[name] for sp in self.stages.values() for name in sp.param_names}
        self._owned = {n for sp in self.local.values() for n in sp.param_names}
        for full_name, p in list(self.module.named_parameters()):
            if full_name in owned:
                self._place(full_name, p, self.stage_mesh, owned[full_name])
            else:  # another rank's stage: not held here
                self._place(full_name, p, None, None)
        self.executor = Executor(self.local, sched.actions[self.pp_rank], self.microbatches, self.ctx.device,
                                 P2P(specs, sched, self.pp_rank, self.pp_group, self.ctx.device))
        self.tied = self._find_tied()
        self._tie_groups: dict[tuple[int, ...], object] = {}

    # ------------------------------------------------------------ tied weights
    def _find_tied(self) -> dict[str, tuple[int, ...]]:
        """Parameters held by stages on more than one pipeline rank (tied weights: the embedding
        on the first stage, the LM head on the last) -> those pp ranks. The copies have the same
        placements on their stages' sub-meshes (the plan places a parameter by its name and
        shape: plan.place_parameters), so equal shards meet in the sum."""
        held: dict[str, set[int]] = {}
        for spec in self.specs:
            for name in spec.param_names:
                held.setdefault(name, set()).add(self.schedule.rank_of(spec.index))
        return {name: tuple(sorted(r)) for name, r in held.items() if len(r) > 1}

    def _tie_group(self, ranks: tuple[int, ...]):
        """The process group of this rank's copies of a tied parameter: the pp ranks ``ranks`` at
        this rank's coordinates on the other mesh axes (the pp group itself when they are all of
        it). Created on first use, by every rank, in the same order."""
        if len(ranks) == self.pp_size:
            return self.pp_group
        if ranks not in self._tie_groups:
            dim = self.mesh.mesh_dim_names.index(self.pp_axis)
            rows = self.mesh.mesh.movedim(dim, -1).reshape(-1, self.pp_size).tolist()
            me = dist.get_rank()
            self._tie_groups[ranks] = None  # (this rank holds no copy)
            for row in rows:  # every rank creates every row's group (new_group's contract)
                g = dist.new_group([row[r] for r in ranks])
                if me in row and row.index(me) in ranks:
                    self._tie_groups[ranks] = g
                    self.counter.axes[g.group_name] = self.pp_axis
        return self._tie_groups[ranks]

    def _sync_across_stages(self, grads: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Sum each tied parameter's gradient over the stages that hold a copy (one all-reduce
        per tied parameter, on the pp ranks holding it), so every copy steps the same way."""
        if not self.tied:
            return grads
        mine: dict[str, torch.Tensor] = {}
        rest = []
        for name, g in grads:
            if name in self.tied:
                mine[name] = g if name not in mine else mine[name] + g
            else:
                rest.append((name, g))
        for name in sorted(self.tied):  # the same order on every rank
            group = self._tie_group(self.tied[name])  # (every rank takes part in creating it)
            if self.pp_rank not in self.tied[name]:
                continue
            g = mine[name].contiguous()
            failure.wait(dist.all_reduce(g, group=group, async_op=True), f"the gradient sum of tied weight {name}",
                         self.timeout, guard=self.guard)
            rest.append((name, g))
        return rest

    # seconds a receive may wait before the step fails (AUTOPAR_P2P_TIMEOUT)
    p2p_timeout = property(lambda self: self.executor.p2p.timeout,
                           lambda self, v: setattr(self.executor.p2p, "timeout", v))

    def named_parameters(self):
        return ((n, p) for n, p in self.module.named_parameters() if n in self._owned)

    def state_dict(self):
        return {k: v for k, v in self.module.state_dict().items() if k in self._owned}

    def __call__(self, *inputs):
        raise InputError("the eval forward (pm(x)) is not built for pipelined programs yet",
                         where="PipelineModule.__call__",
                         fix="compile the model without the pipeline axis for evaluation, or use train_step's loss")

    forward = __call__

    def generate(self, *args, **kwargs):
        raise PlanError("generation (pm.generate) is not built for pipelined programs: a decode step of one token "
                        "would idle every stage but one", where="PipelineModule.generate",
                        fix="compile the model for generation without the pipeline axis, tensor parallel: "
                            "autopar.mesh(tp=N) with plan={'tp': 'megatron'}")

    def _step_loss(self, losses) -> torch.Tensor:
        """The global-batch loss, from the last stage's rank to every rank of the pipeline."""
        m = self.microbatches
        loss = (sum(losses) / m).detach().reshape(()) if losses else torch.zeros((), device=self.ctx.device)
        loss = loss.float()
        if self.pp_size > 1:
            root = self.pp_ranks[self.schedule.rank_of(len(self.specs) - 1)]
            failure.wait(dist.broadcast(loss, src=root, group=self.pp_group, async_op=True),
                         f"the loss broadcast from the last stage (rank {root})", self.p2p_timeout,
                         guard=self.guard)
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

    def stage_collectives(self, s: int):
        """Stage ``s``'s own collectives (one of this rank's): its program's per micro-batch and
        its gradient sync's."""
        return StageView(self, self.local[s]).collectives()

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
                            recs += [CommRecord("send", self.pp_axis, 2, val_bytes(node_of[o].meta["val"]),
                                                f"activation {what} of stage {s} to stage {t}", sp.spec.modules[1],
                                                "forward")] * self.microbatches
                elif kind == "input_grad":
                    src = sp.spec.inputs[what]
                    if src[0] == "stage" and self.schedule.rank_of(src[1]) != self.pp_rank:
                        recs += [CommRecord("send", self.pp_axis, 2, val_bytes(node_of[o].meta["val"]),
                                            f"gradient of stage {s}'s input {what} back to stage {src[1]}",
                                            sp.spec.modules[0], "backward")] * self.microbatches
        for name, ranks in sorted(self.tied.items()):
            if self.pp_rank in ranks:
                p = self.module.get_parameter(name)
                recs.append(CommRecord("all_reduce", self.pp_axis, len(ranks), p.to_local().numel() * p.element_size(),
                                       f"tied weight {name}: the gradients of its copies on pp ranks {list(ranks)} "
                                       "summed", "", "backward"))
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
        return saved_in_flight(self.schedule.actions[self.pp_rank], self.stages)

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
        lines = [head] + ([self.auto_plan] if getattr(self, "auto_plan", None) else [])
        lines += compile_notes([sp.ctx for sp in self.local.values()])
        lines += ["", "stages:"]
        for r in self.describe_stages():
            lines.append(f"  stage {r['stage']} (pp rank {r['rank']}): {r['first']} .. {r['last']}, "
                         f"{r['parameters']:,} B of parameters")
        mine = dict(self.named_parameters())
        for s, sp in sorted(self.local.items()):
            rows = replicated_lines(sp.ctx.placed, {n: p for n, p in mine.items() if n in sp.param_names}, "    ")
            if rows:
                lines += [f"  stage {s}:"] + rows
        lines.append("")
        lines += bytes_lines(self.predicted_bytes(), self.counter)
        if self.in_flight:
            lines.append(f"saved activations in flight (last step): {self.in_flight['peak_microbatches']} "
                         f"(stage, micro-batch) sets, {self.in_flight['peak_bytes']:,} B")
        lines += self.memory_lines(optimizer)
        lines += self.clock.lines()
        if self.inductor is not None:
            lines.append(self.inductor.line())
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
        """Node name of the joint per-rank program -> "P" | "F" | "I" | "W" (the part that runs it)."""
        out = {}
        parts = dict(self.stage.parts, **({"P": self.stage.prologue} if self.stage.prologue is not None else {}))
        for name, part in parts.items():
            if part.gm is not None:
                for n in part.gm.graph.nodes:
                    if n.op == "call_function":
                        out[n.name] = name
        return out

    def collectives(self):
        # per micro-batch, except what the stage's prologue runs once per step (ZeRO-1/2 gathers)
        once = self.stage.prologue.members if self.stage.prologue is not None else frozenset()
        recs = [(info(n).comm, n.name in once) for n in self.program.local.graph.nodes if info(n).comm is not None]
        return ([c for c, o in recs if not o] * self.accumulate + [c for c, o in recs if o]
                + [info(n).comm for n in self.sync_program.local.graph.nodes if info(n).comm is not None])

