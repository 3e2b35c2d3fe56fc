"""One transformer block's cost-model figures, compiled at depths 1-3 (see autopar.planner)."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace

from autopar.errors import PlanError
from autopar.options import CompileOptions

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
    fwd_s: float = 0.0  # forward: compute + exposed communication on the block's own axes (tp, cp, ep)
    bwd_s: float = 0.0
    flops: int = 0
    # of fwd_s / bwd_s, what a pipeline runs on its first stage: the embedding's ops, forward and
    # backward (``_embedding_seconds``; zero for a block)
    first_fwd_s: float = 0.0
    first_bwd_s: float = 0.0
    # wire bytes per rank on the block's own axes: (axis, "mb") per micro-batch (activations,
    # attention's all-to-alls and ring shifts, routed tokens), (axis, "grad") once per step (the
    # gradients of parameters replicated on cp / ep, sequence parallelism's norm weights on tp)
    comm: dict = field(default_factory=dict)
    # the program's parameter gradients in the order the backward produces them (the order the
    # bucket pass assigns their reductions): ("block" / "rest", local elements) each. Read from one
    # compile (``block_coefficients``: depth 1), not differenced or scaled
    grads_order: tuple = ()

    def __sub__(self, o: "Figures") -> "Figures":
        return Figures(*(getattr(self, f) - getattr(o, f) for f in _SCALARS),
                       comm={k: self.comm.get(k, 0) - o.comm.get(k, 0) for k in set(self.comm) | set(o.comm)})

    def scaled(self, k: float) -> "Figures":
        """The figures for ``k`` times the sequences per micro-batch: per-sequence quantities
        scale, the parameters (and their copies, gradients and gradient traffic) do not."""
        if k == 1:
            return self
        return Figures(self.param_elems, self.params, self.copies, self.grads, int(self.acts * k), self.fwd_s * k,
                       self.bwd_s * k, int(self.flops * k), self.first_fwd_s * k, self.first_bwd_s * k,
                       comm={key: int(v * k) if key[1] == "mb" else v for key, v in self.comm.items()})

    def bytes_on(self, axis: str, what: str) -> int:
        return self.comm.get((axis, what), 0)

    def close(self, o: "Figures", rel: float = 0.02) -> list[str]:
        pairs = [(f, getattr(self, f), getattr(o, f)) for f in _SCALARS]
        pairs += [(f"{k[0]} {k[1]} bytes", self.comm.get(k, 0), o.comm.get(k, 0)) for k in set(self.comm) | set(o.comm)]
        bad = []
        for f, a, b in pairs:
            if abs(a - b) > rel * max(abs(a), abs(b), 1e-12) + (1e-9 if isinstance(a, float) else 0):
                bad.append(f"{f}: {a:.6g} vs {b:.6g}")
        return bad


_SCALARS = ("param_elems", "params", "copies", "grads", "acts", "fwd_s", "bwd_s", "flops", "first_fwd_s", "first_bwd_s")


def figures_of(pm, dev, fused: bool = False) -> Figures:
    """One compiled (non-pipelined) ParallelModule -> Figures, through the cost model (``fused``:
    its programs as Inductor compiles them)."""
    from torch.distributed.tensor import DTensor

    from autopar.analysis import cost

    mem = cost.predict_memory(pm, "none")
    prog = cost.program_memory(pm.program.local, pm.program.inputs, pm.program.outputs)
    links = cost.axis_links(pm.ctx.axis_names, pm.ctx.axis_sizes, dev)
    est = cost.simulate(pm.program.local, dev, links, cost.core_share(dev, math.prod(pm.ctx.axis_sizes)), fused)
    elems = sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in pm.parameters())
    comp = sum(est.by_phase.values()) or 1.0
    fwd_share = est.by_phase.get("forward", 0.0) / comp
    comm: dict = {}
    for r in pm.collectives():
        key = (r.axis, "grad" if r.reason.startswith("gradient of") else "mb")
        comm[key] = comm.get(key, 0) + int(r.wire_bytes)
    copies = prog.max_by["param_copies"]
    first_f, first_b = _embedding_seconds(pm, dev, links, fused)
    return Figures(elems, mem["parameters"], copies, prog.max_by["grads_in_flight"],
                   prog.peak_without_grads - copies, est.step_s * fwd_share, est.step_s * (1 - fwd_share),
                   est.flops, first_f, first_b, comm, _grads_order(pm))


def _grads_order(pm) -> tuple:
    """``Figures.grads_order`` of ``pm``'s per-rank program: each gradient output by where its
    value is made in the graph."""
    from autopar.modpath import block_of

    graph = pm.program.local.graph
    where = {n: i for i, n in enumerate(graph.nodes)}
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    grads = [(where.get(o, -1), "block" if block_of(role[1]) else "rest", int(o.meta["val"].numel()))
             for role, o in zip(pm.program.outputs, out.args[0])
             if role[0] == "grad" and hasattr(o, "meta") and "val" in o.meta]
    return tuple((kind, elems) for _, kind, elems in sorted(grads, key=lambda g: g[0]))


def embedding_parameters(model) -> set[str]:
    """The parameters of the model's lookup tables outside its repeated blocks: every
    ``nn.Embedding`` module's, whatever it is called (``ModelInfo.embed_share`` counts the same
    modules). What a pipeline's first stage holds besides its blocks."""
    import torch

    from autopar.splice import find_blocks

    found = find_blocks(model, min_blocks=2)
    inside = found[0] + "." if not isinstance(found, str) and found[0] else None
    return {f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
            and not (inside and f"{mn}.".startswith(inside)) for pn, _ in m.named_parameters(recurse=False)}


