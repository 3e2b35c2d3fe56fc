"""Hugging Face causal-LM architectures at tiny sizes, for the architecture-breadth check.

``ARCHS`` names the most used causal-LM families of ``transformers`` (its ``model_type``s), each
built from its config class with random weights (no download): 2 layers, hidden 64, 4 heads,
vocab 128, and what each family needs on top (few experts, small rotary dims...). Every model
keeps the attention implementation transformers picks for it (SDPA where it has one, eager
otherwise), so the sweep sees the code users run.

``breadth_job`` (on every rank of a ``DistPool``) compiles one of them under a plan, trains
``STEPS`` AdamW steps and returns the losses, gradients and gathered parameters of every step and
the eval forward; ``breadth_reference`` builds the same model on one process, and ``compare``
checks every step against it (benchmarks/hf_breadth.py: the full table; tests/test_hf_breadth.py:
the architectures that needed a fix).
"""

from __future__ import annotations

import copy

import torch

from autopar.runtime.common import full_tensor

BATCH, SEQ, VOCAB, STEPS, LR = 4, 16, 128, 2, 1e-2
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=16, use_cache=False,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_DROP = object()  # a COMMON field the config class does not accept

# display name -> (model_type, config fields on top of COMMON)
ARCHS: dict[str, tuple[str, dict]] = {
    "Llama": ("llama", {}),
    "Mistral": ("mistral", {}),
    "Qwen2": ("qwen2", {}),
    "Qwen3": ("qwen3", {}),
    "Gemma": ("gemma", {}),
    "Gemma2": ("gemma2", {}),
    "Gemma3": ("gemma3_text", {}),
    "Phi": ("phi", {}),
    "Phi-3": ("phi3", {}),
    "GPT-2": ("gpt2", {}),
    "GPT-Neo": ("gpt_neo", dict(attention_types=[[["global", "local"], 1]], window_size=8)),
    "GPT-NeoX": ("gpt_neox", {}),
    "GPT-J": ("gptj", dict(rotary_dim=8)),
    "OPT": ("opt", dict(ffn_dim=128, word_embed_proj_dim=64)),
    "BLOOM": ("bloom", {}),
    "Falcon": ("falcon", dict(head_dim=_DROP)),
    "MPT": ("mpt", {}),
    "Mixtral": ("mixtral", _MOE),
    "Qwen2-MoE": ("qwen2_moe", dict(_MOE, shared_expert_intermediate_size=64)),
    "Qwen3-MoE": ("qwen3_moe", _MOE),
    "gpt-oss": ("gpt_oss", _MOE),
    "DeepSeek-V3": ("deepseek_v3", dict(_MOE, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
                                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
                                        num_key_value_heads=4)),
    "Mamba": ("mamba", dict(state_size=8, expand=2, conv_kernel=4)),
    "StableLM": ("stablelm", {}),
    "Starcoder2": ("starcoder2", {}),
    "Cohere": ("cohere", {}),
    "OLMo": ("olmo", {}),
    "OLMo2": ("olmo2", {}),
    "Granite": ("granite", {}),
    "GLM": ("glm", {}),
    "CodeGen": ("codegen", dict(rotary_dim=8)),
    "GPTBigCode": ("gpt_bigcode", {}),
    "SmolLM3": ("smollm3", {}),
    "Helium": ("helium", {}),
}

PLANS = {"fsdp": ({"dp": 2}, {"dp": "fsdp"}),
         "megatron": ({"tp": 2}, {"tp": "megatron"}),  # placements derived from the graph: no rules, no "rest"
         "sequence": ({"tp": 2}, {"tp": "sequence"})}
