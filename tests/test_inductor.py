"""Compiled per-rank programs (``autopar.compile(..., inductor=True)``, autopar/runtime/inductor.py).

- parity on 2 gloo ranks (ddp, fsdp) through test_parity's machinery: losses, gradients and
  parameters of 3 AdamW steps within test_parity's tolerances, the bytes the process group was
  handed equal to the prediction, collective by collective, and as many calls of each as the
  uncompiled program makes (the compilation moved, merged or dropped none);
- the stitched program's structure (fake mesh, no process group runs): every collective, wait
  and bucket ``cat`` in the same order as in the uncompiled program, no ATen compute left outside
  the compiled segments, and the repeated block's segments shared: a model twice as deep
  compiles no more distinct segments.
"""

from __future__ import annotations

import collections

import pytest
import torch
from test_parity import run_and_check_parity

from autopar.runtime.inductor import _VIEWS, _Segment, opaque

pytestmark = pytest.mark.filterwarnings("ignore")


# ddp is a slow confirmation (./run.sh test -m slow; 30 s in a slow hour): fsdp, which CI runs, goes through the
# same segments, compiles and timings, with the collectives inside the step that ddp has only at its end
@pytest.mark.parametrize("plan", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_inductor_parity(pools, references, plan):
    out = run_and_check_parity(pools, references, "llama", {"dp": 2}, {"dp": plan}, evaluate=False, inductor=True)
    stats = out["inductor"]
    assert stats is not None and stats.segments >= 4 and stats.distinct >= 4, stats
    assert out["timings"]["inductor"] > 0  # compiled in autopar.compile, not in the first step
    calls = collections.Counter()
    for r in out["records"]:
        calls[f"{r.kind}@{r.axis}"] += out["steps"]
    assert {k: v["calls"] for k, v in out["measured"].items()} == dict(calls)


def _structure(gm):
    """The Python calls a program makes that are not compute (in order), and the compute ops."""
    kept = [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and opaque(n) and not isinstance(n.target, _Segment)
            and getattr(n.target, "__name__", "") != "_pack"]
    compute = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and not opaque(n)
               and n.target not in _VIEWS]
    return kept, compute


def _compile(fake, layers: int):
    import autopar
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy
    from autopar.testing import build_model

    _, batches, _ = build_model("llama")
    with fake(0, dp=2) as mesh:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(n_layers=layers))
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=cross_entropy, plan={"dp": "fsdp"},
                             capture_eval=False, inductor=True)
        return pm, pm.executor.compiled(pm.program.local)


def test_segments_keep_the_schedule(fake):
    pm, stitched = _compile(fake, 2)
    original = pm.program.local
    kept, compute = _structure(stitched)
    kept0, compute0 = _structure(original)
    assert compute == [], compute  # every ATen compute op runs inside a compiled segment
    assert compute0  # (the check above can fail: the uncompiled program has them)
    # the Python calls left are the program's own collectives, waits and bucket cats, in its order
    wanted = [t for t in kept0 if "c10d" in t or t == "aten.cat.default"]
    assert [t for t in kept if "c10d" in t or t == "aten.cat.default"] == wanted
    assert sum("all_gather" in t for t in wanted) >= 2 and sum("wait_tensor" in t for t in wanted) >= 4
    segments = sum(isinstance(n.target, _Segment) for n in stitched.graph.nodes)
    assert segments == pm.inductor.segments >= 4
    # twice as deep: more segments, but the repeated block's are the same compiled code
    deep, _ = _compile(fake, 4)
    assert deep.inductor.segments > segments
    assert deep.inductor.distinct <= pm.inductor.distinct + 2, (deep.inductor, pm.inductor)


def test_a_segment_inductor_fails_on_runs_uncompiled(fake, monkeypatch):
    from autopar.runtime import inductor

    pm, _ = _compile(fake, 2)

    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(inductor, "_compile", fail)
    stats = inductor.InductorStats()
    with pytest.warns(UserWarning, match="runs uncompiled: Inductor failed on it"):
        gm = inductor.compile_program(pm.program.local, torch.device("cpu"), stats)
    assert stats.segments == 0 and sum(stats.skipped.values()) >= 4, stats
    assert "no C++ compiler" in stats.line()
    # op by op: the same nodes as the program, in the same order
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == [str(n.target) for n in pm.program.local.graph.nodes if n.op == "call_function"]
