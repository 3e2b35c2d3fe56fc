"""autopar's Triton kernels through Triton's interpreter, for CPU tensors, without ``TRITON_INTERPRET``.

Triton picks compiled or interpreted once per ``@triton.jit`` function, when the decorator runs,
from ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``); that includes its standard library
(``tl.sum``, ``tl.max``, ``tl.cdiv``... are ``@jit`` functions decorated when ``triton.language`` is
first imported, and torch imports it early). Setting the variable from autopar would switch every
Triton kernel in the process, the user's too, and would not even work once torch had imported
Triton. So autopar leaves the environment alone and builds, on first use, an interpreted twin of
each kernel module (``interpreted(attention)``): the same source, every function rebound to a
private copy of the module's namespace in which

- each ``@triton.jit`` kernel is a ``triton.runtime.interpreter.InterpretedFunction`` of the same
  Python function (what ``triton.jit`` returns under ``TRITON_INTERPRET=1``);
- ``tl`` is a view of ``triton.language`` that hands out the standard library's ``@jit``
  functions as interpreted ones too (everything else is ``triton.language``'s own attribute, read
  at call time, so the interpreter's per-launch patching of ``tl``'s builtins is seen);
- ``INTERPRETED`` is True (the host code upcasts bf16 tiles there: the interpreter's bf16 dot
  is wrong).

The module itself keeps Triton's choice (compiled unless the user set ``TRITON_INTERPRET``), so
CUDA tensors take the compiled kernels. What is process-wide is what Triton's interpreter does
while one launch runs: it patches ``triton.language``'s builtins with interpreter versions. It
undoes the grid launch's patches, but not those of a nested call of another ``@jit`` function
(``tl.sum``, a helper: ``InterpretedFunction.__call__`` in triton 3.9), which left
``triton.language.core``'s builtins patched after the launch, so compiled Triton code in the
same process (a user's, on a GPU) would have traced interpreter builtins. Each launch of a twin
therefore restores every attribute of ``triton.language``'s modules and classes that it changed
(``_LeavesLanguageAsFound``; launches are serialised: the patching is process-wide while it lasts).
"""

from __future__ import annotations

import functools
import sys
import threading
import types

import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import KernelInterface

_LAUNCH = threading.Lock()


def _is_kernel(value) -> bool:
    """A ``@triton.jit`` function, compiled (JITFunction) or already interpreted."""
    return isinstance(value, KernelInterface) and callable(getattr(value, "fn", None))


class _InterpretedLanguage(types.ModuleType):
    """``triton.language`` as an interpreted kernel must see it: its ``@jit`` functions interpreted."""

    def __init__(self):
        super().__init__(tl.__name__)
        self._interpreted: dict[str, InterpretedFunction] = {}

    def __getattr__(self, name: str):
        value = getattr(tl, name)
        if not _is_kernel(value):
            return value  # read each time: the interpreter patches builtins for the length of a launch
        if name not in self._interpreted:
            self._interpreted[name] = InterpretedFunction(value.fn)
        return self._interpreted[name]


