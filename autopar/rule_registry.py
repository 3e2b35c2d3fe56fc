"""The registry of autopar's own sharding rules (``RULES``: op -> rule) and the ``rule`` decorator
that fills it; autopar/rules.py and autopar/rules_parts.py both register here (autopar/rules.py
documents what a rule is)."""

from __future__ import annotations

from typing import Callable

RULES: dict[object, Callable] = {}


def rule(*ops):
    def register(fn):
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def norm_dim(dim: int, ndim: int) -> int:
    """``dim`` of a value with ``ndim`` dims, made non-negative."""
    return dim % ndim if ndim else 0
