"""Front end: an unmodified nn.Module (+ loss) becomes a joint forward+backward ATen graph.

torch APIs used, and why. All but torch.export are private; like every private torch name
autopar uses, they are looked up in autopar/torch_compat.py (the torch boundary), which says
what autopar does on a torch that lacks one:

- ``torch._dynamo.functional_export._dynamo_graph_capture_for_export``: dynamo capture of the
  user's Python into an FX graph with parameters lifted, keeping ``stack_trace`` and
  ``nn_module_stack`` so every node can name the user's source line.
- ``torch._dynamo.functional_export._suggest_or_raise_constraint_violation``: skipped for
  autopar's own captures, which have no dynamic shapes (``torch_compat.static_export``: it builds
  the compiled frame's guards only to look for violated dynamic-shape constraints).
- ``torch._functorch.aot_autograd.aot_export_joint_with_descriptors``: AOTAutograd traces the
  forward and the autograd backward together into one functional ATen graph under
  FakeTensorMode; each placeholder/output carries a descriptor (``ParamAOTInput``,
  ``GradAOTOutput``...) so we know which gradient belongs to which parameter without
  relying on positions. It is the API meta-pytorch/autoparallel is built on.
- ``torch.export.export`` (+ ``run_decompositions``, attention kept whole) for the forward-only
  (eval) program and generation's prefill / decode programs: public, and it names parameters in
  its graph signature (and the inputs a program updates in place: the KV cache).
- ``torch.nn.utils.stateless._reparametrize_module``: ``torch.func.functional_call``'s context,
  for a mixed-precision generation step, which calls the model otherwise than through ``forward``.

Decompositions: none beyond what AOTAutograd does by default, so layer_norm-style ops,
``_log_softmax``, ``nll_loss_*``, SDPA and ``embedding_dense_backward`` stay single ops
that the sharding rules can see.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import OutputKind
from torch.overrides import TorchFunctionMode

from autopar import torch_compat as tc
from autopar.errors import CaptureError, TorchVersionError
from autopar.ir import Program, info
from autopar.modpath import get_attr as _get_attr
from autopar.modpath import tensor_names

# ---- a model on meta tensors (planning a 70B model without its memory) must trace into the same
# joint graph as with real weights (tests/test_explain.py compares the two). Two fixes, in force
# only while the autograd pass traces a meta model (``_meta_autograd``): nothing changes at import.


def _nll_loss_via_forward(self, target, weight=None, reduction=1, ignore_index=-100):
    return torch.ops.aten.nll_loss_forward(self, target, weight, reduction, ignore_index)[0]


# On the meta device aten::nll_loss dispatches straight to a meta kernel with no autograd
# formula, so AOTAutograd traced a cross-entropy loss on meta with no backward (every gradient
# None). An AutogradMeta kernel routes it through nll_loss_forward, as the CPU/CUDA composite
# does; registered for the length of the trace only (torch_compat.dispatcher_kernel).
_META_NLL_LOSS = tc.dispatcher_kernel("aten", "nll_loss", _nll_loss_via_forward, "AutogradMeta")


def _sdpa_as_on_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """On meta tensors SDPA takes the math path (its backend choice is a per-device stub with
    no meta entry) and materialises the [seq, seq] attention matrix. Where the CPU would take
    its flash kernel (4-D, equal head dims, no dropout, equal head counts or grouped-query heads
    with ``enable_gqa``, which that kernel takes as they are), call that op, so a model planned on
    meta traces the same attention as one with real weights."""
    heads = query.ndim == 4 and key.ndim == 4 and value.ndim == 4 and key.shape[1] == value.shape[1] and (
        query.shape[1] == key.shape[1] or (enable_gqa and key.shape[1] and query.shape[1] % key.shape[1] == 0))
    if (query.device.type == "meta" and heads and dropout_p == 0.0
            and query.shape[-1] == key.shape[-1] == value.shape[-1]):
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the CPU composite converts it
            attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device),
                                    torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=query.device))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa)


class _MetaAttention(TorchFunctionMode):
    """SDPA calls go to ``_sdpa_as_on_cpu``. A torch function mode, not a patched
    ``torch.nn.functional``: it is thread-local and ends with the ``with`` block, so only
    autopar's trace sees it. It is entered around AOTAutograd (which honours modes), not around
    dynamo's export capture (which ignores them): the torch-level graph keeps SDPA as written,
    which is also what the lower pass wants."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in tc.native_nn("scaled_dot_product_attention"):
            return _sdpa_as_on_cpu(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _meta_autograd(model: nn.Module, device: torch.device | None = None):
    """The meta-model fixes above, for the length of one AOTAutograd trace of ``model``.
    ``device``: where the program will run (a model built on meta to be loaded after compiling);
    the CPU attention op is substituted only for CPU (or planning): elsewhere SDPA's math path stays."""
    if not any(p.is_meta for p in model.parameters()):
        yield
        return
    cpu = device is None or device.type in ("meta", "cpu")
    with _META_NLL_LOSS(), (_MetaAttention() if cpu else contextlib.nullcontext()):
        yield


class _WithLoss(nn.Module):
    """model + loss as one module: ``loss_fn(model(*inputs[:-1]), inputs[-1])``.

    With a ``compute_dtype`` (mixed precision), every floating-point parameter is cast to it
    at the top of the step, so the traced graph computes in that dtype from fp32 master
    parameters (the backward of the cast turns each gradient back into fp32), and the model's
    output is cast to fp32 before the loss (as Megatron-LM computes its cross-entropy).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable | None, compute_dtype: torch.dtype | None = None,
                 call: Callable | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.compute_dtype = compute_dtype
        self.call = call  # ``call(model, *inputs)`` instead of ``model(*inputs)`` (generation's steps)
        self.cast_outside = False  # the parameters are of the compute dtype already (autopar/cast_outside.py)
        if call is not None and compute_dtype is not None:
            tc.reparametrize_module  # noqa: B018 - looked up before dynamo traces ``_model`` (or raises)

    def _model(self, *inputs):
        run = self.model if self.call is None else functools.partial(self.call, self.model)
        if self.compute_dtype is None:
            return _unwrap_output(run(*inputs))
        if self.cast_outside:  # the capture's stand-ins: of the compute dtype already
            out = _unwrap_output(run(*inputs))
        else:
            cast = {n: (p.to(self.compute_dtype) if p.is_floating_point() else p)
                    for n, p in self.model.named_parameters()}
            if self.call is None:
                out = _unwrap_output(torch.func.functional_call(self.model, cast, inputs))
            else:  # functional_call calls only ``forward``: its context, around ``call``
                with tc.reparametrize_module(self.model, cast):
                    out = _unwrap_output(run(*inputs))
        if self.loss_fn is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
            out = out.float()
        return out

    def forward(self, *inputs):
        if self.loss_fn is None:
            return self._model(*inputs)
        return self.loss_fn(self._model(*inputs[:-1]), inputs[-1])


def _unwrap_output(out):
    """Hugging Face models return a ModelOutput; the loss wants its logits (or its loss)."""
    if hasattr(out, "logits") and not isinstance(out, torch.Tensor):
        return out.loss if getattr(out, "loss", None) is not None else out.logits
    return out


def _static_capture():
    """autopar's captures (no dynamic shapes) skip export's constraint check (torch_compat.static_export)."""
    return tc.static_export()


def _user_exception(wrapper: nn.Module, example_inputs: tuple):
    """When dynamo reports only "Observed exception", the user's code raised: run model + loss
    once on fake tensors (shapes only, nothing computed or allocated) to get that exception and
    the user's frame it came from. None if it does not raise that way."""
    import traceback

    try:
        fake_mode = tc.FakeTensorMode
    except TorchVersionError:
        return None
    try:
        with warnings.catch_warnings(), fake_mode(allow_non_fake_inputs=True):
            warnings.simplefilter("ignore")
            wrapper(*example_inputs)
    except Exception as err:  # noqa: BLE001 - what the user's code raised
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if "/torch/" not in f.filename and f.filename != __file__]
        where = f"{frames[-1].filename}:{frames[-1].lineno}  {frames[-1].line}" if frames else None
        return err, where
    return None


