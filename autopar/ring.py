"""Ring attention on a ``{"cp": "context"}`` axis: the local computation of attention whose q, k, v
are sequence shards in the load-balanced layout (autopar/layout.py: rank r of n holds chunks r
and 2n-1-r of 2n).

Forward: n steps; at step t this rank holds the K/V block of rank j = r - t (mod n), issues the
shift of that block to the next rank (rank r+1 receives it) and meanwhile computes its queries'
attention on it with the fused attention op, which returns the block's log-sum-exp; the partial
outputs are merged by their log-sum-exp. Under a causal mask the layout makes every step after
the first half the work, the same half on every rank: step 0 (its own block) is causal on the
local sequence (its two chunks are in order), a block from a rank j < r is wholly before both
query chunks for its first chunk and wholly after for its second (only the first is used), a
block from j > r is wholly before the second query chunk only (only those queries attend).
An explicit mask (HF Llama's) is cut per block (this rank's rows, block j's columns) and every
block computed with it.

Backward: the K/V blocks go round again, each with the gradient accumulators dK, dV of its
owner; each step adds this rank's contribution (the fused backward given the merged output and
log-sum-exp, which makes a block's gradient exact); after n steps one more shift hands each
accumulator back to its owner. The next K/V block and the previous step's accumulators are in
flight while a step's block computes (forward likewise: the next block while this one computes);
the overlap pass keeps that order (each wait just before its first user). Per rank and layer: forward 2·(n-1) K/V block shifts, backward
2·(n-1) K/V and 2·n dK/dV block shifts; a block is b·(s/n)·h_kv·d elements.

A shift is one ``all_to_all_single`` whose input goes to one peer only (``_c10d_functional``:
traced into the per-rank program like every collective, issued through the process group, counted
by its meter; localize files it as kind "shift": all of it leaves the rank).
"""

from __future__ import annotations

import torch

from autopar.layout import zigzag_take

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _issue(ctx, axis: int, tensors) -> torch.Tensor:
    """Send ``tensors`` (flattened into one buffer) to the next rank of the axis, receive the
    previous rank's: one all_to_all_single with one non-empty split each way (not waited)."""
    n, r = ctx.axis_sizes[axis], ctx.coord[axis]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    m = flat.numel()
    send = [m if j == (r + 1) % n else 0 for j in range(n)]
    recv = [m if j == (r - 1) % n else 0 for j in range(n)]
    return c10d.all_to_all_single(flat, recv, send, ctx.group_name(axis))


