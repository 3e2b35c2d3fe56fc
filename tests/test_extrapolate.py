"""``autopar plan`` extrapolated in depth (autopar/tools/extrapolate.py) against every block compiled.

- fsdp x megatron on an 8-block Llama: bytes, calls, FLOPs, parameters and every memory figure
  equal the full compile's exactly, times within 1%;
- the identity check fails on blocks that are not identical, naming the figure;
- a pipeline plan and a shallow model are compiled whole (no extrapolation).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from autopar.tools.explain import plan_main
from autopar.tools.extrapolate import extrapolate


def _plan_json(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(["-q", "--json", *argv]) == 0
    return json.loads(out.getvalue())[0]


def _close(got, want, rel: float, path: str = ""):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            _close(got[k], want[k], rel, f"{path}.{k}")
    elif isinstance(want, (int, float)) and not isinstance(want, bool):
        assert got == pytest.approx(want, rel=rel, abs=1e-9), path
    else:
        assert got == want, path


@pytest.mark.slow  # (14 s; test_depth's CI cases make the same check on Hugging Face models)
def test_extrapolated_plan_equals_every_block_compiled(monkeypatch):
    """(Depth 4 compiled in a forked process, as on the command line: the test runner's
    threads would otherwise keep them in this one.)"""
    argv = ["llama-tiny", "--mesh", "dp=2,tp=2", "--plan", "dp=fsdp,tp=megatron", "--set", "n_layers=8",
            "--batch", "4", "--seq", "32"]
    monkeypatch.setenv("AUTOPAR_PLAN_FORK", "always")
    fast, full = _plan_json(*argv), _plan_json(*argv, "--full-depth")
    assert fast["extrapolated"] == {"depths": [3, 4, 5], "layers": 8, "blocks": "layers", "forked": [4], "period": 1,
                                    "forked_after": "localize",
                                    "localized": {"3": ["recorded"], "4": ["spliced"], "5": ["spliced"]}}
    assert "extrapolated" not in full
    for key in ("parameters", "comm_bytes", "comm_calls", "flops"):
        assert fast[key] == full[key], key
    full["memory"].pop("peak_node")
    assert fast["memory"] == full["memory"]
    _close({k: v for k, v in fast["time"].items() if k != "stage_seconds"},
           {k: v for k, v in full["time"].items() if k != "stage_seconds"}, 1e-2, "time")


def test_blocks_that_differ_are_not_extrapolated():
    same = [{"bytes": 10 + 5 * d, "time": {"step_s": 1.0 + 0.5 * d}} for d in (3, 4, 5)]
    out, bad = extrapolate(same, 10)
    assert bad == [] and out == {"bytes": 60, "time": {"step_s": 6.0}}
    grown = [dict(s) for s in same]
    grown[2] = {"bytes": 36, "time": {"step_s": 3.5}}  # the fifth block adds 6 bytes, the fourth 5
    out, bad = extrapolate(grown, 10)
    assert bad == ["bytes: increments 5 then 6"]
    extra = [dict(s) for s in same]
    extra[2] = {**extra[2], "all_gather@dp": 1}
    assert "appear at some depths only" in extrapolate(extra, 10)[1][0]


def test_pipelines_and_shallow_models_compile_every_block():
    pipe = _plan_json("llama-tiny", "--mesh", "pp=2", "--plan", "pp=1f1b", "--set", "n_layers=6")
    shallow = _plan_json("llama-tiny", "--mesh", "dp=2", "--plan", "dp=ddp")
    assert "extrapolated" not in pipe and "extrapolated" not in shallow


def test_the_peak_moves_to_the_point_that_grows_fastest():
    """liveness.peak_in_depth: at 3-5 blocks the gradients' end of the program holds the peak, at
    32 the forward's end does (it grows 10x faster per block): each point on its own line."""
    from autopar.analysis.liveness import ProgramMemory, peak_in_depth

    def mem(d):
        fwd = {"activations": 100 + 130 * d, "param_copies": 8, "grads_in_flight": 0}
        bwd = {"activations": 4, "param_copies": 0, "grads_in_flight": 2000 + 13 * d}
        return ProgramMemory(peak=2004 + 13 * d, at_peak=bwd, max_by={k: max(fwd[k], bwd[k]) for k in fwd},
                             branches={"peak": bwd, "activations": fwd, "gradients": bwd})

    got = peak_in_depth([mem(3), mem(4), mem(5)], (3, 4, 5), 32)
    assert got["at_peak"] == {"activations": 100 + 130 * 32, "param_copies": 8, "grads_in_flight": 0}
    assert got["max_by"]["grads_in_flight"] == 2000 + 13 * 32
    # a single line through the peaks would have said 2004 + 13 * 32 = 2420 bytes, not 4268


