"""Weights held as parts (autopar/unfuse.py cuts a fused projection into one parameter per part):
the parametrization, and the global views that give each such weight whole under its own name
(``pm.state_dict()``, checkpoints, ``pm.load_pretrained``, the breadth check's comparisons)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


NOTE = "cut: "  # the reports' prefix for a fused weight cut into parts (unfuse_find.describe's lines)


class Parts(nn.Module):
    """The parametrization: the fused tensor is ``cat(parts, dim)``; ``sizes`` along ``dim``."""

    def __init__(self, sizes: list[int], dim: int = 0):
        super().__init__()
        self.sizes, self.dim = [int(s) for s in sizes], dim

    def forward(self, *parts):
        return torch.cat(parts, self.dim)

    def right_inverse(self, fused):
        return tuple(p.clone() for p in torch.split(fused, self.sizes, self.dim))

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, dim={self.dim}"


@dataclass
class Group:
    fused: str
    parts: list[str]
    sizes: list[int]
    dim: int


def groups(model: nn.Module) -> list[Group]:
    """Every tensor of ``model`` held as parts by ``Parts`` (this module's parametrization)."""
    out = []
    for mod_name, mod in model.named_modules():
        plist = getattr(mod, "parametrizations", None)
        if not isinstance(plist, nn.ModuleDict):
            continue
        for attr, pl in plist.items():
            if len(pl) == 1 and isinstance(pl[0], Parts):
                pre = f"{mod_name}." if mod_name else ""
                out.append(Group(f"{pre}{attr}", [f"{pre}parametrizations.{attr}.original{i}"
                                                    for i in range(len(pl[0].sizes))], pl[0].sizes, pl[0].dim))
    return out


def part_of(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """part name -> (fused name, the part's offset along dim, dim)."""
    out = {}
    for g in groups(model):
        at = 0
        for p, s in zip(g.parts, g.sizes):
            out[p] = (g.fused, at, g.dim)
            at += s
    return out


def fuse(named: dict, model: nn.Module) -> dict:
    """``named`` (name -> whole tensor, as ``pm.named_parameters()`` gathered) with each cut
    weight's parts replaced by the fused tensor under its own name, in the parts' place."""
    gs = {g.parts[0]: g for g in groups(model)}
    rest = {p for g in gs.values() for p in g.parts[1:]}
    out = {}
    for k, v in named.items():
        if k in gs:
            g = gs[k]
            if all(p in named for p in g.parts):
                out[g.fused] = torch.cat([named[p] for p in g.parts], g.dim)
                continue
        if k in rest and all(p in named for p in next(g for g in gs.values() if k in g.parts).parts):
            continue
        out[k] = v
    return out


def fused_shapes(shapes: dict, model: nn.Module) -> dict:
    """``shapes`` (name -> shape, a state dict's names) with each cut weight's parts replaced by
    the fused tensor's shape under its own name."""
    out = dict(shapes)
    for g in groups(model):
        if all(p in out for p in g.parts):
            first = list(out.pop(g.parts[0]))
            for p in g.parts[1:]:
                out.pop(p)
            first[g.dim] = sum(g.sizes)
            out[g.fused] = tuple(first)
    return out


_PREFIXES = ("", "state.", "param_groups.")  # a model's state dict; an optimizer's, flattened by name


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def to_fused(d: dict, model: nn.Module, values: bool = True) -> list[tuple]:
    """In the flat dict ``d`` (a model's state dict, or an optimizer's flattened by parameter name:
    ``state.<name>.exp_avg``, ``param_groups.<name>.lr``), every cut weight's parts replaced by one
    entry under the fused name: the parts' tensors gathered whole and concatenated (a DTensor
    replicated on the parts' mesh, so DCP writes it once and any plan reads it), a per-parameter
    scalar (AdamW's ``step``, a learning rate) as the first part's. Returns what ``from_fused``
    needs to put the parts back. A part held on another pipeline stage (meta here) makes a meta
    entry. Every rank of a part's mesh calls this (it gathers). ``values=False`` (a load, which
    overwrites them): empty fused tensors of the same kind, nothing gathered."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate

    undo = []
    for g in groups(model):
        for pre in _PREFIXES:
            p0 = pre + g.parts[0]
            for key in [k for k in d if k == p0 or k.startswith(p0 + ".")]:
                rest = key[len(p0):]
                keys = [pre + p + rest for p in g.parts]
                if not all(k in d for k in keys):
                    continue
                vals = [d[k] for k in keys]
                v0 = vals[0]
                if isinstance(v0, torch.Tensor) and v0.ndim > g.dim and v0.shape[g.dim] == g.sizes[0]:
                    shape = list(v0.shape)
                    shape[g.dim] = sum(g.sizes)
                    if any(v.is_meta for v in vals):
                        fused = torch.empty(shape, dtype=v0.dtype, device="meta")
                    else:
                        local = (v0.to_local() if isinstance(v0, DTensor) else v0)
                        whole = (torch.cat([_whole(v) for v in vals], g.dim) if values else
                                 torch.empty(shape, dtype=local.dtype, device=local.device))
                        fused = (DTensor.from_local(whole, v0.device_mesh, [Replicate()] * v0.device_mesh.ndim,
                                                    run_check=False) if isinstance(v0, DTensor) else whole)
                else:
                    fused = v0
                for k in keys:
                    del d[k]
                d[pre + g.fused + rest] = fused
                undo.append((pre + g.fused + rest, keys, vals, g))
    return undo


def from_fused(d: dict, undo: list[tuple]) -> None:
    """After a load into the entries ``to_fused`` made: each part's values copied (in place) into
    its own tensors from the fused one, which go back into ``d`` under the parts' names."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for key, keys, vals, g in undo:
        fused = d.pop(key)
        at = 0
        for k, v, size in zip(keys, vals, g.sizes):
            if isinstance(v, torch.Tensor) and not v.is_meta and isinstance(fused, torch.Tensor) \
                    and fused.ndim > g.dim and not fused.is_meta and v.ndim == fused.ndim:
                piece = _whole(fused).narrow(g.dim, at, size)
                if isinstance(v, DTensor):
                    local = distribute_tensor(piece, v.device_mesh, v.placements, src_data_rank=None).to_local()
                    v.to_local().copy_(local)
                else:
                    v.copy_(piece)
            elif isinstance(v, torch.Tensor) and not v.is_meta and isinstance(fused, torch.Tensor):
                (v.to_local() if isinstance(v, DTensor) else v).copy_(_whole(fused))
            elif not isinstance(v, torch.Tensor):
                v = fused
            d[k] = v
            at += size
