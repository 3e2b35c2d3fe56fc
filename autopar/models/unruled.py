"""A model built on custom ops that nobody wrote a sharding rule for (tests/test_derived_rules.py).

``demo_unruled::gate(x, w)`` gates each token by a sigmoid of its own projection (row-wise: each
token's output depends on that token only), with its backward ``demo_unruled::gate_backward``
(dx row-wise, dw a sum over every token: a partial sum when tokens are split). ``demo_unruled::
center(x)`` subtracts the mean over the batch (every row depends on every row: no split of the
batch gives its result). ``demo_unruled::segment_mm(x, w)`` multiplies the tokens, in E equal
contiguous groups, each by its expert's matrix ``w[e]`` (stacked experts ``[E, K, N]``, as
transformers' grouped_mm is), with its backward. Neither autopar nor DTensor knows them;
autopar/derived_rules.py derives their rules by running them, and the tensor-parallel derivation
(autopar/analysis/tp_measured.py) follows segment_mm the same way (the experts' up projection
column-parallel, the down projection row-parallel).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


@torch.library.custom_op("demo_unruled::gate", mutates_args=())
def gate(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.sigmoid(x @ w)[..., None]


@gate.register_fake
def _(x, w):
    return torch.empty_like(x)


@torch.library.custom_op("demo_unruled::gate_backward", mutates_args=())
def gate_backward(dy: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    s = torch.sigmoid(x @ w)
    ds = (dy * x).sum(-1) * s * (1 - s)  # d/d(x @ w)
    dx = dy * s[..., None] + ds[..., None] * w
    dw = (ds[..., None] * x).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


@gate_backward.register_fake
def _(dy, x, w):
    return torch.empty_like(x), torch.empty_like(w)


def _gate_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gate_bwd(ctx, dy):
    x, w = ctx.saved_tensors
    return tuple(torch.ops.demo_unruled.gate_backward(dy, x, w))


gate.register_autograd(_gate_bwd, setup_context=_gate_setup)


@torch.library.custom_op("demo_unruled::center", mutates_args=())
def center(x: Tensor) -> Tensor:
    return x - x.mean(0, keepdim=True)


@center.register_fake
def _(x):
    return torch.empty_like(x)


center.register_autograd(lambda ctx, dy: torch.ops.demo_unruled.center(dy), setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("demo_unruled::segment_mm", mutates_args=())
def segment_mm(x: Tensor, w: Tensor) -> Tensor:
    return torch.cat([xe @ we for xe, we in zip(x.chunk(w.shape[0]), w)])


@segment_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("demo_unruled::segment_mm_backward", mutates_args=())
def segment_mm_backward(dy: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    e = w.shape[0]
    dx = torch.cat([dye @ we.T for dye, we in zip(dy.chunk(e), w)])
    dw = torch.stack([xe.T @ dye for xe, dye in zip(x.chunk(e), dy.chunk(e))])
    return dx, dw


@segment_mm_backward.register_fake
def _(dy, x, w):
    return torch.empty_like(x), torch.empty_like(w)


segment_mm.register_autograd(lambda ctx, dy: tuple(torch.ops.demo_unruled.segment_mm_backward(dy, *ctx.saved_tensors)),
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class Unruled(nn.Module):
    """Embedding -> linear -> gate (-> center over the batch) -> LM head; ``experts``: a residual
    block of stacked experts through segment_mm (up, GELU, down) after the gate."""

    def __init__(self, vocab: int = 64, dim: int = 32, centered: bool = False, experts: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.w = nn.Parameter(torch.randn(dim) / dim ** 0.5)
        self.head = nn.Linear(dim, vocab)
        self.centered = centered
        if experts:
            self.w_up = nn.Parameter(torch.randn(experts, dim, 2 * dim) / dim ** 0.5)
            self.w_down = nn.Parameter(torch.randn(experts, 2 * dim, dim) / (2 * dim) ** 0.5)

    def forward(self, tokens):
        h = torch.ops.demo_unruled.gate(self.proj(self.embed(tokens)), self.w)
        if self.centered:
            h = torch.ops.demo_unruled.center(h)
        if hasattr(self, "w_up"):
            flat = h.flatten(0, 1)
            up = nn.functional.gelu(torch.ops.demo_unruled.segment_mm(flat, self.w_up))
            h = h + torch.ops.demo_unruled.segment_mm(up, self.w_down).view_as(h)
        return self.head(h)


def build(centered: bool = False, seed: int = 0, experts: int = 0, frozen: tuple = ()):
    """(model, batches, loss_fn): global batches of 4 x 8 tokens; ``frozen``: parameters that
    need no gradient."""
    torch.manual_seed(seed)
    model = Unruled(centered=centered, experts=experts)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
               for _ in range(2)]
    return model, batches, lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _build(centered: bool, experts: int, frozen: tuple, model: str):
    """``model``: "unruled" (this file's), or "linear_attn" / "linear_attn_wide" (autopar/models/linear_attn.py)."""
    if model.startswith("linear_attn"):
        from autopar.models import linear_attn

        return linear_attn.build(wide=2 if model == "linear_attn_wide" else 1)
    return build(centered, experts=experts, frozen=frozen)


def reference(centered: bool, steps: int = 2, experts: int = 0, frozen: tuple = (), model: str = "unruled") -> dict:
    """One eager process: losses and gradients of each step (SGD in between)."""
    model, batches, loss_fn = _build(centered, experts, frozen, model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses, grads = [], []
    for x, y in batches[:steps]:
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def job(axes: dict, plan: dict, centered: bool, steps: int = 2, experts: int = 0, frozen: tuple = (),
        model: str = "unruled") -> dict:
    """On every rank of a pool: compile under ``plan``, the same steps; what was derived."""
    import autopar
    from autopar.parts import fuse
    from autopar.runtime.common import full_tensor

    model, batches, loss_fn = _build(centered, experts, frozen, model)
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=batches[0], loss_fn=loss_fn, plan=plan,
                         capture_eval=False)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
    losses, grads = [], []
    for x, y in batches[:steps]:
        losses.append(pm.train_step(x, y).item())
        local = {n: full_tensor(p.grad).clone() for n, p in pm.named_parameters() if p.grad is not None}
        grads.append(fuse(local, pm.module))  # (a weight cut into parts: its whole gradient)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "derived": list(pm.ctx.derived_rules), "report": pm.report(),
            "placements": {n: str(tuple(p.placements)) for n, p in pm.named_parameters() if hasattr(p, "placements")},
            "collectives": [str(r.kind) if hasattr(r, "kind") else str(r) for r in pm.collectives()]}
