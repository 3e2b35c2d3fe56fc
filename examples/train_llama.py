"""The same script on one process, N gloo processes, or torchrun (NCCL on GPUs).

    python examples/train_llama.py                          # one process
    torchrun --nproc-per-node 2 examples/train_llama.py     # dp=2 (gloo on CPU)
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 2
"""

import argparse

import torch
import torch.distributed as dist

import autopar
from autopar.models.llama import Llama, LlamaConfig, cross_entropy

ap = argparse.ArgumentParser()
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--steps", type=int, default=3)
args = ap.parse_args()

mesh = autopar.mesh(dp=-1, tp=args.tp)
torch.manual_seed(0)
cfg = LlamaConfig()
model = Llama(cfg)
tokens = torch.randint(0, cfg.vocab_size, (8, 32))
targets = torch.roll(tokens, -1, dims=1)
pm = autopar.compile(model, mesh, example_inputs=(tokens, targets), loss_fn=cross_entropy,
                     plan={"dp": "ddp", "tp": "megatron"})
opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
for step in range(args.steps):
    loss = pm.train_step(tokens, targets)
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
if dist.get_rank() == 0:
    print(f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}: {len(pm.collectives())} collectives per step")
