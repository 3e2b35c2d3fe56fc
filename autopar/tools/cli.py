"""autopar: the command line.

    autopar dump MODEL ...     the partitioned per-rank program (text, json, dot, svg)
    autopar plan MODEL ...     per-rank memory, communication, FLOPs and predicted step time
    autopar explain MODEL ...  the plan, and why: rules, collectives' source lines, the memory peak
    autopar calibrate ...      measure this machine for the cost model's device table
    autopar bench ...          the benchmark harness (autopar vs PyTorch-native parallelism)
    autopar demo ...           compile the built-in Llama on a CPU mesh, train, print what happened

``autopar <command> --help`` describes each. Exit codes: 0 success, 1 the model could not be
compiled under the plan, 2 bad usage (model spec, mesh, plan, option).
"""

from __future__ import annotations

import gc
import os
import sys

COMMANDS = {
    "dump": ("autopar.tools.explain", "dump_main", "the partitioned per-rank program: placements, collectives, source lines"),
    "plan": ("autopar.tools.explain", "plan_main", "per-rank memory, bytes per collective and axis, FLOPs, predicted time"),
    "explain": ("autopar.tools.explain", "explain_main", "the plan, and why each placement, collective and peak byte is there"),
    "calibrate": ("autopar.tools.calibrate", "main", "measure this machine (matmul, memory, gloo) for the device table"),
    "bench": ("autopar.tools.bench", "main", "autopar against PyTorch-native parallelism, same run, alternating"),
    "demo": ("autopar.tools.demo", "main", "compile the built-in Llama on a CPU mesh, train, print what it did"),
}


# commands that leave by os._exit when run as the console script (not when main() is called with
# arguments, as the tests do)
_QUICK_EXIT = ("dump", "plan", "explain")


def main(argv=None) -> int:
    argv_given = argv
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0] + "\n\ncommands:")
        for name, (_, _, what) in COMMANDS.items():
            print(f"  {name:10s} {what}")
        print("\nautopar <command> --help for each; exit codes: 0 ok, 1 cannot compile, 2 bad usage")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"autopar: unknown command {cmd!r} (commands: {', '.join(COMMANDS)}; autopar --help)", file=sys.stderr)
        return 2
    import importlib

    module, fn, _ = COMMANDS[cmd]
    console = argv_given is None
    if console and cmd in _QUICK_EXIT:
        # no cyclic collection from here to the exit (autopar.scoped.paused_collector pauses it for
        # the compiles alone where main() is called in a longer-lived process): importing torch,
        # dynamo and autopar makes objects by the million, and the collector's passes over them
        # took 0.4 s of those imports' 1.7 s
        gc.disable()
    sys.argv = [f"autopar {cmd}"] + rest
    quick = console and cmd in _QUICK_EXIT
    entry = getattr(importlib.import_module(module), fn)
    if quick:  # the trace cache written after the output, behind the command (autopar/disk_cache.py)
        from autopar import disk_cache

        disk_cache.write_behind()
    try:
        rc = entry(rest)
    except SystemExit as e:  # argparse --help / usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        if quick:
            _flush()
            disk_cache.finish_behind()
    rc = rc if isinstance(rc, int) else 0
    if quick:
        # the analysis commands leave at once: tearing down the interpreter (freeing every traced
        # graph and fake tensor, torch's exit handlers) took 0.6-0.7 s of a 6.7 s `autopar plan`
        # of Llama-3-8B. What they print is flushed; a file written with -o is closed already;
        # a forked child of theirs is waited for, or killed; only the trace cache's writer (above)
        # outlives them, detached from their output.
        os._exit(rc)
    return rc


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # `autopar dump ... | head`: the reader has gone
            pass


if __name__ == "__main__":
    sys.exit(main())
