"""Where a profiled run's CPU went, by compile stage: reads a ``py-spy record -f raw`` file.

    py-spy record -r 25 --subprocesses -f raw -o suite.txt -- .venv/bin/python -m pytest ...
    python benchmarks/profile_categories.py suite.txt

Each sample counts for the first category whose frame is on its stack (the order below: an
import inside a capture counts as an import, a capture inside the harness as a capture), then by
process kind (pool processes, forked from ``autopar.poolserver``'s fork server; the others).
Shares of samples, not seconds: a sampler that falls behind drops samples evenly enough for shares.
"""

from __future__ import annotations

import collections
import sys

CATEGORIES = [
    ("imports", ["_find_and_load"]),
    ("inductor", ["torch/_inductor/"]),
    ("dynamo capture", ["fullgraph_capture", "_dynamo/convert_frame"]),
    ("joint graph", ["joint_program", "autograd_pass"]),
    ("localize", ["localize_pass", "trace_local"]),
    ("propagate", ["propagate_pass"]),
    ("schedule", ["schedule_pass"]),
    ("other passes", ["run_pipeline"]),
    ("eval export", ["capture_forward ("]),  # (at compile before 78e095a; at the first pm(x) since)
    ("training steps", ["train_step", "executor.py"]),
    ("test harness", ["testing.py"]),
    ("planner", ["autopar/planner/"]),
    ("cost model", ["autopar/analysis/"]),
]


def main(path: str) -> None:
    by_cat, by_proc = collections.Counter(), collections.Counter()
    for line in open(path, errors="replace"):
        stack, _, n = line.rstrip().rpartition(" ")
        try:
            count = int(n)
        except ValueError:
            continue
        cat = next((name for name, marks in CATEGORIES if any(m in stack for m in marks)), "other")
        pool = "forkserver" in stack
        by_cat[cat] += count
        by_proc[(("pool" if pool else "other processes"), cat)] += count
    total = sum(by_cat.values())
    print(f"{total} samples")
    for cat, n in by_cat.most_common():
        print(f"{100 * n / total:5.1f}%  {cat}")
    print()
    for (proc, cat), n in sorted(by_proc.items(), key=lambda kv: -kv[1])[:20]:
        print(f"{100 * n / total:5.1f}%  {proc}: {cat}")


if __name__ == "__main__":
    main(sys.argv[1])
