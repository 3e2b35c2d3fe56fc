"""A model's asserts on a tensor's value, kept in the program as device-side checks.

XLM checks its inputs with ``assert lengths.max().item() <= slen``. With
``capture_scalar_outputs`` (torch_compat.scalar_outputs) dynamo traces that as ``.item()``, the
comparison on the Python scalar, and ``aten._assert_scalar``; the joint forward + backward trace
cannot follow a value read on the host, and a per-rank program should not read one each step.
``to_device`` rewrites each such assert into torch's ``_assert_async`` of the same condition computed
on the tensor (the comparison operators mean the same on a 0-d tensor): the check stays in the
program, on every rank, and fails as the eager assert would (on CPU at once; on a GPU at the next
synchronization, as CUDA's device asserts do). Where the value is sharded (a max over batch rows
split on dp), propagation all-reduces it before the comparison, so every rank fails together. An
assert it cannot rewrite so (the host value used for anything but those operators) is left as it
is, and the capture stops at ``host_reads``' CaptureError, which names its line.

What the program checks this way is reported (``pm.report()``, ``autopar explain``: ``NOTE``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar import torch_compat as tc
from autopar.ir import source_line

# Python operators on scalars that mean the same on 0-d tensors (a bool tensor for a comparison)
_SAME_ON_TENSORS = {operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne, operator.and_,
                    operator.or_, operator.add, operator.sub, operator.mul, operator.neg, operator.truediv}
_ON_TENSORS = {operator.not_: torch.logical_not, torch.sym_not: torch.logical_not}
PREFIX = "the model's assert failed: "
NOTE = "value check on the device (the model's assert, all-reduced where its value is sharded): "


def to_device(gm: fx.GraphModule) -> list[str]:
    """Rewrite ``gm``'s asserts on ``.item()`` values into device-side asserts; their source lines."""
    g = gm.graph
    done = []
    check_async = tc.find("assert_async", None)
    if check_async is None:  # (this torch cannot: the capture fails on the .item() as before)
        return done
    for a in [n for n in g.nodes if n.op == "call_function" and n.target is torch.ops.aten._assert_scalar.default]:
        expr = _expression(a.args[0])
        if expr is None:
            continue
        for n in expr:
            if _is_item(n):
                continue
            for i in [i for i in n.all_input_nodes if _is_item(i)]:
                n.replace_input_with(i, i.args[0])
            n.target = _ON_TENSORS.get(n.target, n.target)
        cond = a.args[0].args[0] if _is_item(a.args[0]) else a.args[0]
        where = source_line(a) or source_line(cond)
        with g.inserting_before(a):
            check = g.call_function(check_async, (cond, PREFIX + (where or str(a.args[1]))))
        check.meta.update(a.meta)
        g.erase_node(a)
        done.append(where or str(a.args[1]))
    for n in [n for n in g.nodes if _is_item(n) and not n.users]:
        g.erase_node(n)
    if done:
        g.lint()
        gm.recompile()
    return list(dict.fromkeys(done))


def host_reads(gm: fx.GraphModule) -> list[str]:
    """Where ``gm`` still reads a tensor's value on the host (``.item()`` / ``.tolist()`` used for
    more than an assert: JetMoE's ``expert_size.tolist()`` sizing a split), one line each."""
    return list(dict.fromkeys(source_line(n) or n.name for n in gm.graph.nodes
                              if n.op == "call_method" and n.target in ("item", "tolist")))


def checks(gm: fx.GraphModule) -> list[str]:
    """The device-side checks ``to_device`` made in ``gm``, one per source line (what the report
    lists; dynamo may add a second condition for one assert, from the value's known range)."""
    check_async = tc.find("assert_async", None)
    return list(dict.fromkeys(n.args[1][len(PREFIX):] for n in gm.graph.nodes if n.op == "call_function"
                              and n.target is check_async and len(n.args) > 1
                              and str(n.args[1]).startswith(PREFIX)))


def _is_item(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target == "item"


def _expression(cond) -> list[fx.Node] | None:
    """The nodes computing ``cond`` from ``.item()`` reads and constants when every one is an
    operator that means the same on 0-d tensors and used by this expression alone (so that making
    them tensors changes nothing else); None otherwise."""
    if not isinstance(cond, fx.Node):
        return None
    seen: list[fx.Node] = []
    stack, items = [cond], 0
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.append(n)
        if _is_item(n):
            items += 1
            continue
        if n.op != "call_function" or (n.target not in _SAME_ON_TENSORS and n.target not in _ON_TENSORS):
            return None
        stack.extend(n.all_input_nodes)
    inner = set(seen)
    for n in seen:
        if n is not cond and not _is_item(n) and any(u not in inner for u in n.users):
            return None
    return seen if items else None
