"""What the passes know about the mesh, the plan and this rank (``Context``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autopar.plan import Placed, Plan
from autopar.ir import info
from autopar.unfuse_find import describe as describe_cuts


class Context:
    """What the passes know about the mesh, the plan and this rank. Every field is declared here;
    the passes change some of them (each comment names who), none adds one (``__slots__``: an
    attribute set from outside that is not one of these is an AttributeError)."""

    __slots__ = ("mesh", "axis_names", "axis_sizes", "coord", "device", "plan", "placed", "dp_axes", "cp_axes",
                 "timings", "compute_dtype", "reduce_dtype", "recompute", "accumulate", "loss_scale", "progress",
                 "bucket_mb", "prefetch", "reshard_after_forward", "kept_gathered", "sync_grads", "output_roles",
                 "strategy_cache", "_groups", "boundary", "lowered", "kernel_choices", "derived_rules", "masks", "cuts",
                 "value_checks", "cache_layout", "from_disk")

    def __init__(self, mesh: DeviceMesh, plan: Plan, placed: Placed, *, compute_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, recompute: str, accumulate: int, loss_scale: str | float | None,
                 progress: Callable[[str], None] | None, bucket_mb: float, prefetch: int,
                 reshard_after_forward: bool | None, device: torch.device | None = None):
        # (the compile options' keywords come from make_context: their defaults are compile's, autopar/options.py)
        self.mesh = mesh
        self.axis_names: tuple[str, ...] = tuple(mesh.mesh_dim_names)
        self.axis_sizes: tuple[int, ...] = tuple(mesh.shape)
        coord = mesh.get_coordinate()
        # this rank's index on each axis
        self.coord: tuple[int, ...] = tuple(coord) if coord is not None else tuple(0 for _ in self.axis_sizes)
        # where the program runs (meta: a planning compile, which never runs)
        self.device: torch.device = device if device is not None else torch.device(mesh.device_type)
        self.plan = plan
        self.placed = placed  # every parameter's placements (storage and compute) under the plan
        self.dp_axes: list[int] = [i for i, a in enumerate(plan.axes) if a.data_parallel]
        # context-parallel axes (plan.CONTEXT_PARALLEL) of more than one rank: the inputs' dim 1 (the
        # sequence) sharded over them
        self.cp_axes: list[int] = [i for i, a in enumerate(plan.axes) if a.context_parallel and self.axis_sizes[i] > 1]
        # seconds per pass (shared with the CompileState: make_context)
        self.timings: dict[str, float] = {}
        self.compute_dtype = compute_dtype  # None: fp32 throughout
        self.reduce_dtype = reduce_dtype  # dtype gradients are reduced in (None: as produced)
        self.recompute = recompute  # the recompute pass's policy: "none" | "full" | "selective"
        self.accumulate = accumulate  # micro-batches per step (a pipeline's: its micro-batches)
        self.loss_scale = loss_scale  # fp16 only: "dynamic" or a fixed scale (the runtime's LossScaler)
        self.progress = progress  # called with each pass's name as it starts (compile's progress=)
        self.bucket_mb = bucket_mb  # the overlap pass's gradient buckets (passes/bucket.py); 0: none
        self.prefetch = prefetch  # blocks ahead a parameter gather is issued (passes/gather.py)
        # which parameters stay gathered from forward to backward (passes/state.py: reshard_policy)
        self.reshard_after_forward = reshard_after_forward
        # the state pass: (name, gathered bytes) per parameter kept gathered from forward to backward
        self.kept_gathered: list[tuple[str, int]] = []
        # split / schedule: False while building a program whose gradients are not reduced (the
        # no-sync program of accumulation, a pipeline stage's); True for the others
        self.sync_grads = True
        self.output_roles: list = []  # propagate: the roles of the program's outputs (output_hint)
        # propagate: DTensor's answers for the program being propagated, by op and input specs
        # (repeated blocks ask the same question); None outside propagate
        self.strategy_cache: dict | None = None
        self._groups = [mesh.get_group(i).group_name for i in range(len(self.axis_sizes))]
        # split: a pipeline stage's program: (per input, per output) whether dim 0 is the batch
        self.boundary: tuple[list[bool], list[bool]] | None = None
        self.lowered: dict[str, int] = {}  # what the lower pass rewrote into kernel ops, per rule
        self.kernel_choices: list = []  # kernels="auto": each op's kernels/choice.Choice (both sides' times)
        self.derived_rules: list[str] = []  # ops with no rule: what autopar/derived_rules.py derived, and how
        self.masks: list[str] = []  # what the masks pass did with each attention mask (passes/masks.py)
        self.cuts: list[str] = []  # fused weights cut into one parameter per part (autopar/unfuse.py)
        self.value_checks: list[str] = []  # the model's asserts on values, checked on the device (autopar/value_checks.py)
        # generation's programs (autopar/generation.py): the KV cache inputs' placements, by
        # input index (role ("cache", i)); a cache input or output not listed is replicated
        self.cache_layout: dict[int, tuple[Placement, ...]] = {}
        self.from_disk: list[str] = []  # the compile's traces read from disk, by kind (autopar/disk_cache.py)

    # placements the program's boundary must have
    def input_placements(self, shape: tuple[int, ...]) -> tuple[Placement, ...]:
        """Batch (dim 0) sharded on every data-parallel axis, the sequence (dim 1) on every
        context-parallel axis, replicated elsewhere (and on 1-rank axes, where sharding is the
        identity: a batch of 1 cannot be "sharded")."""
        def one(i):
            if i in self.dp_axes and len(shape) > 0 and self.axis_sizes[i] > 1:
                return Shard(0)
            if i in self.cp_axes and len(shape) > 1:
                return Shard(1)
            return Replicate()
        return tuple(one(i) for i in range(len(self.axis_sizes)))

    def io_placements(self, shape, batched: bool) -> tuple[Placement, ...]:
        """A value crossing a pipeline stage boundary: batch-sharded like the inputs if its dim 0
        is the batch, replicated otherwise (so neighbouring stages agree on the layout)."""
        return self.input_placements(shape) if batched else tuple(Replicate() for _ in self.axis_sizes)

    def placeholder_placements(self, role, shape):
        kind, what = role
        if kind == "param":
            return self.placed.compute[what]  # the state pass applies the storage layout
        if kind == "input":
            return self.io_placements(shape, self.boundary[0][what]) if self.boundary else self.input_placements(shape)
        if kind == "tangent" and self.boundary:
            return self.io_placements(shape, self.boundary[1][what])
        if kind == "cache" and what in self.cache_layout:
            return self.cache_layout[what]
        return tuple(Replicate() for _ in self.axis_sizes)

    def output_placements(self, role, node=None):
        kind, what = role
        if kind == "grad":
            return self.placed.placements[what] if self.sync_grads else None
        if kind == "act":
            return self.io_placements(tuple(node.meta["val"].shape), self.boundary[1][what])
        if kind == "input_grad":
            return self.io_placements(tuple(node.meta["val"].shape), self.boundary[0][what])
        if kind == "cache" and what in self.cache_layout:  # updated in place: it keeps its input's layout
            return self.cache_layout[what]
        return tuple(Replicate() for _ in self.axis_sizes)

    def output_hint(self, node: fx.Node):
        """The placements the program's output wants for ``node`` (a gradient), if it is one; also
        through the dtype casts between it and the output (mixed precision: a bf16 gradient cast
        to its fp32 parameter's dtype, which keeps its placement). A gradient left unreduced (the
        no-sync program of accumulation, a pipeline stage) has no required layout, but its
        parameter's placement is still the layout to produce it in where a rule can at no cost
        (the embedding's vocab rows): the sync program then has nothing to slice."""
        while True:
            for u in node.users:
                if u.op == "output":
                    i = list(u.args[0]).index(node)
                    want = (info(u).wants or [None] * len(u.args[0]))[i]
                    role = self.output_roles[i] if i < len(self.output_roles) else None
                    if want is None and role is not None and role[0] == "grad":
                        want = self.placed.placements.get(role[1])
                    return want
            cast = next(iter(node.users), None) if len(node.users) == 1 else None
            if cast is None or not _dtype_cast(cast):
                return None
            node = cast

    # process groups, for rule implementations and localize
    def group_name(self, axis: int) -> str:
        return self._groups[axis]

    def axis_of_group(self, name: str) -> int:
        return self._groups.index(name)

    def all_reduce(self, x: torch.Tensor, op: str, axis: int) -> torch.Tensor:
        if self.axis_sizes[axis] == 1:
            return x
        c10d = torch.ops._c10d_functional
        return c10d.wait_tensor(c10d.all_reduce(x, op, self.group_name(axis)))

    def prod(self, axes) -> int:
        n = 1
        for a in axes:
            n *= self.axis_sizes[a]
        return n


def make_context(mesh: DeviceMesh, parsed: Plan, params: dict, options, accumulate: int, state=None) -> Context:
    """A stage's Context: its parameters placed by the plan on ``mesh``, the compile options
    (``options``: autopar.options.Options)."""
    from autopar.plan import place_parameters

    g = options.given
    placed = place_parameters(parsed, params, tuple(mesh.shape))
    # planning only (no data): the program stays on meta. (deferred: the model was built on meta to be
    # loaded after compiling; traced on meta, the program runs on the mesh's device: localize puts the
    # graph's meta device arguments there)
    meta = any(p.is_meta for p in params.values()) and not options.deferred
    ctx = Context(mesh, parsed, placed, compute_dtype=options.compute_dtype, reduce_dtype=options.reduce_dtype,
                  recompute=g.recompute, accumulate=accumulate,
                  loss_scale=options.loss_scale if options.compute_dtype == torch.float16 else None,
                  progress=g.progress, bucket_mb=g.bucket_mb, prefetch=g.prefetch,
                  # a pipeline stage re-gathers all: its micro-batches' forward and backward run apart
                  reshard_after_forward=True if options.pipeline is not None else g.reshard_after_forward,
                  device=torch.device("meta") if meta else None)
    if state is not None:  # what the earlier passes recorded, seen from the stage
        ctx.timings = state.timings
        ctx.lowered = state.lowered
        ctx.kernel_choices = state.kernel_choices
        ctx.masks = state.masks
        ctx.value_checks = state.value_checks
        ctx.cuts = describe_cuts(state.cuts) + state.cut_notes
        ctx.from_disk = state.from_disk
    return ctx


def _dtype_cast(n: fx.Node) -> bool:
    """``n`` changes its one input's dtype and nothing else (so it keeps the input's placement)."""
    aten, prims = torch.ops.aten, torch.ops.prims
    if n.op != "call_function":
        return False
    if n.target is prims.convert_element_type.default:
        return True
    if n.target is not aten._to_copy.default or len(n.args) != 1 or not set(n.kwargs) <= {"dtype", "layout", "device"}:
        return False
    val = getattr(n.args[0], "meta", {}).get("val")
    return (val is not None and n.kwargs.get("device", val.device) == val.device
            and n.kwargs.get("layout", val.layout) == val.layout)


MASKS_NOTE = "attention masks: "  # a note's prefix for the masks pass's lines (passes/masks.py)


def compile_notes(ctxs: list) -> list[str]:
    """What the compile decided on the user's behalf, one line each, for the reports
    (``pm.report()``, a pipeline's, ``autopar explain``): the masks pass's, the fused weights cut
    (autopar/unfuse.py) and the value checks (autopar/value_checks.py), recorded before the split
    and so the same in every stage (the first context's); the kernels chosen; and every context's
    derived op rules (propagate runs per stage), once each."""
    from autopar import value_checks
    from autopar.disk_cache import note as disk_note
    from autopar.kernels.choice import summary
    from autopar.parts import NOTE as CUT_NOTE

    first = ctxs[0] if ctxs else None
    lines = [MASKS_NOTE + m for m in (first.masks if first else [])]
    lines += [CUT_NOTE + m for m in (first.cuts if first else [])]
    lines += [value_checks.NOTE + m for m in (first.value_checks if first else [])]
    lines += [f"kernels='auto': {line}" for line in summary(first.kernel_choices if first else [])]
    lines += [f"no rule, derived: {line}" for line in dict.fromkeys(d for c in ctxs for d in c.derived_rules)]
    lines += [line for line in [disk_note(first.from_disk if first else [])] if line]
    return lines
