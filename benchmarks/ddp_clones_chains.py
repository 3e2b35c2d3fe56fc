"""The clones of a one-layer hf-qwen2-small per-rank program under {"dp": "ddp"} on dp=1 and dp=2 (fake
meshes, the same per-rank batch), each with the ops it copies and what reads it
(benchmarks/ddp_clones.py; output appended to benchmarks/results/ddp-clones-2026-11-27.txt).

    .venv/bin/python benchmarks/ddp_clones_chains.py
"""
import autopar
from autopar.models import zoo
from autopar.mesh import fake_mesh
def prog(dp, batch):
    loaded = zoo.load("hf-qwen2-small", meta=False, batch=batch, seq=128, overrides={"num_hidden_layers": 1})
    with fake_mesh({"dp": dp}, 0) as mesh:
        pm = autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn, plan={"dp": "ddp"}, capture_eval=False)
    return pm.program.local
for dp, b in ((1, 4), (2, 8)):
    g = prog(dp, b).graph
    print("dp", dp)
    for n in g.nodes:
        if "clone" in str(n.target):
            src = n.args[0]
            chain = []
            x = src
            for _ in range(3):
                if not hasattr(x, "target"): break
                chain.append(str(x.target).replace("aten.", "")); x = x.args[0] if x.args else None
            users = [str(u.target).replace("aten.", "") for u in n.users]
            print(f"  {n.name:10s} {tuple(n.meta['val'].shape)} in-stride {src.meta['val'].stride()} <- {chain} -> {users}")
