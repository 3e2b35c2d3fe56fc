"""Tiled matmul in Triton with a fused epilogue: ``y = act(a @ b + bias)``, act in {none, gelu
(exact, erf), silu}; optionally also stores the pre-activation ``z`` (what the backward needs).
Grouped program order (GROUP_M rows of tiles share B tiles in cache), fp32 accumulation inside
the matrix instruction, any sizes (rows and columns past the edge wrap around when loaded and are
never stored, so only K is masked, and only where the block does not divide it), any strides (so
``x @ w.T`` is a stride swap, not a copy). Tiles, warps and pipeline depth are chosen per shape
by timing on the device (kernels/tune.py), among them an epilogue split in two column halves and a
persistent kernel (``_matmul_persistent``: the next tile's loads overlap this tile's epilogue) and
tiles fetched through TMA descriptors (kernels/tma.py); a call's launch is remembered per signature
(``tune.Plans``).

The backward of ``linear_act`` uses the same kernel: ``dz = dy * act'(z)`` (an elementwise
kernel), ``dx = dz @ w``, ``dw = dz.T @ x`` (stride swaps again), ``db = dz.sum(0)``. Those two
products have no epilogue, and for them cuBLAS (``CUBLAS``) is one more candidate the tuner times.
"""

from __future__ import annotations

import triton
import triton.language as tl

from autopar.kernels import tma as _tma
from autopar.kernels import tune

# Whether these kernels run in Triton's interpreter (see kernels/attention.py): the bf16 dot is
# wrong there, so tiles are upcast to fp32 first.
INTERPRETED = bool(triton.knobs.runtime.interpret)
ACTS = {"none": 0, "gelu": 1, "silu": 2}


@triton.jit
def _act(z, ACT: tl.constexpr):
    if ACT == 1:
        return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    if ACT == 2:
        return z / (1.0 + tl.exp(-z))
    return z


@triton.jit
def _tile(tile_id, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile ``tile_id``'s first row and first column, in grouped order (GROUP_M rows of
    tiles share B's tiles in cache)."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    group = tile_id // width
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % width) % size_m
    pid_n = (tile_id % width) // size_m
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _main_loop(A, B, start_m, start_n, M, N, K, sam, sak, sbk, sbn, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
               EVEN_MN: tl.constexpr, TMA: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc = A[rows, :] @ B[:, cols] in fp32 for the tile at (start_m, start_n). Where the tiles do
    not divide the output, rows / columns past the edge wrap around (loaded unmasked, never
    stored); only K is masked, and only where the block does not divide it. TMA: A and B are
    tensor descriptors and the copy engine fetches the tiles (past any edge it reads zeros, so
    nothing is masked); A_T / B_T: the descriptor is over the operand's transpose (its contiguous
    dim is M for A, N for B), and the loaded tile is transposed back."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TMA:  # (one return at the end: Triton 3.6 refused this function with an early one)
        for k0 in range(0, K, BLOCK_K):
            if A_T:
                a = A.load([k0, start_m]).T
            else:
                a = A.load([start_m, k0])
            if B_T:
                b = B.load([start_n, k0]).T
            else:
                b = B.load([k0, start_n])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
    else:
        rm = start_m + tl.arange(0, BLOCK_M)
        rn = start_n + tl.arange(0, BLOCK_N)
        if EVEN_MN:
            am = rm
            bn = rn
        else:
            am = rm % M
            bn = rn % N
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = A + am[:, None].to(tl.int64) * sam + rk[None, :] * sak
        b_ptrs = B + rk[:, None] * sbk + bn[None, :].to(tl.int64) * sbn
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(k0 + rk)[None, :] < K, other=0.0)
                b = tl.load(b_ptrs, mask=(k0 + rk)[:, None] < K, other=0.0)
            if UPCAST:  # the interpreter's bf16 dot is wrong: do it in fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * sak
            b_ptrs += BLOCK_K * sbk
    return acc


