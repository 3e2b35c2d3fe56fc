"""Fault cases: one rank fails, every rank must raise within seconds (tests/test_faults.py,
benchmarks/faults.py; the mechanism: autopar/runtime/failure.py).

``run_fault_case(case, plan)`` runs a case on fresh gloo processes (a failure abandons the
process groups, so a shared pool could not run another job after it) and returns what every
rank raised and when it exited; ``recoverable_faults_job`` runs on a shared pool the failures
that leave the program usable.

``own_one`` / ``own_zero``: the failing rank's own exception (``own_error``: an instance of the
user's own type, or torch's out-of-memory error) must reach it as that very object; it catches
it, calls ``train_step`` again and lives on ``linger`` seconds, while its peer raises
``RankFailure`` naming it.
"""

from __future__ import annotations

import os
import queue
import time

import torch

from autopar.testing import _free_port, build_model, parent_environment, process_context, worker_environment

FAULT_PLANS = {"fsdp": ({"dp": 2}, {"dp": "fsdp"}), "pp": ({"pp": 2}, {"pp": "1f1b"}),
               "ddp": ({"dp": 2}, {"dp": "ddp"}), "megatron": ({"tp": 2}, {"tp": "megatron"}),
               "inductor": ({"dp": 2}, {"dp": "ddp"})}  # (inductor: compiled with inductor=True)

FAULT_CASES = {  # name: what happens (on rank 1 unless said)
    "token_one": "token id 300 >= vocab 256 in rank 1's batch only",
    "token_all": "token id 300 >= vocab 256 on every rank (then one good step)",
    "shape_one": "rank 1's batch has the wrong shape ([4, 8] for [4, 16])",
    "dtype_one": "rank 1's batch has the wrong dtype (int32 for int64)",
    "loss_one": "an exception in the loss on rank 1, mid-step",
    "hang_one": "rank 1 stuck in the loss (sleeps) until the others time out",
    "kill_one": "rank 1 SIGKILLed in the loss, mid-step",
    "kill_zero": "rank 0 (the store's host) SIGKILLed in the loss, mid-step",
    "short_one": "rank 1 runs one step fewer and exits",
    "compile_one": "the loss function raises while tracing on rank 1 only",
    "own_one": "the user's own exception in the loss on rank 1, mid-step; rank 1 catches it and lives on",
    "own_zero": "the same on rank 0 (the store's host)",
    "clip_late": "between steps: rank 1 busy (until rank 0 has its result) while rank 0 waits in clip_grad_norm_'s all_reduce",
    "plan_bad": "unknown strategy in the plan (every rank)",
    "plan_batch": "batch not divisible by the data-parallel ranks / micro-batches (every rank)",
}


def _fault_loss_error(loss):
    raise RuntimeError("injected: the loss failed on this rank")


class InjectedFailure(Exception):
    """An exception type of the user's own (``own_one``: the failing rank must get it as it is)."""


OWN_ERROR = InjectedFailure("injected: the user's code failed on this rank")  # (one object per process)
OWN_OOM = torch.OutOfMemoryError("injected: out of memory in the loss (code that catches it shrinks the batch)")


def own_error(plan_name: str) -> BaseException:
    """The very object the failing rank's code raises in ``own_*`` under ``plan_name``."""
    return OWN_OOM if plan_name == "fsdp" else OWN_ERROR


def _fault_own_error(loss):
    raise OWN_ERROR


def _fault_own_oom(loss):
    raise OWN_OOM


def _fault_kill(loss):
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _fault_sleep(loss):
    time.sleep(float(os.environ.get("AUTOPAR_FAULT_SLEEP", "20")))
    return loss


