"""``autopar dump | plan | explain``: what each rank will hold, send and compute, and why.

Everything runs in this process on a fake process group (any mesh size) with the model on the
meta device (no memory for weights), so Llama-3 70B on 1024 ranks plans on a laptop:

    autopar dump  MODEL --mesh dp=2,tp=2 --plan dp=fsdp,tp=megatron [--rank R] [--format text|json|dot|svg]
    autopar plan  MODEL --mesh dp=8,tp=8 --plan dp=fsdp,tp=megatron [--device h100] [--rank 0,7]
    autopar explain MODEL ...   (plan, plus why: the rule behind every placement, the source line
                                 behind every collective, what is alive at the memory peak)

MODEL is a built-in name (``--list-models``) or ``package.module:factory``. ``--plan`` takes
axis=strategy pairs (the Python API's vocabulary) or a JSON file with the plan dict.
Exit codes: 0 success; 1 the model could not be compiled under this plan (the error says why);
2 bad command line (model spec, mesh, plan or option).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
import warnings


from autopar.errors import AutoparError, PlanError
from autopar.mesh import fake_mesh
from autopar.options import CompileOptions
from autopar.scoped import paused_collector
from autopar.tools.render import (Analysis, dump_dot, dump_json, dump_svg, dump_text, explain_text,
                                  plan_table, summary)
from autopar.context import compile_notes


# --------------------------------------------------------------------------- parsing
def parse_mesh(text: str) -> dict[str, int]:
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier():
            raise PlanError(f"bad mesh {text!r}", where="--mesh", fix="write axis=size pairs, e.g. dp=2,tp=2")
        try:
            n = int(size)
        except ValueError:
            n = 0
        if n < 1:
            raise PlanError(f"mesh axis {name!r} needs a positive integer size, got {size!r}", where="--mesh")
        if name in axes:
            raise PlanError(f"mesh axis {name!r} given twice", where="--mesh")
        axes[name] = n
    return axes


def parse_plan_arg(text: str) -> dict:
    if text.endswith(".json") or os.path.isfile(text):
        if not os.path.isfile(text):
            raise PlanError(f"no such plan file {text!r}", where="--plan")
        try:
            with open(text) as f:
                plan = json.load(f)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file {text!r} is not valid JSON: {e}", where="--plan") from None
        if not isinstance(plan, dict):
            raise PlanError(f"plan file {text!r} must hold a JSON object (axis -> strategy)", where="--plan")
        return plan
    plan = {}
    for part in text.split(","):
        axis, eq, strategy = part.partition("=")
        if not eq or not axis.strip() or not strategy.strip():
            raise PlanError(f"bad plan {text!r}", where="--plan",
                            fix="write axis=strategy pairs, e.g. dp=fsdp,tp=megatron, or give a JSON plan file")
        plan[axis.strip()] = _strategy_arg(strategy.strip())
    return plan


def balanced_for(plan: dict, device: str) -> dict:
    """``plan`` with its pipeline axis balanced by ``device``'s costs (the ``--device`` being
    planned for) unless it names split points or a device itself: planning a GPU job on a CPU
    would otherwise balance the stages by the CPU's costs (``passes/split.py``)."""
    from autopar.pipeline_plan import is_pipeline_strategy

    out = dict(plan)
    for axis, v in plan.items():
        if is_pipeline_strategy(v):
            v = {"schedule": v} if isinstance(v, str) else dict(v)
            if "split" not in v:
                v.setdefault("balance", device)
            out[axis] = v
    return out


