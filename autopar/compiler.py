"""``autopar.compile``: the driver. Reads top to bottom as the pipeline it runs."""

from __future__ import annotations

import functools
import time
import warnings
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autopar.errors import PlanError
from autopar.frontend import capture_forward, capture_joint
from autopar.ir import Program
from autopar.plan import Placed, Plan, parse_plan, place_parameters


class Context:
    """What the passes know about the mesh, the plan and this rank."""

    def __init__(self, mesh: DeviceMesh, plan: Plan, placed: Placed):
        self.mesh = mesh
        self.axis_names = tuple(mesh.mesh_dim_names)
        self.axis_sizes = tuple(mesh.shape)
        coord = mesh.get_coordinate()
        self.coord = tuple(coord) if coord is not None else tuple(0 for _ in self.axis_sizes)
        self.device = torch.device(mesh.device_type)
        self.plan = plan
        self.placed = placed
        self.dp_axes = [i for i, a in enumerate(plan.axes) if a.data_parallel]
        self.timings: dict[str, float] = {}
        self._groups = [mesh.get_group(i).group_name for i in range(len(self.axis_sizes))]

    # placements the program's boundary must have
    def input_placements(self, shape: tuple[int, ...]) -> tuple[Placement, ...]:
        """Batch (dim 0) sharded on every data-parallel axis, replicated elsewhere."""
        return tuple(Shard(0) if (i in self.dp_axes and len(shape) > 0) else Replicate()
                     for i in range(len(self.axis_sizes)))

    def placeholder_placements(self, role, shape):
        kind, what = role
        if kind == "param":
            return self.placed.placements[what]
        if kind == "input":
            return self.input_placements(shape)
        return tuple(Replicate() for _ in self.axis_sizes)

    def output_placements(self, role, spec):
        kind, what = role
        if kind == "grad":
            return self.placed.placements[what]
        return tuple(Replicate() for _ in self.axis_sizes)

    def output_hint(self, node: fx.Node):
        """The placements the program's output wants for ``node`` (a gradient), if it is one."""
        for u in node.users:
            if u.op == "output":
                return u.meta.get("autopar_in", [None] * len(u.args[0]))[list(u.args[0]).index(node)]
        return None

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


def compile(
    model: nn.Module | Callable | None = None,
    mesh: DeviceMesh | None = None,
    *,
    example_inputs: tuple | None = None,
    loss_fn: Callable | None = None,
    plan: dict | None = None,
    inputs: str = "global",
    debug: bool = False,
    skip_passes: tuple[str, ...] = (),
):
    """Compile ``model`` for ``mesh`` under ``plan``; returns a ParallelModule.

    As a decorator (``@autopar.compile(mesh=..., example_inputs=..., plan=...)``) on a model
    class or a model-building function, the class/function then returns ParallelModules.
    """
    if model is None or (isinstance(model, type) or (callable(model) and not isinstance(model, nn.Module))):
        return _decorator(model, mesh=mesh, example_inputs=example_inputs, loss_fn=loss_fn, plan=plan,
                          inputs=inputs, debug=debug, skip_passes=skip_passes)
    from autopar.passes import run_passes
    from autopar.runtime import ParallelModule

    if mesh is None:
        raise PlanError("autopar.compile needs a mesh", fix="pass mesh=autopar.mesh(dp=2)")
    if example_inputs is None:
        raise PlanError("autopar.compile needs example_inputs (global shapes)",
                        fix="pass example_inputs=(tokens, targets)")
    if inputs not in ("global", "local"):
        raise PlanError(f"inputs must be 'global' or 'local', got {inputs!r}")
    example_inputs = tuple(example_inputs)
    t0 = time.perf_counter()
    parsed = parse_plan(plan, tuple(mesh.mesh_dim_names))
    params = dict(model.named_parameters())
    placed = place_parameters(parsed, params, tuple(mesh.shape))
    for axis, names in placed.unplaced.items():
        warnings.warn(f"autopar: the '{axis}' strategy did not recognise {len(names)} parameter(s), "
                      f"replicated on '{axis}': {', '.join(names)} (place them with plan['rules'])",
                      stacklevel=2)
    ctx = Context(mesh, parsed, placed)
    program: Program = capture_joint(model, example_inputs, loss_fn)
    ctx.timings["capture"] = time.perf_counter() - t0
    program = run_passes(program, ctx, skip=skip_passes, debug=debug)
    ctx.timings["total"] = time.perf_counter() - t0
    # the eval program is captured now, while the parameters are still plain tensors; its
    # passes run on the first forward call
    fwd_inputs = example_inputs[:-1] if loss_fn is not None else example_inputs
    fwd_program = capture_forward(model, fwd_inputs)
    ctx.timings["capture_forward"] = time.perf_counter() - t0 - ctx.timings["total"]
    forward_builder = functools.partial(run_passes, fwd_program, ctx, debug=debug, label="eval ")
    return ParallelModule(model, ctx, program, example_inputs, loss_fn is not None, inputs, forward_builder)


def _decorator(target, **kw):
    def wrap(t):
        @functools.wraps(t)
        def build(*args, **kwargs):
            return compile(t(*args, **kwargs), **kw)

        return build

    return wrap(target) if target is not None else wrap
