"""Dropless mixture-of-experts computation as one op, and its expert-parallel form (``{"ep": "expert"}``).

    autopar::moe_experts(x [T, h], idx [T, k], w [T, k], w_gate [E, h, f], w_up [E, h, f], w_down [E, f, h]) -> [T, h]

out[t] = sum_j w[t, j] · down_e(silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])) with e = idx[t, j]: every
token-expert pair is computed (no capacity, nothing dropped). How many tokens each expert gets
depends on the data, so the op is opaque to tracing (a custom op with a static-shape fake kernel:
its output is [T, h] whatever the routing); inside, the pairs are sorted by expert (a stable sort:
each expert sees its tokens in token order) and each expert runs on its rows.
``autopar::moe_experts_backward`` is its backward (the expert activations recomputed, not saved).

Expert parallelism (autopar/rules.py ``moe_rule`` on an axis whose strategy is ``expert``): the
stacked expert weights are sharded on dim 0 (rank r of n holds experts [r·E/n, (r+1)·E/n)), the
tokens on dim 0 (the batch is split over the axis as under ddp). Per rank, the op becomes

1. this rank's pair count per expert (``[E]``, static shape), all-gathered over the axis: an
   explicit ``all_gather_into_tensor`` in the per-rank program (counted, predicted exactly);
2. ``autopar::moe_experts_ep``: the pairs sorted by expert are sent to the ranks owning their
   experts (``all_to_all_single`` with uneven splits read from the counts), the local experts
   run on what arrived (in source-rank order, so each expert sees the global batch's tokens in
   order), the results go back by the reverse all-to-all, and each rank combines its tokens'
   k results with their routing weights. Its backward sends x, the output gradient and the
   routing weight of each pair ([P, 2h+1]) and gets back dx and the routing weight's gradient
   ([P, h+1]); the expert weights' gradients stay on their owner (Shard(0), complete).

The two uneven all-to-alls run inside the op, at run time: their sizes are data, which the
per-rank program (traced with fake tensors of static shapes) cannot hold. So they are not graph
nodes of their own, but the op's node carries their CommRecord (passes/localize.py ``_annotate_ep``:
kind ``all_to_all_v``, the balanced-routing estimate ``ep_record_bytes``, (n-1)/n of the pairs
leave the rank), so dump / explain / the cost model see and blame them; what they cannot do is
move them (no overlap with compute). The process group's meter counts them as kind
``all_to_all_v`` (bytes that leave the rank) while an expert-parallel op runs
(autopar/runtime/measure.py); on gloo they are waited through autopar/runtime/guarded.py like
the programs' own collectives (a peer's failure wakes the wait).
Bytes per rank and layer that leave the rank, with P_out its pairs routed off-rank and P_in the
pairs other ranks route to its experts: forward P_out·h + P_in·h elements, backward
P_out·(2h+1) + P_in·(h+1).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import textwrap
import types

import torch
import torch.nn.functional as F
from torch import Tensor

c10d = torch.ops._c10d_functional
EP_KIND = "all_to_all_v"  # the uneven all-to-alls of expert parallelism (CommRecord / meter kind)


# ---------------------------------------------------------------- one set of experts on sorted rows
def _experts_forward(rows: Tensor, sizes: list[int], w_gate, w_up, w_down) -> Tensor:
    """Rows grouped by expert (``sizes[e]`` rows for local expert e) through their experts."""
    out = rows.new_empty((rows.shape[0], w_down.shape[-1]))
    start = 0
    for e, m in enumerate(sizes):
        if m:
            xs = rows[start:start + m]
            out[start:start + m] = (F.silu(xs @ w_gate[e]) * (xs @ w_up[e])) @ w_down[e]
        start += m
    return out


def _experts_backward(xs_all: Tensor, gs_all: Tensor, ws_all: Tensor, sizes: list[int], w_gate, w_up, w_down):
    """Per row: dx and the routing weight's gradient; per local expert: its weights' gradients.
    ``gs_all``: the output gradient of each row's token, ``ws_all`` its routing weight."""
    dxs = torch.zeros_like(xs_all)
    dws = xs_all.new_zeros(xs_all.shape[0])
    dg, du, dd = torch.zeros_like(w_gate), torch.zeros_like(w_up), torch.zeros_like(w_down)
    start = 0
    for e, m in enumerate(sizes):
        if m:
            sl = slice(start, start + m)
            xs, gs = xs_all[sl], gs_all[sl]
            gate, up = xs @ w_gate[e], xs @ w_up[e]
            sg = F.silu(gate)
            a = sg * up
            dws[sl] = (gs * (a @ w_down[e])).sum(-1)
            dy = gs * ws_all[sl, None]
            dd[e] = a.transpose(0, 1) @ dy
            da = dy @ w_down[e].transpose(0, 1)
            sig = torch.sigmoid(gate)
            dgate = da * up * (sig * (1 + gate * (1 - sig)))
            dup = da * sg
            dg[e] = xs.transpose(0, 1) @ dgate
            du[e] = xs.transpose(0, 1) @ dup
            dxs[sl] = dgate @ w_gate[e].transpose(0, 1) + dup @ w_up[e].transpose(0, 1)
        start += m
    return dxs, dws, dg, du, dd


