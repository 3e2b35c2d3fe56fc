"""``autopar plan`` of a deep model for the price of three shallow ones.

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

The memory peak is not one line but the largest of several (the end of the forward grows by one
block's saved activations per block, the end of the backward by one block's gradients), and which
is largest can change with the depth: each of those points is carried along its own line, checked
the same way, and the largest taken (``autopar.analysis.liveness.peak_in_depth``).

Any figure that fails its check, or that a depth adds or drops (a collective kind that appears
only from some depth on), makes ``plan`` compile every block instead, and say why.

Depth 3 is compiled first, in this process; the deeper depths' per-rank programs are spliced
from its (autopar/local_splice.py, checked node for node, else traced and said why). Where the
process can fork (autopar/forked.py: the command line; ``AUTOPAR_PLAN_FORK=0`` switches it off) it
forks as soon as depth 3's localize pass has recorded that program (``forked.Continued``,
``passes.after``): the child finishes depth 3 and compiles depth 4, sending back only the figures
the extrapolation reads (``_figures``); this process compiles depth 5 (its program is what
``plan`` shows). Two processes for a 2-core machine, both warm (dynamo, DTensor's strategy
choices, the model code: depth 3 paid them). If the child fails, depths 3 and 4 are compiled here
instead, and the progress says so.

Where it applies: any model with a repeated block list (``splice.find_blocks``: Hugging Face's
``model.layers``, GPT-2's ``transformer.h``, a factory's own ``nn.ModuleList``) of more than 5
blocks, the built-in models included: the shallow depths are that list cut in a copy of the
model on the meta device (autopar/depth.py), not the model rebuilt from a config. Not under plans
with a pipeline axis (a pipeline's stage boundaries move with the depth; its capture is spliced
instead, autopar/splice.py). Blocks that are not all alike but repeat every few
(``splice.find_period``: Gemma 2 and gpt-oss alternate a sliding-window and a full attention
layer) are extrapolated in units of that many blocks, at 3, 4 and 5 units, each depth traced whole
(splicing repeats one block: not these), every unit's increments required equal. The
per-parameter lists the table's notes give (parameters left to ``plan['rest']``, or stored whole)
are each block's names repeated for every block, where every block's are the same. A model
without such a list, or whose blocks fail the check, is compiled whole, with the reason as one
note. ``autopar plan --full-depth`` compiles every block regardless;
``tests/test_extrapolate.py`` and ``tests/test_depth.py`` check the extrapolated table against the
full compile.
"""

from __future__ import annotations

import contextlib
import time
import warnings

from autopar.forked import Continued, Parted, can_fork
from autopar.parts import NOTE as CUT_NOTE
from autopar.context import MASKS_NOTE
from autopar.tools.render import Analysis, summary

DEPTHS = (3, 4, 5)
# relative tolerance on (L - 5) * (increment 5 - increment 4), against the extrapolated figure
_EXACT, _TIME = 0.0, 1e-2


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


# the memory figures a peak decides (carried point by point in ``_memory``, not along one line)
_PEAK_KEYS = ("program_peak", "tensor_peak", "step_peak")


def _memory(figs: list[dict], out: dict, layers: int) -> str:
    """Replace the peak figures of ``out['memory']`` by the peak carried to ``layers`` blocks
    point by point (``liveness.peak_in_depth``), composed as ``cost.predict_memory`` composes
    them; the reason when a point's bytes do not grow by the same amount per block, else ""."""
    from autopar.analysis.liveness import peak_in_depth

    m = out["memory"]
    got = {}
    for what in ("joint", "sync"):
        mems = [f["mems"].get(what) for f in figs]
        if any(x is None for x in mems):
            continue
        for point in mems[0].branches:
            for c, a in mems[0].branches[point].items():
                b, z = (x.branches[point][c] for x in mems[1:])
                if z - b != b - a:
                    return (f"the {what} program's {c} at its {point} point: increments {b - a} then {z - b} "
                            "bytes per block")
        got[what] = peak_in_depth(mems, DEPTHS, layers)
    joint = sum(got["joint"]["at_peak"].values())
    sync = sum(got["sync"]["at_peak"].values()) if "sync" in got else 0
    acc = m.get("accumulators", 0)
    m["program_peak"] = max(joint + acc, sync)
    m["tensor_peak"] = max(joint, sync)
    wins = got["joint"] if joint + acc >= sync else got["sync"]
    for c, v in wins["at_peak"].items():
        m[f"peak_{c}"] = v
    for c, v in wins["max_by"].items():
        m[f"max_{c}"] = v
    m["step_peak"] = m["parameters"] + m["optimizer_state"] + m["program_peak"]
    return ""


