"""Pipeline parallelism: the stage-split pass, per-stage SPMD programs and the schedule executor.

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
4. **Partition** each stage's per-rank joint program into three graphs: ``F`` (what the stage's
   outputs need), ``I`` (what the input gradients need, beyond F) and ``W`` (the rest: weight
   gradients). Values F hands to I/W are the stage's saved activations; B runs I then W.
5. **Run** the schedule (autopar/schedules.py): each rank walks its action list; a forward
   receives its inputs (blocking ``recv`` from the producer's rank, tagged by edge and
   micro-batch), runs F, sends its outputs (``isend``); a backward receives the output gradients,
   runs I, sends input gradients back, runs W (ZB-H1 runs W later). Parameter gradients are summed
   over micro-batches and synchronised once. Every action is timed (``timeline``), saved
   activations are counted (``peak_in_flight``), bytes sent are counted per step.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import operator
import re
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn

from autopar.errors import CaptureError, InputError, PlanError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


# ------------------------------------------------------------------------------------ options
@dataclass
class PipelineOptions:
    schedule: str
    microbatches: int | None = None  # None: the default (see default_microbatches)
    virtual: int = 1
    split: list[str] | None = None  # module names that start a stage (S - 1 of them)

    @classmethod
    def parse(cls, value, axis: str = "pp") -> PipelineOptions:
        where = f"plan[{axis!r}]"
        if isinstance(value, str):
            value = {"schedule": value}
        if not isinstance(value, dict):
            raise PlanError(f"the pipeline axis wants a schedule name or a dict, got {value!r}", where=where,
                            fix=f'e.g. "{axis}": "1f1b" or {{"schedule": "interleaved", "virtual": 2, '
                            '"microbatches": 8}')
        unknown = set(value) - {"schedule", "microbatches", "virtual", "split"}
        if unknown:
            raise PlanError(f"unknown pipeline option(s) {sorted(unknown)}", where=where,
                            fix="options are schedule, microbatches, virtual, split")
        s = value.get("schedule")
        if s not in PP_SCHEDULES:
            raise PlanError(f"unknown pipeline schedule {s!r}", where=where, fix=f"use one of {list(PP_SCHEDULES)}")
        m = value.get("microbatches")
        if m is not None and (not isinstance(m, int) or m < 1):
            raise PlanError(f"microbatches must be a positive int, got {m!r}", where=f"{where}['microbatches']")
        v = value.get("virtual", 2 if s == "interleaved" else 1)
        if not isinstance(v, int) or v < 1 or (v > 1 and s != "interleaved"):
            raise PlanError(f"virtual={v!r}: only the interleaved schedule runs more than one stage per rank",
                            where=f"{where}['virtual']", fix='use "schedule": "interleaved" with virtual >= 2')
        split = value.get("split")
        if split is not None and (not isinstance(split, (list, tuple)) or not all(isinstance(x, str) for x in split)):
            raise PlanError(f"split must be a list of module names, got {split!r}", where=f"{where}['split']")
        return cls(s, m, v, list(split) if split is not None else None)


def default_microbatches(opts: PipelineOptions, p: int, batch_per_dp: int) -> int:
    """The largest M <= 4 * P that divides the per-data-parallel-rank batch (a multiple of P for
    the interleaved schedule), so the bubble (P-1)/(M+P-1) is at most ~20% when the batch
    allows; at least P."""
    for m in range(4 * p, p - 1, -1):
        if batch_per_dp % m == 0 and (opts.schedule != "interleaved" or m % p == 0):
            return m
    raise PlanError(f"a {p}-stage pipeline needs at least {p} micro-batches, and the batch per data-parallel "
                    f"rank ({batch_per_dp}) cannot be split into {p} or more equal micro-batches"
                    + (" (a multiple of P, interleaved)" if opts.schedule == "interleaved" else ""),
                    where="example_inputs", fix=f"use a batch per data-parallel rank that is a multiple of {p}")


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
    cost: float = 0.0  # predicted seconds of forward + backward (whole micro-batch, one rank)
    param_bytes: int = 0
    is_last: bool = False


_BLOCK = re.compile(r"^((?:[^.]*\.)*?\d+)(\.|$)")  # the first list element on the path: layers.3, h.0, 3


def _path(n: fx.Node) -> str:
    st = n.meta.get("nn_module_stack")
    if not st:
        return ""
    p = list(st.values())[-1][0]
    while "getattr(" in p:  # under functional_call (mixed precision): getattr(L['self'].model.layers, '0').mlp
        q = re.sub(r"getattr\(([^()]*?), '([^']*)'\)", r"\1.\2", p)
        if q == p:
            break
        p = q
    p = re.sub(r"^L\['self'\]\.model\.?", "", p)
    p = re.sub(r"^L\['self'\]\.?", "", p)
    p = re.sub(r"\[(\d+)\]", r".\1", p).replace("_modules['", "").replace("']", "")
    return p


def _block(path: str) -> str:
    m = _BLOCK.match(path)
    return m.group(1) if m else ""


def _node_flops(n: fx.Node, fake_mode) -> float:
    """Forward FLOPs of one torch-level node, from torch's flop-counter formulas on the trace's
    fake tensors (matmuls, attention; everything else counts 0 and is timed as an op)."""
    if n.op not in ("call_function", "call_method"):
        return 0.0
    from torch.utils.flop_counter import FlopCounterMode

    def val(a):
        return a.meta.get("example_value") if isinstance(a, fx.Node) else a

    args = fx.node.map_aggregate(n.args, val)
    kwargs = fx.node.map_aggregate(n.kwargs, val)
    try:
        with fake_mode, FlopCounterMode(display=False) as fc, torch.no_grad():
            if n.op == "call_method":
                getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                n.target(*args, **kwargs)
        return float(fc.get_total_flops())
    except Exception:  # noqa: BLE001 - an op we cannot replay counts as overhead only
        return 0.0


def _val_bytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def capture_whole(model: nn.Module, micro_inputs: tuple, loss_fn, compute_dtype, lower: bool = False) -> fx.GraphModule:
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export

    from autopar.frontend import _meta_attention, _WithLoss

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _meta_attention(model, lower):
                gm = _dynamo_graph_capture_for_export(_WithLoss(model, loss_fn, compute_dtype))(*micro_inputs)
    except Exception as e:  # noqa: BLE001
        raise CaptureError(f"could not trace the model for pipeline splitting: {type(e).__name__}: {e}",
                           where=type(model).__name__) from e
    if lower:
        from autopar.passes.lower import lower_pass

        gm.meta["autopar_lowered"] = dict(lower_pass(gm))
    return gm


def split_stages(gm: fx.GraphModule, n_stages: int, split: list[str] | None, device=None,
                 dev_name: str | None = None) -> list[StageSpec]:
    """The stage-split pass over the captured graph; see the module docstring."""
    from autopar import cost

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
        dev = cost.get_device(dev_name or ("h100" if torch.cuda.is_available() else "cpu"))
        fake_mode = gm.meta.get("fake_mode") or contextlib.nullcontext()
        seg_cost = [0.0] * n_seg
        seg_bytes = [0] * n_seg
        rate = dev.flops["fp32"] * dev.efficiency
        for n in anchors:
            out = n.meta.get("example_value")
            moved = _val_bytes(out) + sum(_val_bytes(a.meta.get("example_value")) for a in n.all_input_nodes)
            t = max(_node_flops(n, fake_mode) / rate, moved / dev.mem_bw) + dev.op_overhead
            seg_cost[seg_of[n]] += 3 * t  # forward + backward (2x)
        for n in nodes:
            if n.op == "get_attr":
                users = [u for u in n.users if u in seg_of]
                if users:
                    seg_bytes[seg_of[users[0]]] += _val_bytes(n.meta.get("example_value"))
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
    # parameters/buffers are copied into each stage that uses them; parameters may live in one only
    attr_stages: dict[fx.Node, set[int]] = {}
    for n in nodes:
        if n.op == "get_attr":
            attr_stages[n] = {stage[u] for u in n.users if u in stage}
            if _is_param(gm, n) and len(attr_stages[n]) > 1:
                users = sorted({paths.get(u, "") for u in n.users if u in stage})
                raise PlanError(f"parameter {n.target} is used by pipeline stages {sorted(attr_stages[n])} "
                                f"(modules {users}): tied weights cannot live on two stages",
                                where="plan['pp']", fix="untie the weights, or choose split points (plan['pp']"
                                "['split']) that keep the modules sharing it in one stage")
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
        sg = fx.GraphModule(root, g)
        stage_paths = [paths[n] for n in stage_nodes[st] if n in paths and paths[n]]
        spec = StageSpec(st, sg, inputs, consumers[st], example, in_batched,
                         [False] if st == n_stages - 1 else
                         [_batched(n, n.meta.get("example_value"), batch_dep, placeholders) for n in outs],
                         params, (stage_paths[0] if stage_paths else "", stage_paths[-1] if stage_paths else ""),
                         is_last=st == n_stages - 1)
        spec.param_bytes = sum(_val_bytes(getattr(root, p)) for p in params)
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


def is_pipeline_strategy(v) -> bool:
    return (isinstance(v, str) and v in PP_SCHEDULES) or (isinstance(v, dict) and "schedule" in v)


# ------------------------------------------------------------------------------------ partition
@dataclass
class Part:
    """One of a stage's three graphs (F, I, W): reads ``args`` (names of the joint program's
    placeholders or of values earlier parts produced), writes ``outs``."""

    name: str
    gm: fx.GraphModule | None
    args: list[str]
    outs: list[str]
    nodes: int = 0


def partition(gm: fx.GraphModule, roles: list[tuple]) -> dict[str, Part]:
    """Split a stage's per-rank joint program into F (everything its activations / loss need),
    I (what its input gradients need beyond F) and W (what its weight gradients need beyond
    both). Collectives go with the values they produce; recomputed values land in I/W."""
    nodes = list(gm.graph.nodes)
    out = nodes[-1]
    outs = list(out.args[0])

    def targets(kinds):
        return [o for o, r in zip(outs, roles) if r[0] in kinds and isinstance(o, fx.Node)]

    def ancestors(ts, exclude):
        seen: set[fx.Node] = set()
        stack = list(ts)
        while stack:
            n = stack.pop()
            if n in seen or n in exclude or n.op == "placeholder":
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        return seen

    f = ancestors(targets(("act", "loss")), set())
    i = ancestors(targets(("input_grad",)), f)
    w = ancestors(targets(("grad",)), f | i)
    groups = [("F", f), ("I", i), ("W", w)]
    needed_by_later: list[set[fx.Node]] = []
    for k, (_, g) in enumerate(groups):
        later = set()
        for _, h in groups[k + 1:]:
            for n in h:
                later.update(a for a in n.all_input_nodes if a in g)
        later.update(o for o in outs if isinstance(o, fx.Node) and o in g)
        needed_by_later.append(later)
    parts = {}
    for (name, g), later in zip(groups, needed_by_later):
        if not g:
            parts[name] = Part(name, None, [], [])
            continue
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        args = []
        for n in nodes:
            if n not in g:
                continue
            for a in n.all_input_nodes:
                if a not in env and a not in g:
                    ph = graph.placeholder(a.name)
                    ph.meta.update({k: a.meta[k] for k in ("val", "autopar") if k in a.meta})
                    env[a] = ph
                    args.append(a.name)
            env[n] = graph.node_copy(n, env.__getitem__)
        keep = [n for n in nodes if n in later]
        graph.output(tuple(env[n] for n in keep))
        parts[name] = Part(name, fx.GraphModule(gm, graph), args, [n.name for n in keep], len(g))
    return parts


# ------------------------------------------------------------------------------------ compile
@dataclass
class StageProgram:
    spec: StageSpec
    ctx: object
    program: object
    sync: object
    parts: dict[str, Part]
    param_names: list[str]  # the user's names of the parameters this stage holds
    ph_names: list[str] = field(default_factory=list)  # per program input: its placeholder's name
    out_names: list[str | None] = field(default_factory=list)  # per program output: node name (None: no value)
    ph_vals: dict = field(default_factory=dict)  # placeholder name -> its per-rank fake value
    saved_bytes: int = 0  # predicted: what one micro-batch's forward leaves for its backward
    saved_after_i: int = 0  # ... and what its input-gradient part leaves for its weight-gradient part


def _saved_bytes(gm: fx.GraphModule, roles, parts: dict[str, Part], after: str = "F") -> int:
    """Bytes of the distinct storages a micro-batch holds between its parts, from the trace's fake
    tensors: ``after="F"``: what F leaves for I and W (the stage's activations in flight);
    ``after="I"``: what W still needs (with the output gradients). Views of parameters and
    buffers do not count."""
    from autopar.cost import _storages

    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state = {sid for n, (kind, _) in zip(placeholders, roles) if kind in ("param", "buffer")
             for sid, _ in _storages(n.meta.get("val"))}
    skip = {n.name for n, (kind, _) in zip(placeholders, roles) if kind in ("param", "buffer")}
    if after == "F":
        skip |= {n.name for n, (kind, _) in zip(placeholders, roles) if kind == "tangent"} | set(parts["I"].outs)
        names = set(parts["I"].args) | set(parts["W"].args)
    else:
        names = set(parts["W"].args)
    seen, total = set(state), 0
    for name in sorted(names - skip):
        for sid, nbytes in _storages(nodes[name].meta.get("val")):
            if sid not in seen:
                seen.add(sid)
                total += nbytes
    return total


def compile_pipeline(model: nn.Module, mesh, *, example_inputs: tuple, loss_fn, plan: dict, pp_axis: str,
                     compute_dtype, reduce_dtype, recompute: str, accumulate: int, inputs: str, debug: bool,
                     skip_passes, progress, stages: str = "local", lower: bool = False,
                     loss_scale="dynamic"):
    """``autopar.compile`` with a pipeline axis; ``stages="all"`` also compiles the stages other
    ranks hold (planning: ``autopar dump`` shows every stage)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.compiler import Context
    from autopar.frontend import _tensor_names, capture_stage
    from autopar.passes import run_passes
    from autopar.passes.state import grad_sync_program
    from autopar.plan import parse_plan, place_parameters
    from autopar.schedules import SCHEDULES, ScheduleError, interleaved, validate

    opts = PipelineOptions.parse(plan[pp_axis], pp_axis)
    if accumulate != 1:
        raise PlanError("accumulate=K with a pipeline axis: the pipeline's micro-batches already accumulate "
                        "gradients", where="autopar.compile(accumulate=...)",
                        fix=f'drop accumulate and set plan["{pp_axis}"] = {{"schedule": "{opts.schedule}", '
                        f'"microbatches": M}}')
    names = tuple(mesh.mesh_dim_names)
    p = mesh.shape[names.index(pp_axis)]
    others = tuple(a for a in names if a != pp_axis)
    stage_plan = {k: v for k, v in plan.items() if k != pp_axis}
    for glob, per_axis in (plan.get("rules") or {}).items():
        if isinstance(per_axis, dict) and pp_axis in per_axis:
            raise PlanError(f"rule {glob!r} places parameters on the pipeline axis {pp_axis!r}: a stage's parameters "
                            "live on its own ranks only", where=f"plan['rules'][{glob!r}]",
                            fix=f"drop '{pp_axis}' from the rule")
    if others:
        stage_mesh = mesh[others] if len(others) > 1 else mesh[others[0]]
    else:  # pipeline only: each stage is one rank
        stage_mesh = init_device_mesh(mesh.device_type, (p, 1), mesh_dim_names=(pp_axis, "dp"))["dp"]
        stage_plan = {"dp": "ddp", **({"rules": plan["rules"]} if "rules" in plan else {})}
    parsed = parse_plan(stage_plan, tuple(stage_mesh.mesh_dim_names))
    dp_axes = [i for i, a in enumerate(parsed.axes) if a.data_parallel]
    dp = math.prod(stage_mesh.shape[i] for i in dp_axes)
    batched = [x for x in example_inputs if isinstance(x, torch.Tensor) and x.ndim > 0]
    b = batched[0].shape[0] if batched else 0
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] != b:
            raise PlanError(f"input #{i} has batch size {x.shape[0]}, input #0 {b}: a pipeline splits every input "
                            "along dim 0 into micro-batches", where=f"example_inputs[{i}]")
    if b % dp:
        raise PlanError(f"batch size {b} cannot be split over {dp} data-parallel ranks", where="example_inputs",
                        fix=f"use a batch that is a multiple of {dp}")
    m = opts.microbatches or default_microbatches(opts, p, b // dp)
    where = f"plan[{pp_axis!r}]['microbatches']"
    if m < p:
        raise PlanError(f"{m} micro-batch(es) cannot fill a {p}-stage pipeline: every stage but one would idle "
                        "the whole step", where=where, fix=f"use microbatches >= {p}")
    if b % (m * dp):
        raise PlanError(f"the batch ({b}) does not split into {m} micro-batches x {dp} data-parallel ranks",
                        where=where, fix=f"use a batch that is a multiple of {m * dp}, or microbatches dividing "
                        f"{b // dp}")
    try:
        sched = interleaved(p, m, opts.virtual) if opts.schedule == "interleaved" else SCHEDULES[opts.schedule](p, m)
        validate(sched)
    except ScheduleError as e:
        raise PlanError(str(e), where=f"plan[{pp_axis!r}]") from e
    n_stages = p * opts.virtual
    micro = tuple(x[: x.shape[0] // m] if isinstance(x, torch.Tensor) and x.ndim > 0 else x for x in example_inputs)
    t0 = time.perf_counter()
    if progress:
        progress(f"capture (whole model, micro-batch of {b // m}) and split into {n_stages} stages")
    gm = capture_whole(model, micro, loss_fn, compute_dtype, lower=lower)
    lowered = dict(gm.meta.get("autopar_lowered", {}))
    device = next((q.device for q in model.parameters()), torch.device("cpu"))
    specs = split_stages(gm, n_stages, opts.split, device=device)
    capture_s = time.perf_counter() - t0
    pp_rank = mesh.get_local_rank(pp_axis)
    wanted = range(n_stages) if stages == "all" else [s for s in range(n_stages) if sched.rank_of(s) == pp_rank]
    ids = _tensor_names(model)
    compiled = []
    for s in wanted:
        spec = specs[s]
        params = {ids[id(getattr(spec.gm, t))][1]: getattr(spec.gm, t) for t in spec.params}
        placed = place_parameters(parsed, params, tuple(stage_mesh.shape))
        for axis, pnames in placed.unplaced.items():
            warnings.warn(f"autopar: the '{axis}' strategy did not recognise {len(pnames)} parameter(s) of stage {s}, "
                          f"replicated on '{axis}': {', '.join(pnames)} (place them with plan['rules'])", stacklevel=3)
        ctx = Context(stage_mesh, parsed, placed, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                      recompute=recompute, accumulate=m)
        ctx.loss_scale = loss_scale if compute_dtype == torch.float16 else None
        ctx.progress = progress
        ctx.boundary = (spec.in_batched, spec.out_batched)
        ctx.stage = s
        ctx.lowered = lowered
        if device.type == "meta":
            ctx.device = device
        ctx.timings["capture"] = capture_s
        t1 = time.perf_counter()
        if progress:
            progress(f"stage {s}: capture joint")
        program = capture_stage(spec.gm, spec.example, model, spec.is_last)
        ctx.timings["capture_stage"] = time.perf_counter() - t1
        ctx.sync_grads = False
        program = run_passes(program, ctx, skip=skip_passes, debug=debug, label=f"stage {s} ")
        sync = grad_sync_program(program, ctx, debug=debug)
        ctx.sync_grads = True
        gmod = program.local
        parts = partition(gmod, program.outputs)
        sp = StageProgram(spec, ctx, program, sync, parts, list(params))
        sp.ph_names = [n.name for n in gmod.graph.nodes if n.op == "placeholder"]
        out = next(n for n in gmod.graph.nodes if n.op == "output")
        sp.out_names = [o.name if isinstance(o, fx.Node) else None for o in out.args[0]]
        sp.ph_vals = {n.name: n.meta["val"] for n in gmod.graph.nodes if n.op == "placeholder"}
        sp.saved_bytes = _saved_bytes(gmod, program.inputs, parts)
        sp.saved_after_i = _saved_bytes(gmod, program.inputs, parts, after="I")
        ctx.timings["total"] = time.perf_counter() - t0
        compiled.append(sp)
    return PipelineModule(model, mesh, pp_axis, stage_mesh, sched, opts, specs, compiled, example_inputs, inputs,
                          stage_plan=parsed)


# ------------------------------------------------------------------------------------ runtime
class PipelineModule:
    """The compiled pipeline on one rank: the stages it holds, the schedule, the executor.

    ``parameters()`` are this rank's stages' parameters (DTensors on the stage's sub-mesh); the
    other stages' parameters are dropped from the module (meta tensors), so an unchanged
    optimizer built on ``parameters()`` steps what this rank owns. ``train_step`` runs the
    schedule over the global batch and returns the global-batch loss on every rank."""

    def __init__(self, module, mesh, pp_axis, stage_mesh, sched, opts, specs, stages, example_inputs, inputs,
                 stage_plan):
        from autopar.runtime import CommCounter

        self.module = module
        self.mesh = mesh
        self.pp_axis = pp_axis
        self.stage_mesh = stage_mesh
        self.schedule = sched
        self.options = opts
        self.microbatches = sched.microbatches
        self.specs = specs
        self.stages = {sp.spec.index: sp for sp in stages}  # compiled here (all of them when planning)
        self.local = {s: sp for s, sp in self.stages.items() if sched.rank_of(s) == mesh.get_local_rank(pp_axis)}
        self.ctx = stages[0].ctx  # the sub-mesh's view (every stage of this rank shares it)
        self.plan = stage_plan
        self.input_mode = inputs
        self.example_shapes = [(tuple(x.shape), x.dtype) for x in example_inputs]
        self.counter = CommCounter()
        self.pp_rank = mesh.get_local_rank(pp_axis)
        self.pp_size = sched.ranks
        self.pp_group = mesh.get_group(pp_axis)
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        # fp16: dynamic loss scaling (as ParallelModule: torch.amp.GradScaler's constants); the scale
        # enters as the last stage's tangent, the overflow check is one all-reduce over the world
        ls = self.ctx.loss_scale
        self.loss_scale = (65536.0 if ls == "dynamic" else float(ls)) if ls else None
        self._growth_tracker = 0
        self.skipped_steps = 0
        self.steps = 0
        self.accumulate = 1
        self.timeline: list[tuple[float, float, tuple]] = []  # last step, this rank: (start once its inputs arrived, end, action)
        self.in_flight: dict = {}
        self.recv_wait: list[float] = []
        # seconds a receive may wait before the step fails (a peer that died must not hang the rest)
        self.p2p_timeout = float(os.environ.get("AUTOPAR_P2P_TIMEOUT", "600"))
        self._edges = {}
        for spec in specs:
            for k, src in enumerate(spec.inputs):
                if src[0] == "stage":
                    self._edges[(spec.index, k)] = len(self._edges)
        # the tags of input gradients a consumer stage does not produce (no gradient for that input)
        self._no_grad = {self._tag(spec.index, k, mb, True) for spec in specs for k, src in enumerate(spec.inputs)
                         if src[0] == "stage" and not spec.example[k].requires_grad
                         for mb in range(self.microbatches)}
        self._distribute()
        from autopar.runtime import instrument

        for sp in self.stages.values():
            for part in sp.parts.values():
                if part.gm is not None:
                    instrument(part.gm, self.counter, sp.ctx)
            instrument(sp.sync.local, self.counter, sp.ctx)

    # ------------------------------------------------------------ parameters
    def _distribute(self):
        from torch.distributed.tensor import distribute_tensor

        owned = {}
        for sp in self.stages.values():
            for name in sp.param_names:
                owned[name] = sp.ctx.placed.placements[name]
        self._owned = {n for sp in self.local.values() for n in sp.param_names}
        for full_name, p in list(self.module.named_parameters()):
            mod_name, _, attr = full_name.rpartition(".")
            mod = self.module.get_submodule(mod_name) if mod_name else self.module
            if full_name in owned:
                dt = distribute_tensor(p.detach().to(self.ctx.device), self.stage_mesh, owned[full_name])
                mod.register_parameter(attr, nn.Parameter(dt, requires_grad=p.requires_grad))
            else:  # another rank's stage: not held here
                mod.register_parameter(attr, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                          requires_grad=False))

    def named_parameters(self):
        return ((n, p) for n, p in self.module.named_parameters() if n in self._owned)

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def state_dict(self):
        return {k: v for k, v in self.module.state_dict().items() if k in self._owned}

    def __call__(self, *inputs):
        raise InputError("the eval forward (pm(x)) is not built for pipelined programs yet",
                         where="PipelineModule.__call__",
                         fix="compile the model without the pipeline axis for evaluation, or use train_step's loss")

    forward = __call__

    def track_memory(self, on: bool = True):
        raise InputError("memory tracking by category is not built for pipelined programs yet",
                         where="PipelineModule.track_memory",
                         fix="read pm.in_flight (activations held, measured every step) and `autopar plan` "
                         "(predicted per-rank memory)")

    # ------------------------------------------------------------ inputs
    def _local_inputs(self, inputs, n_expected):
        from autopar.runtime import ParallelModule

        return ParallelModule._local_inputs(self, inputs, n_expected)

    # ------------------------------------------------------------ the executor
    def _tag(self, stage: int, k: int, mb: int, backward: bool) -> int:
        return (self._edges[(stage, k)] * self.microbatches + mb) * 2 + int(backward)

    def _send(self, t: torch.Tensor, stage_to: int, tag: int):
        dst = self.pp_ranks[self.schedule.rank_of(stage_to)]
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        self.counter.calls[("send", self.pp_axis)] += 1
        self.counter.payload[("send", self.pp_axis)] += nbytes
        self.counter.wire[("send", self.pp_axis)] += nbytes
        self._pending.append((dist.isend(t, dst=dst, tag=tag), t))

    def _incoming(self, action) -> list[tuple]:
        """(value metadata, producing stage, tag) of what ``action`` receives from other ranks."""
        kind, s, mb = action
        sp = self.stages[s]
        out = []
        if kind == "F":
            for (role, what), name in zip(sp.program.inputs, sp.ph_names):
                src = sp.spec.inputs[what] if role == "input" else None
                if src is not None and src[0] == "stage" and self.schedule.rank_of(src[1]) != self.pp_rank:
                    out.append((sp.ph_vals[name], src[1], self._tag(s, what, mb, False)))
        elif kind in ("B", "I") and not sp.spec.is_last:
            for (role, what), name in zip(sp.program.inputs, sp.ph_names):
                if role != "tangent":
                    continue
                for t, k in sp.spec.consumers[what]:
                    tag = self._tag(t, k, mb, True)
                    if tag not in self._no_grad and self.schedule.rank_of(t) != self.pp_rank:
                        out.append((sp.ph_vals[name], t, tag))
        return out

    def _post_recvs(self, action):
        """Post ``action``'s receives now (irecv), so the transfers run while this rank computes."""
        for like, stage_from, tag in self._incoming(action):
            self._post_recv(like, stage_from, tag)

    def _post_recv(self, like, stage_from: int, tag: int):
        if tag not in self._posted:
            buf = torch.empty(like.shape, dtype=like.dtype, device=self.ctx.device)
            src = self.pp_ranks[self.schedule.rank_of(stage_from)]
            self._posted[tag] = (dist.irecv(buf, src=src, tag=tag), buf)

    def _recv(self, like, stage_from: int, tag: int) -> torch.Tensor:
        self._post_recv(like, stage_from, tag)
        work, buf = self._posted.pop(tag)
        t0 = time.perf_counter()
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.p2p_timeout))
        except RuntimeError as e:  # a peer that failed (or never sends) must not hang this rank
            src = self.pp_ranks[self.schedule.rank_of(stage_from)]
            raise RuntimeError(
                f"autopar pipeline: rank {dist.get_rank()} waited {self.p2p_timeout:g}s for a transfer from stage "
                f"{stage_from} (rank {src}, tag {tag}) that never came: that rank probably failed; its own "
                f"error says why (raise the limit with AUTOPAR_P2P_TIMEOUT=seconds if a step is that slow)") from e
        self._waited += time.perf_counter() - t0
        return buf

    def _deliver(self, value: torch.Tensor, stage_from: int, stage_to: int, tag: int):
        if self.schedule.rank_of(stage_to) == self.pp_rank:
            self._mailbox[tag] = value
        else:
            self._send(value, stage_to, tag)

    def _collect(self, like, stage_from: int, tag: int) -> torch.Tensor:
        if self.schedule.rank_of(stage_from) == self.pp_rank:
            return self._mailbox.pop(tag)
        return self._recv(like, stage_from, tag)

    def _run_part(self, sp: StageProgram, name: str, env: dict):
        part = sp.parts[name]
        if part.gm is None:
            return
        with torch.no_grad():
            outs = part.gm(*[env[a] if a in env else self._shared[sp.spec.index][a] for a in part.args])
        env.update(zip(part.outs, outs))

    def _keep_only(self, sp: StageProgram, env: dict, later: list[str]):
        need = set()
        for name in later:
            need.update(sp.parts[name].args)
        need.update(o for (kind, _), o in zip(sp.program.outputs, sp.out_names) if o is not None and kind == "grad")
        for k in list(env):
            if k not in need:
                del env[k]

    def _forward(self, s: int, mb: int, micro):
        sp = self.stages[s]
        env = {}
        for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
            if kind != "input":
                continue
            src = sp.spec.inputs[what]
            if src[0] == "user":
                env[name] = micro[mb][src[1]]
            else:
                env[name] = self._collect(sp.ph_vals[name], src[1], self._tag(s, what, mb, False))
        self._ready = time.perf_counter()  # inputs are here: compute starts
        self._run_part(sp, "F", env)
        for (kind, what), o in zip(sp.program.outputs, sp.out_names):
            if kind == "loss":
                self._losses.append(env[o] if o in env else self._shared[s][o])
            elif kind == "act":
                value = env[o] if o in env else self._shared[s][o]
                for t, k in sp.spec.consumers[what]:
                    self._deliver(value, s, t, self._tag(t, k, mb, False))
        self._keep_only(sp, env, ["I", "W"])
        self._env[(s, mb)] = env

    def _input_grad(self, s: int, mb: int):
        sp = self.stages[s]
        env = self._env[(s, mb)]
        for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
            if kind != "tangent":
                continue
            like = sp.ph_vals[name]
            if sp.spec.is_last:  # d(global loss)/d(micro-batch loss), times the fp16 loss scale
                env[name] = torch.full(like.shape, (self.loss_scale or 1.0) / self.microbatches, dtype=like.dtype,
                                       device=self.ctx.device)
                continue
            total = None
            for t, k in sp.spec.consumers[what]:
                tag = self._tag(t, k, mb, True)
                if tag not in self._no_grad:
                    g = self._collect(like, t, tag)
                    total = g if total is None else total + g
            env[name] = total if total is not None else torch.zeros(like.shape, dtype=like.dtype,
                                                                    device=self.ctx.device)
        self._ready = time.perf_counter()
        self._run_part(sp, "I", env)
        for (kind, what), o in zip(sp.program.outputs, sp.out_names):
            if kind == "input_grad" and o is not None:
                src = sp.spec.inputs[what]
                if src[0] == "stage":
                    value = env[o] if o in env else self._shared[s][o]
                    self._deliver(value, s, src[1], self._tag(s, what, mb, True))
        self._keep_only(sp, env, ["W"])

    def _weight_grad(self, s: int, mb: int):
        sp = self.stages[s]
        env = self._env.pop((s, mb))
        self._run_part(sp, "W", env)
        acc = self._acc[s]
        for (kind, what), o in zip(sp.program.outputs, sp.out_names):
            if kind == "grad" and o is not None:
                g = env[o] if o in env else self._shared[s][o]
                acc[what] = g.clone() if what not in acc else acc[what].add_(g)

    def train_step(self, *inputs) -> torch.Tensor:
        """Run the schedule on the global batch; gradients land on ``parameters()``; returns the
        global-batch loss (the mean of the micro-batch losses) on every rank."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        local = self._local_inputs(inputs, len(self.example_shapes))
        m = self.microbatches
        micro = [[torch.chunk(x, m, dim=0)[i] if x.ndim > 0 else x for x in local] for i in range(m)]
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        self._shared = {}
        for s, sp in self.local.items():
            vals = {}
            for (kind, what), name in zip(sp.program.inputs, sp.ph_names):
                if kind == "param":
                    vals[name] = params[what].to_local()
                elif kind == "buffer":
                    vals[name] = buffers.get(what, sp.program.buffers.get(what)).to(self.ctx.device)
            self._shared[s] = vals
        self._env, self._mailbox, self._pending, self._losses = {}, {}, [], []
        self._acc = {s: {} for s in self.local}
        events, waits = [], []
        live, peak, peak_bytes = 0, 0, 0
        state = {t.untyped_storage().data_ptr() for vals in self._shared.values() for t in vals.values()
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        actions = self.schedule.actions[self.pp_rank]
        self._posted = {}
        for i, (kind, s, mb) in enumerate(actions):
            self._post_recvs((kind, s, mb))
            if i + 1 < len(actions):  # one action ahead: its inputs arrive while this one computes
                self._post_recvs(actions[i + 1])
            self._ready = time.perf_counter()  # (F, B and I move it past their receives)
            self._waited = 0.0
            if kind == "F":
                self._forward(s, mb, micro)
                live += 1
            elif kind in ("B", "I"):
                self._input_grad(s, mb)
                if kind == "B":
                    self._weight_grad(s, mb)
                    live -= 1
            elif kind == "W":
                self._weight_grad(s, mb)
                live -= 1
            events.append((self._ready, time.perf_counter(), (kind, s, mb)))
            waits.append(self._waited)
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]  # release sent buffers
            peak = max(peak, live)
            peak_bytes = max(peak_bytes, _held_bytes(self._env.values(), state))
        for work, _ in self._pending:  # (a peer that died cannot take them: fail, do not hang)
            work.wait(timeout=datetime.timedelta(seconds=self.p2p_timeout))
        self._pending = []
        # the gradients, summed over micro-batches, synchronised once per step
        synced = []
        for s, sp in self.local.items():
            acc = self._acc[s]
            names = [what for _, what in sp.sync.inputs]
            outs = sp.sync.local(*[acc[n].contiguous() for n in names]) if names else []
            synced += list(zip([name for _, name in sp.sync.outputs], outs))
        from autopar.runtime import ParallelModule

        scale = self.loss_scale
        if scale is None or ParallelModule._unscale(self, [g for _, g in synced], scale):
            for name, g in synced:
                p = params[name]
                d = DTensor(g.detach(), DTensorSpec(self.stage_mesh, p.placements,
                                                    TensorMeta(p.shape, p.stride(), p.dtype)), requires_grad=False)
                p.grad = d if p.grad is None else p.grad + d  # (an overflowing fp16 step leaves .grad as it was)
        loss = (sum(self._losses) / m).detach().reshape(()) if self._losses else torch.zeros((), device=self.ctx.device)
        loss = loss.float()
        if self.pp_size > 1:
            dist.broadcast(loss, src=self.pp_ranks[self.schedule.rank_of(len(self.specs) - 1)], group=self.pp_group,
                           async_op=True).wait(timeout=datetime.timedelta(seconds=self.p2p_timeout))
            self.counter.calls[("broadcast", self.pp_axis)] += 1
            self.counter.payload[("broadcast", self.pp_axis)] += 4
            if self.pp_rank == self.schedule.rank_of(len(self.specs) - 1):
                self.counter.wire[("broadcast", self.pp_axis)] += 4 * (self.pp_size - 1)
        self.timeline = events
        self.recv_wait = waits  # per action: seconds blocked receiving its inputs / output gradients
        self.in_flight = {"peak_microbatches": peak, "peak_bytes": peak_bytes}
        self.steps += 1
        assert not self._posted, "a posted receive was never used"
        del self._env, self._mailbox, self._acc, self._shared, self._posted
        return loss

    # ------------------------------------------------------------ visibility
    def gather_timeline(self) -> list[list[tuple[float, float, tuple]]]:
        """The last step's action timings of every rank on this rank's pipeline (same non-pp
        coordinates), in seconds from the earliest start; call on every rank."""
        out = [None] * self.pp_size
        dist.all_gather_object(out, (self.timeline, self.recv_wait), group=self.pp_group)
        t0 = min(ev[0][0] for ev, _ in out if ev)
        self.gathered_recv_wait = [sum(w) for _, w in out]
        return [[(a - t0, b - t0, act) for a, b, act in ev] for ev, _ in out]

    def collectives(self):
        """Every collective (and point-to-point transfer) this rank performs per step."""
        from autopar.ir import CommRecord

        recs = []
        for s, sp in sorted(self.local.items()):
            recs += StageView(self, sp).collectives()  # its program's collectives x M + its gradient sync
            node_of = {n.name: n for n in sp.program.local.graph.nodes}
            for (kind, what), o in zip(sp.program.outputs, sp.out_names):
                if o is None:
                    continue
                if kind == "act":
                    for t, _ in sp.spec.consumers[what]:
                        if self.schedule.rank_of(t) != self.pp_rank:
                            recs += [CommRecord("send", self.pp_axis, 2, _val_bytes(node_of[o].meta["val"]),
                                                f"activation {what} of stage {s} to stage {t}", sp.spec.modules[1],
                                                "forward")] * self.microbatches
                elif kind == "input_grad":
                    src = sp.spec.inputs[what]
                    if src[0] == "stage" and self.schedule.rank_of(src[1]) != self.pp_rank:
                        recs += [CommRecord("send", self.pp_axis, 2, _val_bytes(node_of[o].meta["val"]),
                                            f"gradient of stage {s}'s input {what} back to stage {src[1]}",
                                            sp.spec.modules[0], "backward")] * self.microbatches
        if self.loss_scale is not None and dist.get_world_size() > 1:
            recs.append(CommRecord("all_reduce", "world", dist.get_world_size(), 4,
                                   "fp16 loss scaling: did any rank's gradients overflow?", "", "backward"))
        if self.pp_size > 1 and self.pp_rank == self.schedule.rank_of(len(self.specs) - 1):
            recs.append(CommRecord("broadcast", self.pp_axis, self.pp_size, 4, "the global-batch loss to every stage",
                                   "", "backward"))
        return recs

    def predicted_bytes(self) -> dict[str, float]:
        from autopar.ir import bytes_by_collective

        out = bytes_by_collective(self.collectives())
        key = f"broadcast@{self.pp_axis}"
        if key in out:  # the root sends the loss to each of the other P - 1 ranks
            out[key] *= self.pp_size - 1
        elif self.pp_size > 1:
            out[key] = 0.0  # (the counter records the receiving side's call with 0 bytes)
        return out

    def predicted_in_flight(self) -> dict:
        """What this rank's action list holds at most: (stage, micro-batch) activation sets and
        their bytes (each stage's ``saved_bytes``), for comparison with ``in_flight``."""
        live, peak, held, peak_bytes = 0, 0, 0, 0
        for kind, s, _ in self.schedule.actions[self.pp_rank]:
            sp = self.stages[s]
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

    def describe_stages(self) -> list[dict]:
        rows = []
        for spec in self.specs:
            rows.append({"stage": spec.index, "rank": self.schedule.rank_of(spec.index), "first": spec.modules[0],
                         "last": spec.modules[1], "parameters": spec.param_bytes})
        return rows

    def report(self, optimizer=None) -> str:
        head = (f"autopar pipeline on mesh {dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))}: "
                f"{self.schedule.name}, {len(self.specs)} stages on {self.pp_size} ranks, {self.microbatches} "
                f"micro-batches; inside each stage: {self.plan.describe()}")
        lines = [head, "", "stages:"]
        for r in self.describe_stages():
            lines.append(f"  stage {r['stage']} (pp rank {r['rank']}): {r['first']} .. {r['last']}, "
                         f"{r['parameters']:,} B of parameters")
        lines.append("")
        lines.append("predicted bytes sent per rank per step: " + ", ".join(
            f"{k}={v:,.0f}" for k, v in sorted(self.predicted_bytes().items())))
        if self.counter.calls:
            lines.append("measured (counted, since start): " + ", ".join(
                f"{k}={v['wire_bytes']:,.0f}" for k, v in self.counter.summary().items()))
        if self.in_flight:
            lines.append(f"saved activations in flight (last step): {self.in_flight['peak_microbatches']} "
                         f"(stage, micro-batch) sets, {self.in_flight['peak_bytes']:,} B")
        return "\n".join(lines)


class StageView:
    """One compiled stage seen the way ``autopar dump`` / ``explain`` read a ParallelModule: its
    joint per-rank program, its gradient sync program, its context and parameters."""

    def __init__(self, pm: PipelineModule, sp: StageProgram):
        self.pipeline, self.stage = pm, sp
        self.program, self.sync_program, self.ctx = sp.program, sp.sync, sp.ctx
        self.example_shapes = pm.example_shapes
        self.accumulate = pm.microbatches
        self.module = self

    def named_parameters(self):
        mine = set(self.stage.param_names)
        return ((n, p) for n, p in self.pipeline.module.named_parameters() if n in mine)

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def part_of(self) -> dict[str, str]:
        """Node name of the joint per-rank program -> "F" | "I" | "W" (the part that runs it)."""
        out = {}
        for name, part in self.stage.parts.items():
            if part.gm is not None:
                for n in part.gm.graph.nodes:
                    if n.op == "call_function":
                        out[n.name] = name
        return out

    def collectives(self):
        per_mb = [n.meta["autopar_comm"] for n in self.program.local.graph.nodes if "autopar_comm" in n.meta]
        return per_mb * self.accumulate + [n.meta["autopar_comm"] for n in self.sync_program.local.graph.nodes
                                           if "autopar_comm" in n.meta]


def _held_bytes(envs, exclude=()) -> int:
    """Bytes of the distinct storages the saved values use; views of parameters/buffers
    (``exclude``: their storages) are not activations."""
    seen, total = set(exclude), 0
    for env in envs:
        for v in env.values():
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
    return total