def capture_graph(model: nn.Module, example_inputs: tuple, loss_fn: Callable | None,
                  compute_dtype: torch.dtype | None = None, dropless: bool = False) -> fx.GraphModule:
    """Trace model (+ loss) with dynamo into a torch-level graph (the capture pass). SDPA calls
    stay as written, also on meta (the lower pass rewrites them; ``_meta_autograd`` fixes the rest).
    ``dropless``: Hugging Face experts modules traced as autopar::moe_experts (autopar/experts.py)."""
    from autopar import capture_cache as cc
    from autopar import cast_outside, splice, value_checks
    from autopar.experts import dropless_experts
    from autopar.forked import settle_autograd
    from autopar.scoped import buffer_assignments

    settle_autograd()  # (before any fake tensor mode: the forked children's backward, autopar/forked.py)
    if splice.active():  # planning a deep model: capture three blocks, repeat the third (autopar/splice.py)
        found = splice.block_list(model)
        if found is not None:
            with splice.truncated(model, *found):
                shallow = capture_graph(model, example_inputs, loss_fn, compute_dtype, dropless)
            out = splice.splice(shallow, model, *found)
            if out is not None:
                return out
            splice.STATS["refused"] = splice.STATS.get("refused", 0) + 1
    wrapper = _WithLoss(model, loss_fn, compute_dtype)
    dynamo_capture = tc.dynamo_graph_capture_for_export

    def trace():
        with (warnings.catch_warnings(), tc.no_compiled_fn_globals(), dropless_experts(model, dropless),
              _static_capture(), tc.scalar_outputs(), buffer_assignments(),
              cast_outside.stand_ins(model, compute_dtype) if compute_dtype else contextlib.nullcontext() as pairs):
            warnings.simplefilter("ignore")
            wrapper.cast_outside = pairs is not None
            try:
                gm = dynamo_capture(wrapper)(*example_inputs)
            finally:
                wrapper.cast_outside = False
        if pairs is not None:
            cast_outside.insert_casts(gm, model, pairs, compute_dtype, (__file__, "_model"))
        value_checks.to_device(gm)  # asserts on a tensor's value: checked on the device (autopar/value_checks.py)
        reads = value_checks.host_reads(gm)
        if reads:
            raise CaptureError(
                f"the model reads a tensor's value on the host at {reads[0]}"
                + (f" (and {len(reads) - 1} more place(s))" if len(reads) > 1 else "")
                + ": the program's shapes and control flow would depend on the data",
                where=reads[0].split("  ")[0] or type(model).__name__,
                fix="compute it with tensor ops (masks, scatter / index_add, padding to a fixed size) instead of "
                "reading it (.item(), .tolist()); an assert on such a value is fine (it stays a device check)")
        return gm

    try:
        return cc.cached("capture", lambda: cc.module_key("capture", wrapper, example_inputs, dropless), trace,
                         lambda gm: cc.gm_template(gm, wrapper), lambda t: cc.gm_from_template(t, wrapper))
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with context
        own = None
        if "Observed exception" in str(e):
            # the experts as autopar's op in the re-run, whatever the plan: transformers' own
            # experts path picks grouped_mm on fake CPU tensors, whose fake kernel wants bf16, and
            # would report that instead of the user's exception (Mixtral fp32 under fsdp did)
            with dropless_experts(model, True):
                own = _user_exception(wrapper, example_inputs)
        if own is not None:  # the model or loss itself raised: say what, and where, not dynamo's wrapper
            err, where = own
            raise CaptureError(f"the model or loss raised while being traced: {type(err).__name__}: {err}",
                               where=where or type(model).__name__,
                               fix="run model + loss once eagerly on the example inputs; fix what raises") from err
        raise CaptureError(
            f"could not trace the model into a joint forward+backward graph: {type(e).__name__}: {e}",
            where=type(model).__name__,
            fix="make the model traceable by torch.export (no data-dependent Python control flow; "
            "HF models need use_cache=False)",
        ) from e