def _route(idx: Tensor):
    """(order, token of each sorted pair): the pairs (t, j) sorted by expert, stably."""
    k = idx.shape[1]
    order = torch.argsort(idx.reshape(-1), stable=True)
    return order, torch.div(order, k, rounding_mode="floor")


# ---------------------------------------------------------------- where the pairs go (one rank or n)
class _Local:
    """Every expert on this rank: nothing moves."""

    def __init__(self, idx: Tensor, num_experts: int):
        self.sizes = torch.bincount(idx.reshape(-1), minlength=num_experts).tolist()

    def there(self, rows: Tensor) -> Tensor:
        return rows

    def back(self, rows: Tensor) -> Tensor:
        return rows


class _Exchange:
    """Pairs sorted by expert go to the rank owning the expert and come back: ``counts`` is the
    all-gathered [n·E] pair counts (row s: rank s's count per expert)."""

    def __init__(self, counts: Tensor, num_local: int, group: str, rank: int, size: int):
        c = counts.reshape(size, size * num_local)
        mine = c[:, rank * num_local:(rank + 1) * num_local]  # [n, L]: what each rank sends to my experts
        self.send = c[rank].reshape(size, num_local).sum(1).tolist()
        self.recv = mine.sum(1).tolist()
        self.group = group
        per_row = mine.reshape(-1)  # (source rank, local expert) blocks, in arrival order
        expert = torch.arange(num_local, device=counts.device).repeat(size)
        self.perm = torch.argsort(torch.repeat_interleave(expert, per_row), stable=True)
        self.sizes = mine.sum(0).tolist()

    def _a2a(self, t: Tensor, out_splits, in_splits) -> Tensor:
        if t.device.type == "cpu":  # gloo: waited in bounded slices that a peer's failure wakes, as the
            from autopar.runtime import guarded  # per-rank programs' own collectives (runtime/guarded.py)

            out = guarded.all_to_all_single(t, out_splits, in_splits, self.group)
            return guarded.wait_tensor(out, f"expert parallelism's all-to-all (group {self.group})")
        return c10d.wait_tensor(c10d.all_to_all_single(t.contiguous(), out_splits, in_splits, self.group))

    def there(self, rows: Tensor) -> Tensor:
        """Sorted by expert on the sender -> grouped by local expert on the owner."""
        return self._a2a(rows, self.recv, self.send)[self.perm]

    def back(self, rows: Tensor) -> Tensor:
        out = torch.empty_like(rows)
        out[self.perm] = rows
        return self._a2a(out, self.send, self.recv)


