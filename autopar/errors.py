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


class TorchVersionError(PlanError):
    """The running torch lacks a private torch feature that autopar needs for what was asked
    (autopar/torch_compat.py lists them, with the supported torch range)."""


class MemoryBudgetError(PlanError):
    """The cost model's predicted per-rank step peak exceeds ``autopar.compile(memory_budget=...)``:
    raised at compile time, before the parameters are distributed (autopar/analysis/budget.py)."""


class ShardingError(AutoparError):
    """A value cannot be sharded as asked (indivisible dimension, op with no rule)."""


class InternalCompilerError(AutoparError):
    """A bug in autopar, not in the model or plan: a pass left a program that breaks what it
    declares it guarantees (passes/checks.py, verified after every pass). The message names the
    pass, the check, the node and its source line, and what to report."""


class InputError(AutoparError):
    """A batch passed at run time contradicts the compiled program."""


class CaptureError(AutoparError):
    """The model could not be traced into a joint forward+backward graph."""


class TrainingError(AutoparError):
    """A training call cannot proceed as things are: no gradients yet, non-finite gradients,
    weights built on meta and not loaded yet."""


class RankFailure(AutoparError):
    """Another rank failed, stopped responding or timed out: raised on every other rank within
    seconds (autopar/runtime/failure.py; the rank whose own code raised mid-step gets its own
    exception, and this on any later call of the broken program). ``rank``: the rank that failed
    (None when unknown), ``error``: its exception's first line as that rank reported it,
    ``unusable``: True once collectives were under way (the process groups are abandoned; fix
    the cause and restart every rank, from the last checkpoint)."""

    def __init__(self, problem: str, *, rank: int | None = None, error: str = "", unusable: bool = True,
                 where: str | None = None, fix: str | None = None):
        self.rank = rank
        self.error = error
        self.unusable = unusable
        super().__init__(problem, where=where, fix=fix)


class StragglerWarning(UserWarning):
    """A rank computes consistently slower than the ranks running the same program, so they wait
    for it (autopar/runtime/steptimes.py: compile's ``straggler_threshold`` / ``straggler_window``)."""
