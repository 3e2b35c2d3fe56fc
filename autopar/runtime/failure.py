"""No hang, ever: every wait of the runtime is bounded, and a rank that fails tells the others.

What blocks a rank is a wait on a collective or a transfer; on gloo such a wait can be
interrupted by nothing but its own end (torch 2.13: ``ProcessGroup.abort()`` / ``shutdown()``
do not wake a blocked wait, measured; a peer's abort does not close its connections either).
So the runtime never blocks for long in one call:

- **Sliced waits.** The executor runs guarded copies of the per-rank programs
  (autopar/runtime/guarded.py) whose collectives return a ``Work``; ``wait`` waits on it in
  slices of ``SLICE_S`` (a collective's ``Work.wait(timeout)`` raises on gloo when the slice
  ends, and the work can be waited again: measured). The fp16 overflow check and a pipeline's
  loss broadcast wait the same way. Sends and receives cannot be sliced (a timed-out gloo
  transfer closes its connection), so a helper thread blocks in them (a receive from the
  moment it is posted) while the main thread waits for the helper in slices.
- **A side channel.** Between slices a blocked rank reads one counter from the c10d store of
  the default group (``_get_default_store()``, a TCPStore: no collective): the number of
  failure records. A rank whose ``train_step`` (or eval call) raises posts a record there
  (its rank, the step, its exception) before raising; a rank blocked in that step sees it
  within a slice and raises ``RankFailure`` naming the failing rank and its exception. The
  failing rank itself raises its own exception, the very object with its traceback (and a
  note, where Python has ``add_note``), as torch.distributed's own tools do: code that catches
  ``torch.OutOfMemoryError`` or its own exception type still sees it. A wait that runs past
  ``timeout`` seconds raises too, after a census (below).
- **Lost peers.** A killed rank's connections close: gloo reports "Connection closed by peer"
  to the ranks waiting on it within milliseconds. If no rank posted a record, the ranks that
  noticed take a census on the store: every rank that is still inside autopar answers within a
  slice, and the ranks that do not answer are named as the ones that stopped responding. A
  rank that loses the store itself names the rank that hosts it (rank 0 under env:// init).
- **After a failure the program is unusable** (a collective may still be pending on its process
  groups, and the ranks no longer agree on which collective is next): the process groups are
  abandoned (never destroyed: destroying a gloo group joins its worker threads, which wait for
  the pending collective, so the process would not exit), the helper's transfers are closed,
  and every later call raises ``RankFailure`` (on the failing rank too, which may live on after
  catching its error: nothing of its waits for a peer). One exception: a failure before this
  rank's first collective of the step (the per-rank batch checks) re-raises the rank's own
  error; if every rank failed the same checks, nothing was sent and the program is still usable.
- **Compile** (``agree``): before the first collective of a new program (its parameters'
  distribution) every rank posts whether it compiled; a rank that could not raises its own
  error, the others a ``RankFailure`` naming it, instead of waiting for it in a broadcast.

Costs when nothing is wrong: no extra collective and no store access per step; per collective
one Python call that issues it and one that waits (and two clock reads: ``blocked()``, the time
spent waiting, which autopar/runtime/steptimes.py splits each step by); per receive a hand-off to the helper thread
(``benchmarks/faults.py --overhead`` measures the step). Only on gloo (CPU tensors) are waits
sliced: a CUDA tensor's wait is left to NCCL's own watchdog and timeout (untested here).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import queue
import re
import threading
import time

import torch.distributed as dist

from autopar import torch_compat as tc
from autopar.errors import MemoryBudgetError, RankFailure

SLICE_S = 0.1  # how long one wait blocks before it looks at the store
CENSUS_S = 2.0  # how long a rank that lost a peer waits for the others to answer
DEFAULT_TIMEOUT_S = 60.0

FIX = ("this program is unusable now (its process groups may hold a pending collective): fix the cause "
       "and restart every rank; resume from the last checkpoint (pm.save / autopar.CheckpointManager)")

_COUNT = "autopar/failures"
_pending: dict[int, tuple] = {}  # id(output) -> (output, Work): the collectives runtime/guarded.py issued
_blocked = [0.0]  # seconds this process spent in the waits below (autopar/runtime/steptimes.py reads it)


def blocked() -> float:
    """Seconds this process has spent so far inside the runtime's waits: collectives, pipeline
    transfers, the loss broadcast (two clock reads per wait; nothing is sent)."""
    return _blocked[0]


def _first_line(e: BaseException | str) -> str:
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    line = text.strip().splitlines()[0] if text.strip() else text
    # gloo's own errors: "[/path/pair.cc:553] Connection closed by peer [ip]:port. This is typically..."
    line = re.sub(r"\[/[^\]]*\.(cc|cpp|h):\d+\] ", "", line)
    if "gloo" in text or "Connection closed" in line:
        line = line.split(". ")[0]
    return line


class World:
    """This process's view of the failure side channel (one per default process group)."""

    def __init__(self):
        self.pg = dist.group.WORLD
        self.store = tc.find("default_store")()  # (torch's private name, through the boundary)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.calls = 0  # communicating calls (train_step, eval) begun on this rank, failed ones too
        self.compiles = 0
        self.seen = 0  # failure records read
        self.records: list[dict] = []
        self.broken: RankFailure | None = None
        self.call: Call | None = None
        self.slice = datetime.timedelta(seconds=SLICE_S)
        self.answered = False
        self.store_reads = 0  # times a wait looked at the store (none while every wait ends within a slice)
        self.store_dead = False
        self.waiter: _Waiter | None = None
        self.watched: list = []  # (work, done) handed to the waiter
        self.waiting: str | None = None  # what this rank waits in, once a wait outlasts a slice

    # ------------------------------------------------------------ the store
    def _where_store(self) -> str:
        s = self.store
        while hasattr(s, "underlying_store"):
            s = s.underlying_store
        host, port = getattr(s, "host", "?"), getattr(s, "port", "?")
        return f"{host}:{port}"

    def _store_lost(self, e: BaseException, what: str) -> RankFailure:
        self.store_dead = True
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun: the store is the agent's
        host = "its launcher's agent" if agent else "rank 0 (the store's host under env:// / tcp:// init)"
        return RankFailure(
            f"{host} stopped responding: the c10d store at {self._where_store()} is gone ({_first_line(e)}), "
            f"seen by rank {self.rank} while {what}", rank=None if agent else 0, error=_first_line(e),
            where=f"rank {self.rank}", fix=FIX)

    def post(self, record: dict) -> None:
        """Append a failure record for every rank to see (best effort: the store may be gone)."""
        record = {"rank": self.rank, "time": time.time(), **record}
        if self.store_dead:
            return
        with contextlib.suppress(Exception):
            i = self.store.add(_COUNT, 1) - 1
            self.store.set(f"autopar/failure/{i}", json.dumps(record))

    def read(self) -> list[dict]:
        """The failure records posted so far (one store round trip when there are no new ones)."""
        self.store_reads += 1
        n = self.store.add(_COUNT, 0)
        while self.seen < n:
            key = f"autopar/failure/{self.seen}"
            if not self.store.check([key]):  # counted, not written yet (the poster is between the two)
                break
            self.records.append(json.loads(self.store.get(key)))
            self.seen += 1
        return self.records

    def relevant(self, records: list[dict]) -> dict | None:
        """The record that explains a failure of this rank's current call: the first root cause
        that broke the program, or that failed the call this rank is in."""
        k = self.call.index if self.call is not None else None
        roots = [r for r in records if r.get("root") and (r.get("fatal") or r.get("call") == k)]
        if roots:
            return roots[0]
        others = [r for r in records if r.get("fatal")]
        return others[0] if others else None

    # ------------------------------------------------------------ waiting
    def wait(self, work, what: str, timeout: float | None = None, p2p: bool = False) -> None:
        """Wait for ``work`` in slices; between them, look for failure records; raise
        ``RankFailure`` on a record, a communication error or after ``timeout`` seconds.
        ``p2p``: a send / receive, whose gloo wait cannot be sliced (a timed-out wait closes the
        connection): a helper thread blocks in it while this thread waits in slices."""
        if timeout is None:
            timeout = self.call.timeout if self.call is not None else DEFAULT_TIMEOUT_S
        if p2p:
            return self._wait_p2p(work, what, timeout)
        start = time.perf_counter()
        try:
            if self._done(work, what):  # (the common case: done within the first slice)
                return
            t0 = time.monotonic() - SLICE_S
            self.waiting = what
            while True:
                self.check(what)
                if time.monotonic() - t0 >= timeout:
                    raise self.timed_out(what, timeout)
                if self._done(work, what):
                    return
        finally:
            self.waiting = None
            _blocked[0] += time.perf_counter() - start

    def watch(self, works: list, timeout: float) -> tuple[threading.Event, list]:
        """Hand sends / receives to the helper thread now (it waits for them in order;
        ``wait_watched`` collects them, all at once). The helper's own bound is later than any
        wait on it: the connection closes (gloo closes it when a transfer's wait times out) only
        after this rank gave up."""
        done, box = threading.Event(), []
        if self.waiter is None:
            self.waiter = _Waiter()
        self.waiter.jobs.put((works, datetime.timedelta(seconds=2 * timeout + 5 * SLICE_S), box, done))
        self.watched = [w for w in self.watched if not w[1].is_set()] + [(work, done) for work in works]
        return done, box

    def wait_watched(self, watched, what: str, timeout: float) -> None:
        done, box = watched
        start = time.perf_counter()
        try:
            if not done.wait(SLICE_S):
                t0 = time.monotonic() - SLICE_S
                self.waiting = what
                while not done.wait(SLICE_S):
                    self.check(what)
                    if time.monotonic() - t0 >= timeout:
                        raise self.timed_out(what, timeout)
        finally:
            self.waiting = None
            _blocked[0] += time.perf_counter() - start
        if box:
            raise self.lost(what, box[0]) from None

    def _wait_p2p(self, work, what: str, timeout: float) -> None:
        self.wait_watched(self.watch([work], timeout), what, timeout)

    def _done(self, work, what: str) -> bool:
        try:
            work.wait(self.slice)
            return True
        except RuntimeError as e:  # gloo: "Operation timed out!" when the slice ends; else a real error
            text = str(e)
            if "timed out" in text.lower() and "Timed out waiting" not in text:
                return False
            raise self.lost(what, e) from None

    def check(self, what: str) -> None:
        """Raise the failure another rank posted for this call (or a fatal one), if any."""
        try:
            records = self.read()
        except Exception as e:  # noqa: BLE001 - the store's process is gone
            raise self._store_lost(e, f"waiting in {what}") from None
        if not self.answered and any(r.get("census") for r in records):
            self.answer()  # a rank lost a peer and asks who is still here
        rec = self.relevant(records)
        if rec is not None:
            raise self.from_record(rec, what)

    def from_record(self, rec: dict, what: str | None) -> RankFailure:
        waiting = f"rank {self.rank} was waiting in {what}" if what else f"rank {self.rank}"
        if rec.get("root"):
            return RankFailure(f"rank {rec['rank']} failed in {rec['where']}: {rec['error']}", rank=rec["rank"],
                               error=rec["error"], where=waiting, fix=FIX)
        return RankFailure(rec["message"], rank=rec.get("culprit"), error=rec.get("error", ""), where=waiting,
                           fix=FIX)

    def lost(self, what: str, e: BaseException) -> RankFailure:
        """A communication error (a peer's connection closed, gloo's own timeout): the record of
        the rank that caused it if there is one, else a census of who still answers."""
        deadline = time.monotonic() + 2 * SLICE_S  # a failing rank posts before its process exits
        while True:
            try:
                rec = self.relevant(self.read())
            except Exception as se:  # noqa: BLE001
                return self._store_lost(se, f"waiting in {what}")
            if rec is not None and (rec.get("root") or time.monotonic() > deadline):
                return self.from_record(rec, what)  # (another rank's account of the same loss, after a grace)
            if time.monotonic() > deadline:
                break
            time.sleep(SLICE_S / 2)
        missing, states = self.census(f"rank {self.rank}: {_first_line(e)} while waiting in {what}")
        if missing:
            who = ", ".join(map(str, missing))
            msg = (f"rank{'s' if len(missing) > 1 else ''} {who} stopped responding: rank {self.rank}'s "
                   f"connection failed while it waited in {what} ({_first_line(e)}), and rank(s) {who} left no "
                   f"error and did not answer within {CENSUS_S:g}s (killed, e.g. out of memory or SIGKILL, "
                   "crashed, or stuck outside autopar)")
        else:
            msg = (f"rank {self.rank}'s connection failed while it waited in {what} ({_first_line(e)}); every rank "
                   "still answers: " + "; ".join(f"rank {r}: {s}" for r, s in sorted(states.items())))
        self.post({"root": False, "fatal": True, "message": msg, "culprit": missing[0] if missing else None,
                   "error": _first_line(e)})
        return RankFailure(msg, rank=missing[0] if missing else None, error=_first_line(e),
                           where=f"rank {self.rank}", fix=FIX)

    def timed_out(self, what: str, timeout: float) -> RankFailure:
        missing, states = self.census(f"rank {self.rank} timed out in {what}")
        with contextlib.suppress(Exception):
            self.read()
        rec = self.relevant(self.records)
        if rec is not None:  # posted during the census
            return self.from_record(rec, what)
        msg = f"rank {self.rank} waited {timeout:g}s (timeout={timeout:g}) in {what}, and no rank reported an error"
        if missing:
            msg += (f"; rank(s) {', '.join(map(str, missing))} did not answer (stuck outside autopar's collectives, "
                    "e.g. in the data loader or a hung op, or killed)")
        others = {r: s for r, s in states.items() if r != self.rank}
        if others:
            msg += "; " + "; ".join(f"rank {r} is {s}" for r, s in sorted(others.items()))
        self.post({"root": False, "fatal": True, "message": msg, "culprit": missing[0] if missing else None,
                   "error": "timeout"})
        return RankFailure(msg, rank=missing[0] if missing else None, error="timeout",
                           where=f"rank {self.rank}", fix=FIX + f"; or raise timeout= (now {timeout:g}s) if a step "
                           "is legitimately that slow")

    def census(self, why: str) -> tuple[list[int], dict[int, str]]:
        """Ask every rank on the store to answer; (ranks that did not answer, what the others do)."""
        self.post({"root": False, "fatal": False, "census": True, "message": why})
        self.answer()
        keys = {r: f"autopar/alive/{r}" for r in range(self.size)}
        deadline = time.monotonic() + CENSUS_S
        answered: dict[int, str] = {}
        try:
            while True:
                for r, k in keys.items():
                    if r not in answered and self.store.check([k]):
                        answered[r] = self.store.get(k).decode()
                if len(answered) == self.size or time.monotonic() > deadline:
                    break
                time.sleep(SLICE_S / 2)
        except Exception:  # noqa: BLE001 - the store went away: nobody else can answer
            pass
        return [r for r in range(self.size) if r not in answered], answered

    def answer(self) -> None:
        if self.answered:
            return
        self.answered = True
        c = self.call
        state = f"in {c.what} (step {c.step})" if c is not None else "outside autopar's calls"
        if self.waiting:
            state = f"waiting in {self.waiting}, " + state
        if not self.store_dead:
            with contextlib.suppress(Exception):
                self.store.set(f"autopar/alive/{self.rank}", state)

    # ------------------------------------------------------------ after a failure
    def abandon(self, failure: RankFailure) -> None:
        """Never use (or destroy) this world's process groups again: see the module docstring."""
        if self.broken is None:
            self.broken = failure
            for pg in list(dist.distributed_c10d._world.pg_map):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
            if self.waiter is not None:  # free the helper thread (it must not hold the process's exit):
                self.waiter.stop = True  # a gloo transfer whose wait times out closes its connection,
                for work, done in self.watched:  # and every wait on it returns (measured); the peer
                    if not done.is_set():  # at the other end is told at once, too
                        with contextlib.suppress(Exception):
                            work.wait(datetime.timedelta(milliseconds=1))
        self.answer()


