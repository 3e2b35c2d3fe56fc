"""autopar: a declarative graph-rewriting compiler that parallelizes PyTorch training."""

from autopar.compiler import compile  # noqa: A004 - the public name is compile
from autopar.errors import AutoparError, CaptureError, InputError, PlanError, ShardingError
from autopar.mesh import mesh
from autopar.verify import VerifyReport, verify

__all__ = ["compile", "mesh", "verify", "VerifyReport", "AutoparError", "PlanError", "ShardingError", "InputError", "CaptureError"]
