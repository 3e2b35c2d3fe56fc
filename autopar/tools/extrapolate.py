"""``autopar plan`` of a deep built-in model for the price of three shallow ones.

A decoder's figures (bytes and calls per collective, FLOPs, parameters, predicted time) grow by
the same amount with each identical block. So instead of compiling all L blocks, the plan is
compiled at depths 3, 4 and 5 (same mesh, plan, batch and options) and every figure extrapolated,
``x(L) = x(3) + (L - 3) * (x(4) - x(3))``. Not from depth 1 or 2: the first and the last block
differ from the inner ones (the first block's gathers have nothing before them to hide behind,
the last one's backward starts at once, its forward prefetches nothing), so only with at least one
inner block does every depth have the same three kinds of block. Depth 5 is the check that the
blocks really are identical, not assumed: for every figure, the fifth block's increment must
equal the fourth's (exactly for parameters, bytes, calls and FLOPs; for times, within what would
move the extrapolated figure by 1%: a list-scheduled overlap simulation rounds differently by a
few microseconds).

The memory peak is not one line but the largest of many (the end of the forward grows by one
block's saved activations per block, the end of the backward by one block's gradients), and which
is largest can change with the depth: it is rebuilt node by node (``peak_at_depth``).

Any figure that fails its check, or that a depth adds or drops (a collective kind that appears
only from some depth on), makes ``plan`` compile every block instead, and say why (e.g. gradient
buckets that span blocks under bf16: the nodes around them are not the same from block to block).

Where it applies: built-in models (their config names the depth: ``n_layers`` /
``num_hidden_layers``) deeper than 5 blocks, under plans without a pipeline axis (a pipeline's
stage boundaries move with the depth) and without parameters left to ``plan['rest']`` (their list
grows with the depth). ``autopar plan --full-depth`` compiles every block regardless;
``tests/test_extrapolate.py`` checks the extrapolated table against the full compile.
"""

from __future__ import annotations

import copy

from autopar.tools.render import Analysis, summary

DEPTHS = (3, 4, 5)
# relative tolerance on (L - 5) * (increment 5 - increment 4), against the extrapolated figure
_EXACT, _TIME = 0.0, 1e-2


def depth_field(spec: str, overrides: dict) -> tuple[str, int] | None:
    """The config field that sets a built-in model's depth, and its depth; None for factories."""
    from autopar.models import zoo

    if ":" in spec or spec not in zoo.BUILTINS:
        return None
    family, fields, *_ = zoo.BUILTINS[spec]
    fields = {**fields, **overrides}
    if family == "llama":
        from autopar.models.llama import LlamaConfig

        return "n_layers", int(fields.get("n_layers", LlamaConfig.n_layers))
    return ("num_hidden_layers", int(fields["num_hidden_layers"])) if "num_hidden_layers" in fields else None


def _tolerance(path: tuple[str, ...]) -> float:
    if path[0] == "time":
        return _TIME
    return _EXACT


def extrapolate(sums: list[dict], layers: int, path: tuple[str, ...] = ()) -> tuple[object, list[str]]:
    """Each numeric figure of ``sums`` (the summaries at DEPTHS) carried to ``layers`` blocks, and
    the figures whose increments differ (the blocks are not identical for them)."""
    a, b, c = sums
    where = ".".join(path) or "summary"
    if isinstance(a, dict):
        if not (a.keys() == b.keys() == c.keys()):
            return None, [f"{where}: {sorted(set(a) ^ set(c))} appear at some depths only"]
        out, bad = {}, []
        for k in a:
            out[k], why = extrapolate([a[k], b[k], c[k]], layers, path + (str(k),))
            bad += why
        return out, bad
    if isinstance(a, (list, tuple)):
        if not (len(a) == len(b) == len(c)):
            return None, [f"{where}: {len(a)} / {len(b)} / {len(c)} entries at depths {DEPTHS}"]
        pairs = [extrapolate([x, y, z], layers, path + (str(i),)) for i, (x, y, z) in enumerate(zip(a, b, c))]
        return type(a)(p[0] for p in pairs), [w for p in pairs for w in p[1]]
    if isinstance(a, bool) or not isinstance(a, (int, float)) or a is None:
        return a, ([] if a == b == c else [f"{where}: {a!r} / {b!r} / {c!r}"])
    step, drift = b - a, (c - b) - (b - a)
    value = a + (layers - DEPTHS[0]) * step
    if abs(drift) * (layers - DEPTHS[-1]) > _tolerance(path) * max(abs(value), 1e-12) + 1e-9:
        return value, [f"{where}: increments {step:.6g} then {c - b:.6g}"]
    return (round(value) if isinstance(a, int) and isinstance(b, int) and isinstance(c, int) else value), []