def joint_program(gm: fx.GraphModule, example_inputs: tuple, model: nn.Module, stage: str | None = None,
                  device: torch.device | None = None) -> Program:
    """The joint forward + backward ATen graph of a torch-level graph (the autograd pass).
    ``stage``: None for a whole model; "middle" / "last" for a pipeline stage (passes/split.py),
    whose outputs are activations for later stages (the loss on the last stage), whose tangents
    are their gradients, and which also returns the gradients of its floating-point inputs.
    ``device``: the device the program will run on (``_meta_autograd``)."""
    from autopar import capture_cache as cc
    from autopar import joint_splice

    spliced = joint_splice.joint_for(gm, model, stage)  # (``autopar plan``'s depths 4 and 5: from depth 3's)
    if spliced is not None:
        return spliced

    def keyed():
        return cc.graph_key(gm, model, example_inputs, stage, str(device), any(p.is_meta for p in model.parameters()))

    return cc.cached("joint", keyed, lambda: _joint_program(gm, example_inputs, model, stage, device),
                     lambda p: cc.program_template(p, model), lambda t: cc.program_copy(t, model))


def _joint_program(gm, example_inputs, model, stage, device) -> Program:
    aot_export_joint_with_descriptors = tc.aot_export_joint_with_descriptors
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stack = contextlib.ExitStack()
            with stack, _meta_autograd(model, device), tc.lazy_tracers():
                joint = aot_export_joint_with_descriptors(stack, gm, tuple(example_inputs))
                graph = joint.graph_module.graph
    except Exception as e:  # noqa: BLE001 - re-raised with context
        what = "pipeline stage" if stage else "model"
        raise CaptureError(f"could not trace the {what} into a joint forward+backward graph: {type(e).__name__}: {e}",
                           where=type(model).__name__) from e
    return _describe(graph, gm, tensor_names(model), model, stage=stage)


