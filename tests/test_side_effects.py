"""autopar leaves the process as it found it: importing it changes no environment variable, no
torch function, no registration on torch's own ops; a compile (successful or not) undoes what it
installed for its own steps; and autopar's Triton kernels run through Triton's interpreter on CPU
without switching other Triton code to it."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import fx
from torch._dynamo import functional_export
from torch.distributed.tensor import _sharding_prop
from torch.utils import flop_counter

import autopar
from autopar import torch_compat
from autopar.models.llama import Llama, LlamaConfig, cross_entropy

aten = torch.ops.aten
CPU_FLASH = (aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward)

IMPORT_EVERYTHING = textwrap.dedent("""
    import json, os, pkgutil, importlib
    import torch._dynamo  # torch's own import sets TORCHINDUCTOR_CACHE_DIR (any custom op call imports it)
    before = dict(os.environ)
    import autopar, autopar.passes, autopar.kernels
    for pkg in (autopar, autopar.passes, autopar.kernels):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(m.name)
    import torch, triton
    import triton.language as tl
    from torch.distributed.tensor import _sharding_prop
    from torch.utils import flop_counter

    @triton.jit
    def users_kernel(x):  # defined after autopar's import: Triton's own choice, compiled
        pass

    aten = torch.ops.aten
    langs = [tl, tl.core, tl.math, tl.standard, tl.core.tensor]
    lang_before = [dict(vars(o)) for o in langs]
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    y, _ = torch.ops.autopar.linear_act(x, w, None, "silu")  # autopar's kernel on CPU: interpreted
    print(json.dumps({
        # the interpreter patches triton.language's builtins during a launch: all put back after
        "triton.language changed": sorted(f"{getattr(o, '__name__', o)}.{k}" for o, b in zip(langs, lang_before)
                                          for k, v in b.items() if vars(o).get(k, v) is not v),
        "environment changed": sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)),
        "users kernel": type(users_kernel).__name__,
        "kernel right": torch.allclose(y, torch.nn.functional.silu(x @ w.T), atol=1e-5),
        "sdpa": torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention,
        "selector": _sharding_prop._select_min_cost_strategy.__qualname__,
        "nll_loss AutogradMeta": torch._C._dispatch_has_kernel_for_dispatch_key("aten::nll_loss", "AutogradMeta"),
        "cpu flash FLOP formulas": [op in flop_counter.flop_registry for op in (
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward)],
    }))
""")


def test_importing_autopar_changes_nothing_outside_it(tmp_path):
    """In a fresh process without TRITON_INTERPRET: import every autopar module, define a Triton
    kernel of one's own, run one of autopar's kernels on CPU."""
    script = tmp_path / "import_everything.py"  # (Triton reads a kernel's source from its file)
    script.write_text(IMPORT_EVERYTHING)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"environment changed": [], "users kernel": "JITFunction", "kernel right": True,
                   "triton.language changed": [], "sdpa": True,
                   "selector": "_select_min_cost_strategy", "nll_loss AutogradMeta": False,
                   "cpu flash FLOP formulas": [False, False]}


def torch_state() -> dict:
    """What autopar may change only for the length of one of its steps."""
    return {
        "sdpa": torch.nn.functional.scaled_dot_product_attention,
        "selector": _sharding_prop._select_min_cost_strategy,
        "view split": torch_compat.find("find_shard_for_split", None),  # (none in torch 2.11)
        "export's constraint check": functional_export._suggest_or_raise_constraint_violation,
        "nll_loss AutogradMeta kernel": torch._C._dispatch_has_kernel_for_dispatch_key("aten::nll_loss", "AutogradMeta"),
        "torch function modes": torch._C._len_torch_function_stack(),
        "cpu flash FLOP formulas": [op in flop_counter.flop_registry for op in CPU_FLASH],
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "Module.__setattr__": torch.nn.Module.__dict__["__setattr__"],
        "cyclic collector on": gc.isenabled(),
    }


PRISTINE = {"sdpa": torch._C._nn.scaled_dot_product_attention, "selector": _sharding_prop._select_min_cost_strategy,
            "view split": torch_compat.find("find_shard_for_split", None),
            "export's constraint check": functional_export._suggest_or_raise_constraint_violation,
            "nll_loss AutogradMeta kernel": False, "torch function modes": 0, "cpu flash FLOP formulas": [False, False],
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
            "Module.__setattr__": torch.nn.Module.__dict__["__setattr__"], "cyclic collector on": True}


@torch.library.custom_op("autopar_test::no_backward", mutates_args=())
def no_backward(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@no_backward.register_fake
def _(x):
    return torch.empty_like(x)


class FailsInAutograd(torch.nn.Module):
    """Traces (dynamo), then fails while AOTAutograd builds the backward: no autograd formula."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return no_backward(self.proj(x)).sum()


