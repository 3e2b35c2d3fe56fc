"""Parameter gathers per block, issued ahead of use (passes/gather.py, run by the overlap pass).

- The rewrite fired: Llama-tiny's per-parameter all-gathers under ZeRO-3 become one per block
  and phase (FSDP2's unit), with the same bytes, and the per-rank invariants (``debug=True``)
  holding; mixed precision gathers the bf16 cast (the cast moves with its gather).
- Prefetch: with ``prefetch=1`` each block's gather is on the wire while the block before it
  computes (its matmuls lie between the gather and its wait); with ``prefetch=0`` none do.
- Numerics on 2 gloo ranks: losses and gradients with bucketed, prefetched gathers equal the
  per-parameter, unprefetched program bit for bit, under fsdp, fsdp + bf16 + full recompute and
  ZeRO-2; 100 steps with prefetch and bucketing on (asynchronous gathers and reduce-scatters
  in flight across blocks) end bit-identical to the synchronous program run as long (the
  1,000-step soak with prefetch on, resident memory / fds / threads watched, is
  benchmarks/soak.py: benchmarks/results/soak-2026-11-23.md). prefetch=2 is refused on gloo (a torch bug, reproduced, named below).
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.models import zoo
from autopar.modpath import block_of
from autopar.passes.localize import c10d
from autopar.runtime.common import full_tensor

GATHER = c10d.all_gather_into_tensor.default


def compile_tiny(mesh, plan, **options):
    """(With every parameter re-gathered in backward unless the test says otherwise: the root's
    kept gathers are test_root_stays_gathered_from_forward_to_backward's.)"""
    options.setdefault("reshard_after_forward", True)
    loaded = zoo.load("llama-tiny", meta=False, batch=8)
    return autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                           plan=plan, capture_eval=False, debug=True, **options)


def gathers(pm):
    return [r for r in pm.collectives() if r.kind == "all_gather"]


def param_names(r) -> list[str]:
    if r.reason.startswith("bucket of"):
        return r.reason.split("(", 1)[1].rstrip(")").split(", ")
    return [r.reason.split("gather parameter ")[1].split()[0]]


def test_one_gather_per_block_and_phase(fake):
    with fake(dp=2) as mesh:
        per_param = compile_tiny(mesh, {"dp": "fsdp"}, bucket_mb=0, prefetch=0)
        pm = compile_tiny(mesh, {"dp": "fsdp"})
        before, after = gathers(per_param), gathers(pm)
        assert len(before) == 41  # every parameter forward, every one a backward needs again
        # forward: embedding, layers.0, layers.1, norm + head; backward: head + norm, layers.1, layers.0
        blocks = [(r.phase, sorted({block_of(n) for n in param_names(r)})) for r in after]
        assert blocks == [("forward", [""]), ("forward", ["layers.0"]), ("forward", ["layers.1"]),
                          ("forward", [""]), ("backward", [""]), ("backward", ["layers.1"]),
                          ("backward", ["layers.0"])]
        assert sum(r.payload_bytes for r in after) == sum(r.payload_bytes for r in before)
        assert sorted(n for r in after for n in param_names(r)) == sorted(n for r in before for n in param_names(r))


def test_root_stays_gathered_from_forward_to_backward(fake):
    """reshard_after_forward (FSDP2's): by default the parameters outside every block (final norm,
    LM head; the embedding's backward reads no weight) are not gathered again for the backward,
    which reads the forward's gathered value; False gathers nothing twice. Bytes drop by exactly
    the root's backward gathers; the liveness peak does not rise for the root (the head's
    gathered weight is used last in forward and first in backward)."""
    from autopar.analysis.cost import predict_memory

    with fake(dp=2) as mesh:
        every = compile_tiny(mesh, {"dp": "fsdp"}, reshard_after_forward=True)
        root = compile_tiny(mesh, {"dp": "fsdp"}, reshard_after_forward=None)
        none = compile_tiny(mesh, {"dp": "fsdp"}, reshard_after_forward=False)
        kept = dict(root.ctx.kept_gathered)
        assert set(kept) == {"norm.weight", "lm_head.weight"}
        assert every.ctx.kept_gathered == []
        assert {block_of(n) for n, _ in none.ctx.kept_gathered} == {"", "layers.0", "layers.1"}

        def sent(pm, phase):
            return sum(r.payload_bytes for r in gathers(pm) if r.phase == phase)

        assert sent(root, "forward") == sent(every, "forward") == sent(none, "forward")
        # a gather's payload is this rank's shard; the kept values are gathered (x2 ranks)
        assert sent(every, "backward") - sent(root, "backward") == sum(kept.values()) // 2
        assert sent(none, "backward") == 0
        assert [(r.phase, sorted({block_of(n) for n in param_names(r)})) for r in gathers(root)] == [
            ("forward", [""]), ("forward", ["layers.0"]), ("forward", ["layers.1"]), ("forward", [""]),
            ("backward", ["layers.1"]), ("backward", ["layers.0"])]
        assert predict_memory(root)["program_peak"] <= predict_memory(every)["program_peak"]
        with pytest.raises(autopar.PlanError, match="reshard_after_forward"):
            compile_tiny(mesh, {"dp": "fsdp"}, reshard_after_forward="yes")


