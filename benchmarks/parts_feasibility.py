"""Feasibility checks for benchmarks/parts_placement_proto.py (a DTensor placement for a fused projection
split into UNEQUAL parts, each part plainly sharded): 2 gloo ranks, a [48, 16] weight with parts
(32, 8, 8) on dim 0 and a [48] bias, on a 1-D mesh of 2. Prints, per variant (PartsShard: a
_StridedShard subclass; PartsShardS: a Shard subclass) and per item, ok / WRONG / FAIL (the
exception's first line) with what DTensor did.

    .venv/bin/python benchmarks/parts_feasibility.py [--variant PartsShard|PartsShardS|StridedControl|all]

StridedControl: torch's own _StridedShard(0, split_factor=3) on EQUAL parts (16, 16, 16), GPT-2's case,
through the same checks (what torch does when the rules' rebuilt placement is the right one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import traceback
import warnings

import torch

PARTS = (32, 8, 8)
SHAPE = (48, 16)


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:160] if msg else ''}"


class Report:
    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def check(self, item: str, what: str, fn):
        """fn() -> (ok: bool, detail: str); an exception is a FAIL."""
        try:
            ok, detail = fn()
            status = "ok" if ok else "WRONG"
        except BaseException as e:  # noqa: BLE001 - reported (DCP raises CheckpointException, a BaseException)
            if isinstance(e, KeyboardInterrupt):
                raise
            status, detail = "FAIL", _first_line(e)
            if os.environ.get("PARTS_TRACE"):
                traceback.print_exc()
        self.rows.append((item, what, status, detail))
        return status == "ok"


def _ref():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(SHAPE, generator=g)
    b = torch.randn(SHAPE[0], generator=g)
    gW = torch.randn(SHAPE, generator=g)
    gb = torch.randn(SHAPE[0], generator=g)
    R = torch.randn(8, 4, generator=g)  # a Replicate parameter and a Shard(0) one (item 4)
    S = torch.randn(8, 4, generator=g)
    gR = torch.randn(8, 4, generator=g)
    gS = torch.randn(8, 4, generator=g)
    x = torch.randn(4, 16, generator=g)
    return dict(W=W, b=b, gW=gW, gb=gb, R=R, S=S, gR=gR, gS=gS, x=x)


def _local(full: torch.Tensor, rank: int, n: int = 2, dim: int = 0) -> torch.Tensor:
    """rank's piece under the parts layout, computed independently of the placement class."""
    out, start = [], 0
    for p in PARTS:
        c = p // n
        out.append(full.narrow(dim, start + rank * c, c))
        start += p
    return torch.cat(out, dim).contiguous()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def job(variant: str, ckpt: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import parts_placement_proto as pp
    from autopar import torch_compat as tc

    warnings.filterwarnings("ignore")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    global PARTS
    if variant == "StridedControl":  # torch's own _StridedShard with EQUAL parts (GPT-2's q|k|v): the control
        PARTS = (16, 16, 16)
        P = tc.StridedShard(0, split_factor=3)
    else:
        PARTS = (32, 8, 8)
        P = getattr(pp, variant)(0, PARTS)
    ref = _ref()
    W, b = ref["W"], ref["b"]
    rep = Report()

    def make(full):
        return DTensor.from_local(_local(full, rank), mesh, [P], run_check=False, shape=full.shape,
                                  stride=full.stride())

    # 1 -------------------------------------------------------------------------------------------
    def from_local():
        ok = True
        for full in (W, b):
            d = make(full)
            ok &= _same(d.full_tensor(), full) and d.placements == (P,) and tuple(d.shape) == tuple(full.shape)
        return ok, f"placements {make(W).placements}, local {tuple(make(W).to_local().shape)}"

    def distribute():
        ok = True
        for full in (W, b):
            d = distribute_tensor(full, mesh, [P])
            ok &= _same(d.to_local(), _local(full, rank)) and _same(d.full_tensor(), full)
        return ok, f"local piece = parts layout: {_same(distribute_tensor(W, mesh, [P]).to_local(), _local(W, rank))}"

    def from_local_noshape():
        d = DTensor.from_local(_local(W, rank), mesh, [P], run_check=False)
        return tuple(d.shape) == SHAPE and _same(d.full_tensor(), W), f"inferred shape {tuple(d.shape)}"

    rep.check("1", "from_local(shape=, stride=) + full_tensor", from_local)
    rep.check("1", "distribute_tensor + full_tensor", distribute)
    rep.check("1", "from_local without shape= (C++ global-shape inference)", from_local_noshape)

    # 2 -------------------------------------------------------------------------------------------
    def to(target, expect_local):
        def f():
            d = make(W).redistribute(mesh, [target])
            return (_same(d.to_local(), expect_local) and d.placements == (target,),
                    f"-> {d.placements}, local {tuple(d.to_local().shape)}")
        return f

    def back(src):
        def f():
            d = distribute_tensor(W, mesh, [src]).redistribute(mesh, [P])
            return (_same(d.to_local(), _local(W, rank)) and d.placements == (P,) and _same(d.full_tensor(), W),
                    f"{src} -> {d.placements}")
        return f

    def to_partial_and_back():
        from torch.distributed.tensor import Partial

        parts = DTensor.from_local(W / n, mesh, [Partial()], run_check=False)  # sum of the ranks' = W
        d = parts.redistribute(mesh, [P])
        return _close(d.to_local(), _local(W, rank)) and d.placements == (P,), f"Partial -> {d.placements}"

    rep.check("2", "-> Replicate", to(Replicate(), W))
    rep.check("2", "-> Shard(0)", to(Shard(0), W.chunk(n)[rank]))
    rep.check("2", "-> Shard(1)", to(Shard(1), W.chunk(n, 1)[rank].contiguous()))
    rep.check("2", "Replicate -> parts", back(Replicate()))
    rep.check("2", "Shard(0) -> parts", back(Shard(0)))
    rep.check("2", "Partial(sum) -> parts (a gradient's reduction)", to_partial_and_back)

    # 3 -------------------------------------------------------------------------------------------
    def adamw(foreach):
        def f():
            names = ("W", "b")
            steps = 3
            full = {k: torch.nn.Parameter(ref[k].clone()) for k in names}
            dist_ = {k: torch.nn.Parameter(make(ref[k])) for k in names}
            kw = dict(lr=0.1, weight_decay=0.1) | ({} if foreach == "default" else {"foreach": foreach})
            o_full = torch.optim.AdamW(list(full.values()), **kw)
            o_dist = torch.optim.AdamW(list(dist_.values()), **kw)
            for s in range(steps):
                for k in names:
                    g = ref["g" + k] * (s + 1)
                    full[k].grad = g.clone()
                    dist_[k].grad = make(g)
                o_full.step()
                o_dist.step()
            ok = all(_close(dist_[k].full_tensor(), full[k].detach()) for k in names)
            st = o_dist.state[dist_["W"]]["exp_avg"]
            ok &= isinstance(st, DTensor) and st.placements == (P,) and _close(st.full_tensor(),
                                                                               o_full.state[full["W"]]["exp_avg"])
            return ok, (f"{steps} steps; param {dist_['W'].placements}, exp_avg {st.placements}, max|diff| "
                        f"{max((dist_[k].full_tensor() - full[k].detach()).abs().max().item() for k in names):.1e}")
        return f

    rep.check("3", "AdamW foreach=default (None)", adamw("default"))
    rep.check("3", "AdamW foreach=True", adamw(True))
    rep.check("3", "AdamW foreach=False", adamw(False))

    # 4 -------------------------------------------------------------------------------------------
    def clip(foreach):
        def f():
            full = {k: torch.nn.Parameter(ref[k].clone()) for k in ("W", "b", "R", "S")}
            d = {"W": torch.nn.Parameter(make(W)), "b": torch.nn.Parameter(make(b)),
                 "R": torch.nn.Parameter(distribute_tensor(ref["R"].clone(), mesh, [Replicate()])),
                 "S": torch.nn.Parameter(distribute_tensor(ref["S"].clone(), mesh, [Shard(0)]))}
            for k in full:
                full[k].grad = ref["g" + k].clone()
            d["W"].grad, d["b"].grad = make(ref["gW"]), make(ref["gb"])
            d["R"].grad = distribute_tensor(ref["gR"].clone(), mesh, [Replicate()])  # (a Replicate local
            d["S"].grad = distribute_tensor(ref["gS"].clone(), mesh, [Shard(0)])     # shares the input's storage)
            kw = {} if foreach == "default" else {"foreach": foreach}
            tn_full = torch.nn.utils.clip_grad_norm_(list(full.values()), 1.0, **kw)
            tn = torch.nn.utils.clip_grad_norm_(list(d.values()), 1.0, **kw)
            tn_val = tn.full_tensor() if isinstance(tn, DTensor) else tn
            ok = _close(tn_val, tn_full)
            ok &= all(_close(d[k].grad.full_tensor(), full[k].grad) for k in full)
            ok &= d["W"].grad.placements == (P,)
            return ok, (f"norm {tn_val.item():.6f} vs {tn_full.item():.6f} "
                        f"({type(tn).__name__}{getattr(tn, 'placements', '')}); W.grad {d['W'].grad.placements}")
        return f

    def norm_only():
        nd = torch.linalg.vector_norm(make(ref["gW"]))
        nd_val = nd.full_tensor() if isinstance(nd, DTensor) else nd
        return _close(nd_val, torch.linalg.vector_norm(ref["gW"])), f"-> {getattr(nd, 'placements', type(nd))}"

    rep.check("4", "vector_norm(grad) alone (the first half of clip)", norm_only)
    rep.check("4", "clip_grad_norm_ foreach=default", clip("default"))
    rep.check("4", "clip_grad_norm_ foreach=True", clip(True))
    rep.check("4", "clip_grad_norm_ foreach=False", clip(False))

    # 5 -------------------------------------------------------------------------------------------
    import torch.distributed.checkpoint as dcp

    def dcp_direct():
        path = os.path.join(ckpt, f"{variant}-direct")
        state = {"W": make(W), "b": make(b)}
        dcp.save(state, checkpoint_id=path)
        into = {"W": make(torch.zeros(SHAPE)), "b": make(torch.zeros(SHAPE[0]))}
        dcp.load(into, checkpoint_id=path)
        ok = _same(into["W"].full_tensor(), W) and _same(into["b"].full_tensor(), b)
        return ok, "saved and loaded back into the parts placement" + ("" if ok else ": values differ")

    def dcp_direct_into_shard():
        path = os.path.join(ckpt, f"{variant}-direct")
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise RuntimeError("no checkpoint (the direct save failed)")
        into = {"W": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)]),
                "b": distribute_tensor(torch.zeros(SHAPE[0]), mesh, [Shard(0)])}
        dcp.load(into, checkpoint_id=path)
        ok = _same(into["W"].full_tensor(), W) and _same(into["b"].full_tensor(), b)
        return ok, "direct save read into Shard(0): " + ("equal" if ok else "values differ (file holds wrong data)")

    def dcp_plain():
        path = os.path.join(ckpt, f"{variant}-plain")
        params = {"W": make(W), "b": make(b)}
        state = {k: v.redistribute(mesh, [Shard(0)]) for k, v in params.items()}  # _plain_shards
        dcp.save(state, checkpoint_id=path)
        into_plain = {k: distribute_tensor(torch.zeros(v.shape), mesh, [Shard(0)]) for k, v in params.items()}
        dcp.load(into_plain, checkpoint_id=path)
        targets = {k: make(torch.zeros(v.shape)) for k, v in params.items()}
        for k, t in targets.items():  # _restore
            t.to_local().copy_(into_plain[k].redistribute(mesh, [P]).to_local())
        ok = all(_same(targets[k].full_tensor(), params[k].full_tensor()) for k in params)
        ok &= all(_same(targets[k].to_local(), params[k].to_local()) for k in params)
        return ok, "save as Shard(0), load as Shard(0), redistribute back: exact" if ok else "values differ"

    rep.check("5", "dcp.save/load of the parts DTensor directly", dcp_direct)
    rep.check("5", "direct save, loaded into Shard(0)", dcp_direct_into_shard)
    rep.check("5", "via plain Shard(0) (checkpoint.py _plain_shards/_restore)", dcp_plain)

    # 6 -------------------------------------------------------------------------------------------
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def local_shape():
        mine = compute_local_shape_and_global_offset(SHAPE, mesh, [P])
        every = [None] * n
        dist.all_gather_object(every, mine)
        sizes_ok = all(tuple(s) == (24, 16) for s, _ in every)
        contiguous = [(o[0], o[0] + s[0]) for s, o in every]
        held = [_local(torch.arange(48), r).tolist() for r in range(n)]
        return sizes_ok, (f"per rank (local shape, offset): {every}; as a contiguous block [o, o+size) "
                          f"{contiguous} is the rows held: {[h == list(range(*c)) for h, c in zip(held, contiguous)]}")

    rep.check("6", "compute_local_shape_and_global_offset", local_shape)

    # 7 -------------------------------------------------------------------------------------------
    def elementwise(name, fn):
        def f():
            A, B = make(W), make(W * 3 + 1)
            out = fn(A, B)
            expect = fn(W, W * 3 + 1)
            full = out.full_tensor()
            return _close(full, expect), f"-> {out.placements}, local {tuple(out.to_local().shape)}"
        return f

    rep.check("7", "A + B", elementwise("add", lambda a, c: a + c))
    rep.check("7", "A * B", elementwise("mul", lambda a, c: a * c))
    rep.check("7", "A * 2.0", elementwise("scalar mul", lambda a, c: a * 2.0))
    rep.check("7", "A + 1", elementwise("scalar add", lambda a, c: a + 1))
    rep.check("7", "A + bias-shaped Replicate (broadcast)", elementwise(
        "bcast", lambda a, c: a + (distribute_tensor(ref["x"][0], mesh, [Replicate()]) if isinstance(a, DTensor)
                                   else ref["x"][0])))

    def inplace(fn):
        def f():
            A = make(W)
            fn(A, make(W * 3 + 1))
            expect = W.clone()
            fn(expect, W * 3 + 1)
            return _close(A.full_tensor(), expect) and A.placements == (P,), f"-> {A.placements}"
        return f

    rep.check("7", "A.add_(B)", inplace(lambda a, c: a.add_(c)))
    rep.check("7", "A.mul_(2.0)", inplace(lambda a, c: a.mul_(2.0)))

    def transpose():
        t = make(W).t()
        return _same(t.full_tensor(), W.t()), f"W.t() -> {t.placements}"

    def matmul(fn, label):
        def f():
            x = distribute_tensor(ref["x"], mesh, [Replicate()])
            out = fn(x, make(W), make(b))
            expect = fn(ref["x"], W, b)
            full = out.full_tensor()
            local_is_parts = _close(out.to_local(), _local(expect, rank, dim=-1))
            return (_close(full, expect),
                    f"-> {out.placements} local {tuple(out.to_local().shape)}; local = parts layout of the true "
                    f"output: {local_is_parts}; max|full_tensor()-true| {(full - expect).abs().max().item():.2f}")
        return f

    rep.check("7", "W.t()", transpose)
    rep.check("7", "x @ W.T (x Replicate)", matmul(lambda x, w, bb: x @ w.T, "mm"))
    rep.check("7", "F.linear(x, W, b)", matmul(lambda x, w, bb: torch.nn.functional.linear(x, w, bb), "linear"))
    return rep.rows


