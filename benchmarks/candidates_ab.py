"""Each kind of launch candidate against the pointer-based ones, from the tuner's own timings.

    python3 benchmarks/candidates_ab.py benchmarks/results/kernels-2026-11-28-h200-2-93c741e.json [...]

``autopar bench --kernels`` writes, under ``meta.launch_configurations``, every shape class the
tuner met and each candidate's median milliseconds there (kernels/tune.py). For each kernel and
each candidate kind named in a configuration (``TMA``, ``PIPE``, ``WS``, ``PERSISTENT``...), this
prints the fastest candidate of that kind divided by the fastest candidate without it, over the
shape classes: below 1, that kind beat everything else the tuner had there.
"""

from __future__ import annotations

import argparse
import collections
import json

KINDS = ("TMA", "PIPE", "WS", "PERSISTENT", "EPI_SPLIT")


def ratios(record: dict) -> dict:
    """(kernel, kind) -> per shape class, the kind's best time over the best time of the rest."""
    out = collections.defaultdict(list)
    for entry in record["meta"]["launch_configurations"]:
        timed = {name: ms for name, ms in entry["ms"].items() if isinstance(ms, float)}
        for kind in KINDS:
            mine = [ms for name, ms in timed.items() if f"{kind}=" in name]
            rest = [ms for name, ms in timed.items() if f"{kind}=" not in name]
            if mine and rest:
                out[(entry["kernel"], kind)].append(min(mine) / min(rest))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="kernels-DATE.json files written by autopar bench --kernels")
    args = ap.parse_args(argv)
    for path in args.files:
        with open(path) as f:
            found = ratios(json.load(f))
        print(path)
        for (kernel, kind), rs in sorted(found.items()):
            rs = sorted(rs)
            print(f"  {kernel} {kind}: {len(rs)} shape classes, best {kind} / best other {rs[0]:.3f}-{rs[-1]:.3f}, "
                  f"median {rs[len(rs) // 2]:.3f}, faster in {sum(r < 1 for r in rs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
