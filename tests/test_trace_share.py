"""Ranks share the traces they would all make alike (autopar/trace_share.py): the mesh's first rank
traces the model (dynamo's capture, the joint and forward programs) and asks DTensor, the others
read its copies from the store, and a rank whose trace differs, or whose leader failed, traces for
itself without waiting out the timeout."""

from __future__ import annotations

import os

import pytest
import torch


def _compile_job(name: str, share: bool, batch: int | None = None, fail_on: int | None = None,
                 evaluate: bool = True, max_sent: int | None = None) -> dict:
    import time

    import torch.distributed as dist

    from autopar import capture_cache as cc
    from autopar import trace_share as ts
    from autopar.passes import propagate
    from autopar.testing import build_model

    os.environ["AUTOPAR_SHARE_TRACES"] = "1" if share else "0"
    os.environ["AUTOPAR_DISK_CACHE"] = "0"  # (each job's traces made here or shared, not read from disk)
    cc.clear()
    propagate._SHARED_STRATEGIES.clear()  # (DTensor's answers from earlier jobs in this process)
    asked = []  # the questions this rank put to DTensor itself
    ask = propagate._dtensor_rule_uncached
    propagate._dtensor_rule_uncached = lambda n, *a: asked.append(n.name) or ask(n, *a)
    ts.STATS.clear()
    ts.WAITED.clear()
    rank = dist.get_rank()
    ts.forget()  # (the leader's copies from earlier jobs: this job's traces are made again)
    dist.barrier()
    sent, ts.MAX_SENT = ts.MAX_SENT, max_sent or ts.MAX_SENT
    model, batches, loss_fn = build_model(name)
    x, y = batches[0]
    if batch is not None and rank == 1:  # (this rank's global batch differs from the leader's)
        x, y = x[:batch], y[:batch]

    def refusing(logits, targets):
        if fail_on == rank:
            raise ValueError(f"the loss refuses on rank {rank}")
        return loss_fn(logits, targets)

    # (a closure over this rank's number is another loss on each rank: its capture is not shared)
    loss = loss_fn if fail_on is None else refusing

    out = {"rank": rank}
    t0 = time.perf_counter()
    try:
        _compile_and_run(out, model, batches, x, y, loss, evaluate, batch is None)
    finally:
        propagate._dtensor_rule_uncached = ask
    out.update(seconds=time.perf_counter() - t0, stats=dict(ts.STATS), waited=list(ts.WAITED),
               cache=dict(cc.STATS), asked=len(asked))
    got = [None, None]
    dist.all_gather_object(got, out)
    os.environ.pop("AUTOPAR_SHARE_TRACES")
    os.environ.pop("AUTOPAR_DISK_CACHE")
    ts.MAX_SENT = sent
    return got


def _compile_and_run(out: dict, model, batches, x, y, loss, evaluate: bool, train: bool) -> None:
    import autopar

    try:
        pm = autopar.compile(model, autopar.mesh(dp=2), example_inputs=(x, y), loss_fn=loss, plan={"dp": "fsdp"},
                             capture_eval=evaluate, timeout=120)
    except Exception as e:  # noqa: BLE001 - returned to the test
        out.update(error=f"{type(e).__name__}: {e}".splitlines()[0])
    else:
        out.update(program=str(pm.program.graph))
        if train:
            out.update(losses=[pm.train_step(xb, yb).item() for xb, yb in batches[:2]])
        if evaluate:  # (the forward program's passes run at the first call)
            out.update(eval=pm(x).detach(), forward=str(pm._forward_program.graph))


def test_one_rank_traces_and_the_other_takes_its_copy(pools):
    """Hugging Face Llama under fsdp, with its eval program: rank 1 takes rank 0's capture, joint
    and forward programs and DTensor's answers instead of making them; its programs, losses and
    eval outputs are those of a compile where every rank traced for itself."""
    pool = pools(2)
    alone = pool.run(_compile_job, "hf_llama", False)
    shared = pool.run(_compile_job, "hf_llama", True)
    assert alone[1]["stats"] == {} and alone[1]["cache"]["joint_miss"] == 1  # (the switch holds: no sharing)
    # (DTensor's answers twice: the training program's propagate, and the eval program's at its first call)
    kinds = {"capture": 1, "joint": 1, "forward": 1, "strategies": 2}
    assert shared[0]["stats"] == {f"{k} published": n for k, n in kinds.items()}, shared[0]["stats"]
    assert shared[1]["stats"] == {f"{k} taken": n for k, n in kinds.items()}, shared[1]["stats"]
    # rank 1 asked DTensor nothing: rank 0's answers were all it needed
    assert alone[1]["asked"] == alone[0]["asked"] > 100 and shared[1]["asked"] == 0, (alone[1]["asked"], shared[1])
    assert all(shared[1]["cache"][f"{k}_shared"] == 1 for k in ("capture", "joint", "forward")), shared[1]["cache"]
    for r in (0, 1):
        assert shared[r]["program"] == alone[r]["program"] and shared[r]["forward"] == alone[r]["forward"]
        assert shared[r]["losses"] == alone[r]["losses"]
        torch.testing.assert_close(shared[r]["eval"], alone[r]["eval"], rtol=0, atol=0)
    assert shared[0]["program"] == shared[1]["program"]


