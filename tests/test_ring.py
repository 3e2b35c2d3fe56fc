"""{"cp": "context"}: ring attention on a ``cp`` mesh axis (autopar/ring.py, autopar/layout.py).

The sequence is sharded over cp in the load-balanced causal layout (2·cp chunks, rank i holds
chunks i and 2·cp-1-i) everywhere, attention included: K/V blocks go round the ring while each
rank computes its queries' partial attention, merged by log-sum-exp; the backward ring carries
dK/dV with them. Checked: parity against one process on gloo pools (losses, gradients,
parameters after AdamW steps, eval forward; measured = predicted bytes and memory) on cp=2, cp=4,
fsdp x cp, megatron x cp and 1f1b x cp, and with the math formulation of the blocks; the shifts'
count and bytes per layer against the formula, the layout helpers, and the PlanError for a
sequence 2·cp does not divide.
"""

from __future__ import annotations

import os

import pytest
import torch

from autopar.errors import PlanError
from autopar.layout import zigzag_index, zigzag_order, zigzag_take, zigzag_unorder
from autopar.testing import parity_job
from test_context import _compile
from test_parity import assert_parity, run_and_check_parity

# (name, axes, plan, also the eval program: its logits gathered back into sequence order)
CASES = [
    ("llama", {"cp": 2}, {"cp": "context"}, True),
    ("hf_llama", {"cp": 2}, {"cp": "context"}, True),  # HF's explicit causal mask, cut per block
    ("llama", {"cp": 4}, {"cp": "context"}, False),  # blocks from ranks before and after: both halves of the plan
    ("llama", {"dp": 2, "cp": 2}, {"dp": "fsdp", "cp": "context"}, False),
    ("llama", {"tp": 2, "cp": 2}, {"tp": "megatron", "cp": "context"}, False),  # the ring on each tp rank's heads
]


@pytest.mark.parametrize("name,axes,plan,evaluate", CASES,
                         ids=[f"{c[0]}-{'x'.join(f'{k}{v}' for k, v in c[1].items())}" for c in CASES])
def test_ring_parity(pools, references, name, axes, plan, evaluate):
    out = run_and_check_parity(pools, references, name, axes, plan, evaluate)  # numbers, memory, bytes
    cp = [r for r in out["records"] if r.axis == "cp"]
    assert {r.kind for r in cp} == {"shift", "all_reduce"}
    for r in cp:  # the ring's shifts; the loss rule's sums and the gradients' all-reduces
        assert r.reason.startswith("inside rule: ring attention") if r.kind == "shift" else \
            r.reason.startswith(("inside rule", "bucket of", "gradient of")), r


def _math_parity_job(name, axes, plan):
    """parity_job with the ring's blocks in the math formulation (what devices without a fused op
    that returns the log-sum-exp run), on CPU."""
    import autopar.ring

    fused, autopar.ring.FUSED = autopar.ring.FUSED, set()
    try:
        return parity_job(name, axes, plan, evaluate=False)
    finally:
        autopar.ring.FUSED = fused


def test_ring_math_blocks_parity(pools, references):
    out = pools(2).run(_math_parity_job, "hf_llama", {"cp": 2}, {"cp": "context"})
    assert_parity(references("hf_llama"), out, "hf_llama")


def _kernels_parity_job(name, axes, plan, triton: bool):
    """parity_job with autopar's attention kernel lowered into the graph (``kernels="on"``), run
    by its PyTorch reference, or with ``triton`` by the Triton kernels (Triton's interpreter on
    CPU: 20 to 60 s a case here, so only with AUTOPAR_TEST_TRITON=1); the ring's blocks call
    ``autopar::flash_attention``, KV heads not repeated."""
    from autopar.kernels.ops import reference

    with reference(not triton):
        return parity_job(name, axes, plan, evaluate=triton, kernels="on")


