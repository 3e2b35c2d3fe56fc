"""``plan="auto"`` from Python: ``autopar.plan`` ranks the plans for a model, ``autopar.compile(plan="auto")``
compiles the best one (see autopar.planner for the search itself)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from autopar.errors import PlanError
from autopar.planner.blocks import RECOMPUTE, info_of
from autopar.planner.compose import AXES, CP_STRATEGIES
from autopar.planner.search import SearchResult, search


@dataclass(frozen=True)
class PlanChoice:
    """One candidate the search kept: what to pass to ``autopar.compile`` and what the cost model
    predicts for it per rank."""

    mesh: dict  # axis -> size, slowest-varying first (pp, dp, ep, cp, tp): autopar.mesh(**mesh)
    plan: dict  # autopar.compile(plan=...)
    recompute: str  # autopar.compile(recompute=...)
    accumulate: int  # autopar.compile(accumulate=...) (a pipeline's micro-batches are in its plan)
    micro_batch: int  # sequences per micro-batch per data-parallel rank
    step_s: float  # predicted seconds per step
    peak_bytes: int  # predicted step peak per rank (parameters, optimizer state, the program's peak)
    tokens_per_s: float
    bubble: float  # a pipeline's idle share of the step (0 without one)
    bytes_per_axis: dict  # wire bytes per rank per step, per mesh axis
    confirmed: bool  # compiled at one and two blocks per stage and extrapolated (else: the screen's estimate)
    label: str

    def compile_options(self) -> dict:
        """``autopar.compile(model, autopar.mesh(**c.mesh), **c.compile_options(), ...)``."""
        return {"plan": self.plan, "recompute": self.recompute, "accumulate": self.accumulate}


@dataclass
class Plans:
    """``autopar.plan``'s answer: the plans that fit the budget, fastest first, and why the rest
    did not (``report()``: the table ``autopar plan --plan auto`` prints)."""

    ranked: list  # of PlanChoice: fits the budget, fastest predicted step first
    rejected: list  # (candidate, why): over the budget, refused by the compiler, or before costing
    world: int
    device: str
    budget: int | None
    precision: str
    seconds: float  # the search's wall time
    search: SearchResult = field(repr=False)

    @property
    def best(self) -> PlanChoice | None:
        return self.ranked[0] if self.ranked else None

    def report(self) -> str:
        from autopar.planner.report import report

        return report(self.search)


def plan(model, example_inputs, loss_fn=None, *, world: int, device: str = "h100", budget: int | str | None = None,
         mesh: dict | None = None, precision: str = "bf16", recompute: str | None = None, top: int = 2,
         cp: tuple | None = None, inductor: bool = False, name: str | None = None, progress=None) -> Plans:
    """Rank the parallel plans of ``model`` for ``world`` ranks of ``device`` (a cost-model row:
    "h100", "h200", "a100", "cpu") by predicted step time, keeping those whose predicted peak per
    rank fits ``budget`` (bytes, or "80GiB"; default: the device's memory). Nothing runs and
    nothing is compiled for a real mesh: the model is compiled on the meta device for one rank of
    fake process groups, with its repeated block list (an ``nn.ModuleList`` / ``nn.Sequential``
    of alike blocks) cut to a few blocks, as ``autopar plan MODEL --plan auto`` does.

    ``example_inputs``: the global batch (each input's first dimension the batch, the second the
    sequence); ``loss_fn(model(*inputs[:-1]), inputs[-1])``, or None if the model returns its loss.
    ``mesh`` fixes axes (``{"tp": 8}``; names among pp, dp, ep, cp, tp); ``recompute`` fixes the
    recompute policy (default: searched); ``top``: candidates confirmed by compiles (0: the
    analytic screen alone); ``cp``: context-parallel strategies to search (default: from 8,192
    tokens on). Raises ``PlanError`` for a model without a repeated block list (a fixed plan
    compiles it whole) and where no factorization of ``world`` suits it. The model is not changed."""
    from autopar.analysis import cost as C

    if recompute is not None and recompute not in RECOMPUTE:
        raise PlanError(f"unknown recompute policy {recompute!r}", where="autopar.plan(recompute=...)",
                        fix=f"one of {list(RECOMPUTE)}, or None to search them")
    if cp is not None and set(cp) - set(CP_STRATEGIES):
        raise PlanError(f"unknown context-parallel strategies {sorted(set(cp) - set(CP_STRATEGIES))}",
                        where="autopar.plan(cp=...)", fix=f"among {list(CP_STRATEGIES)}")
    if mesh and set(mesh) - set(AXES):
        raise PlanError(f"the search places the axes {', '.join(AXES)}; mesh names {sorted(set(mesh) - set(AXES))}",
                        where="autopar.plan(mesh=...)", fix="name the axes pp, dp, ep, cp, tp")
    dev = C.get_device(device)
    info = info_of(model, example_inputs, loss_fn, spec=name or type(model).__name__)

    def run() -> SearchResult:
        res = search(info, world, device=dev.name, budget=budget if budget is not None else int(dev.mem_bytes),
                     mesh=mesh, precision=precision, confirm_top=top, progress=progress, inductor=inductor,
                     recompute=(recompute,) if recompute else RECOMPUTE, cp_strategies=cp)
        res.info = replace(res.info, source=None)  # (the model stays here: plain data goes back from a child)
        return res

    res = beside_process_groups(run)
    return Plans([_choice(c, res) for c in res.ranked],
                 [(c.label(), c.rejected) for c in res.over_budget] + list(res.refused),
                 world, res.device, res.budget, res.precision, res.seconds, res)


def _choice(c, res: SearchResult) -> PlanChoice:
    from autopar.planner.report import _throughput

    return PlanChoice(c.mesh(), c.plan(), c.recompute, c.microbatches if c.pp == 1 else 1, c.mbs, c.step_s, int(c.peak),
                      _throughput(c, res.info, c.world)[0], c.bubble if c.pp > 1 else 0.0,
                      dict(c.confirmed["bytes"] if c.confirmed else c.comm_bytes), c.confirmed is not None, c.label())


def beside_process_groups(fn):
    """``fn()``, which makes and destroys fake process groups (``mesh.fake_mesh``), run where it
    cannot touch this process's own: here where there are none; else in a forked copy of this
    process that forgets them first (never shutting them down: their threads are this
    process's) and sends back what ``fn`` returned; where this process cannot fork, a fake group
    of its own (planning) is destroyed and made again after (a mesh on it is then stale:
    ``compile`` makes its mesh again, ``remade``)."""
    import torch.distributed as dist

    from autopar.forked import Forked, can_fork

    if not dist.is_initialized():
        return fn()
    if not can_fork() and dist.get_backend() == "fake":
        # a planning process group (no threads, nothing sent): replaced, then made again as it was
        from autopar import torch_compat as tc

        rank, world = dist.get_rank(), dist.get_world_size()
        dist.destroy_process_group()
        REMADE["fake"] += 1
        try:
            return fn()
        finally:
            dist.init_process_group("fake", store=tc.fake_store(), rank=rank, world_size=world)
    if not can_fork():
        raise PlanError("plan='auto' searches on fake process groups, which cannot be made beside this process's "
                        "own without forking it, and this process cannot fork (other threads run)",
                        where="plan='auto'",
                        fix="call autopar.plan(model, inputs, loss_fn, world=N) before creating the mesh and pass "
                            "its best plan: autopar.compile(model, mesh, **plans.best.compile_options())")

    def child():
        from autopar import torch_compat as tc

        tc.forget_process_groups()
        try:
            return "ok", fn()
        except PlanError as e:  # the search's own error, sent back whole
            return "plan_error", (e.problem, e.where, e.fix)

    try:
        kind, got = Forked(child).result()
    except RuntimeError as e:  # anything else the child raised, as it reported it
        raise PlanError(f"the search failed: {e}", where="plan='auto'") from None
    if kind != "ok":
        raise PlanError(got[0], where=got[1], fix=got[2])
    return got


REMADE = {"fake": 0}  # fake process groups destroyed and made again (``compile`` then makes its mesh again)


# ------------------------------------------------------------------------- autopar.compile(plan="auto")
def device_row(mesh) -> str:
    """The cost model's row for the devices ``mesh`` runs on (analysis/devices.py ``row_for``)."""
    import torch

    from autopar.analysis.devices import row_for

    return row_for(torch.cuda.get_device_name() if mesh.device_type == "cuda" else None)


def _device_memory(mesh) -> int | None:
    """The memory of the GPU ``mesh`` runs on (None on CPU): the budget where none is given, not
    the cost-model row's (an unlisted GPU is costed as an H100 but has its own memory)."""
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
        if mesh.device_type == "cuda" else None


def choose(model, mesh, *, example_inputs, loss_fn, precision: str, recompute: str, memory_budget,
           inductor: bool) -> tuple[PlanChoice, str]:
    """``autopar.compile(plan="auto")``'s choice on ``mesh`` (its axes and sizes fixed; the
    strategies, recompute and micro-batches searched), and the line that says it. Rank 0 searches
    and sends its choice to the others (one search, one answer)."""
    import torch.distributed as dist

    axes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    if set(axes) - set(AXES):
        raise PlanError(f"plan='auto' places the axes {', '.join(AXES)}; the mesh names {sorted(set(axes) - set(AXES))}",
                        where="autopar.compile(plan='auto')", fix="name the mesh's axes among pp, dp, ep, cp, tp")
    device = device_row(mesh)
    shared = dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"
    got, own = None, None
    if not shared or dist.get_rank() == 0:
        try:
            budget = memory_budget if memory_budget is not None else _device_memory(mesh)
            plans = plan(model, example_inputs, loss_fn, world=math.prod(axes.values()), device=device,
                         budget=budget, mesh=axes, precision=precision,
                         recompute=None if recompute == "none" else recompute, inductor=inductor)
            got = ("ok", plans.best, _line(plans, axes)) if plans.best else (
                "error", "no candidate fits the budget", plans.report())
        except PlanError as e:
            got = ("error", e.problem, e.fix)
        except BaseException as e:  # noqa: BLE001 - the others are told first (they wait in the broadcast), then raised
            got, own = ("error", f"the search raised {type(e).__name__}: {e}", "see rank 0's error; or give a fixed plan"), e
    if shared:
        box = [got]
        dist.broadcast_object_list(box, src=0)
        got = box[0]
    if own is not None:  # rank 0 keeps its own exception (as a failing rank does in a step)
        raise own
    if got[0] != "ok":
        raise PlanError(f"plan='auto' found no plan{'' if not shared or dist.get_rank() == 0 else ' (on rank 0)'}: "
                        + got[1], where="autopar.compile(plan='auto')", fix=got[2] or "give a fixed plan")
    best = got[1]
    return replace(best, plan={k: v for k, v in best.plan.items() if k in axes}), got[2]


def _line(plans: Plans, axes: dict) -> str:
    best = plans.best
    rest = [c for c in plans.ranked[1:] if (c.step_s, c.peak_bytes) != (best.step_s, best.peak_bytes)]
    plan = {k: v for k, v in best.plan.items() if k in axes}
    return (f"autopar: plan='auto' chose plan={plan}, recompute={best.recompute!r}, accumulate={best.accumulate} "
            f"on mesh {axes}: the fastest predicted step ({best.step_s * 1e3:.1f} ms on {plans.device}, peak "
            f"{best.peak_bytes / 2**30:.2f} GiB per rank"
            + (f" of {plans.budget / 2**30:.2f} GiB" if plans.budget else "") + f") of {len(plans.ranked)} plans that fit"
            + (f"; runner-up {rest[0].label} at {rest[0].step_s / best.step_s:.3f}x" if rest else "")
            + f" (searched in {plans.seconds:.1f} s; autopar.plan(...).report() shows the table)")


def resolve_auto(model, mesh, options):
    """``autopar.compile(plan="auto")``: ``options`` (a ``CompileOptions``) with the search's choice
    on ``mesh`` (plan, recompute, accumulate), the mesh to compile on, and the line that says the
    choice, printed here (rank 0) (registered as ``autopar.compiler.AUTO_PLANNER``)."""
    import torch.distributed as dist

    if options.accumulate != 1:
        raise PlanError("plan='auto' chooses accumulate (the micro-batches) itself", where="autopar.compile(accumulate=...)",
                        fix="leave accumulate out, or give a fixed plan")
    remade = REMADE["fake"]
    best, line = choose(model, mesh, example_inputs=options.example_inputs, loss_fn=options.loss_fn,
                        precision=options.precision, recompute=options.recompute,
                        memory_budget=options.memory_budget, inductor=options.inductor)
    options = replace(options, **best.compile_options())
    if REMADE["fake"] != remade:  # the search made this process's fake group again: a mesh on the new one
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(mesh.device_type, tuple(mesh.shape), mesh_dim_names=mesh.mesh_dim_names)
    if not dist.is_initialized() or dist.get_rank() == 0 or dist.get_backend() == "fake":
        print(line, flush=True)
    return options, mesh, line


def _register() -> None:
    from autopar import compiler

    compiler.AUTO_PLANNER = resolve_auto


_register()