@triton.jit
def _store(acc, rm, rn, Bias, C, Z, M, N, scm, scn, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
           STORE_Z: tl.constexpr, EVEN_MN: tl.constexpr):
    """The epilogue of one [rows, cols] piece of a tile: + bias, z stored, act(z) stored."""
    if HAS_BIAS:
        if EVEN_MN:
            acc += tl.load(Bias + rn).to(tl.float32)[None, :]
        else:
            acc += tl.load(Bias + rn % N).to(tl.float32)[None, :]
    c_off = rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
    if EVEN_MN:  # the tiles divide the output: unmasked (vector) stores
        if STORE_Z:
            tl.store(Z + c_off, acc.to(Z.dtype.element_ty))
        tl.store(C + c_off, _act(acc, ACT).to(C.dtype.element_ty))
    else:
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        if STORE_Z:
            tl.store(Z + c_off, acc.to(Z.dtype.element_ty), mask=ok)
        tl.store(C + c_off, _act(acc, ACT).to(C.dtype.element_ty), mask=ok)


@triton.jit
def _epilogue(acc, rm, start_n, Bias, C, Z, M, N, scm, scn, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
              STORE_Z: tl.constexpr, EVEN_MN: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """EPI_SPLIT: the tile's epilogue in two halves of its columns (fewer registers live at once
    while the activation runs and the stores drain), else whole."""
    if EPI_SPLIT:
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        half = start_n + tl.arange(0, BLOCK_N // 2)
        _store(left, rm, half, Bias, C, Z, M, N, scm, scn, HAS_BIAS, ACT, STORE_Z, EVEN_MN)
        _store(right, rm, half + BLOCK_N // 2, Bias, C, Z, M, N, scm, scn, HAS_BIAS, ACT, STORE_Z, EVEN_MN)
    else:
        _store(acc, rm, start_n + tl.arange(0, BLOCK_N), Bias, C, Z, M, N, scm, scn, HAS_BIAS, ACT, STORE_Z,
               EVEN_MN)


@triton.jit
def _matmul(A, B, Bias, C, Z, M, N, K,
            sam, sak, sbk, sbn, scm, scn,
            HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr, UPCAST: tl.constexpr,
            EVEN_K: tl.constexpr, EVEN_MN: tl.constexpr, EPI_SPLIT: tl.constexpr,
            TMA: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One program per output tile."""
    start_m, start_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _main_loop(A, B, start_m, start_n, M, N, K, sam, sak, sbk, sbn, UPCAST, EVEN_K, EVEN_MN, TMA, A_T, B_T,
                     BLOCK_M, BLOCK_N, BLOCK_K)
    rm = start_m + tl.arange(0, BLOCK_M)
    _epilogue(acc, rm, start_n, Bias, C, Z, M, N, scm, scn, HAS_BIAS, ACT, STORE_Z, EVEN_MN, EPI_SPLIT, BLOCK_M,
              BLOCK_N)


@triton.jit
def _matmul_persistent(A, B, Bias, C, Z, M, N, K,
                       sam, sak, sbk, sbn, scm, scn,
                       HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr, UPCAST: tl.constexpr,
                       EVEN_K: tl.constexpr, EVEN_MN: tl.constexpr, EPI_SPLIT: tl.constexpr,
                       TMA: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       NUM_SMS: tl.constexpr):
    """One program per multiprocessor, walking output tiles NUM_SMS apart. The tile loop and the K
    loop are flattened into one software pipeline, so the next tile's first loads are in flight
    while this tile's epilogue (bias, activation, stores) runs."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        start_m, start_n = _tile(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _main_loop(A, B, start_m, start_n, M, N, K, sam, sak, sbk, sbn, UPCAST, EVEN_K, EVEN_MN, TMA, A_T, B_T,
                         BLOCK_M, BLOCK_N, BLOCK_K)
        rm = start_m + tl.arange(0, BLOCK_M)
        _epilogue(acc, rm, start_n, Bias, C, Z, M, N, scm, scn, HAS_BIAS, ACT, STORE_Z, EVEN_MN, EPI_SPLIT, BLOCK_M,
                  BLOCK_N)


@triton.jit
def _act_grad(DY, Z, DZ, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    z = tl.load(Z + offs, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
    if ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        g = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACT == 2:
        s = 1.0 / (1.0 + tl.exp(-z))
        g = s * (1.0 + z * (1.0 - s))
    else:
        g = tl.full([BLOCK], 1.0, tl.float32)
    tl.store(DZ + offs, (dy * g).to(DZ.dtype.element_ty), mask=ok)


L = tune.Launch.of
# (BLOCK_M, BLOCK_N, BLOCK_K), warps, stages: tiles that suit Hopper's and Ampere's matrix units
# (the first H100 run, benchmarks/results/gpu-check-2026-11-26-h100.md: 128x256 w8 won the plain products,
# 128x128 w4 s4 the GELU / SiLU epilogues)
# EPI_SPLIT=1: the epilogue in two column halves; PERSISTENT=1: one program per multiprocessor
# (``_matmul_persistent``), the next tile's loads overlapping this one's epilogue. On the H200 (run 1 of
# benchmarks/results/gpu-2026-11-26-h200.md) these won every shape: linear + GELU 4096^3 0.278 -> 0.228 ms
# (split), 8192x14336x4096 1.90 -> 1.56 (split + persistent); plain products 0.201 -> 0.178 (772 TFLOP/s).
CANDIDATES = [L(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64), L(8, 4, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64),
              L(4, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), L(8, 3, BLOCK_M=256, BLOCK_N=128, BLOCK_K=64),
              L(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, EPI_SPLIT=1),
              L(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, PERSISTENT=1),
              L(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, EPI_SPLIT=1, PERSISTENT=1),
              # TMA=1: A's and B's tiles fetched by the copy engine through tensor descriptors (Hopper
              # and later, offered where _tma_ok holds). On the H200 (benchmarks/results/gpu-2026-11-28.md,
              # run 2) the persistent ones won 3 of 9 shape classes by 1.3-3.4% and lost the rest by up
              # to 9.5%; the two one-tile-per-program ones (128x256 w8 s3, 128x128 w4 s4) were never within
              # 2% of the winner: dropped
              L(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, EPI_SPLIT=1, PERSISTENT=1, TMA=1),
              L(8, 4, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, PERSISTENT=1, TMA=1)]
INTERPRETED_TILES = L(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)
# cuBLAS (torch.mm), offered beside the tiles only where the call is a plain product (no bias, no
# activation, no pre-activation to keep): the backward's dx = dz @ w and dw = dz.T @ x, where a Triton
# kernel has nothing to fuse. The tuner times it with the rest and keeps it only where it is faster; the
# forward's fused epilogue stays Triton's. On the H200 (benchmarks/results/gpu-2026-12-04.md) it won 3 of
# 6 such shape classes by 0.6-4.8% and lost 3 by 3.3-15.6%; at 4096^3 both are within 1%.
CUBLAS = L(1, 1, CUBLAS=1)


def _fit(c: tune.Launch, m: int, n: int, k: int) -> tune.Launch:
    """A candidate's tiles shrunk to the problem where it is smaller (at least 16)."""
    def clamp(block, size):
        return min(block, max(16, triton.next_power_of_2(size)))
    sizes = {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}
    return tune.Launch.of(c.num_warps, c.num_stages, **{name: clamp(v, sizes[name]) if name in sizes else v
                                                        for name, v in c.blocks})


def _layout(t) -> str:
    return "r" if t.stride(1) == 1 else "c" if t.stride(0) == 1 else "s"


_PLANS = tune.Plans()


def matmul(a, b, bias=None, act: str = "none", store_z: bool = False):
    """a [M, K] @ b [K, N] (+ bias [N]) -> act(.) [M, N] (and z, the pre-activation, if store_z)."""
    import torch

    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), device=a.device, dtype=a.dtype)
    z = torch.empty_like(c) if store_z else c
    bias_arg = bias if bias is not None else a
    aligned = _tma.aligned(a, b)  # (the signature fixes the rest of what TMA needs: strides, dtype, device)
    sig = None if tune.forced("matmul") is not None else \
        (a.shape, b.shape, a.stride(), b.stride(), a.dtype, a.device, bias is not None, act, store_z, aligned)
    plan = _PLANS.get(sig) if sig is not None else None
    if plan is CUBLAS:
        return torch.mm(a, b, out=c)
    if plan is not None:  # the same shapes, strides and flags as an earlier call: the launch it computed
        kernel, grid, scalars, kw = plan
        if kw["TMA"]:
            kernel[grid](*_operands(kw, a, b), bias_arg, c, z, *scalars, **kw)
        else:
            kernel[grid](a, b, bias_arg, c, z, *scalars, **kw)
        return (c, z) if store_z else c
    tma = aligned and _tma_ok(a, b)
    scalars = (m, n, k, *a.stride(), *b.stride(), *c.stride())

    def launch(cfg: tune.Launch):
        cfg = _fit(cfg, m, n, k)
        kw = {"EPI_SPLIT": 0, "TMA": 0, **cfg.kwargs(INTERPRETED)}
        kw["TMA"] = int(bool(kw["TMA"]) and tma)  # (a forced TMA candidate on operands TMA cannot fetch: pointers)
        kw.update(A_T=int(kw["TMA"] and a.stride(1) != 1), B_T=int(kw["TMA"] and b.stride(1) != 1))
        tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        kernel, grid = _matmul, (tiles,)
        if kw.pop("PERSISTENT", 0):
            sms = _multiprocessors(a.device)
            kernel, grid = _matmul_persistent, (min(sms, tiles),)
            kw["NUM_SMS"] = min(sms, tiles)
        kw.update(HAS_BIAS=bias is not None, ACT=ACTS[act], STORE_Z=store_z,
                  UPCAST=a.dtype == torch.bfloat16 and INTERPRETED, EVEN_K=k % cfg["BLOCK_K"] == 0,
                  EVEN_MN=m % cfg["BLOCK_M"] == 0 and n % cfg["BLOCK_N"] == 0, GROUP_M=8)
        return kernel, grid, scalars, kw

    plain = bias is None and act == "none" and not store_z

    def run(cfg: tune.Launch):
        if cfg == CUBLAS:
            torch.mm(a, b, out=c)
            return
        kernel, grid, scalars_, kw = launch(cfg)
        kernel[grid](*_operands(kw, a, b), bias_arg, c, z, *scalars_, **kw)

    key = (str(a.dtype), tune.bucket(m), n, k, _layout(a), _layout(b), act, store_z, bias is not None, tma)
    offered = [cfg for cfg in CANDIDATES if tma or not dict(cfg.blocks).get("TMA")] + [CUBLAS] * plain
    cfg = tune.choose("matmul", key, offered, run, INTERPRETED_TILES if INTERPRETED else None)
    if cfg == CUBLAS and not plain:  # (forced on a call with an epilogue: the tiles)
        cfg = INTERPRETED_TILES if INTERPRETED else CANDIDATES[0]
    run(cfg)
    if sig is not None:
        _PLANS.put(sig, CUBLAS if cfg == CUBLAS else launch(cfg))
    return (c, z) if store_z else c


def _tma_ok(a, b) -> bool:
    """Whether the copy engine can fetch a's and b's tiles, either of their dims contiguous
    (kernels/tma.py): the TMA candidates are offered only then."""
    return _tma.available(a.device) and _tma.fits(a, (1, 0)) and _tma.fits(b, (1, 0))


def _operands(kw: dict, a, b) -> tuple:
    """a and b, or under ``kw['TMA']`` a descriptor of each: of the operand as it is where its
    columns are contiguous, else of its transpose (``A_T`` / ``B_T``), boxed as the tile."""
    if not kw["TMA"]:
        return a, b
    bm, bn, bk = kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"]
    return (_tma.descriptor(a, (bk, bm) if kw["A_T"] else (bm, bk), bool(kw["A_T"])),
            _tma.descriptor(b, (bn, bk) if kw["B_T"] else (bk, bn), bool(kw["B_T"])))


_SMS: dict = {}


def _multiprocessors(device) -> int:
    """The device's multiprocessor count (a persistent kernel's grid); 2 on CPU (the interpreter:
    small, so that its programs walk several tiles)."""
    if device.type != "cuda":
        return 2
    import torch

    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def act_grad(dy, z, act: str):
    import torch

    dy, z = dy.contiguous(), z.contiguous()
    dz = torch.empty_like(z)
    n = z.numel()
    _act_grad[(triton.cdiv(n, 1024),)](dy, z, dz, n, ACT=ACTS[act], BLOCK=1024)
    return dz
