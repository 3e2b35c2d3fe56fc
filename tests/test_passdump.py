"""``autopar dump --passes`` and ``--after PASS``: the pass list, and the program after any pass."""

from __future__ import annotations

from autopar.tools.cli import main as cli


def run(capsys, *argv):
    rc = cli(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_dump_passes_lists_every_pass_in_order(capsys):
    from autopar.passes import PASSES

    rc, out, _ = run(capsys, "dump", "--passes")
    assert rc == 0
    listed = [line.split()[1] for line in out.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    assert listed == [p.name for p in PASSES]
    # each pass's declarations (passes/checks.py), the debug-only checks starred, and every check explained
    lines = out.splitlines()
    for p in PASSES:
        at = next(i for i, line in enumerate(lines) if line[4:].startswith(p.name + " "))
        assert lines[at + 1].split("requires:")[1].strip() == (", ".join(p.requires) or
                                                              "(nothing: it starts from the model)")
        assert lines[at + 2].split("guarantees:")[1].replace("*", "").strip() == ", ".join(p.guarantees)
    from autopar.passes.checks import CHECKS

    for c in CHECKS.values():
        star = "" if c.cheap else "*"
        assert any(line.split()[:2] == [c.name + star, f"[{c.on}]"] and line.endswith(c.says) for line in lines), c.name
    assert "local-shapes*" in out and "guarantees: roles, graph, lint*, no-dangling, specs, wants, placements" in out


def test_dump_after_shows_the_program_at_that_point(capsys):
    common = ("llama-tiny", "--mesh", "dp=2,tp=2", "--plan", "dp=fsdp,tp=megatron", "-q")
    rc, out, _ = run(capsys, "dump", *common, "--after", "collectives")
    assert rc == 0 and "after pass 'collectives'" in out and "GLOBAL shapes" in out
    assert "redistribute" in out and "LOCAL shapes" not in out
    rc, out, _ = run(capsys, "dump", *common, "--after", "overlap")
    assert rc == 0 and "after pass 'overlap'" in out and "per-rank program, LOCAL shapes" in out
    assert "[all_gather on dp" in out and "[all_reduce on tp" in out and "redistribute" not in out
    rc, out, _ = run(capsys, "dump", "llama-tiny", "--mesh", "pp=2,dp=2", "--plan", "pp=1f1b,dp=fsdp", "-q",
                     "--after", "split")
    assert rc == 0 and "stage 0 (" in out and "stage 1 (" in out and "torch-level graph" in out
    rc, _, err = run(capsys, "dump", *common, "--after", "overlapp")
    assert rc == 2 and "unknown pass" in err
