"""The cost model: what a per-rank program will hold, send, compute and take, before it runs.

Everything here reads the per-rank program (``program.local``, traced by ``localize`` with fake
tensors of local shapes), so it works on meta tensors over a fake process group for a mesh of
any size. The runtime measures the same quantities (``ParallelModule.memory_report``, the
collective counter); tests compare the two.

- **Memory** (``predict_memory``): persistent state from the parameters' storage placements
  (parameter shards, their fp32 gradients, the optimizer's per-parameter state), plus the
  program's peak by liveness: every value is alive from the node that makes it to its last use
  (an unused value dies at once), views share their base's storage (the fake tensors recorded
  at trace time carry the real aliasing), and each storage counts once. Categories as the
  tracker's (autopar/runtime/memory.py): parameter copies, gradients in flight, activations.
- **Communication**: the CommRecords on the collective nodes (ring bytes per rank, per kind and
  mesh axis), timed α-β per axis: ``alpha + wire_bytes / bandwidth``. An axis whose ranks fit
  in one node (the mesh's last axes are the fastest-varying ranks) uses the intra-node link,
  otherwise the inter-node one.
- **Compute**: FLOPs per node from torch's flop-counter formulas (matmuls, attention), timed by
  a roofline: ``max(flops / (peak * efficiency), bytes / memory_bandwidth)``; ops without FLOPs
  are memory-bound (bytes read + written). Views move no data: run eagerly on a CPU each costs its
  dispatch, on a GPU or compiled nothing. A formula that raises, or a matmul-like op with none
  (autopar/analysis/ops.py, the one FLOP counter), makes the FLOPs unknown, never 0: the estimate lists
  them (``TimeEstimate.unknown_flops``) and ``autopar plan`` shows "unknown".
- **Compiled programs** (``compile(inductor=True)``, ``autopar plan --inductor``): the buffers
  Inductor allocates (autopar/analysis/inductor_model.py: its decompositions, which elementwise
  values it stores or recomputes, its scheduler's fusions): the liveness walk runs over those
  alone and the roofline charges each fused kernel the bytes it reads and writes (``Fusion``).
- **Time** (``simulate``): one compute stream and one communication stream. A collective starts
  when its input is ready and the link is free; ``wait_tensor`` stalls compute until it is done.
  Communication hidden under compute is what the program's ordering buys.

Device figures are in ``DEVICES`` (autopar/analysis/devices.py); the GPU rows are vendor peak figures, stated as assumptions
(dense, no sparsity) with an achievable-fraction factor; the CPU row was calibrated on this
project's development machine (``autopar calibrate`` measures yours and writes a JSON file that
``--devices`` reads).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from autopar.analysis import inductor_model as IM
from autopar.analysis.devices import DEVICES, Device, get_device, load_devices  # noqa: F401 (re-exported)
from autopar.analysis.liveness import ProgramMemory, _storages, program_memory  # noqa: F401 (re-exported)
from autopar.ir import CommRecord, info
from autopar.analysis.ops import UnknownFlops, is_view as _is_view, node_flops, val_bytes

aten = torch.ops.aten


# ------------------------------------------------------------------------------------ memory
OPTIMIZER_STATE = {"adamw": 2, "adam": 2, "adamw-fused": 2, "adam-fused": 2, "sgd": 0, "momentum": 1,
                   "none": 0}  # fp32 tensors per parameter
# fp32 tensor reads + writes per parameter element of one optimizer step as torch implements it
# (torch/optim/adam.py, the same for its foreach and for-loop paths, the defaults on a GPU and a
# CPU): AdamW's weight decay (r1 w1), lerp of exp_avg (r2 w1), exp_avg_sq's mul (r1 w1) and
# addcmul (r2 w1), sqrt into a new tensor (r1 w1), its division and eps (r1 w1 each), addcdiv into
# the parameter (r3 w1): 20. ``fused=True`` (the "-fused" names) reads each input and writes each
# output once: 7. Plain SGD: param.add_(grad) (r2 w1); with momentum: buf.mul_ (2), buf.add_(grad)
# (3), param.add_(buf) (3). Measured 2026-11-27 on an H100 (benchmarks/results/step-profile-*):
# torch.optim.AdamW() on 0.5B fp32 parameters 16.3 ms, where 7 accesses at the HBM rate predicted 4.3.
OPTIMIZER_ACCESSES = {"adamw": 20, "adam": 20, "adamw-fused": 7, "adam-fused": 7, "sgd": 3, "momentum": 8,
                      "none": 0}


def persistent_memory(pm, optimizer: str = "adamw") -> dict[str, int]:
    """Bytes of parameter shards, their gradients (fp32 master gradients, as stored in .grad) and
    optimizer state on this rank, from the storage placements."""
    if optimizer not in OPTIMIZER_STATE:
        from autopar.errors import PlanError

        raise PlanError(f"unknown optimizer {optimizer!r}", where="--optimizer",
                        fix=f"use one of {list(OPTIMIZER_STATE)}")
    from torch.distributed.tensor import DTensor

    params = grads = 0
    for p in pm.parameters():  # a pipeline rank: only its own stages' parameters
        local = p._local_tensor if isinstance(p, DTensor) else p
        nbytes = local.numel() * local.element_size()
        params += nbytes
        grads += nbytes if p.requires_grad else 0
    state = params * OPTIMIZER_STATE[optimizer]
    return {"parameters": params, "gradients": grads, "optimizer_state": state}


def predict_memory(pm, optimizer: str = "adamw", fused: bool | None = None, device: str | None = None) -> dict:
    """Predicted per-rank bytes, keyed like ``ParallelModule.memory_report``. ``fused``: the
    programs' buffers as Inductor allocates them (autopar/analysis/inductor_model.py; default:
    whether ``pm`` was compiled with ``inductor=True``), on ``device`` ("gpu" or "cpu": Inductor's
    thresholds; default: where ``pm`` runs). Pipelines: op by op."""
    if pm.pipelined:
        return predict_pipeline_memory(pm, optimizer)
    if fused is None:
        fused = getattr(pm, "inductor", None) is not None
    state = persistent_memory(pm, optimizer)
    joint = program_liveness(pm.program, fused, device or _device_kind(pm))
    sync = (program_liveness(pm.sync_program, fused, device or _device_kind(pm))
            if pm.sync_program is not None else ProgramMemory())
    # accumulate=K: from the second micro-batch on, the runtime holds the gradient sums (one per
    # gradient the program returns, as it returns them) while the joint program runs
    acc = accumulator_bytes(pm.program) if pm.accumulate > 1 else 0
    m = joint if joint.peak + acc >= sync.peak else sync  # the program during which the step peaks
    out = {**state, "program_peak": max(joint.peak + acc, sync.peak), "accumulators": acc,
           # the programs' own values alone (what ProgramMeter measures per run: ``tensor_peak``)
           "tensor_peak": max(joint.peak, sync.peak),
           **{f"peak_{k}": v for k, v in m.at_peak.items()}, **{f"max_{k}": v for k, v in m.max_by.items()}}
    out["step_peak"] = state["parameters"] + state["optimizer_state"] + out["program_peak"]
    out["peak_node"] = m.peak_node
    out["alive_at_peak"] = m.alive_at_peak
    return out


def program_liveness(program, fused: bool = False, device: str = "gpu") -> ProgramMemory:
    """One per-rank program's liveness: op by op (``program_memory``) or over the buffers Inductor
    allocates when it compiles the program (``fused``; ``device``: "gpu" or "cpu")."""
    if fused:
        return IM.memory(program.local, program.inputs, program.outputs, device)
    return program_memory(program.local, program.inputs, program.outputs)


def _device_kind(pm) -> str:
    dev = getattr(getattr(pm, "executor", None), "device", None)
    return "cpu" if dev is not None and torch.device(dev).type == "cpu" else "gpu"


def accumulator_bytes(program) -> int:
    """Bytes of the gradients one run of ``program`` returns (what ``accumulate=K`` sums them into)."""
    out = next(n for n in program.local.graph.nodes if n.op == "output")
    return sum(val_bytes(o.meta["val"]) for o, (kind, _) in zip(out.args[0], program.outputs)
               if kind == "grad" and isinstance(o, fx.Node))


# ------------------------------------------------------------------------------------ compute
def _dtype_key(n: fx.Node) -> str:
    v = n.meta.get("val")
    t = v[0] if isinstance(v, (list, tuple)) and v else v
    dt = getattr(t, "dtype", torch.float32)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, "fp32")


def compute_seconds(n: fx.Node, dev: Device, flops: int, share: float = 1.0, fusion: "Fusion | None" = None) -> float:
    """Roofline time of one op; ``share`` >= 1 when ranks share a CPU's cores. With ``fusion``
    (the program compiled by Inductor), an op whose code Inductor generates costs the kernels
    charged to it (``Fusion``): none when it is computed inside its consumers."""
    if n.op != "call_function" or n.target is operator.getitem:
        return 0.0
    if _is_view(n.target):
        # eager on a CPU: the view's dispatch runs on the rank's core; on a GPU it launches no
        # kernel (its host cost hides under the queued kernels); compiled: index arithmetic
        return dev.op_overhead if dev.cores and fusion is None else 0.0
    if fusion is not None and n in fusion.generated:
        return sum(_kernel(dev, moved / dev.mem_bw * share) for moved in fusion.kernels.get(n, ()))
    moved = val_bytes(n.meta.get("val")) + sum(val_bytes(a.meta.get("val")) for a in n.all_input_nodes)
    # a memory-bound ATen kernel at the rate measured on such ops (Device.eager_bw); a product's
    # operands (cuBLAS, attention) stream at mem_bw
    t = moved / (dev.mem_bw if flops else (dev.eager_bw or dev.mem_bw))
    if flops:
        t = max(flops / (dev.flops[_dtype_key(n)] * dev.efficiency), t)
    return _kernel(dev, t * share)


def _kernel(dev: Device, t: float) -> float:
    if not dev.cores:
        # a GPU: kernels are launched asynchronously, so the host's launch cost hides under the
        # previous kernel; an op takes its kernel time or the launch gap, whichever is longer
        return max(t, dev.op_overhead)
    return t + dev.op_overhead  # a CPU: eager dispatch runs before the op, on the same core


@dataclass
class Fusion:
    """A program as Inductor compiles it (autopar/analysis/inductor_model.py ``plan``): the
    program's nodes whose code Inductor generates (``generated``: not the extern kernels, matmuls
    and attention, nor the ops left as calls), and the bytes of each kernel charged to one of them
    (``kernels``: the buffer it writes and the buffers its fused expression reads; an op computed
    inside its consumers has none)."""
    generated: set = field(default_factory=set)
    kernels: dict = field(default_factory=dict)  # program node -> [bytes read + written, per kernel]

    def bytes(self) -> int:
        return sum(sum(k) for k in self.kernels.values())


def fusion_of(gm: fx.GraphModule, device: str = "gpu") -> Fusion:
    """``gm``'s kernels as Inductor generates them on ``device`` ("gpu" or "cpu")."""
    b = IM.plan(gm, device)
    f = Fusion()
    extern_parents = {b.parent[x] for x in b.extern}
    f.generated = {p for x, p in b.parent.items() if x.op == "call_function" and x not in b.base} - extern_parents
    for k, _, moved, _ in b.kernels:
        f.kernels.setdefault(b.parent[k], []).append(moved)
    return f


