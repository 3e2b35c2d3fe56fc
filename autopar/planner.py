"""``plan="auto"``: choose the mesh, the strategy per axis, the pipeline and recomputation.

The search costs a candidate from what the compiler and the cost model say about ONE transformer
block, not from a compile of the whole model per candidate:

1. **Block coefficients, compiled.** For every tensor-parallel choice (tp size and strategy:
   megatron or sequence), recompute choice (none / selective / full) and micro-batch size, the
   model is built at depth 1 and depth 2 (its own config with ``n_layers`` /
   ``num_hidden_layers`` overridden) and compiled on a fake tp-only mesh; the cost model runs on
   each per-rank program. The difference of the two is one block (its parameters, its saved
   activations by category at the program's peak, its forward and backward time with its own
   tensor-parallel collectives as the simulator overlaps them); depth 1 minus one block is the
   rest (embeddings, final norm, head, loss). A third depth checks that the blocks really are
   identical: depth 3 minus depth 2 must equal depth 2 minus depth 1 (``Coefficients.linear``),
   otherwise the search refuses the model rather than extrapolating.
2. **Composition, analytic.** A candidate is ``dp x tp x pp`` with a data-parallel strategy
   (ddp, zero1, zero2, fsdp), a pipeline schedule (1f1b, interleaved with 2 virtual stages) and
   a micro-batch count. Its memory is the block figures times the blocks a rank holds and keeps
   in flight (the schedule's simulated peak of live micro-batches), sharded as the strategy
   shards them; its time is the pipeline schedule simulated with per-stage block costs
   (``analysis.schedules.simulate``), plus point-to-point hops, plus the data-parallel traffic
   (ring formulas, alpha-beta on the link the axis lands on) minus what overlaps with compute,
   plus the optimizer step. Axes are placed as ``(pp, dp, tp)``: tp varies fastest (inside a
   node), pp slowest (across nodes).
3. **Check against a real compile** (``verify``): the chosen plan is compiled for real (fake
   process group, full mesh, rank 0) at a reduced depth, and the composition at that depth is
   compared with the cost model's figures for the compiled program. The ratios are printed.

What the composition assumes (each is checked by ``verify`` / tests/test_planner.py on small
meshes, not assumed silently): ZeRO/FSDP gradient traffic hides under the backward of the last
micro-batch except the last block's share; FSDP gathers one block ahead (two blocks' compute-dtype
parameters alive) and hides each gather under the previous block's compute; the rest's time sits
on the last pipeline stage and its parameters split between first (embeddings) and last stage.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

from autopar.errors import PlanError

DP_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
TP_STRATEGIES = ("megatron", "sequence")
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved")
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ------------------------------------------------------------------------------------ block figures
@dataclass
class Figures:
    """What the cost model says about one compiled per-rank program (or a difference of two)."""
    param_elems: int = 0  # local parameter elements
    params: int = 0  # bytes of fp32 master parameters (local)
    copies: int = 0  # most bytes of compute-dtype parameter copies alive at once
    grads: int = 0  # most bytes of gradients in flight at once (the end of the backward)
    acts: int = 0  # most bytes alive at once outside the gradients, less the parameter copies
    fwd_s: float = 0.0  # forward: compute + exposed tensor-parallel communication
    bwd_s: float = 0.0
    flops: int = 0
    tp_bytes: int = 0  # tensor-parallel wire bytes per rank

    def __sub__(self, o: "Figures") -> "Figures":
        return Figures(*(getattr(self, f) - getattr(o, f) for f in self.__dataclass_fields__))

    def scaled(self, k: float) -> "Figures":
        """The figures for ``k`` times the sequences per micro-batch: per-sequence quantities
        scale, the parameters (and their copies and gradients) do not."""
        if k == 1:
            return self
        return Figures(self.param_elems, self.params, self.copies, self.grads, int(self.acts * k), self.fwd_s * k,
                       self.bwd_s * k, int(self.flops * k), int(self.tp_bytes * k))

    def close(self, o: "Figures", rel: float = 0.02) -> list[str]:
        bad = []
        for f in self.__dataclass_fields__:
            a, b = getattr(self, f), getattr(o, f)
            if abs(a - b) > rel * max(abs(a), abs(b), 1e-12) + (1e-9 if isinstance(a, float) else 0):
                bad.append(f"{f}: {a:.6g} vs {b:.6g}")
        return bad


def figures_of(pm, dev) -> Figures:
    """One compiled (non-pipelined) ParallelModule -> Figures, through the cost model."""
    from torch.distributed.tensor import DTensor

    from autopar.analysis import cost

    mem = cost.predict_memory(pm, "none")
    prog = cost.program_memory(pm.program.local, pm.program.inputs, pm.program.outputs)
    links = cost.axis_links(pm.ctx.axis_names, pm.ctx.axis_sizes, dev)
    est = cost.simulate(pm.program.local, dev, links, cost.core_share(dev, math.prod(pm.ctx.axis_sizes)))
    elems = sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in pm.parameters())
    comp = sum(est.by_phase.values()) or 1.0
    fwd_share = est.by_phase.get("forward", 0.0) / comp
    tp_bytes = sum(r.wire_bytes for r in pm.collectives())
    copies = prog.max_by["param_copies"]
    return Figures(elems, mem["parameters"], copies, prog.max_by["grads_in_flight"],
                   prog.peak_without_grads - copies, est.step_s * fwd_share, est.step_s * (1 - fwd_share),
                   est.flops, tp_bytes)


@dataclass
class Coefficients:
    block: Figures
    rest: Figures
    linear: list[str]  # depth 3 - depth 2 against depth 2 - depth 1: what differs (empty: identical blocks)
    compile_s: float


    def scaled(self, k: float) -> "Coefficients":
        return Coefficients(self.block.scaled(k), self.rest.scaled(k), self.linear, self.compile_s)


@dataclass
class ModelInfo:
    spec: str
    depth_field: str
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    batch: int
    seq: int
    embed_share: float  # of the non-block parameters: the part on the first pipeline stage
    params: int
    overrides: dict = field(default_factory=dict)


def model_info(spec: str, batch: int | None, seq: int | None, overrides: dict | None) -> ModelInfo:
    from autopar.models import zoo

    if ":" in spec or spec not in zoo.BUILTINS:
        raise PlanError(f"plan='auto' needs a built-in model, got {spec!r}", where="MODEL argument",
                        fix="use a built-in name (autopar plan --list-models): the search rebuilds the model at "
                            "depths 1-3 from its config; give a fixed --plan for a package.module:factory model")
    family, fields, b, s, _ = zoo.BUILTINS[spec]
    fields = {**fields, **(overrides or {})}
    loaded = zoo.load(spec, batch=batch, seq=seq, overrides=overrides)
    if family == "llama":
        from autopar.models.llama import LlamaConfig

        cfg = LlamaConfig(**{k: v for k, v in fields.items()})
        depth, layers, heads, kv, hidden, vocab = "n_layers", cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.dim, \
            cfg.vocab_size
    else:
        cfg = loaded.model.config
        depth, layers, heads, hidden, vocab = ("num_hidden_layers", cfg.num_hidden_layers, cfg.num_attention_heads,
                                               cfg.hidden_size, cfg.vocab_size)
        kv = getattr(cfg, "num_key_value_heads", None) or heads
    embed = other = 0
    for name, p in loaded.model.named_parameters():
        if ".layers." in f".{name}":
            continue
        if "embed" in name or "wte" in name or "wpe" in name:
            embed += p.numel()
        else:
            other += p.numel()
    tokens = loaded.example_inputs[0]
    return ModelInfo(spec, depth, layers, heads, kv, hidden, vocab, tokens.shape[0], tokens.shape[1],
                     embed / max(1, embed + other), sum(p.numel() for p in loaded.model.parameters()),
                     dict(overrides or {}))


def block_coefficients(info: ModelInfo, tp: int, tp_strategy: str | None, recompute: str, mbs: int, *,
                       precision: str, dev, check: bool = False, kernels: str = "off") -> Coefficients:
    """Compile the model at depths 1 and 2 (3 with ``check``) on a fake tp-only mesh and difference."""
    import autopar
    from autopar.models import zoo
    from autopar.tools.explain import fake_mesh

    t0 = time.perf_counter()
    figs = []
    for depth in (1, 2, 3) if check else (1, 2):
        loaded = zoo.load(info.spec, batch=mbs, seq=info.seq, overrides={**info.overrides, info.depth_field: depth})
        axes = {"tp": tp}
        plan = {"tp": tp_strategy if tp > 1 else "ddp"}
        with fake_mesh(axes, 0) as mesh, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                                 plan=plan, precision=precision, recompute=recompute, capture_eval=False,
                                 kernels=kernels)
            figs.append(figures_of(pm, dev))
    block = figs[1] - figs[0]
    linear = (figs[2] - figs[1]).close(block) if check else []
    return Coefficients(block, figs[0] - block, linear, time.perf_counter() - t0)


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
    # filled by ``cost``
    step_s: float = 0.0
    peak: int = 0
    parts: dict = field(default_factory=dict)
    comm_bytes: dict = field(default_factory=dict)  # wire bytes per rank per step, per axis
    bubble: float = 0.0
    rejected: str = ""
    screened: tuple | None = None  # (step_s, peak) of the analytic composition, once confirmed
    confirmed: dict | None = None  # the compiled figures extrapolated in depth (``confirm``)

    def plan(self) -> dict:
        out: dict = {}
        if self.pp > 1:
            sched = {"schedule": self.schedule, "microbatches": self.microbatches}
            if self.virtual > 1:
                sched["virtual"] = self.virtual
            out["pp"] = sched
        out["dp"] = self.dp_strategy
        if self.tp > 1:
            out["tp"] = self.tp_strategy
        return out

    def mesh(self) -> dict:
        return {k: v for k, v in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp)) if v > 1 or k == "dp"}

    def label(self) -> str:
        parts = [f"dp={self.dp}:{self.dp_strategy}"]
        if self.tp > 1:
            parts.append(f"tp={self.tp}:{self.tp_strategy}")
        if self.pp > 1:
            parts.append(f"pp={self.pp}:{self.schedule}" + (f"(v{self.virtual})" if self.virtual > 1 else ""))
        return " ".join(parts) + f" recompute={self.recompute} mbs={self.mbs} mb={self.microbatches}"


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


def cost(c: Candidate, info: ModelInfo, co: Coefficients, dev, *, precision: str, optimizer: str = "adamw",
         layers: int | None = None, bucket_mb: float = 25) -> Candidate:
    """Fill ``c``'s predicted step time, peak bytes per rank and bytes per axis from one block's figures."""
    from autopar.analysis import schedules as S
    from autopar.analysis.cost import OPTIMIZER_STATE, _optimizer_bytes_per_element, axis_links

    L = layers or info.layers
    b, r = co.block, co.rest
    stages = c.pp * c.virtual
    per_stage = L // stages
    per_rank = L // c.pp
    cb = _DTYPE_BYTES[precision]
    d = c.dp
    names, sizes = ("pp", "dp", "tp"), (c.pp, c.dp, c.tp)
    links = axis_links(names, sizes, dev)
    nstate = OPTIMIZER_STATE[optimizer]

    # ---- time of one micro-batch per (virtual) stage; the rest's compute on the last stage
    F = [per_stage * b.fwd_s for _ in range(stages)]
    B = [per_stage * b.bwd_s for _ in range(stages)]
    F[-1] += r.fwd_s
    B[-1] += r.bwd_s
    # FSDP: each block's parameters gathered in forward and again in backward, one block ahead
    gather_exposed = 0.0
    fsdp_bytes = 0.0
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
    m = c.microbatches
    if c.pp > 1:
        maker = {"1f1b": lambda: S.one_f_one_b(c.pp, m),
                 "interleaved": lambda: S.interleaved(c.pp, m, c.virtual)}[c.schedule]
        sched = maker()
        hop_bytes = c.mbs * info.seq * info.hidden * cb / (c.tp if c.tp_strategy == "sequence" else 1)
        alpha, bw = links["pp"]
        tl = S.simulate(sched, {"F": F, "B": B}, comm=alpha + hop_bytes / bw, per_stage=True)
        makespan, c.bubble = tl.makespan, tl.bubble
        live = tl.peak_in_flight  # per rank: (virtual stage, micro-batch) activation sets at most
        p2p = 2 * m * hop_bytes * (stages - 1) / c.pp  # per rank on average, both directions
    else:
        makespan = m * (F[0] + B[0])
        live, p2p = [1], 0.0
    # ---- data-parallel gradient traffic (per step) and what hides under the last backward
    grad_elems = per_rank * b.param_elems + r.param_elems / max(1, c.pp)
    g = grad_elems * cb
    kind = "all_reduce" if c.dp_strategy in ("ddp", "zero1") else "reduce_scatter"
    sync = _link_seconds(kind, d, g, links["dp"])
    zero_gather = _link_seconds("all_gather", d, grad_elems * 4, links["dp"]) if c.dp_strategy in ("zero1", "zero2") else 0.0
    if c.pp > 1 or m > 1:
        # the pipeline runs its gradient sync after the schedule; under accumulation the sync
        # program runs after the last micro-batch: neither overlaps with a backward
        sync_exposed = sync
    else:
        bucket = min(1.0, bucket_mb * 2**20 / max(1.0, g))
        sync_exposed = max(sync * bucket, sync - B[0] * (1 - 1 / max(1, L)))
    elems_local = grad_elems / (d if c.dp_strategy in ("zero1", "zero2", "fsdp") else 1)
    opt_s = elems_local * _optimizer_bytes_per_element(optimizer) / dev.mem_bw
    c.step_s = makespan + sync_exposed + zero_gather + opt_s
    # ---- memory of the worst pipeline rank: rank 0 (embeddings, most in flight) or the last (head).
    # The program peaks either between forward and backward (activations + parameter copies) or
    # at the end of the backward (the gradients), whichever is larger.
    worst, parts = -1, {}
    sharded_grads = c.dp_strategy in ("zero2", "fsdp") and d > 1
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
            # compute-dtype casts saved for the backward: per micro-batch in flight in a pipeline
            # (each micro-batch's forward casts its stage's parameters again)
            copies = inflight * per_stage * b.copies + rest_share * r.copies if c.pp > 1 else \
                per_rank * b.copies + rest_share * r.copies
            if c.dp_strategy in ("zero1", "zero2") and d > 1:  # the gathered full parameters
                copies = max(copies, elems * cb)
        acts = inflight * per_stage * b.acts + rest_share * r.acts
        acc = elems * 4 if (c.pp == 1 and m > 1) else 0.0  # accumulate=m: the unreduced fp32 gradient sums
        program = max(acts + copies, grads)
        total = params + opt + program + acc
        if total > worst:
            worst = total
            parts = {"parameters": int(params), "optimizer_state": int(opt), "gradients": int(grads),
                     "param_copies": int(copies), "activations": int(acts), "accumulators": int(acc),
                     "rank": rank}
    c.peak, c.parts = int(worst), parts
    c.comm_bytes = {"tp": int(b.tp_bytes * per_rank * m + (r.tp_bytes * m if c.pp == 1 else 0)),
                    "dp": int(_ring(kind, d, g) + fsdp_bytes * m + (_ring("all_gather", d, grad_elems * 4)
                                                                    if zero_gather else 0)),
                    "pp": int(p2p)}
    c.parts["gather_exposed_s"] = gather_exposed
    c.parts["sync_exposed_s"] = sync_exposed
    c.parts["optimizer_s"] = opt_s
    return c


def candidates(info: ModelInfo, world: int, dev, *, mesh: dict | None = None, mbs_choices=(1, 2),
               dp_strategies=DP_STRATEGIES, tp_strategies=TP_STRATEGIES, recompute=RECOMPUTE,
               schedules=SCHEDULES) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Every candidate for ``world`` ranks, and (label, reason) for the factorizations refused
    before costing."""
    out, refused = [], []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if mesh is not None and (mesh.get("tp", 1), mesh.get("pp", 1), mesh.get("dp", 1)) != (tp, pp, dp):
                continue
            lab = f"dp={dp} tp={tp} pp={pp}"
            if tp > dev.ranks_per_node:
                refused.append((lab, f"tp={tp} spans nodes of {dev.ranks_per_node} ranks"))
                continue
            if info.heads % tp or info.kv_heads % tp:
                refused.append((lab, f"{info.heads} heads / {info.kv_heads} KV heads not divisible by tp={tp}"))
                continue
            if info.layers % pp:
                refused.append((lab, f"{info.layers} layers not divisible by pp={pp}"))
                continue
            if info.batch % dp:
                refused.append((lab, f"global batch {info.batch} not divisible by dp={dp}"))
                continue
            for mbs in mbs_choices:
                if (info.batch // dp) % mbs:
                    continue
                m = info.batch // dp // mbs
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
                        for ds in (dp_strategies if dp > 1 else ("ddp",)):
                            for rc in recompute:
                                out.append(Candidate(dp, tp, pp, ds, ts, sched, v, rc, mbs, m))
    return out, refused


@dataclass
class SearchResult:
    ranked: list[Candidate]  # fits, fastest first
    over_budget: list[Candidate]
    refused: list[tuple[str, str]]
    considered: int
    compiles: int
    seconds: float
    coefficient_seconds: float
    linear_check: list[str]
    info: ModelInfo
    budget: int | None
    device: str


def search(spec: str, world: int, *, device: str = "h100", budget: int | str | None = None,
           batch: int | None = None, seq: int | None = None, overrides: dict | None = None,
           mesh: dict | None = None, precision: str = "bf16", optimizer: str = "adamw",
           mbs_choices=(1, 2), dp_strategies=DP_STRATEGIES, tp_strategies=TP_STRATEGIES,
           recompute=RECOMPUTE, schedules=SCHEDULES, confirm_top: int = 2, progress=None) -> SearchResult:
    """Rank every candidate plan for ``world`` ranks by predicted step time, under ``budget``."""
    from autopar.analysis import cost as C
    from autopar.analysis.budget import parse_budget

    t0 = time.perf_counter()
    progress = progress or (lambda s: None)
    if world < 1:
        raise PlanError(f"world size must be >= 1, got {world}", where="--world")
    dev = C.get_device(device)
    limit = parse_budget(budget) if budget is not None else None
    info = model_info(spec, batch, seq, overrides)
    cands, refused = candidates(info, world, dev, mesh=mesh, mbs_choices=mbs_choices, dp_strategies=dp_strategies,
                                tp_strategies=tp_strategies, recompute=recompute, schedules=schedules)
    if not cands:
        why = "; ".join(f"{a}: {b}" for a, b in refused[:6]) or "no factorization"
        raise PlanError(f"no plan for {spec} on {world} ranks", where="plan='auto'", fix=f"refused: {why}")
    # one compiled pair per (tp, strategy, recompute) at the smallest micro-batch; a larger one
    # scales the per-sequence figures (activations, compute, tensor-parallel bytes) linearly
    base_mbs = min(c.mbs for c in cands)
    keys = sorted({(c.tp, c.tp_strategy, c.recompute, base_mbs) for c in cands}, key=str)
    coeffs: dict = {}
    linear: list[str] = []
    tc = time.perf_counter()
    for i, key in enumerate(keys):
        tp, ts, rc, mbs = key
        progress(f"block figures {i + 1}/{len(keys)}: tp={tp} {ts or ''} recompute={rc} mbs={mbs}")
        co = block_coefficients(info, tp, ts, rc, mbs, precision=precision, dev=dev, check=(i == 0))
        if i == 0 and co.linear:
            raise PlanError(f"{spec}: its blocks are not identical (depth 3 - depth 2 differs from depth 2 - depth 1: "
                            + "; ".join(co.linear) + ")", where="plan='auto'",
                            fix="give a fixed plan (the search extrapolates one block to the model's depth)")
        linear = linear or (["identical"] if i == 0 else [])
        coeffs[key] = co
    tcoef = time.perf_counter() - tc
    progress(f"costing {len(cands)} candidates")
    fits, over = [], []
    for c in cands:
        cost(c, info, coeffs[(c.tp, c.tp_strategy, c.recompute, base_mbs)].scaled(c.mbs / base_mbs), dev,
             precision=precision, optimizer=optimizer)
        if limit is not None and c.peak > limit:
            c.rejected = f"predicted peak {c.peak / 2**30:.1f} GiB > budget {limit / 2**30:.1f} GiB"
            over.append(c)
        else:
            fits.append(c)
    fits.sort(key=lambda c: (c.step_s, c.peak))
    n_compiles = sum(3 if i == 0 else 2 for i in range(len(keys)))
    # confirm the best screened candidates by compiling them (two depths each) and re-rank those:
    # the top ``confirm_top``, and the best of each data-parallel strategy (the screen's error is
    # largest between strategies: their extra ops and collective latencies are not in one block)
    done: list[Candidate] = []
    tries = 0
    order = fits[:confirm_top]
    for ds in DP_STRATEGIES:
        best = next((c for c in fits if c.dp_strategy == ds), None)
        if best is not None and all(best is not o for o in order):
            order.append(best)
    chosen = {id(c) for c in order}
    fits = sorted(order, key=lambda c: c.step_s) + [c for c in fits if id(c) not in chosen]
    want = len(order)
    skipped: list[Candidate] = []
    while fits and len(done) < want and tries < 3 * want:
        c = fits.pop(0)
        best = min((d.step_s for d in done), default=math.inf)
        if c.step_s > 1.1 * best and len(done) >= min(want, confirm_top):
            # the screen errs low (it leaves out the strategies' extra ops and collective
            # latencies: see verify); a candidate screened 10% slower than a confirmed one stays screened
            skipped.append(c)
            want -= 1
            continue
        tries += 1
        progress(f"confirming {c.label()} ({len(done) + 1}/{want})")
        try:
            got = confirm(c, info, dev, precision=precision, optimizer=optimizer)
        except Exception as e:  # noqa: BLE001 - the compiler refused this candidate: say why, go on
            c.rejected = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            over.append(c)
            continue
        n_compiles += 2
        c.screened, c.confirmed = (c.step_s, c.peak), got
        c.step_s, c.peak, c.bubble = got["step_s"], got["peak"], got["bubble"] or c.bubble
        if limit is not None and c.peak > limit:
            c.rejected = (f"compiled peak {c.peak / 2**30:.1f} GiB > budget {limit / 2**30:.1f} GiB (screened at "
                          f"{c.screened[1] / 2**30:.1f} GiB)")
            over.append(c)
            continue
        done.append(c)
    done.sort(key=lambda c: (c.step_s, c.peak))
    fits = sorted(skipped + fits, key=lambda c: (c.step_s, c.peak))
    over.sort(key=lambda c: c.peak)
    return SearchResult(done + fits, over, refused, len(cands), n_compiles, time.perf_counter() - t0, tcoef, linear,
                        info, limit, device)


def model_flops_per_step(info: ModelInfo, recompute: bool = False) -> float:
    """Narayanan et al. (SC'21) eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh), with recomputation
    (one extra forward: 4 passes); 72 ... without (3 passes)."""
    B, s, l, h, V = info.batch, info.seq, info.layers, info.hidden, info.vocab
    k = 96 if recompute else 72
    return k * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def compiled(c: Candidate, info: ModelInfo, dev, depth: int, *, precision: str, optimizer: str = "adamw") -> dict:
    """Compile ``c`` for real at ``depth`` (fake process group, its full mesh, rank 0, every
    pipeline stage) and read the cost model: step time, step peak, wire bytes per axis."""
    import autopar
    from autopar.analysis import cost as C
    from autopar.models import zoo
    from autopar.tools.explain import fake_mesh

    loaded = zoo.load(info.spec, batch=c.mbs * c.microbatches * c.dp, seq=info.seq,
                      overrides={**info.overrides, info.depth_field: depth})
    t0 = time.perf_counter()
    with fake_mesh(c.mesh(), 0) as mesh, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                             plan=c.plan(), precision=precision, recompute=c.recompute, capture_eval=False,
                             kernels="off", accumulate=c.microbatches if c.pp == 1 else 1, pipeline_stages="all")
        mem = C.predict_memory(pm, optimizer)
        est = C.predict_time(pm, dev, optimizer)
        by_axis: dict[str, int] = {}
        for r in pm.collectives():
            by_axis[r.axis] = by_axis.get(r.axis, 0) + r.wire_bytes
    times = c.microbatches if c.pp == 1 else 1  # collectives() lists one run of the joint program
    return {"step_s": est.step_s, "peak": int(mem["step_peak"]), "bytes": {k: v * times for k, v in by_axis.items()},
            "bubble": est.bubble, "compile_s": time.perf_counter() - t0}


