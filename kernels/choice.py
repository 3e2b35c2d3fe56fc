"""``kernels="auto"``: autopar's kernel or PyTorch's op, decided per op and shape by timing both.

For each op the lower pass could rewrite (attention, linear + activation), ``decide`` times the
forward + backward of both sides on the device that will run it, on random inputs of the shape
each rank will see, and picks autopar's kernel only if it measured faster. Measurements are kept
in a small JSON cache (``cache_path()``: ``$AUTOPAR_CACHE_DIR`` or ``~/.cache/autopar``,
``kernel-choices.json``) keyed by the device's name, the torch and Triton versions and the shape,
so a compile measures each shape once per machine; ``autopar bench --kernels`` writes the same
entries for the shapes it times (``record``).

Where no CUDA device runs the program (a CPU mesh, or no GPU in this process), nothing is timed and
auto means PyTorch's ops: there Triton runs through its interpreter, a correctness path that is
orders of magnitude slower. Every decision is a ``Choice`` that the compile reports
(``pm.report()``, ``pm.ctx.kernel_choices``), with both times.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import threading
from dataclasses import dataclass

import torch

_LOCK = threading.Lock()
_MEMO: dict[str, dict] = {}  # this process's view of the cache file (read once, then kept)
REPS = 5  # timed forward + backward repetitions per side, after 2 warm-up ones


@dataclass(frozen=True)
class Choice:
    op: str  # "attention" | "linear_act"
    shape: str  # the shape each rank runs, as timed
    use_kernel: bool
    reason: str
    kernel_ms: float | None = None  # forward + backward, median
    torch_ms: float | None = None
    cached: bool = False  # read from the cache, not timed by this compile

    def line(self) -> str:
        side = "autopar's kernel" if self.use_kernel else "PyTorch's op"
        times = "" if self.kernel_ms is None else f": kernel {self.kernel_ms:.3f} ms, PyTorch {self.torch_ms:.3f} ms " \
                                                  f"forward + backward{' (cached)' if self.cached else ''}"
        return f"{self.op}{' ' + self.shape if self.shape else ''} -> {side}{times}; {self.reason}"


def cache_path() -> str:
    base = os.environ.get("AUTOPAR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "autopar")
    return os.path.join(base, "kernel-choices.json")


def _versions() -> str:
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "none"
    return f"torch {torch.__version__} triton {tv}"


def cache_key(device_name: str, op: str, shape: str) -> str:
    return f"{device_name} | {_versions()} | {op} {shape}"


def _load() -> dict:
    if not _MEMO:
        try:
            with open(cache_path()) as f:
                _MEMO.update(json.load(f))
        except (OSError, ValueError):  # no cache yet, or an unreadable one: measured again
            pass
    return _MEMO


def record(device_name: str, op: str, shape: str, kernel_ms: float, torch_ms: float) -> None:
    """Keep one measurement (in memory and in the cache file; a file that cannot be written is
    left alone: the decision still holds for this process)."""
    with _LOCK:
        entries = _load()
        entries[cache_key(device_name, op, shape)] = {"kernel_ms": kernel_ms, "torch_ms": torch_ms,
                                                      "date": datetime.date.today().isoformat()}
        path = cache_path()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(path + ".tmp", path)
        except OSError:
            pass


def lookup(device_name: str, op: str, shape: str) -> dict | None:
    with _LOCK:
        return _load().get(cache_key(device_name, op, shape))


# ------------------------------------------------------------------------------------------ shapes
def attention_shape(b, h, hkv, m, n, d, causal, bias, dtype) -> str:
    return f"B{b} H{h}/{hkv} S{m}x{n} D{d}{' causal' if causal else ''}{' mask' if bias else ''} {_dt(dtype)}"


def linear_shape(rows, k, n, act, bias, dtype) -> str:
    return f"[{rows}, {k}] x [{n}, {k}]^T{' + b' if bias else ''} {act} {_dt(dtype)}"


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------ timing
def time_cuda(fn, reps: int = REPS) -> float:
    """Milliseconds per call of ``fn`` on the current CUDA device: the median over 3 rounds of
    ``reps`` calls issued back to back between two CUDA events, after 2 warm-up calls. Back to back,
    as a training step issues its ops: the host runs ahead of the device, so what is timed is the
    device's work, plus the host's only where the host cannot keep up (a per-call synchronisation
    would add each call's launch latency to a short kernel and rank sides by their Python
    overhead instead)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        rounds.append(a.elapsed_time(b) / reps)
    return statistics.median(rounds)


