"""Work done beside this process in a forked copy of it (``autopar plan``'s depths, the planner's
block figures and confirmations): a fork shares everything already imported and traced, so a
child starts in microseconds where a spawned process would import torch and autopar again.

Forking is safe only where no other thread could hold a lock the child needs: ``can_fork()`` is
true where this process runs no other Python thread (the command line; not a test runner's
worker, whose runner has threads; tqdm's monitor thread does not count). ``AUTOPAR_PLAN_FORK``
overrides it: "0" never, "always" even beside other threads (the tests use it, to cover the
forked path). A child runs one intra-op thread, sends back what its function returned (pickled,
through a pipe) and leaves by ``os._exit``; a child that fails is reported to the caller, which
does the work itself. (Not multiprocessing's "fork" Process: its bootstrap in the child runs the
finalizers the parent's libraries registered and flushes the stdio buffers it inherited; the
child here runs one function and nothing else.)
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import pickle
import signal
import sys
import threading
from typing import Callable

RESULTS: collections.Counter = collections.Counter()  # children's results received: "ok" / "failed"


# threads known not to hold anything a child uses: tqdm's monitor (started by the first progress
# bar a library shows; it wakes every few seconds to look at tqdm's own bars)
_HARMLESS_THREADS = ("tqdm_monitor",)


def can_fork() -> bool:
    mode = os.environ.get("AUTOPAR_PLAN_FORK", "1")
    if not hasattr(os, "fork") or mode in ("0", "false", "off"):
        return False
    others = [t for t in threading.enumerate()
              if t is not threading.current_thread() and t.name not in _HARMLESS_THREADS]
    return mode == "always" or not others


@contextlib.contextmanager
def shared_heap():
    """Around the forks: the modules every compile imports on first use imported once here, not in
    each child, and this process's objects frozen out of the cyclic collector's reach while the
    children start. A fork shares the parent's pages until someone writes to them, and a full
    collection in a child would write to every object (copying every page)."""
    _preload()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _preload() -> None:
    """The modules every compile imports on first use (dynamo, AOTAutograd), imported before a fork."""
    import torch.fx.experimental.proxy_tensor  # noqa: F401

    from autopar import torch_compat

    torch_compat.preload()


def settle_autograd() -> None:
    """Once, before this process's first trace: one backward of a CPU scalar, so that autograd's
    engine decides its device threads with no fake device counted. The engine starts them at the
    process's first backward, one per device its device guards count, and once they exist a forked
    child can run no backward ("Unable to handle autograd's threading in combination with
    fork-based multiprocessing"). Fake tensor mode on a CUDA build of torch with no GPU (PyPI's
    Linux wheel on a CPU machine) puts a stand-in CUDA guard in place that counts devices (eight
    threads on torch 2.11; none on 2.13's CPU build): where AOTAutograd's fake joint trace was the
    first backward, every child that traced a joint failed and was redone here (a period-2 model's
    depths 3-4, the search's confirmations). With a real GPU the threads start either way (its count
    is real): such children still fail and are redone here, and the progress line says so."""
    global _SETTLED
    import torch

    if _SETTLED or torch.is_inference_mode_enabled():  # (no backward runs there: the next trace settles)
        return
    _SETTLED = True
    with torch.enable_grad():
        x = torch.zeros((), requires_grad=True)
        torch.autograd.grad(x * 1.0, x)


_SETTLED = False


def _payload(fn: Callable[[], object]) -> bytes:
    """What a child sends back: ``fn()``'s value, or its error (the parent then does the work)."""
    try:
        return pickle.dumps(("ok", fn()))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which does the work itself
        return pickle.dumps(("error", f"{type(e).__name__}: {e}"))


class Forked:
    """``fn()`` in a forked copy of this process, started at once. ``result()`` waits for what
    ``fn`` returned and raises RuntimeError if the child failed; ``kill()`` stops it."""

    def __init__(self, fn: Callable[[], object]):
        import torch

        r, w = os.pipe()
        sys.stdout.flush()  # (else a child that prints could flush its copy of what is pending here)
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child
            try:
                os.close(r)
                torch.set_num_threads(1)
                payload = _payload(fn)
                with os.fdopen(w, "wb") as f:
                    f.write(payload)
            finally:
                os._exit(0)
        os.close(w)
        self.pipe = os.fdopen(r, "rb")

    def result(self):
        with self.pipe as f:
            data = f.read()
        os.waitpid(self.pid, 0)
        kind, value = pickle.loads(data) if data else ("error", "the forked process died")
        RESULTS["ok" if kind == "ok" else "failed"] += 1
        if kind != "ok":
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        self.pipe.close()
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


class Parted(BaseException):
    """Raised in this process by ``Continued.split``: the work it was doing goes on in the child.
    (Not an Exception: no handler for errors may take it for one.)"""


class Continued(Forked):
    """A fork in the middle of some work: ``split()`` forks once; the child returns from it and
    goes on with the work (``in_child``), then calls ``send(fn)``, which sends ``fn()``'s value (or
    its error) and leaves; this process raises ``Parted`` from ``split()``, leaving the work, and
    ``result()`` later waits for what the child sent. ``autopar plan``'s depth 3 is forked so
    after its localize pass: the child finishes it, this process goes on to depth 5."""

    def __init__(self):  # (nothing forked yet)
        self.pid = None
        self.pipe = None
        self._w: int | None = None

    @property
    def in_child(self) -> bool:
        return self._w is not None

    def split(self, *_) -> None:
        import torch

        if self.pid is not None or self.in_child:
            return  # (once)
        _preload()  # (as shared_heap: imported once, here; the objects frozen for the fork)
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the child: the caller's work goes on here (its objects stay frozen)
            os.close(r)
            self._w = w
            torch.set_num_threads(1)
            return
        gc.unfreeze()
        os.close(w)
        self.pid, self.pipe = pid, os.fdopen(r, "rb")
        raise Parted()

    def send(self, fn: Callable[[], object]) -> None:
        """In the child: ``fn()``'s value (or its error) sent to the parent, then the child leaves
        (never returns)."""
        try:
            payload = _payload(fn)
            with os.fdopen(self._w, "wb") as f:
                f.write(payload)
        finally:
            os._exit(0)

    def fail(self, error: BaseException) -> None:
        """In the child: ``error`` sent to the parent (which does the work itself), then the child leaves."""
        def raising():
            raise error
        self.send(raising)


def _send(f, data: bytes) -> None:
    """``data`` (pickled) as one message: its length, then itself."""
    f.write(len(data).to_bytes(8, "little") + data)
    f.flush()


def _receive(f):
    """The next object ``_send`` wrote, or EOFError where the other end has closed or died."""
    head = f.read(8)
    if len(head) < 8:
        raise EOFError
    data = f.read(int.from_bytes(head, "little"))
    if len(data) < int.from_bytes(head, "little"):
        raise EOFError
    return pickle.loads(data)


class Helper:
    """One forked copy of this process, started on first use, that serves ``serve(request)`` for
    one request after another until ``close()``: the planner's confirmations, each one's shallower
    compile there while the deeper one runs here. A child per call (``Forked``) starts from this
    process's state, but what it traces (the capture cache's captures and joint graphs, DTensor's
    answers) dies with it, and the next child traces it again; a helper keeps them. A request
    and its answer travel pickled through a pipe; ``serve`` is a closure the fork copied, so only
    the request's data travels. A helper that fails is closed and its request done here (``again``);
    the next ``side_by_side`` starts another. With no fork (``can_fork``), everything runs here."""

    def __init__(self, serve: Callable[[object], object]):
        self.serve = serve
        self.pid: int | None = None

    def _start(self) -> None:
        import torch

        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        with shared_heap():  # (the child stays inside it: this process's objects frozen there)
            pid = os.fork()
            if pid == 0:  # the child: serve until the parent closes its end (or exits, or dies)
                try:
                    os.close(req_w)
                    os.close(res_r)
                    torch.set_num_threads(1)
                    with os.fdopen(req_r, "rb") as requests, os.fdopen(res_w, "wb") as answers:
                        while True:
                            try:
                                request = _receive(requests)
                            except EOFError:
                                break
                            try:
                                answer = ("ok", self.serve(request))
                                data = pickle.dumps(answer)
                            except BaseException as e:  # noqa: BLE001 - sent to the parent, which does it itself
                                data = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
                            _send(answers, data)
                finally:
                    os._exit(0)
        os.close(req_r)
        os.close(res_w)
        self.pid, self.requests, self.answers = pid, os.fdopen(req_w, "wb"), os.fdopen(res_r, "rb")

    def side_by_side(self, request, mine: Callable[[], object], again: Callable[[], object]) -> tuple[object, object]:
        """``(serve(request), mine())``: ``serve`` in the helper while ``mine`` runs here; ``again()``
        here after ``mine`` where there is no helper or it failed (the helper is then closed)."""
        if self.pid is None and can_fork():
            self._start()
        sent = False
        if self.pid is not None:
            try:
                _send(self.requests, pickle.dumps(request))
                sent = True
            except Exception:  # noqa: BLE001 - the helper is gone, or the request does not pickle: done here
                self.close()
        try:
            here = mine()
        except BaseException:
            self.close()
            raise
        if sent:
            try:
                kind, value = _receive(self.answers)
            except Exception:  # noqa: BLE001 - EOFError: it died; or an answer this process cannot read
                kind, value = "error", "the helper process died"
            RESULTS["ok" if kind == "ok" else "failed"] += 1
            if kind == "ok":
                return value, here
            self.close()
        return again(), here

    def close(self) -> None:
        """Stop the helper (its requests' pipe closed, then killed: it may be mid-request)."""
        if self.pid is None:
            return
        for f in (self.requests, self.answers):
            with contextlib.suppress(OSError):
                f.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.pid = None

    def __enter__(self) -> Helper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def side_by_side(theirs: Callable[[], object], mine: Callable[[], object], again: Callable[[], object] | None = None,
                 fork: bool = True) -> tuple[object, object]:
    """``(theirs(), mine())``: ``theirs`` in a forked child while ``mine`` runs here, where this
    process can fork (and ``fork``); otherwise, or if the child failed, ``again()`` (default
    ``theirs()``) here after ``mine``. The child is killed if ``mine`` raises."""
    child = None
    if fork and can_fork():
        with shared_heap():
            child = Forked(theirs)
    try:
        here = mine()
    except BaseException:
        if child is not None:
            child.kill()
        raise
    if child is not None:
        with contextlib.suppress(RuntimeError):
            return child.result(), here
    return (again or theirs)(), here
