"""The worker processes (autopar/testing.py ``process_context``): forks of the fork server that
imported torch and autopar once (autopar/poolserver.py), with the environment variables and
import path of the process that started them, not the server's."""

from __future__ import annotations

import os
import sys

import pytest


def _where() -> dict:
    return {"server": getattr(sys.modules.get("autopar.poolserver"), "SERVER", False),
            "env": os.environ.get("AUTOPAR_TEST_POOL_ENV"), "parent": os.getppid(),
            "path": [p for p in sys.path if p.startswith("/autopar-test-path")]}


def test_workers_are_forks_of_the_server_with_the_callers_environment(monkeypatch):
    from autopar.testing import DistPool

    monkeypatch.setenv("AUTOPAR_TEST_POOL_ENV", "first")
    pool = DistPool(2)
    try:
        first = pool.run(_where)
    finally:
        pool.close()
    # a second pool, after the server is running, sees the environment as it is now
    monkeypatch.setenv("AUTOPAR_TEST_POOL_ENV", "second")
    monkeypatch.syspath_prepend("/autopar-test-path")
    pool = DistPool(2)
    try:
        second = pool.run(_where)
    finally:
        pool.close()
    assert first["server"] and second["server"], (first, second)  # imported by the server, not the worker
    assert first["parent"] == second["parent"] != os.getpid()  # both forked by the one server
    assert (first["env"], second["env"]) == ("first", "second")
    assert (first["path"], second["path"]) == ([], ["/autopar-test-path"])


def _raises():
    raise ValueError("injected: this job fails on every rank")


def _seven():
    return 7


def test_a_failed_job_does_not_fail_the_next_test(pools):
    """A job that raises closes its pool (its processes may hold a broken process group); the
    fixture gives the next user a new one, so one failure stays one (it used to fail every later
    test of that size with "worker rank(s) died")."""
    with pytest.raises(RuntimeError, match="injected: this job fails"):
        pools(2).run(_raises)
    assert pools(2).run(_seven) == 7
