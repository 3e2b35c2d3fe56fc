"""The search's report: the table, the chosen plan's command line, the rejections; JSON."""

from __future__ import annotations

from autopar.planner.blocks import ModelInfo
from autopar.planner.compose import Candidate, model_flops_per_step
from autopar.planner.search import SearchResult


def _in_unit(n: float, unit: int = 2**30) -> str:
    return f"{n / unit:.1f}"


def _unit(res: SearchResult) -> tuple[str, int]:
    """GiB, or MiB where every peak shown and the budget are below one GiB (a small model on a CPU)."""
    sizes = [c.peak for c in res.ranked[:20]] + ([res.budget] if res.budget else [])
    return ("MiB", 2**20) if sizes and max(sizes) < 2**30 else ("GiB", 2**30)


def _layers(info: ModelInfo) -> str:
    if info.period > 1:
        return f"{info.layers * info.period} layers in {info.layers} units of {info.period}"
    return f"{info.layers} layers"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _cli_plan(c: Candidate, split: bool = True) -> str:
    """``c``'s plan as ``--plan`` takes it (``split=False``: without a pipeline's split points,
    for the table)."""
    parts = []
    for axis, strat in c.plan().items():
        if isinstance(strat, dict):
            strat = {k: v for k, v in strat.items() if split or k != "split"}
            strat = strat["schedule"] + "".join(f":{k}={'+'.join(v) if isinstance(v, list) else v}"
                                                for k, v in strat.items() if k != "schedule")
        parts.append(f"{axis}={strat}")
    return ",".join(parts)


def command_line(c: Candidate, info: ModelInfo, precision: str, inductor: bool = False) -> str:
    """The fixed-plan command that compiles the chosen candidate (``autopar plan`` / ``explain``);
    for a model given as a Python object (``autopar.plan``), the ``autopar.compile`` call."""
    from autopar.models import zoo

    accumulate = c.microbatches if c.pp == 1 and c.microbatches > 1 else 1
    if info.spec not in zoo.BUILTINS and ":" not in info.spec:
        mesh = ", ".join(f"{k}={v}" for k, v in c.mesh().items())
        return (f"autopar.compile(model, autopar.mesh({mesh}), plan={c.plan()!r}, precision={precision!r}, "
                f"recompute={c.recompute!r}" + (f", accumulate={accumulate}" if accumulate > 1 else "")
                + (", inductor=True" if inductor else "") + ")")
    mesh = ",".join(f"{k}={v}" for k, v in c.mesh().items())
    return (f"autopar plan {info.spec} --mesh {mesh} --plan {_cli_plan(c)} --precision {precision} "
            f"--recompute {c.recompute}"
            + (f" --batch {c.mbs * c.data * c.microbatches} --seq {info.seq}" if info.spec in zoo.BUILTINS else "")
            + (f" --accumulate {accumulate}" if accumulate > 1 else "")
            + (" --inductor" if inductor else ""))


def _throughput(c: Candidate, info: ModelInfo, world: int) -> tuple[float, float]:
    """(tokens/s, model TFLOP/s per rank: 72 B s l h^2 (...) per step, recomputation not counted)."""
    tokens = info.batch * info.seq
    return tokens / c.step_s, model_flops_per_step(info) / c.step_s / world / 1e12


def result_json(res: SearchResult) -> dict:
    world = None
    rows = []
    for c in res.ranked[:20] + res.over_budget[:5]:
        world = c.world
        tok, tf = _throughput(c, res.info, world)
        rows.append({"mesh": c.mesh(), "plan": c.plan(), "recompute": c.recompute, "micro_batch": c.mbs,
                     "microbatches": c.microbatches, "step_s": c.step_s, "tokens_per_s": tok,
                     "model_tflops_per_rank": tf, "peak_bytes": c.peak, "parts": c.parts, "bytes_per_axis": c.comm_bytes,
                     "bubble": c.bubble, "confirmed": c.confirmed, "screened": c.screened, "rejected": c.rejected})
    return {"model": res.info.spec, "world": world, "device": res.device, "budget": res.budget, "inductor": res.inductor,
            "considered": res.considered, "compiles": res.compiles, "seconds": res.seconds,
            "refused": res.refused, "candidates": rows}