def test_a_rank_whose_trace_differs_traces_for_itself(pools):
    """Rank 1's batch differs from the leader's: the leader announces another trace, and rank 1
    traces its own capture and joint program at once (not after the compile's 120 s timeout)."""
    got = pools(2).run(_compile_job, "llama", True, batch=2, evaluate=False)
    assert got[1]["stats"] == {f"{k} traced_here": 1 for k in ("capture", "joint", "strategies")}, got[1]["stats"]
    assert max(got[1]["waited"]) < 20, got[1]["waited"]
    assert got[0]["program"] != got[1]["program"]


def test_a_copy_too_large_to_send_to_every_rank_is_not_sent(pools):
    """A copy whose size times the ranks that would read it exceeds ``MAX_SENT`` stays with the
    leader, which says so: the other rank traces for itself at once."""
    got = pools(2).run(_compile_job, "llama", True, evaluate=False, max_sent=1000)
    kinds = ("capture", "joint", "strategies")
    assert got[0]["stats"] == {f"{k} refused": 1 for k in kinds}, got[0]["stats"]
    assert got[1]["stats"] == {f"{k} traced_here": 1 for k in kinds}, got[1]["stats"]
    assert max(got[1]["waited"]) < 20 and got[0]["program"] == got[1]["program"]


def test_a_failed_leader_leaves_the_others_their_own_error(pools):
    """The leader's capture raises (its loss refuses): rank 1 stops waiting once rank 0 has said
    its compile failed, traces for itself and raises RankFailure naming rank 0; rank 0 raises its
    own error."""
    got = pools(2).run(_compile_job, "llama", True, fail_on=0, evaluate=False)
    assert "the loss refuses on rank 0" in got[0]["error"], got[0]
    assert got[1]["error"].startswith("RankFailure: rank 0 failed in autopar.compile"), got[1]
    assert got[1]["stats"] == {f"{k} traced_here": 1 for k in ("capture", "joint", "strategies")}, got[1]["stats"]
    assert max(got[1]["waited"]) < 20, got[1]["waited"]


def _more_traces_than_the_leader() -> dict:
    import time

    import torch.distributed as dist

    import autopar
    from autopar import trace_share as ts

    ts.STATS.clear()
    ts.WAITED.clear()
    table: dict = {}
    with ts.sharing(autopar.mesh(dp=2), wait_s=120):
        if dist.get_rank() == 1:  # (rank 0 compiles no such thing: a pipeline whose twin stages differ)
            time.sleep(0.5)
            with ts.memo("strategies", ("a question only rank 1 asks",), table):
                table["answer"] = 1
    got = [None, None]
    dist.all_gather_object(got, {"stats": dict(ts.STATS), "waited": list(ts.WAITED)})
    return got


def test_a_trace_the_leader_never_makes_is_not_waited_for(pools):
    """A rank with a trace the leader's compile does not have (pipeline ranks whose stages differ
    in number) stops waiting when the leader's compile ends, not after the 120 s timeout."""
    got = pools(2).run(_more_traces_than_the_leader)
    assert got[0]["stats"] == {} and got[1]["stats"] == {"strategies traced_here": 1}, got
    assert max(got[1]["waited"]) < 20, got[1]["waited"]


@pytest.mark.parametrize("key", [("joint", "graph():\n    %x", (("tensor", (2, 3)),)),
                                 ("forward", (("", ("id", "Llama", 140000000000001), ()),))])
def test_the_digest_names_what_it_compares_by_identity(key):
    """A key's digest is the same in another process (an object's id there differs: its order of
    first appearance counts, not its address) and changes when the key does."""
    from autopar import trace_share as ts

    moved = eval(repr(key).replace("140000000000001", "140000000009999"))
    assert ts.digest(key) == ts.digest(moved)
    assert ts.digest(key) != ts.digest(key + ("more",))
