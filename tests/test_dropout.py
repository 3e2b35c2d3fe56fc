"""Dropout under every plan (autopar/dropout.py): each element's keep / drop is drawn from
its global position, the seed, the step, the micro-batch and the dropout's node.

- the mask of a block is the block of the whole tensor's mask (shards draw their parts of one
  mask; replicas, the same block, draw the same), about 1 - p of it kept, a new one per step;
- the same losses and gradients at every step on one process and under a plan, the ranks'
  generators seeded differently: GPT-2 with dropout 0.1 everywhere (embeddings, attention
  weights, residuals) under fsdp on dp=2 (batch shards) and on tp=2 with its blocks replicated
  (replicas: the tp ranks must draw the same masks, or their copies would differ); Llama with
  attention dropout 0.1 under megatron on tp=2 (the attention weights sharded by head).
- a dropout reading a row-parallel projection's partial sum reads it reduced (on every torch).
"""

from __future__ import annotations

import pytest
import torch

from autopar.dropout import call_key, eager_dropout, keep_mask
from autopar.runtime.common import full_tensor

P = 0.1


def test_a_block_draws_its_part_of_the_whole_mask():
    shape, strides = (6, 8, 10), [80, 10, 1]
    base = call_key(1234, 7, 0, 99)
    whole = keep_mask(shape, [0, 0, 0], strides, P, base, "cpu")
    block = keep_mask((3, 4, 10), [3, 4, 0], strides, P, base, "cpu")  # dims 0 and 1 split in two
    assert torch.equal(block, whole[3:, 4:, :])
    assert torch.equal(keep_mask(shape, [0, 0, 0], strides, P, base, "cpu"), whole)  # reproducible
    other = [keep_mask(shape, [0, 0, 0], strides, P, call_key(*k), "cpu")
             for k in [(1234, 8, 0, 99), (1234, 7, 1, 99), (1234, 7, 0, 98), (1235, 7, 0, 99)]]
    assert all(not torch.equal(o, whole) for o in other)  # another step, micro-batch, node or seed
    big = keep_mask((1000, 1000), [0, 0], [1000, 1], P, base, "cpu")
    assert abs(big.float().mean().item() - (1 - P)) < 3e-3  # 1e6 draws: sd 3e-4
    x = torch.ones(4, 5)
    y = eager_dropout(x, P, 99, 1234, 7)
    assert set(y.unique().tolist()) <= {0.0, torch.tensor(1 / (1 - P)).item()}


def _model(name: str):
    import transformers

    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=P,
                                      embd_pdrop=P, attn_pdrop=P, use_cache=False, tie_word_embeddings=True)
        cls = transformers.GPT2LMHeadModel
    else:
        from autopar.models.zoo import HF_TINY

        cfg = transformers.LlamaConfig(**dict(HF_TINY, vocab_size=128), attention_dropout=P, use_cache=False,
                                       tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"  # attention dropout as a dropout op on the weights
    torch.manual_seed(0)
    return cls(cfg)


def dropout_job(name: str, axes: dict, plan: dict, steps: int = 3, **options) -> dict:
    import torch.distributed as dist

    import autopar
    from autopar.models.hf_archs import _ce

    model = _model(name)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))
               for _ in range(steps)]
    torch.manual_seed(100 + dist.get_rank())  # ranks' generators differ: the masks must not care
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=batches[0], loss_fn=_ce, plan=plan,
                         capture_eval=False, **options)
    pm.seed = 42
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses, grads = [], []
    for x, y in batches:
        losses.append(pm.train_step(x, y).item())
        grads.append({n: full_tensor(p.grad).clone() for n, p in pm.named_parameters()})
        opt.step()
        opt.zero_grad()
    masks = sum(1 for n in pm.program.local.graph.nodes if n.target is torch.ops.autopar.dropout_mask.default)
    return {"losses": losses, "grads": grads, "masks": masks}