def _embedding_seconds(pm, dev, links, fused: bool) -> tuple[float, float]:
    """The cost model's seconds of the embedding's ops in ``pm``'s per-rank program, forward and
    backward: the forward ops that read the embeddings' parameters and no other parameter (the
    cast of the table, the lookup, its all-reduce under a vocab-parallel table), and the backward
    ops that only the embeddings' gradients need (every other output reads none of them). The
    composition runs these on a pipeline's first stage and the rest of the non-block work (final
    norm, LM head, loss) on its last, as the split places them."""
    from torch import fx

    from autopar.analysis import cost
    from autopar.ir import info as node_info

    gm = pm.program.local
    fusion = cost.fusion_of(gm, dev.kind) if fused else None
    share = cost.core_share(dev, math.prod(pm.ctx.axis_sizes))
    out = next(n for n in gm.graph.nodes if n.op == "output")

    def ancestors(roots) -> set:
        seen, todo = set(), [r for r in roots if isinstance(r, fx.Node)]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(n.all_input_nodes)
        return seen

    tables = embedding_parameters(pm.module)
    mine = [o for role, o in zip(pm.program.outputs, out.args[0]) if role[0] == "grad" and role[1] in tables]
    others = [o for role, o in zip(pm.program.outputs, out.args[0]) if not (role[0] == "grad" and role[1] in tables)]
    only_embedding_grads = ancestors(mine) - ancestors(others)
    reads: dict = {}  # node -> which parameters it reads, transitively: {"embedding", "other"}
    roles = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], pm.program.inputs))
    fwd = bwd = 0.0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            role = roles.get(n)
            reads[n] = ({"embedding" if role[1] in tables else "other"} if role and role[0] == "param"
                        else set())
            continue
        reads[n] = set().union(*(reads.get(a, set()) for a in n.all_input_nodes))
        if n.op != "call_function" or "wait_tensor" in str(n.target):
            continue
        backward = n.meta.get("partitioner_tag") == "is_backward"
        if backward:
            # (a forward value that read other parameters marks the LM head's half of a tied
            # table's gradient: that runs on the last stage)
            if n not in only_embedding_grads or any(
                    "other" in reads.get(a, set()) for a in n.all_input_nodes
                    if a.meta.get("partitioner_tag") != "is_backward"):
                continue
        elif reads[n] != {"embedding"}:
            continue
        rec = node_info(n).comm
        if rec is not None:
            dt = cost.comm_seconds(rec, links)
        else:
            try:
                f = cost.node_flops(n)
            except cost.UnknownFlops:
                f = 0
            dt = cost.compute_seconds(n, dev, f, share, fusion)
        if backward:
            bwd += dt
        else:
            fwd += dt
    return fwd, bwd


@dataclass
class Coefficients:
    block: Figures
    rest: Figures
    linear: list[str]  # depth 3 - depth 2 against depth 2 - depth 1: what differs (empty: identical blocks)
    compile_s: float
    at2: Figures | None = None  # the model's figures at depth 2 (``depth_check`` compares depth 3 with them)
    grads_order: tuple = ()  # ``Figures.grads_order`` at depth 1 (one block): the gradient buckets' sizes

    def scaled(self, k: float) -> "Coefficients":
        return Coefficients(self.block.scaled(k), self.rest.scaled(k), self.linear, self.compile_s,
                            grads_order=self.grads_order)