def _figures(r: Analysis) -> dict | None:
    """What the extrapolation reads of one depth's analysis (plain data: a forked child sends it
    back); None for a pipeline (its stage boundaries move with the depth)."""
    from autopar.analysis.cost import program_liveness

    placed = r.pm.ctx.placed
    if r.pm.pipelined:
        return None
    fused, kind = bool(r.options.get("inductor")), r.device.kind  # (as cost.predict_memory)
    mems = {what: program_liveness(p, fused, kind)
            for what, p in (("joint", r.pm.program), ("sync", r.pm.sync_program)) if p is not None}
    # the per-parameter lists the table's notes name (plan['rest']'s, those stored whole)
    lists = {kind: {axis: list(names) for axis, names in getattr(placed, kind).items() if names}
             for kind in ("unplaced", "unsharded")}
    return {"summary": summary(r), "mems": mems, "seconds": dict(r.seconds), "lists": lists}


def _all_blocks(lists: dict, path: str, depth: int, layers: int) -> dict | None:
    """Per-parameter lists of the model at ``depth`` blocks as the model at ``layers`` has them:
    every block's names as each block has them; None where its blocks' names differ."""
    out: dict = {}
    for kind, by_axis in lists.items():
        out[kind] = {}
        for axis, names in by_axis.items():
            before, after, blocks = [], [], [[] for _ in range(depth)]
            for n in names:
                head, _, tail = n[len(path) + 1:].partition(".") if n.startswith(path + ".") else ("", "", "")
                if head.isdigit() and int(head) < depth:
                    blocks[int(head)].append(tail)
                else:
                    (after if any(blocks) else before).append(n)
            if any(b != blocks[0] for b in blocks):
                return None
            out[kind][axis] = before + [f"{path}.{i}.{t}" for i in range(layers) for t in blocks[0]] + after
    return out


def analyse_by_depth(args, plan: dict, rank: int, progress, analyse, loaded) -> Analysis | None:
    """``analyse(args, rank, report, loaded=)`` of ``loaded`` (``zoo.Loaded``: the model, whole) with
    its block list cut to depths 3-5 (``plan``: the parsed ``--plan``) and the summary extrapolated
    to the model's depth; None when the model or plan does not qualify or the blocks are not
    identical (the caller then compiles every block; the reason is in ``args.depth_note``)."""
    from autopar import capture_cache, joint_splice, local_splice, splice
    from autopar.depth import repeated
    from autopar.pipeline_plan import is_pipeline_strategy

    if any(is_pipeline_strategy(v) for v in plan.values()):
        return None
    rep = repeated(loaded.model, loaded.example_inputs, loaded.loss_fn, min_blocks=DEPTHS[-1] + 1, name=loaded.name,
                   periodic=True)
    if isinstance(rep, str):
        args.depth_note = f"compiled every block, not extrapolated in depth: {rep}"
        return None
    layers = rep.layers
    unit = f" units of {rep.period} blocks" if rep.period > 1 else ""

    def at(d: int, report) -> Analysis:
        return analyse(args, rank, lambda s: report(f"{s} (depth {d} of {layers}{unit})"), loaded=rep.at(d))

    if rep.period > 1:
        # blocks that differ within a unit: no splicing (it repeats one block), every depth traced
        with capture_cache.used(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)
            return _by_depth(args, rank, rep, at, progress)
    with capture_cache.used(), splice.spliced(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)  # (torch's, copying a graph's pytree codegen)
        # depth 3 traced once, here, before the fork (capture and joint graph): its compile below
        # finds both in the capture cache, the deeper depths capture its three blocks from there
        # and splice them (autopar/splice.py), and their joint graphs are depth 3's spliced
        # (autopar/joint_splice.py); each is checked to be what a trace would give, else traced
        shallowest = rep.at(DEPTHS[0])
        state = analyse(args, rank, lambda s: progress(f"{s} (depth {DEPTHS[0]} of {layers}, shared)"),
                        loaded=shallowest, stop_after="autograd")
        base = (state.stages[0].gm, state.stages[0].program, shallowest.model) if len(state.stages) == 1 else None
        with joint_splice.based_on(*base) if base else contextlib.nullcontext(), \
                local_splice.recording(rep.path) if base else contextlib.nullcontext():
            return _by_depth(args, rank, rep, at, progress)


