"""Every launch configuration the kernels' tuner may pick, compiled for a Hopper GPU on this CPU.

    .venv/bin/python benchmarks/compile_candidates.py [--arch 90] [--smem 232448] [--jobs 2] [--only attention|matmul]

Triton compiles ahead of time without a GPU: ``triton.compile`` on an ``ASTSource`` for the target
``GPUTarget("cuda", 90, 32)`` runs the whole pipeline (Triton IR, its GPU dialect, LLVM, PTX and
``ptxas``, which the Triton wheel ships) and reports the shared memory the kernel needs. So before a
GPU session this finds what the tests through Triton's interpreter cannot: code the compiler
refuses (on 2026-11-28 an early ``return`` in a ``@triton.jit`` helper passed every interpreted test
and failed to compile on the H200; compiled here, at that commit, it fails the same way) and
configurations over the chip's shared memory as this Triton lays them out. One specialisation per
candidate: bf16, no mask, causal, sizes the blocks divide, the candidate's own flags (TMA ones with
tensor descriptors). The GPU machine's Triton (3.6) is older than this venv's (3.9), and their
shared memory differs: the hand-pipelined 128x128 3-stage forward of 020d5e5 needed 262,144 bytes
on the H200's 3.6 (refused) and 65,536 here; its TMA twin needed 263,168 on both (refused on both).
So this is a check before the GPU's, not instead of it (benchmarks/gpu_check.py ``candidates``
forces each configuration on the chip).

Prints one line per configuration (compiled, its shared memory and seconds, or the error's last
line) and exits 1 if any failed or exceeds ``--smem``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H100_SMEM = 232448  # bytes of shared memory a block may use on an H100 / H200 (227 KiB)


def _signature(fn, consts: dict, types: dict) -> tuple[dict, dict]:
    """(signature, constexprs) for ``triton.compile``: each argument's type (``types`` by name, the
    rest i32), ``consts`` as constexprs."""
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    return sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}


def attention_jobs() -> list[tuple]:
    from autopar.kernels import attention

    return [("attention", kernel, d, c) for kernel, table in (("_fwd", attention.FWD), ("_bwd_dkdv", attention.DKDV),
                                                              ("_bwd_dq", attention.DQ))
            for d, configs in table.items() for c in configs]


def matmul_jobs() -> list[tuple]:
    from autopar.kernels import matmul

    return [("matmul", "_matmul_persistent" if dict(c.blocks).get("PERSISTENT") else "_matmul", None, c)
            for c in matmul.CANDIDATES]


def compile_one(job: tuple, arch: int) -> dict:
    """Compile one configuration; its shared memory, or the error's last line."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from autopar.kernels import attention, matmul

    family, kernel, d, c = job
    blocks = dict(c.blocks)
    tma = bool(blocks.get("TMA"))
    if family == "attention":
        fn = getattr(attention, kernel)
        consts = dict(HAS_BIAS=False, CAUSAL=True, UPCAST=False, TMA=tma, EVEN_M=True, EVEN_N=True, EVEN_D=True,
                      BLOCK_M=blocks["BLOCK_M"], BLOCK_N=blocks["BLOCK_N"], BLOCK_D=d)
        if kernel == "_fwd":
            consts.update(FOLD=True, WS=bool(blocks.get("WS")))
        rows = {"Q": "BLOCK_M", "O": "BLOCK_M", "DO": "BLOCK_M", "DQ": "BLOCK_M",
                "K": "BLOCK_N", "V": "BLOCK_N", "DK": "BLOCK_N", "DV": "BLOCK_N"}
        types = {n: (f"tensordesc<bf16[1,1,{blocks[r]},{d}]>" if tma else "*bf16") for n, r in rows.items()}
        types.update(Bias="*bf16", LSE="*fp32", Delta="*fp32", scale="fp32")
        name = f"attention {kernel} D{d} {c}"
    else:
        fn = getattr(matmul, kernel)
        bm, bn, bk = blocks["BLOCK_M"], blocks["BLOCK_N"], blocks["BLOCK_K"]
        consts = dict(HAS_BIAS=True, ACT=1, STORE_Z=True, UPCAST=False, EVEN_K=True, EVEN_MN=True,
                      EPI_SPLIT=blocks.get("EPI_SPLIT", 0), TMA=int(tma), A_T=0, B_T=int(tma),
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
        if kernel == "_matmul_persistent":
            consts["NUM_SMS"] = 132
        types = {"A": f"tensordesc<bf16[{bm},{bk}]>" if tma else "*bf16",
                 "B": f"tensordesc<bf16[{bn},{bk}]>" if tma else "*bf16",  # (x @ w.T: w's rows are B's columns)
                 "Bias": "*bf16", "C": "*bf16", "Z": "*bf16"}
        name = f"matmul {kernel} {c}"
    sig, constexprs = _signature(fn, consts, types)
    t0 = time.perf_counter()
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the finding
        err = e.__cause__ or e
        lines = [ln for ln in str(err).splitlines() if ln.strip()]
        return {"name": name, "error": f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300],
                "s": time.perf_counter() - t0}
    return {"name": name, "shared": k.metadata.shared, "s": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default 90: Hopper)")
    ap.add_argument("--smem", type=int, default=H100_SMEM, help="shared memory limit in bytes (default: H100's)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", choices=["attention", "matmul"], default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (Triton 3.9 warns when it is unset)
    jobs = ([] if args.only == "matmul" else attention_jobs()) + ([] if args.only == "attention" else matmul_jobs())
    t0 = time.time()
    bad = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        for r in pool.map(compile_one, jobs, [args.arch] * len(jobs)):
            if "error" in r:
                bad += 1
                print(f"FAILED  {r['name']}: {r['error']}", flush=True)
            elif r["shared"] > args.smem:
                bad += 1
                print(f"OVER    {r['name']}: {r['shared']:,} bytes of shared memory > {args.smem:,}", flush=True)
            else:
                print(f"ok      {r['name']}: {r['shared']:,} bytes, {r['s']:.1f} s", flush=True)
    print(f"{len(jobs)} configurations compiled for sm_{args.arch} in {time.time() - t0:.0f} s: "
          f"{len(jobs) - bad} ok, {bad} failed or over {args.smem:,} bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