def report(res: SearchResult, top: int = 8) -> str:
    info = res.info
    lines = []
    world = None
    if res.ranked:
        c0 = res.ranked[0]
        world = c0.world
    uname, unit = _unit(res)
    lines.append(f"autopar plan --plan auto: {info.spec} ({_params(info.params)} parameters, {_layers(info)}, "
                 f"global batch {info.batch} x seq {info.seq}) on {world or '?'} ranks, device {res.device}, budget "
                 + (f"{_in_unit(res.budget, unit)} {uname} per rank" if res.budget else "none")
                 + ("; per-rank programs costed as compile(inductor=True) runs them" if res.inductor else ""))
    checked = {"identical": "checked identical at depths 1-3",
               "identical from depth 2": "checked identical at depths 2-4 (depth 1 is off their line: see the notes)"
               }.get(" ".join(res.linear_check)) or "; ".join(res.linear_check)
    if info.period > 1:
        checked += f" (every depth in units of {info.period} blocks)"
    lines.append(f"searched {res.considered} candidates in {res.seconds:.1f} s ({res.compiles} compiles: "
                 f"{res.coefficient_seconds:.1f} s for one block's figures per tp/recompute choice; the blocks of "
                 f"{info.depth_field or 'the model'} {checked}); confirmed (listed first) = compiled at "
                 + ("2 and 3 blocks (a pipeline: 1 and 2 per stage), " if info.from_depth == 2 else
                    "1 and 2 blocks per stage, ") +
                 "extrapolated in depth (a pipeline: each stage to its blocks in the whole model's split); "
                 "screened = the analytic composition only")
    lines.append("")
    for note in res.notes:
        lines.append(note)
    shown = res.ranked[:top]
    extra = [ax for ax in ("cp", "ep") if any(getattr(c, ax) > 1 for c in shown)]
    head = (f"{'#':>2} {'mesh':18s} {'plan':44s} {'recomp':9s} {'mbs x mb':>8s} {'step ms':>9s} {'tok/s':>9s} "
            f"{'TFLOP/s':>7s} {'peak ' + uname:>8s} {'bubble':>6s} {'dp GB':>7s} {'tp GB':>7s} {'pp GB':>6s}"
            + "".join(f" {ax + ' GB':>7s}" for ax in extra) + "  how")
    lines.append(head)
    ranks = {c.label(): i + 1 for i, c in enumerate(shown)}
    for i, c in enumerate(shown):
        tok, tf = _throughput(c, info, c.world)
        b = c.confirmed["bytes"] if c.confirmed else c.comm_bytes
        mesh = "x".join(f"{k}{v}" for k, v in c.mesh().items())
        lines.append(f"{i + 1:>2} {mesh:18s} {_cli_plan(c, split=False):44s} {c.recompute:9s} {f'{c.mbs}x{c.microbatches}':>8s} "
                     f"{c.step_s * 1e3:9.1f} {tok:9.0f} {tf:{'7.1f' if tf >= 1 else '7.3f'}} {_in_unit(c.peak, unit):>8s} "
                     f"{(f'{c.bubble:.1%}' if c.pp > 1 else '-'):>6s} {b.get('dp', 0) / 1e9:7.2f} "
                     f"{b.get('tp', 0) / 1e9:7.2f} {b.get('pp', 0) / 1e9:6.2f}"
                     + "".join(f" {b.get(ax, 0) / 1e9:7.2f}" for ax in extra) + "  "
                     + (f"confirmed (screen {c.screened[0] * 1e3:.1f} ms, {_in_unit(c.screened[1], unit)} {uname}"
                        + (f"; the programs of #{ranks[c.confirmed['same_as']]}" if c.confirmed.get("same_as") in ranks
                           else "")
                        + ")" if c.confirmed else "screened"))
    lines.append("")
    if res.ranked:
        c = res.ranked[0]
        lines.append(f"chosen: {c.label()}")
        if c.confirmed and c.confirmed.get("grouped"):
            lines.append(f"  stages of {'/'.join(map(str, c.confirmed['grouped']))} blocks (the split balanced by "
                         f"{res.device}'s costs; confirmed with that grouping, "
                         + ("its split points in the command)" if c.split else "the balance in the command)"))
        lines.append(f"  {command_line(c, info, res.precision, res.inductor)}")
        # plans the cost model cannot tell apart from the chosen one (zero1 and zero2 in a
        # pipeline: the same traffic and peak) are named, the runner-up is the next different one
        same = [r for r in res.ranked[1:] if (r.step_s, r.peak) == (c.step_s, c.peak)]
        if same:
            lines.append("  the same predicted step and peak: " + "; ".join(r.label() for r in same[:3]))
        rest = [r for r in res.ranked[1:] if all(r is not s for s in same)]
        if rest:
            r = rest[0]
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
