"""The graph side of the tensor-parallel derivation (autopar/analysis/tensor_parallel.py): op
tables, what the analysis reads of the torch-level graph (parameters through casts and transposes,
which values need a gradient) and how a sharded dim moves through a reshape."""

from __future__ import annotations

import functools

import torch
from torch import fx

from autopar.ir import source_line

# --------------------------------------------------------------------------------- op tables
SAME = {"to", "type", "float", "half", "bfloat16", "double", "contiguous", "clone", "detach", "dropout",
        "alpha_dropout", "feature_alpha_dropout", "type_as", "requires_grad_", "_to_copy", "cpu", "cuda"}
RESHAPE = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "_unsafe_view", "view_as",
           "reshape_as"}
EXPAND = {"expand", "expand_as", "broadcast_to"}
PERMUTE = {"transpose", "swapaxes", "swapdims", "permute", "t", "movedim", "moveaxis"}
SPLIT = {"split", "chunk", "split_with_sizes", "tensor_split", "unbind"}
REDUCE = {"softmax", "log_softmax", "sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp",
          "cumsum", "cumprod", "argmax", "argmin", "topk", "sort", "prod", "all", "any", "var_mean", "std_mean",
          "normalize", "_softmax", "_log_softmax", "linalg_vector_norm"}
NORM = {"layer_norm", "rms_norm"}
STATISTICS = {"mean", "sum", "var", "amax", "norm"}  # reductions whose result is small and linear-ish to combine
MATMUL = {"linear", "addmm", "mm", "matmul", "bmm", "baddbmm"}
CAT = {"cat", "concat", "concatenate", "stack"}
CONV = {"conv1d", "conv2d", "conv3d"}
# a fresh tensor shaped like its input: no data flows from it (a buffer filled by writes after)
FRESH = {"new_empty", "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like", "ones_like", "full_like"}
# every op some table or case of the derivation handles (others are followed by running them:
# autopar/analysis/tp_measured.py)
KNOWN = (SAME | RESHAPE | EXPAND | PERMUTE | SPLIT | REDUCE | NORM | MATMUL | CAT | CONV |
         FRESH | {"getitem", "getattr", "copy_", "repeat", "repeat_interleave", "embedding", "einsum", "cross_entropy", "nll_loss",
          "scaled_dot_product_attention", "flash_attention", "linear_act", "where", "masked_fill", "output"})
OPERATOR = {"truediv": "div", "floordiv": "floor_divide", "iadd": "add", "isub": "sub", "imul": "mul",
            "itruediv": "div", "ipow": "pow", "and_": "bitwise_and", "or_": "bitwise_or", "invert": "bitwise_not",
            "getitem": "getitem", "matmul": "matmul", "neg": "neg", "pos": "positive"}


def strided(dim: int, outer: int):
    """Shard(dim), or dim strided-sharded with ``outer`` parts (each rank holds 1/tp of each)."""
    from torch.distributed.tensor.placement_types import Shard

    if outer == 1:
        return Shard(dim)
    from autopar import torch_compat as tc

    return tc.StridedShard(dim, split_factor=outer)


def op_name(n: fx.Node) -> str:
    if n.op == "call_method":
        return n.target
    if n.op != "call_function":
        return n.op
    name = getattr(n.target, "__name__", str(n.target))
    if getattr(n.target, "__module__", "") in ("_operator", "operator"):
        return OPERATOR.get(name, name)
    return name.split(".")[0]  # an aten overload in a torch-level graph: add.Tensor


@functools.lru_cache(maxsize=None)
def pointwise(name: str) -> bool:
    """An op name whose ATen op carries torch's ``pointwise`` tag (``mul_``: ``mul``'s)."""
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    p = getattr(torch.ops.aten, base, None)
    try:
        return p is not None and any(torch.Tag.pointwise in getattr(p, o).tags for o in p.overloads())
    except Exception:  # noqa: BLE001 - not an op packet
        return False


def val_of(a):
    return a.meta.get("example_value", a.meta.get("val")) if isinstance(a, fx.Node) else None


def shape_of(a) -> tuple[int, ...] | None:
    v = val_of(a)
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def dims_arg(n: fx.Node, pos: int, ndim: int, key: str = "dim"):
    d = n.args[pos] if len(n.args) > pos else n.kwargs.get(key)
    if d is None:
        return None
    ds = d if isinstance(d, (list, tuple)) else [d]
    return {int(x) % ndim for x in ds}


def where_of(n: fx.Node) -> str:
    line = source_line(n)
    return f" at {line}" if line else ""


class Fail(Exception):
    def __init__(self, why: str, outer: int | None = None, indivisible: bool = False):
        super().__init__(why)
        self.why, self.outer = why, outer  # outer: the split factor that would make it hold
        self.indivisible = indivisible  # it would hold on an axis whose size divides the dims


