"""The split pass: a pipeline's stages, cut from the torch-level graph of model + loss.


``plan={"pp": "1f1b", "dp": "fsdp", "tp": "megatron"}`` (or ``"gpipe"``, ``"interleaved"``, ``"zb"``;
``{"pp": {"schedule": "interleaved", "microbatches": 8, "virtual": 2, "split": ["layers.2"]}}``
for the options). What happens, in order:

1. **Capture** the whole model (+ loss) once, at the micro-batch's global shapes, as a torch-level
   FX graph (the dynamo graph the joint capture starts from), every node with its module path.
2. **Split** it into ``S = P * v`` stages at module boundaries: before the modules the user names
   (``split``), or balanced by the cost model: each block of a ModuleList (``layers.3``) and the
   prologue/epilogue around them is a segment; its cost is the roofline time of its forward +
   backward (FLOPs measured with torch's flop counter on the trace's fake tensors, 3x the forward)
   plus the per-op overhead, and contiguous segments are grouped to minimise the slowest stage,
   ties broken by parameter bytes. Values computed only from parameters and buffers (mixed-
   precision casts, rope tables) move to the first stage that uses them. A stage's inputs are the
   values earlier stages (or the user's batch) produce that it reads; stages exchange exactly
   those, point to point, and their gradients backward.
3. **Compile each stage** this rank holds with the ordinary pass pipeline on the stage's
   sub-mesh (the mesh without ``pp``): its own dp/fsdp/tp sharding, gradient reduction deferred to
   one sync program per step (as ``accumulate=M``).
4. **Partition** each stage's per-rank joint program into three graphs (passes/partition.py):
   ``F`` (what the stage's outputs need), ``I`` (what the input gradients need, beyond F) and
   ``W`` (the rest: weight gradients). Values F hands to I/W are the stage's saved activations; B runs I then W.
5. **Run** the schedule (autopar/analysis/schedules.py): each rank walks its action list; a forward
   receives its inputs (blocking ``recv`` from the producer's rank, tagged by edge and
   micro-batch), runs F, sends its outputs (``isend``); a backward receives the output gradients,
   runs I, sends input gradients back, runs W (ZB-H1 runs W later). Parameter gradients are summed
   over micro-batches and synchronised once. Every action is timed (``timeline``), saved
   activations are counted (``peak_in_flight``), bytes sent are counted per step.
"""

from __future__ import annotations

import contextlib
import operator
import time
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from autopar import torch_compat as tc
from autopar.analysis.ops import val_bytes
from autopar.errors import CaptureError, PlanError
from autopar.ir import CompileState, Stage
from autopar.modpath import block_of as _block
from autopar.modpath import module_path as _path
from autopar.modpath import tensor_names
from autopar.passes.twins import args_key, find_twins, value_key

def split_pass(state: CompileState) -> CompileState:
    """After it: ``state.stages`` holds the stages this rank compiles (every stage when planning
    with ``pipeline_stages="all"``), each with its torch-level graph, its example inputs, its
    parameters, and a Context on its mesh (a pipeline stage: the sub-mesh without the pipeline
    axis) with the parameters placed by the plan. No pipeline axis: one stage, the whole graph.
    A stage that compiles to the same program as an earlier one is marked its twin
    (``stage.twin_of``, passes/twins.py): the per-stage passes compile the earlier one only."""
    from autopar.context import make_context
    from autopar.plan import check_rules_cover

    o = state.options
    derive_tensor_parallel(state)
    if o.pipeline is None:
        params = dict(state.model.named_parameters())
        ctx = make_context(state.mesh, o.parsed, params, o, o.given.accumulate, state)
        ctx.sync_grads = o.given.accumulate == 1  # else: gradients summed over micro-batches, reduced once
        state.stages = [Stage(0, state.gm, state.micro_inputs, list(params), ctx)]
        return state
    pl = o.pipeline
    check_rules_cover(pl.parsed, dict(state.model.named_parameters()))  # every stage's leftovers at once
    device = next((q.device for q in state.model.parameters()), torch.device("cpu"))
    state.specs = split_stages(state.gm, pl.n_stages, pl.options.split, device=device, dev_name=pl.options.balance)
    pp_rank = state.mesh.get_local_rank(pl.axis)
    mine = [s for s in range(pl.n_stages) if o.given.pipeline_stages == "all" or pl.schedule.rank_of(s) == pp_rank]
    ids = tensor_names(state.model)
    for spec in state.specs:  # every stage's, also those other ranks compile: tied weights (runtime)
        spec.param_names = [ids[id(getattr(spec.gm, t))][1] for t in spec.params]
    state.stages = []
    for s in mine:
        spec = state.specs[s]
        params = {ids[id(getattr(spec.gm, t))][1]: getattr(spec.gm, t) for t in spec.params}
        ctx = make_context(pl.stage_mesh, pl.parsed, params, o, pl.microbatches, state)
        ctx.boundary = (spec.in_batched, spec.out_batched)
        ctx.sync_grads = False  # gradients summed over the micro-batches, reduced once per step
        state.stages.append(Stage(s, spec.gm, tuple(spec.example), list(params), ctx, spec=spec))
    find_twins(state, ids)  # stages that compile to the same program: compiled once (passes/twins.py)
    return state