def _by_depth(args, rank: int, rep, at, progress) -> Analysis | None:
    """``analyse_by_depth`` from the fork on."""
    from autopar import local_splice, passes

    layers = rep.layers

    def figures_at(d: int, report):
        """depth ``d``'s figures, with how its per-rank program was made (autopar/local_splice.py)"""
        seen = len(local_splice.log())
        a = at(d, report)
        f = _figures(a)
        if f is not None:
            f["localized"] = local_splice.log()[seen:]
        return a, f

    # the shallowest depth first, here: the deeper ones' per-rank programs are spliced from its
    # (autopar/local_splice.py records it at its localize), and after the fork both processes find
    # dynamo, DTensor's strategies and the model code warm. The fork comes as soon as depth 3's
    # per-rank program is recorded: the child finishes depth 3 (its last passes and cost model)
    # and compiles the middle depths, this process goes on to the deepest; two processes for the
    # 2 cores. Where this process cannot fork, every depth is compiled here, one after the other.
    shallow = list(DEPTHS[1:-1])
    child, first = None, None
    cont = Continued() if can_fork() else None
    try:
        with passes.after("localize", cont.split) if cont is not None else contextlib.nullcontext():
            _, first = figures_at(DEPTHS[0], lambda s: None if cont is not None and cont.in_child else progress(s))
    except Parted:
        child = cont  # (depth 3's figures come from it, first)
    except BaseException as e:
        if cont is not None and cont.in_child:
            cont.fail(e)  # (leaves)
        raise
    if cont is not None and cont.in_child:  # the child: depth 3 done, then the middle depths (it leaves)
        cont.send(lambda: [first, *(figures_at(d, lambda s: None)[1] for d in shallow)])
    try:
        last, deepest = figures_at(DEPTHS[-1], progress)
    except BaseException:
        if child is not None:
            child.kill()
        raise
    if deepest is None:  # the plan does not qualify at any depth
        if child is not None:
            child.kill()
        return None
    figs, fork_failed = None, None
    if child is not None:
        try:
            first, *figs = child.result()
        except RuntimeError as e:  # those depths again, here (where an error, if it is one, is raised)
            fork_failed = f"depths {[DEPTHS[0], *shallow]} in a forked process failed ({str(e).splitlines()[0][:120]})"
            progress(f"{fork_failed}: compiling them here")
            _, first = figures_at(DEPTHS[0], progress)
            child = None
    if figs is None:
        figs = [figures_at(d, progress)[1] for d in shallow]
    figs = [first, *figs, deepest]
    if any(f is None for f in figs):
        return None
    lists = [_all_blocks(f["lists"], rep.path, d * rep.period, layers * rep.period) for f, d in zip(figs, DEPTHS)]
    if lists[0] is None or any(x != lists[0] for x in lists):
        args.depth_note = ("compiled every block, not extrapolated in depth: the parameters left to plan['rest'] or "
                           "stored whole differ from block to block")
        return None
    sums = [f["summary"] for f in figs]
    for s in sums:
        s.pop("seconds")
        s["memory"].pop("peak_node", None)  # a node of the shallow program: not the deep one's
        for k in [k for k in s["memory"] if k in _PEAK_KEYS or k.startswith(("peak_", "max_"))]:
            del s["memory"][k]
    out, bad = extrapolate(sums, layers)
    if not bad:
        why = _memory(figs, out, layers)
        bad = [why] if why else []
    if bad:
        args.blocks_differ = True
        args.depth_note = (f"blocks not identical at depths {DEPTHS} ({'; '.join(bad[:3])}"
                           + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") + "): compiled every block")
        return None
    placed = last.pm.ctx.placed  # (the table's notes name the whole model's parameters)
    for kind, by_axis in lists[0].items():
        getattr(placed, kind).update(by_axis)
    seconds = {k: sum(f["seconds"].get(k, 0.0) for f in figs) for k in ("build", "compile", "cost_model", "total")}
    out["seconds"] = seconds
    out["extrapolated"] = {"depths": list(DEPTHS), "layers": layers, "blocks": rep.path, "period": rep.period,
                           "forked": shallow if child is not None else [],
                           **({"forked_after": "localize"} if child is not None else {}),
                           **({"fork_failed": fork_failed} if fork_failed else {}),
                           "localized": {d: f.get("localized", []) for d, f in zip(DEPTHS, figs)}}
    # the masks pass's and the cut's lines count what the deepest compile holds, not the whole model: say so
    counted = (f" (counted in the depth-{DEPTHS[-1]} compile; the model has {layers} blocks): " if rep.period == 1 else
               f" (counted in the compile of {DEPTHS[-1] * rep.period} blocks; the model has {layers * rep.period}): ")
    notes = [n.replace(MASKS_NOTE, MASKS_NOTE[:-2] + counted, 1).replace(CUT_NOTE, CUT_NOTE[:-2] + counted, 1)
             for n in last.notes]
    if fork_failed:  # (the same figures; the time the fork would have saved, spent here)
        notes.append(f"{fork_failed}: compiled in this process instead")
    return Analysis(last.model, last.axes, last.plan, rank, last.coord, last.options, last.pm, last.memory,
                    last.time, last.device, last.links, seconds, notes, int(out["parameters"]),
                    extrapolated=out)


