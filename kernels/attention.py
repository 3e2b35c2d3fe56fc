"""Flash attention in Triton: forward and backward, tiled, with an online softmax.

The [Sq, Sk] score matrix is never materialised: the forward walks key/value blocks keeping a
running max ``m`` and normaliser ``l`` per query row (and saves ``lse = m + log l``); the
backward recomputes each score tile from ``lse`` (FlashAttention-2's split: one kernel owns a
key/value block and accumulates dK, dV over query blocks; another owns a query block and
accumulates dQ). Causal (top-left aligned, as SDPA's ``is_causal``) and not; an optional additive
bias (a float attention mask broadcast over batch / heads); grouped-query attention (``Hkv``
divides ``H``: query head ``h`` reads key/value head ``h // (H / Hkv)``; dK/dV sum over the
group inside one program, no atomics); any head dim (padded to a power of two, masked); sequence
lengths that are not multiples of the block; fp32 / bf16 / fp16 inputs with fp32 accumulation.

Launch only through ``kernels.ops`` (it picks the device path and checks shapes; on CPU tensors it
launches this module's interpreted twin, ``kernels/interpreter.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Whether these kernels run in Triton's interpreter: Triton's own choice here (TRITON_INTERPRET,
# read, never set, by autopar); True in the interpreted twin that CPU tensors use.
INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _scores(q, k, Bias, bias_off, rows, cols, m_ok, n_ok, sbm, sbn, scale,
            HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr):
    """One [rows, cols] tile of q k^T * scale (+ bias), fp32, and which entries are visible."""
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
    if HAS_BIAS:
        s += tl.load(Bias + bias_off + rows[:, None] * sbm + cols[None, :] * sbn,
                     mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    keep = m_ok[:, None] & n_ok[None, :]
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None])
    return s, keep


@triton.jit
def _fwd(Q, K, V, Bias, O, LSE,
         sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
         sbb, sbh, sbm, sbn, sob, soh, som, sod,
         H, G, M, N, DH, scale,
         HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < M
    d_ok = offs_d < DH
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = N
    if CAUSAL:
        end = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        cols = start + offs_n
        n_ok = cols < N
        k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + offs_d[None, :] * skd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
            k = k.to(tl.float32)
        s, keep = _scores(q, k, Bias, b * sbb + h * sbh, offs_m, cols, m_ok, n_ok, sbm, sbn, scale,
                          HAS_BIAS, CAUSAL)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + offs_d[None, :] * svd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh * M + offs_m, tl.where(m_i == float("-inf"), float("inf"), m_i + tl.log(l_safe)),
             mask=m_ok)


@triton.jit
def _bwd_dkdv(Q, K, V, Bias, O, DO, LSE, DK, DV,
              sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
              sbb, sbh, sbm, sbn, sob, soh, som, sod,
              H, G, M, N, DH, scale,
              HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One key/value block of one KV head: dK, dV summed over the query heads of its group.
    O / dO / dQ share q's strides (so), K / dK k's, V / dV v's."""
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    Hkv = H // G
    b = pid_bk // Hkv
    hk = pid_bk % Hkv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    d_ok = offs_d < DH
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
        k = k.to(tl.float32)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = 0
    if CAUSAL:
        first = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(0, G):
        h = hk * G + g
        for start in range(first, M, BLOCK_M):
            rows = start + offs_m0
            m_ok = rows < M
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
            if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
                q = q.to(tl.float32)
            do = tl.load(DO + b * sob + h * soh + rows[:, None] * som + offs_d[None, :] * sod, mask=q_mask,
                         other=0.0)
            if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
                do = do.to(tl.float32)
            o = tl.load(O + b * sob + h * soh + rows[:, None] * som + offs_d[None, :] * sod, mask=q_mask, other=0.0)
            if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
                o = o.to(tl.float32)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
            lse = tl.load(LSE + (b * H + h) * M + rows, mask=m_ok, other=float("inf"))
            s, keep = _scores(q, k, Bias, b * sbb + h * sbh, rows, offs_n, m_ok, n_ok, sbm, sbn, scale,
                              HAS_BIAS, CAUSAL)
            p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do).to(tl.float32)
            dp = tl.dot(do, tl.trans(v)).to(tl.float32)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q).to(tl.float32) * scale
    tl.store(DK + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _bwd_dq(Q, K, V, Bias, O, DO, LSE, DQ,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
            sbb, sbh, sbm, sbn, sob, soh, som, sod,
            H, G, M, N, DH, scale,
            HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < M
    d_ok = offs_d < DH
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
        q = q.to(tl.float32)
    do = tl.load(DO + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, mask=q_mask, other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
        do = do.to(tl.float32)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, mask=q_mask, other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
        o = o.to(tl.float32)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    lse = tl.load(LSE + pid_bh * M + offs_m, mask=m_ok, other=float("inf"))
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = N
    if CAUSAL:
        end = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        cols = start + offs_n0
        n_ok = cols < N
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
            k = k.to(tl.float32)
        v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
            v = v.to(tl.float32)
        s, keep = _scores(q, k, Bias, b * sbb + h * sbh, offs_m, cols, m_ok, n_ok, sbm, sbn, scale,
                          HAS_BIAS, CAUSAL)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k).to(tl.float32) * scale
    tl.store(DQ + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, dq.to(DQ.dtype.element_ty),
             mask=q_mask)


def _strides(t, n=4):
    return list(t.stride()) if t is not None else [0] * n


def _blocks(d: int):
    block_d = max(16, triton.next_power_of_2(d))
    block = 64 if block_d <= 64 else 32
    return block, block, block_d


def forward(q, k, v, bias, causal: bool, scale: float):
    """q [B, H, M, D], k / v [B, Hkv, N, D], bias [B|1, H|1, M, N] or None -> (out, lse fp32 [B, H, M])."""
    import torch

    b, h, m, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((b, h, m), device=q.device, dtype=torch.float32)
    bm, bn, bd = _blocks(d)
    bs = _bias_strides(bias)
    _fwd[(triton.cdiv(m, bm), b * h)](q, k, v, bias if bias is not None else q, out, lse,
                                     *q.stride(), *k.stride(), *v.stride(), *bs, *out.stride(),
                                     h, h // hkv, m, n, d, scale, HAS_BIAS=bias is not None, CAUSAL=causal,
                                     UPCAST=_upcast(q), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    return out, lse


def backward(do, q, k, v, out, lse, bias, causal: bool, scale: float):
    import torch

    b, h, m, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if do.stride() != out.stride():  # the kernels read dO with O's strides
        do = torch.empty_like(out).copy_(do)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    bm, bn, bd = _blocks(d)
    bs = _bias_strides(bias)
    common = (*q.stride(), *k.stride(), *v.stride(), *bs, *out.stride(), h, h // hkv, m, n, d, scale)
    kw = dict(HAS_BIAS=bias is not None, CAUSAL=causal, UPCAST=_upcast(q), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    bias_arg = bias if bias is not None else q
    # dK/dV read q's strides for Q/dO/O (so dO must share out's layout: made so above) and k's for dK
    _bwd_dkdv[(triton.cdiv(n, bn), b * hkv)](q, k, v, bias_arg, out, do, lse, dk, dv, *common, **kw)
    _bwd_dq[(triton.cdiv(m, bm), b * h)](q, k, v, bias_arg, out, do, lse, dq, *common, **kw)
    return dq, dk, dv


def _upcast(t) -> bool:
    """Triton's interpreter (CPU) computes bf16 dots wrongly; there, tiles go to fp32 first."""
    import torch

    return t.dtype == torch.bfloat16 and INTERPRETED


def _bias_strides(bias):
    """Strides of a [B|1, H|1, M, N] additive mask, 0 on the broadcast dims."""
    if bias is None:
        return [0, 0, 0, 0]
    return [0 if bias.shape[i] == 1 else bias.stride(i) for i in range(4)]