@pytest.fixture(scope="module")
def one_process(pools):
    made = {}

    def get(name):
        if name not in made:
            made[name] = pools(1).run(dropout_job, name, {"dp": 1}, {"dp": "ddp"})
        return made[name]
    return get


CASES = [("gpt2", {"dp": 2}, {"dp": "fsdp"}, 2 * 3 + 1),  # per block: attention weights, attention out, MLP
         ("gpt2", {"tp": 2}, {"tp": "megatron"}, 2 * 3 + 1),  # fused q/k/v strided over tp, + the embeddings
         ("llama", {"tp": 2}, {"tp": "megatron"}, 2)]


@pytest.mark.parametrize("name,axes,plan,masks", CASES, ids=["gpt2-fsdp", "gpt2-megatron", "llama-megatron"])
def test_plans_draw_the_masks_one_process_draws(pools, one_process, name, axes, plan, masks):
    ref = one_process(name)
    out = pools(2).run(dropout_job, name, axes, plan)
    assert out["masks"] == ref["masks"] == masks
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    for step, (g_ref, g_out) in enumerate(zip(ref["grads"], out["grads"])):
        for k in g_ref:
            torch.testing.assert_close(g_out[k], g_ref[k], rtol=1e-4, atol=3e-5, msg=f"grad {k} at step {step}")


class _DropAfterRowParallel(torch.nn.Module):
    """An MLP whose output (a partial sum under megatron: ``down`` is row-parallel) goes through a
    dropout before the residual add, as GPT-2's ``resid_dropout`` does."""

    def __init__(self, dim=32):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.drop = torch.nn.Dropout(P)

    def forward(self, x):
        return x + self.drop(self.down(torch.relu(self.up(x))))


def test_a_dropout_reads_a_partial_sum_reduced():
    """A seeded random op never samples a partial sum: the row-parallel projection's output is
    all-reduced first, and the dropout's output is replicated (``partials.reduced_before_random``;
    torch 2.11's DTensor raised "native_dropout with Partial is not supported yet", 2.12+ offers
    Replicate, which autopar now decides itself on every version)."""
    from torch.distributed.tensor.placement_types import Partial, Replicate

    import autopar
    from autopar.ir import spec_of
    from autopar.mesh import fake_mesh
    from test_tp_derive import LM, _ce

    from torch import fx
    from torch.distributed.tensor.placement_types import Shard

    from autopar.ir import ShardSpec
    from autopar.passes.partials import reduced_first

    # the rule itself (DTensor 2.12+ would choose the same below, so the compile alone cannot fail there)
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    drop = g.call_function(torch.ops.aten.native_dropout.default, (x, P, True))
    drop.meta["val"] = (torch.empty(4, 8), torch.empty(4, 8, dtype=torch.bool))
    got = reduced_first(drop, [ShardSpec((Shard(0), Partial()), (4, 8), torch.float32)])
    assert (got.inputs, got.outputs) == ([(Shard(0), Replicate())], ((Shard(0), Replicate()),) * 2)
    add = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    assert reduced_first(add, [ShardSpec((Partial(),), (4, 8), torch.float32)] * 2) is None

    tokens = torch.zeros(4, 8, dtype=torch.long)
    with fake_mesh({"tp": 2}, 0) as mesh:
        pm = autopar.compile(LM([_DropAfterRowParallel() for _ in range(2)]), mesh, example_inputs=(tokens, tokens),
                             loss_fn=_ce, plan={"tp": "megatron"}, capture_eval=False)
    graph = pm.program.graph
    drops = [n for n in graph.nodes if n.target is torch.ops.aten.native_dropout.default]
    assert len(drops) == 2
    for n in drops:
        assert all(o.placements == (Replicate(),) for o in spec_of(n)), spec_of(n)  # (output, mask)
        src = n.args[0]  # (the reduction autopar inserted, reading the row-parallel product's Partial sum)
        assert not isinstance(spec_of(src).placements[0], Partial), src.format_node()
        assert isinstance(spec_of(src.args[0]).placements[0], Partial), src.args[0].format_node()
