"""Run functions on N gloo processes, and compare programs against one process.

``DistPool(n)`` starts n workers once (forked from a server that imported torch and autopar once:
``process_context``), each with a gloo process group, and runs module-level functions on all of them.
``parity_job`` + ``reference_run`` are the numerics check behind the parity tests (and
``autopar.verify``): same init, same data, AdamW, losses / gradients / parameters compared.
"""

from __future__ import annotations

import copy
import os
import pickle
import queue
import time
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp
from autopar.ir import info
from autopar.runtime.common import full_tensor

_TIMEOUT_S = float(os.environ.get("AUTOPAR_POOL_TIMEOUT", "600"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_context():
    """The multiprocessing context for worker processes: forked from multiprocessing's fork
    server, which imported autopar/poolserver.py (torch, dynamo, DTensor, autopar, transformers)
    once, instead of spawned fresh (each spawned process imports them again). A worker gets the
    environment of the process that started it (``worker_environment``), not the server's.
    Where there is no fork server (Windows), spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["autopar.poolserver"])
    return ctx


def parent_environment() -> tuple[dict[str, str], list[str]]:
    """What a worker takes from the process that starts it: its environment variables and its
    import path, as they are now (``worker_environment`` sets them in the worker)."""
    return dict(os.environ), list(sys.path)


def worker_environment(parent: tuple[dict[str, str], list[str]]) -> None:
    """In a forked worker: the starting process's environment and import path, as a spawned
    worker would have them, not those the fork server was started with."""
    env, path = parent
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path


def _worker(rank: int, world: int, port: int, jobs, results, parent):
    import warnings

    worker_environment(parent)
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    _freeze_imports()
    parent = os.getppid()
    while True:
        try:
            job = jobs.get(timeout=2.0)
        except queue.Empty:
            # the pool's owner was killed (no stop will come; the fork server, this process's parent,
            # exits with it): do not linger
            if os.getppid() != parent:
                os._exit(0)
            continue
        if job is None:
            break
        fn, args, kwargs = job
        try:
            out = fn(*args, **kwargs)
            payload = pickle.dumps(out if rank == 0 else None)  # fail here, not in the feeder thread
            results.put((rank, True, payload))
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()
    # every result has been read by the parent (it sent the stop only after): skip the
    # interpreter's teardown, seconds per worker with torch, dynamo and transformers loaded
    # (multiprocessing's own finalizers still run: they release the semaphores this process made)
    import multiprocessing.util

    results.close()
    results.join_thread()
    multiprocessing.util._exit_function()
    os._exit(0)


def _freeze_imports() -> None:
    """Move what the imports made (torch's and autopar's modules: hundreds of
    thousands of objects that live as long as the process) out of the cyclic garbage collector's
    reach: its full collections, which every few compiles walk everything, then walk only what the
    jobs made. A 2-layer Llama compiled 6 times in one process: 0.58-0.93 s per compile before
    (the slow ones are full collections), 0.60-0.67 s after. The workers end by ``os._exit``, so
    the frozen objects need no unfreezing."""
    import gc

    import autopar.compiler  # noqa: F401 - what nearly every job imports first

    gc.collect()
    gc.freeze()


class DistPool:
    """n persistent gloo worker processes; ``run(fn, *args)`` returns rank 0's result."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = process_context()
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        parent = parent_environment()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.jobs[r], self.results, parent),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, **kwargs):
        for q in self.jobs:
            q.put((fn, args, kwargs))
        out, errors = None, []
        deadline = time.monotonic() + _TIMEOUT_S
        for _ in range(self.world_size):
            while True:
                try:
                    rank, ok, val = self.results.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        self.close(force=True)
                        why = (f"worker rank(s) {dead} died (exit codes "
                               f"{[self.procs[r].exitcode for r in dead]})" if dead
                               else f"did not finish in {_TIMEOUT_S}s")
                        raise RuntimeError(f"distributed job {fn.__name__}: {why}") from None
            if not ok:
                errors.append(f"rank {rank}: {val}")
            elif rank == 0:
                out = pickle.loads(val)
        if errors:
            self.close(force=True)
            raise RuntimeError("distributed job failed\n" + "\n".join(errors))
        return out

    def alive(self) -> bool:
        """Every worker still running (a failed job closes the pool: its processes may hold a
        broken process group)."""
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False):
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive() and not force:
                q.put(None)
        for p in self.procs:
            p.join(timeout=2 if force else 20)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------------------------
