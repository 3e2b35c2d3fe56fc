"""Measured per-rank memory, by category, on the tensors the program really holds.

``MemoryTracker.run`` executes a per-rank GraphModule node by node (an ``fx.Interpreter``
that frees every value after its last use, as the generated code does) and, after each node,
sums the bytes of the distinct storages alive, by category:

- ``param_copies``: values made only from parameters: mixed-precision casts, ZeRO all-gathers
  and their views (the "fp16 parameters" of the ZeRO paper's arithmetic);
- ``grads_in_flight``: gradients of parameters between the op that produced them and the end of
  the program (whole under DDP/ZeRO-1 until reduced; a shard after a reduce-scatter);
- ``activations``: everything else (saved activations, activation gradients, temporaries).

Persistent state (parameter shards, ``.grad``, optimizer state) is measured from the
ParallelModule and the optimizer. Storages are counted once however many views point at them.
What it does not see: allocator caching/fragmentation and scratch memory inside one op; on a
GPU, ``torch.cuda.max_memory_allocated`` is reported next to it.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` over the same run (matmuls
and attention; the CPU flash-attention ops are registered with the SDPA formulas below).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils import flop_counter

from autopar.ir import collective_op, tensor_args

aten = torch.ops.aten
CATEGORIES = ("param_copies", "grads_in_flight", "activations")


def _register_cpu_attention_flops():
    reg = flop_counter.flop_registry
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward
    if fwd not in reg:
        flop_counter.register_flop_formula(fwd)(
            lambda q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_flop_count(q, k, v))
    if bwd not in reg:
        flop_counter.register_flop_formula(bwd)(
            lambda go, q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_backward_flop_count(go, q, k, v))


_register_cpu_attention_flops()


def categorize(gm: fx.GraphModule, roles: list[tuple[str, object]], outputs: list[tuple[str, object]]) -> dict[str, str]:
    """node name -> category, from the per-rank graph's structure."""
    cat: dict[str, str] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {n for n, r in zip(placeholders, roles) if r[0] == "param"}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            ins = tensor_args(n)
            if ins and all(a in params or cat.get(a.name) == "param_copies" for a in ins):
                cat[n.name] = "param_copies"
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for o, role in zip(out.args[0], outputs):
        # walk back from a gradient output through single-input ops (casts, views, collectives)
        # to the op that computed it
        while isinstance(o, fx.Node) and role[0] == "grad" and o.op == "call_function":
            cat[o.name] = "grads_in_flight"
            ins = tensor_args(o)
            if len(ins) != 1 and "wait_tensor" not in str(collective_op(o.target)):
                break
            o = ins[0]
    return cat


class _Tracking(fx.Interpreter):
    def __init__(self, gm, categories, skip: set[str]):
        super().__init__(gm, garbage_collect_values=True)
        self.categories = categories
        self.skip = skip  # placeholders counted as persistent state elsewhere
        self.peak_total = 0
        self.at_peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.model_state_peak = 0  # max of param_copies + grads_in_flight
        self.max_by: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._unused: list = []

    def run_node(self, n):
        for dead in self._unused:  # unused values die at once, as in the generated code
            self.env.pop(dead, None)
        self._unused = [n] if not n.users and n.op != "output" else []
        out = super().run_node(n)
        self.env[n] = out
        self._measure()
        return out

    def run(self, *args):
        # storages of persistent state (parameter shards) are counted elsewhere, and so are views
        # of them (a transposed weight saved for the backward is not a copy)
        names = [n.name for n in self.graph.nodes if n.op == "placeholder"]
        self.persistent = {a.untyped_storage().data_ptr() for name, a in zip(names, args)
                           if name in self.skip and isinstance(a, torch.Tensor)}
        return super().run(*args)

    def _measure(self):
        seen: set[int] = set(self.persistent)
        by = dict.fromkeys(CATEGORIES, 0)
        for node, v in self.env.items():
            if node.name in self.skip:
                continue
            c = self.categories.get(node.name, "activations")
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    key = s.data_ptr()
                    if key in seen or s.nbytes() == 0:
                        continue
                    seen.add(key)
                    by[c] += s.nbytes()
        total = sum(by.values())
        if total > self.peak_total:
            self.peak_total, self.at_peak = total, by
        self.model_state_peak = max(self.model_state_peak, by["param_copies"] + by["grads_in_flight"])
        for c in CATEGORIES:
            self.max_by[c] = max(self.max_by[c], by[c])


class MemoryTracker:
    """Per-rank measured memory over the steps run while tracking (the maximum of each step)."""

    def __init__(self):
        self.program_peak = 0
        self.at_peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.model_state_peak = 0
        self.max_by: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.flops = 0
        self.steps = 0

    def run(self, gm: fx.GraphModule, args, categories: dict[str, str], skip: set[str]):
        interp = _Tracking(gm, categories, skip)
        with flop_counter.FlopCounterMode(display=False) as fc:
            out = interp.run(*args)
        self.flops += fc.get_total_flops()
        if interp.peak_total > self.program_peak:
            self.program_peak, self.at_peak = interp.peak_total, interp.at_peak
        self.model_state_peak = max(self.model_state_peak, interp.model_state_peak)
        for c in CATEGORIES:
            self.max_by[c] = max(self.max_by[c], interp.max_by[c])
        return out


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
