"""A model's assert on a tensor's value (XLM's ``assert lengths.max().item() <= slen``) is kept in
the compiled program as a device-side check (autopar/value_checks.py): the program trains as one
process does while it holds, and fails on every rank, naming the user's line, when it does not.

PYTEST_DONT_REWRITE: the model's ``assert`` statements must stay Python's own (pytest would
rewrite them into an ``if``, which dynamo does not treat as an assert)."""

from __future__ import annotations

import torch
import torch.nn as nn

import autopar
from autopar import value_checks
from autopar.capture import capture_graph

LIMIT = 28  # tokens from LIMIT to VOCAB - 1 are in the table but fail the model's own check
VOCAB = 32


class Checked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, VOCAB)

    def forward(self, ids):
        lengths = (ids != 0).sum(dim=1)
        assert lengths.max().item() <= ids.shape[1]  # as XLM writes it: always holds
        assert lengths.min().item() >= 1  # a second check of the same value (XLM has two)
        assert ids.max().item() < LIMIT  # the one a batch can fail
        return self.down(torch.relu(self.up(self.emb(ids))))


def _loss(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(0, 1))


def _data(bad: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, LIMIT, (4, 8), generator=g)
    if bad:
        x[3, 5] = LIMIT + 1  # in the last rank's rows only
    return x, torch.randint(0, VOCAB, (4, 8), generator=g)


def test_the_asserts_become_device_checks_with_the_users_line():
    torch.manual_seed(0)
    x, y = _data(False)
    gm = capture_graph(Checked(), (x, y), _loss)
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "item"]
    lines = value_checks.checks(gm)
    assert len(lines) == 3 and all("test_value_checks.py" in w for w in lines), lines
    assert "ids.max().item() < LIMIT" in lines[2]


def _job(plan: dict):
    torch.manual_seed(0)
    model = Checked()
    ref = Checked()
    ref.load_state_dict(model.state_dict())
    x, y = _data(False)
    pm = autopar.compile(model, autopar.mesh(dp=2), example_inputs=(x, y), loss_fn=_loss, plan=plan)
    got = float(pm.train_step(x, y))
    want = float(_loss(ref(x), y))
    bad = _data(True)
    try:
        pm.train_step(*bad)
        failed = None
    except Exception as e:  # noqa: BLE001 - what the check raised, on this rank
        failed = f"{type(e).__name__}: {e}"
    return {"got": got, "want": want, "failed": failed, "report": pm.report()}


def test_the_program_trains_and_fails_on_every_rank():
    from autopar.testing import DistPool

    # a pool of its own: the failed step leaves a fatal record in the process group's store
    # (autopar/runtime/failure.py), which a later program on the same group would read
    pool = DistPool(2)
    try:
        out = pool.run(_job, {"dp": "ddp"})
    finally:
        pool.close()
    assert abs(out["got"] - out["want"]) <= 1e-5 * abs(out["want"]), out
    assert out["failed"] and "the model's assert failed" in out["failed"] and "LIMIT" in out["failed"], out
    assert out["report"].count(value_checks.NOTE) == 3 and "LIMIT" in out["report"], out["report"]


class Reads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        keep = (x > 0).sum().item()  # a size read from the data
        return self.lin(x).flatten()[:keep]


def test_a_value_read_for_anything_else_is_refused_at_its_line():
    import pytest

    from autopar.errors import CaptureError

    x = torch.randn(4, 8)
    with pytest.raises(CaptureError) as e:
        capture_graph(Reads(), (x, torch.zeros(())), lambda out, y: out.sum())
    assert "reads a tensor's value on the host at tests/test_value_checks.py" in str(e.value), e.value
    assert "(x > 0).sum().item()" in str(e.value) and ".tolist()" in str(e.value), e.value
