"""The IR: a torch.fx graph whose every tensor value carries a ``ShardSpec``.

Where the pieces live on a node: ``node.meta["val"]`` holds FakeTensor(s) with the GLOBAL
shape (set by capture; the per-rank graph's nodes hold LOCAL ones); everything autopar adds is
one typed record, ``node.meta["autopar"]`` = ``NodeInfo`` (``info(node)``): the value's
``ShardSpec`` (propagate), the placements its op needs (propagate), the rule that decided, the
``CommRecord``s of a collective with its reason and source line (collectives, localize).
``check_invariants`` (global graphs) and ``check_local`` (per-rank graphs) enforce what each
pass promises (passes/README.md).
"""

from __future__ import annotations

import math
import operator
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


_UNSET = object()  # a node propagate has not reached yet


@dataclass
class NodeInfo:
    """Everything autopar records about one node, in one typed record: ``node.meta["autopar"]``
    (``info(node)``). Each field names the pass that sets it."""

    role: tuple | None = None  # autograd / capture: a placeholder's role, e.g. ("param", name)
    spec: object = _UNSET  # propagate: ShardSpec (a tuple of them for multi-output ops; None: no tensor)
    wants: list | None = None  # propagate: the placements each tensor input must have when the op runs
    rule: object = None  # propagate: the RuleResult that decided (its .name, its local .impl)
    seq_dim: object = None  # propagate, under a sequence-parallel strategy: the value's sequence dim
    #                         (int), "flat" (dim 0 is batch x sequence merged) or None (autopar/layout.py)
    why: str | None = None  # state: why this consumer needs its input's layout (becomes a reason)
    recomputed: str | None = None  # recompute: the forward node this backward copy recomputes
    reason: str | None = None  # collectives (redistribute nodes): why the move exists
    producer: str = ""  # collectives: source line of the op that produced the value moved
    comm: object = None  # collectives: predicted CommRecords (list); localize: a per-rank collective's CommRecord

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
    program: Program | None = None  # autograd: the joint graph; localize adds .local, the per-rank one
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
    options: object  # autopar.compiler.Options: the plan and every compile option, validated
    example_inputs: tuple  # the global example batch, as given
    micro_inputs: tuple  # one micro-batch of it: what capture traces
    gm: fx.GraphModule | None = None  # capture: the torch-level graph of model + loss
    masks: list = field(default_factory=list)  # masks: per attention mask, what was done and why (one line each)
    lowered: dict = field(default_factory=dict)  # lower: rewrites into kernel ops, per rule
    stages: list[Stage] = field(default_factory=list)  # split: the stages compiled on this rank
    specs: list = field(default_factory=list)  # split (pipelines): every stage's StageSpec
    # split: per tensor-parallel axis, the placements derived from ``gm`` (analysis/tensor_parallel.py)
    tp_derived: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)


def check_invariants(graph: fx.Graph, stage: str) -> None:
    """The IR's written-down invariants; the pass runner calls this between passes in debug mode."""
    graph.lint()
    for n in graph.nodes:
        if n.op == "output":
            continue
        if stage in ("propagate", "recompute", "state", "collectives"):
            if not info(n).has_spec:
                raise AssertionError(f"after {stage}: node {n.name} has no ShardSpec")
            spec = spec_of(n)
            val = n.meta.get("val")
            if isinstance(spec, ShardSpec) and isinstance(val, torch.Tensor):
                if tuple(val.shape) != spec.shape:
                    raise AssertionError(f"{n.name}: ShardSpec shape {spec.shape} != value {tuple(val.shape)}")
        if stage == "collectives" and n.op == "call_function" and info(n).wants is not None:
            for a, want in zip(tensor_args(n), info(n).wants):
                have = spec_of(a)
                if want is not None and have is not None and tuple(have.placements) != tuple(want):
                    raise AssertionError(
                        f"after collectives: {n.name} wants {fmt_placements(want)} for {a.name}, "
                        f"which is {fmt_placements(have.placements)}")
        if stage == "localize":
            target = n.target if n.op == "call_function" else None
            if target is not None and "_c10d_functional" in str(target) and "wait_tensor" not in str(target):
                users = list(n.users)
                if not any("wait_tensor" in str(u.target) for u in users):
                    raise AssertionError(f"collective {n.name} has no wait_tensor")
                if info(n).comm is None:
                    raise AssertionError(f"collective {n.name} has no CommRecord (why is it there?)")


