"""The torch boundary (autopar/torch_compat.py) on a torch that lacks one of its private names.

Each name in ``torch_compat.PRIVATE`` is hidden in turn (the boundary's one lookup fails for it,
as on a torch that does not have it) and the code that uses it is run: a small compile (Llama,
one block, megatron on a fake tp=2 mesh) or the runtime helper that reads it. Where the table
gives a fallback, that still works; where it gives none, the error is a TorchVersionError (a
PlanError) naming the running torch. Each case also checks that the hidden name was asked for
(a case that never reaches its name would prove nothing).

torch 2.11 lacks ``_ViewShardingPropagator`` and 2.11 / 2.12 ``_split_factor_matches`` (the
boundary's docstring): hiding the first is the 2.11 case below (the dp x cp view then needs it);
the second autopar no longer reads at all."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import autopar
from autopar import torch_compat as tc
from autopar.ir import info
from autopar.models.llama import Llama, LlamaConfig, cross_entropy


@pytest.fixture
def hide(monkeypatch):
    """``hide(name, ...)``: the boundary cannot find those names; returns the list of lookups of them."""
    from autopar import capture_cache, record
    from autopar.passes import localize, propagate

    monkeypatch.setattr(capture_cache, "enabled", lambda: False)  # every case traces and propagates anew
    monkeypatch.setattr(record, "_CLASS", [])  # (the recorder's class looks its names up when made)
    monkeypatch.setattr(propagate, "_SHARED_STRATEGIES", {})
    monkeypatch.setenv("AUTOPAR_DISK_CACHE", "0")  # (DTensor asked anew: no answers from disk)
    monkeypatch.setattr(localize, "_SIZE_FREE", {})
    asked: list[str] = []

    def hide_(*names):
        hidden = {(tc.PRIVATE[n].module, tc.PRIVATE[n].attr): n for n in names}
        found = tc._lookup

        def lookup(module, attr):
            if (module, attr) in hidden:
                asked.append(hidden[module, attr])
                raise (AttributeError if attr else ImportError)(f"hidden: {module} {attr}")
            return found(module, attr)

        monkeypatch.setattr(tc, "_lookup", lookup)
        tc.forget()
        return asked

    yield hide_
    tc.forget()


def _llama(meta=False):
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = Llama(LlamaConfig(n_layers=1))
    tokens = torch.randint(0, 256, (2, 8), device="meta" if meta else "cpu")
    return model, (tokens, tokens)


def compile_llama(fake, meta=False, axes=None, plan=None, **kw):
    model, inputs = _llama(meta)
    with fake(**(axes or {"tp": 2})) as mesh:
        return autopar.compile(model, mesh, example_inputs=inputs, loss_fn=cross_entropy,
                               plan=plan or {"tp": "megatron"}, capture_eval=False, **kw)


def compiles(fake):
    pm = compile_llama(fake)
    assert any(r.kind == "all_reduce" and r.axis == "tp" for r in pm.collectives())


def steps_as_eager(fake):
    """A compiled program that runs (its code generated when first called) computes what eager does."""
    model, (tokens, _) = _llama()
    want = cross_entropy(model(tokens), tokens)
    with fake(dp=1) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=(tokens, tokens), loss_fn=cross_entropy,
                             plan={"dp": "ddp"}, capture_eval=False)
        torch.testing.assert_close(pm.train_step(tokens, tokens), want, rtol=1e-5, atol=1e-6)


def compiles_on_meta(fake):
    """The meta fixes: nll_loss's AutogradMeta kernel (registered for the trace, removed after)."""
    pm = compile_llama(fake, meta=True)
    assert any(r.phase == "backward" for r in pm.collectives())
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::nll_loss", "AutogradMeta")


def compiles_with_capture_cache(fake, monkeypatch):
    from autopar import capture_cache

    monkeypatch.setattr(capture_cache, "enabled", lambda: True)
    compile_llama(fake)


def sharing_traces(fake):
    """A joint program as the bytes one rank shares with the others (autopar/trace_share.py), read
    back; where this torch lacks a name sharing needs, no bytes (each rank traces for itself)."""
    from autopar import capture_cache, trace_share
    from autopar.capture import capture_joint

    model, inputs = _llama()
    program = capture_joint(model, inputs, cross_entropy)
    data = trace_share.encode(capture_cache.program_template(program, model))
    with fake(dp=2):
        store = tc.find("default_store", lambda: None)()  # (what the failure channel and sharing read)
    if tc.has("GraphPickler") and tc.has("GraphPicklerOptions"):
        assert str(trace_share.decode(data).graph) == str(program.graph)
    else:
        assert data is None
    assert (store is not None) == tc.has("default_store")


