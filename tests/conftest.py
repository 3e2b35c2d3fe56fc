"""Fixtures: a fake process group for planning at any mesh size, and real gloo pools.

The gloo pools are spawned once per test session (spawning costs seconds) and shared.
"""

from __future__ import annotations

import os

import autopar  # noqa: F401
import warnings

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")


def fake_mesh(rank: int = 0, **axes):
    """A DeviceMesh over a fake process group of any size, in this process."""
    from autopar.mesh import fake_mesh as mesh_of

    return mesh_of(axes, rank)


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


# The files that take longest (measured 2026-11-25, one worker: seconds), run first: under
# ``./run.sh test``'s two xdist workers (``--dist loadfile``) the files go out in collection order,
# so starting with the longest keeps one worker from running a long file alone at the end.
# Only the order changes; a stale list costs a little wall time, nothing else.
LONGEST_FIRST = ("test_planner.py", "test_experts.py", "test_pipeline.py", "test_state.py", "test_context.py",
                 "test_faults.py", "test_gather.py", "test_kernels.py", "test_ring.py", "test_parity.py",
                 "test_elastic.py", "test_explain.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: file order kept otherwise)