def check_local(gm: fx.GraphModule, program: Program, axis_sizes, after: str) -> None:
    """The per-rank graph's invariants (debug mode, after localize and every later pass):

    - it lints; every ``_c10d_functional`` collective has a ``wait_tensor`` and a CommRecord;
    - every value has its LOCAL shape: placeholders, outputs, and the value each global node
      became (the last per-rank node traced for it, ``meta["custom"]["autopar_origin"]``) have the
      shape of that global value's ShardSpec on this rank. A global shape left behind (a view or an expand
      that kept its global size) fails here, naming the node and the user's line.
    """
    where = f"after {after}"
    gm.graph.lint()
    globals_ = {n.name: n for n in program.graph.nodes}
    g_ph = [n for n in program.graph.nodes if n.op == "placeholder"]
    g_out = next(n for n in program.graph.nodes if n.op == "output")
    for n in gm.graph.nodes:
        target = n.target if n.op == "call_function" else None
        if target is not None and "_c10d_functional" in str(target) and "wait_tensor" not in str(target):
            if not any("wait_tensor" in str(u.target) for u in n.users):
                raise AssertionError(f"{where}: collective {n.name} has no wait_tensor")
            if info(n).comm is None:
                raise AssertionError(f"{where}: collective {n.name} has no CommRecord (why is it there?)")
    pairs = []
    if len(g_ph) == len([n for n in gm.graph.nodes if n.op == "placeholder"]):
        pairs += zip([n for n in gm.graph.nodes if n.op == "placeholder"], g_ph)
    last: dict[str, fx.Node] = {}  # a global node's value is the last per-rank node traced for it
    for n in gm.graph.nodes:
        name = (n.meta.get("custom") or {}).get("autopar_origin", "")
        if n.op == "call_function" and name in globals_:
            last[name] = n
    for name, n in last.items():
        origin = globals_[name]
        if isinstance(spec_of(origin), ShardSpec) and n.target is not operator.getitem:
            pairs.append((n, origin))
    for n, origin in pairs:
        _check_local_value(n, n.meta.get("val"), spec_of(origin), axis_sizes, where, origin)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if len(out.args[0]) == len(g_out.args[0]):
        for o, g in zip(out.args[0], g_out.args[0]):
            if isinstance(o, fx.Node) and isinstance(g, fx.Node):
                _check_local_value(o, o.meta.get("val"), spec_of(g), axis_sizes, where, g)


def _check_local_value(n: fx.Node, val, spec, axis_sizes, where: str, origin: fx.Node) -> None:
    if isinstance(spec, (tuple, list)) and isinstance(val, (tuple, list)):
        for v, s in zip(val, spec):
            _check_local_value(n, v, s, axis_sizes, where, origin)
        return
    if not isinstance(spec, ShardSpec) or not isinstance(val, torch.Tensor):
        return
    want = spec.local_shape(axis_sizes)
    if tuple(val.shape) != tuple(want):
        shape = "the GLOBAL shape" if tuple(val.shape) == spec.shape else "shape"
        raise AssertionError(
            f"{where}: per-rank value {n.name} has {shape} {list(val.shape)}, but {origin.name} is "
            f"{spec} and a rank holds {list(want)} of it (at {source_line(origin) or 'unknown line'})")


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in a fixed order (flattening list args such as cat's)."""
    out = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, fx.Node))
    return out