def _between(gm, start, end, target) -> int:
    nodes = list(gm.graph.nodes)
    i, j = nodes.index(start), nodes.index(end)
    return sum(1 for n in nodes[i:j] if n.target is target)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_prefetch_puts_a_block_of_compute_under_each_gather(fake, prefetch):
    with fake(dp=2) as mesh:
        pm = compile_tiny(mesh, {"dp": "fsdp"}, prefetch=prefetch)
        gm = pm.stage.program.local
        colls = [n for n in gm.graph.nodes if n.target is GATHER]
        assert len(colls) == 7
        under = []
        for c in colls:
            wait = next(iter(c.users))
            under.append(_between(gm, c, wait, torch.ops.aten.mm.default))
        # matmuls that run while each gather is on the wire. Forward: embedding, layers.0, layers.1,
        # norm + head (7 matmuls per block); backward: head (2), layers.1, layers.0 (14 each).
        # prefetch=1: each block's gather under the block before it; 2: under the two before it.
        # The first gather of each phase waits where it is used (no move across phases).
        want = {0: [0] * 7, 1: [0, 0, 7, 7, 0, 2, 14], 2: [0, 0, 7, 14, 0, 2, 16]}[prefetch]
        assert under == want
        order = [n for n in gm.graph.nodes if n.target is GATHER]
        assert order == colls and len({c.meta["val"].numel() for c in colls}) > 1  # issue order kept


def test_mixed_precision_gathers_the_cast(fake):
    """bf16: the parameter's cast to bf16 runs on the shard and moves with its (bucketed,
    prefetched) gather, so half the bytes travel."""
    with fake(dp=2) as mesh:
        fp32 = compile_tiny(mesh, {"dp": "fsdp"})
        bf16 = compile_tiny(mesh, {"dp": "fsdp"}, precision="bf16")
        assert len(gathers(bf16)) == len(gathers(fp32)) == 7
        assert sum(r.payload_bytes for r in gathers(bf16)) * 2 == sum(r.payload_bytes for r in gathers(fp32))
        gm = bf16.stage.program.local
        for c in [n for n in gm.graph.nodes if n.target is GATHER]:
            assert c.args[0].meta["val"].dtype == torch.bfloat16


def test_fsdp_with_megatron_gathers_per_block_on_dp(fake):
    with fake(dp=2, tp=2) as mesh:
        per_param = compile_tiny(mesh, {"dp": "fsdp", "tp": "megatron"}, bucket_mb=0, prefetch=0)
        pm = compile_tiny(mesh, {"dp": "fsdp", "tp": "megatron"})
        dp_before = [r for r in gathers(per_param) if r.axis == "dp"]
        dp_after = [r for r in gathers(pm) if r.axis == "dp"]
        assert len(dp_after) <= 8 < len(dp_before)
        assert sum(r.payload_bytes for r in dp_after) == sum(r.payload_bytes for r in dp_before)
        tp = [(r.kind, r.payload_bytes) for r in per_param.collectives() if r.axis == "tp"]
        assert tp == [(r.kind, r.payload_bytes) for r in pm.collectives() if r.axis == "tp"]


