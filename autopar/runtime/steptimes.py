"""Step times per rank, compute against waiting, and stragglers.

Each ``train_step`` records on its own rank, sending nothing: the step's wall time and the
seconds it spent blocked in the runtime's waits (collectives, pipeline transfers, the loss
broadcast: ``failure.blocked()``, two clock reads per wait); ``compute`` is the rest (the ops,
the batch checks, Python). A rank that is slow computes longer and waits less; the others wait
for it. With ``pm.guard`` off the programs' own functional waits are not timed (compute then
includes them).

- ``pm.step_times(last=N)``: the last N steps of every rank, gathered (one all-gather of
  2 x N numbers; call it on every rank).
- Every ``straggler_window`` steps (compile's option, 100 by default) ``train_step`` gathers the
  window's compute times the same way (one all-gather of ``window`` numbers per rank, nothing in
  the other steps) and compares each rank with its peers, the ranks running the same program (all
  ranks of an SPMD plan; in a pipeline the ranks holding the same stages): a rank whose compute
  time, step by step, is more than ``straggler_threshold`` (1.2) times the median of its peers' in
  the median step of the window gets a ``StragglerWarning`` naming it (on rank 0), and
  ``pm.stragglers`` holds the last check on every rank. A pipeline rank without peers (no dp
  inside the stages) is not compared: its stages do different work (the measured timeline,
  ``pm.gather_timeline()``, shows their balance).
"""

from __future__ import annotations

import collections
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from autopar.errors import StragglerWarning
from autopar.runtime import failure

KEEP = 1000  # steps of history per rank (fixed memory)


class StepClock:
    """This rank's recent steps: (step, compute seconds, waiting seconds)."""

    def __init__(self, threshold: float | None = 1.2, window: int = 100):
        self.threshold = threshold
        self.window = window
        self.steps: collections.deque = collections.deque(maxlen=max(KEEP, window))
        self.last_check: dict | None = None
        self._t0 = self._b0 = 0.0

    def start(self) -> None:
        self._t0, self._b0 = time.perf_counter(), failure.blocked()

    def stop(self, step: int) -> None:
        total = time.perf_counter() - self._t0
        waited = failure.blocked() - self._b0
        self.steps.append((step, max(0.0, total - waited), waited))

    def due(self, step: int) -> bool:
        return bool(self.threshold) and self.window > 0 and step % self.window == 0

    def lines(self) -> list[str]:
        """The report's section: this rank's medians, the last straggler check."""
        if not self.steps:
            return []
        recent = list(self.steps)[-self.window:]
        c = statistics.median(r[1] for r in recent) * 1e3
        w = statistics.median(r[2] for r in recent) * 1e3
        out = ["", (f"step times on this rank (median of the last {len(recent)} steps): compute {c:.2f} ms, "
                    f"waiting {w:.2f} ms (pm.step_times() gathers every rank's)")]
        if self.last_check is not None:
            chk = self.last_check
            found = ", ".join(f"rank {r} ({x:.2f}x)" for r, x in chk["stragglers"].items()) or "none"
            out.append(f"last straggler check (steps {chk['steps'][0]}-{chk['steps'][1]}, threshold "
                       f"{self.threshold:g}x): {found}")
        return out


def _gather(pm, rows: torch.Tensor, what: str) -> torch.Tensor:
    """``rows`` ([k] float64) of every rank: [world, k] (one all-gather on the default group)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return rows[None]
    dev = pm.ctx.device if pm.ctx.device.type != "meta" else torch.device("cpu")
    t = rows.to(dev)
    out = t.new_empty(world * t.numel())
    work = dist.all_gather_into_tensor(out, t, async_op=True)  # (all_gather_single: torch 2.12 and later only)
    failure.wait(work, what, pm.timeout, guard=pm.guard)
    return out.view(world, -1).cpu()


def _recent(clock: StepClock, last: int, cols: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    """The last ``last`` steps' columns, NaN-padded in front to ``last`` rows (every rank sends
    the same count even if one recorded fewer)."""
    recent = list(clock.steps)[-last:]
    rows = torch.full((last, len(cols)), float("nan"), dtype=torch.float64)
    if recent:
        rows[last - len(recent):] = torch.tensor([[r[c] for c in cols] for r in recent], dtype=torch.float64)
    return [r[0] for r in recent], rows


def step_times(pm, last: int = 100) -> dict:
    """Every rank's last ``last`` steps: ``{"steps": [...], "compute": [[s per step] per rank],
    "wait": [...]}`` (seconds; call on every rank: one all-gather)."""
    steps, rows = _recent(pm.clock, last, (1, 2))
    world = _gather(pm, rows.flatten(), "the step-time gather (pm.step_times)").view(-1, last, 2)
    keep = slice(last - len(steps), last)
    return {"steps": steps, "compute": world[:, keep, 0].tolist(), "wait": world[:, keep, 1].tolist()}


def peers(pm) -> list[list[int]]:
    """Groups of global ranks that run the same program (compared with one another)."""
    world = dist.get_world_size()
    if not pm.pipelined:
        return [list(range(world))]
    mesh = pm.mesh.mesh.movedim(pm.mesh.mesh_dim_names.index(pm.pp_axis), 0)
    return [sorted(int(r) for r in mesh[i].flatten()) for i in range(mesh.shape[0])]


def check(pm) -> dict:
    """Compare the last window's compute times of every rank with its peers' (see the module
    docstring); warn on rank 0 naming the stragglers. Returns (and keeps in ``pm.stragglers``)
    ``{"steps": (first, last), "stragglers": {rank: ratio}, "compute_ms": [...], "wait_ms": [...]}``."""
    clock = pm.clock
    steps, rows = _recent(clock, clock.window, (1, 2))
    world = _gather(pm, rows.flatten(), "the straggler check's step-time gather").view(-1, clock.window, 2)
    comp, wait = world[..., 0], world[..., 1]
    ratio = {}
    for group in peers(pm):
        if len(group) < 2:
            continue
        for r in group:
            others = comp[[q for q in group if q != r]]
            rel = comp[r] / others.median(dim=0).values.clamp_min(1e-9)
            rel = rel[~rel.isnan()]
            if rel.numel():
                ratio[r] = float(rel.median())
    slow = {r: x for r, x in sorted(ratio.items()) if x > clock.threshold}

    def med(t):
        return [round(float(v.nanmedian()) * 1e3, 2) for v in t]

    chk = {"steps": (steps[0], steps[-1]) if steps else (0, 0), "stragglers": slow, "ratios": ratio,
           "compute_ms": med(comp), "wait_ms": med(wait)}
    clock.last_check = chk
    if slow and dist.get_rank() == 0:
        per = "; ".join(f"rank {r}: {c:.1f} / {w:.1f}" for r, (c, w) in enumerate(zip(chk["compute_ms"],
                                                                                         chk["wait_ms"])))
        who = ", ".join(f"rank {r} ({x:.2f}x its peers' compute time)" for r, x in slow.items())
        warnings.warn(StragglerWarning(
            f"straggler{'s' if len(slow) > 1 else ''} over steps {chk['steps'][0]}-{chk['steps'][1]}: {who}, above "
            f"the threshold {clock.threshold:g}x in the median step; compute / waiting per step, ms (medians): {per}. "
            "The other ranks wait for it in every collective: look for another job on its CPU/GPU, thermal "
            "throttling, a slower data loader or a busier host"), stacklevel=3)
    return chk
