"""Pretrained weights into shards (``pm.load_pretrained``, autopar/runtime/weights.py): a tiny
Hugging Face Llama saved with ``save_pretrained`` in several safetensors files, built again on
the meta device, compiled (fsdp, megatron, a 2-stage pipeline) and loaded, each rank reading only
its shards; the first step's loss and gradients against the same checkpoint loaded by
``from_pretrained`` on one process. Also: tied embeddings (``lm_head.weight`` absent from the
file), a bf16 checkpoint into fp32 parameters, rotary buffers recomputed, ``train_step`` refused
before the load, and a checkpoint that does not fit refused on every rank with its keys named.
"""

from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar.testing import _ce
from autopar.runtime.common import full_tensor

BATCH = 4
SEQ = 16


def _config(tied: bool):
    from transformers import LlamaConfig

    from autopar.models.zoo import HF_TINY

    cfg = LlamaConfig(**HF_TINY, use_cache=False, tie_word_embeddings=tied)
    cfg._attn_implementation = "sdpa"
    return cfg


def _batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 256, (BATCH, SEQ), generator=g), torch.randint(0, 256, (BATCH, SEQ), generator=g)


def _reference(path: str) -> dict:
    """One process: ``from_pretrained`` (fp32), the loss, every gradient, the logits."""
    from transformers import LlamaForCausalLM

    from autopar.capture import _WithLoss

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    x, y = _batch()
    loss = _WithLoss(model, _ce)(x, y)
    loss.backward()
    with torch.no_grad():
        logits = model(x).logits
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "logits": logits}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return make_checkpoints(tmp_path_factory.mktemp("hf"))


def make_checkpoints(root) -> dict:
    """Three checkpoints of one random init under the folder ``root`` (a Path): untied fp32, tied
    bf16 (``lm_head.weight`` not stored), and one that does not fit (a key missing, a key too
    many, a shape changed); with the one-process references of the first two."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    out = {}
    for name, tied, dtype, shard in [("untied", False, torch.float32, "200KB"), ("tied", True, torch.bfloat16, "100KB")]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(tied)).to(dtype)
        path = str(root / name)
        model.save_pretrained(path, safe_serialization=True, max_shard_size=shard)
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        assert len(files) >= 2 and os.path.exists(os.path.join(path, "model.safetensors.index.json")), files
        out[name] = path
    sd = {k: v.clone() for k, v in LlamaForCausalLM(_config(False)).state_dict().items()}
    del sd["model.layers.1.mlp.up_proj.weight"]
    sd["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(2, 2)
    sd["model.norm.weight"] = torch.ones(65)
    os.makedirs(root / "bad")
    save_file(sd, str(root / "bad" / "model.safetensors"))
    out["bad"] = str(root / "bad")
    torch.set_num_threads(1)
    out["ref"] = {k: _reference(out[k]) for k in ("untied", "tied")}
    return out


def pretrained_job(path: str, axes: dict, plan: dict, tied: bool, build: str, bad: str | None = None,
                   evaluate: bool = False) -> dict:
    """On every rank: build on meta (``build``: "torch-meta" = ``with torch.device("meta")``,
    "init-empty" = ``autopar.init_empty_weights()``), compile, load_pretrained, one train_step."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    cfg = _config(tied)
    with (torch.device("meta") if build == "torch-meta" else autopar.init_empty_weights()):
        model = LlamaForCausalLM(cfg)
    x, y = _batch()
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=(x, y), loss_fn=_ce, plan=plan,
                         capture_eval=evaluate)
    out = {"buffers": {n: (str(b.device), b.tolist()) for n, b in pm.module.named_buffers()}}
    try:
        pm.train_step(x, y)
    except autopar.TrainingError as e:
        out["before_load"] = str(e)
    if bad is not None:
        try:
            pm.load_pretrained(bad)
        except autopar.InputError as e:
            out["bad"] = str(e)
    report = pm.load_pretrained(path)
    out["report"] = {"per_rank": report.per_rank, "model_bytes": report.model_bytes, "line": report.line(),
                     "read_whole": report.read_whole, "tensors": report.tensors}
    out["loss"] = pm.train_step(x, y).item()
    grads = {n: full_tensor(p.grad) for n, p in pm.named_parameters()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (grads, out.get("bad"), out.get("before_load"), report.tensors))
    out["grads"] = {k: v for g, *_ in everyone for k, v in g.items()}
    out["bad_everywhere"] = [b for _, b, _, _ in everyone]
    out["refused_everywhere"] = [r for _, _, r, _ in everyone]
    out["tensors_per_rank"] = [t for *_, t in everyone]
    if evaluate:
        out["logits"] = pm(x)
    out["tied_after"] = pm.module.lm_head.weight is pm.module.model.embed_tokens.weight
    return out