def inject_at_loss(pm, fn) -> None:
    """Insert a call ``fn(value)`` where this rank's loss is made: in the SPMD joint program just
    before the backward starts (the first op reading the loss's tangent), in a pipeline the last
    stage's forward part after its loss node; a pipeline rank without the loss: after the first
    value its first stage's forward sends on."""
    if pm.pipelined:
        spots = []
        for sp in pm.local.values():
            part = sp.parts.get("F")
            names = [o for (k, _), o in zip(sp.program.outputs, sp.out_names) if k == "loss" and o]
            if part is not None and part.gm is not None and names:
                spots.append((part.gm, names[0]))
        if not spots:
            sp = pm.local[min(pm.local)]
            acts = [o for (k, _), o in zip(sp.program.outputs, sp.out_names) if k == "act" and o]
            spots = [(sp.parts["F"].gm, acts[0])]
    else:
        # where the backward starts: the first op that reads the loss's tangent (the loss is made
        # by then; the output node itself may sit at the program's end, after every gradient's
        # all-reduce: passes/overlap.py waits the step loss's all-reduce there)
        graph = pm.program.local.graph
        tangents = [n for (k, _), n in zip(pm.program.inputs, [p for p in graph.nodes if p.op == "placeholder"])
                    if k == "tangent"]
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min((u for t in tangents for u in t.users), key=order.__getitem__, default=None)
        spots = [(pm.program.local, first.prev.name)] if first is not None else []
    pm.executor._guarded.clear()  # (the guarded and compiled copies are made from the programs as they are now)
    pm.executor._compiled.clear()
    for gm, name in spots:
        node = next(n for n in gm.graph.nodes if n.name == name)
        with gm.graph.inserting_after(node):
            gm.graph.call_function(fn, (node,))
        gm.recompile()


def fault_job(case: str, plan_name: str, timeout: float, report, peer_done=None, linger: float = 0.0):
    """One rank's side of a fault case: compile the tiny Llama under the plan, inject the fault,
    train; returns what happened ("ok: ..."; the failing rank of ``own_*``: a dict, ``_own_error``),
    or raises what the rank raised. ``peer_done``: an event rank 0 sets once it has its result
    (``clip_late``'s busy rank waits for it)."""
    import torch.distributed as dist

    import autopar

    rank = dist.get_rank()
    axes, plan = FAULT_PLANS[plan_name]
    model, batches, loss_fn = build_model("llama")
    if plan_name != "pp":  # one block compiles faster (a pipeline of 2 stages wants 2)
        from autopar.models.llama import Llama, LlamaConfig

        torch.manual_seed(0)
        model = Llama(LlamaConfig(n_layers=1))
    x, y = batches[0]
    if case == "plan_bad":
        plan = {**plan, ("dp" if "dp" in plan else "pp"): "zero9"}
    if case == "plan_batch":
        x, y = (x[:3], y[:3]) if plan_name == "fsdp" else (x, y)
        plan = plan if plan_name == "fsdp" else {"pp": {"schedule": "1f1b", "microbatches": 3}}
    if case == "compile_one" and rank == 1:
        def loss_fn(logits, targets):  # noqa: F811 - this rank's loss fails while tracing
            raise ValueError("injected: this rank's loss function does not trace")
    if case in ("plan_bad", "plan_batch", "compile_one"):
        report("fault", time.time())
    pm = autopar.compile(model, autopar.mesh(**axes), example_inputs=(x, y), loss_fn=loss_fn, plan=plan,
                         capture_eval=False, timeout=timeout, inductor=plan_name == "inductor")
    pm.train_step(x, y)  # one good step first: every rank is running when the fault comes
    if case in ("own_one", "own_zero"):
        return _own_error(pm, x, y, int(case == "own_one"), plan_name, linger, report)
    bad_x = x
    if case == "token_all" or (case == "token_one" and rank == 1):
        bad_x = x.clone()
        bad_x[1, 3] = 300
    if case == "shape_one" and rank == 1:
        bad_x = x[:, :8]
    if case == "dtype_one" and rank == 1:
        bad_x = x.int()
    inject = {"loss_one": (1, _fault_loss_error), "hang_one": (1, _fault_sleep), "kill_one": (1, _fault_kill),
              "kill_zero": (0, _fault_kill)}.get(case)
    if inject is not None and inject[0] == rank:
        inject_at_loss(pm, inject[1])
    if case == "clip_late":  # a collective between steps, outside train_step: bounded the same way
        report("fault", time.time())
        if rank == 1:  # busy until rank 0 has given up waiting for it (at most 60 s)
            if peer_done is None or not peer_done.wait(60):
                return "ok: busy for 60 s, rank 0 still waiting"
            return "ok: busy through the clip"
        pm.clip_grad_norm_(1.0)
        return "ok"
    if case == "short_one":  # rank 1 stops one step early (its loader ran out): rank 0 waits for it
        if rank == 1:
            report("fault", time.time())
            return "ok: returned one step early"
        pm.train_step(x, y)
        return "ok"
    report("fault", time.time())
    if case == "token_all":
        try:
            pm.train_step(bad_x, y)
        except autopar.InputError:
            pm.train_step(x, y)  # still usable: nothing was sent
            return "ok: InputError on every rank, then a good step"
    pm.train_step(bad_x, y)
    return "ok"


