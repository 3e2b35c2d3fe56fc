"""Generation: ``pm.generate(input_ids, max_new_tokens)``, greedy decoding with a static KV cache.

Two programs, compiled by the compiler (autopar/generation.py, handed to ``ParallelModule`` as
its generation builder) under the training program's plan, mesh and Context, running on its
placed parameters (each rank's local shards, as ``pm(x)`` does: nothing is copied):

    prefill  (ids [B, L], positions [L], *cache) -> logits of the last position [B, V]
    decode   (ids [B, 1], positions [1], *cache) -> logits [B, V]

The cache is a (keys, values) pair per layer, each ``[B, kv_heads, L + max_new_tokens,
head_dim]`` globally, allocated once per call (zeros) and written in place by both programs:
the model's step writes its keys / values with ``index_copy_`` at ``positions``. Every
position attends to the cache through a mask ``cached position <= own position``. The cache's
layout is the plan's (autopar/generation.py says how it is found); the logits come out
replicated, so the argmax, the stop test and the tokens are the same on every rank.

Here: the models' cache paths (what a step is, the cache's shape), the plan check and the
generation loop. This module compiles nothing (tests/test_layout.py: the runtime imports neither
the capture nor the passes).

Models with a cache path: Hugging Face decoder-only models (the step passes a ``Cache`` whose
layers write into the tensors given, an explicit 4-D mask and position ids) and the built-in
Llama (autopar/models/llama.py, ``kv_cache=``). Plans: no data-parallel axis of more than one
rank (a latency plan: every rank decodes the whole batch), no pipeline, no sequence parallelism.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Placement

from autopar.errors import InputError, PlanError
from autopar.ir import Program, info

WHERE = "ParallelModule.generate"


# ---------------------------------------------------------------- models with a cache path
@dataclass(frozen=True)
class CacheShape:
    """A model's KV cache: ``layers`` (keys, values) pairs of ``[B, kv_heads, max_len, head_dim]``."""

    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int | None  # the longest sequence the model's positions cover (None: no limit known)


