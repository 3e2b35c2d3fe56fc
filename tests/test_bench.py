"""The benchmark harness's instruments: the collective meter agrees with autopar's own byte
counter and with DDP's analytic volume; the harness runs a pair end to end and writes its
report."""

from __future__ import annotations

import json

import pytest
import torch


def meter_job():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import autopar
    from autopar.tools.bench import CommMeter
    from autopar.testing import build_model

    model, batches, loss_fn = build_model("llama")
    pm = autopar.compile(model, autopar.mesh(dp=2), example_inputs=batches[0], loss_fn=loss_fn,
                         plan={"dp": "zero3"})
    pm.counter.reset()
    with CommMeter() as m:
        pm.train_step(*batches[0])
    ours = {k.split("@")[0]: v for k, v in pm.predicted_bytes().items()}  # (the meter is pm.counter's)
    model, batches, loss_fn = build_model("llama")
    psi = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, broadcast_buffers=False)
    x, y = batches[0]
    r = dist.get_rank()
    with CommMeter() as d:
        loss_fn(ddp(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]).backward()
    return dict(m.bytes), ours, dict(d.bytes), psi


def test_comm_meter_agrees_with_autopar_and_ddp(pools):
    meter, ours, ddp, psi = pools(2).run(meter_job)
    assert meter == pytest.approx(ours)  # the meter sees exactly what autopar predicts
    assert ddp == pytest.approx({"all_reduce": 2 * (2 - 1) / 2 * 4 * psi})  # DDP: one bucketed all-reduce


def test_harness_runs_a_pair(pools, tmp_path):
    from autopar.tools.bench import markdown, pair_job, summarize

    r = pools(2).run(pair_job, "ddp", 2, 1, 4, 32)
    rows = summarize([r], 4, 32)
    row = rows[0]
    assert len(row["autopar"]["losses"]) == 3 and row["max_loss_diff"] < 1e-4  # same model, same data
    assert row["autopar"]["comm_bytes"] == pytest.approx(row["baseline"]["comm_bytes"], rel=1e-3)
    assert row["autopar"]["peak_bytes"] > 0 and row["baseline"]["peak_bytes"] > 0
    assert row["autopar"]["persistent_bytes"] == row["baseline"]["persistent_bytes"]  # 16 B/param both
    md = markdown(rows, {"date": "d", "machine": "m", "device": "cpu", "torch": torch.__version__, "model": "x",
                         "batch": 4, "seq": 32, "steps": 2, "warmup": 1})
    assert "| ddp | dp=2 | DistributedDataParallel |" in md
    json.dumps(rows, default=str)