def compiles_under_a_budget(fake):
    compile_llama(fake, memory_budget="1GiB")  # (the predicted peak, from each rank's shard shapes)


def compiles_with_inductor(fake):
    from autopar.runtime import inductor

    pm = compile_llama(fake)
    inductor.compile_program(pm.program.local, torch.device("cpu"), inductor.InductorStats())


def compiles_twin_stages(fake):
    from autopar.compiler import build

    torch.manual_seed(0)
    model, tokens = Llama(LlamaConfig(n_layers=4)), torch.randint(0, 256, (4, 8))
    with fake(pp=4) as mesh:  # stages 1 and 2 hold one block each: 2 is 1's twin (passes/twins.py)
        state = build(model, mesh, example_inputs=(tokens, tokens), loss_fn=cross_entropy,
                      plan={"pp": "gpipe"}, pipeline_stages="all")
    assert any(st.twin_of is not None for st in state.stages)


def generation_step_in_bf16(fake):
    from autopar.capture import _WithLoss

    _WithLoss(torch.nn.Linear(4, 4), None, torch.bfloat16, call=lambda m, x: m(x))


def dp_cp_views(fake):
    """The view split fix's case: dp=2 x cp=4 on 2 sequences ([b*s] rows, the batch on dp and the
    sequence strided on cp, unflattened back to [b, s]). Fine with every name; without the fixed
    view propagation (torch 2.11), a TorchVersionError: tests/test_context.py checks the rest."""
    model, _ = _llama()
    tokens = torch.randint(0, 256, (2, 16))
    with fake(dp=2, cp=4) as mesh:
        autopar.compile(model, mesh, example_inputs=(tokens, tokens), loss_fn=cross_entropy,
                        plan={"dp": "ddp", "cp": "ulysses"}, capture_eval=False)


def measuring(fake):
    class Meter(tc.TorchDispatchMode):
        pass

    with Meter():
        torch.ones(2) + 1


def counting_collectives(fake):
    assert tc.composite_kernel(torch.ops._c10d_functional.all_reduce.default) is not None


def reusing_bucket_buffers(fake):
    t = torch.ones(4)
    assert tc.storage_use_count(t) >= 1 and isinstance(tc.dispatch_mode_active(), bool)


def clipping_gradients(fake):
    from autopar.runtime.grads import _norms, _scale_

    ts = [torch.ones(3), torch.full((2,), 2.0)]
    assert [float(n) for n in _norms(ts, 2.0, None)] == pytest.approx([3 ** 0.5, 8 ** 0.5])
    _scale_(ts, torch.tensor(0.5), None)
    assert float(ts[1][0]) == 1.0


def running_collectives(fake):
    with fake(tp=2) as mesh:
        assert tc.resolve_process_group(mesh.get_group(0).group_name) is not None


def whole_mesh_group(fake):
    with fake(dp=2, tp=2) as mesh:
        assert tc.whole_mesh_group(mesh).size() == 4


def fake_meshes(fake):
    with fake(tp=2) as mesh:
        assert mesh.size() == 2


def forgetting_process_groups(fake):
    """(Run with one of its names hidden only: the boundary looks all three up before it changes
    anything, so this process's groups stay as they are.)"""
    tc.forget_process_groups()


def localizes(fake):
    """The per-rank program (recorded, or traced by make_fx where the recorder cannot run) keeps
    each op's origin and source line."""
    pm = compile_llama(fake)
    ops = [n for n in pm.program.local.graph.nodes if n.op == "call_function"]
    assert ops and all(n.meta["custom"]["autopar_origin"] for n in ops)
    assert sum("models/llama.py" in (n.stack_trace or "") for n in ops) > len(ops) // 2


def inductor_thresholds(fake):
    from autopar.analysis import inductor_model as IM

    th = IM.thresholds("cpu")
    assert th.reuse_reads > 0 and th.opcount > 0 and th.acc_reads > 0


