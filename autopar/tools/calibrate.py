"""``autopar calibrate``: measure this machine for the cost model's device table.

Measures, with one thread per rank (as the gloo workers run): matmul FLOP/s per dtype, memory
bandwidth (an elementwise add on 4 MiB tensors, its outputs kept alive as a forward's are: bytes
read + written), torch.optim.AdamW's step (its 20 fp32 accesses per element as bytes/s), and
gloo all-reduce between ``--ranks`` processes on this machine (default 2; latency from a 4-byte
all-reduce, bandwidth from a 16 MiB one). Where more processes than cores will run (4 gloo ranks on a 2-core machine), measure
with that many: a ring step then also waits for the OS to schedule its peer, which the row keeps as
``loaded_alpha`` (a 4-byte all-reduce between 1 ms slices of matmuls on every rank). Prints the row and
writes it as JSON (``--out``), which ``autopar plan --devices FILE --device NAME`` reads.

``--device cuda`` measures the GPU instead (what the datasheet rows h100 / h200 assume): bf16 /
fp16 / fp32 matmuls at 4096^3, HBM bandwidth by an elementwise add on 1 GiB tensors (what the
kernels Inductor generates are costed at), the rate of a transformer block's elementwise ops run
eagerly (bf16, casts, broadcasts, strided halves: ``eager_bw``, what the per-rank program's own
ops are costed at), AdamW's step, and the host's launch gap per op (a loop of tiny ops, synchronised once at the end: the per-rank program's
launch rate when the GPU is not the limit). Each figure is timed between ``torch.cuda.synchronize``
calls. The links (NVLink, the NIC) cannot be measured on one GPU: they are the datasheet row's
(``row_for`` the device's name), and the row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timeit(fn, reps: int, device: str = "cpu", inner: int = 1) -> float:
    """Median seconds of one ``fn()``, each timing ``inner`` calls back to back between two
    synchronisations (on a GPU a 0.2 ms op timed alone would carry the synchronisation's latency)."""
    fn()
    ts = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        ts.append((time.perf_counter() - t0) / inner)
    return statistics.median(ts)


def matmul_flops(dtype: torch.dtype, n: int = 512, reps: int = 5, device: str = "cpu", inner: int = 1) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _timeit(lambda: a @ b, reps, device, inner)


def memory_bandwidth(mib: int = 4, reps: int = 40, alive: int = 32, device: str = "cpu") -> float:
    """Bytes read + written per second by an elementwise op allocating its output, as the
    per-rank program's ops do: the last ``alive`` outputs stay alive (a forward's activations wait
    for the backward), so each output is memory the allocator gets fresh from the OS, its pages
    faulted in as the op writes them. Measured 2026-11-25 on this machine: 8-9 GB/s for 0.5-8 MiB
    tensors, against 75-115 GB/s when every call gets the same warm block back (what this measured
    before; the program's elementwise ops were then predicted 10x too fast). On a GPU the caching
    allocator hands blocks back without the OS, and each add is timed between synchronisations."""
    x = torch.randn(mib * 2**20 // 4, device=device)
    y = torch.randn_like(x)
    ring: list = [None] * alive
    times = []
    for i in range(reps + alive):
        _sync(device)
        t0 = time.perf_counter()
        z = x + y
        _sync(device)
        times.append(time.perf_counter() - t0)
        ring[i % alive] = z
    return 3 * x.numel() * 4 / statistics.median(times[alive:])


def op_overhead(reps: int = 2000, device: str = "cpu") -> float:
    """Seconds of eager dispatch for a tiny op (what every node of the per-rank program costs; on a
    GPU the launch gap: the loop is synchronised once, after it)."""
    x = torch.ones(8, device=device)
    x = x + 1
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        x = x + 1
    _sync(device)
    return (time.perf_counter() - t0) / reps


def optimizer_bandwidth(elems: int = 2**22, reps: int = 5, device: str = "cpu") -> float:
    """Bytes/s of torch.optim.AdamW's step as torch runs it by default (for-loop on a CPU, foreach
    on a GPU) over ``elems`` fp32 parameter elements in 8 tensors, counted as the cost model counts
    it (``cost.OPTIMIZER_ACCESSES``: 20 accesses x 4 bytes per element)."""
    from autopar.analysis.cost import _optimizer_bytes_per_element

    params = [torch.nn.Parameter(torch.randn(elems // 8, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()  # (its state made)
    return elems * _optimizer_bytes_per_element("adamw") / _timeit(opt.step, reps, device)


def _block_elementwise(x, w, cos, sin, gate, up, dr, dm):
    """A Llama block's elementwise ops, forward and backward: an RMSNorm computed in fp32 and cast
    back, rotary embedding on its heads (the cat of two strided halves), a SiLU gate and a residual
    add; the backward by ``torch.autograd.grad`` (traced with the forward by ``make_fx``)."""
    b, s, h, d = cos.shape[0], cos.shape[1], x.shape[-1] // cos.shape[-1], cos.shape[-1]
    hf = x.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
    q = n.view(b, s, h, d)
    r = q * cos + torch.cat((-q[..., d // 2:], q[..., :d // 2]), -1) * sin
    m = torch.nn.functional.silu(gate) * up + x
    return torch.autograd.grad((r, m), (x, w, gate, up), (dr.view(r.shape), dm))


def eager_bandwidth(tokens: int = 8192, dim: int = 4096, head_dim: int = 128, reps: int = 10,
                    device: str = "cuda", overhead: float = 0.0) -> float:
    """Bytes/s at which a training step's elementwise ops run eagerly, op by op as the per-rank
    program runs them: ``_block_elementwise`` at ``tokens`` x ``dim`` in bf16 (Llama-3-8B's width),
    traced to ATen ops, its bytes counted by the cost model's own counter (``cost.compute_seconds``)
    and the traced program timed whole. Returns the rate at which the cost model's GPU formula
    (each op: its bytes at this rate, or the launch gap ``overhead`` if longer) gives the measured
    time. On the H200 of 2026-11-27 these ops ran at about 2/3 of what a contiguous fp32 add on
    1 GiB reaches (``memory_bandwidth``): bf16, broadcasting, casts, strided halves."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.analysis import cost
    from autopar.analysis.devices import Device

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device).manual_seed(0)

    def rnd(*shape, grad=False):
        return torch.randn(*shape, generator=g, device=device, dtype=dt).requires_grad_(grad)
    b = 2
    s = tokens // b
    inputs = (rnd(b, s, dim, grad=True), rnd(dim, grad=True), rnd(b, s, 1, head_dim), rnd(b, s, 1, head_dim),
              rnd(b, s, dim, grad=True), rnd(b, s, dim, grad=True), rnd(b, s, dim), rnd(b, s, dim))
    gm = make_fx(_block_elementwise)(*inputs)
    unit = Device("bytes", {"fp32": 1e30, "bf16": 1e30, "fp16": 1e30}, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1)
    moved = [cost.compute_seconds(n, unit, 0) for n in gm.graph.nodes]  # bytes (1 byte/s, no launch gap)
    moved = [m for m in moved if m > 0]
    with torch.no_grad():  # the traced ops alone, as the per-rank program runs them
        t = _timeit(lambda: gm(*inputs), reps, device)

    def predicted(bw):
        return sum(max(m / bw, overhead) for m in moved)
    lo, hi = 1e6, 1e15  # bisection on the rate: predicted() falls as bw rises
    if predicted(hi) >= t:  # launch-bound: the bytes decide nothing
        return sum(moved) / t
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predicted(mid) > t else (lo, mid)
    return (lo * hi) ** 0.5


def _allreduce_job(sizes, reps):
    import torch.distributed as dist

    out = {}
    for n in sizes:
        x = torch.ones(max(1, n // 4))
        dist.barrier()
        out[n] = _timeit(lambda: dist.all_reduce(x), reps)
    return out


def _loaded_job(work_s: float = 1e-3, iters: int = 60) -> float:
    """Seconds a 4-byte all-reduce adds to an iteration of ``work_s`` of matmuls on every rank
    (the ranks computing between collectives, as a program's do)."""
    import torch.distributed as dist

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    k = max(1, int(work_s / _timeit(lambda: a @ b, 20)))
    x = torch.ones(1)
    out = {}
    for with_ar in (False, True, False, True):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            for _ in range(k):
                a @ b
            if with_ar:
                dist.all_reduce(x)
        dist.barrier()
        out.setdefault(with_ar, []).append((time.perf_counter() - t0) / iters)
    return min(out[True]) - min(out[False])


def gloo_links(reps: int = 10, ranks: int = 2) -> tuple[float, float, float]:
    """(alpha per ring step, bandwidth per rank, loaded alpha per ring step) of a gloo all-reduce
    among ``ranks`` processes, read as the cost model reads a ring all-reduce: 2(N-1) steps, each
    rank sending 2(N-1)/N of the payload (``ir.ring_bytes``). The loaded alpha (``Device.loaded_alpha``)
    only where the ranks outnumber the cores: the ranks compute between all-reduces (``_loaded_job``)."""
    from autopar.testing import DistPool

    pool = DistPool(ranks)
    try:
        small, big = 4, 16 * 2**20
        t = pool.run(_allreduce_job, [small, big], reps)
        loaded = pool.run(_loaded_job) if ranks > (os.cpu_count() or 1) else 0.0
    finally:
        pool.close()
    steps = 2 * (ranks - 1)
    alpha = t[small] / steps
    bw = big * steps / ranks / max(t[big] - t[small], 1e-9)
    return alpha, bw, max(0.0, loaded) / steps


def calibrate(name: str | None = "cpu", comm: bool = True, ranks: int = 2, device: str = "cpu") -> dict:
    if device == "cuda":
        return calibrate_gpu(name)
    torch.set_num_threads(1)
    row = {"name": name,
           "flops": {"fp32": matmul_flops(torch.float32), "bf16": matmul_flops(torch.bfloat16),
                     "fp16": matmul_flops(torch.float16, reps=3)},
           "mem_bw": memory_bandwidth(), "mem_bytes": _ram(), "ranks_per_node": 64, "efficiency": 1.0,
           "op_overhead": op_overhead(), "cores": os.cpu_count() or 1, "optimizer_bw": optimizer_bandwidth(),
           "source": f"calibrated by `autopar calibrate` on {time.strftime('%Y-%m-%d')}, 1 thread per rank, "
                     f"gloo all-reduce among {ranks} processes"}
    alpha, bw, loaded = gloo_links(ranks=ranks) if comm else (60e-6, 1e9, 0.0)
    row.update(intra_bw=bw, intra_alpha=alpha, inter_bw=bw, inter_alpha=alpha, loaded_alpha=loaded)
    return row


def calibrate_gpu(name: str | None = None, n: int = 4096, mib: int = 1024, device: str = "cuda",
                  opt_elems: int = 2**27, tokens: int = 8192, dim: int = 4096) -> dict:
    """The row for this process's GPU: measured compute, HBM bandwidth and launch gap; memory from
    the device's properties; links and nodes from the datasheet row of its name (one GPU cannot
    measure them). Efficiency 1: the figures are achieved rates. (``device``: where the timed ops
    run; "cpu" only in the test that checks the row without a GPU.)"""
    from dataclasses import asdict

    from autopar.analysis.devices import DEVICES, row_for

    gpu = torch.cuda.get_device_name()
    base = DEVICES[row_for(gpu)]
    flops = {"fp32": matmul_flops(torch.float32, n, 5, device, 4),
             "bf16": matmul_flops(torch.bfloat16, n, 10, device, 10),
             "fp16": matmul_flops(torch.float16, n, 10, device, 10)}
    gap = op_overhead(2000, device)
    row = {**asdict(base), "name": name or f"{base.name}-calibrated", "flops": flops, "efficiency": 1.0,
           "mem_bw": memory_bandwidth(mib, 20, 2, device), "op_overhead": gap,
           "eager_bw": eager_bandwidth(tokens, dim, device=device, overhead=gap),
           "optimizer_bw": optimizer_bandwidth(opt_elems, 5, device),
           "mem_bytes": float(torch.cuda.get_device_properties(0).total_memory)}
    row["source"] = (f"calibrated by `autopar calibrate --device cuda` on {time.strftime('%Y-%m-%d')} on {gpu} "
                     f"(torch {torch.__version__}): {n}^3 matmuls, an elementwise add on {mib} MiB, a Llama block's "
                     f"elementwise ops forward + backward at {tokens} x {dim} run eagerly, the launch gap of a tiny op, torch's AdamW step on {opt_elems:,} parameters; links from the {base.name} row "
                     f"({base.source})")
    return row


def _ram() -> float:
    try:
        with open("/proc/meminfo") as f:
            return float(f.readline().split()[1]) * 1024
    except OSError:
        return 16 * 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="autopar calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=None,
                   help="the device row's name (default cpu; with --device cuda, the datasheet row's + -calibrated)")
    p.add_argument("--out", default=None, help="write the row as JSON here")
    p.add_argument("--no-comm", action="store_true", help="skip the gloo measurement")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="measure the CPU (default) or this process's GPU (links then from the datasheet row)")
    p.add_argument("--ranks", type=int, default=2,
                   help="processes in the gloo measurement (default 2; the number the measured runs will use)")
    args = p.parse_args(argv)
    from autopar.errors import PlanError

    bad = (PlanError(f"--ranks {args.ranks}: an all-reduce needs at least 2 processes", where="--ranks",
                     fix="pass 2 or more") if args.ranks < 2 else
           PlanError("--device cuda: torch sees no GPU here", where="--device", fix="run it on the GPU machine")
           if args.device == "cuda" and not torch.cuda.is_available() else None)
    if bad is not None:
        print(f"autopar calibrate: {bad}", file=sys.stderr)
        return 2
    name = args.name or ("cpu" if args.device == "cpu" else None)
    row = calibrate(name, comm=not args.no_comm, ranks=args.ranks, device=args.device)
    from autopar.analysis.cost import Device

    print(Device(**row).describe())
    if args.out:
        with open(args.out, "w") as f:
            json.dump([row], f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
