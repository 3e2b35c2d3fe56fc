"""A pytest plugin that writes each failing test's report to a file the moment it arrives
(``AUTOPAR_FAILURES_LOG``), so that a run cut short by a time limit still says why each test failed:
pytest prints tracebacks only at the end, and under xdist the per-test lines carry no reason.

    AUTOPAR_FAILURES_LOG=$OUT/failures.txt python3 -m pytest -p benchmarks.failures_log ...

(benchmarks/gpu_suite.sh loads it: the GPU machine's time is short and its last call may be cut.)
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("AUTOPAR_FAILURES_LOG")
    if not path or not report.failed:
        return
    with open(path, "a") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n")
