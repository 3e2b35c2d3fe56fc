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
  (kernels/tune.py), among candidates that suit Hopper and Ampere;
- the host's work for a call (grid, scalar arguments, constexprs) is remembered per call signature
  (``tune.Plans``): a repeated call goes straight to Triton's launcher, since a short call's time is
  the host's (docs/kernels.md).

Launch only through ``kernels.ops`` (it picks the device path and checks shapes; on CPU tensors it
launches this module's interpreted twin, ``kernels/interpreter.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from autopar.kernels import tune

# Whether these kernels run in Triton's interpreter: Triton's own choice here (TRITON_INTERPRET,
# read, never set, by autopar); True in the interpreted twin that CPU tensors use.
INTERPRETED = bool(triton.knobs.runtime.interpret)

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

L = tune.Launch.of
# Candidates per head-dim block (<= 64, 128+). The first H100 run (benchmarks/results/gpu-check-2026-11-26-
# h100.md) chose 64x64 w4 for the forward but at D128 past 4k (128x128 w8), 64x128 w8 for dK/dV at D128
# (32x128 w4 spilled its two [128, 128] fp32 accumulators: 3x slower), 128x64 w8 for dQ.
# forward: BLOCK_M query rows, BLOCK_N keys; BLOCK_N divides BLOCK_M (the causal split needs it)
# WS=True: the key loop warp-specialised by Triton (tl.range's warp_specialize). On the H200 with Triton 3.6
# (benchmarks/results/gpu-2026-11-26-h200.md, run 1) it compiled with 8 warps and won D128 at S >= 2048 by up
# to 5%; with 4 warps Triton's NVGPUWarpSpecialization pass failed, and at D64 it never won.
FWD = {64: [L(4, 3, BLOCK_M=64, BLOCK_N=64), L(4, 4, BLOCK_M=64, BLOCK_N=64), L(4, 3, BLOCK_M=128, BLOCK_N=64),
            L(8, 3, BLOCK_M=128, BLOCK_N=128), L(8, 4, BLOCK_M=128, BLOCK_N=64)],
       128: [L(4, 3, BLOCK_M=64, BLOCK_N=64), L(8, 3, BLOCK_M=128, BLOCK_N=128), L(8, 3, BLOCK_M=128, BLOCK_N=64),
             L(4, 2, BLOCK_M=64, BLOCK_N=64), L(8, 4, BLOCK_M=128, BLOCK_N=64),
             L(8, 3, BLOCK_M=128, BLOCK_N=128, WS=True), L(8, 2, BLOCK_M=128, BLOCK_N=128, WS=True)]}
# dK/dV: a block of BLOCK_N keys walks query blocks of BLOCK_M rows; BLOCK_M divides BLOCK_N. On the H200
# (run 1) 64x64 w4 s3 won every D64 shape and 64x128 w8 s3 every D128 one (128x128 w8 s2 ran 2-4x slower:
# dropped); the other stage counts are there to be measured.
DKDV = {64: [L(4, 3, BLOCK_M=64, BLOCK_N=64), L(4, 4, BLOCK_M=64, BLOCK_N=64), L(4, 2, BLOCK_M=64, BLOCK_N=64),
             L(8, 3, BLOCK_M=64, BLOCK_N=128)],
        128: [L(8, 3, BLOCK_M=64, BLOCK_N=128), L(8, 2, BLOCK_M=64, BLOCK_N=128), L(8, 4, BLOCK_M=64, BLOCK_N=128),
              L(4, 3, BLOCK_M=64, BLOCK_N=64)]}
# dQ: a block of BLOCK_M query rows walks key blocks of BLOCK_N; BLOCK_N divides BLOCK_M (run 1: 128x64 w8
# s3 or 64x64 w4 s3 at D64, 128x64 w8 s3 at D128; 128x32 never won)
DQ = {64: [L(8, 3, BLOCK_M=128, BLOCK_N=64), L(4, 3, BLOCK_M=64, BLOCK_N=64), L(8, 4, BLOCK_M=128, BLOCK_N=64),
           L(4, 4, BLOCK_M=64, BLOCK_N=64)],
      128: [L(8, 3, BLOCK_M=128, BLOCK_N=64), L(8, 4, BLOCK_M=128, BLOCK_N=64), L(8, 2, BLOCK_M=128, BLOCK_N=128),
            L(4, 3, BLOCK_M=64, BLOCK_N=64)]}
# interpreted (CPU tests): small blocks, so short test sequences still cross several blocks
FWD_I, DKDV_I, DQ_I = L(BLOCK_M=32, BLOCK_N=16), L(BLOCK_M=16, BLOCK_N=32), L(BLOCK_M=32, BLOCK_N=16)


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
def _fwd_blocks(acc, l_i, m_i, q, K, V, Bias, k_base, v_base, bias_base, offs_m, m_ok, offs_d, d_ok, lo, hi,
                skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                DIAG: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                UPCAST: tl.constexpr, FOLD: tl.constexpr, WS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key/value blocks [lo, hi) of one query block; DIAG: the causal mask applies in them. FOLD (no
    bias, a positive scale): max(s * c) = max(s) * c, so the [rows, keys] tile is never scaled on
    its own: one multiply-add per score instead of a multiply and a subtract. WS: Triton's warp
    specialisation of the loop (a candidate the tuner may pick where this Triton and chip run it)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start = tl.multiple_of(start, BLOCK_N)
        cols = start + offs_n
        n_ok = cols < N
        k = _load_tile(K + k_base, cols, offs_d, skn, skd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST)
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
        v = _load_tile(V + v_base, cols, offs_d, svn, svd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST)
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
         EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, pid_bh, b, h, hk, offs_m, offs_d, m_ok, d_ok = _query_block(H, G, M, DH, CAUSAL, BLOCK_M, BLOCK_D)
    q = _load_tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqm, sqd, m_ok, d_ok, EVEN_M, EVEN_D, UPCAST)
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
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, Bias, k_base, v_base, bias_base, offs_m, m_ok,
                                    offs_d, d_ok, 0, tl.minimum(first, N), skn, skd, svn, svd, sbm, sbn, N,
                                    qk_scale, False, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, FOLD, WS, BLOCK_N)
        # the blocks the diagonal crosses
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, Bias, k_base, v_base, bias_base, offs_m, m_ok,
                                    offs_d, d_ok, first, tl.minimum(first + BLOCK_M, N), skn, skd, svn, svd,
                                    sbm, sbn, N, qk_scale, True, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, FOLD, WS, BLOCK_N)
    else:
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K, V, Bias, k_base, v_base, bias_base, offs_m, m_ok,
                                    offs_d, d_ok, 0, N, skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                                    False, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, FOLD, WS, BLOCK_N)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod
    lse = tl.where(m_i == float("-inf"), float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    if EVEN_M and EVEN_D:
        tl.store(o_ptrs, out.to(O.dtype.element_ty))
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
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
def _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, Delta, Bias, q_base, o_base, row_base, bias_base, offs_n, offs_d, d_ok,
                 lo, hi, sqm, sqd, som, sod, sbm, sbn, M, N, qk_scale,
                 DIAG: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_M: tl.constexpr, EVEN_D: tl.constexpr,
                 UPCAST: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query blocks [lo, hi) against one key block, transposed: scores [keys, rows]."""
    offs_m = tl.arange(0, BLOCK_M)
    for start in range(lo, hi, BLOCK_M):
        start = tl.multiple_of(start, BLOCK_M)
        rows = start + offs_m
        m_ok = rows < M
        q = _load_tile(Q + q_base, rows, offs_d, sqm, sqd, m_ok, d_ok, EVEN_M, EVEN_D, UPCAST)
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
        do = _load_tile(DO + o_base, rows, offs_d, som, sod, m_ok, d_ok, EVEN_M, EVEN_D, UPCAST)
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
              HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One key/value block of one KV head: dK, dV summed over the query heads of its group.
    dO shares O's strides (so), dK k's, dV v's."""
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    Hkv = H // G
    b = (pid_bk // Hkv).to(tl.int64)
    hk = (pid_bk % Hkv).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    d_ok = offs_d < DH
    k = _load_tile(K + b * skb + hk * skh, offs_n, offs_d, skn, skd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST)
    v = _load_tile(V + b * svb + hk * svh, offs_n, offs_d, svn, svd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST)
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
        if CAUSAL:
            # rows the diagonal crosses in this key block, then the rows that see all of it
            dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, Delta, Bias, q_base, o_base, row_base, bias_base, offs_n,
                                  offs_d, d_ok, first, tl.minimum(first + BLOCK_N, M), sqm, sqd, som, sod, sbm, sbn,
                                  M, N, qk_scale, True, HAS_BIAS, EVEN_M, EVEN_D, UPCAST, BLOCK_M)
            dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, Delta, Bias, q_base, o_base, row_base, bias_base, offs_n,
                                  offs_d, d_ok, first + BLOCK_N, M, sqm, sqd, som, sod, sbm, sbn,
                                  M, N, qk_scale, False, HAS_BIAS, EVEN_M, EVEN_D, UPCAST, BLOCK_M)
        else:
            dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, Delta, Bias, q_base, o_base, row_base, bias_base, offs_n,
                                  offs_d, d_ok, 0, M, sqm, sqd, som, sod, sbm, sbn,
                                  M, N, qk_scale, False, HAS_BIAS, EVEN_M, EVEN_D, UPCAST, BLOCK_M)
    dk = dk * scale
    kv_ok = n_ok[:, None] & d_ok[None, :]
    dk_ptrs = DK + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd
    dv_ptrs = DV + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd
    if EVEN_N and EVEN_D:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty))
    else:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_ok)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, K, V, Bias, k_base, v_base, bias_base, offs_m, m_ok, offs_d, d_ok, lo, hi,
               skn, skd, svn, svd, sbm, sbn, N, qk_scale,
               DIAG: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
               UPCAST: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        cols = start + offs_n
        n_ok = cols < N
        k = _load_tile(K + k_base, cols, offs_d, skn, skd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST)
        v = _load_tile(V + v_base, cols, offs_d, svn, svd, n_ok, d_ok, EVEN_N, EVEN_D, UPCAST)
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
            HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
            EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, pid_bh, b, h, hk, offs_m, offs_d, m_ok, d_ok = _query_block(H, G, M, DH, CAUSAL, BLOCK_M, BLOCK_D)
    q = _load_tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqm, sqd, m_ok, d_ok, EVEN_M, EVEN_D, UPCAST)
    do = _load_tile(DO + b * sob + h * soh, offs_m, offs_d, som, sod, m_ok, d_ok, EVEN_M, EVEN_D, UPCAST)
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
        dq = _dq_blocks(dq, q, do, lse2, delta, K, V, Bias, k_base, v_base, bias_base, offs_m, m_ok, offs_d, d_ok,
                        0, tl.minimum(first, N), skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                        False, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, BLOCK_N)
        dq = _dq_blocks(dq, q, do, lse2, delta, K, V, Bias, k_base, v_base, bias_base, offs_m, m_ok, offs_d, d_ok,
                        first, tl.minimum(first + BLOCK_M, N), skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                        True, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, BLOCK_N)
    else:
        dq = _dq_blocks(dq, q, do, lse2, delta, K, V, Bias, k_base, v_base, bias_base, offs_m, m_ok, offs_d, d_ok,
                        0, N, skn, skd, svn, svd, sbm, sbn, N, qk_scale,
                        False, HAS_BIAS, EVEN_N, EVEN_D, UPCAST, BLOCK_N)
    dq = dq * scale
    dq_ptrs = DQ + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd
    if EVEN_M and EVEN_D:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty))
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _for_d(candidates: dict, block_d: int) -> list:
    """The candidates for a head-dim block: those of the smallest listed dim that holds it."""
    return candidates[min((k for k in candidates if k >= block_d), default=max(candidates))]


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _key(q, k, bias, causal: bool) -> tuple:
    """The shape class a launch configuration is chosen for."""
    b, h, m, d = q.shape
    return (str(q.dtype), _block_d(d), causal, bias is not None, h // k.shape[1] > 1,
            tune.bucket(m), tune.bucket(k.shape[2]), tune.bucket(b * h))


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
    sig = _signature(("attention_fwd",), q, k, v, causal, scale) if bias is None else None
    plan = _FWD_PLANS.get(sig) if sig is not None else None
    if plan is not None:  # the same shapes, strides and flags as an earlier call
        grid, scalars, kw = plan
        _fwd[grid](q, k, v, q, out, lse, *scalars, **kw)
        return out, lse
    hkv, n = k.shape[1], k.shape[2]
    bd = _block_d(d)
    scalars = (*q.stride(), *k.stride(), *v.stride(), *_bias_strides(bias), *out.stride(), h, h // hkv, m, n, d, scale)

    def launch(c: tune.Launch):
        return ((triton.cdiv(m, c["BLOCK_M"]), b * h), scalars,
                dict(HAS_BIAS=bias is not None, CAUSAL=causal, UPCAST=_upcast(q), FOLD=bias is None and scale > 0,
                     EVEN_M=_even(m, c["BLOCK_M"]), EVEN_N=_even(n, c["BLOCK_N"]), EVEN_D=bd == d, BLOCK_D=bd,
                     **{"WS": False, **c.kwargs(INTERPRETED)}))

    def run(c: tune.Launch):
        grid, scalars_, kw = launch(c)
        _fwd[grid](q, k, v, bias if bias is not None else q, out, lse, *scalars_, **kw)

    c = tune.choose("attention_fwd", _key(q, k, bias, causal), _for_d(FWD, bd), run, FWD_I if INTERPRETED else None)
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
    sig = None if bias is not None else _signature(("attention_bwd_dkdv", "attention_bwd_dq"), q, k, v, causal, scale,
                                                   out.stride(), dq.stride(), dk.stride(), dv.stride())
    plan = _BWD_PLANS.get(sig) if sig is not None else None
    if plan is not None:
        (g_delta, s_delta, k_delta), (g_kv, kw_kv), (g_q, kw_q), common = plan
        _bwd_delta[g_delta](out, do, delta, *s_delta, **k_delta)
        _bwd_dkdv[g_kv](q, k, v, q, do, lse, delta, dk, dv, *common, **kw_kv)
        _bwd_dq[g_q](q, k, v, q, do, lse, delta, dq, *common, **kw_q)
        return dq, dk, dv
    bd = _block_d(d)
    dm = 16 if INTERPRETED else 64
    delta_plan = ((triton.cdiv(m, dm), b * h), (h, m, d, *out.stride()), dict(BLOCK_M=dm, BLOCK_D=bd))
    _bwd_delta[delta_plan[0]](out, do, delta, *delta_plan[1], **delta_plan[2])
    common = (*q.stride(), *k.stride(), *v.stride(), *_bias_strides(bias), *out.stride(), h, h // hkv, m, n, d,
              scale)
    bias_arg = bias if bias is not None else q
    key = _key(q, k, bias, causal)

    def flags(c):
        return dict(HAS_BIAS=bias is not None, CAUSAL=causal, UPCAST=_upcast(q), EVEN_M=_even(m, c["BLOCK_M"]),
                    EVEN_N=_even(n, c["BLOCK_N"]), EVEN_D=bd == d, BLOCK_D=bd, **c.kwargs(INTERPRETED))

    def dkdv_grid(c):
        return triton.cdiv(n, c["BLOCK_N"]), b * hkv

    def dq_grid(c):
        return triton.cdiv(m, c["BLOCK_M"]), b * h

    def run_dkdv(c: tune.Launch):
        _bwd_dkdv[dkdv_grid(c)](q, k, v, bias_arg, do, lse, delta, dk, dv, *common, **flags(c))

    def run_dq(c: tune.Launch):
        _bwd_dq[dq_grid(c)](q, k, v, bias_arg, do, lse, delta, dq, *common, **flags(c))

    c_kv = tune.choose("attention_bwd_dkdv", key, _for_d(DKDV, bd), run_dkdv, DKDV_I if INTERPRETED else None)
    run_dkdv(c_kv)
    c_q = tune.choose("attention_bwd_dq", key, _for_d(DQ, bd), run_dq, DQ_I if INTERPRETED else None)
    run_dq(c_q)
    if sig is not None:
        _BWD_PLANS.put(sig, (delta_plan, (dkdv_grid(c_kv), flags(c_kv)), (dq_grid(c_q), flags(c_q)), common))
    return dq, dk, dv


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