# ------------------------------------------------------------------------------------ comm
def axis_links(axis_names, axis_sizes, dev: Device) -> dict[str, tuple[float, float]]:
    """(alpha, bandwidth) per mesh axis: intra-node if the axis and every faster-varying axis
    after it fit in one node."""
    out = {}
    inner = 1
    for name, size in reversed(list(zip(axis_names, axis_sizes))):
        inner *= size
        intra = inner <= dev.ranks_per_node
        out[name] = (dev.intra_alpha, dev.intra_bw) if intra else (dev.inter_alpha, dev.inter_bw)
    out["world"] = (dev.inter_alpha, dev.inter_bw) if math.prod(axis_sizes) > dev.ranks_per_node else (
        dev.intra_alpha, dev.intra_bw)
    return out


def comm_seconds(r: CommRecord, links) -> float:
    if r.group_size <= 1:
        return 0.0
    alpha, bw = links[r.axis]
    # a ring shift (ring attention) is one hop: one latency
    steps = 2 * (r.group_size - 1) if r.kind == "all_reduce" else 1 if r.kind == "shift" else r.group_size - 1
    return steps * alpha + r.wire_bytes / bw


@dataclass
class TimeEstimate:
    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    optimizer_s: float = 0.0
    flops: int = 0
    by_phase: dict[str, float] = field(default_factory=dict)
    comm_by_axis: dict[str, float] = field(default_factory=dict)
    exposed_by_axis: dict[str, float] = field(default_factory=dict)  # the compute stream's stalls per axis
    bubble: float | None = None  # pipelines: idle fraction of the simulated schedule
    stage_seconds: dict[str, list[float]] = field(default_factory=dict)  # pipelines: F/I/W per stage
    # ops whose FLOPs could not be computed (UnknownFlops messages): flops and the compute times
    # are then lower bounds (those ops timed by their bytes only)
    unknown_flops: list[str] = field(default_factory=list)


