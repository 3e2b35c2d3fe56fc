"""Why autopar's ddp step peak on HF Qwen2 was 1.04x DDP's at 2 ranks (docs/results.md; fixed in c7bec5c): the per-rank
program of hf-qwen2-small under {"dp": "ddp"} on dp=2 (a fake mesh, rank 0) against the same on
dp=1 with the same per-rank batch: the liveness peak, what is alive at it, and the clones each
program holds (the placed graph's, then the per-rank program's after localize).

    .venv/bin/python benchmarks/ddp_clones.py
"""
import autopar
from autopar.models import zoo
from autopar.mesh import fake_mesh
from autopar.analysis.liveness import program_memory
loaded = zoo.load("hf-qwen2-small", meta=False, batch=8, seq=128)
with fake_mesh({"dp": 2}, 0) as mesh:
    pm = autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn, plan={"dp": "ddp"}, capture_eval=False)
p = pm.program
m = program_memory(p.local, p.inputs, p.outputs)
print("peak MiB", m.peak / 2**20, "at", m.peak_node, {k: round(v / 2**20, 2) for k, v in m.at_peak.items()})
print("max_by", {k: round(v / 2**20, 2) for k, v in m.max_by.items()})
for b, n, c in sorted(m.alive_at_peak, reverse=True)[:6]: print("  ", round(b / 2**20, 2), n, c)
print(pm.ctx.masks)
import collections
print(sorted(collections.Counter(round(b/2**20,2) for b,_,_ in m.alive_at_peak).items()))
with fake_mesh({"dp": 1}, 0) as mesh1:
    loaded = zoo.load("hf-qwen2-small", meta=False, batch=4, seq=128)
    pm1 = autopar.compile(loaded.model, mesh1, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn, plan={"dp": "ddp"}, capture_eval=False)
p1 = pm1.program
m1 = program_memory(p1.local, p1.inputs, p1.outputs)
print("dp1 peak", m1.peak/2**20, sorted(collections.Counter(round(b/2**20,2) for b,_,_ in m1.alive_at_peak).items()))
a = {n: b for b, n, _ in m.alive_at_peak}; a1 = {n: b for b, n, _ in m1.alive_at_peak}
print("only dp2:", [(n, a[n]) for n in a if n not in a1][:10]); print("only dp1:", [(n, a1[n]) for n in a1 if n not in a][:10])
for n in p.local.graph.nodes:
    if n.name in ("clone_1", "clone_3"):
        src = n.args[0]
        print(n.name, n.meta["val"].shape, n.meta["val"].stride(), "<-", src.name, src.target, src.meta["val"].shape, src.meta["val"].stride(), [u.name for u in n.users][:4], n.kwargs)
        s2 = src.args[0] if src.args else None
        if hasattr(s2, "name"): print("     <-", s2.name, s2.target, s2.meta["val"].shape)
def clones(g): return [n.name for n in g.nodes if "clone" in str(n.target)]
print("dp2 placed graph clones", clones(pm.program.graph)); print("dp2 local", clones(p.local.graph))
print("dp1 placed graph clones", clones(pm1.program.graph)); print("dp1 local", clones(p1.local.graph))
