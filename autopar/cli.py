"""autopar: the command line.

    autopar bench ...      the benchmark harness (autopar vs PyTorch-native parallelism)
    autopar demo ...       the demo (compile, train a few steps on a CPU mesh, print what happened)

``autopar <command> --help`` describes each. Exit codes: 0 success, 2 bad usage.
"""

from __future__ import annotations

import sys

COMMANDS = {
    "bench": ("autopar.bench", "autopar against PyTorch-native parallelism, same run, alternating"),
    "demo": ("autopar.demo", "compile the built-in Llama on a CPU mesh, train, print what it did"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0] + "\n\ncommands:")
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:8s} {what}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"autopar: unknown command {cmd!r} (commands: {', '.join(COMMANDS)}; autopar --help)", file=sys.stderr)
        return 2
    import importlib

    mod = importlib.import_module(COMMANDS[cmd][0])
    sys.argv = [f"autopar {cmd}"] + rest
    mod.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