def core_share(dev: Device, world: int) -> float:
    """How many ranks share one core's worth of compute (1 on GPUs)."""
    if not dev.cores:
        return 1.0
    return max(1.0, min(world, dev.ranks_per_node) / dev.cores)


def oversubscribed(dev: Device, world: int) -> bool:
    """A CPU node running more ranks than it has cores (4 gloo ranks on this 2-core machine).
    There a collective is CPU work too, on the cores the ranks compute on, so it hides under no
    compute; and each ring step waits for the OS to run its peer. The cost model then runs every
    collective on the compute stream (``simulate(blocking=True)``) with ``dev.loaded_alpha`` per
    step, and a pipeline's idle ranks hand their cores to the busy ones
    (``predict_pipeline_time``). Measured against 21 plans on 4 ranks of this machine:
    benchmarks/planner_measured.py."""
    return bool(dev.cores) and min(world, dev.ranks_per_node) > dev.cores


def loaded_links(links: dict, dev: Device) -> dict:
    """``links`` with each step's latency the loaded one (``Device.loaded_alpha``) where measured."""
    if not dev.loaded_alpha:
        return links
    return {k: (dev.loaded_alpha, bw) for k, (_, bw) in links.items()}


def simulate(gm: fx.GraphModule, dev: Device, links, share: float = 1.0, fused: bool = False,
             blocking: bool = False) -> TimeEstimate:
    """One compute stream and one communication stream per mesh axis over the per-rank program,
    in program order: a collective starts once the compute before it has issued it and its
    axis's stream is free; a ``wait_tensor`` stalls the compute stream until its collective is
    done (that stall is the exposed communication, charged to the collective's axis).
    ``fused``: the program's compute compiled by Inductor (``compile(inductor=True)``), its
    kernels fused as Inductor fuses them (``Fusion``). ``blocking``: every collective runs on the compute
    stream where it is issued (an oversubscribed CPU: ``oversubscribed``)."""
    est = TimeEstimate()
    fusion = fusion_of(gm, dev.kind) if fused else None
    t_compute = 0.0
    t_link: dict[str, float] = {}
    done: dict[fx.Node, tuple[float, str]] = {}
    for n in gm.graph.nodes:
        rec = info(n).comm
        inside = rec is not None and "_c10d_functional" not in str(n.target)  # an op that communicates inside
        if rec is not None and (blocking or inside):  # (expert parallelism's): its transfers stall the compute stream
            dur = comm_seconds(rec, links)
            est.comm_s += dur
            est.comm_by_axis[rec.axis] = est.comm_by_axis.get(rec.axis, 0.0) + dur
            est.exposed_comm_s += dur
            est.exposed_by_axis[rec.axis] = est.exposed_by_axis.get(rec.axis, 0.0) + dur
            t_compute += dur
            rec = None
            if not inside:  # a collective, run where issued: no compute of its own
                continue
        if rec is not None:
            dur = comm_seconds(rec, links)
            start = max(t_compute, t_link.get(rec.axis, 0.0))
            t_link[rec.axis] = start + dur
            done[n] = (start + dur, rec.axis)
            est.comm_s += dur
            est.comm_by_axis[rec.axis] = est.comm_by_axis.get(rec.axis, 0.0) + dur
            continue
        if n.op == "call_function" and "wait_tensor" in str(n.target):
            end, axis = done.get(n.args[0], (0.0, ""))
            if end > t_compute:
                est.exposed_comm_s += end - t_compute
                est.exposed_by_axis[axis] = est.exposed_by_axis.get(axis, 0.0) + end - t_compute
                t_compute = end
            continue
        try:
            f = node_flops(n)
        except UnknownFlops as e:
            f = 0  # timed by its bytes; the estimate says it is a lower bound
            est.unknown_flops.append(str(e))
        dt = compute_seconds(n, dev, f, share, fusion)
        est.flops += f
        est.compute_s += dt
        phase = "backward" if n.meta.get("partitioner_tag") == "is_backward" else "forward"
        est.by_phase[phase] = est.by_phase.get(phase, 0.0) + dt
        t_compute += dt
    est.step_s = max([t_compute, *t_link.values()])
    return est


