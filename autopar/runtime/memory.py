"""Measured per-rank memory and FLOPs, on the real step (the per-rank programs' generated code).

``MemoryTracker.step`` wraps one whole ``train_step``:

- **the step's peak** (``program_peak``): the most the allocator held above its level when the
  step started (``measure.AllocatorPeak``: CUDA's peak statistics; on CPU the allocator's own
  allocation events). It sees everything the step allocates: the programs' values, scratch
  memory inside ops, the process group's own buffers, the runtime's own tensors (batch slices,
  the loss-scale tangent, gradient accumulators). On CPU ``program_peak_without_backend`` leaves
  out the process group's buffers (gloo copies whole inputs and outputs of reduce-scatters and
  all-gathers while they are in flight: how many are in flight at once depends on timing). Persistent state (parameter shards, ``.grad``, optimizer state) is measured on
  the tensors the ParallelModule and the optimizer hold.
- **by category** (``ProgramMeter``, a TorchDispatchMode over each program run): the storages
  the program's ops create, op by op, until they are freed (a weak reference on each storage
  sees the free), each counted once however many views point at it:

  - ``param_copies``: made only from parameters (or from such copies): mixed-precision casts,
    ZeRO all-gathers and their views (the "fp16 parameters" of the ZeRO paper's arithmetic);
  - ``grads_in_flight``: a gradient the program returns, from the op that computed it (traced
    back through single-input ops: casts, reductions) until the program ends;
  - ``activations``: everything else (saved activations, activation gradients, temporaries).

  The categories read only the program's interface (which inputs are parameters, which outputs
  gradients) and the ops that really ran; not the graph the cost model reads. Their sum
  (``tensor_peak``) is below the allocator's figure by the scratch memory inside ops and what
  the runtime holds outside the programs.
- **FLOPs**: the cost model's formula table (autopar/analysis/ops.py ``flop_formula``: torch's
  flop-counter formulas, the CPU flash-attention ops with the SDPA ones) on every op the programs ran, with
  its real arguments, counted by ``ProgramMeter``. Not by ``FlopCounterMode`` itself: it runs
  composite ops (``silu_backward``...) as their decompositions, whose extra temporaries the
  allocator would then measure.

The cost model (autopar/analysis/cost.py) predicts the same figures from the graph; the categories
are defined graph-side in autopar/analysis/liveness.py (``categorize``).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import fx

from autopar import torch_compat as tc
from autopar.analysis.liveness import CATEGORIES
from autopar.analysis.ops import flop_formula, op_flops
from autopar.runtime.executor import call
from autopar.runtime.measure import AllocatorPeak, optimizer_state_bytes, tensor_bytes  # noqa: F401 (re-exported)


class ProgramMeter(tc.TorchDispatchMode):
    """One run of a per-rank program: the storages its ops create, by category, alive op by op;
    and the FLOPs of its ops.

    ``args``: the program's arguments; ``roles``: its ``program.inputs`` (parameters are
    persistent state: not counted, and what is made only from them is a parameter copy). Other
    arguments (the batch, a sync program's gradients) are counted from the start. Call
    ``close(outputs, roles)`` after the run: gradients are known only then.
    """

    def __init__(self, args, roles):
        super().__init__()
        self.persistent = {_key(a) for a, (kind, _) in zip(args, roles) if kind == "param" and _counted(a)}
        self.sid: dict[int, int] = {}  # live storage (data pointer) -> serial id
        self.nbytes: list[int] = []  # per serial id
        self.copy: list[bool] = []  # made only from parameters (or from such copies)
        self.made_from: list[tuple[int | None, ...]] = []  # the tracked inputs of the op that made it
        self.events: list[tuple[int, int]] = []  # (serial id, +bytes at birth / -bytes at free), in order
        self._refs: list = []
        self._open = True
        self.flops = 0
        for a, (kind, _) in zip(args, roles):
            if kind != "param" and _counted(a) and _key(a) not in self.sid:
                self._new(a.untyped_storage(), False, ())

    def _new(self, st, copy: bool, made_from) -> None:
        sid = len(self.nbytes)
        self.sid[st.data_ptr()] = sid
        self.nbytes.append(st.nbytes())
        self.copy.append(copy)
        self.made_from.append(made_from)
        self.events.append((sid, st.nbytes()))
        key = st.data_ptr()
        self._refs.append(weakref.ref(st, lambda _: self._freed(sid, key)))

    def _freed(self, sid: int, key: int) -> None:
        if self._open:
            self.events.append((sid, -self.nbytes[sid]))
            if self.sid.get(key) == sid:
                del self.sid[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if flop_formula(func) is not None:  # (op_flops: grouped K / V heads matched as the cost model does;
            # torch 2.11's SDPA formulas assert equal heads)
            self.flops += op_flops(func, args, kwargs, out)
        ins = [t for t in _leaves((args, kwargs)) if _counted(t)]
        keys = [_key(t) for t in ins]
        tracked = tuple(self.sid.get(k) for k in keys)
        copy = bool(keys) and all(k in self.persistent or (self.sid.get(k) is not None and self.copy[self.sid[k]])
                                  for k in keys)
        for t in _leaves(out):
            if _counted(t):
                k = _key(t)
                if k not in self.sid and k not in self.persistent:
                    self._new(t.untyped_storage(), copy, tracked if len(ins) == 1 else ())
        return out

    def close(self, outputs, roles) -> dict:
        """Stop watching; the run's peak: total, by category at it, and each category's maximum."""
        self._open = False
        grads = set()
        for o, (kind, _) in zip(outputs, roles):
            sid = self.sid.get(_key(o)) if kind == "grad" and _counted(o) else None
            while sid is not None and sid not in grads:  # back through single-input ops
                grads.add(sid)
                sid = self.made_from[sid][0] if self.made_from[sid] else None
        cat = ["grads_in_flight" if s in grads else "param_copies" if self.copy[s] else "activations"
               for s in range(len(self.nbytes))]
        cur = dict.fromkeys(CATEGORIES, 0)
        out = {"peak": 0, "at_peak": dict(cur), "max_by": dict(cur), "model_state_peak": 0, "flops": self.flops}
        for sid, delta in self.events:
            cur[cat[sid]] += delta
            total = sum(cur.values())
            if total > out["peak"]:
                out["peak"], out["at_peak"] = total, dict(cur)
            out["model_state_peak"] = max(out["model_state_peak"], cur["param_copies"] + cur["grads_in_flight"])
            for c in CATEGORIES:
                out["max_by"][c] = max(out["max_by"][c], cur[c])
        return out


def _leaves(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)


def _counted(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().nbytes() > 0


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class MemoryTracker:
    """Measured per-rank memory and FLOPs over the steps run while tracking (each figure the
    maximum over those steps; FLOPs summed)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.program_peak = 0  # the allocator: peak above the step's starting level
        self.program_peak_without_backend: int | None = None  # ... without the process group's scratch (CPU)
        self.tensor_peak = 0  # the programs' storages alive at once (ProgramMeter)
        self.at_peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.model_state_peak = 0
        self.max_by: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.flops = 0
        self.steps = 0

    @contextlib.contextmanager
    def step(self):
        """Around one whole train_step: the allocator's peak."""
        with AllocatorPeak(self.device) as alloc:
            yield
        self.program_peak = max(self.program_peak, alloc.peak)
        if alloc.peak_without_backend is not None:
            self.program_peak_without_backend = max(self.program_peak_without_backend or 0, alloc.peak_without_backend)
        self.steps += 1

    def run(self, gm: fx.GraphModule, args, in_roles, out_roles):
        """One run of a per-rank program (its generated code, or a pipeline stage's part) under
        ``ProgramMeter``; ``in_roles`` / ``out_roles``: (kind, name) per argument / output."""
        meter = ProgramMeter(args, in_roles)
        with meter:
            out = call(gm, args)
        m = meter.close(out, out_roles)
        self.flops += m["flops"]
        if m["peak"] > self.tensor_peak:
            self.tensor_peak, self.at_peak = m["peak"], m["at_peak"]
        self.model_state_peak = max(self.model_state_peak, m["model_state_peak"])
        for c in CATEGORIES:
            self.max_by[c] = max(self.max_by[c], m["max_by"][c])
        return out
