"""localize's trace: autopar's recorder (autopar/record.py) against make_fx, in one process.

    python benchmarks/localize_record.py [--rounds 3] [--table]

Each case is compiled on a fake mesh up to localize, the two tracers alternating round by round
(the capture, joint graph and propagation come from the process's capture cache after the first
compile: the localize pass is what differs). Prints each case's localize seconds per round, the
medians and their ratio, and whether the two per-rank programs are the same (node for node, as
tests/test_record.py compares them). ``--table``: the recorder against itself without its table of
the functional collectives' outputs (record.py ``_SEEN``: each collective and wait through its
fake kernel), in place of make_fx.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from autopar import record
from autopar.compiler import build
from autopar.mesh import fake_mesh
from autopar.options import CompileOptions
from autopar.testing import build_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_record import nodes  # noqa: E402  (the test's comparison: names, values, aliasing, metadata)

CASES = [
    ("hf_llama", {"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "megatron"}, 3),
    ("llama", {"dp": 2, "tp": 2}, {"dp": "zero2", "tp": "sequence"}, 1),
    ("llama", {"dp": 2, "cp": 2}, {"dp": "fsdp", "cp": "context"}, 3),
    ("llama", {"cp": 2}, {"cp": "ulysses"}, 0),
    ("moe_dropless", {"dp": 2, "ep": 2}, {"dp": "fsdp", "ep": "expert"}, 3),
    ("llama_deep", {"dp": 2}, {"dp": "fsdp"}, 1),
]


def localize_once(name, axes, plan, rank, recorded: bool, table: bool = False) -> tuple[float, list]:
    real = record.available
    record.available = lambda: (recorded or table) and real()
    cls = record._recorder_class()
    kept = cls._run
    if table and not recorded:  # (the recorder, every collective through its fake kernel)
        cls._run = lambda self, func, args, kwargs: func(*args, **kwargs)
    try:
        model, batches, loss_fn = build_model(name)
        with fake_mesh(axes, rank) as mesh:
            state = build(model, mesh, CompileOptions(plan=plan, example_inputs=batches[0], loss_fn=loss_fn,
                                                      capture_eval=False), stop_after="localize")
    finally:
        record.available = real
        cls._run = kept
    return state.timings["localize"], [nodes(st.program.local) for st in state.stages]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--table", action="store_true", help="the recorder with and without its table of collectives")
    args = ap.parse_args()
    print(f"torch {torch.__version__}; recorder available: {record.available()}")
    for case in CASES:
        localize_once(*case, True)  # (the capture cache and DTensor's caches warm for both)
        times: dict[bool, list[float]] = {True: [], False: []}
        programs = {}
        for _ in range(args.rounds):
            for recorded in (False, True):
                t, programs[recorded] = localize_once(*case, recorded, args.table)
                times[recorded].append(t)
        mf, rec = statistics.median(times[False]), statistics.median(times[True])
        name, axes, plan, _ = case
        label = f"{name} {'x'.join(f'{a}={n}' for a, n in axes.items())} {'+'.join(plan.values())}"
        base = "no table" if args.table else "make_fx"
        print(f"{label:40s} {base} {' '.join(f'{t:.3f}' for t in times[False])} | recorder "
              f"{' '.join(f'{t:.3f}' for t in times[True])} | medians {mf:.3f} / {rec:.3f} s = {rec / mf:.2f}x | "
              f"same program: {programs[True] == programs[False]} ({sum(map(len, programs[True]))} nodes)")


if __name__ == "__main__":
    main()
