"""The copy engine (TMA, Hopper and later) for the kernels' tiles: whether a tensor's tiles can be
fetched by it, and the host-side tensor descriptors (Triton's ``TensorDescriptor``) that the TMA
launch candidates take in place of pointers (kernels/attention.py, kernels/matmul.py).

A descriptor needs one contiguous dim, a 16-byte aligned base and every other stride a multiple of
16 bytes (what ``cuTensorMapEncodeTiled`` accepts); past the tensor's edges the engine reads zeros
and clips stores, so a kernel loading through one needs no masks. Triton's interpreter runs
descriptors too, so the CPU tests (tests/test_kernels.py) check the descriptor path of every
candidate."""

from __future__ import annotations

try:  # host-side tensor descriptors: Triton 3.4 and later
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton offers the pointer candidates only
    TensorDescriptor = None

_CAPABLE: dict = {}


def available(device) -> bool:
    """Whether launches on ``device`` may take descriptors: this Triton has them, and a CUDA device
    has the copy engine (compute capability 9 or later; asked once per device); CPU tensors run
    in Triton's interpreter, which has them."""
    if TensorDescriptor is None:
        return False
    if device.type != "cuda":
        return True
    if device.index not in _CAPABLE:
        import torch

        _CAPABLE[device.index] = torch.cuda.get_device_capability(device.index)[0] >= 9
    return _CAPABLE[device.index]


def aligned(*ts) -> bool:
    """Whether every one of ``ts`` starts on a 16-byte boundary: the one condition of ``fits`` that a
    call's shapes, strides and dtype do not fix, so a launch plan remembered by signature
    (kernels/tune.py ``Plans``) keys on it and runs ``fits`` only when it plans."""
    bits = 0
    for t in ts:  # (a loop, not a generator: this runs on every call, before its remembered plan)
        bits |= t.data_ptr()
    return bits % 16 == 0


def fits(t, contiguous_dims: tuple = (-1,)) -> bool:
    """Whether a descriptor can cover ``t``: one of ``contiguous_dims`` has stride 1, the base is
    16-byte aligned, and the stride of every other dim longer than one is a multiple of 16 bytes."""
    size = t.element_size()
    if t.data_ptr() % 16:
        return False
    inner = next((d % t.dim() for d in contiguous_dims if t.stride(d) == 1), None)
    if inner is None or (t.shape[inner] * size) % 16:
        return False
    return all((s * size) % 16 == 0 for d, (s, n) in enumerate(zip(t.stride(), t.shape)) if d != inner and n > 1)


def descriptor(t, box: tuple, transposed: bool = False):
    """A descriptor of ``t`` whose box (the tile one load fetches) is ``box``; ``transposed``: of
    the transpose of a 2-D ``t`` whose first dim is the contiguous one (then row-major). A dim of
    length one gets a placeholder stride: TMA wants a multiple of 16 bytes even where it is unused."""
    if transposed:
        return TensorDescriptor(t, [t.shape[1], t.shape[0]], [t.stride(1), 1], list(box))
    unit = max(1, 16 // t.element_size())
    strides = [s if n > 1 else unit for s, n in zip(t.stride()[:-1], t.shape[:-1])] + [1]
    return TensorDescriptor(t, list(t.shape), strides, list(box))
