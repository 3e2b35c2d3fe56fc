"""The host's cost of one kernel call without the launch itself (docs/kernels.md, "Launch plans
remembered"): autopar's attention forward / backward and a matmul with Triton's launch stubbed out,
through the remembered launch plan (``tune.Plans``) and with every call missing it.

    .venv/bin/python benchmarks/launch_host_cost.py

CPU only (no GPU needed: nothing is launched); microseconds per call, the median of 3 runs of
20,000 calls. The configuration is set as the tuner would have chosen it (its first candidate).
"""

from __future__ import annotations

import statistics
import time

import torch

from autopar.kernels import attention as A
from autopar.kernels import matmul as MM
from autopar.kernels import tune


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _us(fn, n: int = 20000) -> float:
    for _ in range(200):
        fn()
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    for name in ("_fwd", "_bwd_delta", "_bwd_dkdv", "_bwd_dq"):
        setattr(A, name, _NoLaunch())
    MM._matmul = MM._matmul_persistent = _NoLaunch()
    A.INTERPRETED = MM.INTERPRETED = False  # the compiled path's host code
    q, k = torch.randn(4, 32, 64, 64), torch.randn(4, 8, 64, 64)
    v = k.clone()
    tma = A.tma_ok(q, k, v, q)  # (CPU tensors: True, as the interpreter runs descriptors; on a Hopper GPU too)
    for name, table in (("attention_fwd", A.FWD), ("attention_bwd_dkdv", A.DKDV), ("attention_bwd_dq", A.DQ)):
        tune._CHOSEN[(name, A._key(q, k, None, True, tma))] = table[64][0]
    x, w = torch.randn(256, 128), torch.randn(128, 512)
    tune._CHOSEN[("matmul", (str(x.dtype), tune.bucket(256), 512, 128, "r", "r", "none", False, False,
                             MM._tma_ok(x, w)))] = MM.CANDIDATES[0]
    out, lse = A.forward(q, k, v, None, True, 0.125)
    do = torch.randn_like(out)
    calls = {"attention forward": lambda: A.forward(q, k, v, None, True, 0.125),
             "attention backward": lambda: A.backward(do, q, k, v, out, lse, None, True, 0.125),
             "matmul": lambda: MM.matmul(x, w)}
    planned = {what: _us(fn) for what, fn in calls.items()}
    for table in (A._FWD_PLANS, A._BWD_PLANS, MM._PLANS):
        table.get = lambda sig: None  # every call takes the full path
    print("| call | host us, plan remembered | host us, every call planned |\n|---|---|---|")
    for what, fn in calls.items():
        print(f"| {what} | {planned[what]:.1f} | {_us(fn):.1f} |")


if __name__ == "__main__":
    main()