class _Builtin:
    """autopar.models.llama.Llama: its own ``kv_cache=`` path."""

    name = "the built-in Llama"

    @staticmethod
    def shape(model) -> CacheShape:
        c = model.cfg
        return CacheShape(c.n_layers, c.n_kv_heads, c.dim // c.n_heads, c.max_seq_len)

    @staticmethod
    def step(model, ids, positions, *cache):
        pairs = list(zip(cache[0::2], cache[1::2]))
        return model(ids, kv_cache=pairs, positions=positions)[:, -1, :]


class _HFLayer:
    """One layer of a Hugging Face ``Cache``: keys / values written in place at ``positions``."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys, values, positions):
        self.keys, self.values, self.positions = keys, values, positions
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.positions, key_states)
        self.values.index_copy_(2, self.positions, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, *args, **kwargs):
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _HF:
    """A Hugging Face decoder-only model (``GenerationMixin``): the step passes its own ``Cache``, a
    4-D additive mask (so HF's mask code returns it as is) and the position ids."""

    name = "a Hugging Face model"

    @staticmethod
    def shape(model) -> CacheShape:
        c = model.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        return CacheShape(c.num_hidden_layers, kv, head_dim, getattr(c, "max_position_embeddings", None))

    @staticmethod
    def step(model, ids, positions, *cache):
        from transformers.cache_utils import Cache

        layers = [_HFLayer(k, v, positions) for k, v in zip(cache[0::2], cache[1::2])]
        kv = Cache(layers=layers)
        b, s = ids.shape
        allowed = torch.arange(cache[0].shape[2], device=ids.device) <= positions[:, None]  # [s, max_len]
        dtype = cache[0].dtype
        mask = torch.zeros((), dtype=dtype, device=ids.device).masked_fill(~allowed, torch.finfo(dtype).min)
        out = model(input_ids=ids, attention_mask=mask[None, None].expand(b, 1, s, -1),
                    position_ids=positions[None].expand(b, s), past_key_values=kv, use_cache=True)
        return out.logits[:, -1, :]


def _sliding_window(model: nn.Module) -> int | None:
    """A Hugging Face model's sliding attention window where its layers use one (Mistral, Qwen2 with
    ``use_sliding_window``, Gemma2's alternate layers), else None."""
    c = getattr(model, "config", None)
    w = getattr(c, "sliding_window", None)
    if not isinstance(w, int) or w <= 0 or getattr(c, "use_sliding_window", True) is False:
        return None
    return w


def cache_path(model: nn.Module):
    """The cache path of ``model`` (``_Builtin`` / ``_HF``), or a PlanError saying there is none."""
    from autopar.models.llama import Llama

    if isinstance(model, Llama):
        if model.cfg.n_experts:
            raise PlanError("generation is not supported for the built-in Llama with a mixture-of-experts MLP "
                            "(its capacity dispatch routes per sequence: one token at a time routes differently)",
                            where=WHERE, fix="generate with a dense Llama (n_experts=0)")
        return _Builtin
    try:
        from transformers import GenerationMixin, PreTrainedModel
    except ImportError:  # no transformers: only the built-in model
        GenerationMixin = PreTrainedModel = ()
    if isinstance(model, PreTrainedModel) and isinstance(model, GenerationMixin) \
            and not getattr(model.config, "is_encoder_decoder", False):
        return _HF
    raise PlanError(f"{type(model).__name__} has no KV-cache path autopar can drive", where=WHERE,
                    fix="generate with a Hugging Face decoder-only model (a GenerationMixin, e.g. LlamaForCausalLM) "
                        "or autopar.models.llama.Llama; for another model, run pm(tokens) per token (no cache)")


# ---------------------------------------------------------------- compiling the two programs
@dataclass
class Programs:
    """The prefill and decode programs for one (batch, prompt length, cache length)."""

    prefill: Program
    decode: Program
    layout: tuple[tuple[Placement, ...], ...]  # per cache tensor
    local_shapes: tuple[tuple[int, ...], ...]  # per cache tensor, on this rank
    compile_s: float


@dataclass
class GenerateStats:
    """What the last ``pm.generate`` call did on this rank (``pm.generate_stats``)."""

    batch: int
    prompt: int
    new_tokens: int  # generated (fewer than asked if every sequence stopped at eos)
    cache_shape: tuple[int, ...]  # one cache tensor, global
    cache_local_shape: tuple[int, ...]  # ... on this rank (the first; ``cache_bytes`` counts them all)
    cache_placements: tuple[Placement, ...]
    cache_bytes: int  # every cache tensor this rank holds
    prefill_s: float
    decode_s: float  # all decode steps
    compile_s: float  # 0 when the programs were compiled by an earlier call
    collectives: dict = field(default_factory=dict)  # per program: collectives per call


def check_plan(pm) -> None:
    ctx = pm.ctx
    dp = [(ctx.axis_names[a], ctx.axis_sizes[a]) for a in ctx.dp_axes if ctx.axis_sizes[a] > 1]
    if dp:
        raise PlanError(f"generation runs a latency plan (tensor parallel): this program's plan has data-parallel "
                        f"axes {dp}", where=WHERE,
                        fix="compile the model for generation on a mesh without a data-parallel axis, e.g. "
                            "autopar.mesh(tp=2) with plan={'tp': 'megatron'}")
    seq = [a.axis for i, a in enumerate(ctx.plan.axes) if a.strategy == "sequence"
           or (a.context_parallel and ctx.axis_sizes[i] > 1)]
    if seq:
        raise PlanError(f"generation does not support sequence or context parallelism (axis {seq[0]!r}): decode "
                        "steps have one token, nothing to split over the sequence", where=WHERE,
                        fix=f"compile with plan={{{seq[0]!r}: 'megatron'}} for generation")


def param_dtype(module) -> torch.dtype:
    """The dtype of the model's floating-point parameters (the cache's, without a compute dtype)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


# ---------------------------------------------------------------- the generation loop
def generate(pm, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
             pad_token_id: int | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """See ``ParallelModule.generate``."""
    from autopar.runtime import failure

    check_plan(pm)
    path = cache_path(pm.module)
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point() \
            or input_ids.is_complex() or input_ids.shape[1] == 0:
        raise InputError(f"input_ids must be an int tensor [batch, prompt length], got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}", where=WHERE)
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}", where=WHERE)
    if attention_mask is not None and not bool((attention_mask == 1).all()):
        raise InputError("prompts of different lengths (an attention_mask with padding) are not supported", where=WHERE,
                         fix="generate each group of equal-length prompts in its own call")
    b, prompt = input_ids.shape
    max_len = prompt + max_new_tokens
    shape = path.shape(pm.module)
    if shape.max_positions is not None and max_len > shape.max_positions:
        raise InputError(f"prompt ({prompt}) + max_new_tokens ({max_new_tokens}) = {max_len} positions, beyond the "
                         f"model's {shape.max_positions}", where=WHERE,
                         fix=f"ask for at most {shape.max_positions - prompt} new tokens, or shorten the prompt")
    window = _sliding_window(pm.module)
    if window is not None and max_len > window:
        raise InputError(f"prompt ({prompt}) + max_new_tokens ({max_new_tokens}) = {max_len} positions, beyond the "
                         f"model's sliding attention window ({window}): the decode step attends to every cached "
                         "position, so it would not compute what the model computes past the window", where=WHERE,
                         fix=f"generate at most {window} positions in all")
    emb = pm.module.get_input_embeddings() if hasattr(pm.module, "get_input_embeddings") \
        else getattr(pm.module, "embed_tokens", None)
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is not None and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise InputError(f"input_ids hold ids outside [0, {vocab})", where=WHERE,
                         fix="check the tokenizer's vocabulary against the model's")
    if pm._unloaded:
        raise InputError(f"the model's weights are not loaded yet ({sorted(pm._unloaded)[0]}, ...)", where=WHERE,
                         fix="pm.load_pretrained(path) or pm.load(checkpoint) first")
    key = (b, prompt, max_len)
    compiled = 0.0
    if key not in pm._generation:
        if pm._generation_builder is None:
            raise InputError("this program was built without a generation builder: nothing compiles generation's "
                             "programs", where=WHERE, fix="build it with autopar.compile")
        try:
            programs = pm._generation_builder(pm, path, b, prompt, max_len)
        except BaseException as e:
            failure.agree(e, pm.timeout, "pm.generate (compiling its programs)")
            raise
        failure.agree(None, pm.timeout, "pm.generate (compiling its programs)")
        pm._generation[key] = programs
        compiled = programs.compile_s
    programs = pm._generation[key]
    dev = pm.ctx.device
    dtype = pm.ctx.compute_dtype or param_dtype(pm.module)
    cache = [torch.zeros(shape, dtype=dtype, device=dev) for shape in programs.local_shapes]
    ids = input_ids.to(dev)
    pad = pad_token_id if pad_token_id is not None else eos_token_id
    out = [ids]
    unfinished = torch.ones(b, dtype=torch.bool, device=dev)
    with failure.call(pm, "generate") as call:
        call.communicating()
        t0 = time.perf_counter()
        logits, = pm._run_program(programs.prefill, [ids, torch.arange(prompt, device=dev), *cache])
        t1 = time.perf_counter()
        for i in range(max_new_tokens):
            tok = logits.argmax(-1)
            if eos_token_id is not None:
                tok = torch.where(unfinished, tok, torch.full_like(tok, pad))
                unfinished &= tok != eos_token_id
            out.append(tok[:, None])
            if i == max_new_tokens - 1 or not bool(unfinished.any()):
                break
            pos = torch.tensor([prompt + i], device=dev)
            logits, = pm._run_program(programs.decode, [tok[:, None], pos, *cache])
        t2 = time.perf_counter()
    tokens = torch.cat(out, dim=1)
    pm.generate_stats = GenerateStats(
        b, prompt, tokens.shape[1] - prompt, (b, shape.kv_heads, max_len, shape.head_dim), programs.local_shapes[0],
        programs.layout[0], sum(t.numel() * t.element_size() for t in cache), t1 - t0, t2 - t1, compiled,
        {name: len([n for n in p.local.graph.nodes if info(n).comm is not None])
         for name, p in (("prefill", programs.prefill), ("decode", programs.decode))})
    return tokens
