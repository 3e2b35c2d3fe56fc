"""Models by name, for the command line: built-in shapes and ``package.module:factory`` specs.

A spec is either

- ``package.module:factory``: a function (importable from the current directory or
  ``PYTHONPATH``) returning ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``;
  example inputs are the GLOBAL batch. ``module.py:factory`` (a file path) works too;
- a built-in name (``autopar dump --list-models``): Llama / GPT / MoE shapes from tiny to 70B on
  the project's own decoder, and Hugging Face model classes built from their config class with
  random weights (no download), e.g. ``hf-llama-tiny``, ``hf-llama3-8b``, ``hf-mistral-tiny``.

Built-in models are created on the meta device when ``meta=True`` (the command line's default:
planning needs shapes, not values), so a 70B model costs no memory. ``overrides`` change config
fields (``n_layers=4``, ``num_hidden_layers=4``...) and ``batch`` / ``seq`` the example batch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from autopar.errors import PlanError

# name: (family, config fields, default global batch, default sequence length, description)
_LLAMA = "llama"
_HF = "hf"
# the test suite's model is LlamaConfig's defaults (vocab 256, dim 64, 2 layers, 4 heads / 2 KV, ffn 128)
LLAMA_SMALL = dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=256)
HF_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)  # tests' HF models too (testing.build_model)
HF_SMALL = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=256)  # LLAMA_SMALL's shapes (autopar bench --model)
_LLAMA3 = dict(vocab_size=128256, n_kv_heads=8, max_seq_len=8192, rope_theta=500000.0)


def _hf(cls: str, model: str, **fields) -> dict:
    return dict(cls=cls, model=model, **fields)


BUILTINS: dict[str, tuple[str, dict, int, int, str]] = {
    "llama-tiny": (_LLAMA, {}, 4, 16, "the test suite's Llama (2 layers, dim 64, GQA)"),
    "llama-small": (_LLAMA, LLAMA_SMALL, 8, 256, "the benchmark harness's Llama (4.2M parameters)"),
    "gpt-tiny": (_LLAMA, dict(n_kv_heads=4, ffn_dim=256, mlp="gelu"), 4, 16,
                 "GPT-style block (GELU MLP with biases, MHA)"),
    "moe-tiny": (_LLAMA, dict(n_experts=4, top_k=2), 4, 16, "Llama with a top-2 of 4 experts MoE MLP"),
    "moe-tiny-dropless": (_LLAMA, dict(n_experts=4, top_k=2, moe_dispatch="dropless"), 4, 16,
                          "moe-tiny computing every token-expert pair (no capacity): expert parallelism's MoE"),
    "llama3-8b": (_LLAMA, dict(_LLAMA3, dim=4096, n_layers=32, n_heads=32, ffn_dim=14336), 8, 2048,
                  "Llama-3 8B shapes"),
    "llama3-70b": (_LLAMA, dict(_LLAMA3, dim=8192, n_layers=80, n_heads=64, ffn_dim=28672), 8, 2048,
                   "Llama-3 70B shapes"),
    "mixtral-8x7b": (_LLAMA, dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                  max_seq_len=4096, n_experts=8, top_k=2, rope_theta=1e6), 8, 1024,
                     "Mixtral 8x7B shapes on the project's MoE block (GShard-style dispatch)"),
    "hf-llama-tiny": (_HF, _hf("LlamaConfig", "LlamaForCausalLM", **HF_TINY), 4, 16,
                      "transformers LlamaForCausalLM, tiny config, random weights"),
    "hf-llama3-8b": (_HF, _hf("LlamaConfig", "LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                              intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0), 8, 2048,
                     "transformers LlamaForCausalLM with Llama-3 8B's config"),
    "hf-llama3-70b": (_HF, _hf("LlamaConfig", "LlamaForCausalLM", vocab_size=128256, hidden_size=8192,
                               intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                               num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0), 8, 2048,
                      "transformers LlamaForCausalLM with Llama-3 70B's config"),
    "hf-mistral-tiny": (_HF, _hf("MistralConfig", "MistralForCausalLM", **HF_TINY), 4, 16,
                        "transformers MistralForCausalLM, tiny config"),
    "hf-qwen2-tiny": (_HF, _hf("Qwen2Config", "Qwen2ForCausalLM", **HF_TINY), 4, 16,
                      "transformers Qwen2ForCausalLM, tiny config (q/k/v biases)"),
    "hf-qwen2-small": (_HF, _hf("Qwen2Config", "Qwen2ForCausalLM", **HF_SMALL), 8, 128,
                       "transformers Qwen2ForCausalLM with llama-small's shapes (4.2M parameters)"),
}


@dataclass
class Loaded:
    model: torch.nn.Module
    example_inputs: tuple
    loss_fn: Callable | None
    name: str


def _ce(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def _coerce(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def parse_overrides(items) -> dict:
    out = {}
    for item in items or ():
        for kv in item.split(","):
            if "=" not in kv:
                raise PlanError(f"bad model override {kv!r}", where="--set", fix="write key=value, e.g. n_layers=4")
            k, v = kv.split("=", 1)
            out[k.strip()] = _coerce(v.strip())
    return out


def describe_builtins() -> str:
    lines = ["built-in models (MODEL argument):"]
    for name, (_, _, b, s, what) in BUILTINS.items():
        lines.append(f"  {name:16s} {what} (default batch {b} x {s})")
    lines.append("  or package.module:factory  (returns (model, example_inputs[, loss_fn]))")
    return "\n".join(lines)


def load(spec: str, *, meta: bool = True, batch: int | None = None, seq: int | None = None,
         overrides: dict | None = None, seed: int = 0) -> Loaded:
    if ":" in spec:
        return _load_factory(spec)
    if spec not in BUILTINS:
        import difflib

        close = difflib.get_close_matches(spec, list(BUILTINS), n=3)
        raise PlanError(f"unknown model {spec!r}", where="MODEL argument",
                        fix=(f"did you mean {' or '.join(close)}? " if close else "")
                        + f"use a built-in name ({', '.join(BUILTINS)}) or package.module:factory")
    family, fields, b, s, _ = BUILTINS[spec]
    fields = {**fields, **(overrides or {})}
    b, s = batch or b, seq or s
    torch.manual_seed(seed)
    device = torch.device("meta") if meta else torch.device("cpu")
    if family == _LLAMA:
        from autopar.models.llama import Llama, LlamaConfig, cross_entropy

        try:
            cfg = LlamaConfig(**fields)
        except TypeError as e:
            raise PlanError(f"bad override for {spec}: {e}", where="--set",
                            fix=f"fields: {', '.join(LlamaConfig.__dataclass_fields__)}") from None
        if s > cfg.max_seq_len:
            cfg.max_seq_len = s
        with device:
            model = Llama(cfg)
        loss_fn = cross_entropy
        vocab = cfg.vocab_size
    else:
        try:
            import transformers
        except ImportError:
            raise PlanError(f"{spec} needs the transformers package", where="MODEL argument",
                            fix="pip install transformers (or pip install -e '.[test]')") from None
        fields = dict(fields)
        cls, model_cls = fields.pop("cls"), fields.pop("model")
        cfg = getattr(transformers, cls)(use_cache=False, tie_word_embeddings=False, **fields)
        cfg._attn_implementation = "sdpa"
        if s > cfg.max_position_embeddings:
            cfg.max_position_embeddings = s
        with device:
            model = getattr(transformers, model_cls)(cfg)
        loss_fn = _ce  # the front end hands the loss the output's logits
        vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    if meta:
        tokens = torch.empty((b, s), dtype=torch.long, device="meta")
        targets = torch.empty((b, s), dtype=torch.long, device="meta")
    else:
        tokens = torch.randint(0, vocab, (b, s), generator=g)
        targets = torch.randint(0, vocab, (b, s), generator=g)
    return Loaded(model, (tokens, targets), loss_fn, spec)


def _load_factory(spec: str) -> Loaded:
    mod_name, _, fn_name = spec.rpartition(":")
    where = f"MODEL argument {spec!r}"
    if not mod_name or not fn_name:
        raise PlanError(f"bad model spec {spec!r}", where=where, fix="write package.module:factory")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            if not os.path.exists(mod_name):
                raise PlanError(f"no such file {mod_name!r}", where=where)
            path = os.path.abspath(mod_name)
            name = os.path.basename(mod_name)[:-3]
            module = sys.modules.get(name)
            if getattr(module, "__file__", None) != path:
                if module is not None:  # another module by that name: this file's under its own
                    name = f"autopar_factory_{abs(hash(path)):x}_{name}"
                module_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(module_spec)
                # registered as imported modules are: dynamo and pickle look a function's module up by name
                sys.modules[name] = module
                module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except PlanError:
        raise
    except ModuleNotFoundError as e:
        raise PlanError(f"cannot import {mod_name!r}: {e}", where=where,
                        fix="run from the directory that contains it, or add it to PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise PlanError(f"importing {mod_name!r} failed: {type(e).__name__}: {e}", where=where) from None
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise PlanError(f"{mod_name!r} has no function {fn_name!r}", where=where,
                        fix=f"callables there: {', '.join(names[:12]) or 'none'}")
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the user's factory failed
        raise PlanError(f"{spec}() raised {type(e).__name__}: {e}", where=where) from e
    if not isinstance(out, tuple) or len(out) not in (2, 3) or not isinstance(out[0], torch.nn.Module):
        raise PlanError(f"{spec} must return (model, example_inputs) or (model, example_inputs, loss_fn), "
                        f"got {type(out).__name__}", where=where)
    model, example = out[0], out[1]
    example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    if not all(isinstance(x, torch.Tensor) for x in example):
        raise PlanError("example_inputs must be tensors (the global batch)", where=where)
    return Loaded(model, example, out[2] if len(out) == 3 else None, spec)


def random_batches(cfg, n: int, batch: int, seq: int):
    """``n`` (tokens, next tokens) pairs of shape [batch, seq], the same on every call. ``cfg``: a
    config with ``vocab_size``, or the vocabulary size."""
    vocab = getattr(cfg, "vocab_size", cfg)
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out
