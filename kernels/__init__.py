"""Triton kernels and their PyTorch reference paths (see the kernels issue)."""
