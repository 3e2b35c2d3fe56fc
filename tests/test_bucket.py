"""Gradient bucketing (passes/bucket.py, run by the overlap pass).

- The rewrite fired: Llama-tiny's per-gradient all-reduces (DDP) / reduce-scatters (FSDP)
  become one collective per bucket, with the same bytes, one CommRecord naming the gradients,
  and the per-rank invariants (``debug=True``) holding.
- Bucket boundaries: DDP's assignment by size (small first bucket), reduce-scatters per block
  (FSDP2's unit), never across collective kinds, process groups, reduce ops or dtypes; on a
  list, on a hand-built graph and on 2-D meshes.
- Numerics on 2 gloo ranks: bucketed gradients equal unbucketed ones bit for bit (a sum of two
  values does not depend on where in a buffer it sits).
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import autopar
from autopar.errors import PlanError
from autopar.ir import CommRecord, info
from autopar.models import zoo
from autopar.modpath import block_of
from autopar.passes.bucket import Reduction, assign_buckets, bucket_gradient_reductions
from autopar.runtime.common import full_tensor

c10d = torch.ops._c10d_functional
REDUCTIONS = (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default)
MiB = 2**20


def compile_tiny(mesh, plan, **options):
    loaded = zoo.load("llama-tiny", meta=False, batch=8)
    return autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                           plan=plan, capture_eval=False, debug=True, **options)


def is_grad(r) -> bool:
    return r.reason.startswith("gradient of") or (r.reason.startswith("bucket of")
                                                  and r.reason.split(" (")[0].endswith("gradients"))


def grad_records(pm, kind=None, axis="dp"):
    return [r for r in pm.collectives() if is_grad(r) and r.axis == axis and kind in (None, r.kind)]


def names_of(r) -> list[str]:
    """The gradients a record reduces: "gradient of NAME ..." or "bucket of N gradients (A, B)"."""
    if r.reason.startswith("gradient of"):
        return [r.reason.split()[2]]
    return r.reason.split("(", 1)[1].rstrip(")").split(", ")


def by_block(names: list[str]) -> list[list[str]]:
    """Consecutive names of one repeated block (``layers.1``; "" outside every block) grouped."""
    groups: list[list[str]] = []
    for n in names:
        if groups and block_of(groups[-1][-1]) == block_of(n):
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups


@pytest.mark.parametrize("plan,kind", [("ddp", "all_reduce"), ("fsdp", "reduce_scatter")])
def test_llama_tiny_one_collective_per_bucket(fake, plan, kind):
    """Llama-tiny's gradients (~0.4 MiB) fit in DDP's first bucket: one all-reduce. FSDP's
    reduce-scatters are bucketed per block, FSDP2's unit: LM head + final norm, each layer, and
    the embedding (issued last, alone: left as it was)."""
    with fake(dp=2) as mesh:
        per_grad = compile_tiny(mesh, {"dp": plan}, bucket_mb=0)
        bucketed = compile_tiny(mesh, {"dp": plan})  # default: 25 MiB, the first bucket 1 MiB
        before, after = grad_records(per_grad, kind), grad_records(bucketed, kind)
        order = [names_of(r)[0] for r in before]  # backward (issue) order
        assert sorted(order) == sorted(n for n, _ in per_grad.named_parameters())
        assert all(r.reason.startswith("gradient of") for r in before)
        want = [order] if kind == "all_reduce" else by_block(order)
        assert kind == "all_reduce" or [len(g) for g in want] == [2, 9, 9, 1]
        assert [names_of(r) for r in after] == want
        assert all(r.reason.startswith(f"bucket of {len(names_of(r))} gradients (") for r in after
                   if len(names_of(r)) > 1)
        # the same bytes, on the same axis: predicted = counted at the process group stays exact
        assert sum(r.payload_bytes for r in after) == sum(r.payload_bytes for r in before)
        assert (sum(r.wire_bytes for r in bucketed.collectives())
                == sum(r.wire_bytes for r in per_grad.collectives()))
        graph = bucketed.program.local.graph
        colls = [n for n in graph.nodes if n.target in REDUCTIONS]
        waits = [n for n in graph.nodes if n.target is c10d.wait_tensor.default and n.args[0] in colls]
        assert len(colls) == len(waits) == 2 + len(want)  # the loss's two statistics + one per bucket


def test_buckets_close_by_size_in_backward_order(fake):
    """Several buckets: DDP's sizes (the first one small), issued while the backward still runs,
    every wait after every issue (deferred to the end), gradients in backward order."""
    cap = 0.05  # MiB: below 1 MiB, so the first bucket's limit too
    with fake(dp=2) as mesh:
        per_grad = compile_tiny(mesh, {"dp": "ddp"}, bucket_mb=0)
        pm = compile_tiny(mesh, {"dp": "ddp"}, bucket_mb=cap)
        order = [names_of(r)[0] for r in grad_records(per_grad)]  # issue order
        sizes = {names_of(r)[0]: r.payload_bytes for r in grad_records(per_grad)}
        groups = [names_of(r) for r in grad_records(pm)]
        assert len([g for g in groups if len(g) > 1]) >= 3
        assert [n for g in groups for n in g] == order  # backward order, bucket after bucket
        for r, g in zip(grad_records(pm), groups):
            assert r.payload_bytes == sum(sizes[n] for n in g)
            assert sum(sizes[n] for n in g[:-1]) < cap * MiB  # closed by the gradient that filled it
        nodes = list(pm.program.local.graph.nodes)
        buckets = [n for n in nodes if info(n).comm is not None and info(n).comm.reason.startswith("bucket")]
        issues = [nodes.index(n) for n in buckets]
        waits = [nodes.index(w) for n in buckets for w in n.users if w.target is c10d.wait_tensor.default]
        mms = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
        assert issues[0] < max(mms)  # the first bucket goes on the wire while the backward still runs
        assert min(waits) > max(issues)


def test_first_bucket_is_small():
    """DDP's assignment on a list: 1 MiB first, then the cap; a bucket closes at the gradient that
    fills it; keys never mix, each with its own small first bucket; issue order = last member's.
    Reduce-scatters: a bucket also closes where the block changes."""
    def red(name, nbytes, key=("all_reduce", "0", "sum", torch.float32, 1)):
        return Reduction(None, None, name, key, nbytes)

    bf16 = ("all_reduce", "0", "sum", torch.bfloat16, 1)
    rs = [red("a", MiB // 2), red("b", MiB // 2), red("c", 3 * MiB), red("x", 2 * MiB, bf16),
          red("d", 2 * MiB), red("e", MiB), red("y", 1, bf16), red("f", 1)]
    got = [[r.name for r in b] for b in assign_buckets(rs, 4 * MiB)]
    assert got == [["a", "b"], ["x"], ["c", "d"], ["y"], ["e", "f"]]
    assert [[r.name for r in b] for b in assign_buckets(rs[:3], 0.25 * MiB)] == [["a"], ["b"], ["c"]]
    names = ("head.weight", "norm.weight", "layers.1.w", "layers.1.v", "layers.0.w", "embed.weight")
    rs = [Reduction(None, None, n, ("reduce_scatter", "0", "sum", torch.float32, 2), 1, block_of(n))
          for n in names]
    got = [[r.name for r in b] for b in assign_buckets(rs, 4 * MiB)]
    assert got == [["head.weight", "norm.weight"], ["layers.1.w", "layers.1.v"], ["layers.0.w"],
                   ["embed.weight"]]


def test_buckets_never_mix_groups_ops_or_dtypes(fake):
    """A hand-built per-rank program: gradients reduced on two process groups, with two reduce
    ops and two dtypes. Only same-key reductions share a bucket; a bucket of one is left as is."""
    f32, bf16 = torch.float32, torch.bfloat16
    with fake(dp=2, tp=2) as mesh:
        dp, tp = mesh.get_group("dp").group_name, mesh.get_group("tp").group_name
        specs = [("g0", dp, "sum", f32), ("g1", tp, "sum", f32), ("g2", dp, "sum", f32),
                 ("g3", dp, "avg", f32), ("g4", dp, "sum", bf16), ("g5", tp, "sum", f32),
                 ("g6", dp, "sum", f32)]

        def program(*xs):
            return [c10d.wait_tensor(c10d.all_reduce(x * 2, op, group))
                    for x, (_, group, op, _) in zip(xs, specs)]

        gm = make_fx(program, tracing_mode="fake")(*[torch.randn(4, 3, dtype=d) for *_, d in specs])
        for n in gm.graph.nodes:
            if n.target is c10d.all_reduce.default:
                v = n.args[0].meta["val"]
                info(n).comm = CommRecord("all_reduce", "dp" if n.args[2] == dp else "tp", 2,
                                          v.numel() * v.dtype.itemsize, "gradient of ...", "", "backward")
        done = bucket_gradient_reductions(gm, [("grad", name) for name, *_ in specs], 25)
        assert done == [["g1", "g5"], ["g0", "g2", "g6"]]  # issue order: where each one's last gradient is
        recs = [info(n).comm for n in gm.graph.nodes if info(n).comm is not None]
        assert len(recs) == 4  # two buckets; g3 (avg) and g4 (bf16) alone, untouched
        assert {r.reason for r in recs if not r.reason.startswith("bucket")} == {"gradient of ..."}
        # each gradient still gets its own values back (the fake process group reduces nothing)
        xs = [torch.randn(4, 3, dtype=d) for *_, d in specs]
        assert all(torch.equal(o, x * 2) for o, x in zip(gm(*xs), xs))


@pytest.mark.parametrize("axes,plan", [({"dp": 2, "rep": 2}, {"dp": "fsdp", "rep": "ddp"}),
                                       ({"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "megatron"})])
def test_2d_mesh_buckets_per_axis(fake, axes, plan):
    """HSDP (per gradient: all-reduce over 'rep', then reduce-scatter over 'dp'): per block, one
    all-reduce over the concatenation and one reduce-scatter. ddp x megatron: the gradients' dp
    all-reduces are bucketed, the tp all-reduces of activations left alone."""
    with fake(**axes) as mesh:
        per_grad = compile_tiny(mesh, plan, bucket_mb=0)
        pm = compile_tiny(mesh, plan)
        order = [names_of(r)[0] for r in grad_records(per_grad, axis="dp")]
        want = by_block(order) if "fsdp" in plan.values() else [order]
        for axis in [a for a, s in plan.items() if s in ("ddp", "fsdp")]:
            before, after = grad_records(per_grad, axis=axis), grad_records(pm, axis=axis)
            assert len(before) == len(order)
            assert [names_of(r) for r in after] == want
            assert sum(r.payload_bytes for r in after) == sum(r.payload_bytes for r in before)
            assert {r.kind for r in after} == {r.kind for r in before}
        def others(p):  # (parameter gathers are bucketed per block too: passes/gather.py, tested below)
            return [(r.kind, r.axis, r.payload_bytes, r.reason) for r in p.collectives()
                    if not is_grad(r) and r.kind != "all_gather"]

        def gathered(p):
            return sum(r.payload_bytes for r in p.collectives() if r.kind == "all_gather")

        assert others(per_grad) == others(pm)
        assert gathered(per_grad) == gathered(pm)


@pytest.mark.parametrize("bad", [-1, "25", True, float("nan"), None])
def test_bucket_mb_must_be_a_non_negative_number(fake, bad):
    with fake(dp=2) as mesh, pytest.raises(PlanError, match="bucket_mb"):
        compile_tiny(mesh, {"dp": "ddp"}, bucket_mb=bad)


# --------------------------------------------------------------------- 2 gloo ranks
def bucket_numerics_job(strategy: str, options: dict):
    """Every rank: gradients of one step with and without bucketing, and how many gradient
    collectives each program issues per step."""
    import autopar
    from autopar.testing import build_model

    out = {}
    for mb in (0, 25):
        model, batches, loss_fn = build_model("llama")
        pm = autopar.compile(model, autopar.mesh(dp=2), example_inputs=batches[0], loss_fn=loss_fn,
                             plan={"dp": strategy}, capture_eval=False, bucket_mb=mb, **options)
        pm.train_step(*batches[0])
        grads = {n: full_tensor(p.grad) for n, p in pm.named_parameters()}
        out[mb] = (grads, len([r for r in pm.collectives() if is_grad(r)]))
    return out


@pytest.mark.parametrize("strategy,options", [("ddp", {"precision": "bf16"}), ("fsdp", {}),
                                              ("fsdp", {"accumulate": 2})],
                         ids=["ddp-bf16", "fsdp", "fsdp-accumulate2"])
def test_bucketed_gradients_equal_unbucketed_exactly(pools, strategy, options):
    """ddp-bf16: bucketed all-reduce in bf16, each gradient cast to fp32 after its view; fsdp: the
    reduce-scatter buckets in the step's program; accumulate=2: in the gradient-sync program."""
    out = pools(2).run(bucket_numerics_job, strategy, options)
    (g0, calls0), (g25, calls25) = out[0], out[25]
    assert calls0 == 21  # one per parameter
    assert calls25 == (1 if strategy == "ddp" else 4)  # the whole model; per block: head, 2 layers, embedding
    assert g0.keys() == g25.keys()
    for name in g0:
        assert g0[name].dtype == g25[name].dtype and torch.equal(g0[name], g25[name]), name
