"""The collectives each plan implies, on a fake process group (any mesh size, one process).

Megatron: exactly one all-reduce on the tp axis per attention block and one per MLP block
in forward (plus the vocab-parallel embedding's), the mirrored ones in backward (plus the LM
head's), no all-gather anywhere, and the full-vocab logits never gathered. DDP: every
gradient reduced exactly once (in buckets, passes/bucket.py: "bucket of N gradients (a, b, ...)").
Predicted bytes equal the ring formula 2(N-1)/N x bytes.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models.llama import Llama, LlamaConfig, cross_entropy

B, S = 8, 16


def compile_llama(mesh, plan, n_layers=3, **cfg):
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layers=n_layers, **cfg)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (B, S))
    pm = autopar.compile(model, mesh, example_inputs=(tokens, tokens), loss_fn=cross_entropy, plan=plan,
                         debug=True, capture_eval=False)
    return pm, cfg, model


def reduced_names(r) -> list[str]:
    """The gradients a record reduces: "gradient of NAME ..." or "bucket of N gradients (A, B, ...)"."""
    if r.reason.startswith("gradient of"):
        return [r.reason.split()[2]]
    return r.reason.split("(", 1)[1].rstrip(")").split(", ")


def activation_reduces(pm, phase, nbytes):
    return [r for r in pm.collectives() if r.phase == phase and r.axis == "tp" and r.payload_bytes == nbytes]


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
@pytest.mark.parametrize("axes", [{"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 4}])
def test_megatron_one_all_reduce_per_block(fake, axes, mlp):
    with fake(**axes) as mesh:
        plan = {a: ("megatron" if a == "tp" else "ddp") for a in axes}
        pm, cfg, _ = compile_llama(mesh, plan, mlp=mlp, n_kv_heads=4)
        dp = axes.get("dp", 1)
        act = B // dp * S * cfg.dim * 4  # one [B/dp, S, D] fp32 activation
        recs = pm.collectives()
        assert not [r for r in recs if r.kind in ("all_gather", "all_to_all", "reduce_scatter")]
        fwd = activation_reduces(pm, "forward", act)
        bwd = activation_reduces(pm, "backward", act)
        assert all(r.kind == "all_reduce" for r in fwd + bwd)
        # forward: the vocab-parallel embedding, then one per attention and one per MLP block
        assert len(fwd) == 1 + 2 * cfg.n_layers
        assert "embed_tokens" in fwd[0].producer
        # each is attributed to its block through the line that produced or consumed the value
        def block(r, words):
            return any(w in r.source or w in r.producer for w in words)

        attn_words, mlp_words = ("self_attn", "o_proj", "q_proj"), ("self.mlp", "down_proj", "up_proj")
        assert len([r for r in fwd if block(r, attn_words)]) == cfg.n_layers
        assert len([r for r in fwd if block(r, mlp_words)]) == cfg.n_layers
        # backward mirrors it: the LM head's input gradient, then one per block
        assert len(bwd) == 1 + 2 * cfg.n_layers
        assert "lm_head" in bwd[0].producer
        assert len([r for r in bwd if block(r, attn_words)]) == cfg.n_layers
        assert len([r for r in bwd if block(r, mlp_words)]) == cfg.n_layers
        # the logits ([B*S, V]) are never gathered: nothing on tp is larger than the activation
        assert max(r.payload_bytes for r in recs if r.axis == "tp") == act


def test_megatron_cross_entropy_is_vocab_parallel(fake):
    with fake(tp=4) as mesh:
        pm, cfg, _ = compile_llama(mesh, {"tp": "megatron"}, n_layers=1, n_kv_heads=4)
        ce = [r for r in pm.collectives() if "log_softmax" in r.reason or "nll_loss" in r.reason]
        # max and sum-of-exp over the vocab ([B*S] each), the loss sum, its backward's sum
        assert sorted(r.payload_bytes for r in ce) == sorted([B * S * 4, B * S * 4, 4, B * S * 4])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ddp_reduces_every_gradient_once(fake, n):
    with fake(dp=n) as mesh:
        pm, cfg, model = compile_llama(mesh, {"dp": "ddp"})
        grads = [r for r in pm.collectives() if r.reason.startswith(("gradient of", "bucket of"))]
        names = [n_ for r in grads for n_ in reduced_names(r)]
        assert sorted(names) == sorted(n_ for n_, _ in model.named_parameters())
        assert all(r.kind == "all_reduce" and r.axis == "dp" and r.phase == "backward" for r in grads)
        # bytes: ring all-reduce of every parameter's gradient, plus the loss sum and token count
        psi = sum(p.numel() for p in model.parameters())
        expected = 2 * (n - 1) / n * (4 * psi + 4 + 4)
        assert sum(r.wire_bytes for r in pm.collectives()) == pytest.approx(expected)


def test_megatron_bytes_match_analytic(fake):
    tp = 4
    with fake(tp=tp) as mesh:
        pm, cfg, _ = compile_llama(mesh, {"tp": "megatron"}, n_layers=2, n_kv_heads=4)
        act = B * S * cfg.dim * 4
        ring = 2 * (tp - 1) / tp
        # 2 x (embedding/LM head + 2 per layer) activations, CE: 2 row stats fwd + 1 bwd + loss scalar
        expected = ring * (2 * (1 + 2 * cfg.n_layers) * act + 3 * B * S * 4 + 4)
        assert sum(r.wire_bytes for r in pm.collectives()) == pytest.approx(expected)


def test_2d_mesh_composes(fake):
    with fake(dp=2, tp=2) as mesh:
        pm, cfg, model = compile_llama(mesh, {"dp": "ddp", "tp": "megatron"}, n_layers=2)
        recs = pm.collectives()
        dp_grads = [r for r in recs if r.axis == "dp" and r.reason.startswith(("gradient of", "bucket of"))]
        names = sorted(n for r in dp_grads for n in reduced_names(r))
        assert names == sorted(n for n, _ in model.named_parameters())
        # each gradient is reduced over dp at its tp-local size
        params = dict(pm.named_parameters())
        for r in dp_grads:
            assert r.payload_bytes == sum(params[n].to_local().numel() * 4 for n in reduced_names(r))


def test_one_rank_axes_move_nothing(fake):
    with fake(dp=1, tp=1) as mesh:
        pm, _, _ = compile_llama(mesh, {"dp": "ddp", "tp": "megatron"}, n_layers=1)
        assert pm.collectives() == []
        assert not [n for n in pm.program.local.graph.nodes if "_c10d_functional" in str(n.target)]