def _strategy_arg(text: str):
    """``1f1b`` -> "1f1b"; a pipeline schedule with options, ``interleaved:virtual=2:microbatches=8``
    (``split=layers.4+layers.8`` for split points) -> the plan's dict form."""
    if ":" not in text:
        return text
    name, *opts = text.split(":")
    out: dict = {"schedule": name}
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq:
            raise PlanError(f"bad strategy option {o!r} in {text!r}", where="--plan",
                            fix="write schedule:key=value, e.g. interleaved:virtual=2:microbatches=8")
        out[k] = v.split("+") if k == "split" else (int(v) if v.isdigit() else v)
    return out


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="built-in name (see --list-models) or package.module:factory")
    p.add_argument("--mesh", default="dp=2", help="named mesh axes, e.g. dp=8,tp=8 (default dp=2)")
    p.add_argument("--plan", default=None,
                   help="'auto' (autopar plan only: choose the mesh and plan, see --world, --budget) or axis=strategy pairs (ddp zero1 zero2 zero3 fsdp megatron sequence ulysses context expert; on a pipeline axis gpipe 1f1b "
                        "interleaved zb, with options as zb:microbatches=8 or interleaved:virtual=2:split=layers.4+"
                        "layers.8) or a JSON plan file (default: ddp on every axis)")
    p.add_argument("--rank", default="0", help="rank(s) to analyse: R, R1,R2 or 'all' (meshes up to 64 ranks)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--reduce-dtype", default=None, choices=["fp32", "bf16", "fp16"])
    p.add_argument("--recompute", default="none", choices=["none", "full", "selective"])
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--kernels", default="off", choices=["auto", "on", "off"],
                   help="lower attention / linear + activation to autopar's Triton kernel ops (default off here: "
                        "planning on meta tensors; 'on' shows the program a GPU run with kernels would have)")
    p.add_argument("--bucket-mb", type=float, default=25,
                   help="MiB of gradients per bucketed reduction, DDP's bucket_cap_mb (default 25; 0: one "
                        "collective per gradient and per gathered parameter)")
    p.add_argument("--prefetch", type=int, default=1,
                   help="ZeRO/FSDP: blocks ahead each block's parameter gather is issued (default 1, FSDP2's; "
                        "0: where first used)")
    p.add_argument("--reshard-after-forward", default="default", choices=["default", "true", "false"],
                   help="ZeRO-3/FSDP, as FSDP2's: default keeps the root's parameters (outside every repeated "
                        "block) gathered from forward to backward and re-gathers the blocks; true re-gathers all; "
                        "false none")
    p.add_argument("--batch", type=int, default=None, help="global batch (built-in models)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (built-in models)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a built-in model's config field, e.g. --set n_layers=4")
    p.add_argument("--device", default="h100", help="device row of the cost model (h100 h200 a100 cpu)")
    p.add_argument("--devices", default=None, help="JSON file with more device rows (from autopar calibrate)")
    p.add_argument("--optimizer", default="adamw",
                   help="its state and its step's memory traffic: adamw, adam (torch's default foreach / for-loop "
                        "step), adamw-fused, adam-fused (fused=True), sgd, momentum, none")
    p.add_argument("--real", action="store_true", help="build built-in models with real weights (default: meta)")
    p.add_argument("--list-models", action="store_true", help="list the built-in models and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


# --------------------------------------------------------------------------- analysis
def _paused(fn, ranks: int):
    """``fn()`` (one rank's analysis) with the collector paused; of several ranks' analyses, each
    one's garbage collected before the next starts (64 of them would otherwise pile up)."""
    with paused_collector():
        out = fn()
    if ranks > 1:
        gc.collect()
    return out


class Progress:
    """Stages on stderr as they start: one updating line on a terminal, a line each otherwise."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last = None

    def __call__(self, what: str):
        if self.quiet:
            return
        now = time.perf_counter()
        end = "" if self.tty else "\n"
        print(f"{chr(13) if self.tty else ''}[autopar {now - self.t0:6.1f}s] {what:60s}", end=end, file=sys.stderr,
              flush=True)
        self.last = what

    def done(self):
        if not self.quiet and self.last is not None:
            print(f"{chr(13) if self.tty else ''}[autopar {time.perf_counter() - self.t0:6.1f}s] {'done':60s}",
                  file=sys.stderr, flush=True)


def parse_ranks(text: str, world: int) -> list[int]:
    if text == "all":
        if world > 64:
            raise PlanError(f"--rank all on a {world}-rank mesh compiles {world} programs", where="--rank",
                            fix="name the ranks to compare, e.g. --rank 0,63")
        return list(range(world))
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        raise PlanError(f"bad --rank {text!r}", where="--rank", fix="write R, R1,R2 or all") from None
    for r in ranks:
        if not 0 <= r < world:
            raise PlanError(f"rank {r} is outside the mesh (ranks 0..{world - 1})", where="--rank")
    return ranks


def compile_options(args, loaded, plan: dict, rank: int, progress: Progress) -> CompileOptions:
    """The command line's options (``args``) for compiling ``loaded`` under ``plan`` as ``rank``:
    on a fake process group, nothing to run (no eval forward), every pipeline stage."""
    return CompileOptions(example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn, plan=plan,
                          precision=args.precision, reduce_dtype=args.reduce_dtype, recompute=args.recompute,
                          accumulate=args.accumulate, progress=lambda s: progress(f"rank {rank}: {s}"),
                          capture_eval=False, pipeline_stages="all", kernels=args.kernels, bucket_mb=args.bucket_mb,
                          prefetch=args.prefetch,
                          reshard_after_forward={"default": None, "true": True, "false": False}[args.reshard_after_forward])


def dump_after(args, rank: int, progress: Progress) -> str:
    """The program as the pass list leaves it after pass ``args.after`` (``autopar dump --after``)."""
    from autopar.compiler import build
    from autopar.analysis import cost
    from autopar.models import zoo
    from autopar.tools.passdump import state_text

    axes = parse_mesh(args.mesh)
    if args.devices:
        cost.load_devices(args.devices)
    plan = balanced_for(parse_plan_arg(args.plan) if args.plan else {a: "ddp" for a in axes},
                        cost.get_device(args.device).name)
    progress(f"rank {rank}: building {args.model}")
    loaded = zoo.load(args.model, meta=not args.real, batch=args.batch, seq=args.seq,
                      overrides=zoo.parse_overrides(args.set))
    with fake_mesh(axes, rank) as mesh:
        state = build(loaded.model, mesh, compile_options(args, loaded, plan, rank, progress), stop_after=args.after)
        return state_text(state)


def analyse(args, rank: int, progress: Progress, loaded=None, stop_after: str | None = None) -> Analysis:
    """Build the model (or take ``loaded``, a ``zoo.Loaded``), compile it for ``rank`` of a fake
    process group, run the cost model. ``stop_after``: the compile's state after that pass instead
    (autopar/tools/extrapolate.py: the depth the deeper ones' joint graphs are spliced from)."""
    from autopar.compiler import build, compile_with
    from autopar.analysis import cost
    from autopar.models import zoo

    axes = parse_mesh(args.mesh)
    plan = parse_plan_arg(args.plan) if args.plan else {a: "ddp" for a in axes}
    if args.devices:
        cost.load_devices(args.devices)
    dev = cost.get_device(args.device)
    t0 = time.perf_counter()
    if loaded is None:
        progress(f"rank {rank}: building {args.model}")
        loaded = zoo.load(args.model, meta=not args.real, batch=args.batch, seq=args.seq,
                          overrides=zoo.parse_overrides(args.set))
    n_params = sum(p.numel() for p in loaded.model.parameters())
    notes = []
    with fake_mesh(axes, rank) as mesh:
        t1 = time.perf_counter()
        if stop_after is not None:
            return build(loaded.model, mesh, compile_options(args, loaded, balanced_for(plan, dev.name), rank, progress),
                         stop_after=stop_after)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = compile_with(loaded.model, mesh, compile_options(args, loaded, balanced_for(plan, dev.name), rank,
                                                                  progress))
        notes = sorted({str(w.message) for w in caught if "autopar" in str(w.message)})
        ctxs = [sp.ctx for sp in pm.local.values()] if pm.pipelined else [pm.ctx]
        notes += compile_notes(ctxs)
        twins = [s for s, st in pm.stages.items() if st.twin_of is not None] if pm.pipelined else []
        if twins:
            notes.append(f"{len(twins)} of {len(pm.stages)} pipeline stages compile to an earlier stage's program and "
                         "were copied from it, renamed (passes/twins.py; AUTOPAR_STAGE_TWINS=0 traces every stage)")
        t2 = time.perf_counter()
        progress(f"rank {rank}: cost model")
        memory = cost.predict_memory(pm, args.optimizer, fused=getattr(args, "inductor", False),
                                     device=dev.kind)
        pipelined = pm.pipelined
        links = (cost._pipeline_links(pm, dev) if pipelined
                 else cost.axis_links(pm.ctx.axis_names, pm.ctx.axis_sizes, dev))
        est = cost.predict_time(pm, dev, args.optimizer, fused=getattr(args, "inductor", False))
        t3 = time.perf_counter()
        coord = tuple(mesh.get_coordinate())
    options = {"precision": args.precision, "reduce_dtype": args.reduce_dtype, "recompute": args.recompute,
               **({"kernels": dict(pm.ctx.lowered)} if args.kernels != "off" else {}),
               "accumulate": args.accumulate, "optimizer": args.optimizer,
               "bucket_mb": args.bucket_mb, "prefetch": args.prefetch,
               "reshard_after_forward": args.reshard_after_forward,
               **({"inductor": True} if getattr(args, "inductor", False) else {}),
               "inputs": [f"{list(x.shape)} {x.dtype}" for x in loaded.example_inputs]}
    return Analysis(args.model, axes, plan, rank, coord, options, pm, memory, est, dev, links,
                    {"build": t1 - t0, "compile": t2 - t1, "cost_model": t3 - t2, "total": t3 - t0,
                     **{f"pass {k}": v for k, v in pm.ctx.timings.items()}}, notes, n_params)


# --------------------------------------------------------------------------- formatting helpers


# --------------------------------------------------------------------------- entry points
def _run(command: str, argv) -> int:
    from autopar.models import zoo

    p = argparse.ArgumentParser(prog=f"autopar {command}", description=_DESCRIPTIONS[command],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=zoo.describe_builtins())
    add_common(p)
    if command == "dump":
        p.add_argument("--format", default="text", choices=["text", "json", "dot", "svg"])
        p.add_argument("--passes", action="store_true", help="print the pass list, in order, and exit")
        p.add_argument("--after", default=None, metavar="PASS",
                       help="the program as the pass list leaves it after PASS (autopar dump --passes lists them)")
    p.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    if command == "plan":
        p.add_argument("--json", action="store_true", help="print the analysis as JSON")
        p.add_argument("--world", type=int, default=None,
                       help="--plan auto: the number of ranks to plan for (the mesh is chosen; --mesh fixes it, "
                            "--recompute and --precision fix those too)")
        p.add_argument("--budget", default=None, help="--plan auto: memory per rank, e.g. 80GiB (default: the "
                                                     "device's memory)")
        p.add_argument("--top", type=int, default=2,
                       help="--plan auto: candidates confirmed by a compile (plus the best of each data-parallel "
                            "strategy, unless screened 10%% slower than a confirmed one); 0: the analytic screen "
                            "alone; default 2")
        p.add_argument("--cp", default=None, metavar="STRATEGIES",
                       help="--plan auto: context-parallel strategies to search, comma-separated (ulysses,context) "
                            "or none; default: both from 8192 tokens per sequence on, none below")
        p.add_argument("--inductor", action="store_true",
                       help="cost the per-rank programs as compile(inductor=True) runs them (the buffers Inductor "
                            "allocates, its fused kernels' bytes; default: op by op, as eager)")
        p.add_argument("--full-depth", action="store_true",
                       help="compile every block (default, for a model with a repeated block list of more than 5 "
                            "blocks: compile it with the list cut to 3, 4 and 5 blocks, check that each block adds "
                            "the same figures and extrapolate to its depth)")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    given = list(sys.argv[1:] if argv is None else argv)
    args.mesh_given = any(a == "--mesh" or a.startswith("--mesh=") for a in given)
    args.precision_given = any(a == "--precision" or a.startswith("--precision=") for a in given)
    args.recompute_given = any(a == "--recompute" or a.startswith("--recompute=") for a in given)
    if args.plan == "auto" and command != "plan":
        print(f"autopar {command}: --plan auto is for `autopar plan` (it chooses the plan); run `autopar plan "
              f"MODEL --plan auto --world N`, then `autopar {command}` with the plan it prints", file=sys.stderr)
        return 2
    if args.list_models:
        print(zoo.describe_builtins())
        return 0
    if command == "dump" and args.passes:
        from autopar.tools.passdump import passes_text

        sys.stdout.write(passes_text())
        return 0
    if not args.model:
        p.print_usage(sys.stderr)
        print(f"autopar {command}: a MODEL is required (autopar {command} --list-models)", file=sys.stderr)
        return 2
    progress = Progress(args.quiet)
    if command == "plan" and args.plan == "auto":
        return _auto(args, progress)
    try:
        axes = parse_mesh(args.mesh)
        ranks = parse_ranks(args.rank, math.prod(axes.values()))
        if command == "dump" and len(ranks) > 1:
            raise PlanError("dump shows one rank's program", where="--rank", fix="give one rank")
        if args.accumulate < 1:
            raise PlanError(f"--accumulate must be >= 1, got {args.accumulate}", where="--accumulate")
        if command == "dump" and args.after:
            from autopar.passes import check_names

            check_names([args.after], "--after")
            text = _paused(lambda: dump_after(args, ranks[0], progress), 1)
        elif command == "plan" and not args.full_depth:
            from autopar import capture_cache
            from autopar.tools.extrapolate import plan_analysis

            plan = parse_plan_arg(args.plan) if args.plan else {}
            # one rank: each depth is traced once, so nothing would read the capture cache
            with capture_cache.bypassed() if len(ranks) == 1 else contextlib.nullcontext():
                results = [_paused(lambda r=r: plan_analysis(args, plan, r, progress, analyse), len(ranks))
                           for r in ranks]
        else:
            results = [_paused(lambda r=r: analyse(args, r, progress), len(ranks)) for r in ranks]
    except PlanError as e:
        progress.done()
        print(f"autopar {command}: {e}", file=sys.stderr)
        return 2
    except AutoparError as e:
        progress.done()
        print(f"autopar {command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    progress.done()
    if command == "dump" and args.after:
        pass
    elif command == "dump":
        text = {"text": dump_text, "json": dump_json, "dot": dump_dot, "svg": dump_svg}[args.format](results[0])
    elif command == "plan":
        text = (json.dumps([{**summary(a), "notes": a.notes} for a in results], indent=1, default=str) + "\n") \
            if args.json \
            else plan_table(results)
    else:
        text = "\n".join(explain_text(a) for a in results)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        try:
            sys.stdout.write(text)
        except BrokenPipeError:  # `autopar dump ... | head`
            pass
    return 0


def _auto(args, progress) -> int:
    """``autopar plan MODEL --plan auto --world N [--budget 80GiB] [--device h100]``."""
    from autopar import planner
    from autopar.analysis import cost
    from autopar.models import zoo

    try:
        if args.devices:
            cost.load_devices(args.devices)
        dev = cost.get_device(args.device)
        mesh = parse_mesh(args.mesh) if args.mesh_given else None
        if mesh is not None and set(mesh) - set(planner.AXES):
            raise PlanError(f"--plan auto chooses among {', '.join(planner.AXES)} axes; --mesh names "
                            f"{sorted(set(mesh) - set(planner.AXES))}", where="--mesh",
                            fix=f"name the axes {', '.join(planner.AXES)} (or leave --mesh out)")
        cp = None if args.cp is None else tuple(s for s in args.cp.split(",") if s and s != "none")
        if cp and set(cp) - set(planner.CP_STRATEGIES):
            raise PlanError(f"--cp {args.cp}: unknown strategy {sorted(set(cp) - set(planner.CP_STRATEGIES))}",
                            where="--cp", fix="ulysses, context, both comma-separated, or none")
        # --mesh fixes the axes it names; with --world the others are searched, without it the
        # mesh is the whole world
        world = args.world if args.world is not None else (math.prod(mesh.values()) if mesh else None)
        if world is None:
            raise PlanError("--plan auto needs the number of ranks", where="--world", fix="e.g. --world 64")
        if mesh and world % math.prod(mesh.values()):
            raise PlanError(f"--world {world} is not a multiple of the {math.prod(mesh.values())} ranks --mesh "
                            f"{args.mesh} fixes", where="--mesh", fix="fix fewer axes, or choose --world to match")
        budget = args.budget if args.budget is not None else int(dev.mem_bytes)
        res = planner.search(args.model, world, device=args.device, budget=budget, batch=args.batch, seq=args.seq,
                             overrides=zoo.parse_overrides(args.set), mesh=mesh,
                             precision=args.precision if args.precision_given else "bf16",
                             optimizer=args.optimizer, confirm_top=args.top, progress=progress,
                             recompute=(args.recompute,) if args.recompute_given else planner.RECOMPUTE,
                             cp_strategies=cp, inductor=args.inductor)
    except PlanError as e:
        progress.done()
        print(f"autopar plan: {e}", file=sys.stderr)
        return 2
    except AutoparError as e:
        progress.done()
        print(f"autopar plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    progress.done()
    text = (json.dumps(planner.result_json(res), indent=1) + "\n") if args.json else planner.report(res)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0 if res.ranked else 1


_DESCRIPTIONS = {
    "dump": "the partitioned per-rank program: every value's placement, every collective with its kind, mesh axis, "
            "bytes, reason and source line; forward and backward apart",
    "plan": "per-rank table: parameters, gradients, optimizer state, activation peak (liveness), bytes per "
            "collective kind and mesh axis, FLOPs, predicted step time with the device assumptions",
    "explain": "the plan table, and why: the rule behind each placement, the source line behind each collective, "
               "what is alive at the memory peak",
}


def dump_main(argv=None) -> int:
    return _run("dump", argv)


def plan_main(argv=None) -> int:
    return _run("plan", argv)


def explain_main(argv=None) -> int:
    return _run("explain", argv)
