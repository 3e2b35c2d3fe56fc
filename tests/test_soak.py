"""A short soak (benchmarks/soak.py runs 1,000 steps): open file descriptors and threads stay
flat over 60 steps with checkpoints, under FSDP and a 1F1B pipeline."""

from __future__ import annotations

import pytest

from autopar.soak import soak_job, verdict


@pytest.mark.parametrize("plan", ["fsdp", "1f1b"])
def test_fds_and_threads_do_not_grow(pools, tmp_path, plan):
    res = pools(2).run(soak_job, plan, 60, [10, 30, 60], n_layers=2, ckpt=str(tmp_path), ckpt_every=20)
    assert verdict(res, warmup=10, rss_growth=1.0) == []  # (resident memory: benchmarks/soak.py, 1,000 steps)
    for rank in res["ranks"]:
        assert sorted(rank["samples"]) == [0, 10, 30, 60]
