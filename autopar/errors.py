"""autopar's errors: each names the problem, where it came from, and what to do."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class. ``where`` is the user's source line or parameter name when known."""

    def __init__(self, problem: str, *, where: str | None = None, fix: str | None = None):
        self.problem = problem
        self.where = where
        self.fix = fix
        parts = [problem]
        if where:
            parts.append(f"  where: {where}")
        if fix:
            parts.append(f"  what to do: {fix}")
        super().__init__("\n".join(parts))


class PlanError(AutoparError):
    """The plan, mesh or a rule in it is invalid (unknown strategy, unknown axis, bad glob)."""


class ShardingError(AutoparError):
    """A value cannot be sharded as asked (indivisible dimension, op with no rule)."""


class InputError(AutoparError):
    """A batch passed at run time contradicts the compiled program."""


class CaptureError(AutoparError):
    """The model could not be traced into a joint forward+backward graph."""


class TrainingError(AutoparError):
    """A training call cannot proceed as things are: no gradients yet, non-finite gradients,
    weights built on meta and not loaded yet."""
