"""Changes to torch's process-wide state that autopar needs only while one of its steps runs.

autopar leaves torch as it found it (tests/test_side_effects.py). Where a step cannot avoid a
process-wide change (a dispatcher registration, a module attribute DTensor reads), it makes the
change on entry and undoes it on exit, also when the step raises. Entries are counted, so nested
steps and steps in several threads share one change, undone when the last of them leaves; a
change that other threads can see while it is in place must therefore behave as torch's own
code for them (e.g. consult a ContextVar that only autopar's step sets).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any


@contextlib.contextmanager
def setting(var: ContextVar, value, *patches: "SharedPatch") -> Iterator[None]:
    """``var`` set to ``value`` in this context (thread / task) and each of ``patches`` applied,
    for the length of the block: the pairing every patch here needs (the change that other threads
    can see consults ``var``, which only this block sets)."""
    token = var.set(value)
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p())
            yield
    finally:
        var.reset(token)


class SharedPatch:
    """``with patch():`` applies ``apply()`` on the first entry and ``undo(what apply returned)``
    on the last exit."""

    def __init__(self, apply: Callable[[], Any], undo: Callable[[Any], None]):
        self._apply, self._undo = apply, undo
        self._lock = threading.Lock()
        self._users = 0
        self._token: Any = None

    @property
    def active(self) -> bool:
        return self._users > 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._token = self._apply()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    token, self._token = self._token, None
                    self._undo(token)


def _module_setattr_for_traces():
    import torch

    orig = torch.nn.Module.__setattr__

    def __setattr__(module, name, value):
        buffers = module.__dict__.get("_buffers")
        if torch.compiler.is_compiling() and buffers is not None and name in buffers \
                and isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            buffers[name] = value  # what Module does, its persistence unchanged
        else:
            orig(module, name, value)

    torch.nn.Module.__setattr__ = __setattr__
    return orig


def _undo_module_setattr(orig) -> None:
    import torch

    torch.nn.Module.__setattr__ = orig


# ``with buffer_assignments():`` (autopar/capture.py, around dynamo's capture): a tensor that code
# dynamo traces assigns to a buffer its module has already goes into ``_buffers`` as Module does.
# Module's own path reads ``value.persistent`` where the buffer was made as ``nn.Buffer``, which
# dynamo cannot trace ("Unsupported python_type() call"; CTRL assigns its position table again in
# forward). Public torch API only (so here, not in the torch boundary). The gate is
# ``torch.compiler.is_compiling()``, not a ContextVar, whose ``get`` dynamo cannot trace: eager
# code in any thread takes Module's own path; a dynamo trace in another thread in that window
# takes this one, which assigns what Module would (global buffer-registration hooks not run).
buffer_assignments = SharedPatch(_module_setattr_for_traces, _undo_module_setattr)


def _pause_collector():
    import gc

    was = gc.isenabled()
    gc.disable()
    return was


def _resume_collector(was) -> None:
    import gc

    if was:
        gc.enable()


# ``with paused_collector():`` Python's cyclic garbage collector off while a compile or an analysis
# traces (autopar/compiler.py ``build``, autopar/tools/explain.py). A trace makes objects by the
# million and keeps most of them to its end (graphs, nodes, fake tensors), so the collector's passes
# find little to free: they took 0.5-0.7 s of a 5.5 s `autopar plan` of Llama-3-8B; a second compile
# of llama-tiny on dp=2 x tp=2, 0.75 -> 0.62 s. What they would have freed is freed when the collector
# next runs (the peak grows by that: 22 MB in that plan). Counted like the patches above: nested or concurrent
# compiles share one pause, lifted when the last leaves, and only where the collector was on when
# the first entered. A forked child (depths compiled beside a process) inherits the pause.
paused_collector = SharedPatch(_pause_collector, _resume_collector)
