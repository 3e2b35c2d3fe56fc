"""PROTOTYPE (a feasibility study, REJECTED: docs/tensor-parallel.md, "Coverage and what is left";
not part of autopar): a DTensor placement for a fused
projection split into UNEQUAL parts, each part plainly sharded along one mesh axis.

``PartsShard(dim, parts)``: rank r's local tensor is ``cat_p(chunk r of part p)`` along ``dim``,
where the parts are consecutive blocks of ``dim`` of sizes ``parts`` (each divisible by the axis
size). With equal parts it is torch's ``_StridedShard(dim, split_factor=len(parts))``; grouped-query
attention's ``[q (32 heads) | k (8) | v (8)]`` is ``PartsShard(0, (32*d, 8*d, 8*d))``.

Two variants, both built on the same mixin (benchmarks/parts_feasibility.py checks both):

- ``PartsShard``: a subclass of torch's private ``_StridedShard`` (``tc.StridedShard``). Its base
  is not ``Shard`` on torch 2.11+ (``is_shard()`` is False), so DTensor's sharding rules treat it
  as an "exotic" shard (mostly: redistribute to Replicate first) instead of as a plain Shard.
  The C++ base stores ``split_factor = len(parts)``, read only by torch code that treats the
  placement as an ordinary ``_StridedShard`` (see the report for where that is wrong).
- ``PartsShardS``: a subclass of public ``Shard``: ``is_shard()`` is True, so every sharding rule
  sees a ``Shard(dim)`` and rebuilds plain ``Shard`` outputs (wrong values, see the report).

Private torch names read here (through autopar/torch_compat.py except where marked):
``_StridedShard`` (tc.StridedShard); the placement hooks torch's redistribute calls:
``_split_tensor``, ``_to_replicate_tensor``, ``_replicate_to_shard``, ``_reduce_shard_tensor``,
``_to_new_shard_dim``, ``_local_shard_size_and_offset``, ``local_shard_size_and_offset``;
``torch.distributed._functional_collectives.all_gather_tensor`` (semi-public funcol).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Shard

from autopar import torch_compat as tc


def _check(parts, n: int, dim_size: int | None = None):
    if any(p % n for p in parts):
        raise ValueError(f"every part size {parts} must be divisible by the mesh axis size {n}")
    if dim_size is not None and sum(parts) != dim_size:
        raise ValueError(f"parts {parts} sum to {sum(parts)}, the sharded dim has size {dim_size}")


class _PartsMixin:
    """What both variants override; ``self.dim`` comes from torch's C++ base, ``self.parts`` is
    kept in the instance dict (the C++ placements take extra attributes, like torch's own
    ``_MaskPartial``)."""

    parts: tuple[int, ...]

    def _init_parts(self, parts) -> None:
        parts = tuple(int(p) for p in parts)
        if len(parts) < 1 or any(p <= 0 for p in parts):
            raise ValueError(f"parts must be positive sizes, got {parts}")
        object.__setattr__(self, "parts", parts)

    # ---- identity: the C++ bases compare (dim[, split_factor]) only, which would make a parts
    # placement EQUAL to Shard(dim) / _StridedShard(dim, k) and redistribute a no-op between them
    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.dim == self.dim and other.parts == self.parts

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.dim, self.parts))

    def __reduce__(self):  # the C++ __getstate__ would drop ``parts``
        return (type(self), (self.dim, self.parts))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim}, parts={self.parts})"

    def __str__(self) -> str:
        return f"P({self.dim}, {'|'.join(map(str, self.parts))})"

    def __fx_repr__(self):
        return f"autopar.parts_placement.{type(self).__name__}({self.dim}, {self.parts})", {
            "autopar": __import__("autopar.parts_placement")}

    # ---- layout: the one function everything else is built on
    def _split_tensor(self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True):
        """Rank r's piece for every r (torch's hook: distribute_tensor, Replicate -> this, and on
        torch 2.13 the _StridedShard index arithmetic all call it)."""
        _check(self.parts, num_chunks, tensor.size(self.dim))
        pieces = [p.chunk(num_chunks, dim=self.dim) for p in torch.split(tensor, list(self.parts), dim=self.dim)]
        shards = [torch.cat([pc[r] for pc in pieces], dim=self.dim) for r in range(num_chunks)]
        if contiguous:
            shards = [s.contiguous() for s in shards]
        return shards, ([0] * num_chunks if with_padding else [])

    def _select_split_tensor(self, tensor, num_chunks, index, *, with_padding=True, contiguous=True, clone=True):
        out = self._split_tensor(tensor, num_chunks, with_padding=False, contiguous=False)[0][index]
        return out.clone() if clone else (out.contiguous() if contiguous else out)

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        """All-gather along ``dim`` ([rank 0's piece | rank 1's piece | ...]), then regroup the
        pieces part by part. Own implementation: torch's differs by version."""
        import torch.distributed._functional_collectives as funcol

        n = mesh.size(mesh_dim=mesh_dim)
        _check(self.parts, n, current_logical_shape[self.dim])
        gathered = funcol.all_gather_tensor(local_tensor.contiguous(), gather_dim=self.dim, group=(mesh, mesh_dim))
        if hasattr(gathered, "wait"):
            gathered = gathered.wait()
        per_rank = torch.split(gathered, local_tensor.size(self.dim), dim=self.dim)
        local_parts = [p // n for p in self.parts]
        split = [torch.split(block, local_parts, dim=self.dim) for block in per_rank]
        return torch.cat([split[r][p] for p in range(len(self.parts)) for r in range(n)], dim=self.dim).contiguous()

    def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        return self._select_split_tensor(local_tensor, mesh.size(mesh_dim=mesh_dim), shard_index)

    # torch 2.13's name for the Replicate -> _StridedShard hook
    _replicate_to_strided_shard = _replicate_to_shard

    def _reduce_shard_tensor(self, tensor, mesh, reduce_op, mesh_dim):
        """Partial -> this: all-reduce, then keep this rank's piece (a reduce-scatter of the tensor
        reordered rank-major would be cheaper; a prototype)."""
        import torch.distributed._functional_collectives as funcol

        full = funcol.all_reduce(tensor, reduce_op, group=(mesh, mesh_dim))
        if hasattr(full, "wait"):
            full = full.wait()
        return self._replicate_to_shard(full, mesh, mesh_dim, mesh.get_coordinate()[mesh_dim])

    def _to_new_shard_dim(self, local_tensor, mesh, mesh_dim, current_logical_shape, new_shard_dim):
        """Only reached for the Shard variant (this -> Shard(other dim)): via Replicate."""
        full = self._to_replicate_tensor(local_tensor, mesh, mesh_dim, current_logical_shape)
        return Shard(new_shard_dim)._replicate_to_shard(full, mesh, mesh_dim, mesh.get_coordinate()[mesh_dim])

    # ---- sizes / offsets (compute_local_shape_and_global_offset; DCP's chunk metadata)
    def _offsets(self, size: int, num_chunks: int, rank: int) -> list[int]:
        _check(self.parts, num_chunks, size)
        out, start = [], 0
        for p in self.parts:
            c = p // num_chunks
            out += range(start + rank * c, start + (rank + 1) * c)
            start += p
        return out

    def local_shard_size_and_offset(self, curr_local_size, num_chunks, rank, offset_mode=None, **kw):
        """Both torch signatures of ``_StridedShard``'s: 2.13 passes ``offset_mode`` (an IntEnum:
        FIRST=0 -> the first offset (int), ALL=1 -> every index (list), NONE=2 -> None); the
        early-2026 one (~2.11) passes ``return_first_offset`` (bool, 4th positional or keyword)."""
        offs = self._offsets(curr_local_size, num_chunks, rank)
        if "return_first_offset" in kw:
            offset_mode = bool(kw["return_first_offset"])
        if type(offset_mode) is bool:
            offset_mode = "FIRST" if offset_mode else "ALL"
        mode = getattr(offset_mode, "name", offset_mode)
        if mode in ("NONE", 2):
            return len(offs), None
        if mode in ("ALL", 1):
            return len(offs), offs
        return len(offs), (offs[0] if offs else -1)

    def _local_shard_size_and_offset(self, curr_local_size, num_chunks, rank, offset_mode=None, **kw):
        return self.local_shard_size_and_offset(curr_local_size, num_chunks, rank, offset_mode, **kw)

    # ---- what autopar itself would ask
    def local_indices(self, size: int, num_chunks: int, rank: int) -> list[int]:
        """The global indices along ``dim`` that rank ``rank`` holds, in local order."""
        return self._offsets(size, num_chunks, rank)

    def local_blocks(self, size: int, num_chunks: int, rank: int) -> list[tuple[int, int, int]]:
        """(global start, local start, length) of each contiguous block rank ``rank`` holds: one
        per part (what a checkpoint reader or load_pretrained would read slice by slice)."""
        out, start, local = [], 0, 0
        for p in self.parts:
            c = p // num_chunks
            out.append((start + rank * c, local, c))
            start, local = start + p, local + c
        return out


class PartsShard(_PartsMixin, tc.StridedShard):
    """The unequal-parts placement as a ``_StridedShard`` subclass (``is_shard()`` False)."""

    def __init__(self, dim: int, parts) -> None:
        super().__init__(dim, split_factor=len(tuple(parts)))
        self._init_parts(parts)

    # torch 2.13's _StridedShard.__eq__ / split_factor are fine; __eq__ above is stricter


class PartsShardS(_PartsMixin, Shard):
    """The same layout as a ``Shard`` subclass (``is_shard()`` True: DTensor's rules see Shard(dim))."""

    def __init__(self, dim: int, parts) -> None:
        super().__init__(dim)
        self._init_parts(parts)


def parts_placement(dim: int, parts, kind=PartsShard):
    """Equal parts -> torch's own ``_StridedShard(dim, split_factor=k)`` (or Shard for one part);
    unequal parts -> ``kind(dim, parts)``."""
    parts = tuple(parts)
    if len(parts) == 1:
        return Shard(dim)
    if len(set(parts)) == 1:
        return tc.StridedShard(dim, split_factor=len(parts))
    return kind(dim, parts)
