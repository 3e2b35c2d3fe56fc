"""Plans are data: a strategy per mesh axis, each written as parameter-name rules.

    plan = {"dp": "ddp", "tp": "megatron"}                       # presets
    plan = {"dp": "ddp", "tp": "megatron",
            "rules": {"*lm_head.weight": {"tp": "R"}}}           # override a preset
    plan = {"tp": [("*.w_in.weight", "S(0)"), ("*.w_out.weight", "S(1)")]}   # replace it
    plan = {"tp": "megatron", "rest": "replicate"}               # replicate what no rule matches

A rule is (glob on the parameter's full name, placement); the first matching rule wins,
overrides before presets. Placements are written "R", "S(d)" (a tensor dim) or DTensor
placement objects.

A parameter that no rule matches on some axis is a PlanError naming it (a silently replicated
weight costs memory and bandwidth nobody asked for). ``"rest": "replicate"`` replicates every
such parameter on every axis instead; they are listed in ``placed.unplaced``, ``report()`` and
``autopar explain``. Data-parallel presets match every parameter ("*"), so "rest" only
concerns tensor-parallel axes.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autopar.errors import PlanError

R = Replicate()

# Megatron-LM tensor parallelism is derived from the captured program, not from layer names
# (autopar/analysis/tensor_parallel.py: which matmul's or einsum's output dim is followed to the one
# that contracts it, through heads and activations): ``Plan.derived`` holds its decisions per axis,
# set by the split pass. The preset itself has no rules.
MEGATRON: list[tuple[str, Placement]] = []
# the strategies whose placements come from the graph (Plan.derived)
DERIVED_TP = {"megatron", "sequence"}

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
# "sequence": Megatron's parameter placements with sequence parallelism on the same axis: between the
# tensor-parallel regions activations are sharded over the sequence (autopar/layout.py says how the
# propagation lays them out); reduce-scatter out of / all-gather into each region, no all-reduce
# Context parallelism (autopar/layout.py, ``CONTEXT_PARALLEL``): the batch's sequence dim is sharded
# over the axis everywhere; parameters replicated on it, their gradients all-reduced over it (its ranks
# see different tokens, as data-parallel ranks see different sequences). "ulysses": an all-to-all turns
# sequence shards into head shards for attention and back (DeepSpeed-Ulysses). "context": ring attention,
# the sequence in a load-balanced layout (2·cp chunks, rank i holds i and 2·cp-1-i), K/V passed around
# the ring at attention (autopar/ring.py)
CONTEXT_PARALLEL = {"ulysses", "context"}
# Expert parallelism (autopar/experts.py): the stacked expert weights [E, ...] sharded on dim 0 (each rank
# holds E/ep experts), every other parameter replicated; the batch split over the axis as under ddp (dense
# gradients all-reduced over it); tokens go to their experts' ranks and back by all-to-alls
EXPERT = ([(f"*mlp.{w}", Shard(0)) for w in ("w_gate", "w_up", "w_down")]  # the built-in MoE
          + [(f"*experts.{w}", Shard(0)) for w in ("gate_up_proj", "down_proj")]  # HF Mixtral / Qwen2-MoE
          + [("*", R)])
EXPERT_PARALLEL = {"expert"}
PRESETS: dict[str, list[tuple[str, Placement]]] = {
    **{s: [("*", R)] for s in ZERO_LEVEL}, "megatron": MEGATRON, "sequence": MEGATRON,
    **{s: [("*", R)] for s in CONTEXT_PARALLEL}, "expert": EXPERT}


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

    @property
    def context_parallel(self) -> bool:
        """The axis shards the inputs' sequence dim (dim 1) and replicates every parameter."""
        return self.strategy in CONTEXT_PARALLEL


# plan["rest"]: what happens to a parameter that no rule of an axis matches
REST = {"error": "a PlanError naming it (the default)",
        "replicate": "replicated on that axis, listed in report() and autopar explain"}


