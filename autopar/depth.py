"""Any model with a repeated block list at other depths: the list cut in a copy on the meta device.

Planning a deep model compiles it shallow: ``autopar plan``'s fixed plans at depths 3-5, then
extrapolated (autopar/tools/extrapolate.py); ``plan="auto"``'s search at depths 1-3 and at one and
two blocks per pipeline stage (autopar/planner/). Those shallow variants come from the model
itself, whoever wrote it: its repeated block list (``splice.find_blocks``: an ``nn.ModuleList`` or
``nn.Sequential`` of blocks of one class with the same parameter shapes: Hugging Face's
``model.layers``, GPT-2's ``transformer.h``, torchtitan's ``layers``, a user's own) is cut to its
first ``d`` blocks in a copy of the module whose parameters and buffers are empty meta tensors
(nothing allocated, the user's module untouched: a compile replaces the copy's parameters, not
the user's). No config is read and nothing rebuilt, so a factory's model, a module built from a
Hugging Face config and the built-in models go the same way and give the same figures.

The example inputs go to the meta device with it (planning reads shapes only). The search
changes the batch: every input's first dimension is taken as the batch (``at(depth, batch=)``).
A list whose blocks differ only within a repeating unit (``splice.find_period``: Gemma 2's
alternating attention) is cut by whole units where the caller asks (``repeated(periodic=True)``:
``autopar plan``'s fixed plans, and the search, whose depths then count units).
What this cannot see (a block whose code depends on its index, beyond its attributes) the
callers' checks catch: the extrapolation compiles a third depth and requires each figure's
increments to be equal, the search requires depth 3 - depth 2 = depth 2 - depth 1.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from autopar import splice


@dataclass
class Repeated:
    """A model whose repeated block list ``path`` holds ``layers`` blocks, with what it is compiled with."""

    model: nn.Module
    example_inputs: tuple
    loss_fn: Callable | None
    path: str
    blocks: nn.Module
    name: str = ""
    # the planner's whole-model pipeline groupings for this model, by what else they depend on
    # (planner/search.py ``confirm``): cached with the model, so another model never reads them
    splits: dict = field(default_factory=dict, repr=False, compare=False)

    # the blocks repeat in units of this many (``splice.find_period``: 2 where a sliding-window and
    # a full attention layer alternate); depths and ``layers`` count units
    period: int = 1

    @property
    def layers(self) -> int:
        return len(self.blocks) // self.period

    def at(self, depth: int, batch: int | None = None):
        """The model with its first ``depth`` units (blocks, where ``period`` is 1), copied on the
        meta device, and its example inputs on meta (with ``batch`` as their first dimension where
        given): a ``zoo.Loaded``."""
        from autopar.models.zoo import Loaded

        if not 1 <= depth <= self.layers:
            raise ValueError(f"depth {depth} outside 1..{self.layers}")
        return Loaded(meta_copy(self.model, self.path, self.blocks, depth * self.period),
                      meta_inputs(self.example_inputs, batch), self.loss_fn, self.name)


def repeated(model: nn.Module, example_inputs, loss_fn=None, *, min_blocks: int = 2,
             name: str = "", periodic: bool = False) -> Repeated | str:
    """``model``'s repeated block list as a ``Repeated``, or why it has none (one line).
    ``periodic``: where no list's blocks are all alike, one whose blocks repeat in units of a few
    (``splice.find_period``, at least ``min_blocks`` units) is taken, with its period."""
    found = splice.find_blocks(model, min_blocks)
    if isinstance(found, str):
        unit = splice.find_period(model, min_blocks) if periodic else None
        if unit is None:
            return found
        return Repeated(model, tuple(example_inputs), loss_fn, unit[0], unit[1], name, period=unit[2])
    return Repeated(model, tuple(example_inputs), loss_fn, found[0], found[1], name)


def meta_copy(model: nn.Module, path: str, blocks: nn.Module, depth: int) -> nn.Module:
    """A copy of ``model`` with its block list ``path`` cut to ``depth`` blocks, every parameter
    and buffer an empty meta tensor (tied ones stay tied)."""
    with splice.truncated(model, path, blocks, keep=depth):
        memo: dict = {}
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in memo:
                empty = torch.empty_like(t, device="meta")
                memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return copy.deepcopy(model, memo)


def meta_inputs(xs, batch: int | None = None) -> tuple:
    """Example inputs as empty meta tensors (the first dimension ``batch`` where given)."""
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            shape = (batch, *x.shape[1:]) if batch is not None and x.ndim > 0 else tuple(x.shape)
            x = torch.empty(shape, dtype=x.dtype, device="meta")
        out.append(x)
    return tuple(out)
