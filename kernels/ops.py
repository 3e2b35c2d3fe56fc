"""The kernels as torch custom ops (``torch.ops.autopar.*``) with autograd, fake (meta)
implementations, FLOP formulas for the cost model, and a plain-PyTorch reference path.

    autopar::flash_attention(q, k, v, bias?, causal, scale) -> (out, lse)
    autopar::flash_attention_backward(do, q, k, v, out, lse, bias?, causal, scale) -> (dq, dk, dv)
    autopar::linear_act(x, w, b?, act) -> (y, z)          y = act(x @ w.T + b), z the pre-activation
    autopar::linear_act_backward(dy, x, w, z, act, has_bias=True) -> (dx, dw, db)

Each is an ordinary node in a traced graph: the sharding rules (autopar/rules.py) shard
attention over batch and heads and linear_act like a column-parallel linear.

Which path runs: ``AUTOPAR_KERNELS=reference`` (or ``reference()``) -> the PyTorch reference
(tests compare the two); otherwise Triton: on CUDA tensors compiled, on CPU tensors through
Triton's interpreter (the kernel modules' interpreted twins, ``kernels/interpreter.py``: autopar
never sets ``TRITON_INTERPRET``, so other Triton code in the process keeps Triton's own choice;
slow, for tests on small shapes).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import Tensor

_REFERENCE = [os.environ.get("AUTOPAR_KERNELS", "") == "reference"]


@contextlib.contextmanager
def reference(on: bool = True):
    """Run the custom ops' PyTorch reference path inside the block."""
    old = _REFERENCE[0]
    _REFERENCE[0] = on
    try:
        yield
    finally:
        _REFERENCE[0] = old


