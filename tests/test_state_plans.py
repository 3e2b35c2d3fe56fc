"""What ZeRO, mixed precision, accumulation and recompute do to the program, on a fake process
group (planning only; the numerics are in test_state.py).

Communication volume per rank per step (ring, Psi parameters, N data-parallel ranks):
DDP all-reduce 2(N-1)/N x 4Psi; ZeRO-1/2 reduce-scatter + all-gather = the same total;
ZeRO-3 adds a second all-gather for the backward (1.5x), except for parameters the backward
does not read (the embedding table: its gradient needs only the token ids) and, by default, the
root's parameters, which stay gathered from forward to backward as under FSDP2
(``reshard_after_forward``: True re-gathers them too, False gathers nothing twice).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

import autopar
from autopar.errors import PlanError
from autopar.ir import bytes_by_collective
from autopar.models.llama import Llama, LlamaConfig, cross_entropy

B, S = 8, 16


def compile_llama(mesh, plan, n_layers=2, **options):
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layers=n_layers)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (B, S))
    pm = autopar.compile(model, mesh, example_inputs=(tokens, tokens), loss_fn=cross_entropy, plan=plan,
                         debug=True, capture_eval=False, **options)
    psi = sum(p.numel() for p in pm.parameters())
    return pm, psi


def totals(pm) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in bytes_by_collective(pm.collectives()).items():
        out[k.split("@")[0]] = out.get(k.split("@")[0], 0) + v
    return out


LOSS_STATS = 8  # the CE's token count and loss sum, all-reduced over dp


@pytest.mark.parametrize("n", [2, 8])
def test_zero_communication_volume(fake, n):
    with fake(dp=n) as mesh:
        ring = (n - 1) / n
        vol = {}
        for s in ("ddp", "zero1", "zero2", "zero3"):
            pm, psi = compile_llama(mesh, {"dp": s})
            vol[s] = totals(pm)
        for raf in (True, False):
            vol[raf] = totals(compile_llama(mesh, {"dp": "zero3"}, reshard_after_forward=raf)[0])
        embed = 256 * 64
        root = sum(p.numel() for name, p in pm.named_parameters() if not name.startswith("layers."))
        assert vol["ddp"] == pytest.approx({"all_reduce": 2 * ring * (4 * psi + LOSS_STATS)})
        for s in ("zero1", "zero2"):
            assert vol[s] == pytest.approx({"all_gather": ring * 4 * psi, "reduce_scatter": ring * 4 * psi,
                                            "all_reduce": 2 * ring * LOSS_STATS})
            assert sum(vol[s].values()) == pytest.approx(sum(vol["ddp"].values()))
        rest = {"reduce_scatter": ring * 4 * psi, "all_reduce": 2 * ring * LOSS_STATS}
        assert vol[True] == pytest.approx({"all_gather": ring * 4 * (2 * psi - embed), **rest})
        assert vol["zero3"] == pytest.approx({"all_gather": ring * 4 * (2 * psi - root), **rest})
        assert vol[False] == pytest.approx({"all_gather": ring * 4 * psi, **rest})


def test_zero3_gathers_per_phase_zero2_once(fake):
    with fake(dp=4) as mesh:
        # one gather per parameter (bucket_mb=0): per-block buckets are tests/test_gather.py's
        pm3, _ = compile_llama(mesh, {"dp": "zero3"}, bucket_mb=0, reshard_after_forward=True)
        pm2, _ = compile_llama(mesh, {"dp": "zero2"}, bucket_mb=0)
        g3 = [r for r in pm3.collectives() if r.kind == "all_gather"]
        g2 = [r for r in pm2.collectives() if r.kind == "all_gather"]
        n_params = len(list(pm3.parameters()))
        assert len(g2) == n_params and all(r.phase == "forward" for r in g2)
        assert len([r for r in g3 if r.phase == "forward"]) == n_params
        assert len([r for r in g3 if r.phase == "backward"]) == n_params - 1  # not the embedding
        assert all("ZeRO-3: gather parameter" in r.reason for r in g3)
        # by default (FSDP2's) the root's parameters (outside layers.N) are not gathered again
        pm_root, _ = compile_llama(mesh, {"dp": "zero3"}, bucket_mb=0)
        in_blocks = [n for n, _ in pm_root.named_parameters() if n.startswith("layers.")]
        back = [r for r in pm_root.collectives() if r.kind == "all_gather" and r.phase == "backward"]
        assert len(back) == len(in_blocks)
        assert {n for n, _ in pm_root.ctx.kept_gathered} == {n for n, _ in pm_root.named_parameters()} - set(
            in_blocks) - {"embed_tokens.weight"}
        # ZeRO-1 reduces at the very end of the program, ZeRO-2 as soon as each gradient is ready
        # (one reduce-scatter per gradient: bucket_mb=0; buckets are tests/test_bucket.py's)
        pm1, _ = compile_llama(mesh, {"dp": "zero1"}, bucket_mb=0)
        pm2, _ = compile_llama(mesh, {"dp": "zero2"}, bucket_mb=0)

        def positions(pm):
            nodes = list(pm.program.local.graph.nodes)
            rs = [i for i, n in enumerate(nodes) if "reduce_scatter" in str(n.target)]
            mms = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
            return rs, mms

        rs1, mm1 = positions(pm1)
        rs2, mm2 = positions(pm2)
        assert len(rs1) == len(rs2) == n_params
        assert min(rs1) > max(mm1)  # ZeRO-1: after the last matmul of the backward
        assert min(rs2) < max(mm2)  # ZeRO-2: interleaved with the backward


def test_fsdp_with_megatron_shards_distinct_dims(fake):
    with fake(dp=2, tp=2) as mesh:
        pm, _ = compile_llama(mesh, {"dp": "fsdp", "tp": "megatron"})
        pl = {n: p.placements for n, p in pm.named_parameters()}
        assert pl["layers.0.self_attn.q_proj.weight"] == (Shard(1), Shard(0))  # tp column, dp the other dim
        assert pl["layers.0.self_attn.o_proj.weight"] == (Shard(0), Shard(1))
        assert pl["layers.0.input_layernorm.weight"][0] == Shard(0)
        for p in pl.values():
            dims = [x.dim for x in p if isinstance(x, Shard)]
            assert len(dims) == len(set(dims))


def test_mixed_precision_halves_bytes(fake):
    with fake(dp=4) as mesh:
        f32 = totals(compile_llama(mesh, {"dp": "zero3"})[0])
        bf16 = totals(compile_llama(mesh, {"dp": "zero3"}, precision="bf16")[0])
        bf16_f32reduce = totals(compile_llama(mesh, {"dp": "zero3"}, precision="bf16", reduce_dtype="fp32")[0])
        assert bf16["all_gather"] == pytest.approx(f32["all_gather"] / 2)
        assert bf16["reduce_scatter"] == pytest.approx(f32["reduce_scatter"] / 2)
        assert bf16_f32reduce["reduce_scatter"] == pytest.approx(f32["reduce_scatter"])


@pytest.mark.parametrize("mesh_plan,options", [
    ({"tp": "megatron"}, {}),
    ({"tp": "megatron"}, {"precision": "bf16"}),
    ({"tp": "megatron"}, {"accumulate": 2}),  # the no-sync program: gradients left unreduced
    ({"pp": "1f1b", "tp": "megatron"}, {"precision": "bf16"}),  # a pipeline stage: the same
])
def test_vocab_parallel_embedding_backward(fake, mesh_plan, options):
    """Under Megatron the embedding's gradient is computed for the rank's own vocabulary rows:
    also when a cast to the fp32 parameter stands between it and the output (mixed precision), and
    when the program leaves its gradients unreduced (accumulation, pipeline stages). No
    full-vocabulary gradient is materialized and sliced."""
    with fake(**{a: 2 for a in mesh_plan}) as mesh:
        pm, _ = compile_llama(mesh, mesh_plan, **options)
    programs = [st.program for st in pm.stages.values()] if pm.pipelined else [pm.program]
    vocab = LlamaConfig().vocab_size
    rows = [n.meta["val"].shape[0] for p in programs for n in p.local.graph.nodes
            if n.target is torch.ops.aten.embedding_dense_backward.default]
    assert rows == [vocab // 2]


@pytest.mark.parametrize("plan", ["ddp", "zero2", "zero3"])
def test_accumulation_syncs_gradients_once(fake, plan):
    with fake(dp=2) as mesh:
        one = totals(compile_llama(mesh, {"dp": plan})[0])
        four = totals(compile_llama(mesh, {"dp": plan}, accumulate=4)[0])
        grad_kind = "all_reduce" if plan == "ddp" else "reduce_scatter"
        loss_stats_extra = 3 * 2 * 0.5 * LOSS_STATS if plan == "ddp" else 0  # per micro-batch
        assert four[grad_kind] == pytest.approx(one[grad_kind] + loss_stats_extra)
        if plan == "zero3":  # parameters are gathered again for every micro-batch
            assert four["all_gather"] == pytest.approx(4 * one["all_gather"])


def test_recompute_reruns_block_forward(fake):
    with fake(tp=2) as mesh:
        base, _ = compile_llama(mesh, {"tp": "megatron"}, n_layers=2)
        full, _ = compile_llama(mesh, {"tp": "megatron"}, n_layers=2, recompute="full")
        sel, _ = compile_llama(mesh, {"tp": "megatron"}, n_layers=2, recompute="selective")

        def bwd_reduces(pm):
            return len([r for r in pm.collectives() if r.phase == "backward" and r.kind == "all_reduce"])

        # full recompute re-runs each block's forward, including its 2 tp all-reduces (the reduced
        # values are not kept from the forward: only the block's input is)
        assert bwd_reduces(full) == bwd_reduces(base) + 2 * 2
        assert bwd_reduces(sel) == bwd_reduces(base)  # selective keeps matmul outputs: no re-reduce
        assert full.program.recomputed > sel.program.recomputed > 0 == base.program.recomputed


def test_option_errors(fake):
    with fake(dp=2) as mesh:
        for kw, msg in [({"accumulate": 3}, "not divisible by accumulate=3"),
                        ({"precision": "fp8"}, "unknown precision"),
                        ({"recompute": "some"}, "unknown recompute policy"),
                        ({"accumulate": 0}, "positive int")]:
            with pytest.raises(PlanError, match=msg):
                compile_llama(mesh, {"dp": "zero2"}, **kw)