@dataclass
class ModelInfo:
    spec: str
    depth_field: str  # the block list's path (the model's depth is its length)
    layers: int
    heads: int  # 0: unknown (tensor parallelism's divisibility then left to the compile)
    kv_heads: int
    hidden: int
    vocab: int  # 0: unknown
    batch: int
    seq: int
    embed_share: float  # of the non-block parameters: the part on the first pipeline stage
    params: int
    overrides: dict = field(default_factory=dict)
    experts: int = 0  # experts per MoE layer (0: a dense model)
    no_ep: str = ""  # why expert parallelism cannot apply ("" where it can)
    # the model itself, whose block list is cut to the depths the search compiles (autopar/depth.py)
    source: object = field(default=None, repr=False, compare=False)
    # the first depth on the blocks' line: 2 where the search found depth 1 (its one block the first
    # and the last) off it; ``confirm`` then compiles an SPMD candidate at depths 2 and 3
    from_depth: int = 1
    # the list's blocks repeat in units of this many (``splice.find_period``: Gemma 2's alternating
    # attention windows); ``layers`` and every depth the search compiles count units
    period: int = 1

    def at(self, depth: int, batch: int):
        """The model with ``depth`` blocks (units) and a global batch of ``batch`` (a ``zoo.Loaded``, on meta)."""
        return self.source.at(depth, batch)


def model_info(spec: str, batch: int | None, seq: int | None, overrides: dict | None) -> ModelInfo:
    """``info_of`` a model by name: a built-in (``batch``, ``seq``, ``overrides`` change it) or
    ``package.module:factory`` (``batch`` changes its inputs' first dimension)."""
    from autopar.models import zoo

    loaded = zoo.load(spec, batch=batch, seq=seq, overrides=overrides)
    return info_of(loaded.model, loaded.example_inputs, loaded.loss_fn, spec=spec, batch=batch, overrides=overrides)


# where a model says its shapes (its config's fields, or its blocks' attributes): the screen's
# divisibility checks and throughput; unknown ones are left to the compiles
_HEADS = ("num_attention_heads", "n_heads", "n_head", "num_heads", "nhead")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head")
_HIDDEN = ("hidden_size", "dim", "n_embd", "d_model", "embed_dim")
_VOCAB = ("vocab_size", "n_vocab", "padded_vocab_size")
_EXPERTS = ("num_local_experts", "n_experts", "num_experts")


def info_of(model, example_inputs, loss_fn=None, *, spec: str, batch: int | None = None,
            overrides: dict | None = None) -> ModelInfo:
    """What the search needs of ``model`` (any ``nn.Module`` with a repeated block list,
    ``splice.find_blocks``; its example inputs' first dimension is the batch, the second the
    sequence): its depth, shapes and parameters; the search compiles it at other depths by
    cutting that list (autopar/depth.py). A ``PlanError`` saying what to do where it has no such list."""
    import torch

    from autopar.depth import meta_inputs, repeated

    if batch is not None:
        example_inputs = meta_inputs(example_inputs, batch)
    rep = repeated(model, example_inputs, loss_fn, min_blocks=2, name=spec, periodic=True)
    if not isinstance(rep, str) and rep.period > 1 and rep.layers < 3:
        rep = (f"the blocks of its list {rep.path} repeat in units of {rep.period}, and {rep.layers} units are too few "
               "for the search's check (it compiles 1, 2 and 3)")
    if isinstance(rep, str):
        raise PlanError(f"plan='auto' cannot search {spec}: {rep}", where="plan='auto'",
                        fix="give a fixed plan (autopar plan MODEL --mesh dp=8,tp=8 --plan dp=fsdp,tp=megatron, or "
                            "autopar.compile(plan={...})): it compiles the whole model; the search extrapolates one "
                            "block to the model's depth, so it needs the model's repeated blocks in one "
                            "nn.ModuleList or nn.Sequential, every block alike (one class, the same parameters, "
                            "the same plain attributes but a layer index) or alike the one a few places before "
                            "(alternating attention windows), at least 3 of those units")
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    holders = [h for h in (cfg, *rep.blocks[0].modules()) if h is not None]

    def first(names) -> int:
        for h in holders:
            for n in names:
                v = getattr(h, n, None)
                if type(v) is int and v > 0:
                    return v
        return 0

    outside = [(n, p) for n, p in model.named_parameters() if not (n.startswith(rep.path + ".") or not rep.path)]
    tables = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
              and not (n.startswith(rep.path + ".") or not rep.path)]
    heads = first(_HEADS)
    experts = first(_EXPERTS)
    dispatch = getattr(cfg, "moe_dispatch", None)
    no_ep = ("its MoE dispatches by capacity (GShard einsums need every expert); expert parallelism needs "
             "--set moe_dispatch=dropless") if experts and dispatch not in (None, "dropless") else ""
    # the lookup tables outside the blocks (modules that are embeddings, whatever they are called)
    embed = sum(p.numel() for m in tables for p in m.parameters(recurse=False))
    other = sum(p.numel() for _, p in outside) - embed
    tokens = rep.example_inputs[0]
    return ModelInfo(spec, rep.path, rep.layers, heads, first(_KV_HEADS) or heads,
                     first(_HIDDEN) or max((m.embedding_dim for m in tables), default=0),
                     first(_VOCAB) or max((m.num_embeddings for m in tables), default=0),
                     tokens.shape[0], tokens.shape[1] if tokens.ndim > 1 else 1, embed / max(1, embed + other),
                     sum(p.numel() for p in model.parameters()), dict(overrides or {}), experts,
                     no_ep if experts else "the model has no experts", rep, period=rep.period)


