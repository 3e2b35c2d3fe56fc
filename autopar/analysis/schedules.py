"""Pipeline schedules as data: a list of actions per rank, a validator and a simulator.

An action is ``(kind, stage, microbatch)`` with kind

- ``F``: forward of ``stage`` on ``microbatch``;
- ``B``: full backward (input gradient and weight gradient together);
- ``I`` / ``W``: the backward split into the input gradient (what the previous stage waits for)
  and the weight gradient (which can run later: zero-bubble schedules fill bubbles with it).

Stage ``s`` of ``P * v`` lives on rank ``s % P`` (``v`` virtual stages per rank for interleaved
schedules). Point-to-point traffic is implied by the dependencies and made explicit by
``with_communication``: the activation of ``F(s, m)`` is sent to the rank of ``s + 1``, the input
gradient of ``B/I(s, m)`` to the rank of ``s - 1``.

Here: generators (GPipe, 1F1B, interleaved 1F1B, ZB-H1), ``validate`` (complete, on the right
ranks, no deadlock), ``simulate`` (per rank timelines, bubble fraction, peak activations in
flight) and ``saved_in_flight`` (the bytes of saved activations a rank's action list holds at
most). passes/split.py splits the model into stages and runs these action lists on
process groups (``plan={"pp": "1f1b"}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Action = tuple[str, int, int]  # (kind, stage, microbatch)


class ScheduleError(ValueError):
    """A schedule that is incomplete, puts an action on the wrong rank, or deadlocks."""


@dataclass
class Schedule:
    name: str
    ranks: int  # P
    microbatches: int  # M
    virtual: int  # v: stages per rank
    actions: list[list[Action]]  # per rank, in execution order

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks


def _check(p: int, m: int, v: int = 1):
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"ranks, micro-batches and virtual stages must be >= 1, got P={p}, M={m}, v={v}")
    if m < p:
        raise ScheduleError(f"{m} micro-batches cannot fill a {p}-stage pipeline (every stage idles): use M >= P")


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (in reverse micro-batch order)."""
    _check(p, m)
    acts = [[("F", r, i) for i in range(m)] + [("B", r, i) for i in reversed(range(m))] for r in range(p)]
    return Schedule("gpipe", p, m, 1, acts)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: P - r - 1 warm-up forwards, then alternate one forward and one backward."""
    _check(p, m)
    acts = []
    for r in range(p):
        warm = min(p - r - 1, m)
        a: list[Action] = [("F", r, i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                a.append(("F", r, f))
                f += 1
            a.append(("B", r, b))
            b += 1
        acts.append(a)
    return Schedule("1f1b", p, m, 1, acts)


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): rank r holds stages r, r + P, ..., micro-batches go
    through the rank's v chunks in groups of P."""
    _check(p, m, v)
    if m % p:
        raise ScheduleError(f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple of the ranks ({p})")
    total = m * v

    def fwd(k):  # the k-th forward on a rank -> (chunk, microbatch)
        group, within = divmod(k, p * v)
        return (within // p), group * p + within % p

    def bwd(k):
        chunk, mb = fwd(k)
        return v - 1 - chunk, mb

    acts = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        a: list[Action] = []
        for k in range(warm):
            c, i = fwd(k)
            a.append(("F", c * p + r, i))
        f, b = warm, 0
        while b < total:
            if f < total:
                c, i = fwd(f)
                a.append(("F", c * p + r, i))
                f += 1
            c, i = bwd(b)
            a.append(("B", c * p + r, i))
            b += 1
        acts.append(a)
    return Schedule(f"interleaved(v={v})", p, m, v, acts)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into
    input gradient I and weight gradient W. Rank r runs each W r steps late, so r + 1 weight
    gradients are left for the end: the input-gradient cascade of the last micro-batch (rank
    P-1 down to 0) no longer waits behind weight gradients, and the deferred W's fill the tail.
    Bubble (P-1)(F+I-W) instead of 1F1B's (P-1)(F+I+W); peak activations P on every rank,
    1F1B's maximum (the "H1" memory bound)."""
    acts = []
    for r, order in enumerate(one_f_one_b(p, m).actions):  # 1F1B's order, B -> I + a late W
        a: list[Action] = []
        w = 0
        for kind, stage, i in order:
            if kind != "B":
                a.append((kind, stage, i))
                continue
            a.append(("I", stage, i))
            if i >= r:  # W of micro-batch i - r
                a.append(("W", stage, w))
                w += 1
        a += [("W", r, i) for i in range(w, m)]
        acts.append(a)
    return Schedule("zb-h1", p, m, 1, acts)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb": zb_h1}


# ------------------------------------------------------------------------------------ validation
def _deps(a: Action, last_stage: int) -> list[Action]:
    kind, s, i = a
    if kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if kind in ("B", "I"):
        own = [("F", s, i)]
        return own + ([(None, s + 1, i)] if s < last_stage else [])  # the next stage's input gradient
    if kind == "W":
        return [("I", s, i)]
    raise ScheduleError(f"unknown action kind {kind!r} in {a}")


def validate(sched: Schedule) -> None:
    """Every (stage, micro-batch) has a forward and a backward (B, or I and W) exactly once, on
    the rank that holds the stage, and the ranks' orders can all run to completion."""
    seen: dict[Action, int] = {}
    for r, acts in enumerate(sched.actions):
        for a in acts:
            kind, s, i = a
            if not (0 <= s < sched.stages and 0 <= i < sched.microbatches):
                raise ScheduleError(f"rank {r}: {a} names a stage or micro-batch outside the schedule")
            if sched.rank_of(s) != r:
                raise ScheduleError(f"rank {r}: {a} belongs on rank {sched.rank_of(s)}")
            if a in seen:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            seen[a] = r
    for s in range(sched.stages):
        for i in range(sched.microbatches):
            if ("F", s, i) not in seen:
                raise ScheduleError(f"incomplete: no forward of stage {s} on micro-batch {i}")
            split = ("I", s, i) in seen or ("W", s, i) in seen
            if split and not (("I", s, i) in seen and ("W", s, i) in seen and ("B", s, i) not in seen):
                raise ScheduleError(f"stage {s} micro-batch {i}: a split backward needs both I and W, and no B")
            if not split and ("B", s, i) not in seen:
                raise ScheduleError(f"incomplete: no backward of stage {s} on micro-batch {i}")
    simulate(sched)  # raises on deadlock


# ------------------------------------------------------------------------------------ simulation
@dataclass
class Timeline:
    makespan: float
    busy: list[float]
    events: list[list[tuple[float, float, Action]]]  # per rank: (start, end, action)
    peak_in_flight: list[int]  # per rank: most (stage, micro-batch) activations held at once (virtual
    # stages count 1 each: divide by v for micro-batches of a whole rank's layers)
    bubble: float = 0.0
    extra: dict = field(default_factory=dict)


def simulate(sched: Schedule, cost: dict | None = None, comm: float = 0.0, per_stage: bool = False) -> Timeline:
    """Run the action lists with durations ``cost`` per stage of a rank (default F=1, B=2, I=1,
    W=1; a virtual stage of an interleaved schedule is 1/v of that) and ``comm`` seconds per
    point-to-point transfer; each rank runs its actions in order, each as soon as its
    dependencies are done. Raises ScheduleError on a deadlock (no rank can make progress).

    ``per_stage=True``: ``cost`` maps each kind to a list of durations, one per (virtual) stage,
    used as given (measured or predicted stage costs); a missing B is I + W, a missing I/W half B."""
    if per_stage:
        c = dict(cost or {})
        n = sched.stages
        if "B" not in c and "I" in c and "W" in c:
            c["B"] = [i + w for i, w in zip(c["I"], c["W"])]
        if "B" in c:
            c.setdefault("I", [b / 2 for b in c["B"]])
            c.setdefault("W", [b / 2 for b in c["B"]])
        table = {k: list(v) + [0.0] * (n - len(v)) for k, v in c.items()}
    else:
        per = {k: c / sched.virtual for k, c in {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, **(cost or {})}.items()}
        table = {k: [v] * sched.stages for k, v in per.items()}
    last = sched.stages - 1
    done: dict[Action, float] = {}
    grad_ready: dict[tuple[int, int], float] = {}  # (stage, mb) -> time its input gradient is ready
    pos = [0] * sched.ranks
    clock = [0.0] * sched.ranks
    events: list[list] = [[] for _ in range(sched.ranks)]
    live = [0] * sched.ranks
    peak = [0] * sched.ranks
    remaining = sum(len(a) for a in sched.actions)
    while remaining:
        progressed = False
        for r in range(sched.ranks):
            while pos[r] < len(sched.actions[r]):
                a = sched.actions[r][pos[r]]
                ready = clock[r]
                ok = True
                for d in _deps(a, last):
                    if d[0] is None:
                        t = grad_ready.get((d[1], d[2]))
                        if t is None:
                            ok = False
                            break
                        ready = max(ready, t + (comm if sched.rank_of(d[1]) != r else 0.0))
                    elif d in done:
                        hop = comm if (d[0] == "F" and sched.rank_of(d[1]) != r) else 0.0
                        ready = max(ready, done[d] + hop)
                    else:
                        ok = False
                        break
                if not ok:
                    break
                end = ready + table[a[0]][a[1]]
                events[r].append((ready, end, a))
                done[a] = end
                clock[r] = end
                if a[0] in ("B", "I"):
                    grad_ready[(a[1], a[2])] = end
                if a[0] == "F":
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                elif a[0] in ("B", "W"):  # activations are freed once the stage's backward is complete
                    live[r] -= 1
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: sched.actions[r][pos[r]] for r in range(sched.ranks) if pos[r] < len(sched.actions[r])}
            raise ScheduleError(f"{sched.name} deadlocks: every rank waits — " + ", ".join(
                f"rank {r} at {a}" for r, a in stuck.items()))
    makespan = max(clock)
    busy = [sum(e - s for s, e, _ in ev) for ev in events]
    bubble = 1.0 - sum(busy) / (sched.ranks * makespan) if makespan else 0.0
    return Timeline(makespan, busy, events, peak, bubble)


def saved_in_flight(actions: list[Action], stages) -> dict:
    """What one rank's action list holds at most: (stage, micro-batch) activation sets and their
    bytes. ``stages``: stage index -> its compiled stage (``saved_bytes``: what F saves for I / W;
    ``saved_after_i``: what W still needs after I)."""
    live, peak, held, peak_bytes = 0, 0, 0, 0
    for kind, s, _ in actions:
        sp = stages[s]
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


def theory_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of the reference schedules with F=1, B=2 (F=I=W=1 for ZB-H1)."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb":  # (P-1)(F+I-W) idle against M(F+I+W) of work
        return (p - 1) * 1 / (3 * m + (p - 1) * 1)
    raise ValueError(name)


def gantt(timelines: dict[str, tuple[Schedule, Timeline]], path: str, unit: str = "") -> str:
    """A PNG (or SVG, by the file name) Gantt chart per schedule: ranks as rows, F/B/I/W coloured,
    micro-batch numbers in the boxes; ``unit`` labels the time axis (measured charts: "s")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c9be8", "B": "#2ca02c", "I": "#ff9f40", "W": "#9467bd"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.0 + 0.45 * sum(s.ranks for s, _ in timelines.values())),
                             squeeze=False)
    for ax, (title, (sched, tl)) in zip(axes[:, 0], timelines.items()):
        for r, ev in enumerate(tl.events):
            for s, e, (kind, stage, mb) in ev:
                shade = 1.0 if sched.virtual == 1 else 0.55 + 0.45 * (stage // sched.ranks) / max(1, sched.virtual - 1)
                ax.barh(r, e - s, left=s, color=colors[kind], alpha=shade, edgecolor="white")
                ax.text((s + e) / 2, r, str(mb), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(sched.ranks), [f"rank {r}" for r in range(sched.ranks)])
        ax.invert_yaxis()
        if unit:
            ax.set_xlabel(unit, fontsize=8)
        ax.set_title(f"{title}: P={sched.ranks}, M={sched.microbatches}, bubble {tl.bubble:.1%}, "
                     f"peak activations in flight {max(tl.peak_in_flight) / sched.virtual:g} micro-batches", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["forward", "backward", "input grad", "weight grad"], loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
