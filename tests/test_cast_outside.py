"""Mixed precision's parameter casts made outside dynamo's trace (autopar/cast_outside.py): the
capture must be the one dynamo gives when it traces the casts itself (``functional_call`` in the
traced code), node for node, and so must the joint graph AOTAutograd makes of it (ops, arguments,
module paths, values, the program's inputs and outputs); the user's model is left as it was,
also when the trace fails; where stand-ins do not apply the casts are traced as before."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from autopar import capture_cache, cast_outside
from autopar.capture import capture_graph, joint_program
from autopar.errors import CaptureError
from autopar.ir import source_line
from autopar.models import zoo
from autopar.modpath import get_attr, stack_path

import foreign_models


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")  # both captures traced, neither read
    monkeypatch.setenv("AUTOPAR_DISK_CACHE", "0")
    capture_cache.clear()


def _canon(graph: fx.Graph, model: nn.Module) -> list:
    """Each node as (op, target, arguments, value, module paths, phase, user line): a get_attr by
    the model's tensor it reads (its attribute's name is dynamo's, or autopar's for an unused one)."""
    names = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    index, out = {}, []
    for k, n in enumerate(graph.nodes):
        index[n] = k
        target = names.get(id(get_attr(graph.owning_module, n.target)), n.target) if n.op == "get_attr" else n.target
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", index[a]))
        v = n.meta.get("example_value", n.meta.get("val"))
        value = (tuple(v.shape), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor) else None
        # a cast's line: in autopar/capture.py either way (moved); a read of a buffer had
        # functional_call's, which names no line of the model
        line = source_line(n) if n.op != "get_attr" else ""
        out.append((n.op, str(target), str(args), value, stack_path(n.meta.get("nn_module_stack")),
                    stack_path(n.meta.get("fwd_nn_module_stack")), str(n.meta.get("partitioner_tag")),
                    line.split(":")[0] if line.startswith("autopar/") else line))
    return out


def _traced(model, inputs, loss, dtype):
    """The capture with the casts in the traced code (stand-ins off), and its joint program."""
    saved = cast_outside._DEVICES
    cast_outside._DEVICES = ()
    try:
        gm = capture_graph(model, inputs, loss, dtype)
        return gm, joint_program(gm, inputs, model)
    finally:
        cast_outside._DEVICES = saved


class _Odd(nn.Module):
    """A frozen weight, an integer parameter, unused parameters (floating-point and integer), a
    buffer read in the forward and one not, a weight shared by two modules."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.weight.requires_grad_(False)
        self.steps = nn.Parameter(torch.tensor([3]), requires_grad=False)
        self.unused = nn.Linear(16, 16)
        self.unused_steps = nn.Parameter(torch.tensor([1]), requires_grad=False)
        self.register_buffer("scale", torch.full((16,), 0.5))
        self.register_buffer("unused_scale", torch.full((16,), 0.5))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.frozen(self.embed(tokens)) * self.scale
        return self.head(x) + self.steps.float().sum() * 0


def _odd():
    with torch.device("meta"):
        model = _Odd()
    tokens = torch.zeros((2, 8), dtype=torch.long, device="meta")
    return model, (tokens, torch.zeros_like(tokens)), foreign_models._ce


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Wrapped(nn.Module):
    """Blocks under activation checkpointing (dynamo's higher-order op lifts their weights) and a
    weight-normed head (its parameters are the parametrization's ``original0`` / ``original1``)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.utils.parametrizations.weight_norm(nn.Linear(16, 8))

    def forward(self, x):
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return self.head(x)


def _wrapped():
    return _Wrapped(), (torch.randn(4, 16), torch.randn(4, 8)), nn.functional.mse_loss


def _zoo(spec):
    def make():
        loaded = zoo.load(spec, meta=True, batch=2, seq=16)
        return loaded.model, loaded.example_inputs, loaded.loss_fn
    return make


def _hf(name):
    return lambda: foreign_models.hf(name, num_hidden_layers=2)


@pytest.mark.parametrize("make,dtype", [
    (_hf("Llama"), torch.bfloat16),
    (_hf("GPT-2"), torch.bfloat16),  # tied embedding and head
    (_hf("Mixtral"), torch.float16),
    (_zoo("moe-tiny"), torch.bfloat16),
    (_odd, torch.bfloat16),
    (_wrapped, torch.bfloat16),  # (on the CPU)
], ids=["hf-llama", "hf-gpt2", "hf-mixtral-fp16", "moe-tiny", "odd", "checkpointed-weight-normed"])
def test_the_capture_and_joint_graph_are_the_traced_casts(make, dtype):
    model, inputs, loss = make()
    before = {n: (p, p.dtype) for n, p in model.named_parameters()}
    old_gm, old = _traced(model, inputs, loss, dtype)
    with cast_outside.stand_ins(model, dtype) as pairs:
        assert pairs is not None  # (the stand-ins apply: meta parameters)
    new_gm = capture_graph(model, inputs, loss, dtype)
    new = joint_program(new_gm, inputs, model)
    assert _canon(new_gm.graph, model) == _canon(old_gm.graph, model)
    assert _canon(new.graph, model) == _canon(old.graph, model)
    assert (new.inputs, new.outputs) == (old.inputs, old.outputs)
    # every tensor a get_attr reads is the user's own fp32 one, as in the traced casts' graph
    # (other reads: a higher-order op's body)
    reads = [v for n in new_gm.graph.nodes if n.op == "get_attr"
             if isinstance(v := getattr(new_gm, n.target), torch.Tensor)]
    assert all(any(r is p for p, _ in before.values()) or any(r is b for b in model.buffers()) for r in reads)
    assert {n: (p, p.dtype) for n, p in model.named_parameters()} == before


def test_the_model_is_left_as_it_was_when_the_trace_fails():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).reshape(3, -1)  # 2 x 8 elements: not a multiple of 3

    model = Fails()
    weight = model.lin.weight
    with pytest.raises(CaptureError):
        capture_graph(model, (torch.randn(2, 8), torch.randn(2, 8)), nn.functional.mse_loss, torch.bfloat16)
    assert model.lin.weight is weight and weight.dtype == torch.float32


def test_where_stand_ins_do_not_apply_the_casts_are_traced():
    class Tagged(nn.Parameter):  # a parameter subclass: its behaviour may hang on its type
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[0].weight = Tagged(model[0].weight.detach())
    with cast_outside.stand_ins(model, torch.bfloat16) as pairs:
        assert pairs is None and type(model[0].weight) is Tagged
    on_cpu, on_meta = nn.Linear(8, 8), nn.Linear(8, 8, device="meta")
    torch.use_deterministic_algorithms(True)  # (fills uninitialised CPU memory: stand-ins would cost it)
    try:
        with cast_outside.stand_ins(on_cpu, torch.bfloat16) as cpu, \
                cast_outside.stand_ins(on_meta, torch.bfloat16) as meta:
            assert cpu is None and meta is not None
    finally:
        torch.use_deterministic_algorithms(False)
    inputs = (torch.randn(2, 8), torch.randn(2, 8))
    gm = capture_graph(model, inputs, nn.functional.mse_loss, torch.bfloat16)
    casts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert len(casts) == 4 and all(n.args[1] == torch.bfloat16 for n in casts)