# --------------------------------------------------------------------------------- the graph
class Graph:
    """What the analysis needs of the torch-level graph: node order, parameters (through casts
    and transposes), which values depend on a parameter (need a gradient), inputs' descendants."""

    def __init__(self, gm: fx.GraphModule, model: torch.nn.Module):
        from autopar.modpath import get_attr, tensor_names

        ids = tensor_names(model)
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.param: dict[fx.Node, str] = {}
        for n in self.nodes:
            if n.op == "get_attr":
                t = get_attr(gm, n.target)
                kind, name = ids.get(id(t), (None, None))
                if kind == "param":
                    self.param[n] = name
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # every parameter
        self.measured: dict = {}  # (node, input placements) -> what running it split gave (tp_measured.py)
        self.grad: set[fx.Node] = set()
        self.from_input: set[fx.Node] = set()
        for n in self.nodes:
            ins = n.all_input_nodes
            if n in self.param or (op_name(n) not in FRESH and any(a in self.grad for a in ins)):
                self.grad.add(n)
            if n.op == "placeholder" or any(a in self.from_input for a in ins):
                self.from_input.add(n)

    def param_view(self, a) -> tuple[str, list[int]] | None:
        """(parameter name, perm) if ``a`` is a parameter seen through casts / transposes: dim i
        of ``a`` is dim perm[i] of the parameter."""
        chain = []
        while isinstance(a, fx.Node) and a not in self.param:
            name = op_name(a)
            if name in SAME or name in ("t", "transpose", "permute", "swapaxes", "swapdims") or \
                    (name == "getattr" and len(a.args) > 1 and a.args[1] in ("T", "mT")):
                chain.append(a)
                a = a.args[0]
            else:
                return None
        if not isinstance(a, fx.Node):
            return None
        nd = len(shape_of(a) or ())
        perm = list(range(nd))
        for v in reversed(chain):
            perm = apply_permute(v, perm)
            if perm is None:
                return None
        return self.param[a], perm


def apply_permute(n: fx.Node, dims: list) -> list | None:
    """``dims`` (per dim of n's input, any labels) reordered as n reorders its input's dims."""
    name = op_name(n)
    nd = len(dims)
    if name in SAME:
        return dims
    if name in ("t",) or (name == "getattr" and n.args[1] in ("T", "mT")):
        if nd < 2:
            return dims
        return dims[:-2] + [dims[-1], dims[-2]] if name != "t" or nd == 2 else None
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (int(x) % nd for x in _pair(n))
        out = list(dims)
        out[a], out[b] = out[b], out[a]
        return out
    if name == "permute":
        order = n.args[1] if isinstance(n.args[1], (list, tuple)) else n.args[1:]
        return [dims[int(i) % nd] for i in order]
    if name in ("movedim", "moveaxis"):
        src, dst = n.args[1], n.args[2]
        src, dst = ([src], [dst]) if isinstance(src, int) else (list(src), list(dst))
        src, dst = [s % nd for s in src], [d % nd for d in dst]
        rest = [dims[i] for i in range(nd) if i not in src]
        out = [None] * nd
        for s, d in zip(src, dst):
            out[d] = dims[s]
        it = iter(rest)
        return [x if x is not None else next(it) for x in out]
    return None


def _pair(n: fx.Node):
    args = list(n.args[1:3])
    for k in ("dim0", "dim1"):
        if k in n.kwargs:
            args.append(n.kwargs[k])
    return args[:2]


# --------------------------------------------------------------------------------- reshapes
def reshape_track(src: tuple, dst: tuple, d: int, o: int, tp: int) -> tuple[int, int]:
    """Where the sharded dim goes through a reshape ``src`` -> ``dst``. Dim d of src is (o, m):
    o outer parts, each sharded in m contiguously. Returns (dim of dst, its outer parts); a
    Fail when the shards would cross a dst dim's boundary (its ``outer``: the split factor the
    weight needs instead)."""
    digits: list[list] = []  # [size, is_sharded]
    for i, s in enumerate(src):
        if i == d:
            if o > 1:
                digits.append([o, False])
            digits.append([s // o, True])
        elif s != 1:
            digits.append([s, False])
    out_dim, out_outer = None, 1
    k = 0
    for j, size in enumerate(dst):
        rem, before = size, 1
        while rem > 1:
            if k >= len(digits):
                raise Fail("a reshape autopar cannot follow")
            dsz, sh = digits[k]
            if dsz <= rem:
                if rem % dsz:
                    raise Fail(f"a reshape from {list(src)} to {list(dst)} that mixes the sharded dim with others")
                if sh:
                    out_dim, out_outer = j, before
                before *= dsz
                rem //= dsz
                k += 1
            else:
                if dsz % rem:
                    raise Fail(f"a reshape from {list(src)} to {list(dst)} that mixes the sharded dim with others")
                if sh:  # the sharded digit is split: its outer part (rem) lands in dim j
                    if rem % tp:
                        raise Fail(f"a view to {list(dst)} splits the sharded dim into {rem} x {dsz // rem}: its "
                                    f"outer part ({rem}, e.g. the heads) does not divide by {tp}", outer=rem,
                                    indivisible=True)
                    out_dim, out_outer = j, before
                digits[k] = [dsz // rem, False]
                rem = 1
    if out_dim is None:
        raise Fail("a reshape autopar cannot follow")
    return out_dim, out_outer