def capture_joint(model: nn.Module, example_inputs: tuple, loss_fn: Callable | None,
                  compute_dtype: torch.dtype | None = None) -> Program:
    """capture + autograd for a whole model, in one call (tests and tools that want the joint
    graph of a model without the rest of the pass list)."""
    return joint_program(capture_graph(model, example_inputs, loss_fn, compute_dtype), example_inputs, model)


def _describe(graph: fx.Graph, gm: fx.GraphModule, ids, model, stage: str | None = None) -> Program:
    """Turn AOT descriptors into autopar's placeholder/output roles, with user names."""
    d = tc.aot_descriptors

    def real_name(target: str) -> tuple[str, str]:
        t = _get_attr(gm, target)
        if t is None or id(t) not in ids:
            raise CaptureError(f"cannot map traced tensor {target!r} back to a model parameter or buffer")
        return ids[id(t)]

    inputs: list[tuple[str, Any]] = []
    buffers: dict[str, torch.Tensor] = {}
    named_b = dict(model.named_buffers())
    constants = _constants_as_buffers(graph)
    for n in graph.nodes:
        if n.op != "placeholder":
            continue
        desc = n.meta.get("desc")
        if n in constants:
            name, buffers[name] = constants[n]
            inputs.append(("buffer", name))
        elif isinstance(desc, d.ParamAOTInput):
            kind, name = real_name(desc.target)
            inputs.append(("param", name))
        elif isinstance(desc, d.BufferAOTInput):
            kind, name = real_name(desc.target)
            inputs.append(("buffer", name))
            buffers[name] = named_b[name]
        elif isinstance(desc, d.PlainAOTInput):
            inputs.append(("input", desc.idx))
        elif isinstance(desc, d.TangentAOTInput):
            if stage is not None and isinstance(desc.output, d.PlainAOTOutput):
                inputs.append(("tangent", desc.output.idx))
            else:
                inputs.append(("tangent", len([i for i in inputs if i[0] == "tangent"])))
        else:
            raise CaptureError(f"unsupported graph input {desc!r}",
                               fix="inputs must be tensors, parameters and buffers")
        info(n).role = inputs[-1]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outputs: list[tuple[str, Any]] = []
    for desc in out_node.meta.get("desc", []):
        if isinstance(desc, d.PlainAOTOutput):
            outputs.append(("act" if stage == "middle" else "loss", desc.idx))
        elif isinstance(desc, d.GradAOTOutput) and isinstance(desc.grad_of, d.ParamAOTInput):
            outputs.append(("grad", real_name(desc.grad_of.target)[1]))
        elif stage is not None and isinstance(desc, d.GradAOTOutput) and isinstance(desc.grad_of, d.PlainAOTInput):
            outputs.append(("input_grad", desc.grad_of.idx))
        elif desc is None or isinstance(desc, d.GradAOTOutput):
            outputs.append(("none", None))
        else:
            raise CaptureError(
                f"unsupported graph output {desc!r} (buffer mutation in forward?)",
                fix="autopar does not support models that mutate buffers in forward yet")
    return Program(graph=graph, inputs=inputs, outputs=outputs, buffers=buffers)


