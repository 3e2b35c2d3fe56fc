"""Simulated pipeline schedules against theory, and their Gantt charts.

    .venv/bin/python benchmarks/schedules_report.py [--out benchmarks/results]

F=1, B=2 time units (I=W=1 for ZB-H1), no transfer cost. Prints a markdown table (bubble
simulated vs theory, peak activations in flight per rank) and writes a PNG Gantt chart.
"""

from __future__ import annotations

import argparse
import os

from autopar.analysis import schedules as S


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    print("| schedule | P | M | v | bubble simulated | theory | idle time / 1F1B's | peak activations in flight (per rank) |")
    print("|---|---|---|---|---|---|---|---|")
    for p, m in [(4, 8), (4, 16), (8, 16), (8, 64)]:
        base = S.simulate(S.one_f_one_b(p, m))
        base_idle = p * base.makespan - sum(base.busy)
        for name, make, v in [("gpipe", S.gpipe, 1), ("1f1b", S.one_f_one_b, 1),
                              ("interleaved", lambda p, m: S.interleaved(p, m, 2), 2),
                              ("interleaved", lambda p, m: S.interleaved(p, m, 4), 4), ("zb", S.zb_h1, 1)]:
            sched = make(p, m)
            S.validate(sched)
            tl = S.simulate(sched)
            idle = p * tl.makespan - sum(tl.busy)
            peak = tl.peak_in_flight if v == 1 else [round(x / v, 2) for x in tl.peak_in_flight]
            print(f"| {sched.name} | {p} | {m} | {v} | {tl.bubble:.4f} | {S.theory_bubble(name, p, m, v):.4f} | "
                  f"{idle / base_idle:.3f} | {peak} |")
    os.makedirs(args.out, exist_ok=True)
    path = S.gantt({n: (s, S.simulate(s)) for n, s in [("GPipe", S.gpipe(4, 8)), ("1F1B", S.one_f_one_b(4, 8)),
                                                       ("interleaved 1F1B", S.interleaved(4, 8, 2)),
                                                       ("ZB-H1", S.zb_h1(4, 8))]},
                   os.path.join(args.out, "schedules-gantt.png"))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
