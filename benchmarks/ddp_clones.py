"""Why autopar's ddp step peak on HF Qwen2 was 1.04x DDP's at 2 ranks (docs/results.md; fixed in
c7bec5c): hf-qwen2-small under {"dp": "ddp"} on dp=1 and dp=2 (fake meshes, rank 0, the same
per-rank batch of 4 x 128), per program: the liveness peak and what is alive at it (by size), and
every clone of the placed graph and of the per-rank program, each with the ops it copies and
what reads it. Before the fix the dp=2 per-rank program held 20 clones to dp=1's 8, four of them
alive at the peak (benchmarks/results/ddp-clones-2026-11-27.txt keeps both runs).

    .venv/bin/python benchmarks/ddp_clones.py [--layers N]
"""

from __future__ import annotations

import argparse
import collections

import autopar
from autopar.analysis.liveness import program_memory
from autopar.mesh import fake_mesh
from autopar.models import zoo


def program(dp: int, layers: int | None):
    loaded = zoo.load("hf-qwen2-small", meta=False, batch=4 * dp, seq=128,
                      overrides={"num_hidden_layers": layers} if layers else None)
    with fake_mesh({"dp": dp}, 0) as mesh:
        return autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                               plan={"dp": "ddp"}, capture_eval=False)


def _chain(n, depth: int = 3) -> list[str]:
    out, x = [], n
    for _ in range(depth):
        if not hasattr(x, "target"):
            break
        out.append(str(x.target).replace("aten.", ""))
        x = x.args[0] if x.args else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None, help="blocks (default the model's 4)")
    args = ap.parse_args()
    for dp in (1, 2):
        pm = program(dp, args.layers)
        p = pm.program
        m = program_memory(p.local, p.inputs, p.outputs)
        sizes = sorted(collections.Counter(round(b / 2**20, 2) for b, _, _ in m.alive_at_peak).items())
        print(f"dp={dp}: peak {m.peak / 2**20:.2f} MiB at {m.peak_node}; alive at it (MiB, count): {sizes}")
        for where, g in (("placed graph", p.graph), ("per-rank program", p.local.graph)):
            clones = [n for n in g.nodes if "clone" in str(n.target)]
            print(f"  {len(clones)} clones in the {where}")
            if where == "per-rank program":
                for n in clones:
                    v = n.meta["val"]
                    print(f"    {n.name:10s} {tuple(v.shape)} from strides {n.args[0].meta['val'].stride()} "
                          f"<- {_chain(n.args[0])} -> {[str(u.target).replace('aten.', '') for u in n.users]}")


if __name__ == "__main__":
    main()