# parity: the same model, init and data on one process and on the mesh


class _CEHead(torch.nn.Module):
    """Embedding (with a padding row) -> LM head: exercises the vocab-parallel rules."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim, padding_idx=3)
        self.norm = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        return self.lm_head(self.norm(self.embed_tokens(tokens)))


class _MaskedAttention(torch.nn.Module):
    """Attention with an explicit [B,1,S,S] padding+causal mask (SDPA's attn_mask path)."""

    def __init__(self, vocab=64, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.q_proj = torch.nn.Linear(dim, dim)
        self.k_proj = torch.nn.Linear(dim, dim)
        self.v_proj = torch.nn.Linear(dim, dim)
        self.o_proj = torch.nn.Linear(dim, dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        b, s = tokens.shape
        x = self.embed_tokens(tokens)
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        mask = causal[None, None] & (tokens != 0)[:, None, None, :]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.lm_head(x + self.o_proj(o.transpose(1, 2).reshape(b, s, -1)))


def _ce(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def build_model(name: str, seed: int = 0):
    """(model, batches, loss_fn) for the built-in test models; batches are GLOBAL."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    vocab = 256
    seq = 16
    if name in ("llama", "gpt"):
        from autopar.models.llama import Llama, LlamaConfig, cross_entropy

        cfg = LlamaConfig(mlp="swiglu" if name == "llama" else "gelu", n_kv_heads=2 if name == "llama" else 4)
        model, loss_fn = Llama(cfg), cross_entropy
    elif name == "llama_tied":  # the LM head reads the embedding's weight
        from autopar.models.llama import Llama, LlamaConfig, cross_entropy

        model, loss_fn = Llama(LlamaConfig(tie_embeddings=True)), cross_entropy
    elif name == "llama_deep":  # 8 layers, longer sequences: activations dominate (recompute tests)
        from autopar.models.llama import Llama, LlamaConfig, cross_entropy

        model, loss_fn, seq = Llama(LlamaConfig(n_layers=8, max_seq_len=128)), cross_entropy, 128
    elif name in ("llama6", "llama6_tied"):  # 6 blocks: enough segments for 8 pipeline stages (pp=4, 2 virtual)
        from autopar.models.llama import Llama, LlamaConfig, cross_entropy

        model, loss_fn = Llama(LlamaConfig(n_layers=6, tie_embeddings=name.endswith("tied"))), cross_entropy
    elif name == "moe":  # top-2 of 4 experts in every block (GShard-style capacity dispatch)
        from autopar.models.llama import Llama, LlamaConfig, cross_entropy

        model, loss_fn = Llama(LlamaConfig(n_experts=4, top_k=2)), cross_entropy
    elif name == "moe_dropless":  # the same, every token-expert pair computed (expert parallelism's MoE)
        from autopar.models.llama import Llama, LlamaConfig, cross_entropy

        model, loss_fn = Llama(LlamaConfig(n_experts=4, top_k=2, moe_dispatch="dropless")), cross_entropy
    elif name in ("hf_llama", "hf_llama_eager"):  # eager: HF's softmax(QK^T s + mask) V attention
        from transformers import LlamaConfig as HFConfig
        from transformers import LlamaForCausalLM

        from autopar.models.zoo import HF_TINY

        cfg = HFConfig(**HF_TINY, use_cache=False, tie_word_embeddings=False)
        cfg._attn_implementation = "eager" if name == "hf_llama_eager" else "sdpa"
        model, loss_fn = LlamaForCausalLM(cfg), _ce
    elif name == "ce_rules":
        model, loss_fn, vocab = _CEHead(), _ce, 64
    elif name == "attn_mask":
        model, loss_fn, vocab = _MaskedAttention(), _ce, 64
    else:
        raise ValueError(f"unknown test model {name!r}")
    batches = []
    for _ in range(3):
        x = torch.randint(1, vocab, (4, seq), generator=g)
        y = torch.randint(0, vocab, (4, seq), generator=g)
        if name == "ce_rules":  # ignored targets only in the first rows: ranks count differently
            y[:2, : 11] = -100
            x[:, 5] = 3  # the padding row
        if name == "attn_mask":
            x[1, 12:] = 0  # padded tail
        batches.append((x, y))
    return model, batches, loss_fn


FP16_TEST_SCALE = 1024.0


# AdamW's eps in the parity runs (both sides). At torch's 1e-8, an element whose true gradient is
# at float-noise level (|g| ~ 1e-8, against gradients of ~0.1) steps by up to lr whichever way the
# noise points: the same model summed in another order (a sharded matmul, an all-reduce) moved one
# up_proj element by 3.6e-3 after one step (llama_tied, dp=2 x tp=2), and the next step's
# gradients by 1e-4, failing a check meant for the program, not for Adam's amplification of
# rounding. At 1e-6 such an element moves by lr * |g| / eps, a hundred times less; a real error
# (a wrong shard, a missing reduction) still moves gradients by their own size.
PARITY_ADAMW_EPS = 1e-6


def parity_optimizer(params, lr: float) -> torch.optim.AdamW:
    """The optimizer of every run compared with ``reference_run`` (and of the reference itself)."""
    return torch.optim.AdamW(params, lr=lr, eps=PARITY_ADAMW_EPS)


def reference_run(name: str, steps: int = 3, lr: float = 1e-2, precision: str = "fp32"):
    """One process, eager PyTorch: the same model, data and optimizer. Under bf16/fp16 the
    parameters are cast to the compute dtype for the step (fp32 master weights and AdamW), as
    autopar's front end does; fp16 scales the loss by ``FP16_TEST_SCALE`` and unscales the
    gradients (compile the fp16 side with ``loss_scale=FP16_TEST_SCALE``: a fixed scale, so both
    sides step on the same steps)."""
    from autopar.capture import _WithLoss

    model, batches, loss_fn = build_model(name)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    step_fn = _WithLoss(model, loss_fn, dtype)
    scale = FP16_TEST_SCALE if precision == "fp16" else 1.0
    opt = parity_optimizer(model.parameters(), lr)
    losses, grads = [], []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        loss = step_fn(x, y)
        (loss * scale).backward()
        losses.append(loss.item())
        for p in model.parameters():
            p.grad.div_(scale)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def parity_job(name: str, axes: dict, plan: dict, steps: int = 3, lr: float = 1e-2, evaluate: bool = True,
               **options):
    """Runs on every rank of a pool: compile, train ``steps`` AdamW steps, gather everything.
    ``options`` go to autopar.compile (precision, accumulate, recompute...). ``evaluate``: also
    capture and run the eval program (``pm(x)``: a second capture and pass list, seconds per case)."""
    import autopar

    mesh = autopar.mesh(**axes)
    model, batches, loss_fn = build_model(name)
    pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan=plan, debug=True,
                         capture_eval=evaluate, **options)
    opt = parity_optimizer(pm.parameters(), lr)
    losses, grads = [], []
    pm.counter.reset()
    pm.measure()  # bytes at the process group, every step
    for i in range(steps):
        if i == steps - 1:  # (slow: on the last step) the allocator's peak, live storages, FLOPs
            pm.track_memory()
        loss = pm.train_step(*batches[i % len(batches)])
        losses.append(loss.item())
        grads.append({n: full_tensor(p.grad).detach() if p.grad is not None else None
                      for n, p in pm.named_parameters()})
        opt.step()
        if i == steps - 1:
            memory = pm.memory_report(opt)
        opt.zero_grad()
    params = {n: full_tensor(p.detach()) for n, p in pm.named_parameters()}
    measured = pm.counter.summary()
    evaluated = pm(batches[0][0]) if evaluate else None
    records = [copy.copy(r) for r in pm.collectives()]
    from autopar.analysis.cost import predict_memory

    predicted = {k: v for k, v in predict_memory(pm).items() if k != "alive_at_peak"}
    return {"predicted_memory": predicted, "losses": losses, "grads": grads, "params": params, "records": records,
            "measured": measured, "steps": steps, "eval": evaluated, "memory": memory,
            "placements": {n: str(pm.ctx.placed.placements[n]) for n, _ in pm.named_parameters()},
            "skipped": pm.skipped_steps, "accumulate": pm.accumulate,
            "rules": sorted({info(n).rule.name for n in pm.program.graph.nodes if info(n).rule is not None}),
            "inductor": pm.inductor, "timings": dict(pm.ctx.timings),
            }


def api_job():
    """The user contract on a real 2-rank group: decorator, local batches, state_dict, optimizer."""
    import autopar
    from autopar.models.llama import Llama, LlamaConfig, cross_entropy

    mesh = autopar.mesh(dp=-1)
    _, batches, _ = build_model("llama")
    x, y = batches[0]
    out = {}

    @autopar.compile(mesh=mesh, example_inputs=(x, y), loss_fn=cross_entropy, plan={"dp": "ddp"})
    def make(seed):
        torch.manual_seed(seed)
        return Llama(LlamaConfig())

    pm = make(0)
    out["decorated_type"] = type(pm).__name__
    out["state_dict_keys"] = sorted(pm.state_dict())
    loss_global = pm.train_step(x, y).item()
    # the same batch, already sharded by the loader: each rank passes its rows
    torch.manual_seed(0)
    pm_local = autopar.compile(Llama(LlamaConfig()), mesh, example_inputs=(x, y), loss_fn=cross_entropy,
                               plan={"dp": "ddp"}, inputs="local")
    rank = torch.distributed.get_rank()
    n = torch.distributed.get_world_size()
    rows = x.shape[0] // n
    loss_local = pm_local.train_step(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]).item()
    out["loss_global"], out["loss_local"] = loss_global, loss_local
    errors = {}
    for mode, p, args in [("global", pm, (x[:rows], y[:rows])), ("local", pm_local, (x, y))]:
        try:
            p.train_step(*args)
        except autopar.InputError as e:
            errors[mode] = str(e)
    out["errors"] = errors
    # ddp replicates every parameter: plain nn.Parameters (a sharded plan's are DTensors, their
    # optimizer state sharded with them); AdamW's state is plain tensors too
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt.step()
    out["param_types"] = sorted({type(p).__name__ for p in pm.parameters()})
    out["state_types"] = sorted({type(v).__name__ for st in opt.state.values() for v in st.values()})
    return out


def verify_job(plan: dict, axes: dict, **options):
    """autopar.verify on the built-in Llama; returns the report (rank 0)."""
    import autopar

    model, batches, loss_fn = build_model("llama")
    report = autopar.verify(model, autopar.mesh(**axes), example_inputs=batches[0], loss_fn=loss_fn,
                            plan=plan, batches=batches, **options)
    return report, str(report)


PIPELINE_CASES = [  # (model, mesh, plan, compile options): tests/test_pipeline.py, benchmarks/parity_report.py
    ("llama", {"pp": 2}, {"pp": "1f1b"}, {}),
    ("llama", {"pp": 2}, {"pp": "gpipe"}, {}),
    ("llama_tied", {"pp": 2}, {"pp": "zb"}, {}),  # tied embedding / LM head: one copy per stage, summed
    ("llama", {"pp": 2}, {"pp": {"schedule": "interleaved", "virtual": 2}}, {}),
    ("llama6_tied", {"pp": 4}, {"pp": "1f1b"}, {}),  # tied across pp ranks 0 and 3: a group of its own
    ("llama6", {"pp": 4}, {"pp": "gpipe"}, {}),
    ("llama6", {"pp": 4}, {"pp": "zb"}, {}),
    ("llama6", {"pp": 4}, {"pp": {"schedule": "interleaved", "virtual": 2}}, {}),
    ("llama_tied", {"pp": 2, "dp": 2}, {"pp": "1f1b", "dp": "fsdp"}, {"recompute": "full"}),
    ("llama", {"pp": 2, "tp": 2}, {"pp": "zb", "tp": "megatron"}, {}),
    ("llama", {"pp": 2, "dp": 2}, {"pp": "1f1b", "dp": "zero2"}, {}),  # gathers in the prologue: once per step
]


def pipeline_parity_job(name: str, axes: dict, plan: dict, steps: int = 3, lr: float = 1e-2,
                        track_memory: bool = False, **options):
    """``parity_job`` for a pipelined program: every rank holds only its stages, so parameters and
    gradients are gathered from all ranks; also returns the last step's measured schedule (every
    pipeline rank's action timings) and the activations each rank held in flight
    (``track_memory``: and the allocator's figures of the last step, ``memory``, with the cost
    model's, ``predicted_memory``)."""
    import torch.distributed as dist

    import autopar
    from autopar.analysis.cost import predict_memory

    mesh = autopar.mesh(**axes)
    model, batches, loss_fn = build_model(name)
    pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan=plan, debug=True, **options)
    opt = parity_optimizer(pm.parameters(), lr)
    losses, grads = [], []
    pm.counter.reset()
    pm.measure()  # count what each rank hands to the process group
    for i in range(steps):
        if track_memory and i == steps - 1:
            pm.track_memory()
        losses.append(pm.train_step(*batches[i % len(batches)]).item())
        grads.append({n: full_tensor(p.grad).detach() for n, p in pm.named_parameters()})
        opt.step()
        opt.zero_grad()
    params = {n: full_tensor(p.detach()) for n, p in pm.named_parameters()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (params, grads, pm.counter.summary(), pm.predicted_bytes(), pm.in_flight,
                                      [s.spec.index for s in pm.stages.values()], pm.predicted_in_flight(),
                                      pm.memory_report(opt) if track_memory else None,
                                      predict_memory(pm) if track_memory else None))
    timeline = pm.gather_timeline()
    merged_p, merged_g = {}, [{} for _ in range(steps)]
    for p_, g_, *_ in everyone:
        merged_p.update(p_)
        for i, g in enumerate(g_):
            merged_g[i].update(g)
    return {"losses": losses, "grads": merged_g, "params": merged_p, "steps": steps,
            "measured": [e[2] for e in everyone], "predicted": [e[3] for e in everyone],
            "in_flight": [e[4] for e in everyone], "stages": [e[5] for e in everyone],
            "predicted_in_flight": [e[6] for e in everyone], "memory": [e[7] for e in everyone],
            "predicted_memory": [e[8] for e in everyone],
            "timeline": timeline, "microbatches": pm.microbatches, "schedule": pm.schedule,
            "split": pm.describe_stages(), "report": pm.report(), "skipped": pm.skipped_steps}


ATTENTION_CASES = [  # tests/test_kernels.py, benchmarks/kernels_report.py
    # (B, H, Hkv, Sq, Sk, D, causal, additive mask, dtype)
    (1, 2, 2, 37, 37, 64, True, False, torch.float32),     # odd length, causal
    (2, 2, 2, 16, 29, 64, False, False, torch.float32),    # Sk != Sq, non-causal, batch 2
    (1, 4, 2, 37, 45, 64, False, True, torch.float32),     # GQA (2 query heads per KV head), additive mask
    (1, 4, 1, 33, 33, 128, True, False, torch.float32),    # head dim 128, multi-query
    (1, 2, 1, 33, 33, 128, True, False, torch.bfloat16),
    (1, 2, 2, 20, 20, 64, True, True, torch.float16),
    (1, 4, 2, 24, 24, 48, False, False, torch.float16),    # a head dim that is not a power of two
    (2, 4, 2, 96, 96, 64, True, False, torch.float32),     # longer than the interpreted blocks (kernels/
    (1, 4, 2, 100, 100, 64, True, False, torch.bfloat16),  # attention.py *_I): blocks below and across the
    (1, 2, 2, 64, 96, 64, False, True, torch.float32),     # diagonal, shapes that divide the blocks or not
]


def pipeline_failure_job(fail_rank: int, timeout_s: float = 3.0):
    """A pipeline step in which ``fail_rank`` raises before its first send: the others must fail
    with the same clear error at once (its failure record), at the latest after ``timeout_s``,
    instead of hanging (tests/test_pipeline.py)."""
    import torch.distributed as dist

    import autopar

    model, batches, loss_fn = build_model("llama")
    pm = autopar.compile(model, autopar.mesh(pp=dist.get_world_size()), example_inputs=batches[0],
                         loss_fn=loss_fn, plan={"pp": "1f1b"})
    pm.p2p_timeout = timeout_s
    if dist.get_rank() == fail_rank:
        def boom(*args):
            raise RuntimeError("injected failure in this rank's forward")
        pm.executor._forward = boom
    return pm.train_step(*batches[0])


def run_attention_case(b, h, hkv, sq, sk, d, causal, bias, dtype) -> dict:
    """One ATTENTION_CASES entry: the kernel's output, log-sum-exp and gradients, and the same from
    its reference path, on the same seeded inputs (tests/test_kernels.py, benchmarks/kernels_report.py)."""
    from autopar.kernels import ops

    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, sk, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, sk, d, generator=g).to(dtype).requires_grad_()
    mask = torch.randn(b, 1, sq, sk, generator=g) if bias else None
    out, lse = torch.ops.autopar.flash_attention(q, k, v, mask, causal, d ** -0.5)
    do = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    with ops.reference():
        ref, ref_lse = torch.ops.autopar.flash_attention(q, k, v, mask, causal, d ** -0.5)
        ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    return {"inputs": (q, k, v), "do": do, "out": out, "lse": lse, "grads": grads, "ref": ref, "ref_lse": ref_lse,
            "ref_grads": ref_grads}


def run_linear_act_case(act: str, dtype, rows=(3, 17), k: int = 40, n: int = 70) -> dict:
    """linear_act (default: ragged, 51 rows, K=40, N=70) against autograd in fp32, and the reference path's."""
    from autopar.kernels import ops

    g = torch.Generator().manual_seed(1)
    x = torch.randn(*rows, k, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    y, _ = torch.ops.autopar.linear_act(x, w, b, act)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    ref = getattr(torch.nn.functional, act)(torch.nn.functional.linear(xr, wr, br))
    ref_grads = torch.autograd.grad(ref, (xr, wr, br), dy.float())
    with ops.reference():
        y_reference_path, _ = torch.ops.autopar.linear_act(x, w, b, act)
    return {"y": y, "grads": grads, "ref": ref, "ref_grads": ref_grads, "y_reference_path": y_reference_path}


def measure_plan_job(spec: str, batch: int, seq: int, overrides: dict, axes: dict, plan: dict, steps: int = 6,
                     warmup: int = 2, **options) -> dict:
    """Runs on every rank: build the built-in model ``spec`` (real weights, same seed everywhere),
    compile it under ``plan``, run ``warmup`` + ``steps`` AdamW steps timed by the wall clock (barrier
    before each), then one step under the allocator tracker. Returns each step's time (the slowest
    rank's) and the largest rank's step peak (parameters + optimizer state + the allocator's peak in
    the step, without gloo's buffers), or the error."""
    import time

    import torch.distributed as dist

    import autopar
    from autopar.models import zoo

    try:
        mesh = autopar.mesh(**axes)
        loaded = zoo.load(spec, meta=False, batch=batch, seq=seq, overrides=overrides)
        t0 = time.perf_counter()
        pm = autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                             plan=plan, capture_eval=False, **options)
        compile_s = time.perf_counter() - t0
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        times = []
        for i in range(warmup + steps):
            dist.barrier()
            t = time.perf_counter()
            pm.train_step(*loaded.example_inputs)
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if i >= warmup:
                times.append(time.perf_counter() - t)
        pm.track_memory()
        pm.train_step(*loaded.example_inputs)
        opt.step()
        m = pm.memory_report(opt)
        opt.zero_grad()
        peak = m["parameters"] + m["optimizer_state"] + (m.get("program_peak_without_backend")
                                                         or m.get("program_peak", 0))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (times, int(peak)))
        return {"times": [max(ts) for ts in zip(*(e[0] for e in everyone))], "peak": max(e[1] for e in everyone),
                "compile_s": compile_s}
    except Exception as e:  # noqa: BLE001 - reported per plan, the sweep goes on
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