def _own_error(pm, x, y, failing: int, plan_name: str, linger: float, report):
    """``own_*``: rank ``failing`` raises ``own_error(plan_name)`` in its loss, mid-step. The
    peer's ``train_step`` raises (what it raised is its result). The failing rank returns what it
    caught: its type, whether it is the very object raised, the innermost frame of its traceback,
    its notes; what a second ``train_step`` raised; then it lives on ``linger`` seconds."""
    import traceback

    import torch.distributed as dist

    if dist.get_rank() != failing:
        report("fault", time.time())
        pm.train_step(x, y)
        return "ok: no error"
    own = own_error(plan_name)
    inject_at_loss(pm, _fault_own_oom if own is OWN_OOM else _fault_own_error)
    report("fault", time.time())
    try:
        pm.train_step(x, y)
        return "ok: no error"
    except BaseException as e:  # noqa: BLE001 - what this rank caught is the result
        report("raised", time.time())
        out = {"type": type(e).__name__, "type_is": type(e) is type(own), "same": e is own, "message": str(e),
               "innermost": traceback.extract_tb(e.__traceback__)[-1].name, "notes": getattr(e, "__notes__", [])}
    t = time.monotonic()
    try:
        pm.train_step(x, y)
        out["again"] = "no error"
    except BaseException as e:  # noqa: BLE001
        out["again"] = f"{type(e).__name__}: {e}"
    out["again_s"] = time.monotonic() - t
    time.sleep(linger)
    report("linger_end", time.time())
    return out


def recoverable_faults_job() -> list:
    """Failures that leave the program (and a shared pool) usable: every rank's batch fails the
    same check before anything is sent; one rank cannot compile (the others learn it before the
    parameters are distributed). Returns every rank's (batch error, compile error, losses)."""
    import torch.distributed as dist

    import autopar
    from autopar.models.llama import Llama, LlamaConfig

    rank = dist.get_rank()
    _, batches, loss_fn = build_model("llama")
    x, y = batches[0]
    torch.manual_seed(0)
    pm = autopar.compile(Llama(LlamaConfig(n_layers=1)), autopar.mesh(dp=2), example_inputs=(x, y),
                         loss_fn=loss_fn, plan={"dp": "fsdp"}, capture_eval=False, timeout=10)
    losses = [pm.train_step(x, y).item()]
    bad = x.clone()
    bad[0, 0] = 999
    try:
        pm.train_step(bad, y)
        said_batch = "no error"
    except autopar.AutoparError as e:
        said_batch = f"{type(e).__name__}: {e}"
    losses.append(pm.train_step(x, y).item())

    def broken_loss(logits, targets):  # this rank's loss function fails while tracing
        raise ValueError("injected: this rank's loss function does not trace")

    try:
        autopar.compile(Llama(LlamaConfig(n_layers=1)), autopar.mesh(dp=2), example_inputs=(x, y),
                        loss_fn=broken_loss if rank == 1 else loss_fn, plan={"dp": "fsdp"}, capture_eval=False,
                        timeout=10)
        said_compile = "no error"
    except autopar.AutoparError as e:
        said_compile = f"{type(e).__name__}: {e}"
    losses.append(pm.train_step(x, y).item())  # the first program still runs
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (said_batch, said_compile, losses))
    return everyone


