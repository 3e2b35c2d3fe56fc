"""Elastic training under torchrun: checkpoints every few steps, resumes after a restart.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # (below)
    torchrun --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        examples/train_elastic.py --ckpt /tmp/elastic --steps 12 --every 3

On start every rank loads the latest complete checkpoint under ``--ckpt`` (none: a fresh start),
parameters, AdamW state, RNG and the data position (``extra``), and goes on from there. If a
worker dies, the others fail within seconds (``autopar.RankFailure``: a lost peer, or the bounded
``timeout``), torchrun restarts every worker (``--max-restarts``), and they resume; the losses
are the uninterrupted run's, bit for bit (tests/test_elastic.py).

``AUTOPAR_EXAMPLE_KILL_AT_STEP=7``: rank 1 SIGKILLs itself before step 7 in a run that did not
resume from a checkpoint (the first attempt; torchrun's TORCHELASTIC_RESTART_COUNT counts
restarts per node, and a node restarted because another failed does not count it), to see the
restart. ``--plan 1f1b``: a 2-stage pipeline instead of FSDP.

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (set for torchrun): torch 2.13's c10d rendezvous otherwise
hands every attempt's workers the same TCPStore, which still holds the previous attempt's keys,
so the restarted workers read stale gloo addresses and fail to connect (torch issue 135712;
autopar.mesh warns). With it, rank 0 hosts a fresh store each attempt.
"""

import argparse
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist

import autopar
from autopar.models.llama import Llama, LlamaConfig, cross_entropy

ap = argparse.ArgumentParser()
ap.add_argument("--ckpt", required=True, help="checkpoint folder (kept across restarts)")
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
ap.add_argument("--plan", choices=("fsdp", "1f1b"), default="fsdp")
ap.add_argument("--timeout", type=float, default=10.0, help="seconds any wait may block (compile's timeout=)")
args = ap.parse_args()

t0 = time.perf_counter()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
kill_at = int(os.environ.get("AUTOPAR_EXAMPLE_KILL_AT_STEP", "-1"))
if "RANK" in os.environ and not dist.is_initialized():
    # a short bound for the waits outside train_step too (checkpoint I/O coordination), so a lost
    # peer ends this attempt in seconds and torchrun can restart it
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3 * args.timeout))
mesh = autopar.mesh(pp=-1) if args.plan == "1f1b" else autopar.mesh(dp=-1)
rank = dist.get_rank()

torch.manual_seed(0)
cfg = LlamaConfig(n_layers=2)
model = Llama(cfg)


def batch(i: int):
    """The data: batch i depends on i only (the loader's position is all there is to save)."""
    g = torch.Generator().manual_seed(1000 + i)
    tokens = torch.randint(0, cfg.vocab_size, (8, 32), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


pm = autopar.compile(model, mesh, example_inputs=batch(0), loss_fn=cross_entropy,
                     plan={"pp": "1f1b"} if args.plan == "1f1b" else {"dp": "fsdp"}, timeout=args.timeout,
                     capture_eval=False)
opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
ckpts = autopar.CheckpointManager(args.ckpt, keep=2)
extra = ckpts.load_latest(pm, opt)  # parameters, optimizer state, RNG, pm.steps; None: nothing saved yet
start = extra["next_batch"] if extra else 0
if rank == 0:
    print((f"resumed from {ckpts.latest()} at batch {start}" if extra else "fresh start")
          + f" (this node's restart count {attempt}; set up in {time.perf_counter() - t0:.1f}s: process group, "
          "compile, load)", flush=True)

for i in range(start, args.steps):
    if i == kill_at and rank == 1 and extra is None:
        print(f"rank 1: SIGKILL at step {i} (AUTOPAR_EXAMPLE_KILL_AT_STEP)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    loss = pm.train_step(*batch(i))
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {i}: loss {loss.item():.6f} ({loss.item().hex()})", flush=True)
    if (i + 1) % args.every == 0:
        ckpts.save(pm, optimizer=opt, extra={"next_batch": i + 1})
if rank == 0:
    print(f"done: {args.steps} steps", flush=True)
dist.destroy_process_group()