@dataclass
class Plan:
    axes: list[AxisPlan]
    overrides: dict[str, list[tuple[str, Placement]]] = field(default_factory=dict)
    rest: str = "error"  # a key of REST
    # axis -> the tensor-parallel placements derived from the captured graph (autopar/analysis/
    # tensor_parallel.py ``Derived``), for axes whose strategy is in DERIVED_TP; set by the split pass
    derived: dict[str, object] = field(default_factory=dict)

    def describe(self) -> str:
        return ", ".join(f"{a.axis}={a.strategy}" for a in self.axes)

    @property
    def zero(self) -> int:
        return max((a.zero for a in self.axes), default=0)


def parse_plan(plan, axis_names: tuple[str, ...]) -> Plan:
    if plan is None:
        plan = {a: "ddp" for a in axis_names}
    if plan == "auto":
        raise PlanError('plan="auto" is resolved by autopar.compile (it searches on the mesh it is given)',
                        where="plan=...",
                        fix="autopar.compile(model, mesh, plan='auto', ...), or autopar.plan(model, inputs, loss_fn, "
                            "world=N) and pass plans.best.compile_options()")
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
        if key not in ("rules", "rest") and key not in axis_names:
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
            # an expert-parallel axis splits the batch as a data-parallel one does
            axes.append(AxisPlan(axis, s, PRESETS[s], s in DATA_PARALLEL or s in EXPERT_PARALLEL))
        elif isinstance(s, (list, tuple)):
            rules = [(g, parse_placement(p, f"plan[{axis!r}][{g!r}]")) for g, p in s]
            axes.append(AxisPlan(axis, "rules", rules, False))
        else:
            raise PlanError(f"strategy for axis {axis!r} must be a preset name or a list of (glob, placement)",
                            where=f"plan[{axis!r}]")
    return Plan(axes, overrides, _parse_rest(plan.get("rest", "error")))


def _parse_rest(value) -> str:
    if isinstance(value, str) and value in REST:
        return value
    raise PlanError(f"unknown plan['rest'] value {value!r}", where="plan['rest']",
                    fix='use "replicate" (replicate every parameter that no rule matches) or leave "rest" out '
                    "(a parameter that no rule matches is then an error naming it)")


@dataclass
class Placed:
    placements: dict[str, tuple[Placement, ...]]  # how each parameter is STORED (what the optimizer sees)
    unplaced: dict[str, list[str]]  # axis -> parameters no rule matched, replicated by plan["rest"]
    compute: dict[str, tuple[Placement, ...]] = field(default_factory=dict)  # how the program uses it
    unsharded: dict[str, list[str]] = field(default_factory=dict)  # zero axis -> params kept whole
    # tensor-parallel axis of size > 1 -> every parameter replicated on it, with the rule that did it
    replicated: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


def place_parameters(plan: Plan, params: dict[str, torch.Tensor], axis_sizes) -> Placed:
    """Each parameter's placement on each axis: the first matching rule, plan['rules'] before the
    strategy's. A parameter no rule matches is an error unless plan['rest'] says what to do."""
    unplaced = check_rules_cover(plan, params)
    out: dict[str, list[Placement]] = {n: [] for n in params}
    replicated: dict[str, list[tuple[str, str]]] = {}
    for i, ap in enumerate(plan.axes):
        for name, t in params.items():
            hit, glob, source = _match(plan, ap, name)
            if hit is None:  # plan["rest"] == "replicate" (check_rules_cover raised otherwise)
                hit = R
            if axis_sizes[i] == 1:  # one rank on this axis: every placement is the whole tensor
                hit = R
            elif _is_strided(hit):
                hit = _checked_strided(hit, name, t, ap.axis, axis_sizes[i])
            elif isinstance(hit, Shard):
                hit = _checked_shard(hit, name, t, ap.axis, axis_sizes[i], ap.strategy)
            elif not ap.data_parallel and not ap.context_parallel:
                replicated.setdefault(ap.axis, []).append((name, _rule_text(ap, glob, source)))
            out[name].append(hit)
    compute = {n: tuple(p) for n, p in out.items()}
    _check_experts(plan, params, compute, axis_sizes)
    storage, unsharded = _shard_state(plan, params, compute, axis_sizes)
    return Placed(storage, unplaced, compute, unsharded, replicated)


