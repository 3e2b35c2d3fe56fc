"""Flash attention in Triton: forward and backward, tiled, with an online softmax.

The [Sq, Sk] score matrix is never materialised: the forward walks key/value blocks keeping a
running max ``m`` and normaliser ``l`` per query row (and saves ``lse = m + log l``); the
backward recomputes each score tile from ``lse`` (FlashAttention-2's split: a small kernel
computes ``delta = rowsum(dO * O)`` once; one kernel owns a key/value block and accumulates dK,
dV over query blocks; another owns a query block and accumulates dQ). Causal (top-left aligned,
as SDPA's ``is_causal``) and not; an optional additive bias (a float attention mask broadcast
over batch / heads); grouped-query attention (``Hkv`` divides ``H``: query head ``h`` reads
key/value head ``h // (H / Hkv)``; dK/dV sum over the group inside one program, no atomics); any
head dim (padded to a power of two, masked); sequence lengths that are not multiples of the
block; fp32 / bf16 / fp16 inputs with fp32 accumulation.

What makes it fast (Triton's fused-attention tutorial and FlashAttention-2 do the same):

- scores in base 2: ``q k^T`` is scaled by ``scale * log2(e)`` once and ``exp2`` replaces ``exp``
  (``lse`` is stored in natural log, as SDPA's and the reference's);
- the causal loop is split: the blocks entirely below the diagonal run with no mask at all, only
  the blocks the diagonal crosses are masked (and the blocks above it are never visited);
- no masks where the shapes divide the blocks (``EVEN_*`` constexprs), so loads vectorise;
- ``acc = dot(p, v, acc)`` accumulates inside the matrix instruction;
- query blocks are scheduled longest first under the causal mask (less tail at the end);
- block sizes, warps and pipeline depth are chosen per shape class by timing on the device
  (kernels/tune.py), among candidates that suit Hopper and Ampere (kernels/attention_launches.py),
  some of which fetch their tiles through TMA descriptors (kernels/tma.py; on an H200 they won
  some backward shape classes by up to 9%, never the forward);
- the host's work for a call (grid, scalar arguments, constexprs) is remembered per call signature
  (``tune.Plans``): a repeated call goes straight to Triton's launcher, since a short call's time is
  the host's (docs/kernels.md).

Launch only through ``kernels.ops`` (it picks the device path and checks shapes; on CPU tensors it
launches this module's interpreted twin, ``kernels/interpreter.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from autopar.kernels import tma as _tma
from autopar.kernels import tune
from autopar.kernels.attention_launches import DKDV, DKDV_I, DQ, DQ_I, FWD, FWD_I, offered, operands, tma_ok

# Whether these kernels run in Triton's interpreter: Triton's own choice here (TRITON_INTERPRET,
# read, never set, by autopar); True in the interpreted twin that CPU tensors use.
INTERPRETED = bool(triton.knobs.runtime.interpret)

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_tile(P, rows, cols_d, sr, sd, r_ok, d_ok, EVEN_R: tl.constexpr, EVEN_D: tl.constexpr,
               UPCAST: tl.constexpr):
    """A [rows, head dim] tile, masked only where the shape does not divide the block."""
    ptrs = P + rows[:, None] * sr + cols_d[None, :] * sd
    if EVEN_R and EVEN_D:
        t = tl.load(ptrs)
    elif EVEN_R:
        t = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    elif EVEN_D:
        t = tl.load(ptrs, mask=r_ok[:, None], other=0.0)
    else:
        t = tl.load(ptrs, mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
        t = t.to(tl.float32)
    return t


@triton.jit
def _rows(P, base, bi, hi, start, rows, cols_d, sr, sd, r_ok, d_ok, EVEN_R: tl.constexpr, EVEN_D: tl.constexpr,
          UPCAST: tl.constexpr, TMA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [start, start + BLOCK_R) of head (bi, hi) as a [BLOCK_R, BLOCK_D] tile. TMA: ``P`` is a
    tensor descriptor over the [B, H, S, D] tensor (the copy engine fetches the box; rows past the
    end and columns past the head dim read as zero); else ``P + base`` is the head's first element."""
    if TMA:
        t = P.load([bi, hi, start, 0]).reshape(BLOCK_R, BLOCK_D)
        if UPCAST:
            t = t.to(tl.float32)
    else:
        t = _load_tile(P + base, rows, cols_d, sr, sd, r_ok, d_ok, EVEN_R, EVEN_D, UPCAST)
    return t


