"""Kernel section of the benchmark harness: autopar's Triton kernels against PyTorch's.

    autopar bench --kernels [--kernel-seqs 1024 2048 4096 8192] [--out DIR]
    autopar bench --kernels --smoke        (tiny shapes: checks the harness runs; CPU timings mean nothing)

On a CUDA device: TFLOP/s (forward, and forward + backward) of ``autopar::flash_attention``
against ``F.scaled_dot_product_attention`` (PyTorch's own flash/efficient backends) over
sequence lengths, causal and not, head dims 64 and 128, bf16, GQA 4:1; and of
``autopar::linear_act`` (matmul + bias + GELU fused) against ``F.gelu(F.linear(...))``
(cuBLAS + a separate elementwise kernel) over sizes, forward and forward + backward. FLOPs:
4·B·H·S²·D for attention forward (halved when causal), 2.5x that for the backward; 2·M·N·K for
the matmul forward, twice that for its backward. Each shape's forward + backward times go into
the cache ``kernels="auto"`` decides from (kernels/choice.py), and the JSON's meta lists the launch
configuration the kernels chose per shape class with every candidate's time (kernels/tune.py).
Times are medians of CUDA-event timings of calls issued back to back (as a training step issues
them: the host's launch overhead counts only where it cannot keep ahead of the device), after
warm-up. Without a GPU it says so and measures nothing, unless
``--smoke`` (then it runs tiny shapes through Triton's interpreter to prove the harness works).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time

import torch

from autopar.kernels import choice, tune


def _time(fn, reps: int, cuda: bool, back_to_back: bool = True) -> float:
    """Median seconds of ``fn``. On a GPU, by CUDA events: ``back_to_back`` (kernels) times calls
    issued back to back, as a training step issues its ops (kernels/choice.py ``time_cuda``); else
    each call alone, synchronised (whole steps, which synchronise on their loss anyway). On CPU, the
    wall clock."""
    if cuda and back_to_back:
        return choice.time_cuda(fn, reps) / 1e3
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_rows(seqs, dtype, device, reps, smoke):
    import torch.nn.functional as F

    import autopar.kernels.ops  # noqa: F401

    rows = []
    b, h, hkv = (1, 4, 2) if smoke else (4, 32, 8)
    for d in ((64,) if smoke else (64, 128)):
        for s in seqs:
            for causal in (False, True):
                q = torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
                k = torch.randn(b, hkv, s, d, device=device, dtype=dtype, requires_grad=True)
                v = torch.randn(b, hkv, s, d, device=device, dtype=dtype, requires_grad=True)
                do = torch.randn(b, h, s, d, device=device, dtype=dtype)
                flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)

                def ours():
                    return torch.ops.autopar.flash_attention(q, k, v, None, causal, d ** -0.5)[0]

                def theirs():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

                row = {"kernel": "attention", "B": b, "H": h, "Hkv": hkv, "S": s, "D": d, "causal": causal}
                for name, fn in (("autopar", ours), ("torch", theirs)):
                    fwd = _time(lambda fn=fn: fn(), reps, device == "cuda")
                    both = _time(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), do), reps, device == "cuda")
                    row[f"{name}_fwd_tflops"] = flops / fwd / 1e12
                    row[f"{name}_fwdbwd_tflops"] = 3.5 * flops / both / 1e12
                    row[f"{name}_fwdbwd_ms"] = both * 1e3
                if device == "cuda":  # what kernels="auto" reads for this shape (kernels/choice.py)
                    choice.record(torch.cuda.get_device_name(), "attention",
                                  choice.attention_shape(b, h, hkv, s, s, d, causal, False, dtype),
                                  row["autopar_fwdbwd_ms"], row["torch_fwdbwd_ms"])
                rows.append(row)
    return rows


def matmul_rows(sizes, dtype, device, reps):
    import torch.nn.functional as F

    rows = []
    for m, n, k in sizes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        bias = torch.randn(n, device=device, dtype=dtype)
        flops = 2 * m * n * k
        row = {"kernel": "linear+gelu", "M": m, "N": n, "K": k}
        xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, bias))
        dy = torch.randn(m, n, device=device, dtype=dtype)
        sides = (("autopar", lambda a, b, c: torch.ops.autopar.linear_act(a, b, c, "gelu")[0]),
                 ("torch", lambda a, b, c: F.gelu(F.linear(a, b, c))))
        for name, fn in sides:
            row[f"{name}_tflops"] = flops / _time(lambda fn=fn: fn(x, w, bias), reps, device == "cuda") / 1e12
            both = _time(lambda fn=fn: torch.autograd.grad(fn(xg, wg, bg), (xg, wg, bg), dy), reps, device == "cuda")
            row[f"{name}_fwdbwd_tflops"] = 3 * flops / both / 1e12
            row[f"{name}_fwdbwd_ms"] = both * 1e3
        if device == "cuda":
            choice.record(torch.cuda.get_device_name(), "linear_act", choice.linear_shape(m, k, n, "gelu", True, dtype),
                          row["autopar_fwdbwd_ms"], row["torch_fwdbwd_ms"])
        rows.append(row)
    return rows


def _issue_ms(fn, calls: int) -> float:
    """Host milliseconds per call of issuing ``fn`` ``calls`` times without waiting for the device
    (the rate at which the host can launch it), after one warm-up call."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / calls
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return ms


