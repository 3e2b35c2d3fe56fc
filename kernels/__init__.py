"""Triton kernels and their PyTorch reference paths.

- ``attention.py``: flash attention forward and backward (online softmax, causal or not, an
  additive mask, grouped-query heads, any head dim and sequence length, fp32 accumulation);
- ``matmul.py``: tiled matmul with a fused bias + GELU / SiLU epilogue, and its backward;
- ``ops.py``: both as ``torch.ops.autopar.*`` custom ops with autograd, fake implementations,
  FLOP formulas and a reference path (``ops.reference()`` / ``AUTOPAR_KERNELS=reference``).

``passes/lower.py`` rewrites models to use them (``autopar.compile(..., kernels="auto"|"on"|"off")``).
- ``interpreter.py``: the interpreted twins of the Triton modules that CPU tensors run on
  (Triton's interpreter, without setting ``TRITON_INTERPRET`` for the whole process).

Launch the Triton modules only through ``ops`` (it picks compiled or interpreted by device).
"""