def test_one_gather_in_flight_per_group_with_prefetch_1(fake):
    """prefetch=1 never has two all-gathers of one process group issued and not yet waited (what
    gloo requires: see test_prefetch_2_is_refused_on_gloo)."""
    for plan, axes in (({"dp": "fsdp"}, {"dp": 2}), ({"dp": "fsdp", "tp": "megatron"}, {"dp": 2, "tp": 2})):
        with fake(**axes) as mesh:
            gm = compile_tiny(mesh, plan, precision="bf16").stage.program.local
            open_: dict[str, int] = {}
            for n in gm.graph.nodes:
                if n.target is GATHER:
                    group = n.args[-1]
                    assert open_.get(group, 0) == 0, n.name
                    open_[group] = 1
                elif n.target is c10d.wait_tensor.default and n.args[0].target is GATHER:
                    open_[n.args[0].args[-1]] = 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1", None])
def test_prefetch_must_be_a_non_negative_int(fake, bad):
    with fake(dp=2) as mesh, pytest.raises(PlanError, match="prefetch"):
        compile_tiny(mesh, {"dp": "fsdp"}, prefetch=bad)


# --------------------------------------------------------------------- 2 gloo ranks
def refused_job():
    """Every rank's PlanError message (None where compile did not raise)."""
    import torch.distributed as dist

    from autopar.testing import build_model

    model, batches, loss_fn = build_model("llama")
    msg = None
    try:
        autopar.compile(model, autopar.mesh(dp=2), example_inputs=batches[0], loss_fn=loss_fn,
                        plan={"dp": "fsdp"}, capture_eval=False, prefetch=2)
    except PlanError as e:
        msg = str(e)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, msg)
    return every


def test_prefetch_2_is_refused_on_gloo(pools):
    """Two functional all-gathers in flight on one gloo group corrupt the heap in torch 2.13 (a
    plain-torch reproduction: 2 ranks, 9 parameter-sized ``_c10d_functional.all_gather_into_tensor``
    calls per iteration, each waited 2 calls later, with compute between: SIGSEGV / SIGABRT
    "malloc(): unaligned tcache chunk detected" within 3,000 iterations in fp32, bf16 and fp16;
    waited before the next is issued: no crash). So prefetch=2 is refused there, by name."""
    msgs = pools(2).run(refused_job)
    assert len(msgs) == 2
    for m in msgs:  # raised on every rank, naming the option, the cause and the fix
        assert m is not None and "prefetch=2" in m and "gloo" in m and "prefetch=1" in m



def gather_numerics_job(strategy: str, options: dict, steps: int):
    """Every rank: losses and final parameters after ``steps`` steps of AdamW, with gathers
    per parameter and synchronous (bucket_mb=0, prefetch=0) and bucketed + prefetched."""
    from autopar.testing import build_model

    out = {}
    for name, knobs in (("sync", {"bucket_mb": 0, "prefetch": 0}), ("async", {"prefetch": 1})):
        model, batches, loss_fn = build_model("llama")
        pm = autopar.compile(model, autopar.mesh(dp=2), example_inputs=batches[0], loss_fn=loss_fn,
                             plan={"dp": strategy}, capture_eval=False, **knobs, **options)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        losses = []
        for i in range(steps):
            losses.append(float(pm.train_step(*batches[i % len(batches)])))
            if i == 0:
                grads = {n: full_tensor(p.grad) for n, p in pm.named_parameters()}
            opt.step()
            opt.zero_grad()
        params = {n: full_tensor(p) for n, p in pm.named_parameters()}
        calls = len(gathers(pm))
        out[name] = (losses, grads, params, calls)
    return out


@pytest.mark.parametrize("strategy,options,steps", [
    ("fsdp", {}, 3),
    ("fsdp", {"precision": "bf16", "recompute": "full"}, 3),
    ("zero2", {}, 3),
    pytest.param("fsdp", {"precision": "bf16"}, 100, marks=pytest.mark.slow),  # (10 s)
], ids=["fsdp", "fsdp-bf16-recompute", "zero2", "100-steps"])
def test_prefetched_gathers_equal_synchronous_ones_exactly(pools, strategy, options, steps):
    out = pools(2).run(gather_numerics_job, strategy, options, steps)
    sync, fast = out["sync"], out["async"]
    assert fast[3] < sync[3]  # fewer gathers
    assert sync[0] == fast[0]  # losses, every step
    for name in sync[1]:
        assert torch.equal(sync[1][name], fast[1][name]), name
        assert torch.equal(sync[2][name], fast[2][name]), name
    assert all(x == x for x in fast[0])  # (no NaN after 100 steps either)