# the memory figures a peak decides (recomputed from the program's node windows, not extrapolated)
_PEAK_KEYS = ("program_peak", "tensor_peak", "step_peak")


def _program(pm):
    """(nodes, their bytes alive by category, the peak, the index of the first backward node) of
    the joint program, placeholders left out."""
    from autopar.analysis.liveness import program_memory

    prog = pm.program
    mem = program_memory(prog.local, prog.inputs, prog.outputs)
    # the placeholders (one per parameter: their number grows with the depth) hold no peak
    kept = [(n, by) for n, by in zip(prog.local.graph.nodes, mem.by_node) if n.op != "placeholder"]
    nodes, by_node = [n for n, _ in kept], [by for _, by in kept]
    start = next((i for i, n in enumerate(nodes) if n.meta.get("partitioner_tag") == "is_backward"), len(nodes))
    return nodes, by_node, mem.peak, start


def peak_at_depth(runs: list[Analysis], layers: int) -> tuple[dict | None, str]:
    """The joint program's peak at ``layers`` blocks, by category, from node windows.

    A peak is not one linear figure: it is the largest of many (the end of the forward grows by
    one block's saved activations per block, the end of the backward by one block's gradients),
    and which one is largest can change with the depth. Each node's bytes are linear in the depth
    once its role is fixed, and inside a run of identical blocks they are linear in the block's
    index too, so the most bytes of a run are at one of its ends. The windows hold those ends: the
    program's first block (with what precedes it), the last forward block and the first backward
    one (around the loss), and the last backward block (with what follows it), each node matched
    by its distance from its window's anchor across the three depths, checked to run the same op,
    and extrapolated alone; the peak at ``layers`` is the largest of them. At the deepest compile
    the windows must hold the program's true peak (else a peak inside the runs: not extrapolated).
    Returns ({"at_peak": bytes by category at the peak, "max_by": each category's most}, "") or
    (None, why)."""
    data = [_program(r.pm) for r in runs]
    n = [len(d[0]) for d in data]
    f = [d[3] for d in data]
    if n[2] - n[1] != n[1] - n[0] or f[2] - f[1] != f[1] - f[0]:
        return None, f"program lengths {n} (backward from {f}) do not grow by the same nodes per block"
    wf, wb = f[1] - f[0], (n[1] - f[1]) - (n[0] - f[0])
    hf = wf + max(f[0] - DEPTHS[0] * wf, 0)  # one forward block and what is not in a block
    hb = wb + max((n[0] - f[0]) - DEPTHS[0] * wb, 0)

    def index(d: int, key: tuple[str, int]) -> int:
        where, k = key
        return k if where == "start" else (f[d] + k if where == "loss" else n[d] - 1 - k)

    keys = ([("start", k) for k in range(hf)] + [("loss", k) for k in range(-hf, hb)]
            + [("end", k) for k in range(hb)])
    deepest, best, best_at = len(data) - 1, -1, None
    seen_deepest, most = 0, {}
    for key in keys:
        idx = [index(d, key) for d in range(len(data))]
        if any(not 0 <= i < n[d] for d, i in enumerate(idx)):
            continue
        ops = {str(data[d][0][i].target) for d, i in enumerate(idx)}
        if len(ops) > 1:
            return None, f"the node {key[1]} from the {key[0]} runs {sorted(ops)} at depths {DEPTHS}"
        vals = [data[d][1][i] for d, i in enumerate(idx)]
        seen_deepest = max(seen_deepest, sum(vals[deepest].values()))
        cats = {}
        for c in vals[0]:
            a, b, z = (v[c] for v in vals)
            if z - b != b - a:
                return None, (f"bytes alive at node {key[1]} from the {key[0]} ({c}): increments {b - a} then "
                              f"{z - b}")
            cats[c] = a + (layers - DEPTHS[0]) * (b - a)
            most[c] = max(most.get(c, 0), cats[c])
        if sum(cats.values()) > best:
            best, best_at = sum(cats.values()), cats
    if seen_deepest != data[deepest][2]:
        return None, (f"the peak at depth {DEPTHS[-1]} ({data[deepest][2]} B) is inside a run of blocks, "
                      f"not at its ends ({seen_deepest} B)")
    return {"at_peak": best_at, "max_by": most}, ""