def check_rules_cover(plan: Plan, params: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Per axis, the parameters that no rule matches; a PlanError naming all of them (with their
    shapes) unless plan['rest'] = 'replicate'. Works on the whole model before any splitting."""
    unmatched: dict[str, list[str]] = {}
    for ap in plan.axes:
        names = [n for n in params if _match(plan, ap, n)[0] is None]
        if names:
            unmatched[ap.axis] = names
    if unmatched and plan.rest == "error":
        raise _unmatched_error(plan, unmatched, params)
    return unmatched


def _unmatched_error(plan: Plan, unmatched: dict[str, list[str]], params) -> PlanError:
    lines = []
    for ap in plan.axes:
        names = unmatched.get(ap.axis, [])
        if names:
            lines.append(f"{_strategy_text(ap)} has no rule for {len(names)} parameter(s), so nothing says how to "
                         f"place them on mesh axis '{ap.axis}':")
            lines += [f"    {n} {list(params[n].shape)}" for n in names]
    axis, names = next(iter(unmatched.items()))
    return PlanError(
        "\n".join(lines), where=", ".join(f"plan[{a!r}]" for a in unmatched),
        fix=f'give them rules in plan["rules"], e.g. {{"{names[0]}": {{"{axis}": "R"}}}} to replicate or '
        f'{{"{names[0]}": {{"{axis}": "S(0)"}}}} to shard dim 0, or set plan["rest"] = "replicate" to replicate '
        "every parameter that no rule matches (report() and autopar explain list them with their sizes)")


def _strategy_text(ap: AxisPlan) -> str:
    return f"the {ap.strategy!r} strategy" if ap.strategy in PRESETS else f"the rule list in plan[{ap.axis!r}]"


def _rule_text(ap: AxisPlan, glob: str, source: str) -> str:
    """Which rule placed a parameter, in words, for the reports."""
    if source.startswith(DERIVED):
        return source
    if not glob:
        return "plan['rest'] = 'replicate' (no rule matched)"
    if source == OVERRIDE:
        return f"plan['rules'] override {glob!r}"
    if ap.strategy in PRESETS:
        return f"{ap.strategy} preset rule {glob!r}"
    return f"plan[{ap.axis!r}] rule {glob!r}"


def _check_experts(plan: Plan, params, compute, axis_sizes) -> None:
    """An expert-parallel axis of more than one rank must find expert weights to shard."""
    for i, ap in enumerate(plan.axes):
        if ap.strategy in EXPERT_PARALLEL and axis_sizes[i] > 1 and \
                not any(isinstance(p[i], Shard) for p in compute.values()):
            raise PlanError(f"mesh axis '{ap.axis}' is expert-parallel but the model has no expert weights to "
                            f"shard over it (no parameter matches {[g for g, p in ap.rules if isinstance(p, Shard)]})",
                            where=f"plan[{ap.axis!r}]",
                            fix=f"use a mixture-of-experts model, shard its stacked expert weights with plan['rules'] "
                            f"(e.g. {{'*my_experts.w1': {{'{ap.axis}': 'S(0)'}}}}), or use 'ddp' on that axis")


def _is_strided(p: Placement) -> bool:
    from autopar import torch_compat as tc

    return isinstance(p, tc.StridedShard)


def _checked_strided(p, name: str, t: torch.Tensor, axis: str, size: int):
    """A strided shard (k parts of a dim, each sharded): each part must divide by the axis."""
    d = p.dim % t.ndim
    if t.shape[d] % (p.split_factor * size):
        raise PlanError(f"parameter {name!r} of shape {list(t.shape)} cannot be sharded on dim {d} in "
                        f"{p.split_factor} parts over mesh axis '{axis}' of size {size}: not divisible",
                        where=f"parameter {name}",
                        fix=f"use a '{axis}' size that divides {t.shape[d] // p.split_factor}, "
                        f"or add a rule {{'{name}': {{'{axis}': 'R'}}}} to plan['rules']")
    if d == p.dim:
        return p
    return type(p)(d, split_factor=p.split_factor)


def _checked_shard(p: Shard, name: str, t: torch.Tensor, axis: str, size: int, strategy: str = "") -> Shard:
    d = p.dim % t.ndim if t.ndim else None
    if d == 0 and strategy in EXPERT_PARALLEL and t.shape[0] % size:
        raise PlanError(f"parameter {name!r} of shape {list(t.shape)} stacks {t.shape[0]} experts, which expert "
                        f"parallelism cannot split over mesh axis '{axis}' of size {size}: {t.shape[0]} is not "
                        f"divisible by {size}", where=f"parameter {name}",
                        fix=f"use an '{axis}' size that divides the number of experts ({t.shape[0]})")
    if d is None or t.shape[d] % size:
        raise PlanError(
            f"parameter {name!r} of shape {list(t.shape)} cannot be sharded on dim {p.dim} "
            f"over mesh axis '{axis}' of size {size}: not divisible",
            where=f"parameter {name}",
            fix=f"use a '{axis}' size that divides {t.shape[d] if d is not None else 'it'}, "
            f"or add a rule {{'{name}': {{'{axis}': 'R'}}}} to plan['rules']")
    return Shard(d)


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
            taken = {p.dim for p in pl if isinstance(p, Shard) or _is_strided(p)}
            dims = [d for d in range(t.ndim) if d not in taken and t.shape[d] % axis_sizes[i] == 0]
            if not dims:
                unsharded.setdefault(ap.axis, []).append(name)
                continue
            pl[i] = Shard(dims[0])
            storage[name] = tuple(pl)
    return storage, unsharded


OVERRIDE = "override (plan['rules'])"


def _match(plan: Plan, ap: AxisPlan, name: str) -> tuple[Placement | None, str, str]:
    """The rule that places ``name`` on axis ``ap``: (placement, glob, source), where source is
    OVERRIDE, the strategy's name, or (a derived placement: glob "") ``DERIVED`` + why; (None,
    "", "") when no rule matches. Order: plan['rules'], a placement derived from the graph that
    shards, the strategy's rules, a derived replication."""
    found = _first(plan.overrides.get(ap.axis, []), name)
    if found:
        return found[0], found[1], OVERRIDE
    d = plan.derived.get(ap.axis)
    decision = d.decisions.get(name) if d is not None else None
    if decision is not None and not isinstance(decision.placement, Replicate):
        return decision.placement, "", f"{DERIVED}: {decision.why}"
    found = _first(ap.rules, name)
    if found:
        return found[0], found[1], ap.strategy
    if decision is not None:
        return decision.placement, "", f"{DERIVED}: {decision.why}"
    return None, "", ""