def host_profile(out_dir: str, smoke: bool = False, calls: int = 20) -> list[dict]:
    """Where a forward call's time goes at a short sequence (B4 H32/8 S1024, D64 and D128, causal and
    not, on a GPU; tiny with ``smoke``): ``calls`` back-to-back forward calls of each side under
    torch.profiler. Per call: the wall time (CUDA events), the host time of the op's outermost
    profiled event (its dispatch, allocation and launch) and the device time of its kernels; for
    autopar also the host's issue time per call through the custom op with autograd, under no_grad,
    and of the kernel module's ``forward`` alone (no custom op): which layer the host time is in.
    The profiler's tables go to ``out_dir``/host-profile.txt."""
    rows, tables = [], []
    cuda = torch.cuda.is_available()
    shapes = [(64, True)] if smoke or not cuda else [(64, True), (64, False), (128, True), (128, False)]
    for d, causal in shapes:
        r, t = _host_profile_one(d, causal, smoke, calls)
        rows += r
        tables += t
    r, t = _linear_profile(smoke)
    rows += r
    tables += t
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "host-profile.txt"), "w") as f:
        f.write("\n\n".join(tables) + "\n")
    return rows


def _linear_profile(smoke: bool, calls: int = 5):
    """linear + GELU forward + backward (8192 x 4096 -> 14336 on a GPU), each side: wall ms per call
    and every device kernel's ms per call (where the backward's time goes)."""
    import torch.nn.functional as F

    import autopar.kernels.ops  # noqa: F401

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    m, n, k = (64, 96, 64) if smoke or not cuda else (8192, 14336, 4096)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5).requires_grad_()
    bias = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    sides = {"autopar": lambda: torch.ops.autopar.linear_act(x, w, bias, "gelu")[0],
             "torch": lambda: F.gelu(F.linear(x, w, bias))}
    rows, tables = [], []
    for name, fn in sides.items():
        def both(fn=fn):
            return torch.autograd.grad(fn(), (x, w, bias), dy)
        wall, avg = _profiled(both, calls)
        kernels = sorted(((getattr(e, "self_device_time_total", 0) / 1e3 / calls, e.key) for e in avg
                          if getattr(e, "self_device_time_total", 0) > 0), reverse=True)
        rows.append({"side": name, "shape": f"linear + GELU fwd+bwd {m}x{k} -> {n} {str(dtype)[6:]}",
                     "wall_ms_per_call": wall, "host_ms_per_call": None,
                     "device_ms_per_call": sum(ms for ms, _ in kernels),
                     "kernels": [{"name": key[:80], "ms": ms} for ms, key in kernels[:8]]})
        tables.append(f"== {name} linear + GELU fwd+bwd ({calls} calls)\n"
                      + avg.table(sort_by="self_device_time_total" if cuda else "cpu_time_total", row_limit=20))
    return rows, tables


