"""Dropout whose mask does not depend on how the tensor is laid out over the ranks.

A dropout mask drawn from each rank's own generator is wrong under every plan that shards or
replicates activations: ranks holding REPLICAS of a tensor (tensor parallelism's norms and
residuals) must draw the same mask, or their copies diverge silently; ranks holding different
SHARDS of it (data parallelism's batch rows, tensor parallelism's hidden columns) must not draw
the same mask for every shard, or the masks of the whole batch are correlated; and neither may
depend on what the other ranks' generators did before (a data loader seeded per rank).

autopar draws each element's keep / drop from a counter-based hash of its GLOBAL position (its
linear index in the global tensor) and a key made of the run's seed, the step, the micro-batch and
the dropout's node in the captured graph (``splitmix64``, Steele et al. 2014, a well-mixed 64-bit
finaliser; its top 53 bits are the uniform draw). A rank computes the draws of the elements it
holds only, from their global offsets, so:

- replicas draw the same mask, shards draw the parts of one mask, whatever the plan: the same
  seed gives the same masks under ddp, fsdp, megatron, pipelines or one process;
- the mask is reproducible from the seed (``autopar.compile(..., seed=)``, else rank 0's
  ``torch.initial_seed()``, agreed on every rank at the first step);
- it is not torch's stream: a single-process eager run with ``F.dropout`` draws other masks
  (the same distribution). ``eager_dropout`` is the same draw for an eager model, so that one
  process can be compared with a plan exactly (tests/test_dropout.py).

Localize replaces each ``aten.native_dropout`` of the training program by
``autopar::dropout_mask`` (this rank's part of the mask, from its shard's global offsets) times the
input, scaled by 1 / (1 - p); the backward uses the saved mask as before. Recompute never re-draws
a random op (passes/recompute.py), and the mask is a function of (seed, step, micro-batch, node),
so a pipeline's stages and a re-run of a step draw the same.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from autopar import torch_compat as tc

_M64 = (1 << 64) - 1


@dataclass
class Draw:
    """Which masks the dropouts of a program call draw: the run's seed, the step and the
    micro-batch. Each runtime owns one (``Runtime.draw``: the step's, the executor sets the
    micro-batch before each action) and makes it the current one for the length of its step
    (``drawing``), which is what ``autopar::dropout_mask`` reads when it runs."""

    seed: int = 0
    step: int = 0
    micro: int = 0


# the draw of the step running in this thread (``drawing``); outside a step, seed 0, step 0, micro-batch 0
_CURRENT: ContextVar[Draw | None] = ContextVar("autopar_dropout_draw", default=None)


@contextmanager
def drawing(draw: Draw):
    """``draw`` is the one the dropouts read while this runs (a runtime's step)."""
    token = _CURRENT.set(draw)
    try:
        yield draw
    finally:
        _CURRENT.reset(token)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(z: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix(z: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 tensors (multiplications wrap modulo 2^64)."""
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _mix_int(x: int) -> int:
    """The same finaliser on a Python int (for the per-call key)."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def node_key(name: str) -> int:
    """A dropout's identity: its node's name in the torch-level capture, which every rank, pipeline
    stage and plan shares."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def call_key(seed: int, step: int, micro: int, key: int) -> int:
    """The stream of one dropout call: a 64-bit value from the seed, step, micro-batch and node."""
    h = _mix_int(seed & _M64)
    for part in (step, micro, key):
        h = _mix_int(h ^ (part & _M64))
    return _signed(h)


def keep_mask(shape, starts, strides, p: float, base: int, device) -> Tensor:
    """True where an element is kept: the elements of the global tensor at ``starts`` (global
    offsets per dim) with global ``strides``, ``shape`` of them, under the call's ``base`` key."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    for d, (n, s0, st) in enumerate(zip(shape, starts, strides)):
        view = [1] * len(shape)
        view[d] = n
        idx = idx + ((torch.arange(n, dtype=torch.int64, device=device) + s0) * st).view(view)
    h = _splitmix(idx.expand(tuple(shape)) ^ base)
    u = _shr(h, 11).to(torch.float64) * (1.0 / (1 << 53))
    return u >= p


@torch.library.custom_op("autopar::dropout_mask", mutates_args=())
def dropout_mask(x: Tensor, p: float, starts: list[int], strides: list[int], key: int) -> Tensor:
    """This rank's part of the keep-mask of a dropout on a tensor whose local block starts at global
    offsets ``starts`` (global ``strides``), for the call the current ``Draw`` names (see the module docstring)."""
    draw = _CURRENT.get() or Draw()
    base = call_key(draw.seed, draw.step, draw.micro, key)
    return keep_mask(tuple(x.shape), starts, strides, p, base, x.device)


@dropout_mask.register_fake
def _(x, p, starts, strides, key):
    return torch.empty(x.shape, dtype=torch.bool, device=x.device)


def local_dropout(x: Tensor, p: float, starts: list[int], strides: list[int], key: int):
    """``aten.native_dropout(x, p, train=True)`` on this rank's block: (output, mask)."""
    if p >= 1.0:
        mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        return x * mask, mask
    mask = torch.ops.autopar.dropout_mask(x, p, starts, strides, key)
    return x * mask * (1.0 / (1.0 - p)), mask


def eager_dropout(x: Tensor, p: float, key: int, seed: int, step: int, micro: int = 0) -> Tensor:
    """The same draw for a whole (global) tensor in eager code: a single-process reference."""
    strides = list(tc.contiguous_strides(x.shape))
    mask = keep_mask(tuple(x.shape), [0] * x.ndim, strides, p, call_key(seed, step, micro, key), x.device)
    return x * mask * (1.0 / (1.0 - p))