def _first(rules, name: str):
    for glob, p in rules:
        if fnmatch.fnmatchcase(name, glob):
            return p, glob
    return None


DERIVED = "derived from the graph"


def placement_reasons(plan: Plan, name: str) -> list[tuple[str, str, str]]:
    """Per mesh axis, which rule placed parameter ``name`` and where it came from:
    (axis, rule glob or "", OVERRIDE | strategy name | "plan['rest']: replicated" | "no rule")."""
    out = []
    for ap in plan.axes:
        p, glob, source = _match(plan, ap, name)
        if p is None:
            source = "plan['rest']: replicated" if plan.rest == "replicate" else "no rule"
        out.append((ap.axis, glob, source))
    return out


def replicated_lines(placed: Placed, params: dict[str, torch.Tensor], indent: str = "  ") -> list[str]:
    """Every parameter replicated on a tensor-parallel axis (each of its ranks holds the whole
    tensor), its size and the rule that replicated it, with the total per axis: the memory a
    tensor-parallel plan does not divide, for report() and autopar explain."""
    lines = []
    for axis, rows in placed.replicated.items():
        rows = [(n, params[n], why) for n, why in rows if n in params]
        numel = sum(t.numel() for _, t, _ in rows)
        nbytes = sum(t.numel() * t.element_size() for _, t, _ in rows)
        lines.append(f"{indent}replicated on tensor-parallel axis '{axis}' (whole tensor on each of its ranks): "
                     f"{len(rows)} parameter(s), {numel:,} elements, {nbytes:,} B in all")
        for n, t, why in rows:
            lines.append(f"{indent}  {n:44s} {str(list(t.shape)):>14s} {t.numel():>12,} elements "
                         f"{t.numel() * t.element_size():>14,} B  <- {why}")
    return lines