def _fault_worker(rank: int, world: int, port: int, case: str, plan_name: str, timeout: float, results, done, parent,
                  linger: float = 0.0):
    import warnings

    worker_environment(parent)
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)

    def report(kind, value):
        results.put((rank, kind, value))

    try:
        out = fault_job(case, plan_name, timeout, report, done, linger)
        report("result", (time.time(), out))
    except BaseException as e:  # noqa: BLE001 - what this rank raised is the result
        report("result", (time.time(), f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        report("error_text", f"{type(e).__name__}: {e}")
    finally:
        if rank == 0:
            done.set()


def run_fault_case(case: str, plan_name: str, timeout: float = 5.0, world: int = 2, limit: float = 120.0,
                   linger: float = 0.0, spawn: bool = False, raised=None) -> dict:
    """Run ``case`` on ``world`` fresh processes; what every rank raised (first line), and the
    seconds from the fault to each rank's exit (None: still running at ``limit``, then killed).
    ``linger``: how long the failing rank of ``own_*`` lives on after its error; ``spawn``: the
    processes are spawned (a fresh interpreter that exits as a script does: atexit handlers,
    finalization), not forked from the fork server (whose children end in ``os._exit``).
    ``raised``: a ``threading.Event`` set once every rank has its result or has exited (what is
    left is the lingering and the exits: a caller running this in a thread may do other work)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait as wait_any

    ctx = mp.get_context("spawn") if spawn else process_context()
    results = ctx.Queue()
    port = _free_port()
    done = ctx.Event()  # rank 0 has its result
    parent = parent_environment()
    procs = [ctx.Process(target=_fault_worker, args=(r, world, port, case, plan_name, timeout, results, done, parent,
                                                     linger), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    exited: dict[int, float] = {}
    deadline = time.monotonic() + limit
    msgs = []
    while len(exited) < world and time.monotonic() < deadline:
        alive = {p.sentinel: r for r, p in enumerate(procs) if r not in exited}
        for s in wait_any(list(alive), timeout=0.05):
            exited[alive[s]] = time.time()
        while True:
            try:
                msgs.append(results.get_nowait())
            except queue.Empty:
                break
        if raised is not None and not raised.is_set() and \
                all(r in exited or any(m[0] == r and m[1] == "result" for m in msgs) for r in range(world)):
            raised.set()
    if raised is not None:
        raised.set()
    for r, p in enumerate(procs):
        if r not in exited:
            p.kill()
            p.join(5)
    while True:
        try:
            msgs.append(results.get(timeout=0.2))
        except queue.Empty:
            break
    if os.environ.get("AUTOPAR_FAULT_DEBUG"):
        print(msgs, exited)
    faults = [v for _, k, v in msgs if k == "fault"]
    t0 = min(faults) if faults else None
    out = {"case": case, "plan": plan_name, "timeout": timeout, "ranks": {}}
    for r in range(world):
        res = [v for rr, k, v in msgs if rr == r and k == "result"]
        text = [v for rr, k, v in msgs if rr == r and k == "error_text"]
        caught = [v for rr, k, v in msgs if rr == r and k == "raised"]  # (own_*: raised, caught, lived on)
        lived = [v for rr, k, v in msgs if rr == r and k == "linger_end"]
        if caught and res:
            res = [(caught[0], res[0][1])]
        out["ranks"][r] = {
            "said": res[0][1] if res else ("(killed)" if procs[r].exitcode == -9 else f"(no result; exit code "
                                                                                      f"{procs[r].exitcode})"),
            "text": text[0] if text else "",
            "raised_s": (res[0][0] - t0) if res and t0 is not None else None,
            "exit_s": (exited[r] - t0) if r in exited and t0 is not None else None,
            "exitcode": procs[r].exitcode,
            "lived_s": (lived[0] - t0) if lived and t0 is not None else None,
        }
    return out
