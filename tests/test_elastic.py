"""Elastic restart under torchrun (examples/train_elastic.py): a worker SIGKILLed mid-run, torchrun
restarts every worker, they resume from the latest complete checkpoint, and the losses are an
uninterrupted run's bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from autopar.testing import _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = re.compile(r"^step (\d+): loss \S+ \((\S+)\)$", re.MULTILINE)


def _torchrun(ckpt, kill_at=None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.pop("AUTOPAR_EXAMPLE_KILL_AT_STEP", None)
    if kill_at is not None:
        env["AUTOPAR_EXAMPLE_KILL_AT_STEP"] = str(kill_at)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
           os.path.join(ROOT, "examples", "train_elastic.py"), "--ckpt", str(ckpt), "--steps", "10", "--every", "3"]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_killed_worker_restarts_and_resumes_exactly(tmp_path):
    # both jobs at once (each compiles; this machine has 2 cores)
    runs = {"uninterrupted": _torchrun(tmp_path / "a"), "killed": _torchrun(tmp_path / "b", kill_at=7)}
    logs = {}
    for name, p in runs.items():
        try:
            logs[name] = p.communicate(timeout=400)[0]
        finally:
            p.kill()
        assert p.returncode == 0, f"{name} run failed:\n{logs[name][-4000:]}"
    ref = dict(STEP.findall(logs["uninterrupted"]))
    assert sorted(map(int, ref)) == list(range(10)) and "resumed" not in logs["uninterrupted"]
    log = logs["killed"]
    assert "rank 1: SIGKILL at step 7" in log
    assert re.search(r"resumed from \S+step-000006 at batch 6 \(this node's restart count 1;", log), log[-3000:]
    first, _, second = log.partition("resumed from")
    before, after = dict(STEP.findall(first)), dict(STEP.findall(second))
    # step 6 ran on both ranks before rank 1 killed itself at step 7, but whether rank 0 printed it
    # before torchrun stopped it depends on the load (seen: not printed, under a second pytest
    # worker); steps 0-5 were checkpointed, so they are there either way
    assert set(range(6)) <= set(map(int, before)) <= set(range(7)), sorted(before)
    assert sorted(map(int, after)) == list(range(6, 10))
    assert {**before, **after} == ref  # every step's loss, bit for bit (float.hex)
    assert "done: 10 steps" in log
