"""Ops nobody wrote a sharding rule for (issue 35, item 6): autopar derives one by running the op
whole and in chunks on random inputs (autopar/derived_rules.py), or gathers its inputs whole where
no split of them gives its result, and says which; either way the run matches one process."""

from __future__ import annotations

import pytest
import torch

from autopar.models import unruled


def _close(out, ref):
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    for got, want in zip(out["grads"], ref["grads"]):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_a_row_wise_op_without_a_rule_runs_batch_parallel(pools, plan):
    """The gate op and its backward: tokens split over dp arrive split, and the derivation finds
    that the op runs on each rank's rows (output split the same way) and that its weight gradient
    is a partial sum (reduced like any other); no gather of the activations."""
    out = pools(2).run(unruled.job, {"dp": 2}, {"dp": plan}, False)
    _close(out, unruled.reference(False))
    derived = "\n".join(out["derived"])
    assert "demo_unruled.gate.default: on dp: inputs S(0), R -> outputs S(0) (checked by running it" in derived
    assert "demo_unruled.gate_backward.default: on dp: inputs S(0), S(0), R -> outputs S(0), P(sum)" in derived
    assert "no rule, derived: demo_unruled.gate.default" in out["report"]


def test_an_op_no_split_computes_gathers_its_inputs_and_says_so(pools):
    """center(x) = x - mean over the batch: chunk-wise results are not the whole, so its input
    is gathered whole on dp and the op runs replicated; the run still matches one process."""
    out = pools(2).run(unruled.job, {"dp": 2}, {"dp": "ddp"}, True)
    _close(out, unruled.reference(True))
    assert any(line.startswith("demo_unruled.center.default: on dp: inputs gathered whole, the op replicated "
                               "(its chunk-wise results do not make up the whole)") for line in out["derived"]), \
        out["derived"]


def test_what_cannot_be_checked_is_replicated_with_the_reason(monkeypatch):
    """Inputs past the size limit are not run: the op is replicated, and the reason names the limit."""
    import autopar
    from autopar import derived_rules
    from autopar.mesh import fake_mesh

    monkeypatch.setattr(derived_rules, "MAX_ELEMENTS", 16)
    monkeypatch.setattr(derived_rules, "_CACHE", {})
    model, batches, loss_fn = unruled.build()
    with fake_mesh({"dp": 2}, 0) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                             capture_eval=False)
    assert any("inputs larger than 16 elements are not run to check it" in line for line in pm.ctx.derived_rules)
