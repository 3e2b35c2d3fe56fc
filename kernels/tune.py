"""Launch configurations chosen by timing, per kernel and shape class, on the device that runs them.

A kernel module names its candidates (block sizes, warps, pipeline stages: ``Launch``) and a key
for the shape class a call belongs to; ``choose`` times every candidate once per key on the
current CUDA device (``triton.testing.do_bench``, median) and keeps the fastest for the life of
the process. A candidate that fails to compile or launch (too much shared memory for this chip,
say) is recorded with its error and skipped; if every candidate fails, the first one's error is
raised. Interpreted launches (Triton's interpreter, CPU tensors) take the module's fixed
``interpreted`` candidate: timing the interpreter says nothing.

Why not ``triton.autotune``: the interpreted twins (kernels/interpreter.py) rebind each kernel
function to a private namespace, and an autotuned kernel object would carry its compiled-mode
configs and cache into that twin; the choice also has to be reported (``chosen()``, written into
``autopar bench --kernels``' JSON) and must never break a launch that one candidate cannot run.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

_LOCK = threading.Lock()
_CHOSEN: dict[tuple, "Launch"] = {}
_TIMES: dict[tuple, dict[str, float | str]] = {}
_FORCED: dict[str, "Launch"] = {}  # kernel name -> the configuration every launch takes (``force``)


@dataclass(frozen=True)
class Launch:
    """One launch configuration: the kernel's block-size constexprs, warps and pipeline stages."""
    blocks: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def of(cls, num_warps: int = 4, num_stages: int = 3, **blocks: int) -> "Launch":
        return cls(tuple(blocks.items()), num_warps, num_stages)

    def __getitem__(self, name: str) -> int:
        return dict(self.blocks)[name]

    def kwargs(self, interpreted: bool) -> dict:
        kw = dict(self.blocks)
        if not interpreted:  # the interpreter takes no launch options
            kw.update(num_warps=self.num_warps, num_stages=self.num_stages)
        return kw

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.blocks) + f" w{self.num_warps} s{self.num_stages}"


def choose(name: str, key: tuple, candidates: list[Launch], run: Callable[[Launch], object],
           interpreted: Launch | None) -> Launch:
    """The launch configuration for kernel ``name`` on shape class ``key``: ``interpreted`` when
    that is given (an interpreted launch), else the fastest of ``candidates`` by ``run(config)``,
    timed on first use of the key and remembered."""
    forced = _FORCED.get(name)
    if forced is not None:
        return forced
    if interpreted is not None:
        return interpreted
    full = (name, key)
    got = _CHOSEN.get(full)
    if got is not None:
        return got
    with _LOCK:
        if full in _CHOSEN:
            return _CHOSEN[full]
        from triton.testing import do_bench

        times: dict[str, float | str] = {}
        best, best_ms, first_error = None, float("inf"), None
        for c in candidates:
            try:
                ms = do_bench(lambda c=c: run(c), warmup=5, rep=15, return_mode="median")
            except Exception as e:  # noqa: BLE001 - a candidate this chip cannot run: recorded, skipped
                lines = [ln for ln in str(e).splitlines() if ln.strip()]  # (a compile error's cause: its last line)
                times[str(c)] = (f"{type(e).__name__}: " + " ... ".join(dict.fromkeys(lines[:1] + lines[-1:])))[:300]
                first_error = first_error or e
                continue
            times[str(c)] = ms
            if ms < best_ms:
                best, best_ms = c, ms
        if best is None:
            raise first_error
        # a kept exception's traceback holds this frame and the failed launch's (their tensors among
        # them) in a cycle that only the cyclic collector frees: drop it now
        first_error = None
        _CHOSEN[full], _TIMES[full] = best, times
        return best


@contextlib.contextmanager
def force(name: str, config: "Launch"):
    """Inside the block every launch of kernel ``name`` takes ``config``, interpreted launches too,
    and nothing is timed or remembered: how tests run each device candidate through Triton's
    interpreter (tests/test_kernels.py)."""
    old = _FORCED.get(name)
    _FORCED[name] = config
    try:
        yield
    finally:
        if old is None:
            _FORCED.pop(name, None)
        else:
            _FORCED[name] = old


def forced(name: str) -> "Launch | None":
    """The configuration ``force`` set for kernel ``name``, if any."""
    return _FORCED.get(name)


class Plans:
    """Launch plans remembered by call signature: what a kernel module computes on the host for a
    call (the grid, the scalar arguments, the constexprs of the configuration ``choose`` picked)
    depends only on the tensors' shapes, strides, dtype and device and the call's flags, so a
    second call with the same signature reuses it and goes straight to Triton's launcher (the
    host's time per call is what a short kernel waits on: docs/kernels.md). At most ``limit``
    signatures are kept (then the table starts again), so varying shapes cannot grow it without
    bound."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._plans: dict = {}

    def get(self, sig):
        return self._plans.get(sig)

    def put(self, sig, plan) -> None:
        if len(self._plans) >= self.limit:
            self._plans.clear()
        self._plans[sig] = plan


def chosen() -> list[dict]:
    """Every choice made in this process: kernel, shape class, the chosen configuration and each
    candidate's median milliseconds (or its error)."""
    return [{"kernel": name, "key": repr(key), "chosen": str(c), "ms": _TIMES.get((name, key), {})}
            for (name, key), c in _CHOSEN.items()]


def bucket(n: int) -> int:
    """A size's class for the key: the next power of two (at least 64)."""
    return max(64, 1 << max(0, int(n) - 1).bit_length())
