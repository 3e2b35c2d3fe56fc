"""lower: rewrite attention and linear + activation into autopar's kernel ops.

Runs on the torch-level graph the front end captures (before AOTAutograd derives the backward),
so each rewritten op brings its own backward kernel into the joint graph through its registered
autograd (autopar/kernels/ops.py), and the sharding rules see one op, not a decomposition.

Rules are data: a pattern (a matcher over the node that ends it, returning the operands it
binds, or None) and a replacement (the kernel op and its arguments). In order:

- ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, attn_mask=None | float / bool mask,
  dropout_p=0, is_causal, scale)`` on 4-D inputs -> ``autopar::flash_attention``; a bool mask
  becomes an additive one; GQA written out before it (``repeat_interleave(k, G, dim=1)``, or
  Hugging Face's ``repeat_kv`` expand + reshape) is looked through, so the kernel reads each KV
  head once and no repeated copy is made.
- ``eager_attention``: ``matmul(softmax(matmul(q, k.transpose(-2, -1)) * scale [+ mask]) [.to()]
  [dropout(p=0)], v)`` -> the same op (the Hugging Face "eager" attention).
- ``linear_act``: ``gelu(linear(x, w, b))`` / ``silu(linear(x, w, b))`` (exact GELU) ->
  ``autopar::linear_act``, when the linear's output has no other user.

Not rewritten (and left as they were): attention with dropout, non-4-D inputs, a mask that
needs a gradient, GELU with ``approximate="tanh"``. ``lower_graph`` returns how many of each it
rewrote (``autopar.compile(..., kernels="on")`` records them in ``ctx.lowered``). With
``kernels="auto"`` a match is rewritten only where autopar's kernel measured faster than PyTorch's
op at its per-rank shape on this CUDA device (kernels/choice.py), each decision in
``ctx.kernel_choices``.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import fx

from autopar import torch_compat as tc
from autopar.passes.masks import _arg, _is, _method, ungroup

_SDPA = tc.native_nn("scaled_dot_product_attention")
_LINEAR = tc.native_nn("linear")
_ACTS = {**dict.fromkeys(tc.native_nn("gelu"), "gelu"), F.silu: "silu"}
_MATMUL = {torch.matmul, operator.matmul}
_SOFTMAX = {F.softmax, torch.softmax, torch.nn.functional.softmax}


@dataclass
class LoweringRule:
    name: str
    match: Callable[[fx.Node], dict | None]  # node ending the pattern -> bound operands, or None
    replace: Callable[[fx.Graph, fx.Node, dict], fx.Node]  # -> the node replacing it


def _val(n):
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def _four_d(*ns) -> bool:
    return all(isinstance(_val(n), torch.Tensor) and _val(n).ndim == 4 for n in ns)


def _float_mask(mask) -> bool:
    v = _val(mask)
    return mask is None or (isinstance(v, torch.Tensor) and v.ndim == 4 and not v.requires_grad)


# ------------------------------------------------------------------------------------ sdpa
def _match_sdpa(n: fx.Node):
    if not _is(n, "call_function", _SDPA):
        return None
    q, k, v = (_arg(n, i, name) for i, name in enumerate(("query", "key", "value")))
    mask = _arg(n, 3, "attn_mask")
    if _arg(n, 4, "dropout_p", 0.0) != 0.0 or not _four_d(q, k, v) or not _float_mask(mask):
        return None
    if not isinstance(_arg(n, 5, "is_causal", False), bool):
        return None
    causal = _arg(n, 5, "is_causal", False)
    scale = _arg(n, 6, "scale")
    if causal and mask is not None:
        return None
    k0, v0 = ungroup(k), ungroup(v)
    qv = _val(q)
    if _val(k0).shape[1] == 0 or qv.shape[1] % _val(k0).shape[1] or _val(k0).shape[1] != _val(v0).shape[1]:
        k0, v0 = k, v
    if _val(k0).shape[1] != qv.shape[1] and not _arg(n, 7, "enable_gqa", False) and (k0 is k):
        return None  # different head counts without enable_gqa: SDPA itself would refuse
    return {"q": q, "k": k0, "v": v0, "mask": mask, "causal": causal,
            "scale": float(scale) if scale is not None else 1.0 / math.sqrt(qv.shape[-1])}


def _emit_attention(graph: fx.Graph, n: fx.Node, b: dict) -> fx.Node:
    mask = b["mask"]
    with graph.inserting_before(n):
        if mask is not None and _val(mask).dtype == torch.bool:  # allowed positions -> additive 0 / -inf
            zeros = graph.call_function(torch.zeros_like, (mask,), {"dtype": torch.float32})
            mask = graph.call_function(torch.masked_fill,
                                       (zeros, graph.call_function(torch.logical_not, (mask,)), float("-inf")))
        op = graph.call_function(torch.ops.autopar.flash_attention.default,
                                 (b["q"], b["k"], b["v"], mask, b["causal"], b["scale"]))
        out = graph.call_function(operator.getitem, (op, 0))
    for new in (op, out):
        new.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    return out


# ------------------------------------------------------------------------------------ eager attention
def _strip(n):
    """Through .to(dtype) / .type_as / contiguous and dropout with p = 0."""
    while True:
        if _method(n, "to", "type_as", "contiguous"):
            n = n.args[0]
        elif _is(n, "call_function", {F.dropout, torch.dropout, torch.nn.functional.dropout}) \
                and _arg(n, 1, "p", 0.5) == 0.0:
            n = n.args[0]
        else:
            return n


def _transposed_last_two(kt) -> fx.Node | None:
    if _method(kt, "transpose") and len(kt.args) == 3:
        nd = _val(kt.args[0]).ndim if isinstance(_val(kt.args[0]), torch.Tensor) else 4
        dims = {d % nd for d in kt.args[1:] if isinstance(d, int)}
        if dims == {nd - 2, nd - 1}:
            return kt.args[0]
    if _is(kt, "call_function", {torch.transpose}) and len(kt.args) == 3:
        nd = _val(kt.args[0]).ndim
        if {d % nd for d in kt.args[1:]} == {nd - 2, nd - 1}:
            return kt.args[0]
    return None


def _match_eager(n: fx.Node):
    if not _is(n, "call_function", _MATMUL):
        return None
    p, v = n.args[0], n.args[1]
    sm = _strip(p)
    is_softmax = _is(sm, "call_function", _SOFTMAX) or _method(sm, "softmax")
    if not is_softmax:
        return None
    dim = _arg(sm, 1, "dim")
    if dim not in (-1, 3):
        return None
    s = sm.args[0]
    mask = None
    if _is(s, "call_function", {operator.add, torch.add}) and isinstance(s.args[1], fx.Node):
        s, mask = s.args[0], s.args[1]
    scale = 1.0
    if _is(s, "call_function", {operator.mul, torch.mul}) and isinstance(s.args[1], (int, float)):
        s, scale = s.args[0], float(s.args[1])
    elif _is(s, "call_function", {operator.truediv, torch.div}) and isinstance(s.args[1], (int, float)):
        s, scale = s.args[0], 1.0 / float(s.args[1])
    if not _is(s, "call_function", _MATMUL):
        return None
    q, kt = s.args[0], s.args[1]
    k = _transposed_last_two(kt)
    if k is None or not _four_d(q, k, v) or not _float_mask(mask):
        return None
    if mask is not None and _val(mask).dtype == torch.bool:
        return None  # an additive mask is what this pattern adds
    if any(len(x.users) > 1 for x in (s, sm)):
        return None  # the probabilities or scores are used elsewhere: keep them
    k0, v0 = ungroup(k), ungroup(v)
    if _val(q).shape[1] % _val(k0).shape[1] or _val(k0).shape[1] != _val(v0).shape[1]:
        k0, v0 = k, v
    return {"q": q, "k": k0, "v": v0, "mask": mask, "causal": False, "scale": scale}


# ------------------------------------------------------------------------------------ linear + act
def _match_linear_act(n: fx.Node):
    act = _ACTS.get(n.target) if n.op == "call_function" else None
    if act is None:
        return None
    if act == "gelu" and _arg(n, 1, "approximate", "none") != "none":
        return None
    lin = n.args[0]
    if not _is(lin, "call_function", _LINEAR) or len(lin.users) != 1:
        return None
    x, w = lin.args[0], _arg(lin, 1, "weight")
    b = _arg(lin, 2, "bias")
    if not isinstance(_val(w), torch.Tensor) or _val(w).ndim != 2:
        return None
    return {"x": x, "w": w, "b": b, "act": act}


def _emit_linear_act(graph: fx.Graph, n: fx.Node, b: dict) -> fx.Node:
    with graph.inserting_before(n):
        op = graph.call_function(torch.ops.autopar.linear_act.default, (b["x"], b["w"], b["b"], b["act"]))
        out = graph.call_function(operator.getitem, (op, 0))
    for new in (op, out):
        new.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    return out


RULES = [
    LoweringRule("sdpa", _match_sdpa, _emit_attention),
    LoweringRule("eager_attention", _match_eager, _emit_attention),
    LoweringRule("linear_act", _match_linear_act, _emit_linear_act),
]


def lower_pass(state):
    """After it (``kernels`` "on"): every match of RULES in the torch-level graph is a
    ``torch.ops.autopar`` kernel op; "auto": each match where autopar's kernel measured faster at
    the op's per-rank shape on this device (kernels/choice.py), every decision in
    ``state.kernel_choices``; "off": nothing changes. ``state.lowered`` counts rewrites per rule."""
    mode = state.options.lower
    if mode == "off":
        if state.options.given.kernels == "auto":  # said in the report: auto chose PyTorch's ops untimed
            from autopar.kernels import choice
            from autopar.kernels.ops import available

            ok, how = available()
            why = (how if not ok else f"the mesh runs on {state.mesh.device_type}, where Triton would run "
                   "interpreted")
            state.kernel_choices = [choice.not_timed(why)]
        return state
    decide = None
    if mode == "auto":
        decide = _measured_decider(state)
    state.lowered = dict(lower_graph(state.gm, decide=decide))
    if decide is not None:
        state.kernel_choices = decide.choices
    return state


def lower_graph(gm: fx.GraphModule, rules=RULES, decide=None) -> Counter:
    """Rewrite every match of ``rules`` in ``gm`` (in place) for which ``decide(rule name, bound
    operands)`` is true (every match without ``decide``); returns the count per rule."""
    import autopar.kernels.ops  # noqa: F401 - registers torch.ops.autopar.*

    counts: Counter = Counter()
    before = set(gm.graph.nodes)
    for n in list(gm.graph.nodes):
        if n.graph is None or n.op not in ("call_function", "call_method"):
            continue
        for r in rules:
            bound = r.match(n)
            if bound is None:
                continue
            if decide is not None and not decide(r.name, bound):
                break  # PyTorch's op stays (the decision is recorded)
            new = r.replace(gm.graph, n, bound)
            n.replace_all_uses_with(new)
            counts[r.name] += 1
            break
    if counts:
        gm.graph.eliminate_dead_code()
        _fake_values(gm, [n for n in gm.graph.nodes if n not in before])
        gm.recompile()
    return counts


class _MeasuredDecider:
    """kernels="auto": for each match, the per-rank shape it will run at (the batch split over the
    plan's data-parallel axes and accumulation micro-batches, heads / output features over its
    derived tensor-parallel axes, where they divide), in the compute dtype, timed on this process's
    CUDA device once per shape (kernels/choice.py caches it)."""

    def __init__(self, batch_div: int, feature_div: int, dtype, device, ranks: int = 1):
        self.batch_div, self.feature_div, self.dtype, self.device = batch_div, feature_div, dtype, device
        self.ranks = ranks  # the mesh's: rank 0 decides for all when the mesh is the whole world
        self.choices: list = []

    def _div(self, n: int, by: int) -> int:
        return n // by if by > 1 and n % by == 0 else n

    def __call__(self, rule: str, b: dict) -> bool:
        from autopar.kernels import choice

        if rule in ("sdpa", "eager_attention"):
            q, k = _val(b["q"]), _val(b["k"])
            bsz, h, m, d = q.shape
            hkv, n = k.shape[1], k.shape[2]
            bsz = self._div(bsz, self.batch_div)
            if h % self.feature_div == 0 and hkv % self.feature_div == 0:
                h, hkv = self._div(h, self.feature_div), self._div(hkv, self.feature_div)
            bias = b["mask"] is not None
            args = (bsz, h, hkv, m, n, d, b["causal"], bias, self.dtype)
            c = self.decide("attention", choice.attention_shape(*args),
                            lambda: choice.time_attention(*args, device=self.device))
        else:
            x, w = _val(b["x"]), _val(b["w"])
            rows = self._div(math.prod(x.shape[:-1]), self.batch_div)
            args = (rows, x.shape[-1], self._div(w.shape[0], self.feature_div), b["act"], b["b"] is not None,
                    self.dtype)
            c = self.decide("linear_act", choice.linear_shape(*args),
                            lambda: choice.time_linear(*args, device=self.device))
        self.choices.append(c)
        return c.use_kernel

    def decide(self, op: str, shape: str, timer):
        """Rank 0 decides (times, or reads its cache) and every rank takes its decision, so all
        ranks run the same program (the ranks see the same graph, so they ask in the same order).
        A timing that fails keeps PyTorch's op, with the error as the reason."""
        from autopar.kernels import choice

        import torch.distributed as dist

        def mine():
            try:
                return choice.decide(op, shape, timer, self.device)
            except Exception as e:  # noqa: BLE001 - reported in the decision, PyTorch's op kept
                return choice.Choice(op, shape, False, f"timing failed: {type(e).__name__}: {e}")
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
                and dist.get_world_size() == self.ranks):
            return mine()  # one process, or a mesh smaller than the world: this rank's own timing
        box = [mine() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _measured_decider(state) -> _MeasuredDecider:
    from autopar.plan import DERIVED_TP

    o = state.options
    sizes = dict(zip(state.mesh.mesh_dim_names or (), state.mesh.shape))
    parsed = o.pipeline.parsed if o.pipeline is not None else o.parsed
    dp = math.prod(sizes.get(a.axis, 1) for a in parsed.axes if a.data_parallel)
    tp = math.prod(sizes.get(a.axis, 1) for a in parsed.axes if a.strategy in DERIVED_TP)
    micro = o.given.accumulate * (o.pipeline.microbatches if o.pipeline is not None else 1)
    dtype = o.compute_dtype or torch.float32
    device = torch.device(state.mesh.device_type, torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return _MeasuredDecider(dp * micro, tp, dtype, device, ranks=math.prod(sizes.values()) or 1)


def _fake_values(gm: fx.GraphModule, nodes):
    """``example_value`` (the trace's fake tensors) for the nodes a rewrite added, so later
    passes (the pipeline split, the cost model) read them like the others."""
    import contextlib

    mode = gm.meta.get("fake_mode") or contextlib.nullcontext()
    with mode:
        for n in nodes:
            args = fx.node.map_arg(n.args, _val)
            kwargs = fx.node.map_arg(n.kwargs, _val)
            n.meta["example_value"] = n.target(*args, **kwargs)