# name -> what reads it
CASES = {
    "dynamo_graph_capture_for_export": compiles, "constraint_check": compiles, "functional_export": compiles,
    "get_funcname": compiles,
    "assert_async": compiles, "dynamo_config": compiles,  # (a model without value asserts: captured as before)
    "aot_export_joint_with_descriptors": compiles, "aot_descriptors": compiles,
    "FakeTensorMode": compiles_with_inductor,
    "FakeTensor": compiles_twin_stages, "reparametrize_module": generation_step_in_bf16,
    "library_destroy": compiles_on_meta, "c_nn": compiles_on_meta, "select_min_cost_strategy": compiles,
    "op_dispatcher": compiles, "random_ops": compiles, "custom_op_handlers": compiles, "DTensorSpec": compiles,
    "TensorMeta": compiles, "OpSchema": compiles, "compute_local_shape_and_global_offset": compiles_under_a_budget,
    "find_shard_for_split": dp_cp_views, "expected_split_factor": dp_cp_views, "StridedShard": compiles,
    "TorchDispatchMode": measuring, "get_current_dispatch_mode": reusing_bucket_buffers,
    "has_foreach_support": clipping_gradients, "device_has_foreach_support": clipping_gradients,
    "foreach_norm": clipping_gradients, "foreach_mul_": clipping_gradients,
    "resolve_process_group": running_collectives,
    "storage_use_count": reusing_bucket_buffers, "has_kernel_for_dispatch_key": counting_collectives,
    "DispatchKey": counting_collectives, "compile_fx_inner": compiles_with_inductor,
    "select_decomp_table": compiles_with_inductor, "inductor_config": inductor_thresholds,
    "TracingContext": compiles_with_inductor,
    "tracing": compiles_with_inductor, "OpOverload": compiles, "OpOverloadPacket": compiles_with_capture_cache,
    "WrappedCall": compiles_twin_stages, "LazyGraphModule": steps_as_eager, "lazy_graph_modules": compiles,
    "mesh_flatten": whole_mesh_group,
    "GraphPickler": sharing_traces, "GraphPicklerOptions": sharing_traces, "default_store": sharing_traces,
    "fake_pg": fake_meshes, "c10d_world": forgetting_process_groups, "update_default_pg": forgetting_process_groups,
    "unregister_all_process_groups": forgetting_process_groups,
    **dict.fromkeys(("autograd_would_have_decomposed", "fast_detach", "dispatch_mode_key", "get_dispatch_mode",
                     "copy_meta_fields"), localizes),
    "FakeStore": fake_meshes,
}
VERSION = ".".join(torch.__version__.split(".")[:2])
# what the supported torch versions lack (the boundary's docstring)
MISSING = {"2.11": {"find_shard_for_split", "expected_split_factor"}, "2.12": set(), "2.13": set()}
# a fallback whose case still fails on some versions: without the view split fix, 2.11's view
# propagation refuses the dp x cp flatten and 2.13's the unflatten (2.12's takes both)
FAILS_ANYWAY = {"find_shard_for_split": {"2.11", "2.13"}, "expected_split_factor": {"2.11", "2.13"}}


def test_every_private_name_has_a_case():
    assert set(CASES) == set(tc.PRIVATE)
    assert {n for n in tc.PRIVATE if not tc.has(n)} == MISSING.get(VERSION, set())


@pytest.mark.parametrize("name", list(tc.PRIVATE))
def test_without(name, hide, fake, monkeypatch):
    case = CASES[name]
    asked = hide(name)
    args = (fake, monkeypatch) if case is compiles_with_capture_cache else (fake,)
    if tc.PRIVATE[name].fallback is None or VERSION in FAILS_ANYWAY.get(name, ()):
        with pytest.raises(autopar.TorchVersionError, match=re.escape(f"torch {torch.__version__} does not have")) as e:
            case(*args)
        assert re.search(r"torch from 2\.11 to 2\.13|use torch 2\.1[23] to 2\.13", str(e.value)), str(e.value)
    else:
        case(*args)
    if name not in MISSING.get(VERSION, ()):  # (where torch lacks it, what is found first may stop the search)
        assert name in asked, f"{case.__name__} never looked {name} up"


