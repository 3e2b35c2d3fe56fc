"""localize's recorder (autopar/record.py) against make_fx, which it replaces.

The per-rank program localize traces must be the one make_fx traced: the same nodes in the same
order with the same names, targets and operands, each value with the same shape, strides, dtype,
device, storage offset and aliasing (which earlier value's storage it shares: what the liveness
analysis reads), and the metadata autopar reads after localize (stack trace, ``custom``'s origin,
``nn_module_stack``, ``partitioner_tag``...). Compiled on fake meshes both ways
(``record.available`` switched), cases chosen for what they trace: DTensor's dispatch and a
rule's local implementation (Hugging Face Llama, Megatron's vocabulary-parallel embedding), ring
attention (views refused by their strides and retried on a copy: a node made and dropped), expert
parallelism's custom ops, a pipeline stage, dropout; then functions that make a constant, update
in place, return tuples and decompose an op, against make_fx directly.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from autopar import record
from autopar.compiler import build
from autopar.options import CompileOptions
from autopar.testing import build_model

META = ("stack_trace", "custom", "nn_module_stack", "partitioner_tag", "original_aten", "source_fn_stack",
        "recompute", "ac_graph_id")


def nodes(gm: fx.GraphModule) -> list:
    """Per node: its name, test_splice's canonical form of a per-rank node (op, target, arguments by
    position, each value's shape, strides, dtype and storage offset, which earlier node's storage it
    shares, origin, CommRecord, module path), its values' devices and the other metadata fields
    autopar reads."""
    from test_splice import _local_canon

    def devices(v):
        return [x.device.type for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, torch.Tensor)]

    return [(n.name, canon, devices(n.meta.get("val")), tuple(str(n.meta.get(k)) for k in META))
            for n, canon in zip(gm.graph.nodes, _local_canon(gm))]


def _dropout_model():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.1,
                                  embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 16))
    return transformers.GPT2LMHeadModel(cfg), [(tokens, tokens)], \
        lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))


CASES = [
    ("hf_llama", {"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "megatron"}, 3),
    ("llama", {"dp": 2, "cp": 2}, {"dp": "fsdp", "cp": "context"}, 1),
    ("moe_dropless", {"dp": 2, "ep": 2}, {"dp": "fsdp", "ep": "expert"}, 2),
    ("llama6", {"pp": 2, "dp": 2}, {"pp": "1f1b", "dp": "fsdp"}, 1),
    ("gpt2_dropout", {"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "megatron"}, 3),
]


def programs(name, axes, plan, rank, fake, recorded: bool, monkeypatch) -> list:
    monkeypatch.setattr(record, "available", lambda: recorded)
    model, batches, loss_fn = _dropout_model() if name == "gpt2_dropout" else build_model(name)
    with fake(rank, **axes) as mesh:
        state = build(model, mesh, CompileOptions(plan=plan, example_inputs=batches[0], loss_fn=loss_fn,
                                                  capture_eval=False), stop_after="localize")
    return [nodes(stage.program.local) for stage in state.stages]


@pytest.mark.parametrize("name,axes,plan,rank", CASES, ids=[f"{c[0]}-{'x'.join(c[2].values())}" for c in CASES])
def test_record_traces_make_fxs_program(name, axes, plan, rank, fake, monkeypatch):
    recorded = programs(name, axes, plan, rank, fake, True, monkeypatch)
    traced = programs(name, axes, plan, rank, fake, False, monkeypatch)
    assert len(recorded) == len(traced) >= 1
    for got, want in zip(recorded, traced):
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a == b, f"node {i}: recorded {a} != make_fx's {b}"


def test_the_comparison_sees_a_difference(fake, monkeypatch):
    """The check above can fail: a recorder that names one op otherwise makes another program, and
    the comparison says so."""
    real = record._op_name
    monkeypatch.setattr(record, "_op_name", lambda f: "gather" if f is torch.ops._c10d_functional.all_gather_into_tensor.default
                        else real(f))
    case = CASES[0]
    assert programs(*case, fake, True, monkeypatch) != programs(*case, fake, False, monkeypatch)


def _both(fn, example) -> tuple[list, list]:
    with torch.no_grad():
        return nodes(record.record(fn, example)), nodes(make_fx(fn, tracing_mode="fake")(*example))


def test_constants_in_place_and_tuples_as_make_fx():
    """A constant made from data (``torch.tensor``: lifted, kept on the module), a factory op's output
    (torch's binding detaches it if Python still holds it: the recorder must not), an in-place update
    (its node's value taken before a later change), a tuple output and a list output."""
    def fn(*args):  # (varargs: make_fx names the placeholders arg0_1..., as localize's)
        x, w = args
        scale = torch.tensor([2.0, 3.0, 4.0])
        z = torch.zeros_like(x)
        z.add_(x * scale)
        mean, rstd = torch.ops.aten.native_layer_norm.default(z, [3], w, None, 1e-5)[1:]
        a, b = torch.split(z, 2)
        z.unsqueeze_(0)
        return [a + b.sum(), mean, rstd, z, None]

    got, want = _both(fn, [torch.randn(4, 3), torch.randn(3)])
    assert got == want
    assert any(n[1][0] == "get_attr" for n in got)


def test_decompositions_as_make_fx():
    """Under inference mode autograd's keys are skipped, so a CompositeImplicitAutograd op (linear)
    reaches the recorder whole: decomposed as make_fx decomposes it (t + mm); an in-place op on
    its result."""
    def fn(*args):
        return [torch.nn.functional.silu(torch.nn.functional.linear(args[0], args[1])).unsqueeze_(0)]

    example = [torch.randn(4, 3), torch.randn(5, 3)]
    with torch.inference_mode():
        got, want = nodes(record.record(fn, example)), nodes(make_fx(fn, tracing_mode="fake")(*example))
    assert got == want
    assert [n[1][1] for n in got if n[1][0] == "call_function"] == \
        ["aten.t.default", "aten.mm.default", "aten.silu.default", "aten.unsqueeze_.default"]


def test_collectives_seen_before_are_made_from_their_metadata(monkeypatch):
    """A functional collective or wait seen before on operands of the same metadata gets fresh
    outputs made to the metadata it gave then (record.py ``_SEEN``): the graph and values are
    make_fx's (fresh storages: liveness reads which values share one); of the twelve calls, the
    second all_reduce, the second coalesced gather (a list output) and five of the seven waits are
    made from the table."""
    import torch.distributed._functional_collectives  # noqa: F401 - the _c10d_functional ops

    c = torch.ops._c10d_functional

    def fn(*args):
        x, y = args
        a = c.wait_tensor(c.all_reduce(x, "sum", "g0"))
        b = c.wait_tensor(c.all_gather_into_tensor(y, 2, "g0"))
        a2 = c.wait_tensor(c.all_reduce(x * 2, "sum", "g0"))
        p, q = c.all_gather_into_tensor_coalesced([x, y], 2, "g0")
        p2, q2 = c.all_gather_into_tensor_coalesced([x * 3, y], 2, "g0")
        return [a + a2, b, c.wait_tensor(p) + c.wait_tensor(p2), c.wait_tensor(q) * c.wait_tensor(q2)]

    made_here = []
    real = record._made
    monkeypatch.setattr(record, "_made", lambda known: made_here.append(known) or real(known))
    record._SEEN.clear()
    got, want = _both(fn, [torch.randn(4, 3), torch.randn(2, 3)])
    assert got == want
    kinds = sorted(k[0].__name__ for k, v in record._SEEN.items() if v is not None)
    # (an entry per op and operands' metadata: the waits on (4, 3) and on (8, 3) tensors)
    assert kinds == ["all_gather_into_tensor.default", "all_gather_into_tensor_coalesced.default",
                     "all_reduce.default", "wait_tensor.default", "wait_tensor.default"], kinds
    assert len(made_here) == 7
    # each collective's and wait's outputs new storages, none an earlier value's
    made = [(k, n[1][4]) for k, n in enumerate(got) if "_c10d_functional" in n[1][1]]
    assert len(made) == 12 and all(shares == [k] * len(shares) for k, shares in made)


def test_value_reads_refused():
    """A value read from a tensor while localizing (make_fx would burn a constant in) is an error."""
    def fn(*args):
        return [args[0] * args[0].sum().item()]

    with pytest.raises(record.RecordError, match="_local_scalar_dense"):
        with torch.no_grad():
            record.record(fn, [torch.randn(3)])
