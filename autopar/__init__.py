"""autopar: a declarative graph-rewriting compiler that parallelizes PyTorch training."""

# Importing autopar changes nothing outside it: no environment variables, no patched torch
# functions, no registrations on torch's own ops (tests/test_side_effects.py). What autopar needs
# from torch's globals it installs for the length of a compile step and removes after.
from autopar.compiler import compile  # noqa: A004 - the public name is compile
from autopar.errors import (AutoparError, CaptureError, InputError, MemoryBudgetError, PlanError, RankFailure,
                            ShardingError, StragglerWarning, TorchVersionError, TrainingError)
from autopar.mesh import mesh
from autopar.planner.api import PlanChoice, Plans, plan  # (the function; the module autopar/plan.py is the plan parser)
from autopar.runtime.checkpoint import CheckpointManager
from autopar.runtime.weights import init_empty_weights
from autopar.verify import VerifyReport, verify

__all__ = ["compile", "mesh", "plan", "Plans", "PlanChoice", "CheckpointManager", "init_empty_weights", "verify", "VerifyReport", "AutoparError",
           "PlanError", "MemoryBudgetError", "ShardingError", "InputError", "CaptureError", "TrainingError", "RankFailure",
           "StragglerWarning", "TorchVersionError"]
