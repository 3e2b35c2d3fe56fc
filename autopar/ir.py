"""The IR: a torch.fx graph whose every tensor value carries a ``ShardSpec``.

Where the pieces live on a node: ``node.meta["val"]`` holds FakeTensor(s) with the GLOBAL
shape (set by capture; the per-rank graph's nodes hold LOCAL ones); everything autopar adds is
one typed record, ``node.meta["autopar"]`` = ``NodeInfo`` (``info(node)``): the value's
``ShardSpec`` (propagate), the placements its op needs (propagate), the rule that decided, the
``CommRecord``s of a collective with its reason and source line (collectives, localize).
passes/checks.py verifies, after every pass, what that pass promises (passes/README.md).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autopar import torch_compat as tc


@dataclass(frozen=True)
class ShardSpec:
    """One placement per mesh axis plus the value's global shape and dtype."""

    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def local_shape(self, axis_sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The per-rank shape (evenly divisible shards; uneven ones are rejected earlier). A
        strided shard (DTensor's ``_StridedShard``, e.g. a view that merges a sharded dim with the
        dims after it) holds as many elements of its dim as a plain shard does."""
        shape = list(self.shape)
        for p, n in zip(self.placements, axis_sizes):
            if isinstance(p, (Shard, tc.StridedShard)):
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

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | shift (ring) | send (pipeline P2P) | local
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
    if kind in ("send", "broadcast", "shift", "all_to_all_v"):  # point to point between pipeline stages; a
        # root's broadcast; a ring shift (an all_to_all whose input goes to one peer: ring attention's K/V
        # blocks); expert parallelism's uneven all-to-alls (payload: what leaves the rank)
        return float(payload_bytes)
    return 0.0


def bytes_by_collective(records) -> dict[str, float]:
    """Ring bytes per rank per step, keyed "kind@axis" like the runtime's ``counter.summary()`` (CommMeter)."""
    out: dict[str, float] = {}
    for r in records:
        key = f"{r.kind}@{r.axis}"
        out[key] = out.get(key, 0.0) + r.wire_bytes
    return out


def redistribute(x, src, dst):  # pragma: no cover - a marker target, never executed directly
    """Graph marker: change ``x``'s placements from ``src`` to ``dst``. Lowered by localize."""
    raise RuntimeError("autopar.ir.redistribute is a graph marker; run the localize pass")


@dataclass
class RuleResult:
    """What a sharding rule decided for one op (autopar/rules.py, passes/propagate.py)."""

    inputs: list[tuple[Placement, ...]]  # one per tensor input (tensor_args order)
    outputs: tuple  # placements tuple, or a tuple of them for multi-output ops
    impl: Callable | None = None  # impl(ctx, *args with local tensors) -> local output(s)
    name: str = ""


class _Unset:
    """The spec of a node propagate has not reached yet (``NodeInfo.has_spec`` is False)."""

    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self):  # one object in every process (a program shared between ranks: autopar/trace_share.py)
        return "_UNSET"


_UNSET = _Unset()


@dataclass
class NodeInfo:
    """Everything autopar records about one node, in one typed record: ``node.meta["autopar"]``
    (``info(node)``). Each field names the pass that sets it. A global graph's collectives are
    ``predicted`` (on its redistribute nodes); a per-rank graph's are ``comm`` (one per collective)."""

    role: tuple | None = None  # autograd / capture: a placeholder's role, e.g. ("param", name)
    # propagate: ShardSpec (a tuple of them for multi-output ops; None: no tensor)
    spec: ShardSpec | tuple[ShardSpec | None, ...] | None | _Unset = _UNSET
    wants: list | None = None  # propagate: the placements each tensor input must have when the op runs
    rule: RuleResult | None = None  # propagate: the RuleResult that decided (its .name, its local .impl)
    seq_dim: int | str | None = None  # propagate, under a sequence-parallel strategy: the value's sequence
    #                                   dim (int), "flat" (dim 0 is batch x sequence merged) or None (autopar/layout.py)
    why: str | None = None  # state: why this consumer needs its input's layout (becomes a reason)
    recomputed: str | None = None  # recompute: the forward node this backward copy recomputes
    reason: str | None = None  # collectives (redistribute nodes): why the move exists
    producer: str = ""  # collectives: source line of the op that produced the value moved
    # collectives (global graphs, redistribute nodes): the CommRecords its lowering is predicted to issue
    predicted: tuple[CommRecord, ...] = ()
    comm: CommRecord | None = None  # localize (per-rank graphs): this collective's CommRecord
    keep: bool = False  # overlap: an alias that only keeps a collective's input alive until its wait (read by none)

    @property
    def has_spec(self) -> bool:
        return self.spec is not _UNSET


def info(node: fx.Node) -> NodeInfo:
    """The node's record, created empty on first use."""
    rec = node.meta.get("autopar")
    if rec is None:
        rec = node.meta["autopar"] = NodeInfo()
    return rec


