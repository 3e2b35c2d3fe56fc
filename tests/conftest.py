"""Fixtures: a fake process group for planning at any mesh size, and real gloo pools.

The gloo pools are spawned once per test session (spawning costs seconds) and shared.
"""

from __future__ import annotations

import contextlib
import math
import os

import autopar  # noqa: F401  (first: without a GPU it switches Triton to its interpreter before torch imports it)
import warnings

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")


@contextlib.contextmanager
def fake_mesh(rank: int = 0, **axes):
    """A DeviceMesh over a fake process group of any size, in this process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(axes.values()))
    try:
        yield init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake():
    return fake_mesh


@pytest.fixture(scope="session")
def pools():
    from autopar.testing import DistPool

    made: dict[int, DistPool] = {}

    def get(n: int) -> DistPool:
        if n not in made:
            made[n] = DistPool(n)
        return made[n]

    yield get
    for p in made.values():
        p.close()


@pytest.fixture(scope="session")
def references():
    """Single-process runs, computed once per model."""
    from autopar.testing import reference_run

    cache: dict[tuple, dict] = {}

    def get(name: str, precision: str = "fp32") -> dict:
        if (name, precision) not in cache:
            torch.set_num_threads(1)
            cache[(name, precision)] = reference_run(name, precision=precision)
        return cache[(name, precision)]

    return get