def plan_analysis(args, plan: dict, rank: int, progress, analyse) -> Analysis:
    """What ``autopar plan`` reports for ``rank``: extrapolated in depth where that applies, else
    every block compiled (with the reason as a note)."""
    from autopar import disk_cache, splice
    from autopar.models import zoo

    args.depth_note = None
    args.blocks_differ = False  # analyse_by_depth: the depth check found blocks that are not alike
    t0 = time.perf_counter()
    progress(f"rank {rank}: building {args.model}")
    loaded = zoo.load(args.model, meta=not args.real, batch=args.batch, seq=args.seq,
                      overrides=zoo.parse_overrides(args.set))
    built = time.perf_counter() - t0
    read: list[str] = []
    with disk_cache.noting(read):  # (the shared depth's reads: its own notes are not the report's)
        a = analyse_by_depth(args, plan, rank, progress, analyse, loaded)
    if a is None:
        # where every block is compiled (a pipeline) a model's capture is spliced from three of its
        # blocks (autopar/splice.py, which checks them), unless its blocks failed the depth check
        splicing = not args.blocks_differ
        before = dict(splice.STATS)
        with splice.spliced() if splicing else contextlib.nullcontext():
            a = analyse(args, rank, progress, loaded=loaded)
        if args.depth_note:
            a.notes.append(args.depth_note)
        if splice.STATS.get("spliced", 0) > before.get("spliced", 0):
            a.notes.append("the model's capture was spliced from its first three blocks, the third repeated (blocks "
                           "checked alike; --full-depth traces every block)")
    said = disk_cache.note(read)
    if said and said not in a.notes:
        a.notes.append(said)
    a.seconds["build"] = a.seconds.get("build", 0.0) + built
    a.seconds["total"] = a.seconds.get("total", 0.0) + built
    return a