def derive_tensor_parallel(state: CompileState) -> None:
    """Megatron's placements from the whole captured graph (autopar/analysis/tensor_parallel.py),
    once per axis whose strategy derives them (every parameter replicated on a one-rank axis),
    put on the plan(s) the stages are placed with (``Plan.derived``)."""
    from autopar import unfuse
    from autopar.analysis.tensor_parallel import R, Decision, Derived, derive
    from autopar.plan import DERIVED_TP, _first

    o = state.options
    plans = [o.parsed] + ([o.pipeline.parsed] if o.pipeline is not None else [])
    sizes = dict(zip(state.mesh.mesh_dim_names, state.mesh.shape))
    for plan in plans:
        for ap in plan.axes:
            if ap.strategy not in DERIVED_TP or ap.axis in plan.derived:
                continue
            if ap.axis not in state.tp_derived:
                t0 = time.perf_counter()
                if sizes.get(ap.axis, 1) > 1 and not state.cuts:
                    # fused projections cut into unequal parts: one parameter per part (autopar/unfuse.py;
                    # a second tensor-parallel axis derives on the graph the first one cut)
                    state.tp_derived[ap.axis], state.cuts, state.cut_notes = unfuse.derive_with_cuts(
                        state.gm, state.model, lambda ax=ap.axis: derive(state.gm, state.model, sizes[ax], ax),
                        lambda name: any(_first(rules, name) for p in plans for rules in p.overrides.values()))
                elif sizes.get(ap.axis, 1) > 1:
                    state.tp_derived[ap.axis] = derive(state.gm, state.model, sizes[ap.axis], ap.axis)
                else:  # one rank: every placement is the whole tensor
                    state.tp_derived[ap.axis] = Derived(1, {n: Decision(R, "replicated", "one rank on this axis")
                                                            for n, _ in state.model.named_parameters()})
                state.timings["derive"] = state.timings.get("derive", 0.0) + time.perf_counter() - t0
            plan.derived[ap.axis] = state.tp_derived[ap.axis]


# ------------------------------------------------------------------------------------ splitting
@dataclass
class StageSpec:
    index: int
    gm: fx.GraphModule  # the stage's torch-level program
    inputs: list[tuple]  # per placeholder: ("user", i) | ("stage", j, k): output k of stage j
    consumers: list[list[tuple[int, int]]]  # per output: [(stage t, input k of t)]
    example: list[torch.Tensor]
    in_batched: list[bool]  # per input: dim 0 is the batch
    out_batched: list[bool]
    params: list[str]
    modules: tuple[str, str]  # first and last module path in the stage
    param_bytes: int = 0
    is_last: bool = False
    param_names: list[str] = field(default_factory=list)  # the user's names of ``params`` (split_pass)


