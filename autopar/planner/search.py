"""The search: screen every candidate, confirm the best by compiling them (see autopar.planner)."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace

from autopar.errors import PlanError
from autopar.forked import Forked, Helper, can_fork, shared_heap, side_by_side
from autopar.planner.blocks import (DP_STRATEGIES, RECOMPUTE, SCHEDULES, TP_STRATEGIES, ModelInfo, block_coefficients,
                                     check_figures, depth_check, from_depth_two, model_info, planning_options)
from autopar.planner.compose import CP_STRATEGIES, Candidate, candidates, cost

# plan="auto" searches context parallelism by default from this many tokens per sequence on
CP_FROM_SEQ = 8192


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
    precision: str = "bf16"
    notes: list = field(default_factory=list)  # what the search left out, and why
    inductor: bool = False  # the programs costed as compile(inductor=True) runs them


def search(spec: str | ModelInfo, world: int, *, device: str = "h100", budget: int | str | None = None,
           batch: int | None = None, seq: int | None = None, overrides: dict | None = None,
           mesh: dict | None = None, precision: str = "bf16", optimizer: str = "adamw",
           mbs_choices=(1, 2), dp_strategies=DP_STRATEGIES, tp_strategies=TP_STRATEGIES,
           recompute=RECOMPUTE, schedules=SCHEDULES, cp_strategies=None, expert: bool | None = None,
           confirm_top: int = 2, inductor: bool = False, progress=None) -> SearchResult:
    """Rank every candidate plan for ``world`` ranks by predicted step time, under ``budget``.

    ``spec``: a model by name (``model_info``: a built-in, ``package.module:factory``) or a
    ``ModelInfo`` (``info_of``: any module with a repeated block list).

    ``cp_strategies``: context parallelism's strategies to search (None: ulysses and context from
    ``CP_FROM_SEQ`` tokens on, none below: at shorter sequences attention's activations rarely
    decide the plan and each cp choice costs its own block compiles); ``expert``: search expert
    parallelism (None: on a MoE model whose experts can be split); ``inductor``: cost each plan's
    per-rank programs as ``compile(inductor=True)`` runs them (Inductor's buffers and fused kernels)."""
    from autopar.analysis import cost as C
    from autopar.analysis.budget import parse_budget

    t0 = time.perf_counter()
    progress = progress or (lambda s: None)
    if world < 1:
        raise PlanError(f"world size must be >= 1, got {world}", where="--world")
    dev = C.get_device(device)
    limit = parse_budget(budget) if budget is not None else None
    info = spec if isinstance(spec, ModelInfo) else model_info(spec, batch, seq, overrides)
    spec = info.spec
    fixed = mesh or {}
    cp_default = cp_strategies is None
    if cp_default:
        cp_strategies = CP_STRATEGIES if info.seq >= CP_FROM_SEQ or fixed.get("cp", 1) > 1 else ()
    elif fixed.get("cp", 1) > 1 and not cp_strategies:
        raise PlanError(f"--mesh fixes cp={fixed['cp']} but no context-parallel strategy is searched",
                        where="--cp", fix="leave --cp out, or name ulysses and/or context")
    if expert is None:
        expert = bool(info.experts) and not info.no_ep
    elif expert and info.no_ep:
        raise PlanError(f"expert parallelism cannot be searched for {spec}: {info.no_ep}", where="plan='auto'")
    if fixed.get("ep", 1) > 1 and not expert:
        raise PlanError(f"--mesh fixes ep={fixed['ep']} but {spec} cannot be split by experts: {info.no_ep}",
                        where="--mesh")
    notes = []
    if not cp_strategies:
        notes.append(f"context parallelism not searched (sequence {info.seq} < {CP_FROM_SEQ} tokens); --cp "
                     "ulysses,context or --mesh cp=N searches it" if cp_default else
                     "context parallelism not searched (--cp none)")
    if info.experts and not expert:
        notes.append(f"expert parallelism not searched: {info.no_ep or 'expert=False'}")
    cands, refused = candidates(info, world, dev, mesh=mesh, mbs_choices=mbs_choices, dp_strategies=dp_strategies,
                                tp_strategies=tp_strategies, recompute=recompute, schedules=schedules,
                                cp_strategies=cp_strategies, expert=expert)
    if info.period > 1:
        # the search's unit is ``period`` blocks (alternating attention windows): a pipeline's stages
        # would have to start at units, which its split and its per-stage lines do not know
        unit = f"the blocks repeat in units of {info.period}: pipeline stages are not searched for such a list"
        if fixed.get("pp", 1) > 1:
            raise PlanError(f"--mesh fixes pp={fixed['pp']}, but {unit}", where="--mesh",
                            fix="leave pp out of --mesh, or give a fixed pipeline plan")
        refused += [(c.label(), unit) for c in cands if c.pp > 1]
        cands = [c for c in cands if c.pp == 1]
        notes.append(f"pipeline parallelism not searched: {unit.split(': ')[0]} (each depth the search compiles "
                     f"counts units of {info.period} blocks)")
    if not cands:
        why = "; ".join(f"{a}: {b}" for a, b in refused[:6]) or "no factorization"
        raise PlanError(f"no plan for {spec} on {world} ranks", where="plan='auto'", fix=f"refused: {why}")
    # one compiled pair per (tp, strategy, recompute) at the smallest micro-batch; a larger one
    # scales the per-sequence figures (activations, compute, tensor-parallel bytes) linearly
    base_mbs = min(c.mbs for c in cands)
    # the first block choice that compiles is the one checked for identical blocks (depth 3 - depth
    # 2 = depth 2 - depth 1): one without recomputation first, whose figures show every block's saved
    # activations. Under full recomputation the peak is a recomputed block's internals over the
    # saved inputs, and at depth 1 that block is also the last: its peak moves between depths 1
    # and 2 (Mixtral's by 256 bytes at tests/foreign_models.py's shapes), which read as blocks
    # that differ
    keys = sorted({c.block_key for c in cands}, key=lambda k: (k[5] != "none", str(k)))
    coeffs: dict = {}
    linear: list[str] = []
    tc = time.perf_counter()

    def figures_of(i: int, key, report) -> tuple[str, object]:
        tp, ts, cp, cs, ep, rc = key
        report(f"block figures {i + 1}/{len(keys)}: tp={tp} {ts or ''}" + (f" cp={cp} {cs}" if cp > 1 else "")
               + (f" ep={ep}" if ep > 1 else "") + f" recompute={rc} mbs={base_mbs}")
        try:
            return "ok", block_coefficients(info, tp, ts, rc, base_mbs, precision=precision, dev=dev,
                                            cp=cp, cp_strategy=cs, ep=ep, fused=inductor)
        except PlanError as e:  # the compiler refuses this block choice: its candidates go
            return "refused", str(e).splitlines()[0][:160]

    def at3_of(key, depth: int = 3) -> tuple[str, object]:
        """The identical-blocks check's compile (depth 3) of a block choice: ("ok", its figures) or
        ("refused", why depth 3 does not compile)."""
        tp, ts, cp, cs, ep, rc = key
        try:
            return "ok", check_figures(info, tp, ts, rc, base_mbs, depth, precision=precision, dev=dev, cp=cp,
                                       cp_strategy=cs, ep=ep, fused=inductor)
        except PlanError as e:
            return "refused", str(e).splitlines()[0][:160]

    def check_of(key, at3=None) -> tuple[str, object, object]:
        """The identical-blocks check of a block choice that compiled at depths 1 and 2 (``at3``: its
        depth 3 compiled already): ("ok", what differs, depth 3's figures) or ("refused", why depth
        3 does not compile, None)."""
        kind, got = at3 or at3_of(key)
        return (kind, got, None) if kind == "refused" else ("ok", depth_check(coeffs[key], got), got)

    def take(key, got) -> None:
        nonlocal cands, refused
        kind, co = got
        if kind == "refused":
            refused += [(c.label(), f"the block does not compile: {co}") for c in cands if c.block_key == key]
            cands = [c for c in cands if c.block_key != key]
            return
        coeffs[key] = co

    # the first block choice that compiles first, here; then the others, split between this
    # process and a forked child where it can fork (autopar/forked.py). The first one's check at
    # depth 3 (identical blocks: depth 3 - depth 2 must equal depth 2 - depth 1) needs nothing of
    # its depths 1 and 2, so it starts in a child of its own beside them (the longest piece of the
    # block figures, depth 3 traced afresh: run after the other block choices, it had one core wait
    # for it); were the first block choice refused, that child is stopped and the check of the
    # one that compiles goes with the others
    rest = list(enumerate(keys))
    early = None
    if keys and info.layers >= 3 and can_fork():
        with shared_heap():
            early = Forked(lambda: at3_of(keys[0]))
    try:
        while rest and not coeffs:
            i, key = rest.pop(0)
            take(key, figures_of(i, key, progress))
    except BaseException:
        if early is not None:
            early.kill()
        raise
    first = next(iter(coeffs), None)
    check = first is not None and info.layers >= 3
    if early is not None and first != keys[0]:
        early.kill()
        early = None
    later = check and early is None  # the check goes with the other block choices
    mine, theirs = _halves(rest)

    def figures(which, report, checks: bool):
        return lambda: ([figures_of(i, key, report) for i, key in which], check_of(first) if checks else None)

    try:
        (got_theirs, verdict), (got_mine, _) = side_by_side(
            figures(theirs, lambda s: None, later), figures(mine, progress, False),
            again=figures(theirs, progress, later), fork=bool(theirs) or later)
    except BaseException:
        if early is not None:
            early.kill()
        raise
    if early is not None:
        try:
            at3 = early.result()
        except RuntimeError:  # the child failed: depth 3 here (where an error, if it is one, is raised)
            at3 = None
        verdict = check_of(first, at3)
    got = dict(zip([key for _, key in mine + theirs], got_mine + got_theirs))
    for _, key in rest:  # (in the keys' order, as one after the other)
        take(key, got[key])
    while check and verdict[0] == "refused":  # depth 3 does not compile: that block choice goes, the next is checked
        take(first, verdict)
        coeffs.pop(first)
        first = next(iter(coeffs), None)
        verdict = check_of(first) if first is not None else ("ok", [], None)
    edge = []  # what depth 1 alone differs in, where the search's figures are taken from depths 2 and 3
    if check and verdict[1] and info.layers >= 4:
        # depth 1's one block is the first block and the last at once: where it alone is off the
        # line (depth 4 - depth 3 equals depth 3 - depth 2), every block choice is taken from
        # depths 2 and 3 instead (each one's depth 3 compiled now) and the search says so
        kind, at4 = at3_of(first, 4)
        beyond = (at4 - verdict[2]).close(verdict[2] - coeffs[first].at2) if kind == "ok" else None
        if beyond == []:
            edge = verdict[1]
            progress(f"depth 1 is not on the blocks' line ({'; '.join(edge)}): each block choice from depths 2 and 3")
            others = [k for k in coeffs if k != first]
            mine3, theirs3 = _halves(others)
            got3, here3 = side_by_side(lambda: [at3_of(k) for k in theirs3], lambda: [at3_of(k) for k in mine3],
                                       fork=bool(theirs3))
            threes = {first: ("ok", verdict[2]), **dict(zip(theirs3 + mine3, got3 + here3))}
            for key in list(coeffs):
                kind, got = threes[key]
                if kind == "refused":
                    take(key, (kind, got))
                    coeffs.pop(key)
                else:
                    coeffs[key] = from_depth_two(coeffs[key], got)
            notes.append(f"one block's figures from depths 2 and 3: at depth 1, where the one block is the first "
                         f"and the last, {'; '.join(edge)} (depth 3 - depth 2 against depth 2 - depth 1) differ, "
                         f"and depth 4 - depth 3 equals depth 3 - depth 2")
            verdict = ("ok", [], verdict[2])
            info.from_depth = 2
        elif beyond:
            verdict = ("ok", verdict[1] + ["then depth 4 - depth 3 against depth 3 - depth 2: " + "; ".join(beyond)],
                       verdict[2])
    if check and verdict[1]:
        raise PlanError(f"{spec}: its blocks are not identical (depth 3 - depth 2 differs from depth 2 - depth 1: "
                        + "; ".join(verdict[1]) + ")",
                        where="plan='auto'",
                        fix="give a fixed plan (the search extrapolates one block to the model's depth; a fixed "
                            "plan compiles every block)")
    if coeffs:
        coeffs[first].linear = verdict[1] if check else []
        linear = (["identical from depth 2"] if edge else ["identical"]) if check else \
            [f"not checked (the model has {info.layers} blocks, the check compiles 3)"]
    tcoef = time.perf_counter() - tc
    if not cands:
        why = "; ".join(f"{a}: {b}" for a, b in refused[-3:])
        raise PlanError(f"no plan for {spec} on {world} ranks", where="plan='auto'", fix=f"refused: {why}")
    progress(f"costing {len(cands)} candidates")
    fits, over = [], []
    for c in cands:
        cost(c, info, coeffs[c.block_key].scaled(c.mbs / base_mbs), dev,
             precision=precision, optimizer=optimizer)
        if limit is not None and c.peak > limit:
            c.rejected = f"predicted peak {_size(c.peak)} > budget {_size(limit)}"
            over.append(c)
        else:
            fits.append(c)
    fits.sort(key=lambda c: (c.step_s, c.peak))
    n_compiles = sum(3 if i == 0 and info.layers >= 3 else 2 for i in range(len(coeffs)))
    # confirm the best screened candidates by compiling them (two depths each) and re-rank those:
    # the top ``confirm_top``, and the best of each data-parallel strategy (the screen's error is
    # largest between strategies: their extra ops are not in one block; their dp calls are counted,
    # compose.py ``_buckets``)
    done: list[Candidate] = []
    tries = 0
    order = fits[:confirm_top]
    for ds in DP_STRATEGIES if confirm_top > 0 else ():  # (confirm_top=0: the screen alone)
        best = next((c for c in fits if c.dp_strategy == ds), None)
        if best is not None and all(best is not o for o in order):
            order.append(best)
    chosen = {id(c) for c in order}
    fits = sorted(order, key=lambda c: c.step_s) + [c for c in fits if id(c) not in chosen]
    want = len(order)
    skipped: list[Candidate] = []
    # ... and, the screen erring low, any candidate screened faster than the best confirmed one
    # (a confirmation can move a plan behind others the screen ranked below it)
    # each confirmation's shallower compile in one forked helper for them all (autopar/forked.py):
    # what it traces for one (captures, joint graphs, DTensor's answers) the next one finds there
    with confirmations(info, dev, precision=precision, optimizer=optimizer, fused=inductor) as helper:
        while fits and tries < 3 * want and (len(done) < want or fits[0].step_s < min(d.step_s for d in done)):
            c = fits.pop(0)
            # screen against screen: a candidate screened 10% slower than the best confirmed one was
            # screened stays screened. (Not against the confirmed time: the screen errs either way,
            # by up to 20% and by different amounts between data-parallel strategies, whose extra ops
            # one block does not show; a screen against another candidate's
            # compiled time mixes two errors. docs/planner.md: 70B's zero2 was left unconfirmed so.)
            best = min((d.screened[0] for d in done), default=math.inf)
            if c.step_s > 1.1 * best and len(done) >= min(want, confirm_top):
                skipped.append(c)
                want -= 1
                continue
            same = next((d for d in done if same_programs(c, d)), None)
            if same is not None:  # its compile would repeat one already made: take its figures
                got = {**same.confirmed, "same_as": same.label()}
            else:
                tries += 1
                progress(f"confirming {c.label()} ({len(done) + 1}/{max(want, len(done) + 1)})")
                try:
                    got = confirm(c, info, dev, precision=precision, optimizer=optimizer, fused=inductor,
                                  helper=helper)
                except Exception as e:  # noqa: BLE001 - the compiler refused this candidate: say why, go on
                    c.rejected = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    over.append(c)
                    continue
                n_compiles += len(got["depths"]) + bool(got.get("whole"))
            c.screened, c.confirmed = (c.step_s, c.peak), got
            c.step_s, c.peak, c.bubble = got["step_s"], got["peak"], got["bubble"] or c.bubble
            if got.get("split"):
                c.split = tuple(got["split"])
            elif got.get("balance"):
                c.balance = got["balance"]
            if limit is not None and c.peak > limit:
                c.rejected = (f"compiled peak {_size(c.peak)} > budget {_size(limit)} (screened at "
                              f"{_size(c.screened[1])})")
                over.append(c)
                continue
            done.append(c)
    done.sort(key=lambda c: (c.step_s, c.peak))
    fits = sorted(skipped + fits, key=lambda c: (c.step_s, c.peak))
    over.sort(key=lambda c: c.peak)
    return SearchResult(done + fits, over, refused, len(cands), n_compiles, time.perf_counter() - t0, tcoef, linear,
                        info, limit, device, precision, notes, inductor)


def _halves(items: list) -> tuple[list, list]:
    """``items`` split between this process and a forked child (every other one), where it can fork
    and there are two or more; else all here."""
    return (items[0::2], items[1::2]) if len(items) > 1 and can_fork() else (items, [])


_PLAN_FIELDS = ("dp", "tp", "pp", "tp_strategy", "schedule", "virtual", "recompute", "mbs", "microbatches", "cp",
                "cp_strategy", "ep")  # (not a pipeline's split: the dp strategy does not move it)


def same_programs(a: Candidate, b: Candidate) -> bool:
    """ZeRO-1 and ZeRO-2 differ only in when the backward reduces each gradient (ZeRO-1 at its
    end, ZeRO-2 as soon as it is complete); where the gradients are reduced once after all the
    micro-batches (a pipeline, or accumulation) neither backward reduces any, and the two compile
    to the same programs (``tests/test_planner.py`` compares them)."""
    once = a.pp > 1 or a.microbatches > 1
    return (once and {a.dp_strategy, b.dp_strategy} == {"zero1", "zero2"}
            and all(getattr(a, f) == getattr(b, f) for f in _PLAN_FIELDS))


def _size(n: float) -> str:
    """Bytes in GiB, or in MiB below one GiB (a small model's peak on a CPU)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _load(c: Candidate, info: ModelInfo, depth: int):
    return info.at(depth, c.mbs * c.microbatches * c.data)


def compiled(c: Candidate, info: ModelInfo, dev, depth: int, *, precision: str, optimizer: str = "adamw",
             fused: bool = False) -> dict:
    """Compile ``c`` for real at ``depth`` (fake process group, its full mesh, rank 0, every
    pipeline stage; the capture spliced from three blocks, autopar/splice.py) and read the cost
    model: step time, step peak, wire bytes per axis. A pipeline's stages hold equal numbers of
    blocks, named split points (at the model's own depth, ``c.split`` or ``c.balance`` where the
    search set them),
    and its per-stage figures come back too (``confirm`` carries them to the whole model's grouping)."""
    from autopar.analysis import cost as C
    from autopar.analysis import pipeline_cost as PC
    from autopar.compiler import compile_with
    from autopar.mesh import fake_mesh
    from autopar.splice import block_list, spliced

    loaded = _load(c, info, depth)
    t0 = time.perf_counter()
    # the deep model's capture from three of its blocks (autopar/splice.py): the planner's figures
    # assume identical blocks already
    with fake_mesh(c.mesh(), 0) as mesh, warnings.catch_warnings(), spliced():
        warnings.simplefilter("ignore")
        plan = c.plan()
        found = block_list(loaded.model) if c.pp > 1 else None
        if found is not None and not (depth == info.layers and (c.split or c.balance)):
            # equal blocks per stage, named: the split would balance a few blocks around a heavy
            # head unevenly, and ``confirm``'s per-stage lines need each stage at one and two blocks
            per = depth // (c.pp * c.virtual)
            plan["pp"] = {**plan["pp"], "split": [f"{found[0]}.{i}" for i in range(per, depth, per)]}
        pm = compile_with(loaded.model, mesh, planning_options(loaded, plan=plan, precision=precision, recompute=c.recompute,
                                                               accumulate=c.microbatches if c.pp == 1 else 1))
        kind = dev.kind
        mem = C.predict_memory(pm, optimizer, fused=fused, device=kind)
        est = C.predict_time(pm, dev, optimizer, fused)
        by_axis: dict[str, int] = {}
        for r in pm.collectives():
            by_axis[r.axis] = by_axis.get(r.axis, 0) + r.wire_bytes
        # SPMD: the programs' liveness, for ``confirm`` to carry each point that can hold the peak
        programs = None if pm.pipelined else {
            "persistent": mem["parameters"] + mem["optimizer_state"], "accumulators": mem["accumulators"],
            **{k: C.program_liveness(p, fused, kind)
               for k, p in (("joint", pm.program), ("sync", pm.sync_program)) if p is not None}}
        stages = (PC.pipeline_stage_costs(pm, dev, optimizer, fused), PC.pipeline_shape(pm)) if pm.pipelined else None
    grouped = _blocks_per_stage(pm.specs) if pm.pipelined else None
    # (collectives() lists the joint program once per micro-batch and the gradient sync program)
    return {"step_s": est.step_s, "peak": int(mem["step_peak"]), "bytes": by_axis,
            "bubble": est.bubble, "compile_s": time.perf_counter() - t0, "programs": programs,
            "grouped": grouped, "stages": stages, "split": plan["pp"].get("split") if c.pp > 1 else None}


def _blocks_per_stage(specs) -> list[int]:
    from autopar.modpath import block_of

    return [len({block_of(n) for n in (sp.param_names or sp.params) if block_of(n)}) for sp in specs]


def whole_split(c: Candidate, info: ModelInfo, dev, *, precision: str) -> tuple[list[int], list[str] | None]:
    """How the split groups the whole model's blocks into ``c``'s stages, balanced by ``dev``'s
    costs as a run on that device (or ``autopar plan --device``) balances them: (blocks per
    stage, the split points that name that grouping: the first block of each stage after the
    first; None where a stage holds no block). Capture (spliced) and split only."""
    from autopar.compiler import build
    from autopar.mesh import fake_mesh
    from autopar.splice import block_list, spliced

    loaded = _load(c, info, info.layers)
    with fake_mesh(c.mesh(), 0) as mesh, warnings.catch_warnings(), spliced():
        warnings.simplefilter("ignore")
        plan = c.plan()
        plan["pp"] = {**{k: v for k, v in plan["pp"].items() if k != "split"}, "balance": dev.name}
        state = build(loaded.model, mesh, planning_options(loaded, plan=plan, precision=precision,
                                                           recompute=c.recompute), stop_after="split")
    grouped = _blocks_per_stage(state.specs)
    found = block_list(loaded.model)
    if min(grouped) < 1 or found is None:  # a stage without blocks starts at no block: no name says it
        return grouped, None
    # each stage after the first named by its first block, as ``compiled`` names equal stages (a
    # stage's first op can come before its first block: Hugging Face's decoder loop)
    return grouped, [f"{found[0]}.{sum(grouped[:s])}" for s in range(1, len(grouped))]


_SPLITS: dict = {}  # whole_split's answers for a model without a source (else its ``Repeated.splits``)


def confirmations(info: ModelInfo, dev, *, precision: str, optimizer: str = "adamw", fused: bool = False) -> Helper:
    """A forked helper (autopar/forked.py) for ``confirm``'s shallower compiles, for one search:
    a request (candidate, depth, whether to split the whole model too) answered as ``confirm``
    would answer it here, the helper keeping its traces from one request to the next."""
    return Helper(lambda request: _shallower(*request, info, dev, precision=precision, optimizer=optimizer,
                                             fused=fused))


def _shallower(c: Candidate, depth: int, split: bool, info: ModelInfo, dev, *, precision: str, optimizer: str,
               fused: bool) -> tuple:
    """``confirm``'s shallower compile, and the whole model's split where ``split`` (its first for
    this grouping): (figures, split or None)."""
    return (compiled(c, info, dev, depth, precision=precision, optimizer=optimizer, fused=fused),
            whole_split(c, info, dev, precision=precision) if split else None)


def confirm(c: Candidate, info: ModelInfo, dev, *, precision: str, optimizer: str = "adamw",
            fused: bool = False, helper: Helper | None = None) -> dict:
    """The compiled figures of ``c`` at the model's depth, from compiles at one and two blocks per
    (virtual) stage: the whole pipeline, accumulation, ZeRO/FSDP and overlap passes as they are,
    only the depth extrapolated (exact when the blocks are identical). SPMD: each figure along
    its line. A pipeline: each stage's figures along its own line to the number of blocks the
    whole model's split gives it (``whole_split``, balanced by ``dev``: not equal where a head
    or an embedding weighs), composed as the cost model composes a compiled pipeline
    (``pipeline_cost.compose_pipeline``); ``split`` names that grouping for the plan. The compiles run side
    by side where the process can fork."""
    from autopar.analysis import pipeline_cost as PC

    unit = c.pp * c.virtual

    def at(depth: int) -> dict:
        return compiled(c, info, dev, depth, precision=precision, optimizer=optimizer, fused=fused)

    # the two depths side by side where this process can fork (autopar/forked.py): the shallower
    # (and a pipeline's whole-model split) in a child, the deeper here; a child that fails is
    # compiled here again
    # the whole model's grouping, once per what it depends on (the capture and the split pass
    # precede every per-axis strategy: candidates that differ in those share it)
    splits = info.source.splits if info.source is not None else _SPLITS
    key = (info.spec, info.layers, info.seq, repr(sorted(info.overrides.items())), c.pp, c.virtual,
           c.mbs * c.data,
           c.cp, c.cp_strategy, c.ep, c.tp, c.tp_strategy, c.recompute, precision, dev.name)
    known = splits.get(key)

    # SPMD: at depths 1 and 2, or 2 and 3 where depth 1 is off the blocks' line (``search``)
    da, db = (2, 3) if c.pp == 1 and info.from_depth == 2 and info.layers >= 3 else (unit, 2 * unit)

    wants_split = c.pp > 1 and known is None  # (the whole model's grouping wanted too)

    def theirs():
        return _shallower(c, da, wants_split, info, dev, precision=precision, optimizer=optimizer, fused=fused)

    if db > info.layers:  # one block per (virtual) stage is the whole model: compiled as it is
        got = at(info.layers)
        return {"compile_s": got["compile_s"], "depths": (info.layers,), "step_s": got["step_s"], "peak": got["peak"],
                "bubble": got["bubble"], "bytes": {ax: int(v) for ax, v in got["bytes"].items()},
                **({"grouped": got["grouped"], "split": got["split"]} if c.pp > 1 else {})}
    if helper is not None:  # (``confirmations``: its shallower compile where the last one's traces are)
        (a, split), b = helper.side_by_side((c, da, wants_split), lambda: at(db), theirs)
    else:
        (a, split), b = side_by_side(theirs, lambda: at(db))
    out = {"compile_s": a["compile_s"] + b["compile_s"], "depths": (da, db)}
    if c.pp == 1:  # SPMD: each figure along its line, the peak point by point
        k = (info.layers - da) / (db - da)
        out.update(step_s=a["step_s"] + k * (b["step_s"] - a["step_s"]), bubble=b["bubble"],
                   peak=_spmd_peak(a["programs"], b["programs"], (da, db), info.layers),
                   bytes={ax: int(a["bytes"].get(ax, 0) + k * (b["bytes"].get(ax, 0) - a["bytes"].get(ax, 0)))
                          for ax in set(a["bytes"]) | set(b["bytes"])})
        return out
    if len(splits) > 256:
        splits.clear()
    grouped, names = splits.setdefault(key, split or known)
    if min(grouped) >= 1:
        (one, _), shape = a["stages"]
        (two, fixed), _ = b["stages"]
        got = PC.compose_pipeline(shape, [x.at(y, n) for x, y, n in zip(one, two, grouped)], fixed, dev, optimizer)
        got = {"step_s": got["step_s"], "peak": got["step_peak"], "bubble": got["bubble"], "bytes": got["wire"]}
    else:
        # a stage without blocks (the head alone: a small model, a large vocabulary) is not the
        # line through stages of one and two blocks (what its neighbours send and compute once
        # changes): the whole model compiled with that grouping, the split balanced by ``dev``
        # as ``whole_split``'s was (no names can say it)
        got = compiled(replace(c, split=None, balance=dev.name), info, dev, info.layers, precision=precision,
                       optimizer=optimizer, fused=fused)
        out["compile_s"] += got["compile_s"]
        out.update(whole=True, balance=dev.name)
    out.update(step_s=got["step_s"], peak=got["peak"], bubble=got["bubble"],
               bytes={ax: int(v) for ax, v in got["bytes"].items()}, grouped=grouped, split=names)
    return out


def _spmd_peak(a: dict, b: dict, depths: tuple[int, int], layers: int) -> int:
    """An SPMD candidate's step peak at ``layers`` blocks from its programs at ``depths`` (one
    and two blocks, or two and three): persistent state and accumulators along their lines, each
    program's peak by ``liveness.peak_in_depth`` (not the peak's own line: Llama-3-8B bf16 fsdp x
    megatron at 64 ranks gave 3.8 GiB that way against 6.1 GiB compiled at 32 blocks), composed
    as ``cost.predict_memory`` composes them."""
    from autopar.analysis.liveness import peak_in_depth

    da, db = depths

    def line(x, y):
        return x + (layers - da) / (db - da) * (y - x)

    progs = {k: sum(peak_in_depth([a[k], b[k]], depths, layers)["at_peak"].values())
             for k in ("joint", "sync") if k in a}
    acc = line(a["accumulators"], b["accumulators"])
    return int(line(a["persistent"], b["persistent"]) + max(progs["joint"] + acc, progs.get("sync", 0)))


def verify(c: Candidate, info: ModelInfo, dev, *, precision: str, optimizer: str = "adamw",
           depth: int | None = None, fused: bool = False) -> dict:
    """The analytic composition of ``c`` at a reduced depth against the cost model's figures for
    the candidate compiled at that depth (the screen's error, per candidate)."""
    depth = depth or 2 * c.pp * c.virtual
    got = compiled(c, info, dev, depth, precision=precision, optimizer=optimizer, fused=fused)
    co = block_coefficients(info, c.tp, c.tp_strategy, c.recompute, c.mbs, precision=precision, dev=dev, cp=c.cp,
                            cp_strategy=c.cp_strategy, ep=c.ep, fused=fused)
    mine = cost(Candidate(**{k: getattr(c, k) for k in ("dp", "tp", "pp", "dp_strategy", "tp_strategy", "schedule",
                                                       "virtual", "recompute", "mbs", "microbatches", "cp",
                                                       "cp_strategy", "ep")}),
                info, co, dev, precision=precision, optimizer=optimizer, layers=depth)
    return {"depth": depth, "compiled_step_s": got["step_s"], "composed_step_s": mine.step_s,
            "compiled_peak": got["peak"], "composed_peak": mine.peak,
            "time_ratio": mine.step_s / got["step_s"] if got["step_s"] else float("nan"),
            "peak_ratio": mine.peak / got["peak"] if got["peak"] else float("nan")}