def spec_of(node) -> ShardSpec | None:
    if not isinstance(node, fx.Node):
        return None
    rec = node.meta.get("autopar")
    return rec.spec if rec is not None and rec.has_spec else None


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
    local: fx.GraphModule | None = None  # localize: the per-rank program (None before it)
    recomputed: int = 0  # recompute: forward values the backward recomputes (the report counts them)


@dataclass
class Stage:
    """One SPMD program of the whole. A plan without a pipeline axis has one stage holding the
    whole model; a pipeline has one per stage (passes/split.py). The passes fill it in order."""

    index: int
    gm: fx.GraphModule  # split: the stage's torch-level graph (SPMD: the whole capture)
    example: tuple  # its global example inputs (one micro-batch)
    param_names: list[str]  # the user's names of the parameters it holds
    ctx: object = None  # split: the stage's Context (mesh or pipeline sub-mesh, plan, placements)
    spec: object = None  # split (pipelines): StageSpec, where its inputs come from and outputs go
    program: Program | None = None  # autograd: the joint graph; localize sets its .local, the per-rank one
    sync: Program | None = None  # schedule: gradients reduced once per step (accumulation, pipelines)
    parts: dict = field(default_factory=dict)  # schedule (pipelines): the F / I / W per-rank graphs
    ph_names: list[str] = field(default_factory=list)  # per program input: its placeholder's name
    out_names: list[str | None] = field(default_factory=list)  # per program output: node name (None: no value)
    ph_vals: dict = field(default_factory=dict)  # placeholder name -> its per-rank fake value
    saved_bytes: int = 0  # predicted: what one micro-batch's forward leaves for its backward
    saved_after_i: int = 0  # ... and what its input-gradient part leaves for its weight-gradient part
    prologue: object = None  # schedule (pipelines): the Part run once per step (passes/partition.py)
    prologue_bytes: int = 0  # predicted: what its outputs hold for the whole step
    twin_of: int | None = None  # split: the earlier stage whose program this one's is, renamed (passes/twins.py)


@dataclass
class CompileState:
    """The whole program as it moves through the pass list (passes/__init__.py): each pass reads
    what the earlier ones left and adds its part. ``done`` lists the passes run, in order."""

    model: object  # the user's nn.Module
    mesh: object  # the DeviceMesh
    options: object  # autopar.options.Options: every compile option as given and validated, what was derived
    example_inputs: tuple  # the global example batch, as given
    micro_inputs: tuple  # one micro-batch of it: what capture traces
    gm: fx.GraphModule | None = None  # capture: the torch-level graph of model + loss
    masks: list = field(default_factory=list)  # masks: per attention mask, what was done and why (one line each)
    value_checks: list = field(default_factory=list)  # capture: the model's asserts kept as device checks (source lines)
    lowered: dict = field(default_factory=dict)  # lower: rewrites into kernel ops, per rule
    kernel_choices: list = field(default_factory=list)  # lower, kernels="auto": kernels/choice.Choice per op
    stages: list[Stage] = field(default_factory=list)  # split: the stages compiled on this rank
    specs: list = field(default_factory=list)  # split (pipelines): every stage's StageSpec
    # split: per tensor-parallel axis, the placements derived from ``gm`` (analysis/tensor_parallel.py)
    tp_derived: dict = field(default_factory=dict)
    cuts: list = field(default_factory=list)  # split: fused weights cut into one parameter per part (autopar/unfuse.py)
    cut_notes: list = field(default_factory=list)  # split: cuts tried and given up, one line each
    timings: dict[str, float] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    from_disk: list = field(default_factory=list)  # the traces read from autopar/disk_cache.py, by kind


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in a fixed order (flattening list args such as cat's)."""
    out = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, fx.Node))
    return out


def kept_for_effect(n: fx.Node) -> bool:
    """A node nothing reads that is still meant to be there: an in-place update (a buffer's
    ``copy_``), a grad-mode switch (torch.fx's own notion of impure), or overlap's alias that
    keeps a collective's input alive until its wait (``info(n).keep``)."""
    rec = n.meta.get("autopar")
    return (rec is not None and rec.keep) or n.is_impure()


def drop_unread(graph: fx.Graph) -> int:
    """Remove the ops nothing reads: no user (or only unread ``getitem`` projections), not kept
    for an effect (torch.fx's impure ops: in-place and mutable ops, grad-mode switches;
    ``info(n).keep``), and not drawing random numbers (removing a draw would shift every later
    one). What a trace or a rewrite leaves behind (an unread view, torch.export's unused
    values); returns how many went."""
    dropped = 0
    for n in reversed(list(graph.nodes)):
        if n.op != "call_function":
            continue
        if any(u.users or u.target is not operator.getitem for u in n.users):
            continue
        if kept_for_effect(n) or torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            continue
        for u in list(n.users):
            graph.erase_node(u)
        graph.erase_node(n)
        dropped += 1
    return dropped
