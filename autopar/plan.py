"""Plans are data: a strategy per mesh axis, each written as parameter-name rules.

    plan = {"dp": "ddp", "tp": "megatron"}                       # presets
    plan = {"dp": "ddp", "tp": "megatron",
            "rules": {"*lm_head.weight": {"tp": "R"}}}           # override a preset
    plan = {"tp": [("*.w_in.weight", "S(0)"), ("*.w_out.weight", "S(1)")]}   # replace it

A rule is (glob on the parameter's full name, placement); the first matching rule wins,
overrides before presets. Placements are written "R", "S(d)" (a tensor dim) or DTensor
placement objects.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autopar.errors import PlanError

R = Replicate()

# Megatron-LM tensor parallelism, written as rules over the usual Llama/GPT/Qwen/Mistral names.
# HF GPT-2 (Conv1D c_attn/c_fc/c_proj: [in, out] weights, fused qkv) is deliberately absent: its
# parameters are replicated and named in a warning rather than sharded along the wrong dim.
_COLUMN = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "wq", "wk", "wv", "w1", "w3",
           "fc1", "query", "key", "value", "dense_h_to_4h"]
_ROW = ["o_proj", "down_proj", "wo", "w2", "fc2", "out_proj", "dense_4h_to_h"]
_VOCAB = ["embed_tokens", "tok_embeddings", "wte", "word_embeddings", "lm_head", "output", "embed_out"]
_REPLICATED_OK = ["*norm*", "*ln_*", "*ln_f*", "*layernorm*", "*layer_norm*", "*wpe*", "*position_embedding*",
                  "*rotary*", "*bias"]

MEGATRON: list[tuple[str, Placement]] = (
    [(f"*{m}.weight", Shard(0)) for m in _COLUMN]
    + [(f"*{m}.bias", Shard(0)) for m in _COLUMN]
    + [(f"*{m}.weight", Shard(1)) for m in _ROW]
    + [(f"*{m}.weight", Shard(0)) for m in _VOCAB]
    + [(g, R) for g in _REPLICATED_OK]
)

# Data-parallel strategies: every parameter is replicated for compute; they differ in what each
# rank STORES (the parameter placements the optimizer sees) and when gradients are reduced.
#   ddp    parameters, gradients and optimizer state whole on every rank; gradients all-reduced
#   zero1  parameters (hence optimizer state) stored sharded; gathered once per step; gradients
#          held whole until the end of backward, then reduce-scattered
#   zero2  as zero1, but each gradient is reduce-scattered as soon as it is complete
#   zero3  parameters gathered just before their forward use and again before their backward
#          use, freed in between; gradients reduce-scattered as produced ("fsdp" is the same)
ZERO_LEVEL = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
DATA_PARALLEL = set(ZERO_LEVEL)
PRESETS: dict[str, list[tuple[str, Placement]]] = {
    **{s: [("*", R)] for s in ZERO_LEVEL}, "megatron": MEGATRON}


def parse_placement(p, where: str) -> Placement:
    if isinstance(p, Placement):
        return p
    if isinstance(p, str):
        s = p.strip()
        if s in ("R", "Replicate", "Replicate()"):
            return R
        m = re.fullmatch(r"(?:S|Shard)\((-?\d+)\)", s)
        if m:
            return Shard(int(m.group(1)))
    raise PlanError(f"cannot read placement {p!r}", where=where,
                    fix='write "R", "S(0)", "S(1)"... or a DTensor placement')


@dataclass
class AxisPlan:
    axis: str
    strategy: str  # preset name, or "rules" for a user rule list
    rules: list[tuple[str, Placement]]
    data_parallel: bool

    @property
    def zero(self) -> int:
        """ZeRO stage of a data-parallel axis (0 for ddp and for non-data-parallel axes)."""
        return ZERO_LEVEL.get(self.strategy, 0)


@dataclass
class Plan:
    axes: list[AxisPlan]
    overrides: dict[str, list[tuple[str, Placement]]] = field(default_factory=dict)

    def describe(self) -> str:
        return ", ".join(f"{a.axis}={a.strategy}" for a in self.axes)

    @property
    def zero(self) -> int:
        return max((a.zero for a in self.axes), default=0)


def parse_plan(plan, axis_names: tuple[str, ...]) -> Plan:
    if plan is None:
        plan = {a: "ddp" for a in axis_names}
    if not isinstance(plan, dict):
        raise PlanError(f"plan must be a dict mapping mesh axes to strategies, got {type(plan).__name__}",
                        fix='e.g. plan={"dp": "ddp", "tp": "megatron"}')
    overrides: dict[str, list] = {a: [] for a in axis_names}
    for glob, per_axis in (plan.get("rules") or {}).items():
        if not isinstance(per_axis, dict):
            raise PlanError(f"rule {glob!r} must map axis names to placements", where=f"plan['rules'][{glob!r}]")
        for axis, p in per_axis.items():
            if axis not in axis_names:
                raise PlanError(f"rule {glob!r} names unknown mesh axis {axis!r}", where=f"plan['rules'][{glob!r}]",
                                fix=f"mesh axes are {list(axis_names)}")
            overrides[axis].append((glob, parse_placement(p, f"plan['rules'][{glob!r}][{axis!r}]")))
    axes = []
    for key in plan:
        if key != "rules" and key not in axis_names:
            raise PlanError(f"plan names mesh axis {key!r}, which the mesh does not have",
                            where=f"plan[{key!r}]", fix=f"mesh axes are {list(axis_names)}")
    for axis in axis_names:
        if axis not in plan:
            raise PlanError(f"mesh axis {axis!r} has no strategy in the plan", where="plan",
                            fix=f'add e.g. "{axis}": "ddp" (known strategies: {sorted(PRESETS)})')
        s = plan[axis]
        if isinstance(s, str):
            if s not in PRESETS:
                raise PlanError(f"unknown strategy {s!r} for mesh axis {axis!r}", where=f"plan[{axis!r}]",
                                fix=f"known strategies: {sorted(PRESETS)}; on a pipeline axis a schedule: "
                                "gpipe, 1f1b, interleaved, zb")
            axes.append(AxisPlan(axis, s, PRESETS[s], s in DATA_PARALLEL))
        elif isinstance(s, (list, tuple)):
            rules = [(g, parse_placement(p, f"plan[{axis!r}][{g!r}]")) for g, p in s]
            axes.append(AxisPlan(axis, "rules", rules, False))
        else:
            raise PlanError(f"strategy for axis {axis!r} must be a preset name or a list of (glob, placement)",
                            where=f"plan[{axis!r}]")
    return Plan(axes, overrides)


@dataclass
class Placed:
    placements: dict[str, tuple[Placement, ...]]  # how each parameter is STORED (what the optimizer sees)
    unplaced: dict[str, list[str]]  # axis -> parameter names no rule recognised (replicated)
    compute: dict[str, tuple[Placement, ...]] = field(default_factory=dict)  # how the program uses it
    unsharded: dict[str, list[str]] = field(default_factory=dict)  # zero axis -> params kept whole


def place_parameters(plan: Plan, params: dict[str, torch.Tensor], axis_sizes) -> Placed:
    out: dict[str, list[Placement]] = {n: [] for n in params}
    unplaced: dict[str, list[str]] = {}
    for i, ap in enumerate(plan.axes):
        for name, t in params.items():
            hit = _first_match(plan.overrides.get(ap.axis, []), name)
            if hit is None:
                hit = _first_match(ap.rules, name)
            if hit is None:
                unplaced.setdefault(ap.axis, []).append(name)
                hit = R
            if axis_sizes[i] == 1:  # one rank on this axis: every placement is the whole tensor
                hit = R
            if isinstance(hit, Shard):
                d = hit.dim % t.ndim if t.ndim else None
                if d is None or t.shape[d] % axis_sizes[i]:
                    raise PlanError(
                        f"parameter {name!r} of shape {list(t.shape)} cannot be sharded on dim {hit.dim} "
                        f"over mesh axis '{ap.axis}' of size {axis_sizes[i]}: not divisible",
                        where=f"parameter {name}",
                        fix=f"use a '{ap.axis}' size that divides {t.shape[d] if d is not None else 'it'}, "
                        f"or add a rule {{'{name}': {{'{ap.axis}': 'R'}}}} to plan['rules']")
                hit = Shard(d)
            out[name].append(hit)
    compute = {n: tuple(p) for n, p in out.items()}
    storage, unsharded = _shard_state(plan, params, compute, axis_sizes)
    return Placed(storage, unplaced, compute, unsharded)


def _shard_state(plan: Plan, params, compute, axis_sizes):
    """Storage placements on ZeRO axes: each parameter sharded along a dim the other axes do
    not shard (dim 0 first), so gathering on the ZeRO axis gives back the compute layout.
    A parameter with no such divisible dim stays whole on that axis (listed in the report)."""
    storage = dict(compute)
    unsharded: dict[str, list[str]] = {}
    for i, ap in enumerate(plan.axes):
        if ap.zero == 0 or axis_sizes[i] == 1:
            continue
        for name, t in params.items():
            pl = list(storage[name])
            if not isinstance(pl[i], Replicate):
                continue
            taken = {p.dim for p in pl if isinstance(p, Shard)}
            dims = [d for d in range(t.ndim) if d not in taken and t.shape[d] % axis_sizes[i] == 0]
            if not dims:
                unsharded.setdefault(ap.axis, []).append(name)
                continue
            pl[i] = Shard(dims[0])
            storage[name] = tuple(pl)
    return storage, unsharded


def _first_match(rules, name: str):
    for glob, p in rules:
        if fnmatch.fnmatchcase(name, glob):
            return p
    return None


def placement_reasons(plan: Plan, name: str) -> list[tuple[str, str, str]]:
    """Per mesh axis, which rule placed parameter ``name`` and where it came from:
    (axis, rule glob or "", "override" | strategy name | "no rule: replicated")."""
    out = []
    for ap in plan.axes:
        for source, rules in (("override (plan['rules'])", plan.overrides.get(ap.axis, [])), (ap.strategy, ap.rules)):
            hit = next((g for g, _ in rules if fnmatch.fnmatchcase(name, g)), None)
            if hit is not None:
                out.append((ap.axis, hit, source))
                break
        else:
            out.append((ap.axis, "", "no rule: replicated"))
    return out