def _optimizer_bytes_per_element(optimizer: str) -> int:
    """fp32 bytes the optimizer step reads + writes per parameter element (``OPTIMIZER_ACCESSES``:
    torch's AdamW 20 x 4, fused 7 x 4)."""
    return OPTIMIZER_ACCESSES[optimizer] * 4


def optimizer_seconds(elems: int, optimizer: str, dev: Device, share: float = 1.0) -> float:
    """Seconds of the optimizer step over ``elems`` fp32 parameter elements on this rank: its
    accesses at the row's measured optimizer rate (``Device.optimizer_bw``: torch's default AdamW
    timed), else at mem_bw. A fused optimizer on a GPU streams its accesses in one kernel per
    group of tensors: mem_bw."""
    fused_gpu = optimizer.endswith("-fused") and dev.kind == "gpu"
    rate = dev.mem_bw if fused_gpu else (dev.optimizer_bw or dev.mem_bw)
    return elems * _optimizer_bytes_per_element(optimizer) / rate * share


def predict_time(pm, dev: Device, optimizer: str = "adamw", fused: bool | None = None) -> TimeEstimate:
    """Step time: the program(s) simulated, plus the optimizer step (memory-bound, on the shards).
    ``fused``: the per-rank programs as Inductor compiles them (default: whether ``pm`` was
    compiled with ``inductor=True``)."""
    if fused is None:
        fused = getattr(pm, "inductor", None) is not None
    if pm.pipelined:
        return predict_pipeline_time(pm, dev, optimizer, fused)
    links = axis_links(pm.ctx.axis_names, pm.ctx.axis_sizes, dev)
    share = core_share(dev, math.prod(pm.ctx.axis_sizes))
    blocking = oversubscribed(dev, math.prod(pm.ctx.axis_sizes))
    if blocking:
        links = loaded_links(links, dev)
    total = TimeEstimate()
    runs = [(pm.program, pm.ctx.accumulate)] + ([(pm.sync_program, 1)] if pm.sync_program is not None else [])
    for program, times in runs:
        e = simulate(program.local, dev, links, share, fused, blocking)
        for f in ("step_s", "compute_s", "comm_s", "exposed_comm_s", "flops"):
            setattr(total, f, getattr(total, f) + times * getattr(e, f))
        total.unknown_flops += [u for u in e.unknown_flops if u not in total.unknown_flops]
        for mine, theirs in ((total.by_phase, e.by_phase), (total.comm_by_axis, e.comm_by_axis),
                             (total.exposed_by_axis, e.exposed_by_axis)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + times * v
    from torch.distributed.tensor import DTensor

    elems = sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in pm.parameters())
    total.optimizer_s = optimizer_seconds(elems, optimizer, dev, share)
    total.step_s += total.optimizer_s
    return total