def _take(buf: torch.Tensor, like) -> tuple:
    buf = c10d.wait_tensor(buf)
    out, i = [], 0
    for t in like:
        out.append(buf[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return tuple(out)


# ---------------------------------------------------------------- one block
FUSED = {"cpu"}  # device types whose blocks run the fused op (torch's CPU flash attention); else math


def _block(q, k, v, causal: bool, mask, scale):
    """(out, lse) of q attending to k, v; lse in fp32, [b, h, s]."""
    if q.device.type in FUSED:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                    scale=scale)
        return out, lse
    s = _scores(q, k, causal, mask, scale)  # the math formulation elsewhere (no fused op returns an exact lse)
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def _scores(q, k, causal, mask, scale):
    s = (q.float() @ k.float().transpose(-2, -1)) * _scale(q, scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s + mask
    return s


def _scale(q, scale):
    return scale if scale is not None else q.shape[-1] ** -0.5


def _block_backward(do, q, k, v, out, lse, causal: bool, mask, scale):
    """(dq, dk, dv) of one block, given the MERGED output and log-sum-exp of the rows."""
    if q.device.type in FUSED:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, causal,
                                                                         attn_mask=mask, scale=scale)
    return _math_block_backward(do, q, k, v, out, lse, causal, mask, scale)


def _math_block_backward(do, q, k, v, out, lse, causal: bool, mask, scale):
    p = torch.exp(_scores(q, k, causal, mask, scale) - lse.unsqueeze(-1))
    do32 = do.float()
    dv = p.transpose(-2, -1) @ do32
    dp = do32 @ v.float().transpose(-2, -1)
    ds = p * (dp - (do32 * out.float()).sum(-1, keepdim=True)) * _scale(q, scale)
    return (ds @ k.float()).to(q.dtype), (ds.transpose(-2, -1) @ q.float()).to(k.dtype), dv.to(v.dtype)


def _kernel_block(q, k, v, causal: bool, mask, scale):
    """(out, lse) by autopar's Triton attention kernel (``autopar::flash_attention``: KV heads read
    once per group, lse fp32)."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    return torch.ops.autopar.flash_attention(q, k, v, mask, causal, float(_scale(q, scale)))


def _kernel_block_backward(do, q, k, v, out, lse, causal: bool, mask, scale):
    """Its backward given the merged output and lse; the kernels' PyTorch reference backward
    recomputes the block's own softmax (no lse), so under ``AUTOPAR_KERNELS=reference`` the math
    formulation runs instead, on KV heads repeated to the query heads."""
    from autopar.kernels.ops import _REFERENCE

    if not _REFERENCE[0]:  # (contiguous: the Triton backward corrupts memory on a sliced q or k)
        do, q, k, v, out, lse = (t.contiguous() for t in (do, q, k, v, out, lse))
        return torch.ops.autopar.flash_attention_backward(do, q, k, v, out, lse, mask, causal, float(_scale(q, scale)))
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = _math_block_backward(do, q, _repeat(k, rep), _repeat(v, rep), out, lse, causal, mask, scale)
    return dq, _group_sum(dk.float(), rep).to(k.dtype), _group_sum(dv.float(), rep).to(v.dtype)


def _merge(out, lse, bo, bl):
    new = torch.logaddexp(lse, bl)
    return out * torch.exp(lse - new).unsqueeze(-1) + bo.float() * torch.exp(bl - new).unsqueeze(-1), new


def _mask(mask, n: int, r: int, j: int, dtype):
    """This rank's rows and block j's columns of a mask over the whole sequence, additive, with
    finite minimum (a row a block masks wholly gets a vanishing weight in the merge, not a NaN)."""
    m = zigzag_take(zigzag_take(mask, -1, n, j), -2, n, r)
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
    return m.to(dtype).clamp(min=torch.finfo(dtype).min)


def _plan(n: int, r: int, t: int, causal: bool, masked: bool):
    """What step t computes: (query rows: "all" or "second", key chunks: "all" or "first",
    causal). None: nothing (never happens with the balanced layout)."""
    j = (r - t) % n
    if masked or not causal:
        return "all", "all", False
    if t == 0:
        return "all", "all", True
    return ("all", "first", False) if j < r else ("second", "all", False)


def _cut(x, part: str, c: int):
    return x if part == "all" else x[:, :, :c] if part == "first" else x[:, :, c:]


# ---------------------------------------------------------------- grouped-query attention
# A model that repeats its KV heads before attention (Llama's repeat_kv: unsqueeze, expand, clone,
# view) hands the ring ``rep`` identical copies of each KV head: the ring ships one per group
# (h_kv heads, not h) and repeats them on arrival; the backward's dK/dV accumulators hold the
# group sums, handed back spread evenly over the copies (the copies' gradients only ever reach a
# parameter through their sum: the repeat's backward).
def _one_per_group(x, rep: int):
    return x if rep == 1 else x[:, ::rep].contiguous()


def _repeat(x, rep: int):
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _group_sum(x, rep: int):
    return x if rep == 1 else x.unflatten(1, (x.shape[1] // rep, rep)).sum(2)


def kv_repeat(node) -> int:
    """How many copies of each KV head the attention node's key and value are (1: not repeated)."""
    names = [a.name for a in node.target._schema.arguments]
    args = {**dict(zip(names, node.args)), **node.kwargs}
    reps = []
    for what in ("key", "value"):
        a = args.get(what)
        chain = []
        for _ in range(3):
            if not hasattr(a, "target") or a.op != "call_function" or not a.args:
                break
            chain.append(a)
            a = a.args[0]
        ok = (len(chain) == 3 and str(chain[0].target) in ("aten.view.default", "aten._unsafe_view.default")
              and str(chain[1].target) == "aten.clone.default" and str(chain[2].target) == "aten.expand.default"
              and hasattr(a, "target") and str(a.target) == "aten.unsqueeze.default" and a.args[1] == 2)
        reps.append(int(chain[2].args[1][2]) if ok else 1)
    return reps[0] if reps[0] == reps[1] else 1


# ---------------------------------------------------------------- forward / backward
def ring_forward(ctx, axis: int, q, k, v, causal: bool, mask, scale, rep: int = 1, kernel: bool = False):
    """(out, lse) of this rank's queries over the whole sequence (``kernel``: blocks by autopar's
    Triton kernel, else torch's fused CPU op / the math formulation)."""
    block = _kernel_block if kernel else _block
    n, r = ctx.axis_sizes[axis], ctx.coord[axis]
    c = q.shape[2] // 2
    kv = (_one_per_group(k, rep), _one_per_group(v, rep))
    out = lse = None
    for t in range(n):
        buf = _issue(ctx, axis, kv) if t < n - 1 else None  # the next block travels while this one computes
        j = (r - t) % n
        m = _mask(mask, n, r, j, q.dtype) if mask is not None else None
        rows, cols, cz = _plan(n, r, t, causal, m is not None)
        bk, bv = (k, v) if t == 0 else (_repeat(kv[0], rep), _repeat(kv[1], rep))
        bo, bl = block(_cut(q, rows, c), _cut(bk, cols, c), _cut(bv, cols, c), cz, m, scale)
        if out is None:
            out, lse = bo.float(), bl
        elif rows == "all":
            out, lse = _merge(out, lse, bo, bl)
        else:
            o2, l2 = _merge(out[:, :, c:], lse[:, :, c:], bo, bl)
            lse = torch.cat([lse[:, :, :c], l2], 2)
            out = torch.cat([out[:, :, :c], o2], 2)
        if buf is not None:
            kv = _take(buf, kv)
    return out.to(q.dtype), lse  # (the output traced last: the per-rank program's check reads it as the op's)


def ring_backward(ctx, axis: int, do, q, k, v, out, lse, causal: bool, mask, scale, rep: int = 1,
                  kernel: bool = False):
    """(dq, dk, dv) of this rank's q, k, v."""
    block_backward = _kernel_block_backward if kernel else _block_backward
    n, r = ctx.axis_sizes[axis], ctx.coord[axis]
    c = q.shape[2] // 2
    kv = (_one_per_group(k, rep), _one_per_group(v, rep))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc = tuple(torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in kv)
    sent = None  # the accumulators of the previous step, in flight while this step's block computes
    for t in range(n):
        buf = _issue(ctx, axis, kv) if t < n - 1 else None  # K/V travel while this block computes
        j = (r - t) % n
        m = _mask(mask, n, r, j, q.dtype) if mask is not None else None
        rows, cols, cz = _plan(n, r, t, causal, m is not None)
        bk, bv = (k, v) if t == 0 else (_repeat(kv[0], rep), _repeat(kv[1], rep))
        g = block_backward(_cut(do, rows, c), _cut(q, rows, c), _cut(bk, cols, c), _cut(bv, cols, c),
                            _cut(out, rows, c), _cut(lse, rows, c), cz, m, scale)
        dq = dq + g[0].float() if rows == "all" else torch.cat([dq[:, :, :c], dq[:, :, c:] + g[0].float()], 2)
        dkv = [_group_sum(d.float(), rep) for d in g[1:]]
        if sent is not None:
            acc = _take(sent, acc)
        acc = tuple(a + d if cols == "all" else torch.cat([a[:, :, :c] + d, a[:, :, c:]], 2)
                    for a, d in zip(acc, dkv))
        sent = _issue(ctx, axis, acc)  # the accumulators follow their block (after the last step: home)
        if buf is not None:
            kv = _take(buf, kv)
    acc = _take(sent, acc)
    dk, dv = (_repeat(a / rep, rep) if rep > 1 else a for a in acc)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------- the rules' implementations
def _bind(op, args, kwargs) -> dict:
    out = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def ring_impl(op, axis: int, rep: int = 1):
    """The local implementation of attention op ``op`` (SDPA forward, its CPU flash forward or
    backward) on ring axis ``axis``, whose key and value are ``rep`` copies of each KV head
    (``kv_repeat``): impl(ctx, *args, **kwargs) like the op's outputs."""
    kernel = op.namespace == "autopar"  # autopar::flash_attention(q, k, v, bias, causal, scale) and its backward

    def impl(ctx, *args, **kwargs):
        a = _bind(op, args, kwargs)
        if kernel:
            a = {"grad_out": a.get("do"), "query": a["q"], "key": a["k"], "value": a["v"], "out": a.get("out"),
                 "logsumexp": a.get("lse"), "attn_mask": a["bias"], "is_causal": a["causal"], "scale": a["scale"]}
            a = {k: v for k, v in a.items() if v is not None or k in ("attn_mask", "scale")}
        causal, mask, scale = bool(a.get("is_causal")), a.get("attn_mask"), a.get("scale")
        k, v, r = a["key"], a["value"], rep
        grouped = a["query"].shape[1] // k.shape[1] if k.shape[1] != a["query"].shape[1] else 1
        if grouped > 1 and not kernel:  # fewer KV heads (enable_gqa): the math blocks read them repeated
            k, v, r = _repeat(k, grouped), _repeat(v, grouped), grouped  # (one copy per group travels)
        if "grad_out" in a:
            dq, dk, dv = ring_backward(ctx, axis, a["grad_out"], a["query"], k, v, a["out"], a["logsumexp"], causal,
                                       mask, scale, r, kernel)
            if grouped > 1 and not kernel:  # the copies' gradients summed back onto their KV head
                dk, dv = (_group_sum(d.float(), grouped).to(d.dtype) for d in (dk, dv))
            return dq, dk, dv
        out, lse = ring_forward(ctx, axis, a["query"], k, v, causal, mask, scale, r, kernel)
        return out if len(op._schema.returns) == 1 else (out, lse)  # SDPA itself (eval): the output only

    return impl
