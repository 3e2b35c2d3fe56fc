"""Candidates (dp x tp x pp, strategies, schedule, recompute, micro-batch) and their analytic cost
composed from one block's figures (see autopar.planner)."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.planner.blocks import (DP_STRATEGIES, RECOMPUTE, SCHEDULES, TP_STRATEGIES, _DTYPE_BYTES, Coefficients,
                                     ModelInfo)


# ------------------------------------------------------------------------------------ candidates
@dataclass
class Candidate:
    dp: int
    tp: int
    pp: int
    dp_strategy: str
    tp_strategy: str | None
    schedule: str | None
    virtual: int
    recompute: str
    mbs: int  # micro-batch size (sequences per micro-batch per data-parallel rank)
    microbatches: int
    cp: int = 1  # context-parallel ranks (the sequence split over them)
    cp_strategy: str | None = None  # "ulysses" | "context" (ring attention) when cp > 1
    ep: int = 1  # expert-parallel ranks (experts split over them; the batch too, as over dp)
    # filled by ``cost``
    step_s: float = 0.0
    peak: int = 0
    parts: dict = field(default_factory=dict)
    comm_bytes: dict = field(default_factory=dict)  # wire bytes per rank per step, per axis
    bubble: float = 0.0
    rejected: str = ""
    screened: tuple | None = None  # (step_s, peak) of the analytic composition, once confirmed
    confirmed: dict | None = None  # the compiled figures extrapolated in depth (``confirm``)
    split: tuple | None = None  # a pipeline's split points, once confirmed (the grouping ``confirm`` costed)
    balance: str | None = None  # ... or, where no names can say that grouping, the device that balances it

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.cp * self.tp * self.pp

    @property
    def data(self) -> int:
        """Ranks that split the batch: data-parallel and expert-parallel."""
        return self.dp * self.ep

    @property
    def block_key(self) -> tuple:
        """What one block's compiled figures depend on (``block_coefficients``' arguments)."""
        return self.tp, self.tp_strategy, self.cp, self.cp_strategy, self.ep, self.recompute

    def plan(self) -> dict:
        out: dict = {}
        if self.pp > 1:
            sched = {"schedule": self.schedule, "microbatches": self.microbatches}
            if self.virtual > 1:
                sched["virtual"] = self.virtual
            if self.split:
                sched["split"] = list(self.split)
            elif self.balance:
                sched["balance"] = self.balance
            out["pp"] = sched
        out["dp"] = self.dp_strategy
        if self.ep > 1:
            out["ep"] = "expert"
        if self.cp > 1:
            out["cp"] = self.cp_strategy
        if self.tp > 1:
            out["tp"] = self.tp_strategy
        return out

    def mesh(self) -> dict:
        """Axes slowest-varying first: pp across nodes, tp inside one, cp and ep between."""
        return {k: v for k, v in zip(AXES, self.sizes()) if v > 1 or k == "dp"}

    def sizes(self) -> tuple[int, ...]:
        return self.pp, self.dp, self.ep, self.cp, self.tp

    def label(self) -> str:
        parts = [f"dp={self.dp}:{self.dp_strategy}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}:expert")
        if self.cp > 1:
            parts.append(f"cp={self.cp}:{self.cp_strategy}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}:{self.tp_strategy}")
        if self.pp > 1:
            parts.append(f"pp={self.pp}:{self.schedule}" + (f"(v{self.virtual})" if self.virtual > 1 else ""))
        return " ".join(parts) + f" recompute={self.recompute} mbs={self.mbs} mb={self.microbatches}"


AXES = ("pp", "dp", "ep", "cp", "tp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ring(kind: str, n: int, nbytes: float) -> float:
    if n <= 1:
        return 0.0
    return (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n) * nbytes


def _link_seconds(kind: str, n: int, nbytes: float, link) -> float:
    if n <= 1:
        return 0.0
    alpha, bw = link
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps * alpha + _ring(kind, n, nbytes) / bw


_BUCKETS: dict = {}


def _buckets(kind: str, order: tuple, blocks: int, rest: bool, bucket_mb: float,
             nbytes: int) -> tuple[int, float]:
    """(collectives, bytes of the last) that the bucket pass makes of a rank's gradient
    reductions (``nbytes`` per element): ``order`` is one block's program's gradients in backward order
    (``Coefficients.grads_order``), repeated for ``blocks`` blocks, with the rest's (embeddings,
    head) where ``rest``. The pass's own assignment (passes/bucket.py ``assign_buckets``): a
    reduce-scatter bucket stays within its block. Without the order (no figures): one call."""
    from types import SimpleNamespace

    from autopar.passes.bucket import assign_buckets

    if not order:
        return 1, 0.0
    key = (kind, order, blocks, rest, bucket_mb, nbytes)
    hit = _BUCKETS.get(key)
    if hit is None:
        mine = [e for k, e in order if k == "block"]
        first = next((i for i, (k, _) in enumerate(order) if k == "block"), len(order))
        before = [e for k, e in order[:first] if k == "rest"] if rest else []
        after = [e for k, e in order[first:] if k == "rest"] if rest else []
        units = ([(None, e) for e in before] + [(i, e) for i in range(blocks) for e in mine]
                 + [(None, e) for e in after])
        reds = [SimpleNamespace(key=kind, unit=u if kind == "reduce_scatter" else None, nbytes=e * nbytes)
                for u, e in units]
        got = assign_buckets(reds, bucket_mb * 2**20) if bucket_mb else [[r] for r in reds]
        if len(_BUCKETS) > 4096:
            _BUCKETS.clear()
        hit = _BUCKETS[key] = (len(got), float(sum(r.nbytes for r in got[-1])) if got else 0.0)
    return hit


_SIMULATED: dict = {}


def _simulated(schedule: str, pp: int, m: int, virtual: int, F: tuple, B: tuple, comm: float):
    """(makespan, bubble, peak in flight per rank) of a schedule simulated with per-stage costs;
    remembered (candidates that differ only in what the pipeline does not see share it: ddp,
    zero1 and zero2 over the same stages, for one)."""
    from autopar.analysis import schedules as S

    key = (schedule, pp, m, virtual, F, B, comm)
    hit = _SIMULATED.get(key)
    if hit is None:
        sched = S.one_f_one_b(pp, m) if schedule == "1f1b" else S.interleaved(pp, m, virtual)
        tl = S.simulate(sched, {"F": list(F), "B": list(B)}, comm=comm, per_stage=True)
        if len(_SIMULATED) > 4096:
            _SIMULATED.clear()
        hit = _SIMULATED[key] = (tl.makespan, tl.bubble, tl.peak_in_flight)
    return hit


def cost(c: Candidate, info: ModelInfo, co: Coefficients, dev, *, precision: str, optimizer: str = "adamw",
         layers: int | None = None, bucket_mb: float = 25) -> Candidate:
    """Fill ``c``'s predicted step time, peak bytes per rank and bytes per axis from one block's figures."""
    from autopar.analysis.cost import OPTIMIZER_STATE, axis_links, optimizer_seconds

    L = layers or info.layers
    b, r = co.block, co.rest
    stages = c.pp * c.virtual
    per_stage = L // stages
    per_rank = L // c.pp
    cb = _DTYPE_BYTES[precision]
    d = c.dp
    links = axis_links(AXES, c.sizes(), dev)
    nstate = OPTIMIZER_STATE[optimizer]

    # ---- time of one micro-batch per (virtual) stage; the rest's compute where the split puts
    # it: the embedding on the first stage, the final norm, LM head and loss on the last
    F = [per_stage * b.fwd_s for _ in range(stages)]
    B = [per_stage * b.bwd_s for _ in range(stages)]
    F[0] += r.first_fwd_s
    B[0] += r.first_bwd_s
    F[-1] += r.fwd_s - r.first_fwd_s
    B[-1] += r.bwd_s - r.first_bwd_s
    # FSDP: each block's parameters gathered in forward and again in backward, one block ahead
    gather_exposed = 0.0
    fsdp_bytes = 0.0
    ag_b = 0.0
    if c.dp_strategy == "fsdp" and d > 1:
        ag_b = _link_seconds("all_gather", d, b.param_elems * cb, links["dp"])
        fsdp_bytes = _ring("all_gather", d, (per_rank * b.param_elems + r.param_elems / max(1, c.pp)) * cb) * 2
        exposed_f = max(0.0, ag_b - b.fwd_s)
        exposed_b = max(0.0, ag_b - b.bwd_s)
        # link-bound: the dp link carries two gathers per block per micro-batch; what the block's
        # compute cannot cover is exposed whatever the order
        bound = max(0.0, 2 * ag_b - b.fwd_s - b.bwd_s)
        if bound > exposed_f + exposed_b:
            exposed_f, exposed_b = bound / 2, bound / 2
        F = [f + per_stage * exposed_f for f in F]
        B = [x + per_stage * exposed_b for x in B]
        F[0] += ag_b  # the first gather has nothing to hide under
        gather_exposed = ag_b
    # without a pipeline, the loss over batch rows sharded on dp: its sum and its count all-reduced
    # in each micro-batch's forward (autopar's rule for nll_loss), two calls that are all latency. (A
    # pipeline's last stage takes its micro-batch's loss as it is: its compiled programs have none.)
    loss_ar = 2 * _link_seconds("all_reduce", d, 4, links["dp"]) if d > 1 and c.pp == 1 else 0.0
    F[-1] += loss_ar
    m = c.microbatches
    if c.pp > 1:
        # a stage hands the next its micro-batch's activations: sequence-sharded over cp, and
        # over tp too under sequence parallelism
        hop_bytes = c.mbs * info.seq * info.hidden * cb / c.cp / (c.tp if c.tp_strategy == "sequence" else 1)
        alpha, bw = links["pp"]
        makespan, c.bubble, live = _simulated(c.schedule, c.pp, m, c.virtual, tuple(F), tuple(B), alpha + hop_bytes / bw)
        # live: per rank, the (virtual stage, micro-batch) activation sets it holds at most
        p2p = 2 * m * hop_bytes * (stages - 1) / c.pp  # per rank on average, both directions
    else:
        makespan = m * (F[0] + B[0])
        live, p2p = [1], 0.0
    # ---- data-parallel gradient traffic (per step) and what hides under the last backward
    grad_elems = per_rank * b.param_elems + r.param_elems / max(1, c.pp)
    g = grad_elems * cb
    kind = "all_reduce" if c.dp_strategy in ("ddp", "zero1") else "reduce_scatter"
    # one collective per gradient bucket (passes/bucket.py), each paying the ring's latency: on a
    # wide dp axis across nodes (127 steps of 20 us at dp=128) the calls, not the bytes, decide
    calls, last = _buckets(kind, co.grads_order, per_rank, c.pp == 1, bucket_mb, cb) if d > 1 else (1, g)
    alpha = links["dp"][0] * (2 * (d - 1) if kind == "all_reduce" else d - 1)
    sync = _link_seconds(kind, d, g, links["dp"]) + (calls - 1) * alpha if d > 1 else 0.0
    # ZeRO-1/2: the updated parameters gathered back in the compute dtype, one call per block
    # (and one for the rest)
    zero_gather = (_link_seconds("all_gather", d, grad_elems * cb, links["dp"])
                   + per_rank * links["dp"][0] * (d - 1) if c.dp_strategy in ("zero1", "zero2") and d > 1 else 0.0)
    if c.pp > 1 or m > 1:
        # the pipeline runs its gradient sync after the schedule; under accumulation the sync
        # program runs after the last micro-batch: neither overlaps with a backward
        sync_exposed = sync
    else:
        sync_exposed = max(_link_seconds(kind, d, last, links["dp"]) if d > 1 else 0.0,
                           sync - B[0] * (1 - 1 / max(1, L)))
    elems_local = grad_elems / (d if c.dp_strategy in ("zero1", "zero2", "fsdp") else 1)
    opt_s = optimizer_seconds(elems_local, optimizer, dev)
    step = makespan + sync_exposed
    if c.pp == 1:
        # the dp link carries FSDP's gathers and the gradient reductions one after the other:
        # what the compute cannot cover is exposed, whichever order they run in
        link = m * loss_ar + sync
        if c.dp_strategy == "fsdp" and d > 1:  # each block's gathers, and the rest's (forward and backward)
            rest_ag = _link_seconds("all_gather", d, r.param_elems * cb, links["dp"])
            link += m * (2 * per_stage * ag_b + 2 * rest_ag)
        step = max(step, link)
    c.step_s = step + zero_gather + opt_s
    # ---- memory of the worst pipeline rank: rank 0 (embeddings, most in flight) or the last (head).
    # Without a pipeline the program peaks either between forward and backward (activations +
    # parameter copies) or at the end of the backward (the gradients), whichever is larger.
    worst, parts = -1, {}
    # (gradients all-reduced over cp / ep first are held whole until their reduce-scatter)
    sharded_grads = c.dp_strategy in ("zero2", "fsdp") and d > 1 and c.cp == c.ep == 1
    for rank in sorted({0, c.pp - 1}):
        if c.pp == 1:
            rest_share = 1.0
        else:
            rest_share = (info.embed_share if rank == 0 else 0.0) + ((1 - info.embed_share) if rank == c.pp - 1
                                                                     else 0.0)
        elems = per_rank * b.param_elems + rest_share * r.param_elems
        # ZeRO-1/2 and FSDP keep the fp32 master parameters sharded with the optimizer state
        params = elems * 4 / (d if c.dp_strategy != "ddp" else 1)
        opt = elems * 4 * nstate / (d if c.dp_strategy != "ddp" else 1)
        grads = (per_rank * b.grads + rest_share * r.grads) / (d if sharded_grads else 1)
        inflight = live[rank] if c.pp > 1 else 1  # (virtual stage, micro-batch) sets
        if c.dp_strategy == "fsdp" and d > 1:  # one block ahead gathered, the root kept gathered
            copies = (2 * b.param_elems + rest_share * r.param_elems) * cb
        else:
            # compute-dtype casts saved for the backward: one set of the rank's blocks (in a
            # pipeline the stage's prologue makes them once per step for every micro-batch)
            copies = per_rank * b.copies + rest_share * r.copies
            if c.dp_strategy in ("zero1", "zero2") and d > 1:  # the gathered full parameters
                copies = max(copies, elems * cb)
        acts = inflight * per_stage * b.acts + rest_share * r.acts
        if c.pp > 1:
            # the executor sums each stage's gradients (unreduced: the sync program reduces them
            # after the schedule) from the stage's first backward on, while later micro-batches'
            # activations are still in flight: the peak holds both
            acc = per_rank * b.grads + rest_share * r.grads
            # ... and a backward part returns its stage's gradients whole before they are added in
            program = acts + copies + acc + per_stage * b.grads + rest_share * r.grads
        else:
            acc = elems * 4 if m > 1 else 0.0  # accumulate=m: the unreduced fp32 gradient sums
            program = max(acts + copies, grads) + acc
        total = params + opt + program
        if total > worst:
            worst = total
            parts = {"parameters": int(params), "optimizer_state": int(opt), "gradients": int(grads),
                     "param_copies": int(copies), "activations": int(acts), "accumulators": int(acc),
                     "rank": rank}
    c.peak, c.parts = int(worst), parts
    # the block's own axes: per micro-batch traffic m times, gradient traffic once per step; the
    # rest's (embeddings, head, loss) counted on a pipeline's ranks as on its last
    own = {ax: int(per_rank * (b.bytes_on(ax, "mb") * m + b.bytes_on(ax, "grad"))
                   + r.bytes_on(ax, "mb") * m + r.bytes_on(ax, "grad")) for ax in ("tp", "cp", "ep")}
    c.comm_bytes = {**{ax: v for ax, v in own.items() if v or ax == "tp"},
                    "dp": int(_ring(kind, d, g) + fsdp_bytes * m + (_ring("all_gather", d, grad_elems * cb)
                                                                    if zero_gather else 0)),
                    "pp": int(p2p)}
    c.parts["gather_exposed_s"] = gather_exposed
    c.parts["sync_exposed_s"] = sync_exposed
    c.parts["optimizer_s"] = opt_s
    return c


CP_STRATEGIES = ("ulysses", "context")


def candidates(info: ModelInfo, world: int, dev, *, mesh: dict | None = None, mbs_choices=(1, 2),
               dp_strategies=DP_STRATEGIES, tp_strategies=TP_STRATEGIES, recompute=RECOMPUTE,
               schedules=SCHEDULES, cp_strategies=(), expert: bool = False) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Every candidate for ``world`` ranks, and (label, reason) for the factorizations refused
    before costing. ``cp_strategies`` (ulysses, context) adds context-parallel axes; ``expert``
    adds expert-parallel ones (a MoE model)."""
    out, refused = [], []
    for tp in _divisors(world):
        for cp in _divisors(world // tp) if cp_strategies else [1]:
            for ep in _divisors(world // (tp * cp)) if expert else [1]:
                for pp in _divisors(world // (tp * cp * ep)):
                    dp = world // (tp * cp * ep * pp)
                    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
                    if mesh is not None and any(mesh.get(k, v) != v for k, v in sizes.items()):
                        continue  # ``mesh`` fixes the axes it names; the others stay free
                    lab = " ".join(f"{k}={v}" for k, v in sizes.items() if v > 1 or k in ("dp", "tp", "pp"))
                    why = next((reason for bad, reason in (
                        (tp > dev.ranks_per_node, f"tp={tp} spans nodes of {dev.ranks_per_node} ranks"),
                        (dev.ranks_per_node % tp, f"tp={tp} does not divide a node's {dev.ranks_per_node} ranks"),
                        (info.vocab % tp, f"vocabulary {info.vocab} not divisible by tp={tp} (embedding and LM head)"),
                        (info.heads % tp or info.kv_heads % tp,
                         f"{info.heads} heads / {info.kv_heads} KV heads not divisible by tp={tp}"),
                        (info.layers % pp, f"{info.layers} {'units of blocks' if info.period > 1 else 'layers'} "
                                           f"not divisible by pp={pp}"),
                        (info.batch % (dp * ep), f"global batch {info.batch} not divisible by dp x ep={dp * ep}"),
                        (ep > 1 and info.experts % ep, f"{info.experts} experts not divisible by ep={ep}"),
                    ) if bad), None)
                    if why is not None:
                        refused.append((lab, why))
                        continue
                    cps = [(None, 1)] if cp == 1 else []
                    for cs in cp_strategies if cp > 1 else ():
                        # ulysses splits the heads over tp x cp; the ring cuts the sequence in 2 x cp chunks
                        bad = (info.seq % cp and f"sequence {info.seq} not divisible by cp={cp}" if cs == "ulysses"
                               else info.seq % (2 * cp) and f"sequence {info.seq} not divisible by 2 x cp={2 * cp}")
                        bad = bad or (cs == "ulysses" and info.heads % (tp * cp)
                                      and f"{info.heads} heads not divisible by tp x cp={tp * cp}")
                        if bad:
                            refused.append((lab + f" cp={cs}", bad))
                        else:
                            cps.append((cs, cp))
                    for mbs in mbs_choices:
                        if (info.batch // (dp * ep)) % mbs:
                            continue
                        m = info.batch // (dp * ep) // mbs
                        if pp > 1 and m < pp:
                            refused.append((lab + f" mbs={mbs}", f"{m} micro-batches cannot fill {pp} stages"))
                            continue
                        scheds = [(None, 1)] if pp == 1 else [(s, 2 if s == "interleaved" else 1) for s in schedules]
                        for sched, v in scheds:
                            if pp > 1 and info.layers % (pp * v):
                                continue
                            if sched == "interleaved" and m % pp:
                                continue
                            for ts in (tp_strategies if tp > 1 else (None,)):
                                for cs, _ in cps:
                                    for ds in (dp_strategies if dp > 1 else ("ddp",)):
                                        for rc in recompute:
                                            out.append(Candidate(dp, tp, pp, ds, ts, sched, v, rc, mbs, m, cp, cs, ep))
    return out, refused


def model_flops_per_step(info: ModelInfo, recompute: bool = False) -> float:
    """Narayanan et al. (SC'21) eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh), with recomputation
    (one extra forward: 4 passes); 72 ... without (3 passes)."""
    B, s, l, h, V = info.batch, info.seq, info.layers * info.period, info.hidden, info.vocab
    k = 96 if recompute else 72
    return k * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