def _constants_as_buffers(graph: fx.Graph) -> dict[fx.Node, tuple[str, torch.Tensor]]:
    """Tensor constants the model creates in forward (Falcon's ``qkv[..., [-2], :]``, GPT-Neo's
    ``torch.tensor(min_value)``) reach the joint graph as ``get_attr`` nodes on AOTAutograd's own
    module. Each becomes a placeholder placed after the parameters and buffers, fed like a buffer
    (``Program.buffers`` holds its value): every pass sees graph inputs with roles only, and the
    value stays what the model computed with. Returns {new placeholder: (name, value)}."""
    consts = [n for n in graph.nodes if n.op == "get_attr"]
    if not consts:
        return {}
    d = tc.aot_descriptors

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    state = [n for n in placeholders if isinstance(n.meta.get("desc"), (d.ParamAOTInput, d.BufferAOTInput))]
    out = {}
    for c in consts:
        value = _get_attr(graph.owning_module, c.target)
        if not isinstance(value, torch.Tensor):
            raise CaptureError(f"unsupported constant {c.target!r} ({type(value).__name__}) in the traced graph")
        anchor = state[-1] if state else None
        with (graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(placeholders[0])):
            ph = graph.placeholder(c.name)
        ph.meta.update(c.meta)
        c.replace_all_uses_with(ph)
        graph.erase_node(c)
        state.append(ph)
        out[ph] = (f"constant.{c.target}", value.detach())
    return out


_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default}


def _forward_decompositions():
    """Core ATen, except attention, which stays one op (rules.py shards it over batch and heads):
    SDPA's math decomposition gives its output other strides than the op has, so a model that
    ``view``s the attention output (GPT-2's Conv1D: ``x.view(-1, x.size(-1))``) would fail to
    export (pytorch/pytorch#136543), and eval would not run the kernel eager runs."""
    table = torch.export.default_decompositions()
    for op in [op for op in table if "scaled_dot_product" in op.name()]:
        del table[op]
    return table