def planning_options(loaded, **choice) -> CompileOptions:
    """The options a candidate is compiled with to be costed: ``loaded``'s batch and loss, nothing
    to run (no eval forward), PyTorch's own ops, every pipeline stage on this rank; ``choice``: the
    candidate's plan, precision, recompute, ... (a ``CompileOptions`` field each)."""
    return replace(CompileOptions(example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn, capture_eval=False,
                                  kernels="off", pipeline_stages="all"), **choice)


def block_coefficients(info: ModelInfo, tp: int, tp_strategy: str | None, recompute: str, mbs: int, *,
                       precision: str, dev, kernels: str = "off", cp: int = 1, cp_strategy: str | None = None,
                       ep: int = 1, fused: bool = False) -> Coefficients:
    """Compile the model at depths 1 and 2 (``depth_check`` compiles depth 3) on a fake mesh of the
    block's own axes (ep x cp x tp: what one data-parallel rank's micro-batch is spread over) and
    difference. Expert parallelism splits the batch as data parallelism does: the compile sees
    ``mbs`` sequences per ep rank. Gradient buckets are left out (``bucket_mb=0``): a bucket's flat
    buffer is a per-step matter (a pipeline or accumulation reduces the gradients after the
    micro-batches), and would otherwise be counted as one micro-batch's activations."""
    t0 = time.perf_counter()
    figs = [_block_figures(info, depth, tp, tp_strategy, recompute, mbs, precision=precision, dev=dev,
                           kernels=kernels, cp=cp, cp_strategy=cp_strategy, ep=ep, fused=fused) for depth in (1, 2)]
    block = figs[1] - figs[0]
    return Coefficients(block, figs[0] - block, [], time.perf_counter() - t0, at2=figs[1],
                        grads_order=figs[0].grads_order)


def depth_check(co: Coefficients, at3: Figures) -> list[str]:
    """The identical-blocks check of ``co`` (``block_coefficients`` without it) against ``at3``
    (``check_figures`` of the same block choice and keywords): depth 3 - depth 2 against depth 2 -
    depth 1. What differs (empty: the blocks are identical)."""
    return (at3 - co.at2).close(co.block)


def check_figures(info: ModelInfo, tp: int, tp_strategy: str | None, recompute: str, mbs: int, depth: int = 3,
                  **kw) -> Figures:
    """The identical-blocks check's compile: the model at depth 3 (``block_coefficients``'s block
    choice and keywords). Needs nothing of depths 1 and 2, so it can run beside them. (``depth``
    4: the search's test of whether depth 1 alone is off the blocks' line, ``from_depth_two``.)"""
    return _block_figures(info, depth, tp, tp_strategy, recompute, mbs, **kw)


def from_depth_two(co: Coefficients, at3: Figures) -> Coefficients:
    """``co`` (from depths 1 and 2) redone from depths 2 and 3: where depth 1's one block, the
    first block and the last at once, is not the line through the deeper ones (Falcon's
    simulated forward seconds: 216, then 200 and 200 µs a block at the architecture sweep's
    shapes), the figures of depth ``L`` are depth 2's and ``L - 2`` times depth 3 - depth 2."""
    block = at3 - co.at2
    return Coefficients(block, co.at2 - block - block, co.linear, co.compile_s, at2=co.at2,
                        grads_order=co.grads_order)


def _block_figures(info: ModelInfo, depth: int, tp: int, tp_strategy: str | None, recompute: str, mbs: int, *,
                   precision: str, dev, kernels: str = "off", cp: int = 1, cp_strategy: str | None = None,
                   ep: int = 1, fused: bool = False) -> Figures:
    from autopar.compiler import compile_with
    from autopar.mesh import fake_mesh

    axes = {k: v for k, v in (("ep", ep), ("cp", cp), ("tp", tp)) if v > 1} or {"tp": 1}
    plan = {"tp": tp_strategy if tp > 1 else "ddp"} if "tp" in axes else {}
    if cp > 1:
        plan["cp"] = cp_strategy
    if ep > 1:
        plan["ep"] = "expert"
    loaded = info.at(depth, mbs * ep)
    with fake_mesh(axes, 0) as mesh, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = compile_with(loaded.model, mesh, planning_options(loaded, plan=plan, precision=precision,
                                                              recompute=recompute, kernels=kernels, bucket_mb=0))
        return figures_of(pm, dev, fused)