def test_a_compile_leaves_its_programs_code_to_their_first_run(hide, fake, monkeypatch):
    """The programs autopar builds are torch's lazy GraphModules (``tc.graph_module``), and so are
    the graphs of the tracers whose code autopar never runs (localize's make_fx, the joint trace:
    ``tc.lazy_tracers``): a compile that runs nothing generates less Python code than with plain
    GraphModules, each rewritten program generating its code again (what is left: dynamo's and
    torch.export's own)."""
    generated, plain_recompile = [0], torch.fx.GraphModule.recompile

    def counted(self, *args):
        generated[0] += 1
        return plain_recompile(self)
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    compile_llama(fake)
    lazy, generated[0] = generated[0], 0
    hide("lazy_graph_modules")
    compile_llama(fake)
    eager_tracers, generated[0] = generated[0], 0
    hide("lazy_graph_modules", "LazyGraphModule")
    compile_llama(fake)
    assert lazy < eager_tracers < generated[0], (lazy, eager_tracers, generated[0])


def test_split_fix_without_split_factor_matches(fake):
    """torch 2.11 / 2.12 have no ``_split_factor_matches``: autopar's fix never reads it."""
    assert "_split_factor_matches" not in str([p.what for p in tc.PRIVATE.values()])
    if tc.views_fixed():
        dp_cp_views(fake)  # (the fix, with autopar's own predicate)
    else:  # torch 2.11
        with pytest.raises(autopar.TorchVersionError, match="_ViewShardingPropagator"):
            dp_cp_views(fake)


def test_a_torch_version_error_is_a_plan_error():
    err = tc.unavailable("torch.x._y", "something")
    assert isinstance(err, autopar.PlanError) and torch.__version__ in str(err)
    assert tc.SUPPORTED == ("2.11", "2.13")


@pytest.mark.parametrize("which", ["llama", pytest.param("hf_gpt2", marks=pytest.mark.slow)])  # (GPT-2: 15 s)
def test_propagation_gives_dtensor_the_output_meta_of_the_trace(which, fake, monkeypatch):
    """propagate hands DTensor each op's output shape, stride and dtype from the traced graph
    (``tc.known_output_meta``) instead of DTensor running the op on fake tensors of its own: the
    shapes and strides are DTensor's own (the dtypes may differ: for bf16 layer norm's statistics
    the trace has fp32, DTensor's fake run bf16), every placement chosen is the same as with
    DTensor's own, and the patch is undone after."""
    from autopar import capture_cache
    from autopar.passes import propagate

    monkeypatch.setattr(capture_cache, "enabled", lambda: False)
    prop = tc.sharding_propagator()
    own = type(prop)._propagate_tensor_meta_non_cached
    given, seen = propagate._known_output_meta, []

    def flat(m):
        return [m] if m is None or isinstance(m, tc.TensorMeta) else list(m)

    def check(schema):
        got = given(schema)
        if got is not None:
            mine, theirs = flat(got[0]), flat(own(prop, schema))
            assert [(m.shape, m.stride) if m else None for m in mine] == \
                [(m.shape, m.stride) if m else None for m in theirs], schema.op
            seen.append(schema.op)
        return got

    import foreign_models  # (tests/: on the path, as test_autoplan imports it)

    placed = []
    for known in (check, lambda schema: None):  # the trace's output meta, then DTensor's own
        if which == "llama":
            (model, inputs), loss_fn, plan = _llama(), cross_entropy, {"dp": "fsdp", "tp": "megatron"}
        else:
            (model, inputs, loss_fn), plan = getattr(foreign_models, which)(), {"dp": "zero2", "tp": "megatron"}
        monkeypatch.setattr(propagate, "_SHARED_STRATEGIES", {})
        monkeypatch.setenv("AUTOPAR_DISK_CACHE", "0")  # (DTensor asked anew: no answers from disk)
        monkeypatch.setattr(propagate, "_known_output_meta", known)
        with fake(dp=2, tp=2) as mesh:
            pm = autopar.compile(model, mesh, example_inputs=inputs, loss_fn=loss_fn, plan=plan, capture_eval=False,
                                 precision="bf16")
        placed.append([(n.name, info(n).spec, info(n).wants, info(n).rule.name if info(n).rule else None)
                       for n in pm.program.graph.nodes])
    assert len(seen) > 20
    assert placed[0] == placed[1]
    assert "_propagate_tensor_meta_non_cached" not in prop.__dict__