def test_a_forked_depth_that_fails_is_compiled_here(monkeypatch, capsys):
    """Depth 3 is forked after its localize (autopar/forked.py ``Continued``): the child finishes it
    and compiles depth 4. A child that fails sends its error; this process then compiles depths 3
    and 4 itself, says so, and reports the same figures as with no fork at all."""
    import os

    from autopar.tools import extrapolate as ex

    argv = ["llama-tiny", "--mesh", "dp=2,tp=2", "--plan", "dp=fsdp,tp=megatron", "--set", "n_layers=6",
            "--batch", "4", "--seq", "32"]
    monkeypatch.setenv("AUTOPAR_PLAN_FORK", "0")
    alone = _plan_json(*argv)
    here, figures = os.getpid(), ex._figures

    def failing_in_the_child(a):
        if os.getpid() != here:
            raise RuntimeError("a failure in the child")
        return figures(a)

    monkeypatch.setattr(ex, "_figures", failing_in_the_child)
    monkeypatch.setenv("AUTOPAR_PLAN_FORK", "always")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(["--json", *argv]) == 0
    got = json.loads(out.getvalue())[0]
    why = "depths [3, 4] in a forked process failed (RuntimeError: a failure in the child)"
    assert why in capsys.readouterr().err
    assert got["extrapolated"]["forked"] == [] and "forked_after" not in got["extrapolated"]
    assert got["extrapolated"]["fork_failed"] == why and f"{why}: compiled in this process instead" in got["notes"]
    for key in ("parameters", "comm_bytes", "comm_calls", "flops", "memory"):
        assert got[key] == alone[key], key


def test_a_forked_child_traces_a_joint_graph_after_this_process_traced_one(tmp_path):
    """Autograd's engine starts its device threads at a process's first backward, and a forked
    child of a process with those threads can run no backward. On a CUDA build of torch with no GPU
    (PyPI's Linux wheel; torch 2.11 here) fake tensor mode puts a stand-in CUDA guard in place that
    counts devices: where AOTAutograd's fake joint trace was the first backward, every forked child
    that traced a joint graph failed and was redone in the parent (a period-2 model's depths, the
    search's confirmations). ``forked.settle_autograd`` runs a CPU backward first. In a fresh
    process, as the command line: a plan, then a forked child that traces another model's joint
    graph. (On 2.13's CPU build no device is counted and this cannot fail; on 2.11's it failed.)"""
    import os
    import subprocess
    import sys

    code = (
        "from autopar import forked\n"
        "from autopar.tools.explain import plan_main\n"
        "argv = ['-q', 'llama-tiny', '--mesh', 'dp=2', '--plan', 'dp=fsdp', '--full-depth', '--set']\n"
        "assert plan_main([*argv, 'n_layers=2']) == 0\n"
        "print('CHILD', forked.Forked(lambda: plan_main([*argv, 'n_layers=3'])).result())\n")
    env = dict(os.environ, AUTOPAR_CACHE_DIR=str(tmp_path), AUTOPAR_PLAN_FORK="always")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "CHILD 0" in run.stdout, run.stderr[-2000:]


def test_settling_autograd_waits_outside_inference_mode(monkeypatch):
    """No backward runs under ``torch.inference_mode`` (a compile called inside one): the settling
    backward is left to the next trace, not raised."""
    import torch

    from autopar import forked

    monkeypatch.setattr(forked, "_SETTLED", False)
    with torch.inference_mode():
        forked.settle_autograd()
    assert forked._SETTLED is False
    with torch.no_grad():
        forked.settle_autograd()
    assert forked._SETTLED is True