# beyond the sweep's two (tests/test_hf_breadth.py: tied embeddings under each)
MORE_PLANS = {"fsdp+megatron": ({"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "megatron"}),
              "pp": ({"pp": 2}, {"pp": "1f1b"}),
              "ep": ({"ep": 2}, {"ep": "expert"}),  # MoE families whose experts autopar swaps (autopar/experts.py)
              "fsdp+ep": ({"dp": 2, "ep": 2}, {"dp": "fsdp", "ep": "expert"})}


def _ce(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def hf_config(model_type: str, extra: dict, **overrides):
    """The tiny config of ``model_type``: COMMON's sizes, ``extra`` and ``overrides`` on top (a
    field set to ``_DROP`` left to the model's default), dropout off: the references are eager torch,
    whose masks autopar does not draw (tests/test_dropout.py)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in {**COMMON, **extra, **overrides}.items() if v is not _DROP}
    cfg = AutoConfig.for_model(model_type, **fields)
    nested = _nested(cfg, fields)
    if nested:
        cfg = AutoConfig.for_model(model_type, **fields, **nested)
    for c in [cfg] + [getattr(cfg, key, None) for key in getattr(type(cfg), "sub_configs", None) or {}]:
        for k, v in (c.to_dict().items() if hasattr(c, "to_dict") else ()):  # (Emu3's text config's own 0.1)
            if ("dropout" in k or "pdrop" in k) and isinstance(v, float):
                setattr(c, k, 0.0)
    return cfg


def _nested(cfg, fields: dict) -> dict:
    """For a composite config (a multimodal model's text and vision configs, BLT's patcher / encoder /
    decoder / global ones): each sub-config's share of ``fields`` (those it has), so that the text
    model a batch of tokens reaches is built at the tiny sizes too, and the towers beside it are
    small, not the default-size ones an 8B text config or a 400M vision tower would make."""
    out = {}
    for key in getattr(type(cfg), "sub_configs", None) or {}:
        sub = getattr(cfg, key, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        own = sub.to_dict()
        mine = {k: v for k, v in fields.items() if k in own}
        if any(own[k] != v for k, v in mine.items()):  # not built from the flat fields already
            # on top of the defaults the composite config gives this sub-config (Fuyu's Persimmon: relu2...)
            spec = (getattr(type(cfg), "sub_configs_defaults", None) or {}).get(key)
            base = dict(getattr(spec, "init_kwargs", None) or {})
            out[key] = {**({"model_type": own["model_type"]} if "model_type" in own else {}), **base, **mine}
    return out


def build_hf(name: str, seed: int = 0, seq: int = SEQ, router_aux: float = 0.0, **overrides):
    """(model, batches, loss_fn) for ``ARCHS[name]``, or for a transformers ``model_type`` not
    in it (with the MoE fields, as benchmarks/hf_tp_sweep.py builds it) (``overrides``: config fields on top);
    batches are GLOBAL (tokens, targets) of ``seq`` tokens. ``router_aux``: a MoE model is wrapped
    in ``RouterAux`` and the loss adds ``router_aux`` x its load-balancing loss."""
    import transformers

    transformers.logging.set_verbosity_error()
    model_type, extra = ARCHS[name] if name in ARCHS else (name, _MOE)  # any model_type, as the sweep builds it
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randint(3, VOCAB, (BATCH, seq), generator=g),
                torch.randint(0, VOCAB, (BATCH, seq), generator=g)) for _ in range(STEPS)]
    model = _built(model_type, extra, seed, overrides, batches[0][0] if name not in ARCHS else None)
    if model is None:  # as the sweep: maybe a latent-attention family (DSA's indexer on MLA): DeepSeek-V3's fields on top
        model = _built(model_type, {**extra, **ARCHS["DeepSeek-V3"][1]}, seed, overrides)
    if router_aux:
        # transformers installs the hooks that collect router logits on the model's first call, under
        # a threading lock dynamo cannot trace: that call happens here, eagerly
        with torch.no_grad():
            model(batches[0][0][:1, :2], output_router_logits=True)
        return RouterAux(model), batches, _ce_with_aux(router_aux)
    return model, batches, _ce


def _built(model_type: str, extra: dict, seed: int, overrides: dict, tokens=None):
    """The model of the tiny config; with ``tokens``, None where the config or one eager forward
    of two of them fails (fields that do not fit the architecture)."""
    from transformers import AutoModelForCausalLM

    try:
        cfg = hf_config(model_type, extra, **overrides)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
        if tokens is not None:
            with torch.no_grad():
                model(tokens[:1, :2])
        return model
    except Exception:  # noqa: BLE001 - the fields do not fit this architecture
        if tokens is None:
            raise
        return None


class RouterAux(torch.nn.Module):
    """A Hugging Face MoE causal LM returning (logits, its load-balancing loss) (``build_hf(router_aux=...)``)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        out = self.lm(tokens, output_router_logits=True)
        return out.logits, out.aux_loss


def _ce_with_aux(coef: float):
    def loss(out, targets):
        logits, aux = out
        return _ce(logits, targets) + coef * aux
    return loss


def _logits(out):
    from autopar.capture import _unwrap_output

    return _unwrap_output(out)


def _eval_logits(out):
    """The logits of an eval forward (``RouterAux``'s first output)."""
    out = _logits(out)
    return out[0] if isinstance(out, (tuple, list)) else out


def breadth_reference(name: str, **overrides) -> dict:
    """The eager side of ``compare``: the same model (same init) and batches, on one process."""
    model, batches, loss_fn = build_hf(name, **overrides)
    return {"model": model, "batches": batches, "loss_fn": loss_fn}


def breadth_job(name: str, plan_name: str, debug: bool = True, **overrides) -> dict:
    """On every rank of a pool: compile ``name`` under ``PLANS[plan_name]``, train ``STEPS`` AdamW
    steps; returns every step's loss and gradients, the parameters before every step and after the
    last (gathered), the eval forward, and the names of the rules that decided the training
    program's ops."""
    import autopar
    from autopar.ir import info
    from autopar.parts import fuse

    import torch.distributed as dist

    axes, plan = {**PLANS, **MORE_PLANS}[plan_name]
    model, batches, loss_fn = build_hf(name, **overrides)
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=batches[0], loss_fn=loss_fn, plan=plan,
                         debug=debug, capture_eval="pp" not in plan)  # (no eval forward for pipelines)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)

    def merged(local: dict) -> dict:  # a pipeline rank holds its stages' parameters only
        if pm.pipelined:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, local)
            local = {k: v for d in everyone for k, v in d.items()}
        return fuse(local, pm.module)  # (a fused weight cut into parts: autopar/unfuse.py)

    def gathered():  # a copy: full_tensor() of a replicated parameter is the parameter's own storage
        return merged({n: full_tensor(p.detach()).clone() for n, p in pm.named_parameters()})

    losses, grads, params = [], [], [gathered()]
    for x, y in batches:
        losses.append(pm.train_step(x, y).item())
        grads.append(merged({n: full_tensor(p.grad).clone() for n, p in pm.named_parameters()
                             if p.grad is not None}))
        opt.step()
        opt.zero_grad()
        params.append(gathered())
    if pm.pipelined:  # (no eval forward for pipelines yet)
        return {"losses": losses, "grads": grads, "params": params, "eval": None, "rules": []}
    evaluated = _eval_logits(pm(batches[0][0]))
    rules = sorted({info(n).rule.name for n in pm.program.graph.nodes if info(n).rule is not None})
    return {"losses": losses, "grads": grads, "params": params, "eval": evaluated, "rules": rules,
            "tp_sharded": tp_sharded(pm)}


def tp_sharded(pm) -> float | None:
    """The share of the repeated blocks' matrix parameters (elements of those with 2+ dims of size
    > 1: RWKV's [1, 1, hidden] mixing vectors are no matrix) that a tensor-parallel axis ("tp")
    shards, of those the program reads (a multimodal model's vision tower, which a batch of
    tokens never reaches, is left out); None without one."""
    from torch.distributed.tensor.placement_types import Replicate

    from autopar.ir import info
    from autopar.modpath import block_of

    ctx = pm.ctx
    if "tp" not in ctx.axis_names:
        return None
    i = ctx.axis_names.index("tp")
    # what the program reads: the captured graph's parameter inputs that some node uses
    read = {info(p).role[1] for p in pm.program.graph.nodes
            if p.op == "placeholder" and p.users and (info(p).role or ("",))[0] == "param"}
    mats = {n: p for n, p in pm.module.named_parameters()
            if sum(s > 1 for s in p.shape) >= 2 and block_of(n) and n in read}
    total = sum(p.numel() for p in mats.values())
    sharded = sum(p.numel() for n, p in mats.items() if not isinstance(ctx.placed.compute[n][i], Replicate))
    return sharded / total if total else None



def compare(ref: dict, out: dict) -> str | None:
    """None when the compiled run matches one process, else what differs first. Each step is
    checked from the compiled run's own parameters, so that the check is not chaotic: after one
    AdamW step the two runs' parameters differ by what Adam makes of fp32 noise (a gradient of
    -4.9e-10 on one process and -2.4e-9 on two, i.e. zero, moves by up to a whole step either way:
    seen on OLMo), and that difference grows with every step.

    - the parameters before the first step are the model's own (the compile changed nothing);
    - at every step, the loss (1e-4) and the gradients (1e-4 relative + 3e-5 absolute, as
      tests/test_parity.py) against eager forward + backward at the compiled run's parameters;
    - AdamW on one process, fed the compiled run's gradients, gives the parameters it had after
      every step (1e-6);
    - the eval forward (1e-4) against eager forward with the final parameters (not for pipelines)."""
    model, batches, loss_fn = copy.deepcopy(ref["model"]), ref["batches"], ref["loss_fn"]
    names = [n for n, _ in model.named_parameters()]
    if set(out["params"][0]) != set(names):
        return f"parameter names differ: {sorted(set(out['params'][0]) ^ set(names))[:4]}"

    def differ(got: dict, want: dict, what: str, rtol: float, atol: float) -> str | None:
        for k, w in want.items():
            if k not in got:
                return f"{what}: {k} missing"
            if not torch.allclose(got[k], w, rtol=rtol, atol=atol):
                return f"{what}: {k} off by {(got[k] - w).abs().max().item():.1e}"
        return None

    why = differ(out["params"][0], dict(model.named_parameters()), "initial parameter", 0, 0)
    if why:
        return why
    shadow = {n: p.detach().clone() for n, p in model.named_parameters()}  # AdamW fed the compiled gradients
    opt = torch.optim.AdamW(shadow.values(), lr=LR)
    for step, (x, y) in enumerate(batches):
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(out["params"][step][k])
        model.zero_grad()
        loss = loss_fn(_logits(model(x)), y)
        loss.backward()
        if abs(out["losses"][step] - loss.item()) > 1e-4 * max(1.0, abs(loss.item())):
            return f"loss at step {step}: {out['losses'][step]:.6f} vs {loss.item():.6f}"
        want = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        why = differ(out["grads"][step], want, f"gradient at step {step}", 1e-4, 3e-5)
        if why:
            return why
        for k, p in shadow.items():
            p.grad = out["grads"][step].get(k)
        opt.step()
        why = differ(out["params"][step + 1], shadow, f"parameter after AdamW step {step}", 0, 1e-6)
        if why:
            return why
    if out["eval"] is None:
        return None
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(out["params"][-1][k])
        expected = _eval_logits(model(batches[0][0]))
    d = (out["eval"] - expected).abs().max().item()
    return f"eval forward off by {d:.1e}" if d > 1e-4 else None
