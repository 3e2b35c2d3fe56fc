"""``autopar.mesh(dp=2, tp=2)``: a torch DeviceMesh with named axes.

One axis may be -1: it takes the ranks left over, so ``autopar.mesh(dp=-1, tp=2)`` fits
any launcher's world size, and ``autopar.mesh(dp=-1)`` is a one-rank mesh in a plain process.

Under torchrun (or any launcher that set up torch.distributed) it uses the existing process
group; in a plain single process it starts a one-rank gloo group, so the same script runs
unchanged on a laptop. NCCL is used when CUDA is available, gloo otherwise.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.errors import PlanError


def mesh(device_type: str | None = None, **axes: int) -> DeviceMesh:
    if not axes:
        raise PlanError("autopar.mesh needs at least one named axis", fix="e.g. autopar.mesh(dp=2, tp=2)")
    for name, size in axes.items():
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise PlanError(f"mesh axis {name!r} must have a positive integer size (or -1), got {size!r}",
                            where=f"autopar.mesh({name}=...)")
    if list(axes.values()).count(-1) > 1:
        raise PlanError("at most one mesh axis may be -1 (the ranks left over)", where="autopar.mesh(...)")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        _check_world(axes, int(os.environ["WORLD_SIZE"]))  # before any process group exists
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            _warn_shared_store()
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        else:  # one process: an in-memory store, no port (a port inherited or raced for fails with EADDRINUSE)
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    axes = _check_world(axes, dist.get_world_size())
    if device_type == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(axes))


def _warn_shared_store() -> None:
    """torchrun with restarts and its rendezvous store shared with the workers (torch 2.13's default
    under ``--rdzv-backend c10d``): every attempt's workers get the same TCPStore, which still holds
    the previous attempt's keys (gloo's addresses, autopar's failure records), so restarted workers
    fail to connect (torch issue 135712; seen here: "Gloo connectFullMesh failed ... Connect
    timeout"). Told once, by rank 0, before anything is made."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
            and os.environ.get("RANK") == "0"):
        import warnings

        warnings.warn("torchrun shares its rendezvous TCPStore with the workers, and it keeps one attempt's keys for "
                      "the next: after a restart the workers would read stale addresses and fail to connect (torch "
                      "issue 135712). Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
                      "(examples/train_elastic.py)", stacklevel=3)


def _check_world(axes: dict, world: int) -> dict:
    """The axis sizes (-1 resolved) if they make ``world`` ranks; else a PlanError (the same on
    every rank, and under torchrun before any process group is made)."""
    if -1 in axes.values():
        rest = math.prod(v for v in axes.values() if v != -1)
        axes = {k: (world // rest if v == -1 else v) for k, v in axes.items()}
    n = math.prod(axes.values())
    if n != world:
        raise PlanError(
            f"mesh {dict(axes)} has {n} ranks but the process group has {world}",
            where="autopar.mesh(...)",
            fix=f"launch {n} processes (e.g. torchrun --nproc-per-node {n}) or change the axis sizes")
    return axes


@contextlib.contextmanager
def fake_mesh(axes: dict[str, int], rank: int):
    """A DeviceMesh of ``axes`` on a fake process group, as seen by ``rank`` (nothing is sent)."""
    from autopar import torch_compat as tc

    store = tc.fake_store()  # (registers torch's "fake" backend)
    if dist.is_initialized():
        dist.destroy_process_group()
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:"; once per fake mesh
    dist.init_process_group("fake", store=store, rank=rank, world_size=math.prod(axes.values()))
    try:
        yield init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