def _node_flops(n: fx.Node, fake_mode) -> int:
    """Forward FLOPs of one torch-level node (autopar/analysis/ops.py ``replayed_flops``: replayed
    on the trace's fake tensors, each ATen op counted by the cost model's counter). A node that
    cannot be replayed, or whose FLOPs are unknown, is a PlanError: costed as 0 it would silently
    unbalance the stages."""
    from autopar.analysis.ops import UnknownFlops, replayed_flops
    from autopar.ir import source_line

    try:
        return replayed_flops(n, fake_mode)
    except Exception as e:  # noqa: BLE001 - the cost is unknown: say so instead of counting 0
        what = str(e) if isinstance(e, UnknownFlops) else (
            f"replaying it on the trace's fake tensors raised {type(e).__name__}: {e}")
        raise PlanError(f"cannot count the FLOPs of {getattr(n.target, '__name__', n.target)} ({n.name}) to balance "
                        f"the pipeline stages: {what}", where=source_line(n) or n.name,
                        fix="name the stage boundaries yourself (plan['pp']['split'] = [module names]: no costing "
                        "needed), or register a FLOP formula (torch.utils.flop_counter.register_flop_formula)") from e


def _flops_key(n: fx.Node):
    """What a node's FLOPs depend on: its op and its arguments, argument nodes by their values'
    shapes, dtypes and strides."""
    return n.op, n.target, args_key((n.args, n.kwargs), lambda a: value_key(a.meta.get("example_value")))


def _tensor_bytes(n: fx.Node) -> int:
    """``val_bytes`` of a node's value where it is one tensor. A multi-output op's tuple counts 0:
    its outputs are counted where they are read (through their getitems), as the stage costs have
    always been (counting them at the producer too would move stage boundaries)."""
    v = n.meta.get("example_value")
    return val_bytes(v) if isinstance(v, torch.Tensor) else 0


