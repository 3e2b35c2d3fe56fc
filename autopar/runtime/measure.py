"""Instruments at the level the user pays for: the process group and the allocator.

``CommMeter`` counts the bytes of every collective this process hands to ``c10d`` (a
TorchDispatchMode at the collective ops that DDP's reducer, FSDP2, DTensor and autopar's
programs all go through); ``allocator_peak`` reads the allocator's own memory events
(torch.profiler, CPU and CUDA). Neither reads autopar's graphs, so a prediction compared with
them can fail. ``timed`` runs one step between barriers.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.ir import ring_bytes


_KINDS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced_": "all_reduce",
          "_allgather_base_": "all_gather", "allgather_": "all_gather", "all_gather_into_tensor": "all_gather",
          "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
          "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
          "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
          "reduce_scatter_tensor_coalesced": "reduce_scatter", "broadcast_": "broadcast",
          "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all"}


def _group_size(args) -> int:
    names = [a for a in args if isinstance(a, str)]
    if names:  # functional collectives name their group last (an earlier str is the reduce op)
        return dist.get_world_size(dist.distributed_c10d._resolve_process_group(names[-1]))
    for a in args:  # c10d ops carry the ProcessGroup object
        if hasattr(a, "size") and not isinstance(a, torch.Tensor) and callable(a.size):
            try:
                return int(a.size())
            except Exception:  # noqa: BLE001
                continue
    for a in args:  # all_gather_into_tensor(x, group_size, group): the int is the size
        if isinstance(a, int) and a > 0:
            return a
    return dist.get_world_size()


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


class CommMeter(TorchDispatchMode):
    """Bytes every collective this process calls sends (ring model), by kind."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            kind = _KINDS.get(func._opname)
            if kind is not None:
                n = _group_size(list(args) + list(kwargs.values()))
                if kind == "all_gather":  # the per-rank input: the last tensor argument
                    ts = _tensors(args[1] if ns == "c10d" else args[0])
                else:
                    ts = _tensors(args[0])
                nbytes = sum(t.numel() * t.element_size() for t in ts)
                if kind == "broadcast":
                    sent = nbytes if n > 1 and dist.get_rank() == 0 else 0  # the root sends
                else:  # the same ring model autopar's compiler predicts with
                    sent = ring_bytes(kind, nbytes, n)
                self.bytes[kind] += sent
                self.calls[kind] += 1
        return func(*args, **kwargs)


def allocator_peak(fn) -> int:
    """Peak bytes the allocator held above its level before ``fn()``, from profiler memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
                 profile_memory=True, record_shapes=False) as prof:
        fn()
    events = []

    def walk(nodes):
        for e in nodes:
            extra = e.extra_fields
            if type(extra).__name__ == "_ExtraFields_Allocation":
                events.append((e.start_time_ns, extra.alloc_size))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    cur = peak = 0
    for _, size in sorted(events):
        cur += size
        peak = max(peak, cur)
    return peak


def persistent_bytes(params, optimizer) -> dict[str, int]:
    from autopar.runtime.memory import optimizer_state_bytes, tensor_bytes

    params = list(params)
    return {"parameters": tensor_bytes(params), "gradients": tensor_bytes(p.grad for p in params),
            "optimizer_state": optimizer_state_bytes(optimizer)}


def timed(step, *batch):
    """One step between barriers (the slowest rank sets the time): (its result, seconds)."""
    dist.barrier()
    t0 = time.perf_counter()
    out = step(*batch)
    dist.barrier()
    return out, time.perf_counter() - t0