# ------------------------------------------------------------------------------------ pipelines
def _pipeline_links(pm, dev: Device):
    names = tuple(pm.mesh.mesh_dim_names)
    links = axis_links(names, tuple(pm.mesh.shape), dev)
    links.update({k: v for k, v in axis_links(pm.ctx.axis_names, pm.ctx.axis_sizes, dev).items() if k not in names})
    return links


def predict_pipeline_memory(pm, optimizer: str = "adamw") -> dict:
    """A pipeline rank: its stages' persistent state, plus the most its action list holds at once,
    walked action by action as the executor runs it: the saved activations of the micro-batches
    in flight (each stage's saved bytes per micro-batch), the gradient sums of each stage from its
    first backward on (the executor's accumulators), and the running action's transient beyond its
    own saved values (liveness over the stage's joint per-rank program); then the gradient sync
    on the sums."""
    state = persistent_memory(pm, optimizer)
    flight = pm.predicted_in_flight()
    trans, acc, mem, sync_peak = {}, {}, {}, {}
    for s, sp in pm.local.items():
        mem[s], trans[s], acc[s], sync = stage_memory(sp)
        if sync is not None:
            sync_peak[s] = sync.peak
    once = sum(sp.prologue_bytes for sp in pm.local.values())  # the prologues' outputs: the whole schedule
    saved = {s: (sp.saved_bytes, sp.saved_after_i) for s, sp in pm.stages.items()}
    peak, at_stage, sync = _pipeline_peak(pm.schedule.actions[pm.pp_rank], saved, trans, acc, sync_peak, once)
    total_acc = sum(acc.values())
    m = mem[at_stage] if at_stage is not None else ProgramMemory()
    best = max(0, peak - flight["peak_bytes"] - total_acc - once)
    at = {k: v * trans.get(at_stage, 0) / max(1, sum(m.at_peak.values())) for k, v in m.at_peak.items()}
    at["activations"] = at.get("activations", 0) + flight["peak_bytes"]
    at["grads_in_flight"] = at.get("grads_in_flight", 0) + total_acc
    at["param_copies"] = at.get("param_copies", 0) + once
    program_peak = max(peak, sync)
    out = {**state, "program_peak": program_peak, **{f"peak_{k}": int(v) for k, v in at.items()},
           **{f"max_{k}": int(v) for k, v in at.items()}, "in_flight_bytes": flight["peak_bytes"],
           "in_flight_microbatches": flight["peak_microbatches"], "transient_bytes": best,
           "accumulators": total_acc, "prologue_bytes": once}
    out["model_states_peak"] = state["parameters"] + state["optimizer_state"]
    out["step_peak"] = state["parameters"] + state["optimizer_state"] + program_peak
    out["peak_node"] = f"stage {at_stage}: {m.peak_node}" if at_stage is not None else ""
    out["alive_at_peak"] = m.alive_at_peak
    return out