def split_stages(gm: fx.GraphModule, n_stages: int, split: list[str] | None, device=None,
                 dev_name: str | None = None) -> list[StageSpec]:
    """The stage-split pass over the captured graph; see the module docstring."""
    from autopar.analysis import cost
    from autopar.analysis.devices import row_for

    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = nodes[-1]
    compute = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    # which values depend on the batch (everything else is computed from parameters/buffers)
    batch_dep: dict[fx.Node, bool] = {}
    for n in nodes:
        batch_dep[n] = n.op == "placeholder" or any(batch_dep.get(a, False) for a in n.all_input_nodes)
    paths = {n: _path(n) for n in compute}
    anchors = [n for n in compute if batch_dep[n] and n.target is not operator.getitem]
    if not anchors:
        raise CaptureError("the traced model does no computation on its inputs: nothing to pipeline")

    # ---- segments: maximal runs of anchors in the same block (ModuleList element) or outside one
    seg_of: dict[fx.Node, int] = {}
    seg_start_path: list[str] = []
    cur = None
    for n in anchors:
        b = _block(paths[n])
        if cur is None or b != cur[0]:
            cur = (b, len(seg_start_path))
            seg_start_path.append(paths[n])
        seg_of[n] = cur[1]
    n_seg = len(seg_start_path)

    if split is not None:
        if len(split) != n_stages - 1:
            raise PlanError(f"{len(split)} split point(s) for {n_stages} stages: a split point starts each stage "
                            f"after the first, so {n_stages - 1} are needed", where="plan['pp']['split']")
        cuts = []
        for name in split:
            hit = next((n for n in anchors if paths[n] == name or paths[n].startswith(name + ".")), None)
            if hit is None:
                known = sorted({_block(p) or p.split(".")[0] for p in paths.values() if p})
                raise PlanError(f"no module named {name!r} runs in the traced forward", where="plan['pp']['split']",
                                fix=f"name a module path, e.g. one of {known[:12]}")
            cuts.append(anchors.index(hit))
        if cuts != sorted(cuts) or len(set(cuts)) != len(cuts) or cuts[0] == 0:
            raise PlanError(f"split points {split} must be distinct, in forward order, and not the first module",
                            where="plan['pp']['split']")
        bounds = [0] + cuts + [len(anchors)]
        stage_of_anchor = {}
        for s in range(n_stages):
            for n in anchors[bounds[s]:bounds[s + 1]]:
                stage_of_anchor[n] = s
    else:
        if n_seg < n_stages:
            raise PlanError(f"the model has {n_seg} splittable segments (blocks of its layer lists plus what runs "
                            f"before and after them) but the pipeline wants {n_stages} stages",
                            where="plan['pp']", fix="use fewer pipeline stages (pp x virtual) or a deeper model")
        dev = cost.get_device(dev_name or row_for(torch.cuda.get_device_name() if torch.cuda.is_available() else None))
        fake_mode = gm.meta.get("fake_mode") or contextlib.nullcontext()
        seg_cost = [0.0] * n_seg
        seg_bytes = [0] * n_seg
        rate = dev.flops["fp32"] * dev.efficiency
        seen: dict = {}  # the same op on the same shapes (every block of a deep model): replayed once
        for n in anchors:
            moved = _tensor_bytes(n) + sum(_tensor_bytes(a) for a in n.all_input_nodes)
            key = _flops_key(n)
            if key not in seen:
                seen[key] = _node_flops(n, fake_mode)
            flops = seen[key]
            t = max(flops / rate, moved / dev.mem_bw) + dev.op_overhead
            seg_cost[seg_of[n]] += 3 * t  # forward + backward (2x)
        for n in nodes:
            if n.op == "get_attr":
                users = [u for u in n.users if u in seg_of]
                if users:
                    seg_bytes[seg_of[users[0]]] += _tensor_bytes(n)
        groups = _linear_partition(seg_cost, seg_bytes, n_stages)
        stage_of_anchor = {n: groups[seg_of[n]] for n in anchors}

    # ---- every node's stage: anchors by position, getitems with their source, values computed
    # from parameters/buffers only with their first consumer
    stage: dict[fx.Node, int] = {}
    s = 0
    for n in compute:
        if n in stage_of_anchor:
            s = stage_of_anchor[n]
            stage[n] = s
        elif batch_dep[n]:
            stage[n] = s
    for n in compute:
        if n.target is operator.getitem and n.args[0] in stage:
            stage[n] = stage[n.args[0]]
    for n in reversed(nodes):
        if n.op in ("placeholder", "output") or n in stage:
            continue
        user_stages = [stage[u] for u in n.users if u in stage]
        if n.op == "get_attr":
            continue
        stage[n] = min(user_stages) if user_stages else n_stages - 1
    # parameters/buffers are copied into each stage that uses them. A parameter used by several
    # stages (tied weights: the embedding on the first, the LM head on the last) gets one copy per
    # stage; the runtime sums the copies' gradients across those stages every step (Megatron's
    # way), so the copies stay equal (autopar/runtime/pipeline.py, ``tied``)
    loss = out_node.args[0]
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    if not isinstance(loss, fx.Node) or stage.get(loss) != n_stages - 1:
        raise CaptureError("the loss is not computed in the last pipeline stage", where="loss_fn")
    counts = [0] * n_stages
    for n, st in stage.items():
        counts[st] += 1
    if any(c == 0 for c in counts):
        raise PlanError(f"pipeline stage {counts.index(0)} would be empty", where="plan['pp']['split']")

    # ---- stage graphs
    specs: list[StageSpec] = []
    out_index: dict[fx.Node, tuple[int, int]] = {}  # value -> (stage, output index)
    stage_nodes = [[n for n in nodes if stage.get(n) == st] for st in range(n_stages)]
    outputs_of = []
    for st in range(n_stages):
        outs = [n for n in stage_nodes[st] if any(stage.get(u, -1) > st for u in n.users)]
        if st == n_stages - 1:
            outs = [loss]
        for k, n in enumerate(outs):
            out_index[n] = (st, k)
        outputs_of.append(outs)
    consumers: list[list[list]] = [[[] for _ in outs] for outs in outputs_of]
    for st in range(n_stages):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        root = nn.Module()
        inputs, example, in_batched, params = [], [], [], []
        ext = []
        for n in stage_nodes[st]:
            for a in n.all_input_nodes:
                if a not in env and a not in ext and (a.op == "placeholder" or (a.op != "get_attr" and stage.get(a) != st)):
                    ext.append(a)
        ext.sort(key=lambda a: pos[a])
        for a in ext:
            ph = g.placeholder(a.name)
            ph.meta.update(a.meta)
            env[a] = ph
            k = len(inputs)
            if a.op == "placeholder":
                inputs.append(("user", placeholders.index(a)))
            else:
                j, o = out_index[a]
                inputs.append(("stage", j, o))
                consumers[j][o].append((st, k))
            ev = a.meta.get("example_value")
            if not isinstance(ev, torch.Tensor):
                raise CaptureError(f"a non-tensor value ({type(ev).__name__}) crosses pipeline stages at "
                                   f"{paths.get(a, a.name)}", where="plan['pp']", fix="move the split point")
            t = torch.zeros(ev.shape, dtype=ev.dtype, device=device)
            if ev.requires_grad and ev.is_floating_point() and a.op != "placeholder":
                t.requires_grad_(True)
            example.append(t)
            in_batched.append(_batched(a, ev, batch_dep, placeholders))
        for n in stage_nodes[st]:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and a not in env:
                    obj = _attr(gm, a.target)
                    setattr(root, a.target, obj)
                    env[a] = g.get_attr(a.target)
                    env[a].meta.update(a.meta)
                    if isinstance(obj, nn.Parameter):
                        params.append(a.target)
            env[n] = g.node_copy(n, env.__getitem__)
        outs = outputs_of[st]
        g.output(tuple(env[n] for n in outs))
        sg = tc.graph_module(root, g)
        stage_paths = [paths[n] for n in stage_nodes[st] if n in paths and paths[n]]
        spec = StageSpec(st, sg, inputs, consumers[st], example, in_batched,
                         [False] if st == n_stages - 1 else
                         [_batched(n, n.meta.get("example_value"), batch_dep, placeholders) for n in outs],
                         params, (stage_paths[0] if stage_paths else "", stage_paths[-1] if stage_paths else ""),
                         is_last=st == n_stages - 1)
        spec.param_bytes = sum(val_bytes(getattr(root, p)) for p in params)
        specs.append(spec)
    return specs


