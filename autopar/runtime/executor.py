"""The executor: runs one rank's action list over the stages it holds, for any program.

A step is a list of actions per rank (passes/schedule.py, autopar/analysis/schedules.py):

- ``("FB", s, mb)``: stage ``s``'s whole joint per-rank program on micro-batch ``mb`` (forward and
  backward in one graph, so the overlap pass's wait placement spans both). An SPMD plan is one
  stage whose list is ``FB`` per micro-batch (``accumulate=K``: K of them);
- ``("F", s, mb)``, ``("B", s, mb)``, or B split into ``("I", s, mb)`` and ``("W", s, mb)``: a
  pipeline stage's F / I / W parts (passes/partition.py), with the activations and
  their gradients crossing stage boundaries through ``P2P`` (autopar/runtime/p2p.py).

Then ``sync`` runs each stage's gradient-sync program once on the gradients summed over the
micro-batches (stages whose program reduces its gradients itself have none). The runtime
(autopar/runtime/base.py) does the rest the same way for both: loss scaling, ``.grad``.

Recorded per step, for every program: ``timeline`` (each action's start once its inputs were
there, and end), ``recv_wait`` (seconds each action blocked receiving) and ``in_flight`` (the
most (stage, micro-batch) activation sets and their bytes held between actions).
"""

from __future__ import annotations

import time

import torch

from autopar import dropout
from autopar.ir import Stage
from autopar.runtime import guarded as guarded_programs


