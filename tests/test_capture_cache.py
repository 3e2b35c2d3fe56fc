"""The capture cache (autopar/capture_cache.py): a second compile of the same model skips the
traces, gets the same program, and runs the NEW model's tensors; anything that can change what a
trace computes is part of the key."""

from __future__ import annotations

import copy

import pytest
import torch

from autopar import capture_cache as cc
from autopar.capture import capture_forward, capture_graph, joint_program
from autopar.models.llama import Llama, LlamaConfig, cross_entropy
from autopar.runtime.common import full_tensor


def _batch(vocab=256, seq=16):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (4, seq), generator=g), torch.randint(0, vocab, (4, seq), generator=g)


def _llama(seed=0, **cfg):
    torch.manual_seed(seed)
    return Llama(LlamaConfig(**cfg))


def _program_text(p) -> str:
    return "\n".join(f"{n.name} {n.op} {n.target} {n.args} {n.meta['val'] if 'val' in n.meta else ''}"
                     for n in p.graph.nodes) + f"\n{p.inputs}\n{p.outputs}\n{sorted(p.buffers)}"


def _traces(model, batch):
    gm = capture_graph(model, batch, cross_entropy)
    return gm, joint_program(gm, batch, model), capture_forward(model, batch[:1])


def test_a_hit_is_the_same_program_bound_to_the_new_model(monkeypatch):
    cc.clear()
    batch = _batch()
    a, b = _llama(0), _llama(1)
    gm_a, joint_a, fwd_a = _traces(a, batch)
    gm_b, joint_b, fwd_b = _traces(b, batch)
    assert cc.STATS == {"capture_miss": 1, "joint_miss": 1, "forward_miss": 1,
                        "capture_hit": 1, "joint_hit": 1, "forward_hit": 1}
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")
    gm_ref, joint_ref, fwd_ref = _traces(_llama(1), batch)
    assert _program_text(joint_b) == _program_text(joint_ref)
    assert _program_text(fwd_b) == _program_text(fwd_ref)
    assert str(gm_b.graph) == str(gm_ref.graph)
    # the hit's graph module holds b's parameters, not a's; its graph is its own object
    params_b = {id(p) for p in b.parameters()}
    attrs = [getattr(gm_b, n.target) for n in gm_b.graph.nodes if n.op == "get_attr"]
    assert any(id(t) in params_b for t in attrs) and not any(id(t) in {id(p) for p in a.parameters()} for t in attrs)
    assert joint_b.graph is not joint_a.graph and next(iter(joint_b.graph.nodes)) is not next(iter(joint_a.graph.nodes))
    # buffers are b's (rope tables): same values, b's tensors
    bufs_b = dict(b.named_buffers())
    assert all(joint_b.buffers[n] is bufs_b[n] for n in joint_b.buffers if n in bufs_b)
    # and the captured module computes b's loss
    assert torch.equal(gm_b(*batch)[0] if isinstance(gm_b(*batch), (tuple, list)) else gm_b(*batch),
                       cross_entropy(b(batch[0]), batch[1]))
    # a pass writing into a hit's records leaves the cached template alone
    from autopar.ir import info

    for n in joint_b.graph.nodes:
        info(n).why = "written by a pass"
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "1")
    c = _llama(2)
    again = joint_program(capture_graph(c, batch, cross_entropy), batch, c)
    assert cc.STATS["joint_hit"] == 2
    assert all(info(n).why is None for n in again.graph.nodes)