def confirm(c: Candidate, info: ModelInfo, dev, *, precision: str, optimizer: str = "adamw") -> dict:
    """The compiled figures of ``c`` at the model's depth, extrapolated from compiles at one and
    two blocks per (virtual) stage: the whole pipeline, accumulation, ZeRO/FSDP and overlap passes
    as they are, only the depth extrapolated (exact when the blocks are identical)."""
    unit = c.pp * c.virtual
    a = compiled(c, info, dev, unit, precision=precision, optimizer=optimizer)
    b = compiled(c, info, dev, 2 * unit, precision=precision, optimizer=optimizer)
    k = info.layers / unit - 1
    out = {"step_s": a["step_s"] + k * (b["step_s"] - a["step_s"]),
           "peak": int(a["peak"] + k * (b["peak"] - a["peak"])),
           "bytes": {ax: int(a["bytes"].get(ax, 0) + k * (b["bytes"].get(ax, 0) - a["bytes"].get(ax, 0)))
                     for ax in set(a["bytes"]) | set(b["bytes"])},
           "bubble": b["bubble"], "compile_s": a["compile_s"] + b["compile_s"], "depths": (unit, 2 * unit)}
    return out


def verify(c: Candidate, info: ModelInfo, dev, *, precision: str, optimizer: str = "adamw",
           depth: int | None = None) -> dict:
    """The analytic composition of ``c`` at a reduced depth against the cost model's figures for
    the candidate compiled at that depth (the screen's error, per candidate)."""
    depth = depth or 2 * c.pp * c.virtual
    got = compiled(c, info, dev, depth, precision=precision, optimizer=optimizer)
    co = block_coefficients(info, c.tp, c.tp_strategy, c.recompute, c.mbs, precision=precision, dev=dev)
    mine = cost(Candidate(**{k: getattr(c, k) for k in ("dp", "tp", "pp", "dp_strategy", "tp_strategy", "schedule",
                                                       "virtual", "recompute", "mbs", "microbatches")}),
                info, co, dev, precision=precision, optimizer=optimizer, layers=depth)
    return {"depth": depth, "compiled_step_s": got["step_s"], "composed_step_s": mine.step_s,
            "compiled_peak": got["peak"], "composed_peak": mine.peak,
            "time_ratio": mine.step_s / got["step_s"] if got["step_s"] else float("nan"),
            "peak_ratio": mine.peak / got["peak"] if got["peak"] else float("nan")}