def _is_param(gm, n) -> bool:
    return isinstance(_attr(gm, n.target), nn.Parameter)


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _batched(n: fx.Node, ev, batch_dep, placeholders) -> bool:
    """Dim 0 of a value crossing stages is the batch iff it is computed from the batch and its dim 0
    has the batch's size; a value computed from the batch with another leading dim is refused."""
    if not batch_dep.get(n, False):
        return False
    b = placeholders[0].meta["example_value"].shape[0] if placeholders else None
    if isinstance(ev, torch.Tensor) and ev.ndim > 0 and ev.shape[0] == b:
        return True
    raise CaptureError(f"value {n.name} ({list(ev.shape) if isinstance(ev, torch.Tensor) else ev}) crosses a "
                       "pipeline stage boundary but its leading dim is not the micro-batch", where=_path(n) or n.name,
                       fix="move the split point (plan['pp']['split']) to a module boundary where activations are "
                       "batch-first")


def _linear_partition(costs: list[float], nbytes: list[int], k: int) -> list[int]:
    """Group contiguous segments into k non-empty stages minimising the slowest stage (then the
    largest parameter bytes); returns the stage of each segment."""
    n = len(costs)
    pre = [0.0]
    preb = [0]
    for c, b in zip(costs, nbytes):
        pre.append(pre[-1] + c)
        preb.append(preb[-1] + b)
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0.0, 0)
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for t in range(j - 1, i):
                prev = best[j - 1][t]
                if prev == inf:
                    continue
                here = (pre[i] - pre[t], preb[i] - preb[t])
                cand = (max(prev[0], here[0]), max(prev[1], here[1]))
                if cand < best[j][i]:
                    best[j][i], arg[j][i] = cand, t
    out = [0] * n
    i = n
    for j in range(k, 0, -1):
        t = arg[j][i]
        for x in range(t, i):
            out[x] = j - 1
        i = t
    return out