@pytest.mark.parametrize("name", ["llama", "hf_llama"])
def test_ring_kernel_ops_parity(pools, references, name):
    triton = os.environ.get("AUTOPAR_TEST_TRITON") == "1"
    out = pools(2).run(_kernels_parity_job, name, {"cp": 2}, {"cp": "context"}, triton)
    assert "ring attention (cp=context)" in out["rules"]
    assert_parity(references(name), out, name)
    # the kernel reads KV heads once per group: the ring ships h_kv heads (as it does for the
    # repeated heads of the default path)
    b, s, h_kv, layers, steps = 4, 16, 32, 2, out["steps"]
    shift = out["measured"]["shift@cp"]["wire_bytes"]
    assert shift == steps * layers * (2 * b * s * h_kv // 2 + 2 * b * s * h_kv * 3 // 2) * 4


def test_ring_in_pipeline_parity(pools, references):
    # pp x cp on 4 ranks (1f1b): each stage runs the ring on its cp sub-mesh; the stages hand each
    # other sequence shards in the load-balanced layout (cp rank r of stage 0 -> cp rank r of stage 1)
    from autopar.testing import pipeline_parity_job
    from test_pipeline import assert_bytes_predicted, assert_parity as assert_pipeline_parity

    out = pools(4).run(pipeline_parity_job, "llama", {"pp": 2, "cp": 2}, {"pp": "1f1b", "cp": "context"})
    assert_pipeline_parity(references("llama"), out)
    for got in assert_bytes_predicted(out):
        assert got.get("send@pp", 0) > 0 and got.get("shift@cp", 0) > 0, got


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_per_layer(fake, cp):
    # the built-in Llama (2 layers, 4 heads x 16, 2 KV heads repeated to 4 before attention: the
    # ring carries one copy of each, h_kv = 2 x 16 = 32), batch 4, seq 16, fp32. A block
    # (K or V of one rank) is b·(s/cp)·h_kv elements. Per layer, forward: cp-1 shifts of K+V,
    # 2·b·s·h_kv·(cp-1)/cp elements leave each rank; backward: cp-1 shifts of K+V and cp of
    # dK+dV, 2·b·s·h_kv·(2·cp-1)/cp
    b, s, h_kv, layers = 4, 16, 32, 2
    pm = _compile(fake, "llama", {"cp": cp}, {"cp": "context"})
    shifts = [r for r in pm.collectives() if r.kind == "shift"]
    assert all(r.axis == "cp" and r.group_size == cp for r in shifts)
    block = b * (s // cp) * h_kv * 4
    fwd = [r for r in shifts if r.phase == "forward"]
    bwd = [r for r in shifts if r.phase == "backward"]
    assert len(fwd) == layers * (cp - 1) and len(bwd) == layers * (2 * cp - 1)
    assert sum(r.wire_bytes for r in fwd) == layers * 2 * b * s * h_kv * (cp - 1) // cp * 4 == layers * 2 * (cp - 1) * block
    assert sum(r.wire_bytes for r in bwd) == layers * 2 * b * s * h_kv * (2 * cp - 1) // cp * 4
    # nothing else moves activations on cp (the RoPE tables are sliced locally, in the layout):
    # the loss rule's two scalars, the gradients' all-reduce
    others = [r for r in pm.collectives() if r.kind != "shift"]
    assert {r.kind for r in others} == {"all_reduce"}
    assert all(r.payload_bytes == 4 or r.reason.startswith(("bucket of", "gradient of")) for r in others)


def test_ring_lowers_activation_memory(fake):
    from autopar.analysis.cost import predict_memory

    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    peak = {cp: predict_memory(_compile(fake, "llama", {"cp": cp}, {"cp": "context"}, batch=(x, x)))
            for cp in (1, 2, 4)}
    assert peak[1]["parameters"] == peak[2]["parameters"] == peak[4]["parameters"]  # replicated on cp
    # every activation is divided by cp (attention's: this rank's queries, one K/V block); the most
    # activation bytes alive at once (at cp=4 the step's peak is a gradient bucket's moment)
    for cp in (2, 4):
        ratio = peak[cp]["max_activations"] / peak[1]["max_activations"]
        assert ratio == pytest.approx(1 / cp, rel=0.15), (cp, ratio)


def test_ring_bad_inputs(fake):
    # 2·cp chunks: a sequence of 6 divides by cp=2 (ulysses runs it) but not by 4
    x = torch.randint(0, 256, (4, 6))
    with pytest.raises(PlanError, match=r"sequence length .*: 6\) to be divisible by 2 x the ranks of mesh axis "
                                        r"'cp' \(4: .*2·cp chunks"):
        _compile(fake, "llama", {"cp": 2}, {"cp": "context"}, batch=(x, x))
    x = torch.randint(0, 256, (4, 12))
    with pytest.raises(PlanError, match=r"divisible by 2 x the ranks of mesh axis 'cp' \(8"):
        _compile(fake, "llama", {"cp": 4}, {"cp": "context"}, batch=(x, x))


def test_zigzag_layout():
    x = torch.arange(16).view(1, 16)
    parts = [zigzag_take(x, 1, 4, r) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert [zigzag_index(16, 4, r) for r in range(4)] == [p[0].tolist() for p in parts]
    assert torch.equal(zigzag_order(torch.cat(parts, 1), 1, 4), x)
    assert torch.equal(zigzag_unorder(x, 1, 4), torch.cat(parts, 1))
