"""The runtime: runs compiled per-rank programs on torch.distributed process groups."""

from autopar.runtime.measure import CommMeter
from autopar.runtime.module import ParallelModule

__all__ = ["CommMeter", "ParallelModule"]