def stage_memory(sp) -> tuple[ProgramMemory, int, int, ProgramMemory | None]:
    """One of this rank's pipeline stages: its joint program's liveness (the prologue's outputs
    held outside, counted once for the schedule, as the executor holds them), the transient
    beyond its saved values, its gradient sums' bytes, its gradient sync program's liveness."""
    mem = program_memory(sp.program.local, sp.program.inputs, sp.program.outputs,
                         frozenset(sp.prologue.outs) if sp.prologue is not None else frozenset())
    sync = program_memory(sp.sync.local, sp.sync.inputs, sp.sync.outputs) if sp.sync is not None else None
    return mem, max(0, mem.peak - sp.saved_bytes), accumulator_bytes(sp.program), sync


def pipeline_hop(pm, links: dict) -> float:
    """Seconds of the largest activation any stage sends to the next (alpha-beta on the pipeline axis)."""
    alpha, bw = links[pm.pp_axis]
    hop = 0.0
    for sp in pm.stages.values():
        graph = {x.name: x for x in sp.program.local.graph.nodes}
        for (kind, _), o in zip(sp.program.outputs, sp.out_names):
            if kind == "act" and o is not None:
                hop = max(hop, alpha + val_bytes(graph[o].meta.get("val")) / bw)
    return hop


def _pipeline_peak(actions, saved: dict, trans: dict, acc: dict, sync_peak: dict, once: int):
    """(the most the action list holds at once, the stage running then, the sync's peak): the walk
    of ``predict_pipeline_memory``, on plain numbers per stage (``saved``: stage -> (saved bytes
    per micro-batch, saved after its I part); ``trans`` / ``acc`` / ``sync_peak``: this rank's
    stages' transient, accumulator and gradient-sync peak bytes; ``once``: the prologues' outputs)."""
    held, started, peak, at_stage = 0, set(), 0, None
    for kind, s, _ in actions:
        sb, after_i = saved[s]
        if kind == "F":
            held += sb
        level = once + held + sum(acc[t] for t in started) + trans[s]
        if level >= peak:
            peak, at_stage = level, s
        if kind == "B":
            held -= sb
        elif kind == "I":
            held += after_i - sb
        elif kind == "W":
            held -= after_i
        if kind in ("B", "W", "FB"):
            started.add(s)
    # the sync programs, one stage after the other, on the sums (held until each one runs)
    total_acc = sum(acc.values())
    sync = max([total_acc] + [total_acc - acc[s] + p for s, p in sync_peak.items()])
    return peak, at_stage, sync


