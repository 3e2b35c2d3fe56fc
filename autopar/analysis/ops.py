"""What one op or one value is and costs: the single definition that the passes, the cost model
and the runtime's meters share (one name, one meaning).

- ``val_bytes``: the bytes of a graph value (a tensor, or the tensors of a multi-output op's tuple).
- ``VIEW_OPS``: the ops that reshape a value as a view of its input (``view``, ``_unsafe_view``,
  ``reshape``): a sharded dim may be split or merged by them, and their local strides can differ
  from the global value's (propagate checks the first, localize handles the second). Not every
  aliasing op: ``transpose`` / ``slice`` / ``expand`` are views too (the cost model's ``_is_view``
  reads the schema for those), but they keep each dim whole.
- FLOPs: ``flop_formula`` is the one formula table (torch's flop counter, plus the SDPA formulas
  for the CPU flash-attention ops, which torch counts as 0); ``op_flops`` counts one ATen op call
  with it, and says "unknown" (``UnknownFlops``) instead of 0 when a formula raises or a
  matmul-like op has none. Two front ends: ``node_flops`` for a node of an ATen graph (its values
  in ``meta["val"]``: the cost model, the planner), ``replayed_flops`` for a node of the
  torch-level graph (a torch function or method, replayed on the trace's fake tensors, each ATen
  op it runs counted by ``op_flops``: the split pass's stage costs). The runtime's meter
  (autopar/runtime/memory.py ``ProgramMeter``) applies ``flop_formula`` to the ops that really ran.
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.utils import flop_counter

aten = torch.ops.aten


def val_bytes(val) -> int:
    """Bytes of a graph value: a tensor's, the sum over a tuple / list of tensors, 0 otherwise."""
    return sum(math.prod(t.shape) * t.element_size() for t in (val if isinstance(val, (list, tuple)) else (val,))
               if isinstance(t, torch.Tensor))


def is_view(target) -> bool:
    """An op whose output aliases an input (the schema says so; ``_unsafe_view`` is a view at run
    time though its schema returns a fresh tensor): it moves no data."""
    if target is aten._unsafe_view.default:
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


# ------------------------------------------------------------------------------------ FLOPs
# torch has no FLOP formula for the CPU flash-attention ops (they count 0); these are its SDPA
# ones. They are not registered in torch's global registry (a user's FlopCounterMode in the same
# process counts as torch does, and may register its own): autopar looks them up through
# ``flop_formula``.
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_flop_count(q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda go, q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_backward_flop_count(go, q, k, v),
}

# ops that multiply matrices but have no FLOP formula in torch's flop counter: 0 would be a lie
UNCOUNTED = {aten.mv, aten.dot, aten.vdot, aten.addmv, aten.addbmm, aten.addr, aten._int_mm,
             aten._weight_int8pack_mm, aten._cdist_forward, aten._cdist_backward}


def flop_formula(target):
    """The FLOP formula of an op (FlopCounterMode's calling convention): torch's, else autopar's."""
    packet = getattr(target, "overloadpacket", target)
    fn = flop_counter.flop_registry.get(packet) or flop_counter.flop_registry.get(target)
    if fn is None and packet in CPU_ATTENTION_FLOPS:
        fn = flop_counter.shape_wrapper(CPU_ATTENTION_FLOPS[packet])
    return fn


class UnknownFlops(Exception):
    """The FLOPs of one op cannot be computed; the message says why (the front ends add the op,
    the user's source line)."""


def _attention_heads_matched(target, args):
    """An attention op's arguments with grouped K / V (fewer heads than the query: SDPA's
    ``enable_gqa``) expanded to the query's heads, so that a formula counts them as the kernel
    computes them. torch's formulas before 2.13 assert equal heads (the count was then unknown:
    the whole attention costed by its bytes alone, measured 2026-11-27 on torch 2.11)."""
    name = str(getattr(target, "overloadpacket", target))
    if "scaled_dot_product" not in name and "flex_attention" not in name:  # ([B, H, S, D] layouts only)
        return args
    four = [a for a in args[:5] if isinstance(a, torch.Tensor) and a.dim() == 4]
    if not four:
        return args
    h = max(a.shape[1] for a in four)

    def widen(a):  # (the formulas read shapes only: a meta tensor of the widened shape, no data)
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] < h and h % a.shape[1] == 0:
            return torch.empty((a.shape[0], h, *a.shape[2:]), dtype=a.dtype, device="meta")
        return a
    return tuple(widen(a) if i < 5 else a for i, a in enumerate(args))


def op_flops(target, args, kwargs, out) -> int:
    """FLOPs of one ATen op call (``args`` / ``kwargs`` / ``out``: its tensors, real or fake) by its
    formula; 0 for ops that have none (elementwise, views, collectives: memory-bound). Raises
    UnknownFlops when the formula raises or a matmul-like op (``UNCOUNTED``) has none."""
    fn = flop_formula(target)
    if fn is not None:
        args = _attention_heads_matched(target, tuple(args))
    if fn is None:
        if getattr(target, "overloadpacket", target) in UNCOUNTED:
            raise UnknownFlops("torch's flop counter has no formula for it (register one with "
                               "torch.utils.flop_counter.register_flop_formula)")
        return 0
    try:
        return int(fn(*args, **kwargs, out_val=out))
    except Exception as e:  # noqa: BLE001 - any failure of the formula: the count is unknown, not 0
        raise UnknownFlops(f"its FLOP formula raised {type(e).__name__}: {e}") from e


def node_flops(n: fx.Node) -> int:
    """FLOPs of one ATen node (values in ``meta["val"]``), by ``op_flops``; 0 for non-op nodes.
    UnknownFlops names the op, the node and the user's source line."""
    from autopar.ir import source_line

    if n.op != "call_function" or not hasattr(n.target, "overloadpacket"):
        return 0

    def val(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    try:
        return op_flops(n.target, fx.node.map_aggregate(n.args, val), fx.node.map_aggregate(n.kwargs, val),
                        n.meta.get("val"))
    except UnknownFlops as e:
        raise UnknownFlops(f"{n.target} ({n.name}) at {source_line(n) or 'an unknown line'}: {e}") from e


def replayed_flops(n: fx.Node, fake_mode) -> int:
    """Forward FLOPs of one torch-level node (a torch function or method; values in
    ``meta["example_value"]``): the node replayed on the trace's fake tensors under torch's
    FlopCounterMode (which runs it down to ATen ops as autograd would), each ATen op counted by
    ``op_flops``. UnknownFlops names the ATen op; anything else the replay raises is its own."""
    if n.op not in ("call_function", "call_method"):
        return 0

    def val(a):
        return a.meta.get("example_value") if isinstance(a, fx.Node) else a

    args = fx.node.map_aggregate(n.args, val)
    kwargs = fx.node.map_aggregate(n.kwargs, val)
    fc = flop_counter.FlopCounterMode(display=False)
    fc.flop_registry = {op: _counted(op) for op in {*fc.flop_registry, *CPU_ATTENTION_FLOPS, *UNCOUNTED}}
    with fake_mode, fc, torch.no_grad():
        if n.op == "call_method":
            getattr(args[0], n.target)(*args[1:], **kwargs)
        else:
            n.target(*args, **kwargs)
    return int(fc.get_total_flops())


def _counted(op):
    """FlopCounterMode's formula for ``op`` (an overload packet): ``op_flops``."""
    def count(*args, out_val=None, **kwargs):
        try:
            return op_flops(op, args, kwargs, out_val)
        except UnknownFlops as e:
            raise UnknownFlops(f"{op} (which it runs): {e}") from e
    return count