def _profiled(fn, calls: int):
    """Wall milliseconds per call of ``fn`` back to back, and torch.profiler's averages over ``calls``
    more calls."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    wall = _time(fn, calls, cuda) * 1e3
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    return wall, prof.key_averages()


def _host_profile_one(d: int, causal: bool, smoke: bool, calls: int):
    import torch.nn.functional as F

    import autopar.kernels.ops as ops

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    b, h, hkv, s = (1, 4, 2, 64) if smoke or not cuda else (4, 32, 8, 1024)
    q = torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, hkv, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    sides = {"autopar": (lambda: torch.ops.autopar.flash_attention(q, k, v, None, causal, d ** -0.5)[0],
                         "autopar::flash_attention"),
             "torch": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                       "aten::scaled_dot_product_attention")}
    rows, tables = [], []
    for name, (fn, event) in sides.items():
        wall, avg = _profiled(fn, calls)
        top = [e for e in avg if e.key == event]
        dev = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in avg)
        shape = f"B{b} H{h}/{hkv} S{s} D{d}{' causal' if causal else ''} {str(dtype)[6:]}"
        row = {"side": name, "shape": shape, "wall_ms_per_call": wall,
               "host_ms_per_call": (top[0].cpu_time_total / 1e3 / calls) if top else None,
               "device_ms_per_call": dev / 1e3 / calls, "issue_ms_per_call": _issue_ms(fn, calls)}
        if name == "autopar":
            with torch.no_grad():
                row["issue_ms_no_grad"] = _issue_ms(fn, calls)
            module = ops._triton(q)[0]
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            row["issue_ms_kernel_module"] = _issue_ms(lambda: module.forward(qd, kd, vd, None, causal, d ** -0.5),
                                                      calls)
        rows.append(row)
        tables.append(f"== {name} {shape} ({calls} calls)\n" + avg.table(sort_by="cpu_time_total", row_limit=25))
    return rows, tables


def main(args) -> int:
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("autopar bench --kernels: no CUDA device on this machine. The kernels' speed is a GPU figure: "
              "Triton's interpreter (how they run on CPU here, for correctness tests) is not a performance path. "
              "Nothing measured; run this on a GPU machine (or --smoke to check the harness itself).")
        return 0
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    reps = 10 if cuda else 1
    seqs = args.kernel_seqs if not args.smoke else [64]
    sizes = [(4096, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336)] if cuda else [(64, 96, 64)]
    rows = attention_rows(seqs, dtype, device, reps, args.smoke) + matmul_rows(sizes, dtype, device, reps)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "triton": triton_version,
            "device": torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter: smoke test only)",
            "dtype": str(dtype),
            # each kernel's launch configuration per shape class, and every candidate's time (kernels/tune.py)
            "launch_configurations": tune.chosen()}
    lines = [f"Kernels on {meta['device']}, {meta['dtype']}, {meta['date']}" + ("" if cuda else
             " -- SMOKE TEST: interpreter timings, not performance"), "",
             "| kernel | shape | autopar TFLOP/s (fwd / fwd+bwd) | torch TFLOP/s (fwd / fwd+bwd) | autopar / torch "
             "(fwd / fwd+bwd) |", "|---|---|---|---|---|"]
    for r in rows:
        fwd = "autopar_fwd_tflops" if r["kernel"] == "attention" else "autopar_tflops"
        ratios = f"{r[fwd] / r[fwd.replace('autopar', 'torch')]:.2f} / " \
                 f"{r['autopar_fwdbwd_tflops'] / r['torch_fwdbwd_tflops']:.2f}"
        if r["kernel"] == "attention":
            shape = f"B{r['B']} H{r['H']}/{r['Hkv']} S{r['S']} D{r['D']}{' causal' if r['causal'] else ''}"
            lines.append(f"| attention | {shape} | {r['autopar_fwd_tflops']:.3g} / {r['autopar_fwdbwd_tflops']:.3g} | "
                         f"{r['torch_fwd_tflops']:.3g} / {r['torch_fwdbwd_tflops']:.3g} | {ratios} |")
        else:
            lines.append(f"| linear + GELU | {r['M']}x{r['N']}x{r['K']} | {r['autopar_tflops']:.3g} / "
                         f"{r['autopar_fwdbwd_tflops']:.3g} | {r['torch_tflops']:.3g} / {r['torch_fwdbwd_tflops']:.3g} | "
                         f"{ratios} |")
    md = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"kernels-{datetime.date.today()}" + ("-smoke" if not cuda else ""))
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    print(f"wrote {stem}.json, {stem}.md")
    return 0