# ------------------------------------------------------------------------------------ output
def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _cli_plan(c: Candidate) -> str:
    parts = []
    for axis, strat in c.plan().items():
        if isinstance(strat, dict):
            strat = strat["schedule"] + "".join(f":{k}={v}" for k, v in strat.items() if k != "schedule")
        parts.append(f"{axis}={strat}")
    return ",".join(parts)


def command_line(c: Candidate, info: ModelInfo, precision: str) -> str:
    """The fixed-plan command that compiles the chosen candidate (``autopar plan`` / ``explain``)."""
    mesh = ",".join(f"{k}={v}" for k, v in c.mesh().items())
    return (f"autopar plan {info.spec} --mesh {mesh} --plan {_cli_plan(c)} --precision {precision} "
            f"--recompute {c.recompute} --batch {c.mbs * c.dp * (c.microbatches if c.pp > 1 else 1)} --seq {info.seq}"
            + (f" --accumulate {c.microbatches}" if c.pp == 1 and c.microbatches > 1 else ""))


def _throughput(c: Candidate, info: ModelInfo, world: int) -> tuple[float, float]:
    """(tokens/s, model TFLOP/s per rank: 72 B s l h^2 (...) per step, recomputation not counted)."""
    tokens = info.batch * info.seq
    return tokens / c.step_s, model_flops_per_step(info) / c.step_s / world / 1e12