def time_attention(b, h, hkv, m, n, d, causal, bias, dtype, device="cuda") -> tuple[float, float]:
    """Forward + backward milliseconds of autopar's flash attention and of SDPA (its own backend
    choice, grouped-query heads natively) on random inputs of this shape."""
    import torch.nn.functional as F

    import autopar.kernels.ops  # noqa: F401 - registers torch.ops.autopar.*

    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(b, h, m, d, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(b, hkv, n, d, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(b, hkv, n, d, device=device, dtype=dtype, generator=g).requires_grad_()
    mask = torch.randn(1, 1, m, n, device=device, dtype=dtype, generator=g) if bias else None
    do = torch.randn(b, h, m, d, device=device, dtype=dtype, generator=g)
    scale = d ** -0.5

    def ours():
        out = torch.ops.autopar.flash_attention(q, k, v, mask, causal, scale)[0]
        torch.autograd.grad(out, (q, k, v), do)

    def theirs():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=h != hkv)
        torch.autograd.grad(out, (q, k, v), do)
    return time_cuda(ours), time_cuda(theirs)


def time_linear(rows, k, n, act, bias, dtype, device="cuda") -> tuple[float, float]:
    """Forward + backward milliseconds of autopar's linear_act and of act(F.linear(...))."""
    import torch.nn.functional as F

    import autopar.kernels.ops  # noqa: F401

    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(n, k, device=device, dtype=dtype, generator=g) / k ** 0.5).requires_grad_()
    b = torch.randn(n, device=device, dtype=dtype, generator=g).requires_grad_() if bias else None
    dy = torch.randn(rows, n, device=device, dtype=dtype, generator=g)
    leaves = (x, w) if b is None else (x, w, b)

    def ours():
        torch.autograd.grad(torch.ops.autopar.linear_act(x, w, b, act)[0], leaves, dy)

    def theirs():
        torch.autograd.grad(getattr(F, act)(F.linear(x, w, b)), leaves, dy)
    return time_cuda(ours), time_cuda(theirs)


# ------------------------------------------------------------------------------------------ decide
def decide(op: str, shape: str, timer, device: torch.device | str) -> Choice:
    """autopar's kernel or PyTorch's op for ``op`` at ``shape`` (the string ``attention_shape`` /
    ``linear_shape`` gives); ``timer()`` -> (kernel ms, torch ms) measures it on ``device`` when the
    cache has no entry. The kernel only if it measured strictly faster."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return Choice(op, shape, False, f"no CUDA device runs it ({device.type}): Triton would run interpreted")
    try:
        import triton  # noqa: F401
    except ImportError:
        return Choice(op, shape, False, "Triton is not installed")
    name = torch.cuda.get_device_name(device)
    hit = lookup(name, op, shape)
    cached = hit is not None
    if hit is None:
        try:
            kernel_ms, torch_ms = timer()
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return Choice(op, shape, False, "not timed: the timing inputs did not fit in the device's free memory")
        record(name, op, shape, kernel_ms, torch_ms)
        hit = {"kernel_ms": kernel_ms, "torch_ms": torch_ms}
    faster = hit["kernel_ms"] < hit["torch_ms"]
    why = (f"measured {hit['torch_ms'] / hit['kernel_ms']:.2f}x faster" if faster
           else f"the kernel measured {hit['kernel_ms'] / hit['torch_ms']:.2f}x slower") + f" on {name}"
    return Choice(op, shape, faster, why, hit["kernel_ms"], hit["torch_ms"], cached)


def not_timed(why: str) -> Choice:
    """kernels="auto" where nothing is timed (a mesh that is not CUDA, or no Triton), and why."""
    return Choice("attention and linear + activation", "", False, f"not timed: {why}; kernels='on' forces the kernels")


def summary(choices) -> list[str]:
    """One line per distinct decision (op and shape), in order, with how many ops it covers (a
    model's layers share their shapes: one timing, many ops)."""
    counts: dict[tuple, list] = {}
    for c in choices:
        counts.setdefault((c.op, c.shape), [c, 0])[1] += 1
    return [c.line() + (f" [{n} ops]" if n > 1 else "") for c, n in counts.values()]