def _meta_llama(**cfg):
    with torch.device("meta"):
        return Llama(LlamaConfig(n_layers=1, **cfg))


def _tokens():
    return torch.randint(0, LlamaConfig().vocab_size, (4, 16), device="meta")


CASES = {
    # a meta model: the meta fixes (nll_loss's backward, SDPA's CPU flash op) are in force during
    # the autograd pass, and DTensor's selector during propagate
    "succeeds": lambda mesh: autopar.compile(_meta_llama(), mesh, example_inputs=(_tokens(), _tokens()),
                                             loss_fn=cross_entropy, plan={"tp": "megatron"}, capture_eval=False),
    # raises from inside DTensor's propagation (rules shard 2 K/V heads over 4 ranks; the megatron
    # preset would refuse before propagating)
    "fails in propagate": lambda mesh: autopar.compile(_meta_llama(n_kv_heads=2), mesh,
                                                       example_inputs=(_tokens(), _tokens()), loss_fn=cross_entropy,
                                                       plan={"tp": [(f"*{p}_proj.weight", "S(0)") for p in "qkv"],
                                                             "rest": "replicate"}, capture_eval=False),
    # raises from inside AOTAutograd, while the meta fixes are in force
    "fails in autograd": lambda mesh: autopar.compile(FailsInAutograd().to("meta"), mesh,
                                                      example_inputs=(torch.randn(4, 8, device="meta"),),
                                                      loss_fn=None, plan={"dp": "ddp"}, capture_eval=False),
}
MESH = {"succeeds": {"tp": 2}, "fails in propagate": {"tp": 4}, "fails in autograd": {"dp": 2}}
RAISES = {"succeeds": None, "fails in propagate": autopar.ShardingError, "fails in autograd": autopar.CaptureError}


@pytest.mark.parametrize("case", list(CASES))
def test_a_compile_leaves_torch_as_it_found_it(fake, case):
    assert torch_state() == PRISTINE
    with fake(**MESH[case]) as mesh:
        if RAISES[case] is None:
            pm = CASES[case](mesh)
            assert any(r.phase == "backward" for r in pm.collectives())  # nll_loss's backward was traced on meta
        else:
            with pytest.raises(RAISES[case]):
                CASES[case](mesh)
    assert torch_state() == PRISTINE


def test_the_collector_paused_for_a_compile_stays_as_the_user_set_it(fake, monkeypatch):
    """The cyclic collector is off while a compile's passes run (autopar.scoped.paused_collector),
    on again after them, also when they raise; a user who turned it off finds it off."""
    from autopar import passes

    seen, run = [], passes.run_pipeline
    monkeypatch.setattr(passes, "run_pipeline", lambda *a, **k: seen.append(gc.isenabled()) or run(*a, **k))
    with fake(**MESH["succeeds"]) as mesh:
        CASES["succeeds"](mesh)
        assert seen == [False] and gc.isenabled()
        gc.disable()
        try:
            CASES["succeeds"](mesh)
            assert not gc.isenabled()
        finally:
            gc.enable()
    with fake(**MESH["fails in propagate"]) as mesh, pytest.raises(RAISES["fails in propagate"]):
        CASES["fails in propagate"](mesh)
    assert seen == [False, False, False] and gc.isenabled()


def test_autopars_selector_is_seen_only_by_the_propagating_thread(monkeypatch):
    """While autopar propagates a node, DTensor's module holds a dispatching selector: autopar's
    choice in this thread, DTensor's own in any other; DTensor's own again afterwards."""
    from autopar.passes import propagate

    calls = []
    monkeypatch.setattr(_sharding_prop, "_select_min_cost_strategy", lambda s, o=None: calls.append(("dtensor", s)))
    monkeypatch.setattr(propagate, "_select_strategy", lambda node, s, o=None: calls.append(("autopar", s)) or s)
    dtensor_select = _sharding_prop._select_min_cost_strategy
    node = fx.Graph().placeholder("x")
    with propagate._choose_with(node):
        _sharding_prop._select_min_cost_strategy("here", None)
        other = threading.Thread(target=_sharding_prop._select_min_cost_strategy, args=("other thread", None))
        other.start()
        other.join()
    assert calls == [("autopar", "here"), ("dtensor", "other thread")]
    assert _sharding_prop._select_min_cost_strategy is dtensor_select
    with pytest.raises(RuntimeError), propagate._choose_with(node):
        raise RuntimeError("a rule failed")
    assert _sharding_prop._select_min_cost_strategy is dtensor_select