@pytest.mark.parametrize("change", ["config", "buffer", "tied", "shape", "dtype", "training", "loss", "attr"])
def test_what_changes_a_trace_changes_the_key(change):
    batch = _batch()
    cc.clear()
    base = _llama(0)
    capture_graph(base, batch, cross_entropy)
    model, loss, inputs = _llama(0), cross_entropy, batch
    if change == "config":  # same parameters and buffers, another constant in forward
        model = _llama(0, norm_eps=1e-6)
    elif change == "buffer":  # same shapes, other values (a trace may bake them in)
        with torch.no_grad():
            model.rope_cos.mul_(0.5)
    elif change == "tied":
        model = _llama(0, tie_embeddings=True)
    elif change == "shape":
        inputs = _batch(seq=8)
    elif change == "dtype":
        model = copy.deepcopy(base).double()
    elif change == "training":
        model.eval()
    elif change == "loss":
        loss = lambda out, y: cross_entropy(out, y) * 2  # noqa: E731
    elif change == "attr":
        model.layers[1].self_attn.scale_extra = 3.0  # any attribute a forward might read
    capture_graph(model, inputs, loss)
    assert cc.STATS.get("capture_hit", 0) == 0 and cc.STATS["capture_miss"] == 2


def test_an_object_it_cannot_see_into_is_traced_afresh():
    class Opaque:
        __slots__ = ("x",)

    batch = _batch()
    cc.clear()
    for _ in range(2):
        m = _llama(0)
        m.opaque = Opaque()
        capture_graph(m, batch, cross_entropy)
    assert "capture_hit" not in cc.STATS and "capture_miss" not in cc.STATS  # never looked up


def _hit_trains_the_new_model_job():
    """On each rank: compile model A (seed 0), then model B (seed 1, the cache's hit), under
    fsdp; B's losses and parameters after 2 AdamW steps match eager PyTorch on a copy of B."""
    import autopar
    from autopar.testing import build_model

    cc.clear()
    mesh = autopar.mesh(dp=2)
    out = {}
    for seed in (0, 1):
        model, batches, loss_fn = build_model("llama", seed=seed)
        ref = copy.deepcopy(model)
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "fsdp"})
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        losses, ref_losses = [], []
        for x, y in batches[:2]:
            losses.append(pm.train_step(x, y).item())
            opt.step()
            opt.zero_grad()
            loss = loss_fn(ref(x), y)
            loss.backward()
            ref_losses.append(loss.item())
            ropt.step()
            ropt.zero_grad()
        diff = max((full_tensor(p) - dict(ref.named_parameters())[n]).abs().max().item()
                   for n, p in pm.named_parameters())
        with torch.no_grad():
            eval_diff = (pm(batches[2][0]) - ref(batches[2][0])).abs().max().item()
        out[seed] = {"losses": losses, "ref": ref_losses, "param_diff": diff, "eval_diff": eval_diff}
    out["stats"] = dict(cc.STATS)
    return out


def test_a_hit_trains_the_new_model(pools):
    out = pools(2).run(_hit_trains_the_new_model_job)
    assert out["stats"]["capture_hit"] == 1 and out["stats"]["joint_hit"] == 1 and out["stats"]["forward_hit"] == 1
    for seed in (0, 1):
        assert out[seed]["losses"] == pytest.approx(out[seed]["ref"], rel=1e-5), seed
        assert out[seed]["param_diff"] < 1e-4 and out[seed]["eval_diff"] < 1e-4, seed
    assert out[0]["losses"][0] != pytest.approx(out[1]["losses"][0], rel=1e-3)  # the two models do differ


def test_an_entry_keeps_no_tensor_of_the_model_alive():
    """A cached trace holds descriptions and the trace's own constants, not the model's parameters
    or buffers: a model the user dropped is freed even while its traces stay in the cache."""
    import gc
    import weakref

    cc.clear()
    batch = _batch()
    model = _llama(0)
    gm, joint, fwd = _traces(model, batch)
    refs = [weakref.ref(model.embed_tokens.weight), weakref.ref(model.rope_cos)]
    del model, gm, joint, fwd
    gc.collect()
    # (dynamo's compiled-function globals, which held every captured model, are removed: capture.py)
    assert all(r() is None for r in refs)
    assert sum(len(c) for c in cc._CACHES.values()) == 3  # the entries are still there
