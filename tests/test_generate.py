"""pm.generate: greedy decoding with a static KV cache under tensor parallelism (2 gloo ranks,
{"tp": "megatron"}), against references computed independently on one process: Hugging Face's
own ``model.generate(do_sample=False)`` (its dynamic cache, its masks) for HF models, and a loop
of full forwards without any cache for the built-in Llama. Also: the tokens are the same on every
rank, each rank's cache holds 1/tp of the heads (bytes = the formula), eos stopping as HF does
it, and the errors."""

from __future__ import annotations

import pytest
import torch

PROMPT, NEW, BATCH, TP = 8, 12, 2, 2


def build(name: str):
    """A tiny model, seeded (the job gets its weights from the test process)."""
    torch.manual_seed(0)
    if name == "llama":
        from autopar.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig())
    import transformers

    from autopar.models.zoo import HF_TINY

    cls = {"hf_llama": "Llama", "hf_qwen2": "Qwen2", "hf_phi3": "Phi3"}[name]
    extra = {"pad_token_id": 0} if name == "hf_phi3" else {}  # (Phi3Config's default, 32000, is beyond the vocabulary)
    cfg = getattr(transformers, f"{cls}Config")(**HF_TINY, use_cache=False, tie_word_embeddings=False, **extra)
    cfg._attn_implementation = "sdpa"
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
    model.generation_config.eos_token_id = None  # LlamaConfig's default eos (2) would stop HF's generate
    return model


def prompts() -> torch.Tensor:
    return torch.randint(1, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))


def reference(name: str, model, ids, eos=None) -> torch.Tensor:
    """One process, no autopar: HF's generate, or (built-in Llama) full forwards without a cache."""
    with torch.no_grad():
        if name != "llama":
            return model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                                  attention_mask=torch.ones_like(ids))
        x = ids
        for _ in range(NEW):
            x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return x


def generate_job(name: str, state: dict, ids: torch.Tensor, eos: int | None) -> dict:
    import torch.distributed as dist

    import autopar
    from autopar.testing import _ce

    model = build(name)
    model.load_state_dict(state)
    pm = autopar.compile(model, autopar.mesh(tp=dist.get_world_size()), example_inputs=(ids, ids), loss_fn=_ce,
                         plan={"tp": "megatron"}, capture_eval=False)
    out = {"tokens": pm.generate(ids, NEW), "stats": pm.generate_stats}
    if eos is not None:
        out["eos_tokens"] = pm.generate(ids, NEW, eos_token_id=eos)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (out["tokens"], out.get("eos_tokens")))
    out["same_on_every_rank"] = all(torch.equal(t, every[0][0]) and (e is None or torch.equal(e, every[0][1]))
                                    for t, e in every)
    errors = {}
    for what, call in [("too long", lambda: pm.generate(ids, 10_000)),
                       ("ragged", lambda: pm.generate(ids, 2, attention_mask=(ids > 128).long()))]:
        try:
            call()
        except autopar.InputError as e:
            errors[what] = str(e)
    out["errors"] = errors
    out["cut"] = [n for n, _ in pm.named_parameters() if ".parametrizations." in n]
    return out


# Phi-3: q / k / v fused with fewer K/V heads, cut into one parameter per part (autopar/unfuse.py); its
# prefill and decode programs capture the module, whose weight is then the parts' concatenation
@pytest.mark.parametrize("name", ["hf_llama", pytest.param("hf_qwen2", marks=pytest.mark.slow), "llama",
                                  pytest.param("hf_phi3", marks=pytest.mark.slow)])  # (Qwen2 10 s, Phi-3 13 s)
def test_generate_tp2_matches_one_process(pools, name):
    model = build(name)
    ids = prompts()
    expected = reference(name, model, ids)
    # an eos that sequence 0 produces mid-way (HF pads it from then on, and stops once all are done)
    eos = int(expected[0, PROMPT + NEW // 3])
    expected_eos = reference(name, model, ids, eos) if name != "llama" else None
    out = pools(TP).run(generate_job, name, model.state_dict(), ids, eos if name != "llama" else None)

    assert out["same_on_every_rank"]
    assert len(out["cut"]) == (3 * model.config.num_hidden_layers if name == "hf_phi3" else 0), out["cut"]
    assert torch.equal(out["tokens"], expected), (out["tokens"], expected)
    if expected_eos is not None:
        assert expected_eos.shape[1] < PROMPT + NEW or bool((expected_eos[:, PROMPT:] == eos).any())
        assert torch.equal(out["eos_tokens"], expected_eos), (out["eos_tokens"], expected_eos)
    # each rank holds its K/V heads only: 1/tp of the whole cache
    s = out["stats"]
    if name == "llama":
        layers, kv, head_dim = model.cfg.n_layers, model.cfg.n_kv_heads, model.cfg.dim // model.cfg.n_heads
    else:
        c = model.config
        layers, kv, head_dim = c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    whole = 2 * layers * BATCH * kv * (PROMPT + NEW) * head_dim * 4  # fp32
    # (Phi-3: its programs capture the module, whose cut weight is the parts' concatenation; the
    # matmul by it is one matmul per part there too, so K and V, and the cache, are split by heads)
    assert s.cache_shape == (BATCH, kv, PROMPT + NEW, head_dim)
    assert s.cache_local_shape == (BATCH, kv // TP, PROMPT + NEW, head_dim)
    assert s.cache_bytes == whole // TP
    assert s.new_tokens == NEW
    assert s.collectives["decode"] > 0  # the steps communicate (tensor parallel), as compiled
    assert "beyond the model's 64" in out["errors"]["too long"]
    assert "not supported" in out["errors"]["ragged"]


def test_generate_errors(fake):
    """Data-parallel plans and models without a cache path: errors that say what to do."""
    import autopar
    from autopar.testing import build_model

    model, batches, loss_fn = build_model("ce_rules")
    with fake(dp=2) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                             capture_eval=False)
        with pytest.raises(autopar.PlanError, match="data-parallel") as e:
            pm.generate(batches[0][0], 4)
        assert "autopar.mesh(tp=2)" in str(e.value)
    model, batches, loss_fn = build_model("ce_rules")
    with fake(tp=1) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"tp": "megatron"},
                             capture_eval=False)
        with pytest.raises(autopar.PlanError, match="no KV-cache path"):
            pm.generate(batches[0][0], 4)


def test_generate_refuses_to_pass_a_sliding_window(fake):
    """The decode step attends to every cached position: past a model's sliding window it would
    not compute what the model computes, so that is an error, not a silently different answer."""
    import autopar
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8,
                        use_cache=False)
    model = MistralForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 6))

    def ce(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    with fake(tp=1) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=(ids, ids), loss_fn=ce, plan={"tp": "megatron"},
                             capture_eval=False)
        with pytest.raises(autopar.InputError, match=r"sliding attention window \(8\)"):
            pm.generate(ids, 4)