def available() -> tuple[bool, str]:
    """Whether Triton can run here, and how (for the lowering pass's default and its errors)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed (pip install triton)"
    if torch.cuda.is_available():
        return True, "cuda"
    return True, "interpreter (Triton's, on CPU tensors: slow)"


def _triton(t: Tensor):
    """The kernel modules (attention, matmul) that run on ``t``'s device: compiled for CUDA
    tensors, interpreted twins for CPU tensors."""
    from autopar.kernels import attention, matmul

    if t.device.type == "cuda":
        return attention, matmul
    from autopar.kernels.interpreter import interpreted

    return interpreted(attention), interpreted(matmul)


# ------------------------------------------------------------------------------------ attention
def attention_reference(q, k, v, bias, causal: bool, scale: float):
    """softmax(q k^T * scale + bias [+ causal mask]) v in fp32; k / v repeated for GQA."""
    g = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(g, 1)
    vf = v.float().repeat_interleave(g, 1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.float()
    if causal:
        m, n = s.shape[-2:]
        s = s.masked_fill(~torch.ones(m, n, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse[..., None]) @ vf
    return out.to(q.dtype), lse


@torch.library.custom_op("autopar::flash_attention", mutates_args=())
def flash_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool,
                    scale: float) -> tuple[Tensor, Tensor]:
    if _REFERENCE[0]:
        return attention_reference(q, k, v, bias, causal, scale)
    return _triton(q)[0].forward(q, k, v, bias, causal, scale)


@flash_attention.register_fake
def _(q, k, v, bias, causal, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("autopar::flash_attention_backward", mutates_args=())
def flash_attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             bias: Tensor | None, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    if _REFERENCE[0]:
        return attention_backward_reference(do, q, k, v, out, bias, causal, scale)
    return _triton(q)[0].backward(do, q, k, v, out, lse, bias, causal, scale)


def attention_backward_reference(do, q, k, v, out, bias, causal: bool, scale: float):
    """The backward written out (autograd does not run inside a custom op): with p the
    probabilities, dv = p^T do, ds = p * (do v^T - rowsum(do * o)), dq = ds k * scale,
    dk = ds^T q * scale; GQA sums dk / dv over each KV head's query heads."""
    b, h, m, _ = q.shape
    hkv = k.shape[1]
    g = h // hkv
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.float()
    if causal:
        s = s.masked_fill(~torch.ones(m, s.shape[-1], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    dof = do.float()
    dv = p.transpose(-1, -2) @ dof
    ds = p * (dof @ vf.transpose(-1, -2) - (dof * out.float()).sum(-1, keepdim=True))
    dq = ds @ kf * scale
    dk = ds.transpose(-1, -2) @ q.float() * scale
    fold = (lambda t: t.reshape(b, hkv, g, *t.shape[2:]).sum(2))
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


@flash_attention_backward.register_fake
def _(do, q, k, v, out, lse, bias, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attn_setup(ctx, inputs, output):
    q, k, v, bias, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias)
    ctx.causal, ctx.scale = causal, scale
    ctx.set_materialize_grads(False)  # lse's gradient is never used: no zeros made for it


def _attn_backward(ctx, do, dlse):
    if dlse is not None:
        raise NotImplementedError("autopar::flash_attention: the gradient through its log-sum-exp output is not "
                                  "implemented; differentiate through the attention output only")
    if do is None:  # the output took no part in what was differentiated
        return None, None, None, None, None, None
    q, k, v, out, lse, bias = ctx.saved_tensors
    dq, dk, dv = torch.ops.autopar.flash_attention_backward(do, q, k, v, out, lse, bias, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


flash_attention.register_autograd(_attn_backward, setup_context=_attn_setup)


# ------------------------------------------------------------------------------------ linear + activation
def _act_ref(z, act: str):
    return {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu, "none": lambda t: t}[act](z)


def linear_act_reference(x, w, b, act: str):
    z = torch.nn.functional.linear(x, w, b)
    return _act_ref(z, act), z


@torch.library.custom_op("autopar::linear_act", mutates_args=())
def linear_act(x: Tensor, w: Tensor, b: Tensor | None, act: str) -> tuple[Tensor, Tensor]:
    if _REFERENCE[0]:
        return linear_act_reference(x, w, b, act)
    mm = _triton(x)[1]
    x2 = x.reshape(-1, x.shape[-1])
    y, z = mm.matmul(x2, w.t(), b, act, store_z=True)
    shape = (*x.shape[:-1], w.shape[0])
    return y.reshape(shape), z.reshape(shape)


@linear_act.register_fake
def _(x, w, b, act):
    shape = (*x.shape[:-1], w.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("autopar::linear_act_backward", mutates_args=())
def linear_act_backward(dy: Tensor, x: Tensor, w: Tensor, z: Tensor, act: str,
                        has_bias: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db); without a bias (``has_bias`` False) db is zeros, not the sum over dz's rows
    that nothing would read (an M x N read saved)."""
    k, n = x.shape[-1], w.shape[0]
    if _REFERENCE[0]:
        zf = z.float()
        if act == "gelu":
            grad = 0.5 * (1 + torch.erf(zf / math.sqrt(2))) + zf * torch.exp(-0.5 * zf * zf) / math.sqrt(2 * math.pi)
        elif act == "silu":
            sig = torch.sigmoid(zf)
            grad = sig * (1 + zf * (1 - sig))
        else:
            grad = torch.ones_like(zf)
        dz2 = (dy.float() * grad).to(dy.dtype).reshape(-1, n)
        return (dz2 @ w).reshape(x.shape), dz2.t() @ x.reshape(-1, k), dz2.sum(0) if has_bias else dz2.new_zeros(n)
    mm = _triton(x)[1]
    dz = mm.act_grad(dy, z, act).reshape(-1, n)
    x2 = x.reshape(-1, k)
    db = dz.sum(0, dtype=torch.float32).to(dz.dtype) if has_bias else dz.new_zeros(n)
    return mm.matmul(dz, w).reshape(x.shape), mm.matmul(dz.t(), x2), db


@linear_act_backward.register_fake
def _(dy, x, w, z, act, has_bias=True):
    return torch.empty_like(x), torch.empty_like(w), w.new_empty((w.shape[0],))


def _la_setup(ctx, inputs, output):
    x, w, b, act = inputs
    _, z = output
    ctx.save_for_backward(x, w, z)
    ctx.act, ctx.has_bias = act, b is not None
    # z (the pre-activation, kept for the backward) gets no gradient: without this autograd would
    # allocate and fill a zero tensor of the output's size for it at every backward (0.07 ms at
    # 8192 x 14336 on the H200, run 3)
    ctx.set_materialize_grads(False)


def _la_backward(ctx, dy, dz):
    if dz is not None:
        raise NotImplementedError("autopar::linear_act: the gradient through its pre-activation output z is not "
                                  "implemented; differentiate through y = act(z) only")
    if dy is None:
        return None, None, None, None
    x, w, z = ctx.saved_tensors
    dx, dw, db = torch.ops.autopar.linear_act_backward(dy, x, w, z, ctx.act, ctx.has_bias)
    return dx, dw, (db if ctx.has_bias else None), None


linear_act.register_autograd(_la_backward, setup_context=_la_setup)


# ------------------------------------------------------------------------------------ FLOPs (cost model)
def _register_flops():
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.autopar.flash_attention)
    def _attn_flops(q, k, v, *args, out_shape=None, **kwargs):
        b, h, m, d = q
        return 4 * b * h * m * k[2] * d  # q k^T and p v, 2 FLOPs per multiply-add

    @register_flop_formula(torch.ops.autopar.flash_attention_backward)
    def _attn_bwd_flops(do, q, k, v, *args, out_shape=None, **kwargs):
        b, h, m, d = q
        return 10 * b * h * m * k[2] * d  # recompute s, dv, dp, dq, dk

    @register_flop_formula(torch.ops.autopar.linear_act)
    def _la_flops(x, w, *args, out_shape=None, **kwargs):
        return 2 * math.prod(x[:-1]) * x[-1] * w[0]

    @register_flop_formula(torch.ops.autopar.linear_act_backward)
    def _la_bwd_flops(dy, x, w, *args, out_shape=None, **kwargs):
        return 4 * math.prod(x[:-1]) * x[-1] * w[0]


_register_flops()
