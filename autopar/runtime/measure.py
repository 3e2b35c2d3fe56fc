"""Instruments at the level the user pays for: the process group and the allocator.

Neither reads autopar's graphs, so a prediction compared with them can fail.

- ``CommMeter`` counts what this process hands to the process group: every ``c10d::*`` op
  (a TorchDispatchMode). ``ProcessGroup``'s methods (``allreduce``, ``send``...) call these ops
  through the dispatcher whoever calls them: ``torch.distributed``'s functions, DDP's reducer,
  FSDP2, DTensor, and the ``_c10d_functional`` ops of autopar's per-rank programs, whose
  kernels (torch/csrc/distributed/c10d/Functional.cpp) call ``group->allreduce(...)`` and so
  ``c10d::allreduce_``. A Python dispatch mode is taken off the mode stack while it handles an
  op, so it sees a functional collective but not the ``c10d`` op inside it; the meter runs the
  functional op's own kernel with itself entered again and counts only at the ``c10d`` op:
  each transfer once, as the process group receives it. Expert parallelism's ops
  (``autopar::moe_experts_ep`` and its backward, autopar/experts.py) issue their uneven
  all-to-alls inside, at run time: the meter runs them the same way, and counts those
  all-to-alls as kind ``all_to_all_v``, the bytes that leave the rank.
- ``AllocatorPeak`` / ``allocator_peak``: the most the allocator held above its level when the
  measurement started. CUDA: ``torch.cuda.max_memory_allocated`` (peak statistics reset at the
  start). CPU, which keeps no statistics: the CPU allocator's own allocation and free events,
  reported to torch.profiler (``profile_memory=True``). They include scratch memory inside ops
  and everything the step allocates outside autopar's programs; a free of a block allocated
  before the measurement is not reported (the profiler cannot size it), so a step that frees
  memory it did not allocate reads high, never low.
- ``timed`` runs one step between barriers.

Dispatch modes cost Python time on every op while active: on the 2-rank test Llama the meter
adds 56% (fsdp) to 92% (ddp) to a step, ``track_memory()`` (the meter, memory.ProgramMeter and
the profiler) 2.1x to 3.6x; so the runtime turns them on only when asked (``pm.measure()``,
``pm.track_memory()``).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from autopar import torch_compat as tc
from autopar.experts import EP_KIND, EP_OPS
from autopar.ir import ring_bytes

# c10d op -> (kind, the argument holding this rank's payload). The payload is what the prediction
# (autopar/ir.py ring_bytes) calls it: the tensor reduced (all_reduce), this rank's input to a
# gather, the whole input of a reduce-scatter, what a send sends / a broadcast's root broadcasts.
C10D_OPS = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "allgather_": ("all_gather", "input_tensors"),
    "_allgather_base_": ("all_gather", "input_tensor"),
    "allgather_coalesced_": ("all_gather", "input_list"),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "broadcast_": ("broadcast", "tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "recv_any_source_": ("recv", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
}
_FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _named_args(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def mesh_axes(mesh) -> dict[str, str]:
    """Process-group name -> mesh axis name. A mesh axis spanning every rank uses the default
    group, so collectives on the default group (``dist.all_reduce`` with no group) are then
    counted on that axis; otherwise on ``"world"``."""
    return {mesh.get_group(i).group_name: name for i, name in enumerate(mesh.mesh_dim_names)}


class CommMeter(tc.TorchDispatchMode):
    """Bytes this process hands to the process group, per collective kind and mesh axis.

    ``axes``: process-group name -> axis name (``mesh_axes``); a group not in it is ``"world"``
    (the default group) or ``"group <name>"``. ``p2p_axis``: the axis sends and receives are
    counted on whatever group carries them (a pipeline sends on the default group to a global
    rank). ``summary()``: ``{"kind@axis": {"calls", "payload_bytes", "wire_bytes"}}``, keyed
    like the compiler's prediction (``autopar.ir.bytes_by_collective``). Wire bytes follow the
    ring model the compiler predicts with; a broadcast's root sends the payload to each of the
    other ranks, a receive sends nothing.
    """

    def __init__(self, axes: dict[str, str] | None = None, p2p_axis: str | None = None):
        super().__init__()
        self.axes = dict(axes or {})
        self.p2p_axis = p2p_axis
        self.table: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0, 0.0])
        self._depth = 0
        self._in_ep = 0  # inside an expert-parallel op (autopar/experts.py)

    def __enter__(self):
        # entered again while active (``with pm.counter:`` around a measured step): one mode on
        # the stack, so each op is counted once
        self._depth += 1
        return super().__enter__() if self._depth == 1 else self

    def __exit__(self, *exc):
        self._depth -= 1
        return super().__exit__(*exc) if self._depth == 0 else False

    def reset(self) -> None:
        self.table.clear()

    def summary(self) -> dict:
        return {f"{k}@{a}": {"calls": c, "payload_bytes": p, "wire_bytes": w}
                for (k, a), (c, p, w) in sorted(self.table.items())}

    @property
    def bytes(self) -> dict[str, float]:
        """Wire bytes per kind, all axes together."""
        return self._per_kind(2)

    @property
    def calls(self) -> dict[str, int]:
        """Calls per kind, all axes together."""
        return self._per_kind(0)

    def _per_kind(self, column: int) -> dict:
        out: dict = defaultdict(int)
        for (k, _), row in self.table.items():
            out[k] += row[column]
        return dict(out)

    def axis_of(self, group) -> str:
        """The name this meter counts ``group``'s collectives under."""
        name = group.group_name
        if name in self.axes:
            return self.axes[name]
        return "world" if group is dist.group.WORLD else f"group {name}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        ep = ns == "autopar" and func._opname in EP_OPS  # expert parallelism's op: its all-to-alls are inside
        composite = tc.composite_kernel(func) if ep or ns in _FUNCTIONAL else None
        if composite is not None:
            tc.TorchDispatchMode.__enter__(self)  # back on the stack: see the c10d op the kernel calls
            self._in_ep += ep
            try:
                return composite(*args, **kwargs)
            finally:
                self._in_ep -= ep
                tc.TorchDispatchMode.__exit__(self, None, None, None)
        if ns == "c10d" and func._opname in C10D_OPS:
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        kind, payload_arg = C10D_OPS[func._opname]
        named = _named_args(func, args, kwargs)
        group = dist.ProcessGroup.unbox(named["process_group"])
        n = group.size()
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(named[payload_arg]))
        if kind == "all_to_all" and self._in_ep:  # expert parallelism's token exchange: what leaves the rank
            kind = EP_KIND
            splits = list(named["input_split_sizes"])
            rows = max(sum(splits), 1)
            nbytes = nbytes * (rows - splits[group.rank()]) // rows
        elif kind == "all_to_all" and len(set(named.get("input_split_sizes") or [])) > 1:
            kind = "shift"  # uneven splits: what leaves the rank is its input less its own split
            rows = max(_tensors(named[payload_arg])[0].shape[0], 1)
            nbytes = nbytes * (rows - list(named["input_split_sizes"])[group.rank()]) // rows
        if kind in ("send", "recv") and self.p2p_axis is not None:
            axis = self.p2p_axis
        else:
            axis = self.axis_of(group)
        if kind == "broadcast":
            wire = nbytes * (n - 1) if named["root_rank"] == group.rank() else 0.0
        elif kind == "recv":
            wire = 0.0
        else:
            wire = ring_bytes(kind, nbytes, n)
        row = self.table[(kind, axis)]
        row[0] += 1
        row[1] += nbytes
        row[2] += wire