def test_exports_constraint_check_is_skipped_for_autopars_static_captures_only(monkeypatch):
    """autopar's captures skip export's guard building (they have no dynamic dimensions to check);
    a capture with dynamic shapes, or any other thread's export, still runs it; the check is
    torch's own again afterwards."""
    from autopar import capture

    calls = []

    def check(module_to_trace, orig_callable, fake_mode, graph_capture_output, args, kwargs, dynamic_shapes):
        calls.append((threading.current_thread().name, dynamic_shapes))

    monkeypatch.setattr(functional_export, "_suggest_or_raise_constraint_violation", check)
    with capture._static_capture():
        f = functional_export._suggest_or_raise_constraint_violation
        f(None, None, None, None, (), {}, None)  # static: skipped
        f(None, None, None, None, (), {}, dynamic_shapes={"x": {0: "batch"}})
        other = threading.Thread(target=f, args=(None, None, None, None, (), {}, None), name="other")
        other.start()
        other.join()
    assert calls == [("MainThread", {"x": {0: "batch"}}), ("other", None)]
    assert functional_export._suggest_or_raise_constraint_violation is check
    # and a real capture goes through the skip: torch's check is never called
    monkeypatch.setattr(autopar.capture_cache, "enabled", lambda: False)
    calls.clear()
    capture.capture_graph(torch.nn.Linear(4, 4), (torch.randn(2, 4), torch.randn(2, 4)), lambda y, t: ((y - t) ** 2).sum())
    assert calls == []


def test_dynamo_names_no_function_for_its_debug_log_in_autopars_captures_while_that_log_is_off(monkeypatch):
    """autopar's captures skip the function names of dynamo's debug-log headers (each traced file
    tokenized once for them); with that log on (TORCH_LOGS=trace_call) they are named; dynamo's
    own lookup again afterwards."""
    import logging

    from torch._dynamo import symbolic_convert

    from autopar import capture, capture_cache

    calls = []
    monkeypatch.setattr(symbolic_convert, "get_funcname", lambda filename, lineno: calls.append(lineno))
    monkeypatch.setattr(capture_cache, "enabled", lambda: False)
    lookup = symbolic_convert.get_funcname

    def traced():
        capture.capture_graph(torch.nn.Linear(4, 4), (torch.randn(2, 4), torch.randn(2, 4)),
                              lambda y, t: ((y - t) ** 2).sum())

    traced()
    assert calls == [] and symbolic_convert.get_funcname is lookup
    log = logging.getLogger("torch._dynamo.output_graph.__trace_call")
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        traced()
    finally:
        log.setLevel(level)
    assert calls and symbolic_convert.get_funcname is lookup


class _ReassignsItsBuffer(torch.nn.Module):
    """A position table made as ``nn.Buffer`` and assigned again in forward, as CTRL does
    (``self.pos_encoding = self.pos_encoding.to(device=..., dtype=...)``): dynamo could not trace
    Module's own ``__setattr__`` for it ("Unsupported python_type() call")."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.pos = torch.nn.Buffer(torch.randn(8, 16), persistent=False)
        self.proj = torch.nn.Linear(16, 32)

    def forward(self, tokens):
        self.pos = self.pos.to(device=tokens.device, dtype=self.emb.weight.dtype)
        return self.proj(self.emb(tokens) + self.pos[: tokens.shape[1]])


def test_a_buffer_assigned_again_in_forward_is_traced_and_matches_eager():
    """The capture takes the assignment (``autopar.scoped.buffer_assignments``), the program on one
    rank trains as one eager process does, the buffer stays non-persistent, and Module's
    ``__setattr__`` is Module's own again afterwards. While the change is in place, eager code
    (not traced) takes Module's own path: an ``nn.Buffer`` assigned with another persistence
    changes it, as Module does."""
    from autopar.scoped import buffer_assignments
    from autopar.testing import parity_optimizer

    from test_kernels import _one_rank

    torch.manual_seed(0)
    ref = _ReassignsItsBuffer()
    model = _ReassignsItsBuffer()
    model.load_state_dict(ref.state_dict())
    model.pos.copy_(ref.pos)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(2)]

    def loss_fn(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))

    def trained(step, params):
        opt, losses = parity_optimizer(params, 1e-2), []
        for x, y in batches:
            losses.append(step(x, y))
            opt.step()
            opt.zero_grad()
        return losses

    def eager_step(x, y):
        loss = loss_fn(ref(x), y)
        loss.backward()
        return loss.item()

    with _one_rank() as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                             capture_eval=False)
        losses = trained(lambda x, y: float(pm.train_step(x, y)), pm.parameters())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(trained(eager_step, ref.parameters())),
                               rtol=2e-5, atol=2e-5)
    assert "pos" in model._non_persistent_buffers_set
    assert torch_state() == PRISTINE
    eager = _ReassignsItsBuffer()
    with buffer_assignments():
        assert torch.nn.Module.__dict__["__setattr__"] is not PRISTINE["Module.__setattr__"]
        eager.pos = torch.nn.Buffer(eager.pos.clone(), persistent=True)
    assert "pos" not in eager._non_persistent_buffers_set and "pos" in eager.state_dict()
    assert torch_state() == PRISTINE