def predict_pipeline_time(pm, dev: Device, optimizer: str = "adamw", fused: bool = False) -> TimeEstimate:
    """Each compiled stage's F / I / W programs simulated (compute + its collectives), the
    schedule's action lists simulated with those per-stage costs and one alpha-beta transfer of
    the largest activation per hop on the pipeline axis, then this rank's gradient sync and
    optimizer step. Stages other ranks hold are costed when compiled (``autopar plan`` compiles
    them all); otherwise every stage is assumed to cost what this rank's stages cost on average."""

    links = _pipeline_links(pm, dev)
    world = math.prod(pm.mesh.shape)
    share = core_share(dev, world)
    blocking = oversubscribed(dev, world)
    if blocking:  # collectives on the compute stream; actions at one core each, the cores bound below
        links = loaded_links(links, dev)
    act_share = 1.0 if blocking else share
    n = len(pm.specs)
    per: dict[str, list[float | None]] = {k: [None] * n for k in ("F", "I", "W")}
    total = TimeEstimate()
    for s, sp in pm.stages.items():
        mine = pm.schedule.rank_of(s) == pm.pp_rank
        for kind, part in sp.parts.items():
            if part.gm is None:
                per[kind][s] = 0.0
                continue
            e = simulate(part.gm, dev, links, act_share, fused, blocking)
            per[kind][s] = e.step_s
            total.unknown_flops += [u for u in e.unknown_flops if u not in total.unknown_flops]
            if mine:
                times = pm.microbatches
                total.compute_s += times * e.compute_s
                total.comm_s += times * e.comm_s
                total.exposed_comm_s += times * e.exposed_comm_s
                total.flops += times * e.flops
                total.by_phase[kind] = total.by_phase.get(kind, 0.0) + times * e.step_s
                for mine_, theirs in ((total.comm_by_axis, e.comm_by_axis), (total.exposed_by_axis, e.exposed_by_axis)):
                    for k, v in theirs.items():
                        mine_[k] = mine_.get(k, 0.0) + times * v
    hop = pipeline_hop(pm, links)
    prologue = 0.0
    for sp in pm.local.values():  # each stage's prologue, once per step before the schedule
        if sp.prologue is not None and sp.prologue.gm is not None:
            e = simulate(sp.prologue.gm, dev, links, share, fused, blocking)
            prologue += e.step_s
            total.compute_s += e.compute_s
            total.flops += e.flops
            total.by_phase["P"] = total.by_phase.get("P", 0.0) + e.step_s
    for kind, vals in per.items():
        known = [v for v in vals if v is not None]
        mean = sum(known) / len(known) if known else 0.0
        per[kind] = [mean if v is None else v for v in vals]
    pp = pm.mesh.shape[list(pm.mesh.mesh_dim_names).index(pm.pp_axis)]
    tl, makespan = _pipeline_makespan(pm.schedule, per, hop, pm.microbatches, dev, world, pp, blocking)
    p2p = sum(r.wire_bytes for r in pm.collectives() if r.kind == "send")
    alpha, bw = links[pm.pp_axis]
    total.comm_by_axis[pm.pp_axis] = total.comm_by_axis.get(pm.pp_axis, 0.0) + p2p / bw
    total.comm_s += p2p / bw
    sync = 0.0
    for sp in pm.local.values():
        e = simulate(sp.sync.local, dev, links, share, fused, blocking)
        sync += e.step_s
        total.comm_s += e.comm_s
    from torch.distributed.tensor import DTensor

    elems = sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in pm.parameters())
    total.optimizer_s = optimizer_seconds(elems, optimizer, dev, share)
    total.step_s = prologue + makespan + sync + total.optimizer_s
    total.bubble = tl.bubble
    total.stage_seconds = {k: list(v) for k, v in per.items()}
    return total


def _pipeline_makespan(schedule, per: dict, hop: float, microbatches: int, dev: Device, world: int, pp: int,
                       blocking: bool):
    """(the schedule's timeline, its makespan) from each stage's F / I / W seconds and the hop."""
    from autopar.analysis import schedules as S

    n = len(per["F"])
    tl = S.simulate(schedule, per, comm=hop, per_stage=True)
    makespan = tl.makespan
    if blocking:
        # a rank waiting in the schedule's bubbles leaves its core to the busy ones; the node's
        # cores still run all of its ranks' actions: every stage's ranks (world / pp of them) do
        # that stage's F, I and W once per micro-batch, and send its activations forward and
        # their gradients back (CPU work too: gloo copies them through the kernel)
        work = (sum(per[k][t] for k in per for t in range(n)) + 2 * (n - 1) * hop) * microbatches * (world / pp)
        makespan = max(makespan, work * min(world, dev.ranks_per_node) / world / dev.cores)
    return tl, makespan
