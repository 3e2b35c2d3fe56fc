"""Where a traced node or tensor sits in the user's module tree: the few helpers every pass that
groups by block (split, twins, splice), the capture and the tensor-parallel analysis share, with
no import of any pass (tests/test_layout.py: no cycles, layers)."""

from __future__ import annotations

import re
from typing import Any

from torch import fx

BLOCK = re.compile(r"^((?:[^.]*\.)*?\d+)(\.|$)")  # the first list element on the path: layers.3, h.0, 3


def module_path(n: fx.Node) -> str:
    """The module path a torch-level node was traced in, as the model names it
    (``layers.0.self_attn``), whatever form dynamo wrote it in."""
    return stack_path(n.meta.get("nn_module_stack"))


def stack_path(st) -> str:
    """``module_path`` of a module stack (a node's ``nn_module_stack``, or a backward node's
    ``fwd_nn_module_stack``)."""
    if not st:
        return ""
    p = list(st.values())[-1][0]
    while "getattr(" in p:  # under functional_call (mixed precision): getattr(L['self'].model.layers, '0').mlp
        q = re.sub(r"getattr\(([^()]*?), '([^']*)'\)", r"\1.\2", p)
        if q == p:
            break
        p = q
    p = re.sub(r"^L\['self'\]\.model\.?", "", p)
    p = re.sub(r"^L\['self'\]\.?", "", p)
    p = re.sub(r"\[(\d+)\]", r".\1", p).replace("_modules['", "").replace("']", "")
    return p


def block_of(path: str) -> str:
    """``layers.3.mlp.w1`` -> ``layers.3``: the first element of a module list on the path ("" if none)."""
    m = BLOCK.match(path)
    return m.group(1) if m else ""


def get_attr(obj: Any, target: str):
    """``obj.a.b.c`` for target ``a.b.c``; None where a part is missing."""
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def tensor_names(module) -> dict[int, tuple[str, str]]:
    """``id`` of each parameter and buffer of ``module`` -> ``("param" | "buffer", its name)``
    (a tied tensor by its first name)."""
    names: dict[int, tuple[str, str]] = {}
    for n, p in module.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), ("param", n))
    for n, b in module.named_buffers(remove_duplicate=True):
        names.setdefault(id(b), ("buffer", n))
    return names