@triton.jit
def _store_rows(P, base, bi, hi, start, rows, cols_d, sr, sd, r_ok, d_ok, value, EVEN_R: tl.constexpr,
                EVEN_D: tl.constexpr, TMA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``value`` [BLOCK_R, BLOCK_D] into rows [start, start + BLOCK_R) of head (bi, hi), clipped to
    the tensor's rows and head dim (by the descriptor's bounds under TMA, by masks else)."""
    if TMA:
        P.store([bi, hi, start, 0], value.to(P.dtype).reshape(1, 1, BLOCK_R, BLOCK_D))
    else:
        ptrs = P + base + rows[:, None] * sr + cols_d[None, :] * sd
        if EVEN_R and EVEN_D:
            tl.store(ptrs, value.to(P.dtype.element_ty))
        else:
            tl.store(ptrs, value.to(P.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _heads(pid_bh, H, G):
    """Batch, query head and KV head of a (batch x query head) program index, as int64 offsets."""
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    return b, h.to(tl.int64), (h // G).to(tl.int64)


@triton.jit
def _query_block(H, G, M, DH, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (query block, batch x query head) program's indices: the forward's and dQ's grid; under
    the causal mask the longest rows are scheduled first."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b, h, hk = _heads(pid_bh, H, G)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    return pid_m, pid_bh, b, h, hk, offs_m, offs_d, offs_m < M, offs_d < DH


@triton.jit
def _score_tile(q, k, Bias, bias_base, rows, cols, m_ok, n_ok, sbm, sbn, qk_scale, HAS_BIAS: tl.constexpr):
    """[rows, cols] scores in base 2: q k^T * scale * log2(e) (+ the additive mask * log2(e)). The
    mask is read for rows < M and cols < N only: a ragged last block must not read past its end."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if HAS_BIAS:
        s += tl.load(Bias + bias_base + rows[:, None] * sbm + cols[None, :] * sbn,
                     mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32) * LOG2E
    return s


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, K, V, Bias, k_base, v_base, bias_base, bi, hki, offs_m, m_ok, offs_d, d_ok,
                lo, hi, skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                DIAG: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                UPCAST: tl.constexpr, FOLD: tl.constexpr, WS: tl.constexpr, TMA: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Key/value blocks [lo, hi) of one query block; DIAG: the causal mask applies in them. FOLD (no
    bias, a positive scale): max(s * c) = max(s) * c, so the [rows, keys] tile is never scaled on
    its own: one multiply-add per score instead of a multiply and a subtract. WS: Triton's warp
    specialisation of the loop (a candidate the tuner may pick where this Triton and chip run it)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start = tl.multiple_of(start, BLOCK_N)
        cols = start + offs_n
        n_ok = cols < N
        k = _rows(K, k_base, bi, hki, start, cols, offs_d, skn, skd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST, TMA,
                  BLOCK_N, BLOCK_D)
        if FOLD:  # raw scores: the scale goes into the row max and, fused, into exp2's argument
            s = tl.dot(q, tl.trans(k))
        else:
            s = _score_tile(q, k, Bias, bias_base, offs_m, cols, m_ok, n_ok, sbm, sbn, qk_scale, HAS_BIAS)
        if DIAG:
            s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
        if not EVEN_N:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        if FOLD:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if HAS_BIAS:  # a mask of -inf can hide a whole row so far
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _rows(V, v_base, bi, hki, start, cols, offs_d, svn, svd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST, TMA,
                  BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd(Q, K, V, Bias, O, LSE,
         sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
         sbb, sbh, sbm, sbn, sob, soh, som, sod,
         H, G, M, N, DH, scale,
         HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, FOLD: tl.constexpr, WS: tl.constexpr,
         TMA: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """TMA: Q, K, V and O are tensor descriptors over [B, H, S, D] (blocks [1, 1, BLOCK_M or
    BLOCK_N, BLOCK_D]), not pointers."""
    pid_m, pid_bh, b, h, hk, offs_m, offs_d, m_ok, d_ok = _query_block(H, G, M, DH, CAUSAL, BLOCK_M, BLOCK_D)
    bi, hi, hki = b.to(tl.int32), h.to(tl.int32), hk.to(tl.int32)
    q = _rows(Q, b * sqb + h * sqh, bi, hi, pid_m * BLOCK_M, offs_m, offs_d, sqm, sqd, m_ok, d_ok, EVEN_M, EVEN_D,
              UPCAST, TMA, BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    bias_base = b * sbb + h * sbh
    if CAUSAL:
        first = pid_m * BLOCK_M
        # below the diagonal: every key visible to every row of the block, no mask
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, Bias, k_base, v_base, bias_base, bi, hki, offs_m, m_ok,
                                    offs_d, d_ok, 0, tl.minimum(first, N), skn, skd, svn, svd, sbm, sbn, N,
                                    qk_scale, False, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, FOLD, WS, TMA, BLOCK_N,
                                    BLOCK_D)
        # the blocks the diagonal crosses
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, Bias, k_base, v_base, bias_base, bi, hki, offs_m, m_ok,
                                    offs_d, d_ok, first, tl.minimum(first + BLOCK_M, N), skn, skd, svn, svd,
                                    sbm, sbn, N, qk_scale, True, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, FOLD, WS, TMA,
                                    BLOCK_N, BLOCK_D)
    else:
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, Bias, k_base, v_base, bias_base, bi, hki, offs_m, m_ok,
                                    offs_d, d_ok, 0, N, skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                                    False, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, FOLD, WS, TMA, BLOCK_N,
                                    BLOCK_D)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(m_i == float("-inf"), float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    _store_rows(O, b * sob + h * soh, bi, hi, pid_m * BLOCK_M, offs_m, offs_d, som, sod, m_ok, d_ok, out, EVEN_M,
                EVEN_D, TMA, BLOCK_M, BLOCK_D)
    if EVEN_M:
        tl.store(LSE + pid_bh * M + offs_m, lse)
    else:
        tl.store(LSE + pid_bh * M + offs_m, lse, mask=m_ok)


@triton.jit
def _bwd_delta(O, DO, Delta, H, M, DH, sob, soh, som, sod, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O) in fp32, once per query row (dO shares O's strides)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows < M)[:, None] & (offs_d < DH)[None, :]
    off = b * sob + h * soh + rows[:, None] * som + offs_d[None, :] * sod
    o = tl.load(O + off, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh * M + rows, tl.sum(o * do, 1), mask=rows < M)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, Delta, Bias, q_base, o_base, row_base, bias_base, bi, hi_, offs_n, offs_d,
                 d_ok, lo, hi, sqm, sqd, som, sod, sbm, sbn, M, N, qk_scale,
                 DIAG: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_M: tl.constexpr, EVEN_D: tl.constexpr,
                 UPCAST: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query blocks [lo, hi) against one key block, transposed: scores [keys, rows]."""
    offs_m = tl.arange(0, BLOCK_M)
    for start in range(lo, hi, BLOCK_M):
        start = tl.multiple_of(start, BLOCK_M)
        rows = start + offs_m
        m_ok = rows < M
        q = _rows(Q, q_base, bi, hi_, start, rows, offs_d, sqm, sqd, m_ok, d_ok, EVEN_M, EVEN_D, UPCAST, TMA,
                  BLOCK_M, BLOCK_D)
        if EVEN_M:
            lse2 = tl.load(LSE + row_base + rows) * LOG2E
            delta = tl.load(Delta + row_base + rows)
        else:
            lse2 = tl.load(LSE + row_base + rows, mask=m_ok, other=float("inf")) * LOG2E
            delta = tl.load(Delta + row_base + rows, mask=m_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        if HAS_BIAS:
            s_t += tl.load(Bias + bias_base + rows[None, :] * sbm + offs_n[:, None] * sbn,
                           mask=m_ok[None, :] & (offs_n < N)[:, None], other=0.0).to(tl.float32) * LOG2E
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if DIAG:
            p_t = tl.where(offs_n[:, None] <= rows[None, :], p_t, 0.0)
        do = _rows(DO, o_base, bi, hi_, start, rows, offs_d, som, sod, m_ok, d_ok, EVEN_M, EVEN_D, UPCAST, TMA,
                   BLOCK_M, BLOCK_D)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _bwd_dkdv(Q, K, V, Bias, DO, LSE, Delta, DK, DV,
              sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
              sbb, sbh, sbm, sbn, sob, soh, som, sod,
              H, G, M, N, DH, scale,
              HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One key/value block of one KV head: dK, dV summed over the query heads of its group.
    dO shares O's strides (so), dK k's, dV v's. TMA: Q, K, V, DO, DK and DV are tensor descriptors."""
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    Hkv = H // G
    b = (pid_bk // Hkv).to(tl.int64)
    hk = (pid_bk % Hkv).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    d_ok = offs_d < DH
    bi, hki = b.to(tl.int32), hk.to(tl.int32)
    k = _rows(K, b * skb + hk * skh, bi, hki, pid_n * BLOCK_N, offs_n, offs_d, skn, skd, n_ok, d_ok, EVEN_N, EVEN_D,
              UPCAST, TMA, BLOCK_N, BLOCK_D)
    v = _rows(V, b * svb + hk * svh, bi, hki, pid_n * BLOCK_N, offs_n, offs_d, svn, svd, n_ok, d_ok, EVEN_N, EVEN_D,
              UPCAST, TMA, BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E
    first = pid_n * BLOCK_N
    for g in range(0, G):
        h = hk * G + g
        q_base = b * sqb + h * sqh
        o_base = b * sob + h * soh
        row_base = (b * H + h) * M
        bias_base = b * sbb + h * sbh
        hi_ = h.to(tl.int32)
        if CAUSAL:
            # rows the diagonal crosses in this key block, then the rows that see all of it
            dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, Delta, Bias, q_base, o_base, row_base, bias_base, bi, hi_,
                                  offs_n, offs_d, d_ok, first, tl.minimum(first + BLOCK_N, M), sqm, sqd, som, sod,
                                  sbm, sbn, M, N, qk_scale, True, HAS_BIAS, EVEN_M, EVEN_D, UPCAST, TMA, BLOCK_M,
                                  BLOCK_D)
            dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, Delta, Bias, q_base, o_base, row_base, bias_base, bi, hi_,
                                  offs_n, offs_d, d_ok, first + BLOCK_N, M, sqm, sqd, som, sod, sbm, sbn,
                                  M, N, qk_scale, False, HAS_BIAS, EVEN_M, EVEN_D, UPCAST, TMA, BLOCK_M, BLOCK_D)
        else:
            dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, Delta, Bias, q_base, o_base, row_base, bias_base, bi, hi_,
                                  offs_n, offs_d, d_ok, 0, M, sqm, sqd, som, sod, sbm, sbn,
                                  M, N, qk_scale, False, HAS_BIAS, EVEN_M, EVEN_D, UPCAST, TMA, BLOCK_M, BLOCK_D)
    dk = dk * scale
    _store_rows(DK, b * skb + hk * skh, bi, hki, pid_n * BLOCK_N, offs_n, offs_d, skn, skd, n_ok, d_ok, dk, EVEN_N,
                EVEN_D, TMA, BLOCK_N, BLOCK_D)
    _store_rows(DV, b * svb + hk * svh, bi, hki, pid_n * BLOCK_N, offs_n, offs_d, svn, svd, n_ok, d_ok, dv, EVEN_N,
                EVEN_D, TMA, BLOCK_N, BLOCK_D)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, K, V, Bias, k_base, v_base, bias_base, bi, hki, offs_m, m_ok, offs_d, d_ok,
               lo, hi, skn, skd, svn, svd, sbm, sbn, N, qk_scale,
               DIAG: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
               UPCAST: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        cols = start + offs_n
        n_ok = cols < N
        k = _rows(K, k_base, bi, hki, start, cols, offs_d, skn, skd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST, TMA,
                  BLOCK_N, BLOCK_D)
        v = _rows(V, v_base, bi, hki, start, cols, offs_d, svn, svd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST, TMA,
                  BLOCK_N, BLOCK_D)
        s = _score_tile(q, k, Bias, bias_base, offs_m, cols, m_ok, n_ok, sbm, sbn, qk_scale, HAS_BIAS)
        p = tl.math.exp2(s - lse2[:, None])
        if DIAG:
            p = tl.where(cols[None, :] <= offs_m[:, None], p, 0.0)
        if not EVEN_N:
            p = tl.where(n_ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _bwd_dq(Q, K, V, Bias, DO, LSE, Delta, DQ,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
            sbb, sbh, sbm, sbn, sob, soh, som, sod,
            H, G, M, N, DH, scale,
            HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
            EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """TMA: Q, K, V, DO and DQ are tensor descriptors."""
    pid_m, pid_bh, b, h, hk, offs_m, offs_d, m_ok, d_ok = _query_block(H, G, M, DH, CAUSAL, BLOCK_M, BLOCK_D)
    bi, hi, hki = b.to(tl.int32), h.to(tl.int32), hk.to(tl.int32)
    q = _rows(Q, b * sqb + h * sqh, bi, hi, pid_m * BLOCK_M, offs_m, offs_d, sqm, sqd, m_ok, d_ok, EVEN_M, EVEN_D,
              UPCAST, TMA, BLOCK_M, BLOCK_D)
    do = _rows(DO, b * sob + h * soh, bi, hi, pid_m * BLOCK_M, offs_m, offs_d, som, sod, m_ok, d_ok, EVEN_M, EVEN_D,
               UPCAST, TMA, BLOCK_M, BLOCK_D)
    if EVEN_M:
        lse2 = tl.load(LSE + pid_bh * M + offs_m) * LOG2E
        delta = tl.load(Delta + pid_bh * M + offs_m)
    else:
        lse2 = tl.load(LSE + pid_bh * M + offs_m, mask=m_ok, other=float("inf")) * LOG2E
        delta = tl.load(Delta + pid_bh * M + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * LOG2E
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    bias_base = b * sbb + h * sbh
    if CAUSAL:
        first = pid_m * BLOCK_M
        dq = _dq_blocks(dq, q, do, lse2, delta, K, V, Bias, k_base, v_base, bias_base, bi, hki, offs_m, m_ok, offs_d,
                        d_ok, 0, tl.minimum(first, N), skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                        False, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, TMA, BLOCK_N, BLOCK_D)
        dq = _dq_blocks(dq, q, do, lse2, delta, K, V, Bias, k_base, v_base, bias_base, bi, hki, offs_m, m_ok, offs_d,
                        d_ok, first, tl.minimum(first + BLOCK_M, N), skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                        True, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, TMA, BLOCK_N, BLOCK_D)
    else:
        dq = _dq_blocks(dq, q, do, lse2, delta, K, V, Bias, k_base, v_base, bias_base, bi, hki, offs_m, m_ok, offs_d,
                        d_ok, 0, N, skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                        False, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, TMA, BLOCK_N, BLOCK_D)
    dq = dq * scale
    _store_rows(DQ, b * sqb + h * sqh, bi, hi, pid_m * BLOCK_M, offs_m, offs_d, sqm, sqd, m_ok, d_ok, dq, EVEN_M,
                EVEN_D, TMA, BLOCK_M, BLOCK_D)


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _key(q, k, bias, causal: bool, tma: bool) -> tuple:
    """The shape class a launch configuration is chosen for (and whether TMA candidates were offered)."""
    b, h, m, d = q.shape
    return (str(q.dtype), _block_d(d), causal, bias is not None, h // k.shape[1] > 1,
            tune.bucket(m), tune.bucket(k.shape[2]), tune.bucket(b * h), tma)


def _even(n: int, block: int) -> bool:
    return n % block == 0


_FWD_PLANS, _BWD_PLANS = tune.Plans(), tune.Plans()


def _signature(kernels: tuple, q, k, v, causal: bool, scale: float, *more):
    """A call's signature for its remembered launch plan (tune.Plans), or None where the call must
    take the full path: one of its ``kernels`` has a forced configuration (tests)."""
    if any(tune.forced(name) is not None for name in kernels):
        return None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device, causal, scale, *more)


def forward(q, k, v, bias, causal: bool, scale: float):
    """q [B, H, M, D], k / v [B, Hkv, N, D], bias [B|1, H|1, M, N] or None -> (out, lse fp32 [B, H, M])."""
    import torch

    b, h, m, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, m), device=q.device, dtype=torch.float32)
    aligned = _tma.aligned(q, k, v)  # (the signature fixes the rest of what TMA needs: strides, dtype, device)
    sig = _signature(("attention_fwd",), q, k, v, causal, scale, aligned) if bias is None else None
    plan = _FWD_PLANS.get(sig) if sig is not None else None
    if plan is not None:  # the same shapes, strides and flags as an earlier call
        grid, scalars, kw = plan
        if kw["TMA"]:
            qa, ka, va, oa = operands(kw, (q, k, v, out), ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M"))
            _fwd[grid](qa, ka, va, q, oa, lse, *scalars, **kw)
        else:
            _fwd[grid](q, k, v, q, out, lse, *scalars, **kw)
        return out, lse
    tma = aligned and tma_ok(q, k, v, out)
    hkv, n = k.shape[1], k.shape[2]
    bd = _block_d(d)
    scalars = (*q.stride(), *k.stride(), *v.stride(), *_bias_strides(bias), *out.stride(), h, h // hkv, m, n, d, scale)

    def launch(c: tune.Launch):
        return ((triton.cdiv(m, c["BLOCK_M"]), b * h), scalars,
                dict(HAS_BIAS=bias is not None, CAUSAL=causal, UPCAST=_upcast(q), FOLD=bias is None and scale > 0,
                     EVEN_M=_even(m, c["BLOCK_M"]), EVEN_N=_even(n, c["BLOCK_N"]), EVEN_D=bd == d, BLOCK_D=bd,
                     **{"WS": False, **c.kwargs(INTERPRETED), "TMA": tma and bool(dict(c.blocks).get("TMA"))}))

    def run(c: tune.Launch):
        grid, scalars_, kw = launch(c)
        qa, ka, va, oa = operands(kw, (q, k, v, out), ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M"))
        _fwd[grid](qa, ka, va, bias if bias is not None else q, oa, lse, *scalars_, **kw)

    c = tune.choose("attention_fwd", _key(q, k, bias, causal, tma), offered(FWD, bd, tma), run,
                    FWD_I if INTERPRETED else None)
    run(c)
    if sig is not None:
        _FWD_PLANS.put(sig, launch(c))
    return out, lse


def backward(do, q, k, v, out, lse, bias, causal: bool, scale: float):
    import torch

    b, h, m, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if do.stride() != out.stride():  # the kernels read dO with O's strides
        do = torch.empty_like(out).copy_(do)
    q, dq = _with_grad_buffer(q)
    k, dk = _with_grad_buffer(k)
    v, dv = _with_grad_buffer(v)
    delta = torch.empty((b, h, m), device=q.device, dtype=torch.float32)
    aligned = _tma.aligned(q, k, v, do)  # (dq, dk, dv: fresh buffers)
    sig = None if bias is not None else _signature(("attention_bwd_dkdv", "attention_bwd_dq"), q, k, v, causal, scale,
                                                   out.stride(), dq.stride(), dk.stride(), dv.stride(), aligned)
    plan = _BWD_PLANS.get(sig) if sig is not None else None
    if plan is not None:
        (g_delta, s_delta, k_delta), (g_kv, kw_kv), (g_q, kw_q), common = plan
        _bwd_delta[g_delta](out, do, delta, *s_delta, **k_delta)
        if kw_kv["TMA"] or kw_q["TMA"]:
            _run_dkdv(g_kv, kw_kv, q, k, v, q, do, lse, delta, dk, dv, common)
            _run_dq(g_q, kw_q, q, k, v, q, do, lse, delta, dq, common)
        else:  # (pointers: straight to the launcher, the host's time per call being what a short call waits on)
            _bwd_dkdv[g_kv](q, k, v, q, do, lse, delta, dk, dv, *common, **kw_kv)
            _bwd_dq[g_q](q, k, v, q, do, lse, delta, dq, *common, **kw_q)
        return dq, dk, dv
    tma = aligned and tma_ok(q, k, v, do, dq, dk, dv)
    bd = _block_d(d)
    dm = 16 if INTERPRETED else 64
    delta_plan = ((triton.cdiv(m, dm), b * h), (h, m, d, *out.stride()), dict(BLOCK_M=dm, BLOCK_D=bd))
    _bwd_delta[delta_plan[0]](out, do, delta, *delta_plan[1], **delta_plan[2])
    common = (*q.stride(), *k.stride(), *v.stride(), *_bias_strides(bias), *out.stride(), h, h // hkv, m, n, d,
              scale)
    bias_arg = bias if bias is not None else q
    key = _key(q, k, bias, causal, tma)

    def flags(c):
        return dict(HAS_BIAS=bias is not None, CAUSAL=causal, UPCAST=_upcast(q), EVEN_M=_even(m, c["BLOCK_M"]),
                    EVEN_N=_even(n, c["BLOCK_N"]), EVEN_D=bd == d, BLOCK_D=bd,
                    **{**c.kwargs(INTERPRETED), "TMA": tma and bool(dict(c.blocks).get("TMA"))})

    def dkdv_grid(c):
        return triton.cdiv(n, c["BLOCK_N"]), b * hkv

    def dq_grid(c):
        return triton.cdiv(m, c["BLOCK_M"]), b * h

    def run_dkdv(c: tune.Launch):
        _run_dkdv(dkdv_grid(c), flags(c), q, k, v, bias_arg, do, lse, delta, dk, dv, common)

    def run_dq(c: tune.Launch):
        _run_dq(dq_grid(c), flags(c), q, k, v, bias_arg, do, lse, delta, dq, common)

    c_kv = tune.choose("attention_bwd_dkdv", key, offered(DKDV, bd, tma), run_dkdv, DKDV_I if INTERPRETED else None)
    run_dkdv(c_kv)
    c_q = tune.choose("attention_bwd_dq", key, offered(DQ, bd, tma), run_dq, DQ_I if INTERPRETED else None)
    run_dq(c_q)
    if sig is not None:
        _BWD_PLANS.put(sig, (delta_plan, (dkdv_grid(c_kv), flags(c_kv)), (dq_grid(c_q), flags(c_q)), common))
    return dq, dk, dv


def _run_dkdv(grid, kw, q, k, v, bias_arg, do, lse, delta, dk, dv, common):
    """dK / dV's kernel: a key block (BLOCK_N rows of k, v, dk, dv) walks query blocks (BLOCK_M rows of q, dO)."""
    qa, ka, va, doa, dka, dva = operands(kw, (q, k, v, do, dk, dv),
                                          ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M", "BLOCK_N", "BLOCK_N"))
    _bwd_dkdv[grid](qa, ka, va, bias_arg, doa, lse, delta, dka, dva, *common, **kw)


def _run_dq(grid, kw, q, k, v, bias_arg, do, lse, delta, dq, common):
    """dQ's kernel: a query block (BLOCK_M rows of q, dO, dq) walks key blocks (BLOCK_N rows of k, v)."""
    qa, ka, va, doa, dqa = operands(kw, (q, k, v, do, dq), ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M", "BLOCK_M"))
    _bwd_dq[grid](qa, ka, va, bias_arg, doa, lse, delta, dqa, *common, **kw)


def _with_grad_buffer(t):
    """(t, its gradient's buffer) laid out alike: the kernels write dQ / dK / dV with Q's / K's /
    V's strides. ``empty_like`` keeps a dense layout (a transposed view), but a view that is not
    dense (every other head: a chunk on the head dim with batch > 1) gets a contiguous buffer, into
    which t's strides would write past the end; such a t is copied contiguous first."""
    import torch

    g = torch.empty_like(t)
    if any(a != b and n > 1 for a, b, n in zip(g.stride(), t.stride(), t.shape)):  # (a size-1 dim's stride is never used)
        t = t.contiguous()
        g = torch.empty_like(t)
    return t, g


def _upcast(t) -> bool:
    """Triton's interpreter (CPU) computes bf16 dots wrongly; there, tiles go to fp32 first."""
    import torch

    return t.dtype == torch.bfloat16 and INTERPRETED


def _bias_strides(bias):
    """Strides of a [B|1, H|1, M, N] additive mask, 0 on the broadcast dims."""
    if bias is None:
        return [0, 0, 0, 0]
    return [0 if bias.shape[i] == 1 else bias.stride(i) for i in range(4)]
