"""The user contract: decorator form, global vs local batches, state_dict, AdamW on the parameters."""

from __future__ import annotations

from autopar.testing import api_job


def test_user_contract_on_two_ranks(pools):
    out = pools(2).run(api_job)
    assert out["decorated_type"] == "ParallelModule"
    assert "embed_tokens.weight" in out["state_dict_keys"]
    assert out["param_types"] == ["Parameter"]  # ddp: every parameter replicated, stored plain
    assert out["state_types"] == ["Tensor"]
    # a local batch on a program compiled for local batches gives the same loss as the global one
    assert abs(out["loss_global"] - out["loss_local"]) < 1e-6
    # and the wrong kind of batch is a clear error that says which flag to use
    assert "inputs='local'" in out["errors"]["global"]
    assert "inputs='global'" in out["errors"]["local"]


def test_verify_is_a_user_facing_check(pools):
    from autopar.testing import verify_job

    report, text = pools(2).run(verify_job, {"tp": "megatron"}, {"tp": 2})
    assert report.ok, text
    assert len(report.max_grad_diff) == 3 and text.startswith("autopar.verify: OK")
    assert 0 < max(report.max_grad_diff) < 1e-4  # real figures, not zeros: the runs did differ in order


def test_verify_in_mixed_precision(pools):
    """verify compares against eager in the same precision; dynamic fp16 skips are mirrored."""
    from autopar.testing import verify_job

    report, text = pools(2).run(verify_job, {"dp": "zero3"}, {"dp": 2}, precision="bf16", recompute="full")
    assert report.ok, text
    assert 0 < max(report.max_grad_diff) < 5e-2
    report, text = pools(2).run(verify_job, {"dp": "zero2"}, {"dp": 2}, precision="fp16")
    assert report.ok, text
    # Megatron: the embedding's bf16 gradient is vocab-parallel through its cast to fp32
    report, text = pools(2).run(verify_job, {"tp": "megatron"}, {"tp": 2}, precision="bf16")
    assert report.ok, text