def capture_forward(model: nn.Module, example_inputs: tuple, compute_dtype: torch.dtype | None = None,
                    call: Callable | None = None, dropless: bool = False, keyed: Callable | None = None,
                    check: Callable[[Program], None] | None = None) -> Program:
    """Forward-only (eval) program via torch.export; outputs are the model's tensors.
    ``call(model, *inputs)``: what to trace instead of ``model(*inputs)`` (generation's steps).
    An input the traced code updates in place (a KV cache, autopar/generation.py) has the
    role ``("cache", i)`` and its new value is an output ``("cache", i)``, ahead of the others.
    ``keyed``: the capture cache's key made beforehand (``forward_later``: the model as compiled);
    ``check(program)``: raises on a trace not to keep (before the cache or other ranks get it)."""
    from autopar import capture_cache as cc

    from autopar.experts import dropless_experts

    wrapper = _WithLoss(model, None, compute_dtype, call)

    def export():
        with dropless_experts(model, dropless):
            program = _capture_forward(model, wrapper, example_inputs)
        if check is not None:
            check(program)
        return program

    return cc.cached("forward", keyed or (lambda: cc.module_key("forward", wrapper, example_inputs, dropless)),
                     export, lambda p: cc.program_template(p, model), lambda t: cc.program_copy(t, model))


def forward_later(model: nn.Module, example_inputs: tuple, compute_dtype: torch.dtype | None, device: torch.device,
                  dropless: bool = False) -> Callable[[], Program]:
    """``capture_forward`` deferred to the first forward call: compile keeps no forward program
    (torch.export and its decompositions were a third to two fifths of a small model's compile),
    and a run that never calls ``pm(x)`` never exports. By then the parameters are DTensors, so
    the export swaps every parameter and buffer for a fake tensor of its global shape on
    ``device`` (tied ones stay one; no storage) and restores them; the model's training flag,
    grad mode and the capture cache's key (which lets ranks share the export, as at compile) are
    those of the compile. The program runs on the real shards and buffers, read by name. A tensor
    the forward makes from data keeps its value (export records it as it is made); a constant that
    were one of the stand-ins would have lost its value: CaptureError, with the fix (a buffer, or
    ``capture_eval="compile"``, which exports at compile as before). The forward is traced as the
    module is at that call but keyed as it was at compile: a plain attribute changed in between
    shows in the eval program (not in the compiled training step) unless the cache held the export."""
    from autopar import capture_cache as cc

    # (the key needs the model as compiled: the stand-ins' values cannot be fingerprinted)
    # (and the device it traces on: a planning compile's stand-ins are on meta)
    key = cc.module_key("forward", _WithLoss(model, None, compute_dtype), example_inputs, dropless,
                        ("later", str(device))) if cc.enabled() else None
    metas = [torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in example_inputs]
    training, grad = model.training, torch.is_grad_enabled()

    def capture() -> Program:
        mode = tc.FakeTensorMode()

        def fake(t: torch.Tensor, keep_strides: bool = False) -> torch.Tensor:
            with mode:  # (a parameter: contiguous, as DTensor's global view; an input: as given)
                strides = t.stride() if keep_strides else tc.contiguous_strides(t.shape)
                return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=device)

        inputs = tuple(fake(x, True) if isinstance(x, torch.Tensor) else x for x in metas)
        real = dict(model.named_buffers(remove_duplicate=False))

        def check(program: Program) -> None:
            made = sorted(n for n, t in program.buffers.items() if n not in real and isinstance(t, tc.FakeTensor))
            if made:
                raise CaptureError(f"the model's forward creates tensor constant(s) {made} from data, which the eval "
                                   "program, captured at its first call on stand-ins of the (by then sharded) "
                                   "parameters, cannot keep", where=type(model).__name__,
                                   fix="register them as buffers of the model, or compile with "
                                   "capture_eval=\"compile\" (the eval program captured at compile)")

        with swapped(model, fake, training, keep_requires_grad=True), torch.set_grad_enabled(grad):
            program = capture_forward(model, inputs, compute_dtype, dropless=dropless, keyed=lambda: key, check=check)
        # (the module's own buffers by name, as the run reads them; the stand-ins are gone)
        program.buffers = {n: real.get(n, t) for n, t in program.buffers.items()}
        return program

    return capture