_BACKEND = ("c10d::", "gloo:", "nccl:")  # the process group's own implementation (ops and worker threads)


def _allocations(prof) -> list[tuple[int, int, int, bool]]:
    """(time, bytes (+ allocated / - freed), address, inside the process group's implementation)
    for every allocator event the profiler recorded, in time order."""
    events = []

    def walk(nodes, backend: bool):
        for e in nodes:
            if type(e.extra_fields).__name__ == "_ExtraFields_Allocation":
                events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr, backend))
            else:
                walk(e.children, backend or e.name.startswith(_BACKEND))

    walk(prof.profiler.kineto_results.experimental_event_tree(), False)
    return sorted(events, key=lambda e: e[0])


def _peaks(events) -> tuple[int, int]:
    """(peak of everything, peak without the process group's scratch), walked by address: events
    of different threads can be recorded out of order (a block freed by a gloo worker and reused
    by the main thread may show its new allocation first), and an address allocated again
    implies it was freed first."""
    live: dict[int, tuple[int, bool]] = {}
    cur = [0, 0]
    peak = [0, 0]
    for _, size, ptr, backend in events:
        old = live.pop(ptr, None)
        if old is not None:
            cur[0] -= old[0]
            cur[1] -= 0 if old[1] else old[0]
        if size > 0:
            live[ptr] = (size, backend)
            cur[0] += size
            cur[1] += 0 if backend else size
        peak = [max(p, c) for p, c in zip(peak, cur)]
    return peak[0], peak[1]


class AllocatorPeak:
    """``with AllocatorPeak(device) as a: ...`` then ``a.peak``: the most the allocator held above
    its level at entry (see the module docstring for how, per device). On CPU also
    ``a.peak_without_backend``: the same without the blocks the process group allocates for its
    own use (under a ``c10d::`` op or in a gloo worker: gloo's reduce-scatter clones its whole
    input, its all-gather flattens into a whole-size buffer, held while the collective is in
    flight); None on CUDA, whose allocator keeps no such record."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak = 0
        self.peak_without_backend: int | None = None
        self._prof = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self._prof.__exit__(*exc)
            if exc[0] is None:
                self.peak, self.peak_without_backend = _peaks(_allocations(self._prof))
            self._prof = None
        return False


def allocator_peak(fn) -> int:
    """Peak bytes the allocator held above its level before ``fn()`` (on the current CUDA device
    when there is one, else the CPU)."""
    with AllocatorPeak(torch.device("cuda" if torch.cuda.is_available() else "cpu")) as a:
        fn()
    return a.peak


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (DTensors count their local shard)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t._local_tensor
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def optimizer_state_bytes(optimizer) -> int:
    if optimizer is None:
        return 0
    ts = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return tensor_bytes(ts)


def persistent_bytes(params, optimizer) -> dict[str, int]:
    params = list(params)
    return {"parameters": tensor_bytes(params), "gradients": tensor_bytes(p.grad for p in params),
            "optimizer_state": optimizer_state_bytes(optimizer)}


def switch(obj, attr: str, value) -> contextlib.AbstractContextManager:
    """Set ``obj.attr`` now; a context manager that puts the old value back on exit."""
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    return _Restore(lambda: setattr(obj, attr, old))


def both(*restores) -> contextlib.AbstractContextManager:
    return _Restore(lambda: [r.restore() for r in reversed(restores)])


class _Restore(contextlib.AbstractContextManager):
    def __init__(self, restore):
        self.restore = restore

    def __exit__(self, *exc):
        self.restore()
        return False


def timed(step, *batch):
    """One step between barriers (the slowest rank sets the time): (its result, seconds)."""
    dist.barrier()
    t0 = time.perf_counter()
    out = step(*batch)
    dist.barrier()
    return out, time.perf_counter() - t0
