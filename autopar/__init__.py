"""autopar: a declarative graph-rewriting compiler that parallelizes PyTorch training."""

import os as _os

# Without an NVIDIA GPU, autopar's Triton kernels run through Triton's interpreter. Triton decides
# between compiled and interpreted functions when it is first imported (torch may import it
# early), so the switch is set here, before anything else, unless the user set it.
if not (_os.path.exists("/dev/nvidiactl") or _os.path.exists("/proc/driver/nvidia")):
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from autopar.compiler import compile  # noqa: A004 - the public name is compile
from autopar.errors import AutoparError, CaptureError, InputError, PlanError, ShardingError
from autopar.mesh import mesh
from autopar.verify import VerifyReport, verify

__all__ = ["compile", "mesh", "verify", "VerifyReport", "AutoparError", "PlanError", "ShardingError", "InputError", "CaptureError"]