def job_one_rank(variant: str, ckpt: str):
    """Item 5's last check: the plain checkpoint read on ONE rank into a Replicate DTensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (1,))
    ref = _ref()
    rep = Report()

    def load(tag):
        def f():
            path = os.path.join(ckpt, f"{variant}-{tag}")
            if not os.path.exists(os.path.join(path, ".metadata")):
                raise RuntimeError("no checkpoint written")
            into = {"W": distribute_tensor(torch.zeros(SHAPE), mesh, [Replicate()]),
                    "b": distribute_tensor(torch.zeros(SHAPE[0]), mesh, [Replicate()])}
            dcp.load(into, checkpoint_id=path)
            ok = _same(into["W"].to_local(), ref["W"]) and _same(into["b"].to_local(), ref["b"])
            return ok, "1 rank, Replicate: " + ("equal" if ok else "values differ")
        return f

    rep.check("5", "plain checkpoint loaded on 1 rank into Replicate", load("plain"))
    rep.check("5", "direct checkpoint loaded on 1 rank into Replicate", load("direct"))
    return rep.rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="all", choices=["PartsShard", "PartsShardS", "StridedControl", "all"])
    args = ap.parse_args()
    from autopar.testing import DistPool

    variants = ["PartsShard", "PartsShardS", "StridedControl"] if args.variant == "all" else [args.variant]
    ckpt = tempfile.mkdtemp(prefix="partsfeas-")
    print(f"torch {torch.__version__}; W {SHAPE} parts {PARTS} on dim 0, b [48]; 1-D mesh of 2 gloo ranks")
    try:
        rows = {}
        pool = DistPool(2)
        try:
            for v in variants:
                rows[v] = pool.run(job, v, ckpt)
        finally:
            pool.close()
        pool = DistPool(1)
        try:
            for v in variants:
                rows[v] += pool.run(job_one_rank, v, ckpt)
        finally:
            pool.close()
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    for v in variants:
        print(f"\n== {v} ==")
        for item, what, status, detail in sorted(rows[v], key=lambda r: r[0]):
            print(f"{item}  {status:5s}  {what}: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