class _Waiter:
    """One thread that blocks in ``Work.wait()`` of sends and receives for the main thread.

    Not a daemon: a daemon thread whose C++ wait returns while the interpreter finalizes is
    killed inside it (std::terminate, SIGABRT at exit, seen). This one ends when the main thread
    has ended and it is idle; a wait in progress then is bounded by the transfer's timeout."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = False
        threading.Thread(target=self._run, name="autopar-p2p-wait", daemon=False).start()

    def _run(self):  # (the works come in the order the main thread will wait for them)
        main = threading.main_thread()
        while True:
            try:
                works, timeout, box, done = self.jobs.get(timeout=SLICE_S)
            except queue.Empty:
                if not main.is_alive():
                    return
                continue
            try:
                for work in works:
                    if self.stop:
                        raise RuntimeError("autopar: abandoned after a failure")
                    work.wait(timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box.append(e)
            done.set()


_world: World | None = None


def world() -> World | None:
    """The side channel of the current default process group; None when there is nothing to
    coordinate (one rank, a fake process group for planning, or no process group)."""
    global _world
    if not dist.is_initialized():
        return None
    pg = dist.group.WORLD
    if _world is not None and _world.pg is pg:
        return _world
    if dist.get_world_size() == 1 or dist.get_backend(pg) == "fake":
        return None
    _world = World()
    return _world


def wait(work, what: str, timeout: float | None = None, p2p: bool = False, guard: bool = True) -> None:
    """Wait for a ``Work`` (bounded, and woken by another rank's failure): see ``World.wait``.
    ``guard=False``: a plain ``Work.wait`` (with ``timeout`` if given), as before this module."""
    w = world() if guard else None
    if w is not None:
        return w.wait(work, what, timeout, p2p)
    start = time.perf_counter()
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
    finally:
        _blocked[0] += time.perf_counter() - start


# ---------------------------------------------------------------- one call (train_step, eval)
class Call:
    """One communicating call of a runtime (``with failure.call(pm, "train_step") as c``): the
    code before ``c.communicating()`` checks the batch; an exception there is posted for the
    peers and re-raised as it is; after it, any exception breaks the program on every rank: it is
    posted, passes on as it is on this rank, and the peers raise ``RankFailure`` naming it."""

    def __init__(self, w: World, what: str, step: int, timeout: float):
        self.w, self.what, self.step, self.timeout = w, what, step, timeout
        self.index = w.calls
        self.sending = False

    def communicating(self) -> None:
        self.sending = True

    def __enter__(self):
        w = self.w
        if w.broken is not None:
            b = w.broken
            raise RankFailure(b.problem, rank=b.rank, error=b.error, where=f"rank {w.rank}: {self.what} called "
                              "again after the failure", fix=FIX)
        w.calls += 1
        w.call = self
        return self

    def __exit__(self, typ, e, tb):
        w = self.w
        w.call = None if w.call is self else w.call
        if e is None:
            return False
        _pending.clear()
        where = f"{self.what} (step {self.step})"
        if isinstance(e, RankFailure):  # from a wait: a peer's record, a lost peer, a timeout
            w.answer()
            if not self.sending:
                return False
            if not any(r.get("fatal") for r in w.records):  # a peer's batch checks failed: tell it (it may
                # be idle, and call again) that the program is dead now
                w.post({"root": False, "fatal": True, "message": e.problem, "culprit": e.rank, "error": e.error})
            w.abandon(e)
            return False
        if self.sending and _communication_error(e):  # a peer's connection closed under a call not waited here
            failure = w.lost(self.what, e)
            w.abandon(failure)
            raise failure from e
        rec = {"root": True, "call": self.index, "where": where, "error": _first_line(e), "fatal": self.sending}
        w.post(rec)
        if not self.sending:  # the batch checks: nothing was sent, this rank's own error says it best
            return False
        # this rank's own error (the user's, torch's: an out-of-memory, a kernel's IndexError;
        # KeyboardInterrupt, SystemExit too) passes on as it is, the very object with its
        # traceback, as torch.distributed's tools do: the peers raise RankFailure naming this rank
        w.abandon(w.from_record({**rec, "rank": w.rank}, None))
        _note(e, f"autopar: rank {w.rank} raised this in {where}; the other ranks were told and raise RankFailure "
              f"naming it. {FIX[0].upper()}{FIX[1:]}")
        return False


def _note(e: BaseException, note: str) -> None:
    """``e.add_note(note)`` where Python has it (3.11+), once per exception object."""
    if hasattr(e, "add_note") and note not in getattr(e, "__notes__", ()):
        e.add_note(note)


def _communication_error(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and (
        "gloo" in text or "Connection closed" in text or "pair closure" in text))


def call(runtime, what: str):
    """The ``Call`` of one train_step / eval call of ``runtime`` (a no-op context when there is
    nothing to coordinate, or ``runtime.guard`` is off)."""
    w = world() if getattr(runtime, "guard", True) else None
    if w is None:
        return _NoCall()
    return Call(w, f"{what} of {type(runtime).__name__}", runtime.steps, runtime.timeout)


class _NoCall:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def communicating(self) -> None:
        pass


# ---------------------------------------------------------------- compile
def compile_failed(rank: int) -> bool:
    """Whether ``rank`` has said that its current compile failed (``agree``'s record): a rank
    waiting for another's trace (autopar/trace_share.py) stops waiting."""
    w = world()
    if w is None:
        return False
    key = f"autopar/compile/{w.compiles}/{rank}"
    try:
        return bool(w.store.check([key])) and not json.loads(w.store.get(key))["ok"]
    except Exception:  # noqa: BLE001 - the store is gone: the wait's own timeout ends it
        return False


def agree(error: BaseException | None, timeout: float, what: str = "autopar.compile") -> None:
    """Before the first collective of a compiled program (distributing its parameters): every
    rank learns whether every other rank compiled. A rank that failed raises its own error at
    once; the others raise ``RankFailure`` naming it, instead of waiting in the first broadcast
    for a rank that will never come. Costs a store write and N reads once per compile."""
    w = world()
    if w is None:
        if error is not None:
            raise error
        return
    k = w.compiles
    w.compiles += 1
    mine = {"ok": error is None, "error": _first_line(error) if error is not None else "",
            "budget": isinstance(error, MemoryBudgetError)}
    with contextlib.suppress(Exception):
        w.store.set(f"autopar/compile/{k}/{w.rank}", json.dumps(mine))
    if error is not None:
        raise error
    deadline = time.monotonic() + timeout
    pending = set(range(w.size))
    while pending:
        for r in sorted(pending):
            key = f"autopar/compile/{k}/{r}"
            try:
                there = w.store.check([key])
                rec = json.loads(w.store.get(key)) if there else None
            except Exception as e:  # noqa: BLE001
                raise w._store_lost(e, f"waiting for every rank to finish {what}") from None
            if rec is None:
                continue
            pending.discard(r)
            if not rec["ok"] and rec.get("budget"):  # deterministic, before anything ran: the same kind here
                raise MemoryBudgetError(f"rank {r}: {rec['error'].partition(': ')[2]}",
                                        where=f"rank {r}'s prediction in {what}(memory_budget=...)",
                                        fix="see rank " + str(r) + "'s error for its biggest parts; bring its "
                                        "peak down (more ranks on cp / tp / fsdp, recompute) or raise memory_budget")
            if not rec["ok"]:
                raise RankFailure(f"rank {r} failed in {what}: {rec['error']}", rank=r, error=rec["error"],
                                  unusable=False, where=f"rank {w.rank} (compiled fine)",
                                  fix="fix the cause on that rank (every rank must compile the same program) "
                                  "and compile again")
        if pending and time.monotonic() > deadline:
            who = ", ".join(map(str, sorted(pending)))
            raise RankFailure(f"rank(s) {who} did not finish {what} within {timeout:g}s of rank {w.rank}",
                              rank=min(pending), error="timeout", unusable=False, where=f"rank {w.rank}",
                              fix="every rank must call autopar.compile with the same model and plan; raise "
                              "timeout= if compiling is that uneven across ranks")
        if pending:
            time.sleep(0.02)