CASES = [  # (id, checkpoint, mesh, plan, build the model with)
    ("fsdp-tied-bf16", "tied", {"dp": 2}, {"dp": "fsdp"}, "torch-meta"),
    ("megatron", "untied", {"tp": 2}, {"tp": "megatron"}, "init-empty"),
    ("pp2-1f1b", "untied", {"pp": 2}, {"pp": "1f1b"}, "torch-meta"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_load_pretrained_into_shards(pools, checkpoints, case):
    cid, ckpt, axes, plan, build = case
    ref = checkpoints["ref"][ckpt]
    megatron = cid == "megatron"
    out = pools(2).run(pretrained_job, checkpoints[ckpt], axes, plan, ckpt == "tied", build,
                       bad=checkpoints["bad"] if megatron else None, evaluate=megatron)
    print(out["report"]["line"])
    # the first step against from_pretrained on one process
    assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5), (out["loss"], ref["loss"])
    assert out["grads"].keys() == ref["grads"].keys()
    for k, g in ref["grads"].items():
        torch.testing.assert_close(out["grads"][k], g, rtol=1e-5, atol=1e-6, msg=f"{cid}: gradient {k}")
    if megatron:
        torch.testing.assert_close(out["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    # rotary tables recomputed (never meta) and on the program's device
    for name in ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"):
        device, values = out["buffers"][name]
        assert device == "cpu" and values[0] == 1.0 and 0 < values[-1] < 1, (name, values)
    # nothing runs before the weights are there, on any rank
    assert all(r is not None and "hold no weights yet" in r and "load_pretrained" in r
               for r in out["refused_everywhere"]), out["refused_everywhere"]
    # what each rank read: its shards only
    model_bytes = out["report"]["model_bytes"]
    per_rank = [b for b, _ in out["report"]["per_rank"]]
    assert out["report"]["read_whole"] == []
    if cid.startswith("fsdp"):  # every parameter sharded on dp: half of the checkpoint each
        assert model_bytes == 2 * sum(g.numel() for g in ref["grads"].values())  # bf16; the tied lm_head not stored
        assert all(b == model_bytes // 2 for b in per_rank), per_rank
        assert out["tied_after"]
    elif megatron:  # sharded on tp except the norms (replicated: read by both)
        norms = 5 * 64 * 4
        assert all(b == (model_bytes - norms) // 2 + norms for b in per_rank), (per_rank, model_bytes)
    else:  # each pipeline rank reads its stages' parameters, the two together the whole model once
        assert sum(per_rank) == model_bytes and all(0 < b < model_bytes for b in per_rank), per_rank
        assert sum(out["tensors_per_rank"]) == len(ref["grads"])
    if megatron:  # a checkpoint that does not fit: refused on both ranks, every problem named
        for msg in out["bad_everywhere"]:
            assert msg is not None
            assert "no tensor for 1 of the model's parameters/buffers: model.layers.1.mlp.up_proj.weight" in msg
            assert "holds 1 tensor(s) this model does not have: model.layers.9.mlp.gate_proj.weight" in msg
            assert "model.norm.weight has shape [65] in the checkpoint but the model's model.norm.weight has " \
                   "shape [64]" in msg
            assert "strict=False" in msg


def strided_job(path: str) -> dict:
    """Parameters whose placements have no contiguous block (_StridedShard) are read whole and
    sliced; a column shard (Shard(1)) is read as a slice; a bf16 tensor lands in fp32."""
    import types

    from torch import nn
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    from autopar.runtime.weights import load_pretrained

    mesh = autopar.mesh(dp=2)
    m = nn.Module()
    m.register_parameter("w", nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [_StridedShard(0, split_factor=2)])))
    m.register_parameter("v", nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)])))
    pm = types.SimpleNamespace(module=m, _tied={}, _unloaded={"w", "v"}, named_parameters=m.named_parameters)
    rep = load_pretrained(pm, path, verbose=False)
    return {"read_whole": rep.read_whole, "per_rank": rep.per_rank, "w": m.w.full_tensor(), "v": m.v.full_tensor(),
            "unloaded": pm._unloaded}


