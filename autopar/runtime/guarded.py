"""Guarded copies of the per-rank programs: their collectives issued through the process group's
own methods, each waited in bounded slices that a peer's failure wakes (autopar/runtime/failure.py).

The compiler's per-rank graphs call ``_c10d_functional`` collectives and ``wait_tensor``; on gloo
a functional wait blocks until the collective ends, and nothing wakes it (torch 2.13). The
executor runs ``guarded(gm)`` instead: the same graph, whose collective nodes call the functions
here (``pg.allreduce`` / ``_allgather_base`` / ``_reduce_scatter_base`` / ``alltoall_base``: the
``c10d`` ops the functional collectives call themselves, so the same bytes go on the wire and
the byte meter counts them the same; outputs allocated from the input as the functional ops do,
so the memory meter files them in the same categories) and whose waits call ``wait_tensor``
here, which waits on the ``Work`` through ``failure.wait``. The original graphs are untouched.
One difference on purpose: a gradient bucket (an all-reduce of a ``cat`` nothing else reads) is
reduced in place, where the functional op would copy it first (analysis/liveness.py ``reduces_in_place``), in a
buffer kept from step to step while nothing else holds it (``_bucket_cat``).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch import fx

from autopar import torch_compat as tc
from autopar.analysis.liveness import reduces_in_place
from autopar.runtime.failure import _pending, wait

_groups: dict[str, dist.ProcessGroup] = {}
_opts: dict = {}
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


def _group(name: str):
    pg = _groups.get(name)
    if pg is None:
        pg = _groups[name] = tc.resolve_process_group(name)
    return pg


def _issue(out: torch.Tensor, work) -> torch.Tensor:
    _pending[id(out)] = (out, work)
    return out


def _options(kind, op: str):
    key = (kind, op)
    opts = _opts.get(key)
    if opts is None:
        opts = _opts[key] = kind()
        opts.reduceOp = _OPS[op]
    return opts


def all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    return _issue(out, _group(group).allreduce([out], _options(dist.AllreduceOptions, op)))


def all_reduce_in_place(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    """``all_reduce`` of a buffer nothing else reads (``reduces_in_place``): reduced where it is,
    without the functional op's copy (a gradient bucket: one fresh buffer per step, not two)."""
    out = x if x.is_contiguous() else x.contiguous()
    return _issue(out, _group(group).allreduce([out], _options(dist.AllreduceOptions, op)))


def _bucket_cat():
    """A gradient bucket's ``cat`` that refills last step's buffer when nothing else holds it any
    more (the gradients viewing it were dropped: ``zero_grad()``), as DDP's reducer keeps its
    buckets: a fresh 15 MB buffer per step costs its page faults again (glibc maps a block that
    large anew for each allocation), about as long as the copy itself. Otherwise (the last
    step's gradients are still on ``.grad``: kept or accumulated into; a dispatch mode such as
    the memory meter is watching) a fresh buffer, as the functional op would make."""
    box: list[torch.Tensor | None] = [None]

    def bucket_cat(xs, dim=0):
        buf = box[0]
        if (buf is not None and not tc.dispatch_mode_active() and buf.dtype == xs[0].dtype
                and buf.device == xs[0].device and buf.shape == _cat_shape(xs, dim) and buf.is_contiguous()
                and sys.getrefcount(buf) <= 3  # (box, buf, getrefcount's argument)
                and tc.storage_use_count(buf) <= 2):  # (buf, the storage object)
            return torch.cat(xs, dim, out=buf)
        box[0] = buf = None
        box[0] = torch.cat(xs, dim)
        return box[0]

    return bucket_cat


def _cat_shape(xs, dim: int) -> tuple[int, ...]:
    shape = list(xs[0].shape)
    dim = dim % len(shape) if shape else 0
    if shape:
        shape[dim] = sum(x.shape[dim] for x in xs)
    return tuple(shape)


def all_gather_into_tensor(x: torch.Tensor, group_size: int, group: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
    return _issue(out, _group(group)._allgather_base(out, x))


def reduce_scatter_tensor(x: torch.Tensor, op: str, group_size: int, group: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    return _issue(out, _group(group)._reduce_scatter_base(out, x, _options(dist.ReduceScatterOptions, op)))


def all_to_all_single(x: torch.Tensor, output_split_sizes, input_split_sizes, group: str) -> torch.Tensor:
    x = x.contiguous()
    rows = sum(output_split_sizes) if output_split_sizes else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    return _issue(out, _group(group).alltoall_base(out, x, list(output_split_sizes or []),
                                                    list(input_split_sizes or []), dist.AllToAllOptions()))


def wait_tensor(t: torch.Tensor, what: str = "a collective") -> torch.Tensor:
    entry = _pending.pop(id(t), None)
    if entry is None or entry[0] is not t:  # not issued here: the functional op's own wait
        return torch.ops._c10d_functional.wait_tensor(t)
    wait(entry[1], what)
    return t


_c10d = torch.ops._c10d_functional
_REPLACE = {_c10d.all_reduce.default: all_reduce, _c10d.all_gather_into_tensor.default: all_gather_into_tensor,
            _c10d.reduce_scatter_tensor.default: reduce_scatter_tensor,
            _c10d.all_to_all_single.default: all_to_all_single}


def describe(node: fx.Node) -> str:
    """What a rank waits in, for errors: the collective's kind, axis, reason and source line."""
    from autopar.ir import info

    rec = info(node).comm if isinstance(node, fx.Node) else None
    if rec is None:
        return f"a collective ({node})"
    text = f"{rec.kind} on mesh axis '{rec.axis}' ({rec.reason}"
    return text + (f"; {rec.source.split('  ')[0]})" if rec.source else ")")


def guarded(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a per-rank program whose CPU collectives and waits go through this module
    (same ops on the wire, same values); the original graph is left as the compiler made it."""
    if not any(n.op == "call_function" and n.target in _REPLACE for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    val, old = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    graph.output(val, type_expr=getattr(old, "type", None)).meta = copy.copy(old.meta)
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _REPLACE:
            if reduces_in_place(n):
                n.target = all_reduce_in_place
                n.args[0].target = _bucket_cat()
            else:
                n.target = _REPLACE[n.target]
        elif n.target is _c10d.wait_tensor.default:
            src = n.args[0]
            n.target = wait_tensor
            n.args = (src, describe(src))
    return fx.GraphModule(gm, graph)