def _forward(x, idx, w, w_gate, w_up, w_down, route) -> Tensor:
    order, tok = _route(idx)
    y = route.back(_experts_forward(route.there(x[tok]), route.sizes, w_gate, w_up, w_down))
    ws = w.reshape(-1)[order].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y * ws[:, None])


def _backward(g, x, idx, w, w_gate, w_up, w_down, route):
    order, tok = _route(idx)
    h = x.shape[1]
    ws = w.reshape(-1)[order].to(x.dtype)
    rows = route.there(torch.cat([x[tok], g[tok].to(x.dtype), ws[:, None]], 1))
    dxs, dws, dg, du, dd = _experts_backward(rows[:, :h], rows[:, h:2 * h], rows[:, 2 * h], route.sizes,
                                             w_gate, w_up, w_down)
    back = route.back(torch.cat([dxs, dws[:, None]], 1))
    dx = torch.zeros_like(x).index_add_(0, tok, back[:, :h])
    dw = torch.zeros(order.shape[0], dtype=w.dtype, device=w.device)
    dw[order] = back[:, h].to(w.dtype)
    return dx, dw.view(w.shape), dg, du, dd


# ---------------------------------------------------------------- the ops
@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(x: Tensor, idx: Tensor, w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    return _forward(x, idx, w, w_gate, w_up, w_down, _Local(idx, w_gate.shape[0]))


@moe_experts.register_fake
def _(x, idx, w, w_gate, w_up, w_down):
    return torch.empty_like(x)


@torch.library.custom_op("autopar::moe_experts_backward", mutates_args=())
def moe_experts_backward(g: Tensor, x: Tensor, idx: Tensor, w: Tensor, w_gate: Tensor, w_up: Tensor,
                         w_down: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _backward(g, x, idx, w, w_gate, w_up, w_down, _Local(idx, w_gate.shape[0]))


def _grads_like(x, w, w_gate, w_up, w_down):
    return (torch.empty_like(x), torch.empty_like(w), torch.empty_like(w_gate), torch.empty_like(w_up),
            torch.empty_like(w_down))


@moe_experts_backward.register_fake
def _(g, x, idx, w, w_gate, w_up, w_down):
    return _grads_like(x, w, w_gate, w_up, w_down)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _moe_backward(ctx, g):
    x, idx, w, w_gate, w_up, w_down = ctx.saved_tensors
    dx, dw, dg, du, dd = torch.ops.autopar.moe_experts_backward(g, x, idx, w, w_gate, w_up, w_down)
    return dx, None, dw, dg, du, dd


moe_experts.register_autograd(_moe_backward, setup_context=_setup)


@torch.library.custom_op("autopar::moe_experts_ep", mutates_args=())
def moe_experts_ep(x: Tensor, idx: Tensor, w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                   counts: Tensor, group: str, rank: int, size: int) -> Tensor:
    """This rank's tokens through the experts of all ranks (``w_*``: this rank's experts)."""
    return _forward(x, idx, w, w_gate, w_up, w_down, _Exchange(counts, w_gate.shape[0], group, rank, size))


@moe_experts_ep.register_fake
def _(x, idx, w, w_gate, w_up, w_down, counts, group, rank, size):
    return torch.empty_like(x)


@torch.library.custom_op("autopar::moe_experts_ep_backward", mutates_args=())
def moe_experts_ep_backward(g: Tensor, x: Tensor, idx: Tensor, w: Tensor, w_gate: Tensor, w_up: Tensor,
                            w_down: Tensor, counts: Tensor, group: str, rank: int,
                            size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _backward(g, x, idx, w, w_gate, w_up, w_down, _Exchange(counts, w_gate.shape[0], group, rank, size))


@moe_experts_ep_backward.register_fake
def _(g, x, idx, w, w_gate, w_up, w_down, counts, group, rank, size):
    return _grads_like(x, w, w_gate, w_up, w_down)


def _register_flops():
    """FLOPs for the cost model: every pair through its expert's three matmuls (2·h·f each, per
    multiply-add 2); the backward recomputes them and runs six more. Under expert parallelism
    the rank's own tokens are counted (balanced routing: what it computes for others evens out)."""
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula([torch.ops.autopar.moe_experts, torch.ops.autopar.moe_experts_ep])
    def _forward_flops(x, idx, w, w_gate, *args, out_shape=None, **kwargs):
        return 6 * x[0] * idx[1] * x[1] * w_gate[2]

    @register_flop_formula([torch.ops.autopar.moe_experts_backward, torch.ops.autopar.moe_experts_ep_backward])
    def _backward_flops(g, x, idx, w, w_gate, *args, out_shape=None, **kwargs):
        return 18 * x[0] * idx[1] * x[1] * w_gate[2]


_register_flops()
EP_OPS = ("moe_experts_ep", "moe_experts_ep_backward")  # the ops whose all-to-alls run inside (the meter)


# ---------------------------------------------------------------- the rule's implementation
def _counts(ctx, axis: int, idx: Tensor, num_experts: int) -> Tensor:
    """Every rank's pair count per expert, [n·E] (an explicit all-gather in the per-rank program)."""
    experts = torch.arange(num_experts, device=idx.device)
    mine = (idx.reshape(-1, 1) == experts).sum(0)
    n = ctx.axis_sizes[axis]
    return c10d.wait_tensor(c10d.all_gather_into_tensor(mine, n, ctx.group_name(axis)))


def ep_impl(axis: int, backward: bool):
    """The per-rank implementation of autopar::moe_experts (or its backward) on expert-parallel
    mesh axis ``axis``: impl(ctx, *local args) like the op's outputs."""

    def impl(ctx, *args):
        idx, w_gate = (args[1], args[3]) if not backward else (args[2], args[4])
        n, r, group = ctx.axis_sizes[axis], ctx.coord[axis], ctx.group_name(axis)
        counts = _counts(ctx, axis, idx, w_gate.shape[0] * n)
        op = torch.ops.autopar.moe_experts_ep_backward if backward else torch.ops.autopar.moe_experts_ep
        return op(*args, counts, group, r, n)

    return impl


def ep_record_bytes(node_val_shapes, size: int, backward: bool, itemsize: int) -> int:
    """The balanced-routing estimate of the bytes one call sends off-rank: T·k pairs, (n-1)/n of
    them to other ranks and as many coming back; h (forward) or 2h+1 out and h+1 back (backward)."""
    (t, h), k = node_val_shapes
    pairs_off = t * k * (size - 1) // size
    return pairs_off * ((2 * h + 1) + (h + 1) if backward else 2 * h) * itemsize


# ---------------------------------------------------------------- plan checks
EXPERT_STRATEGY = "expert"
MOE_OPS = (torch.ops.autopar.moe_experts.default, torch.ops.autopar.moe_experts_backward.default)


def expert_plan(plan) -> bool:
    """Whether a plan (as the user wrote it) names the expert strategy on some axis."""
    return isinstance(plan, dict) and any(isinstance(s, str) and s == EXPERT_STRATEGY for s in plan.values())


def expert_axes(ctx) -> list[int]:
    """Mesh axes (of size > 1) whose strategy is "expert"."""
    return [i for i, ap in enumerate(ctx.plan.axes) if ap.strategy == EXPERT_STRATEGY and ctx.axis_sizes[i] > 1]


def check_expert_parallel(program, ctx) -> None:
    """A PlanError (before anything runs) when an expert-parallel axis shards expert weights that
    the program does not compute through autopar::moe_experts (e.g. the built-in MoE's GShard
    capacity dispatch, whose einsums would need the experts whole), or when two axes are "expert"."""
    from autopar.errors import PlanError

    axes = expert_axes(ctx)
    if not axes:
        return
    if len(axes) > 1:
        raise PlanError(f"expert parallelism runs on one mesh axis, the plan names {len(axes)}: "
                        + ", ".join(repr(ctx.axis_names[a]) for a in axes), where="plan",
                        fix="merge them into one expert-parallel axis")
    if any(n.op == "call_function" and n.target in MOE_OPS for n in program.graph.nodes):
        return
    a = axes[0]
    sharded = [what for n, (kind, what) in zip((n for n in program.graph.nodes if n.op == "placeholder"),
                                                program.inputs)
               if kind == "param" and not ctx.placed.compute[what][a].is_replicate()]
    if sharded:
        raise PlanError(
            f"mesh axis '{ctx.axis_names[a]}' is expert-parallel ({{'{ctx.axis_names[a]}': 'expert'}}) and shards "
            f"{sharded[0]} (and {len(sharded) - 1} more) by expert, but the model does not compute its experts "
            "with the dropless expert op (autopar::moe_experts): e.g. the built-in MoE's GShard capacity dispatch",
            where=sharded[0],
            fix="build the built-in MoE with LlamaConfig(moe_dispatch='dropless'); a Hugging Face MoE block "
            "(Mixtral, Qwen2-MoE, DeepSeek-V3 and every other transformers experts module computing as Mixtral's) "
            "is swapped to it by autopar's capture; or use another strategy on that axis")


# ---------------------------------------------------------------- Hugging Face experts, while autopar captures
# transformers 5.x stacks a MoE block's experts in one module (MixtralExperts: gate_up_proj [E, 2f, h],
# down_proj [E, h, f], called as experts(hidden [T, h], top_k_index [T, k], top_k_weights [T, k])) whose
# forward is a data-dependent loop or grouped_mm over the hit experts. Under an expert-parallel plan the
# capture traces them as autopar::moe_experts instead (the same arithmetic: act(x W_gate^T) * x W_up^T,
# then W_down^T, weighted and summed per token), by an instance attribute on each such module, set on
# entry and removed on exit, also when the capture raises; nothing else sees it.
HF_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts")


def _hf_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    f = self.gate_up_proj.shape[1] // 2
    w_gate = self.gate_up_proj[:, :f].transpose(1, 2)
    w_up = self.gate_up_proj[:, f:].transpose(1, 2)
    return torch.ops.autopar.moe_experts(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype),
                                         w_gate, w_up, self.down_proj.transpose(1, 2))


@functools.lru_cache(maxsize=None)
def _mixtral_arithmetic(cls: type) -> bool:
    """``cls`` is one of HF_EXPERTS, or its forward is MixtralExperts.forward word for word (54
    transformers 5.23 classes are: DeepseekV2/V3Experts, OlmoeExperts, Glm4MoeExperts, ...; their
    own names differ, their arithmetic does not)."""
    if cls.__name__ in HF_EXPERTS:
        return True
    try:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        return textwrap.dedent(inspect.getsource(cls.forward)) == textwrap.dedent(
            inspect.getsource(MixtralExperts.forward))
    except (ImportError, OSError, TypeError, AttributeError):
        return False


def _swappable(m) -> bool:
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and _mixtral_arithmetic(type(m))
            and gu.ndim == 3 and down.ndim == 3 and gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1]
            and not getattr(m, "has_bias", False) and not getattr(m, "is_transposed", False)
            and getattr(m, "has_gate", True) and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


@contextlib.contextmanager
def dropless_experts(model: torch.nn.Module, on: bool = True):
    """Inside the block (``on``), every Hugging Face experts module of ``model`` that autopar knows
    (``HF_EXPERTS`` and the classes computing as they do, SiLU-gated, no biases) computes through
    autopar::moe_experts."""
    swapped = [m for m in model.modules() if _swappable(m)] if on else []
    try:
        for m in swapped:
            m.forward = types.MethodType(_hf_experts_forward, m)
        yield len(swapped)
    finally:
        for m in swapped:
            m.__dict__.pop("forward", None)
