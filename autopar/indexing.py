"""``index_put``'s layouts. The positions in its ``indices`` are global: a dim they index must be
whole in ``self``, the index result's dims whole in ``values``, and the indices themselves whole.

- ``sound_indexing``: DTensor's layout for an ``index_put``, replicated on the mesh axes where it
  breaks that (applied to DTensor's answer for every ``index_put``, passes/propagate.py);
- ``index_put_layout``: autopar's own, where DTensor has none (torch 2.11's strategy asserts that
  every index is a tensor, so a KV cache written at positions along its sequence dim, indices
  ``[None, None, pos]``, did not compile under tensor parallelism there).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Replicate, Shard

from autopar.ir import RuleResult

R = Replicate()
_INDEX_PUT = torch.ops.aten.index_put.default


class _Geometry:
    """Where ``index_put``'s index result sits: ``indexed`` (the dims of ``self`` the indices
    address), ``width`` (the broadcast indices' dims), ``first`` (the result dim the index result's
    dims start at: in place of the indexed dims where those are adjacent, else first, torch's
    rule) and ``shift`` (``values`` broadcast to the result shape, right-aligned: result dim r is
    values dim r - shift)."""

    def __init__(self, n: fx.Node):
        indices = n.args[1]
        self.indexed = [d for d, ix in enumerate(indices) if ix is not None]
        if not self.indexed:
            return
        self.ndim = n.args[0].meta["val"].ndim
        self.values = n.args[2].meta["val"]
        self.width = max(ix.meta["val"].ndim for ix in indices if ix is not None)
        self.adjacent = self.indexed == list(range(self.indexed[0], self.indexed[-1] + 1))
        self.first = self.indexed[0] if self.adjacent else 0
        self.shift = self.ndim - len(self.indexed) + self.width - self.values.ndim

    def values_dim(self, d: int) -> int | None:
        """The dim of ``values`` that lands on dim ``d`` of ``self`` (one the indices do not
        address); None where ``values`` broadcasts along it (absent or of size 1)."""
        rest = [x for x in range(self.ndim) if x not in self.indexed]
        if self.adjacent:
            r = d if d < self.first else d - len(self.indexed) + self.width
        else:
            r = self.width + rest.index(d)
        v = r - self.shift
        return v if v >= 0 and self.values.shape[v] != 1 else None


def index_put_layout(n: fx.Node, in_specs) -> RuleResult | None:
    """autopar's layout for a functional ``index_put`` (``self``, its tensor indices, ``values``),
    per mesh axis: a Shard of ``self`` on a dim the indices do not address is kept, ``values``
    sharded on the dim that lands there (whole where it broadcasts along it); anything else whole
    (a Partial reduced first: writing into or from a partial sum is not writing the sum). The
    indices whole. Each rank then writes its block at the global positions: no communication but
    what the inputs' layouts need. None for any other op."""
    if n.target is not _INDEX_PUT or not in_specs or in_specs[0] is None or in_specs[-1] is None:
        return None
    g = _Geometry(n)
    if not g.indexed:
        return None
    own, vals = [], []
    for p in in_specs[0].placements:
        if type(p) is Shard and p.dim not in g.indexed:  # (a strided shard: whole, as anything else)
            dv = g.values_dim(p.dim)
            own.append(p)
            vals.append(Shard(dv) if dv is not None else R)
        else:
            own.append(R)
            vals.append(R)
    whole = tuple(R for _ in own)
    return RuleResult([tuple(own), *(whole for _ in in_specs[1:-1]), tuple(vals)], tuple(own), None,
                      "index_put at global positions")



def sound_indexing(n: fx.Node, res: RuleResult) -> RuleResult:
    """DTensor's layout for an ``index_put``, kept where it is sound, else replicated on the mesh axes
    where it is not. The positions in ``indices`` are global: a dim they index must be whole in
    ``self``, the index result's dims whole in ``values``, and the indices themselves whole. torch
    2.11's DTensor sharded ``self`` and ``values`` on dim 0 with replicated indices (DeepSeek-V3's
    expert dispatch under fsdp: a shape error in the step, found 2026-12-04; 2.13 gathers them). The
    functional op only: an in-place one writes into its ``self`` as it is laid out. Any other op:
    ``res`` as it is."""
    if n.target is not _INDEX_PUT or len(res.inputs) < 3 or res.inputs[0] is None or res.inputs[-1] is None:
        return res
    g = _Geometry(n)
    if not g.indexed:
        return res
    indexed, width, first, shift = g.indexed, g.width, g.first, g.shift
    ins = [list(p) if p is not None else None for p in res.inputs]
    outs = list(res.outputs)
    changed = False
    for a in range(len(outs)):
        sp, vp = ins[0][a], ins[-1][a]
        if (isinstance(sp, Shard) and sp.dim in indexed) or \
                (isinstance(vp, Shard) and first <= vp.dim + shift < first + width) or \
                any(p is not None and not isinstance(p[a], Replicate) for p in ins[1:-1]):
            for p in ins:
                if p is not None:
                    p[a] = Replicate()
            outs[a] = Replicate()
            changed = True
    if not changed:
        return res
    return RuleResult([tuple(p) if p is not None else None for p in ins], tuple(outs), res.impl, res.name)
