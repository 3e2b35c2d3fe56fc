"""Where autopar's step peak exceeds eager's on a Hugging Face GQA model (docs/results.md, "ddp on a
Hugging Face model"): hf-qwen2-small on one process, autopar {"dp": "ddp"} against the eager model
(forward + loss + backward), each step's allocator peak; the cost model's list of what is alive at
autopar's peak; and what eager autograd saves (distinct storages, by size).

    .venv/bin/python benchmarks/gqa_peak.py

benchmarks/results/gqa-peak-2026-11-27.txt: before passes/masks.py read grouped-query attention's
KV heads as they are (e7c2ed7); gqa-peak-2026-11-27-after.txt: after.
"""
import gc, torch, autopar
from autopar.models import zoo
from autopar.runtime.measure import allocator_peak
from autopar.analysis.liveness import program_memory
torch.manual_seed(0)
loaded = zoo.load("hf-qwen2-small", meta=False, batch=4, seq=128)
model, (x, y), loss_fn = loaded.model, loaded.example_inputs, loaded.loss_fn
import copy
ref = copy.deepcopy(model)
pm = autopar.compile(model, autopar.mesh(dp=1), example_inputs=(x, y), loss_fn=loss_fn, plan={"dp": "ddp"}, capture_eval=False)
def a_step():
    pm.train_step(x, y)
def e_step():
    loss = loss_fn(ref(x).logits, y)
    loss.backward()
for _ in range(2):
    a_step(); e_step()
for p in pm.parameters(): p.grad = None
for p in ref.parameters(): p.grad = None
gc.collect()
print("autopar peak MiB", allocator_peak(a_step) / 2**20)
for p in pm.parameters(): p.grad = None
gc.collect()
print("eager peak MiB", allocator_peak(e_step) / 2**20)
prog = pm.program
m = program_memory(prog.local, prog.inputs, prog.outputs)
print("predicted program peak MiB", m.peak / 2**20, "at", m.peak_node)
for b, n, c in sorted(m.alive_at_peak, reverse=True)[:12]:
    print(f"  {b/2**20:8.2f} MiB {c:12s} {n}")
print("at_peak", {k: round(v/2**20,2) for k, v in m.at_peak.items()})
tot = sum(b for b,_,_ in m.alive_at_peak); print("alive sum", tot/2**20, len(m.alive_at_peak))
seen = {}
def pack2(t):
    s = t.untyped_storage(); seen[s.data_ptr()] = (s.nbytes(), tuple(t.shape), str(t.grad_fn) if t.grad_fn else "leaf/none")
    return t
params = {p.untyped_storage().data_ptr() for p in ref.parameters()}
with torch.autograd.graph.saved_tensors_hooks(pack2, lambda t: t):
    loss = loss_fn(ref(x).logits, y)
act = {k: v for k, v in seen.items() if k not in params}
print("eager saved distinct non-param MiB", sum(v[0] for v in act.values())/2**20, len(act))
for k, v in sorted(act.items(), key=lambda kv: -kv[1][0])[:8]: print("  ", v[0]/2**20, v[1], v[2][:60])
import collections
ce = collections.Counter(round(v[0]/2**20, 2) for v in act.values())
ca = collections.Counter(round(b/2**20, 2) for b, _, _ in m.alive_at_peak)
print("eager sizes", sorted(ce.items())); print("autopar sizes", sorted(ca.items()))
print("eager saves K and V with their own heads (enable_gqa):")
for k, v in act.items():
    if len(v[1]) == 4 and v[1][1] < 8:
        print(f"   {v[0]/2**20:.2f} MiB {v[1]} {v[2].split()[0][1:]}")
clones = [(b, n) for b, n, _ in m.alive_at_peak if n.startswith("clone")]
print(f"autopar's K and V repeated to the query heads (repeat_kv's clone) alive at its peak: {len(clones)}")
for b, n in clones:
    node = next(x for x in prog.local.graph.nodes if x.name == n)
    print(f"   {b/2**20:.2f} MiB {tuple(node.meta['val'].shape)} {n}")
