"""The IR: a torch.fx graph whose every tensor value carries a ``ShardSpec``.

Where the pieces live on a node (the invariants ``check_invariants`` enforces):

- ``node.meta["val"]``: FakeTensor(s) with the GLOBAL shape (set by the front end);
- ``node.meta["autopar"]``: the value's ``ShardSpec`` (or a tuple of them, ``None`` for
  non-tensors), set by ``propagate`` on every node;
- ``node.meta["autopar_in"]``: the placements each tensor input must have when the op runs,
  set by ``propagate`` for call_function nodes; after ``collectives`` runs they equal the
  producers' placements (every mismatch got a redistribute node);
- redistribute nodes (target ``redistribute``) carry ``node.meta["autopar_comm"]``: a
  ``CommRecord`` per collective step (kind, mesh axis, bytes per rank, reason, source line).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard


@dataclass(frozen=True)
class ShardSpec:
    """One placement per mesh axis plus the value's global shape and dtype."""

    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def local_shape(self, axis_sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The per-rank shape (evenly divisible shards; uneven ones are rejected earlier)."""
        shape = list(self.shape)
        for p, n in zip(self.placements, axis_sizes):
            if isinstance(p, Shard):
                shape[p.dim] = math.ceil(shape[p.dim] / n)
        return tuple(shape)

    def __str__(self) -> str:
        return f"{fmt_dtype(self.dtype)}{list(self.shape)}{fmt_placements(self.placements)}"


def fmt_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
            torch.int64: "i64", torch.int32: "i32", torch.bool: "b8"}.get(dtype, str(dtype))


def fmt_placement(p: Placement) -> str:
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return str(p)


def fmt_placements(ps) -> str:
    return "(" + ", ".join(fmt_placement(p) for p in ps) + ")"


@dataclass
class CommRecord:
    """One collective the program performs, with why it is there."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send (pipeline P2P) | local (no comm)
    axis: str  # mesh axis name
    group_size: int
    payload_bytes: int  # size of the tensor handed to the collective on this rank
    reason: str
    source: str  # user source line ("file:line  code") or "" when unknown
    phase: str = "forward"  # forward | backward
    node: str = ""  # the per-rank graph node name once localized
    producer: str = ""  # source line of the op that produced the value being moved

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends in a ring implementation (the cost model's figure)."""
        return ring_bytes(self.kind, self.payload_bytes, self.group_size)


def ring_bytes(kind: str, payload_bytes: int, n: int) -> float:
    """Per-rank bytes sent by ring collectives.

    all_reduce 2(N-1)/N·D; reduce_scatter (N-1)/N·D with D the input; all_gather (N-1)·d
    with d the per-rank input (= (N-1)/N of the output); all_to_all (N-1)/N·D.
    """
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * payload_bytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n * payload_bytes
    if kind == "all_gather":
        return (n - 1) * payload_bytes
    if kind in ("send", "broadcast"):  # point to point between pipeline stages; a root's broadcast
        return float(payload_bytes)
    return 0.0


def bytes_by_collective(records) -> dict[str, float]:
    """Ring bytes per rank per step, keyed "kind@axis" like the runtime's CommCounter.summary()."""
    out: dict[str, float] = {}
    for r in records:
        key = f"{r.kind}@{r.axis}"
        out[key] = out.get(key, 0.0) + r.wire_bytes
    return out


def redistribute(x, src, dst):  # pragma: no cover - a marker target, never executed directly
    """Graph marker: change ``x``'s placements from ``src`` to ``dst``. Lowered by localize."""
    raise RuntimeError("autopar.ir.redistribute is a graph marker; run the localize pass")


def spec_of(node) -> ShardSpec | None:
    return node.meta.get("autopar") if isinstance(node, fx.Node) else None


def source_line(node: fx.Node) -> str:
    """The innermost user frame of the node's stack trace, as 'file:line  code'."""
    st = node.meta.get("stack_trace")
    if not st:
        return ""
    lines = st.strip().splitlines()
    frames = []
    for i, ln in enumerate(lines):
        s = ln.strip()
        if s.startswith('File "'):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append((s, code))
    user = [f for f in frames if "/torch/" not in f[0] and "functional_export" not in f[0]]
    if not user:
        return ""
    loc, code = user[-1]
    path = loc.split('"')[1]
    lineno = loc.split("line ")[1].split(",")[0]
    short = "/".join(path.split("/")[-2:])
    return f"{short}:{lineno}  {code}"


def phase_of(node: fx.Node) -> str:
    tag = node.meta.get("partitioner_tag")
    return "backward" if tag == "is_backward" else "forward"


@dataclass
class Program:
    """A captured program: the graph plus what its placeholders and outputs mean."""

    graph: fx.Graph
    # per placeholder, in order: ("param", name) | ("buffer", name) | ("input", idx) | ("tangent", i)
    # (a pipeline stage's tangent i is the gradient of its output i)
    inputs: list[tuple[str, object]]
    # per output, in order: ("loss", i) | ("output", i) | ("grad", param_name) | ("none", None);
    # a pipeline stage's program also has ("act", i): activation i sent to later stages, and
    # ("input_grad", i): the gradient of its input i, sent back to the stage that produced it
    outputs: list[tuple[str, object]]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def check_invariants(graph: fx.Graph, stage: str) -> None:
    """The IR's written-down invariants; the pass runner calls this between passes in debug mode."""
    graph.lint()
    for n in graph.nodes:
        if n.op == "output":
            continue
        if stage in ("propagate", "recompute", "state", "collectives"):
            if "autopar" not in n.meta:
                raise AssertionError(f"after {stage}: node {n.name} has no ShardSpec")
            spec = n.meta["autopar"]
            val = n.meta.get("val")
            if isinstance(spec, ShardSpec) and isinstance(val, torch.Tensor):
                if tuple(val.shape) != spec.shape:
                    raise AssertionError(f"{n.name}: ShardSpec shape {spec.shape} != value {tuple(val.shape)}")
        if stage == "collectives" and n.op == "call_function" and "autopar_in" in n.meta:
            for a, want in zip(tensor_args(n), n.meta["autopar_in"]):
                have = spec_of(a)
                if want is not None and have is not None and tuple(have.placements) != tuple(want):
                    raise AssertionError(
                        f"after collectives: {n.name} wants {fmt_placements(want)} for {a.name}, "
                        f"which is {fmt_placements(have.placements)}")
        if stage == "localize":
            target = collective_op(n.target) if n.op == "call_function" else None
            if target is not None and "_c10d_functional" in str(target) and "wait_tensor" not in str(target):
                users = list(n.users)
                if not any("wait_tensor" in str(u.target) for u in users):
                    raise AssertionError(f"collective {n.name} has no wait_tensor")
                if "autopar_comm" not in n.meta:
                    raise AssertionError(f"collective {n.name} has no CommRecord (why is it there?)")


def collective_op(target):
    """The functional collective behind a call target (the runtime wraps them to count bytes)."""
    return getattr(target, "_autopar_collective", target)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in a fixed order (flattening list args such as cat's)."""
    out = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, fx.Node))
    return out
