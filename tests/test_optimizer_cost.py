"""The cost model's per-op counts against what torch really runs: the optimizer step's memory
traffic (``cost.OPTIMIZER_ACCESSES``) counted op by op under a dispatch mode, and the FLOPs of an
attention whose K / V have fewer heads than its query (SDPA's ``enable_gqa``)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.analysis import cost
from autopar.analysis.ops import _attention_heads_matched, op_flops

aten = torch.ops.aten


class _Traffic(TorchDispatchMode):
    """Tensor elements each op reads (its distinct tensor arguments) and writes (its outputs and
    the arguments its schema mutates), counting only tensors of at least ``min_numel`` elements
    (the optimizer's step counters and scalars are not per-parameter traffic)."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.elements = min_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        seen, big = set(), []
        for t in flat:
            if isinstance(t, torch.Tensor) and t.numel() >= self.min_numel and id(t) not in seen:
                seen.add(id(t))
                big.append(t)
        reads = len(big)
        # (the fused optimizers' schemas mark ``grads`` as written: they unscale them in place only
        # when given a ``grad_scale``, which no step here has)
        mutated = [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write
                   and not (a.name == "grads" and kwargs.get("grad_scale") is None)]
        writes = sum(1 for a, v in zip(func._schema.arguments, args) if a in mutated
                     for t in (v if isinstance(v, (list, tuple)) else [v])
                     if isinstance(t, torch.Tensor) and t.numel() >= self.min_numel)
        if not mutated:
            writes = sum(1 for t in torch.utils._pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor) and t.numel() >= self.min_numel)
        self.elements += (reads + writes) * self.min_numel
        return out


@pytest.mark.parametrize("kind,kwargs", [("adamw", {"foreach": False}), ("adamw", {"foreach": True}),
                                         ("adamw-fused", {"fused": True}), ("sgd", {"foreach": False}),
                                         ("momentum", {"momentum": 0.9, "foreach": False})])
def test_optimizer_traffic_is_what_torch_runs(kind, kwargs):
    n = 4096
    p = torch.nn.Parameter(torch.randn(n))
    opt = (torch.optim.SGD([p], lr=0.1, **kwargs) if kind in ("sgd", "momentum")
           else torch.optim.AdamW([p], lr=1e-3, **kwargs))
    for _ in range(2):  # the first step makes the state; the second is what every later step costs
        p.grad = torch.randn(n)
        if _ == 1:
            with _Traffic(n) as t:
                opt.step()
        else:
            opt.step()
    assert t.elements * 4 == cost.OPTIMIZER_ACCESSES[kind] * 4 * n, (kind, t.elements / n)


def test_grouped_query_attention_counts_every_query_head(monkeypatch):
    # torch 2.11's formula (the GPU machine's) asserts equal heads; 2.13's accepts grouped ones. The
    # count must not depend on which: the formula is made strict here, as 2.11's is
    from torch.utils import flop_counter

    loose = flop_counter.sdpa_flop_count

    def strict(q_shape, k_shape, v_shape):
        assert q_shape[1] == k_shape[1] == v_shape[1], "heads differ"
        return loose(q_shape, k_shape, v_shape)
    monkeypatch.setattr(flop_counter, "sdpa_flop_count", strict)
    q = torch.empty(2, 16, 256, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 4, 256, 64, device="meta", dtype=torch.bfloat16)
    full = torch.empty(2, 16, 256, 64, device="meta", dtype=torch.bfloat16)
    widened = _attention_heads_matched(aten._scaled_dot_product_flash_attention.default, (q, k, k))
    assert [tuple(a.shape) for a in widened] == [tuple(q.shape)] * 3
    for op in (aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default):
        args = (q, k, k) if op is aten._scaled_dot_product_flash_attention.default else (q, k, k, None, False)
        ref = (full, full, full) if op is aten._scaled_dot_product_flash_attention.default else (full, full, full, None,
                                                                                                 False)
        assert op_flops(op, args, {}, None) == op_flops(op, ref, {}, None) == 4 * 2 * 16 * 256 * 256 * 64
    # a matmul's arguments are left as they are
    a = torch.empty(3, 4, 5, 6, device="meta")
    assert _attention_heads_matched(aten.bmm.default, (a,)) == (a,)
