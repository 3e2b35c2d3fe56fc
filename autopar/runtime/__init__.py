"""The runtime: runs compiled per-rank programs on torch.distributed process groups."""

from autopar.runtime.module import CommCounter, ParallelModule, instrument

__all__ = ["CommCounter", "ParallelModule", "instrument"]