def _memory(runs: list[Analysis], out: dict, layers: int) -> str:
    """Replace the peak figures of ``out['memory']`` (extrapolated as lines) by the peak from the
    node windows (``peak_at_depth``), composed as ``cost.predict_memory`` composes them; the
    reason when that cannot be done, else ""."""
    from autopar.analysis.liveness import program_memory

    got, why = peak_at_depth(runs, layers)
    if got is None:
        return why
    cats = got["at_peak"]
    m = out["memory"]
    sync = [r.pm.sync_program for r in runs]
    if all(p is None for p in sync):
        sync_peak, sync_at, sync_max = 0, {}, {}
    else:
        mems = [program_memory(p.local, p.inputs, p.outputs) for p in sync]
        peaks = [x.peak for x in mems]
        if peaks[2] - peaks[1] != peaks[1] - peaks[0]:
            return f"the gradient synchronisation program's peak: increments {peaks[1] - peaks[0]} then {peaks[2] - peaks[1]}"
        sync_peak = peaks[0] + (layers - DEPTHS[0]) * (peaks[1] - peaks[0])
        sync_at = {c: mems[0].at_peak[c] + (layers - DEPTHS[0]) * (mems[1].at_peak[c] - mems[0].at_peak[c])
                   for c in mems[0].at_peak}
        sync_max = {c: mems[0].max_by[c] + (layers - DEPTHS[0]) * (mems[1].max_by[c] - mems[0].max_by[c])
                    for c in mems[0].max_by}
    joint = sum(cats.values())
    acc = m.get("accumulators", 0)
    m["program_peak"] = max(joint + acc, sync_peak)
    m["tensor_peak"] = max(joint, sync_peak)
    wins = joint + acc >= sync_peak
    for c, v in (cats if wins else sync_at).items():
        m[f"peak_{c}"] = v
    for c, v in (got["max_by"] if wins else sync_max).items():
        m[f"max_{c}"] = v
    m["step_peak"] = m["parameters"] + m["optimizer_state"] + m["program_peak"]
    return ""


def analyse_by_depth(args, rank: int, progress, analyse) -> Analysis | None:
    """``analyse(args, rank)`` at depths 3-5 and the summary extrapolated to the model's depth;
    None when the model or plan does not qualify or the blocks are not identical (the caller then
    compiles every block; the reason is in ``args.depth_note``)."""
    from autopar.models import zoo
    from autopar.pipeline_plan import is_pipeline_strategy
    from autopar.tools.explain import parse_plan_arg

    found = depth_field(args.model, zoo.parse_overrides(args.set))
    plan = parse_plan_arg(args.plan) if args.plan else {}
    if found is None or found[1] <= DEPTHS[-1] or any(is_pipeline_strategy(v) for v in plan.values()):
        return None
    name, layers = found
    runs: list[Analysis] = []
    for d in DEPTHS:
        sub = copy.copy(args)
        sub.set = list(args.set) + [f"{name}={d}"]
        r = analyse(sub, rank, lambda s, d=d: progress(f"{s} (depth {d} of {layers})"))
        placed = r.pm.ctx.placed
        if r.pm.pipelined or any(placed.unplaced.values()) or any(placed.unsharded.values()):
            return None  # stage boundaries / per-parameter lists move with the depth
        runs.append(r)
    sums = [summary(r) for r in runs]
    for s in sums:
        s.pop("seconds")
        s["memory"].pop("peak_node", None)  # a node of the shallow program: not the deep one's
    peaks = [{k: s["memory"].pop(k) for k in list(s["memory"]) if k in _PEAK_KEYS or k.startswith(("peak_", "max_"))}
             for s in sums]
    out, bad = extrapolate(sums, layers)
    if not bad:
        why = _memory(runs, out, layers)
        bad = [why] if why else []
    del peaks
    if bad:
        args.depth_note = (f"blocks not identical at depths {DEPTHS} ({'; '.join(bad[:3])}"
                           + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") + "): compiled every block")
        return None
    seconds = {k: sum(r.seconds.get(k, 0.0) for r in runs) for k in ("build", "compile", "cost_model", "total")}
    out["seconds"] = seconds
    out["extrapolated"] = {"depths": list(DEPTHS), "layers": layers, "field": name}
    last = runs[-1]
    return Analysis(last.model, last.axes, last.plan, rank, last.coord, last.options, last.pm, last.memory,
                    last.time, last.device, last.links, seconds, last.notes, int(out["parameters"]),
                    extrapolated=out)



def plan_analysis(args, rank: int, progress, analyse) -> Analysis:
    """What ``autopar plan`` reports for ``rank``: extrapolated in depth where that applies, else
    every block compiled (with the reason when the blocks turned out not identical)."""
    args.depth_note = None
    a = analyse_by_depth(args, rank, progress, analyse)
    if a is None:
        a = analyse(args, rank, progress)
        if args.depth_note:
            a.notes.append(args.depth_note)
    return a