def test_strided_placement_reads_the_parameter_whole(pools, tmp_path):
    from safetensors.torch import save_file

    full = torch.arange(32.0).reshape(8, 4)
    save_file({"w": full.to(torch.bfloat16), "v": full}, str(tmp_path / "model.safetensors"))
    out = pools(2).run(strided_job, str(tmp_path))
    assert out["read_whole"] == ["w"] and out["unloaded"] == set()
    assert torch.equal(out["w"], full) and torch.equal(out["v"], full)
    assert [b for b, _ in out["per_rank"]] == [8 * 4 * 2 + 8 * 2 * 4] * 2  # w whole (bf16), half of v (fp32)


def test_missing_safetensors_is_an_error_that_says_what_to_install(monkeypatch, tmp_path):
    import sys

    from autopar.errors import InputError
    from autopar.runtime.weights import checkpoint_files

    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails as if not installed
    with pytest.raises(InputError, match="pip install safetensors"):
        checkpoint_files(str(tmp_path))


def cut_job(path: str) -> dict:
    """Phi-3 ([q | k | v] with fewer key / value heads, one parameter per part under megatron:
    autopar/unfuse.py) built on meta, compiled on tp=2, loaded: each part reads its rows of the
    file's fused tensor; the module's state dict gives the fused tensor back under its own name."""
    from autopar.models.hf_archs import build_hf

    with autopar.init_empty_weights():
        model, batches, loss_fn = build_hf("Phi-3", num_hidden_layers=1)
    pm = autopar.compile(model, autopar.mesh(tp=2), example_inputs=batches[0], loss_fn=loss_fn,
                         plan={"tp": "megatron"}, capture_eval=False)
    rep = pm.load_pretrained(path, verbose=False)
    parts = sorted(n for n, _ in pm.named_parameters() if ".parametrizations." in n)
    return {"parts": parts, "state": {k: full_tensor(v) for k, v in pm.state_dict().items()},
            "loss": pm.train_step(*batches[0]).item(), "read_whole": rep.read_whole}


def test_a_weight_cut_into_parts_reads_its_rows_of_the_fused_tensor(pools, tmp_path):
    from safetensors.torch import save_file

    from autopar.models.hf_archs import build_hf

    model, batches, loss_fn = build_hf("Phi-3", num_hidden_layers=1)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_file(want, str(tmp_path / "model.safetensors"))
    out = pools(2).run(cut_job, str(tmp_path))
    # (the parts read as slices; gate | up, equal parts, is a strided shard and read whole)
    assert len(out["parts"]) == 3 and out["read_whole"] == ["model.layers.0.mlp.gate_up_proj.weight"], out
    assert set(out["state"]) == set(want)
    for k, v in want.items():
        assert torch.equal(out["state"][k], v), k
    assert out["loss"] == pytest.approx(loss_fn(model(batches[0][0]).logits, batches[0][1]).item(), rel=1e-5)