def _language_objects() -> list:
    """triton.language's modules and the classes they define: what the interpreter patches."""
    mods = [m for name, m in list(sys.modules.items())
            if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
    classes = {id(v): v for m in mods for v in vars(m).values()
               if isinstance(v, type) and v.__module__.startswith("triton.language")}
    return mods + list(classes.values())


def _restore(saved: list[tuple[object, dict]]) -> None:
    """Put back every attribute that existed before and now holds something else. Names the
    interpreter added (to a module's globals, for the functions it rewrote and caches) stay:
    compiled code never reads them."""
    for obj, before in saved:
        now = vars(obj)
        for name, value in before.items():
            if name in now and now[name] is not value:
                setattr(obj, name, value)


class OutOfBounds(IndexError):
    """An interpreted kernel's load or store reached past every tensor handed to the launch."""


def _ranges(values) -> list[tuple[int, int, str]]:
    """(first byte, end, what) of the storage of every tensor among a launch's arguments."""
    out = []
    for i, v in values:
        if isinstance(v, (tuple, list)):
            out += _ranges([(f"{i}[{j}]", x) for j, x in enumerate(v)])
        elif callable(getattr(getattr(v, "base", None), "untyped_storage", None)):  # a tensor descriptor
            out += _ranges([(f"{i} (descriptor)", v.base)])
        elif callable(getattr(v, "untyped_storage", None)):
            st = v.untyped_storage()
            out.append((st.data_ptr(), st.data_ptr() + st.nbytes(), f"argument {i} {list(v.shape)} {v.dtype}"))
    return out


class _Bounds:
    """For the length of one launch: every load and store the interpreter makes is checked to lie
    inside the storage of one of the launch's tensors, before it happens. Triton's interpreter
    reads and writes raw addresses (``triton/_C`` ``load`` / ``store``), so on CPU a wrong mask
    or stride writes into whatever the heap holds there: glibc aborts the process much later
    ("corrupted size vs. prev_size"), far from the kernel. Here it raises ``OutOfBounds`` naming
    the kernel, the access and the tensors, and nothing is written. It patches the interpreter's
    builder, which is process-wide, while the launch holds ``_LAUNCH`` (as the interpreter's own
    patching of ``triton.language`` is). A Triton whose interpreter has no such builder (checked on
    triton 3.9, the CPU venv's) runs the launch unchecked."""

    def __init__(self, name: str, ranges):
        import numpy as np
        from triton.runtime import interpreter as ti

        self.np, self.ti, self.name, self.ranges = np, ti, name, ranges

    def check(self, kind: str, ptrs, mask, itemsize: int) -> None:
        np = self.np
        p = ptrs.data if mask is None else ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
        if p.size == 0:
            return
        ok = np.zeros(p.shape, dtype=bool)
        for lo, hi, _ in self.ranges:
            ok |= (p >= lo) & (p <= hi - itemsize)
        if not ok.all():
            bad = int(p[~ok][0])
            near = min(self.ranges, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])))
            where = (f"{bad - near[1]} bytes past the end of {near[2]}" if bad >= near[1]
                     else f"{near[0] - bad} bytes before {near[2]}")
            raise OutOfBounds(f"autopar's Triton kernel {self.name} (interpreted) would {kind} {int((~ok).sum())} "
                              f"of {p.size} elements outside its tensors, e.g. {where}; nothing was "
                              f"{'read' if kind == 'load' else 'written'}")

    def __enter__(self):
        b = getattr(self.ti, "interpreter_builder", None)
        get_np = getattr(self.ti, "_get_np_dtype", None)
        self.active = b is not None and get_np is not None  # (another Triton's interpreter: unchecked)
        if not self.active:
            return self
        self.saved = b.__dict__.get("create_masked_load"), b.__dict__.get("create_masked_store")
        load, store = b.create_masked_load, b.create_masked_store

        def checked_load(ptrs, mask, other, *rest, **kw):  # (a descriptor's load passes its options by name)
            self.check("load", ptrs, mask, get_np(ptrs.get_element_ty()).itemsize)
            return load(ptrs, mask, other, *rest, **kw)

        def checked_store(ptrs, value, mask, *rest, **kw):
            self.check("store", ptrs, mask, value.data.dtype.itemsize)
            return store(ptrs, value, mask, *rest, **kw)

        b.create_masked_load, b.create_masked_store = checked_load, checked_store
        return self

    def __exit__(self, *exc):
        if not self.active:
            return
        b = self.ti.interpreter_builder
        for name, old in zip(("create_masked_load", "create_masked_store"), self.saved):
            if old is None:
                delattr(b, name)
            else:
                setattr(b, name, old)


class _LeavesLanguageAsFound(InterpretedFunction):
    """An interpreted kernel whose launch leaves ``triton.language`` as it found it, and whose
    loads and stores are checked against its tensors' bounds (``_Bounds``)."""

    def run(self, *args, **kwargs):
        import triton.runtime.interpreter as ti

        with _LAUNCH:
            saved = [(obj, dict(vars(obj))) for obj in _language_objects()]
            patch_tensor = getattr(ti, "_patch_lang_tensor", None)
            if patch_tensor is not None:
                ti._patch_lang_tensor = _squeezed_index(patch_tensor)
            try:
                with _Bounds(self.fn.__name__, _ranges(list(enumerate(args)) + list(kwargs.items()))):
                    return super().run(*args, **kwargs)
            finally:
                if patch_tensor is not None:
                    ti._patch_lang_tensor = patch_tensor
                _restore(saved)


def _squeezed_index(patch_tensor):
    """Triton's per-launch patch of ``tl.tensor`` with its interpreter's ``__index__`` made as Triton
    3.9's: a scalar argument is a one-element array there, and Triton 3.6 converted it with
    ``int(array)``, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"): every kernel with a runtime loop bound (``range(0, K, BLOCK_K)``) failed on the GPU
    machine's Triton 3.6 (2026-12-04). Set through Triton's own scope, so its restore undoes it."""
    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    return patched


def _rebind(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    """``fn`` with ``namespace`` as its globals (same code, defaults and closure)."""
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__annotations__ = dict(fn.__annotations__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return new


@functools.cache
def interpreted(module: types.ModuleType) -> types.SimpleNamespace:
    """The interpreted twin of a kernel module (built once per module): its public functions
    (``forward``, ``matmul``...) launch interpreted kernels, whatever Triton chose for ``module``."""
    namespace = dict(vars(module))
    # Triton's interpreter patches the real triton.language it finds among a kernel's globals
    namespace.update(tl=_InterpretedLanguage(), _triton_language=tl, INTERPRETED=True)
    for name, value in vars(module).items():
        if _is_kernel(value):
            namespace[name] = _LeavesLanguageAsFound(_rebind(value.fn, namespace))
        elif isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            namespace[name] = _rebind(value, namespace)
    return types.SimpleNamespace(**{k: v for k, v in namespace.items() if not k.startswith("__")})