class Executor:
    """One rank's actions over its ``stages`` (index -> Stage); ``p2p`` moves what crosses
    stages. ``memory``: a MemoryTracker while the runtime tracks memory (else None)."""

    def __init__(self, stages: dict[int, Stage], actions: list[tuple], microbatches: int, device, p2p):
        self.stages = stages
        self.actions = actions
        self.microbatches = microbatches
        self.device = device
        self.p2p = p2p
        self.memory = None
        self.guard = True  # run the programs' guarded copies: bounded waits (autopar/runtime/failure.py)
        self._guarded: dict[int, tuple] = {}
        self.inductor = None  # an InductorStats when the programs' compute runs compiled (autopar/runtime/inductor.py)
        self._compiled: dict[int, tuple] = {}
        self.timeline: list[tuple[float, float, tuple]] = []
        self.recv_wait: list[float] = []
        self.in_flight: dict = {}
        # what the memory tracker needs to categorize a part's storages
        self._params = {s: {n for (k, _), n in zip(sp.program.inputs, sp.ph_names) if k == "param"}
                        for s, sp in stages.items()}
        self._grads = {s: {o for (k, _), o in zip(sp.program.outputs, sp.out_names) if k == "grad" and o}
                       for s, sp in stages.items()}

    # ---------------------------------------------------------------- one step
    def run(self, micro: list[list[torch.Tensor]], shared: dict[int, dict], scale: float,
            draw: dropout.Draw) -> list[torch.Tensor]:
        """Run the action list on ``micro`` (per micro-batch, this rank's inputs); ``shared``:
        per stage, its parameter and buffer values by placeholder name; ``scale``: the fp16 loss
        scale (1 without); ``draw``: the step's dropout draw (the runtime's), whose micro-batch
        each action sets. Returns the losses this rank computed, one per micro-batch."""
        self._shared, self._scale, self._micro = dict(shared), scale, micro
        for s, sp in self.stages.items():  # each stage's prologue: once per step, held to its end
            part = sp.prologue
            if part is not None and part.gm is not None:
                roles = [("param", a) for a in part.args]
                outs = self._run(part.gm, [shared[s][a] for a in part.args], roles,
                                 [("value", o) for o in part.outs] if self.memory is not None else None)
                self._shared[s] = {**shared[s], **dict(zip(part.outs, outs))}
        self._env: dict[tuple, dict] = {}
        self._losses: list[torch.Tensor] = []
        self.acc: dict[int, dict[str, torch.Tensor]] = {s: {} for s in self.stages}
        self.p2p.begin()
        state = {t.untyped_storage().data_ptr() for vals in self._shared.values() for t in vals.values()
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        events, waits = [], []
        live = peak = peak_bytes = 0
        for i, action in enumerate(self.actions):
            self._post_recvs(action)
            if i + 1 < len(self.actions):  # one action ahead: its inputs arrive while this one computes
                self._post_recvs(self.actions[i + 1])
            kind, s, mb = action
            draw.micro = mb  # (the draw of this micro-batch's dropouts)
            self._ready = time.perf_counter()  # (actions that receive move it past their receives)
            if kind == "FB":
                self._whole(s, mb)
            elif kind == "F":
                self._forward(s, mb)
                live += 1
            elif kind in ("B", "I"):
                self._input_grad(s, mb)
                if kind == "B":
                    self._weight_grad(s, mb)
                    live -= 1
            elif kind == "W":
                self._weight_grad(s, mb)
                live -= 1
            else:
                raise ValueError(f"unknown action {action!r}")
            events.append((self._ready, time.perf_counter(), action))
            waits.append(self.p2p.take_waited())
            self.p2p.release_sent()
            peak = max(peak, live)
            peak_bytes = max(peak_bytes, _held_bytes(self._env.values(), state))
        self.p2p.finish()
        self.timeline, self.recv_wait = events, waits
        self.in_flight = {"peak_microbatches": peak, "peak_bytes": peak_bytes}
        losses = self._losses
        del self._env, self._shared, self._micro, self._losses
        return losses

    def sync(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, gradient in its storage layout) for every gradient of the step: the
        micro-batch sums through each stage's sync program, or as the program left them."""
        out = []
        for s, sp in self.stages.items():
            acc = self.acc[s]
            if sp.sync is None:
                out += list(acc.items())
                continue
            names = [what for _, what in sp.sync.inputs]
            if names:
                args = [acc[n].contiguous() for n in names]
                self.acc[s] = acc = None  # (the sync program frees each sum after its last use)
                res = self._run(sp.sync.local, args, sp.sync.inputs, sp.sync.outputs)
                out += list(zip([what for _, what in sp.sync.outputs], res))
        self.acc = {}
        return out

    # ---------------------------------------------------------------- actions
    def _run(self, gm, args: list, in_roles, out_roles):
        """Run ``gm`` on ``args``, which it takes over: the boxed copy empties the list and drops
        each argument after its last use, so a backward frees the saved activations it has read
        (the caller must hold no other reference to those it wants freed)."""
        # the program IS the backward: autograd must not also record it (parameters are
        # requires_grad DTensors, so it would, and keep every activation a second time)
        gm = self.runnable(gm)
        with torch.no_grad():
            if self.memory is None:
                return call(gm, args)
            return self.memory.run(gm, args, in_roles, out_roles)

    def runnable(self, gm):
        """The copy of ``gm`` this executor runs (made once per program): its collectives wait in
        bounded slices (``guard``) and it is called boxed (a list it clears)."""
        key = (id(gm), self.guard)
        hit = self._guarded.get(key)
        if hit is None or hit[0] is not gm:
            run = self.compiled(gm)
            hit = self._guarded[key] = (gm, _boxed(guarded_programs.guarded(run) if self.guard else run))
        return hit[1]

    def compiled(self, gm):
        """``gm`` with its compute compiled by Inductor when ``inductor`` is on (made once per
        program; autopar/runtime/inductor.py), else ``gm``."""
        if self.inductor is None:
            return gm
        hit = self._compiled.get(id(gm))
        if hit is None or hit[0] is not gm:
            from autopar.runtime.inductor import compile_program

            hit = self._compiled[id(gm)] = (gm, compile_program(gm, self.device, self.inductor))
        return hit[1]

    def programs(self) -> list:
        """Every per-rank program of the step: each stage's joint program or its parts and
        prologue, and its gradient-sync program."""
        out = []
        for sp in self.stages.values():
            parts = [p.gm for p in (sp.parts or {}).values()] + [sp.prologue.gm if sp.prologue is not None else None]
            out += [gm for gm in parts if gm is not None] if sp.parts else [sp.program.local]
            if sp.sync is not None:
                out.append(sp.sync.local)
        return out

    def _tangent(self, like) -> torch.Tensor:
        """d(step loss)/d(micro-batch loss), times the fp16 loss scale: the loss is the mean."""
        return torch.full(like.shape, self._scale / self.microbatches, dtype=like.dtype, device=self.device)

    def _user_input(self, sp: Stage, what) -> int | None:
        """Which of the user's inputs a stage input is (None: another stage's output)."""
        if sp.spec is None:
            return what
        src = sp.spec.inputs[what]
        return src[1] if src[0] == "user" else None

    def _whole(self, s: int, mb: int) -> None:
        sp = self.stages[s]
        args = []
        for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
            if kind == "input":
                args.append(self._micro[mb][self._user_input(sp, what)])
            elif kind == "tangent":
                args.append(self._tangent(sp.ph_vals[name]))
            else:
                args.append(self._shared[s][name])
        outs = self._run(sp.program.local, args, sp.program.inputs, sp.program.outputs)
        acc = self.acc[s]
        for (kind, what), o in zip(sp.program.outputs, outs):
            if kind == "loss":
                self._losses.append(o)
            elif kind == "grad" and o is not None:
                acc[what] = o if what not in acc else acc[what].add_(o)

    def _part(self, sp: Stage, name: str, env: dict, later: tuple[str, ...] | None = None) -> None:
        """Run part ``name`` of stage ``sp`` on ``env``; with ``later`` (the parts still to run on
        this micro-batch), the saved values no later part reads leave ``env`` first, so the part
        frees each after its last use."""
        part = sp.parts[name]
        if part.gm is None:
            return
        s = sp.index
        args = [env[a] if a in env else self._shared[s][a] for a in part.args]
        if later is not None:
            keep = set(self._grads[s]).union(*(sp.parts[k].args for k in later if sp.parts[k].gm is not None))
            for a in part.args:
                if a not in keep:
                    env.pop(a, None)
        in_roles = out_roles = None  # (what the memory tracker categorizes by, when it runs)
        if self.memory is not None:  # (the prologue's outputs: parameter copies, held for the step)
            made_once = set(sp.prologue.outs) if sp.prologue is not None else set()
            in_roles = [("param", a) if a in self._params[s] or a in made_once else ("input", a) for a in part.args]
            out_roles = [("grad", o) if o in self._grads[s] else ("value", o) for o in part.outs]
        env.update(zip(part.outs, self._run(part.gm, args, in_roles, out_roles)))

    def _value(self, s: int, env: dict, name: str):
        return env[name] if name in env else self._shared[s][name]

    def _keep_only(self, sp: Stage, env: dict, later: list[str]) -> None:
        need = set()
        for name in later:
            need.update(sp.parts[name].args)
        need.update(self._grads[sp.index])
        for k in list(env):
            if k not in need:
                del env[k]

    def _forward(self, s: int, mb: int) -> None:
        sp, p2p = self.stages[s], self.p2p
        env = {}
        for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
            if kind != "input":
                continue
            user = self._user_input(sp, what)
            if user is not None:
                env[name] = self._micro[mb][user]
            else:
                src = sp.spec.inputs[what]
                env[name] = p2p.collect(sp.ph_vals[name], src[1], p2p.tag(s, what, mb, False))
        self._ready = time.perf_counter()  # inputs are here: compute starts
        self._part(sp, "F", env)
        for (kind, what), o in zip(sp.program.outputs, sp.out_names):
            if kind == "loss":
                self._losses.append(self._value(s, env, o))
            elif kind == "act":
                value = self._value(s, env, o)
                for t, k in sp.spec.consumers[what]:
                    p2p.deliver(value, t, p2p.tag(t, k, mb, False))
        self._keep_only(sp, env, ["I", "W"])
        self._env[(s, mb)] = env

    def _input_grad(self, s: int, mb: int) -> None:
        sp, p2p = self.stages[s], self.p2p
        env = self._env[(s, mb)]
        for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
            if kind != "tangent":
                continue
            like = sp.ph_vals[name]
            if sp.spec is None or sp.spec.is_last:
                env[name] = self._tangent(like)
                continue
            total = None
            for t, k in sp.spec.consumers[what]:
                tag = p2p.tag(t, k, mb, True)
                if tag not in p2p.no_grad:
                    g = p2p.collect(like, t, tag)
                    total = g if total is None else total + g
            env[name] = total if total is not None else torch.zeros(like.shape, dtype=like.dtype, device=self.device)
        self._ready = time.perf_counter()
        self._part(sp, "I", env, later=("W",))
        for (kind, what), o in zip(sp.program.outputs, sp.out_names):
            if kind == "input_grad" and o is not None:
                src = sp.spec.inputs[what]
                if src[0] == "stage":
                    p2p.deliver(self._value(s, env, o), src[1], p2p.tag(s, what, mb, True))
        self._keep_only(sp, env, ["W"])

    def _weight_grad(self, s: int, mb: int) -> None:
        sp = self.stages[s]
        env = self._env.pop((s, mb))
        self._part(sp, "W", env, later=())
        acc = self.acc[s]
        for (kind, what), o in zip(sp.program.outputs, sp.out_names):
            if kind == "grad" and o is not None:
                g = self._value(s, env, o)
                acc[what] = g.clone() if what not in acc else acc[what].add_(g)

    def _post_recvs(self, action) -> None:
        """Post the receives of ``action`` now (irecv), so they arrive while this rank computes."""
        kind, s, mb = action
        sp, p2p = self.stages[s], self.p2p
        if sp.spec is None:
            return
        if kind == "F":
            for (role, what), name in zip(sp.program.inputs, sp.ph_names):
                src = sp.spec.inputs[what] if role == "input" else None
                if src is not None and src[0] == "stage":
                    p2p.post(sp.ph_vals[name], src[1], p2p.tag(s, what, mb, False))
        elif kind in ("B", "I") and not sp.spec.is_last:
            for (role, what), name in zip(sp.program.inputs, sp.ph_names):
                if role != "tangent":
                    continue
                for t, k in sp.spec.consumers[what]:
                    tag = p2p.tag(t, k, mb, True)
                    if tag not in p2p.no_grad:
                        p2p.post(sp.ph_vals[name], t, tag)


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


def call(gm, args: list):
    """Run a program as ``Executor.runnable`` made it (boxed: it takes ``args`` over)."""
    return gm(args) if getattr(gm, "_boxed_call", False) else gm(*args)


def _boxed(gm):
    """A copy of ``gm`` called as ``gm(args)`` with a list it empties on entry (fx's boxed
    calling convention, as aot_autograd's compiled functions use): its generated code drops each
    argument after its last use, which the caller's argument tuple would otherwise keep alive.
    Programs with their own calling convention (a pytree codegen) are left as they are."""
    import torch.fx as fx

    if type(gm.graph._codegen) is not fx.graph.CodeGen:
        return gm
    graph = fx.Graph()
    val, old = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(val, type_expr=getattr(old, "type", None)).meta = old.meta
    graph.set_codegen(fx.graph._BoxedCodeGen())
    out = fx.GraphModule(gm, graph)
    return out
