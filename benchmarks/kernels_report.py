"""Kernel accuracy for docs/kernels.md: autopar's Triton kernels (Triton's interpreter on CPU) against
their reference paths, max |error| relative to max |reference|, per output and gradient.

    .venv/bin/python benchmarks/kernels_report.py
"""

from __future__ import annotations

import torch

import autopar  # noqa: F401  (switches Triton to its interpreter without a GPU)
from autopar.testing import ATTENTION_CASES, run_attention_case, run_linear_act_case


def rel(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1.0)


def main():
    print("| kernel | case | dtype | out | dq / dx | dk / dw | dv / db |")
    print("|---|---|---|---|---|---|---|")
    for case in ATTENTION_CASES:
        b, h, hkv, sq, sk, d, causal, bias, dtype = case
        r = run_attention_case(*case)
        name = f"B{b} H{h}/{hkv} S{sq}x{sk} D{d}{' causal' if causal else ''}{' +mask' if bias else ''}"
        print(f"| attention | {name} | {str(dtype)[6:]} | {rel(r['out'], r['ref']):.1e} | "
              + " | ".join(f"{rel(a, ref):.1e}" for a, ref in zip(r["grads"], r["ref_grads"])) + " |")
    for act in ("gelu", "silu"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            r = run_linear_act_case(act, dtype)
            print(f"| linear + {act} | [3, 17, 40] x [70, 40]^T + b | {str(dtype)[6:]} | {rel(r['y'], r['ref']):.1e} | "
                  + " | ".join(f"{rel(a, ref):.1e}" for a, ref in zip(r["grads"], r["ref_grads"])) + " |")


if __name__ == "__main__":
    main()