@contextlib.contextmanager
def swapped(module: nn.Module, make: Callable[[torch.Tensor], torch.Tensor], training: bool,
            keep_requires_grad: bool = False):
    """The module as it was before compiling, for torch.export: each parameter (a DTensor now)
    and buffer replaced by ``make(tensor)`` (a meta or fake tensor of its global shape; tied ones
    stay one tensor; parameters requiring no gradient unless ``keep_requires_grad``), in
    ``training`` mode; everything restored after."""
    saved, memo = [], {}
    was = module.training
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    memo[id(t)] = nn.Parameter(make(t), requires_grad=keep_requires_grad and t.requires_grad) \
                        if table is m._parameters else make(t)
                saved.append((table, name, t))
                table[name] = memo[id(t)]
    module.train(training)
    try:
        yield
    finally:
        for table, name, t in saved:
            table[name] = t
        module.train(was)


def _capture_forward(model: nn.Module, wrapper: nn.Module, example_inputs: tuple) -> Program:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(wrapper, tuple(example_inputs), strict=False)
            ep = ep.run_decompositions(_forward_decompositions())  # core ATen: what DTensor and our rules know
    except Exception as e:  # noqa: BLE001
        raise CaptureError(f"could not export the model's forward: {type(e).__name__}: {e}",
                           where=type(model).__name__) from e
    sig = ep.graph_signature
    graph = ep.graph_module.graph
    # export's metadata asserts check GLOBAL dtype/shape facts the per-rank program does not
    # need to re-check; they carry no value, so they are dropped here
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target in _ASSERTS and not n.users:
            graph.erase_node(n)
    named_b = dict(model.named_buffers())
    # tied weights: export may name a shared parameter by any of its names; the program (and the
    # runtime) know it by its first one, as named_parameters() lists it
    first: dict[int, str] = {}
    canonical = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    inputs = []
    buffers = {}
    user_idx = 0
    consts = ep.constants
    mutated = set(sig.user_inputs_to_mutate.values())  # input names updated in place
    ph = [n for n in graph.nodes if n.op == "placeholder"]
    for n in graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in sig.inputs_to_parameters:
            name = sig.inputs_to_parameters[n.name].removeprefix("model.")
            inputs.append(("param", canonical.get(name, name)))
        elif n.name in sig.inputs_to_buffers:
            name = sig.inputs_to_buffers[n.name].removeprefix("model.")
            inputs.append(("buffer", name))
            buffers[name] = named_b[name] if name in named_b else consts[sig.inputs_to_buffers[n.name]]
        elif n.name in sig.inputs_to_lifted_tensor_constants:
            name = sig.inputs_to_lifted_tensor_constants[n.name]
            inputs.append(("buffer", name))
            buffers[name] = consts[name]
        else:
            inputs.append(("cache" if n.name in mutated else "input", user_idx))
            user_idx += 1
        info(n).role = inputs[-1]
    from autopar.unfuse import cut_exported  # a weight cut into parts: one matmul per part here too

    cut_exported(graph, {n: r[1] for n, r in zip(ph, inputs) if r[0] == "param"}, model)
    out_node = next(n for n in graph.nodes if n.op == "output")
    outputs = [("output", i) for i in range(len(out_node.args[0]))]
    if mutated:
        index = {n.name: what for n, (_, what) in zip(ph, inputs)}
        rest = iter(range(len(outputs)))
        outputs = [("cache", index[spec.target]) if spec.kind == OutputKind.USER_INPUT_MUTATION
                   else ("output", next(rest)) for spec in sig.output_specs]
    return Program(graph=graph, inputs=inputs, outputs=outputs, buffers=buffers)
