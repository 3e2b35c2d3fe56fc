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
