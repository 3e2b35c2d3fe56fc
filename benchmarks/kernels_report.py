"""Kernel accuracy for the README: autopar's Triton kernels (Triton's interpreter on CPU) against
their reference paths, max |error| relative to max |reference|, per output and gradient.

    .venv/bin/python benchmarks/kernels_report.py
"""

from __future__ import annotations

import torch

import autopar  # noqa: F401  (switches Triton to its interpreter without a GPU)
from autopar.kernels import ops
from autopar.testing import ATTENTION_CASES


def rel(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1.0)


def main():
    print("| kernel | case | dtype | out | dq / dx | dk / dw | dv / db |")
    print("|---|---|---|---|---|---|---|")
    for b, h, hkv, sq, sk, d, causal, bias, dtype in ATTENTION_CASES:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, h, sq, d, generator=g).to(dtype).requires_grad_()
        k = torch.randn(b, hkv, sk, d, generator=g).to(dtype).requires_grad_()
        v = torch.randn(b, hkv, sk, d, generator=g).to(dtype).requires_grad_()
        mask = torch.randn(b, 1, sq, sk, generator=g) if bias else None
        out, _ = torch.ops.autopar.flash_attention(q, k, v, mask, causal, d ** -0.5)
        do = torch.randn(out.shape, generator=g).to(dtype)
        grads = torch.autograd.grad(out, (q, k, v), do)
        with ops.reference():
            ref, _ = torch.ops.autopar.flash_attention(q, k, v, mask, causal, d ** -0.5)
            rgrads = torch.autograd.grad(ref, (q, k, v), do)
        case = (f"B{b} H{h}/{hkv} S{sq}x{sk} D{d}{' causal' if causal else ''}{' +mask' if bias else ''}")
        print(f"| attention | {case} | {str(dtype)[6:]} | {rel(out, ref):.1e} | "
              + " | ".join(f"{rel(a, r):.1e}" for a, r in zip(grads, rgrads)) + " |")
    for act in ("gelu", "silu"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(3, 17, 40, generator=g).to(dtype).requires_grad_()
            w = (torch.randn(70, 40, generator=g) / 6).to(dtype).requires_grad_()
            bb = torch.randn(70, generator=g).to(dtype).requires_grad_()
            y, _ = torch.ops.autopar.linear_act(x, w, bb, act)
            dy = torch.randn(y.shape, generator=g).to(dtype)
            grads = torch.autograd.grad(y, (x, w, bb), dy)
            xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, bb))
            yr = getattr(torch.nn.functional, act)(torch.nn.functional.linear(xr, wr, br))
            rgrads = torch.autograd.grad(yr, (xr, wr, br), dy.float())
            print(f"| linear + {act} | [3, 17, 40] x [70, 40]^T + b | {str(dtype)[6:]} | {rel(y, yr):.1e} | "
                  + " | ".join(f"{rel(a, r):.1e}" for a, r in zip(grads, rgrads)) + " |")


if __name__ == "__main__":
    main()
