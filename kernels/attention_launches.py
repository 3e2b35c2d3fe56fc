"""Flash attention's launch candidates (kernels/attention.py): per head-dim block (<= 64, 128+), the
block sizes, warps and pipeline stages the tuner (kernels/tune.py) times on the device, and the one
fixed configuration an interpreted (CPU) launch takes, and the operands a launch hands the kernel
(pointers, or TMA descriptors where kernels/tma.py says they fit). What each candidate won on which
GPU is in docs/kernels.md and benchmarks/results/."""

from __future__ import annotations

from autopar.kernels import tma as _tma
from autopar.kernels import tune

L = tune.Launch.of
# Candidates per head-dim block (<= 64, 128+). forward: BLOCK_M query rows, BLOCK_N keys; BLOCK_N divides
# BLOCK_M (the causal split needs it). dK/dV: a block of BLOCK_N keys walks query blocks of BLOCK_M rows;
# BLOCK_M divides BLOCK_N. dQ: a block of BLOCK_M query rows walks key blocks of BLOCK_N; BLOCK_N divides
# BLOCK_M. The small 4-warp ones are there for GPUs with less shared memory than Hopper's.
# WS=True: the key loop warp-specialised by Triton (tl.range's warp_specialize). On the H200 with Triton 3.6
# (benchmarks/results/gpu-2026-11-26-h200.md, run 1) it compiled with 8 warps and won D128 at S >= 2048 by up
# to 5%; with 4 warps Triton's NVGPUWarpSpecialization pass failed, and at D64 it never won.
# TMA=True: tiles fetched by the copy engine through tensor descriptors (Hopper and later; offered where
# kernels/tma.py says every operand fits): no address arithmetic or masks in the loops, fewer registers.
# On the H200 (benchmarks/results/gpu-2026-11-28.md) they beat every other candidate in some backward
# shape classes by up to 9% (dK/dV D64 causal S >= 4096, dQ D128 S8192) and lost elsewhere by up to
# 10%; in the forward they never gained more than 2%.
# Dropped on 2026-11-28: the candidates that in every kernel table so far (10 runs on H100s and H200s,
# benchmarks/results/kernels-2026-11-2*.json) neither won a shape class nor came within 2% of the
# winner: forward D64 64x64 w4 s4, 128x128 w8 s3 and TMA 128x128 w8 s3 / 128x64 w8 s4; forward D128 WS
# 128x128 w8 s2 and TMA 128x64 w8 s3; dK/dV TMA 64x128 w8 s3 (D64) and w8 s2 (D128); dQ D64 64x64 w4 s4.
FWD = {64: [L(4, 3, BLOCK_M=64, BLOCK_N=64), L(4, 3, BLOCK_M=128, BLOCK_N=64), L(8, 4, BLOCK_M=128, BLOCK_N=64),
            L(4, 3, BLOCK_M=64, BLOCK_N=64, TMA=True)],
       128: [L(4, 3, BLOCK_M=64, BLOCK_N=64), L(8, 3, BLOCK_M=128, BLOCK_N=128), L(8, 3, BLOCK_M=128, BLOCK_N=64),
             L(4, 2, BLOCK_M=64, BLOCK_N=64), L(8, 4, BLOCK_M=128, BLOCK_N=64),
             L(8, 3, BLOCK_M=128, BLOCK_N=128, WS=True), L(8, 3, BLOCK_M=128, BLOCK_N=128, TMA=True),
             L(8, 3, BLOCK_M=128, BLOCK_N=128, WS=True, TMA=True)]}
DKDV = {64: [L(4, 3, BLOCK_M=64, BLOCK_N=64), L(4, 4, BLOCK_M=64, BLOCK_N=64), L(4, 2, BLOCK_M=64, BLOCK_N=64),
             L(8, 3, BLOCK_M=64, BLOCK_N=128), L(4, 3, BLOCK_M=64, BLOCK_N=64, TMA=True)],
        128: [L(8, 3, BLOCK_M=64, BLOCK_N=128), L(8, 2, BLOCK_M=64, BLOCK_N=128), L(8, 4, BLOCK_M=64, BLOCK_N=128),
              L(4, 3, BLOCK_M=64, BLOCK_N=64), L(8, 3, BLOCK_M=64, BLOCK_N=128, TMA=True)]}
DQ = {64: [L(8, 3, BLOCK_M=128, BLOCK_N=64), L(4, 3, BLOCK_M=64, BLOCK_N=64), L(8, 4, BLOCK_M=128, BLOCK_N=64),
           L(8, 3, BLOCK_M=128, BLOCK_N=64, TMA=True), L(4, 3, BLOCK_M=64, BLOCK_N=64, TMA=True)],
      128: [L(8, 3, BLOCK_M=128, BLOCK_N=64), L(8, 4, BLOCK_M=128, BLOCK_N=64), L(8, 2, BLOCK_M=128, BLOCK_N=128),
            L(4, 3, BLOCK_M=64, BLOCK_N=64), L(8, 3, BLOCK_M=128, BLOCK_N=64, TMA=True),
            L(8, 4, BLOCK_M=128, BLOCK_N=64, TMA=True)]}
# interpreted (CPU tests): small blocks, so short test sequences still cross several blocks
FWD_I, DKDV_I, DQ_I = L(BLOCK_M=32, BLOCK_N=16), L(BLOCK_M=16, BLOCK_N=32), L(BLOCK_M=32, BLOCK_N=16)


def offered(candidates: dict, block_d: int, tma: bool) -> list:
    """The candidates for a head-dim block (those of the smallest listed dim that holds it), the ones
    that load by TMA only where the call's operands allow it."""
    listed = candidates[min((k for k in candidates if k >= block_d), default=max(candidates))]
    return [c for c in listed if tma or not dict(c.blocks).get("TMA")]


def tma_ok(*ts) -> bool:
    """Whether the copy engine can fetch tiles of every one of ``ts`` ([B, H, S, D], the head dim
    contiguous): the TMA candidates are offered only then (kernels/tma.py)."""
    return _tma.available(ts[0].device) and all(_tma.fits(t) for t in ts)


def operands(kw: dict, ts: tuple, rows: tuple) -> tuple:
    """The kernel's tensor operands: ``ts`` themselves, or under ``kw['TMA']`` a descriptor of each
    whose box is [1, 1, kw[rows[i]], BLOCK_D] (rows of one head)."""
    if not kw.get("TMA"):
        return ts
    return tuple(_tma.descriptor(t, (1, 1, kw[r], kw["BLOCK_D"])) for t, r in zip(ts, rows))