def result_json(res: SearchResult) -> dict:
    world = None
    rows = []
    for c in res.ranked[:20] + res.over_budget[:5]:
        world = c.dp * c.tp * c.pp
        tok, tf = _throughput(c, res.info, world)
        rows.append({"mesh": c.mesh(), "plan": c.plan(), "recompute": c.recompute, "micro_batch": c.mbs,
                     "microbatches": c.microbatches, "step_s": c.step_s, "tokens_per_s": tok,
                     "model_tflops_per_rank": tf, "peak_bytes": c.peak, "parts": c.parts, "bytes_per_axis": c.comm_bytes,
                     "bubble": c.bubble, "confirmed": c.confirmed, "screened": c.screened, "rejected": c.rejected})
    return {"model": res.info.spec, "world": world, "device": res.device, "budget": res.budget,
            "considered": res.considered, "compiles": res.compiles, "seconds": res.seconds,
            "refused": res.refused, "candidates": rows}


def report(res: SearchResult, top: int = 8) -> str:
    info = res.info
    lines = []
    world = None
    if res.ranked:
        c0 = res.ranked[0]
        world = c0.dp * c0.tp * c0.pp
    lines.append(f"autopar plan --plan auto: {info.spec} ({info.params / 1e9:.2f}B parameters, {info.layers} layers, "
                 f"global batch {info.batch} x seq {info.seq}) on {world or '?'} ranks, device {res.device}, budget "
                 + (f"{_gib(res.budget)} GiB per rank" if res.budget else "none"))
    lines.append(f"searched {res.considered} candidates in {res.seconds:.1f} s ({res.compiles} compiles: "
                 f"{res.coefficient_seconds:.1f} s for one block's figures per tp/recompute choice; blocks checked "
                 f"identical at depths 1-3); confirmed (listed first) = compiled at 1 and 2 blocks per stage, "
                 "extrapolated in depth; screened = the analytic composition only")
    lines.append("")
    head = (f"{'#':>2} {'mesh':18s} {'plan':44s} {'recomp':9s} {'mbs x mb':>8s} {'step ms':>9s} {'tok/s':>9s} "
            f"{'TFLOP/s':>7s} {'peak GiB':>8s} {'bubble':>6s} {'dp GB':>7s} {'tp GB':>7s} {'pp GB':>6s}  how")
    lines.append(head)
    for i, c in enumerate(res.ranked[:top]):
        tok, tf = _throughput(c, info, c.dp * c.tp * c.pp)
        b = c.confirmed["bytes"] if c.confirmed else c.comm_bytes
        mesh = "x".join(f"{k}{v}" for k, v in c.mesh().items())
        lines.append(f"{i + 1:>2} {mesh:18s} {_cli_plan(c):44s} {c.recompute:9s} {f'{c.mbs}x{c.microbatches}':>8s} "
                     f"{c.step_s * 1e3:9.1f} {tok:9.0f} {tf:7.1f} {_gib(c.peak):>8s} "
                     f"{(f'{c.bubble:.1%}' if c.pp > 1 else '-'):>6s} {b.get('dp', 0) / 1e9:7.2f} "
                     f"{b.get('tp', 0) / 1e9:7.2f} {b.get('pp', 0) / 1e9:6.2f}  "
                     + (f"confirmed (screen {c.screened[0] * 1e3:.1f} ms, {_gib(c.screened[1])} GiB)" if c.confirmed
                        else "screened"))
    lines.append("")
    if res.ranked:
        c = res.ranked[0]
        lines.append(f"chosen: {c.label()}")
        lines.append(f"  {command_line(c, info, 'bf16')}")
        if len(res.ranked) > 1:
            r = res.ranked[1]
            lines.append(f"runner-up: {r.label()} ({r.step_s / c.step_s:.3f}x the chosen step time)")
    else:
        lines.append("no candidate fits the budget")
    lines.append("")
    lines.append("rejected:")
    if res.over_budget:
        closest = res.over_budget[0]
        lines.append(f"  {len(res.over_budget)} over the budget or refused by the compiler; the closest: "
                     f"{closest.label()}: {closest.rejected}")
    failed = [c for c in res.over_budget if c.rejected.startswith("compile failed")]
    for c in failed[:3]:
        lines.append(f"  {c.label()}: {c.rejected}")
    reasons: dict[str, int] = {}
    for _, why in res.refused:
        key = why.split(" by ")[0] if "divisible" in why else why
        reasons[key] = reasons.get(key, 0) + 1
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:6]:
        lines.append(f"  {n} factorization(s): {why}")
    return "\n".join(lines) + "\n"
