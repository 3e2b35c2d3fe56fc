"""``autopar.compile``'s options, spelled once.

``CompileOptions``: every keyword ``autopar.compile`` takes, as given, with its default (frozen;
``dataclasses.replace`` makes a changed copy). ``autopar.compile(model, mesh, **kw)`` builds one
from its keywords (``CompileOptions.of``); the command line and the planner build one and hand it
to ``compiler.compile_with`` / ``compiler.build``. ``compiler.validate`` checks it against the model
and the mesh and derives ``Options``: what the passes read as ``state.options``, the given options
(``.given``) plus what was derived from them (dtypes, the parsed plan, the pipeline, ...).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from autopar.pipeline_plan import PipelineSetup
from autopar.plan import Plan


@dataclass(frozen=True)
class CompileOptions:
    """``autopar.compile``'s keywords as given (compile's docstring says what each does)."""

    example_inputs: tuple | None = None  # the global example batch (global shapes): what capture traces
    loss_fn: Callable | None = None  # loss_fn(model(*inputs[:-1]), inputs[-1]); None: the model returns its loss
    plan: dict | str | None = None  # axis -> strategy ({"dp": "fsdp", "tp": "megatron"}), or "auto"
    inputs: str = "global"  # "global": the batch is the global one, split here; "local": each rank's own
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16": the compute dtype (fp32 master parameters)
    reduce_dtype: str | None = None  # the dtype gradients are reduced in (None: the compute dtype)
    loss_scale: str | float = "dynamic"  # fp16 only: "dynamic" or a fixed scale
    accumulate: int = 1  # micro-batches per step, gradients synchronised once
    recompute: str = "none"  # "none" | "full" | "selective"
    debug: bool = False  # the full checker after every pass, the passes' before/after
    skip_passes: tuple[str, ...] = ()  # passes left out, by name (passes/__init__.py)
    progress: Callable[[str], None] | None = None  # called with each stage's name as it starts
    capture_eval: bool | str = True  # the forward-only program: at its first call / "compile" / False (none)
    pipeline_stages: str = "local"  # "all": also compile the stages other ranks hold (planning tools)
    kernels: str = "auto"  # "on" | "off" | "auto": autopar's Triton kernels (compiler._kernels_option)
    bucket_mb: float = 25  # MiB of gradients per bucketed collective (DDP's bucket_cap_mb: passes/bucket.py); 0: none
    prefetch: int = 1  # parameter gathers issued this many blocks ahead (passes/gather.py); 0: none
    reshard_after_forward: bool | None = None  # ZeRO-3 / fsdp: passes/state.py reshard_policy
    memory_budget: int | str | None = None  # bytes per rank for the predicted step peak (analysis/budget.py)
    timeout: float = 60.0  # seconds a wait of a step may block (autopar/runtime/failure.py)
    straggler_threshold: float | None = 1.2  # autopar/runtime/steptimes.py; None: no check
    straggler_window: int = 100  # steps between straggler checks
    inductor: bool = False  # compile each per-rank program's compute (autopar/runtime/inductor.py)

    @classmethod
    def of(cls, keywords: dict) -> CompileOptions:
        """The options from ``autopar.compile``'s keywords; an unknown one is a TypeError, as a
        misspelt keyword of a function's is."""
        unknown = sorted(set(keywords) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"autopar.compile() got an unexpected keyword argument {unknown[0]!r}")
        return cls(**keywords)


def compile_signature(head: list[inspect.Parameter]) -> inspect.Signature:
    """``head`` followed by every option as a keyword-only parameter with its default: the
    signature ``autopar.compile`` shows (``help``, ``inspect.signature``), from the one spelling."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(head + [inspect.Parameter(f.name, kw, default=f.default, annotation=f.type)
                                     for f in fields(CompileOptions)])


@dataclass(frozen=True)
class Options:
    """``CompileOptions`` validated against the model and the mesh (``compiler.validate``): what the
    passes read (``state.options``). ``given`` holds the options as given; the other fields are what
    was derived from them (each names its source)."""

    given: CompileOptions
    plan: dict  # given.plan, or {} (plan="auto" resolved before: compiler._auto)
    parsed: Plan  # the plan on the mesh the stages run on (without a pipeline axis)
    compute_dtype: torch.dtype | None  # given.precision; None: fp32 throughout
    reduce_dtype: torch.dtype | None  # given.reduce_dtype, or the compute dtype
    loss_scale: str | float | None  # given.loss_scale under fp16; None otherwise
    lower: str  # given.kernels resolved: "off" (no lower pass), "on" (every match), "auto" (per op, timed)
    skip: tuple[str, ...]  # given.skip_passes, checked
    pipeline: PipelineSetup | None  # the pipeline axis of given.plan, validated, with its schedule
    memory_budget: int | None  # given.memory_budget in bytes
    # the model's parameters are meta and the batch real (``deferred_weights``): traced on meta, run on the
    # mesh's device, parameters materialized as empty local shards for pm.load_pretrained / pm.load
    deferred: bool
    timeout: float  # given.timeout as a float
    straggler_threshold: float | None  # given.straggler_threshold as a float
