"""What a pass requires and guarantees, as named checks, and the verifier that runs them.

Every ``Pass`` (passes/__init__.py) declares ``requires`` (the checks that must hold on what it
reads) and ``guarantees`` (the checks that hold on what it leaves), by name from ``CHECKS``;
``autopar dump --passes`` prints both. After every pass, ALWAYS (not only in debug mode), the
runner calls ``verify`` with the pass's guarantees: the cheap checks run on every compile (a
linear walk over each graph, about 1% of a compile); ``debug=True`` adds the full ones
(``Check.cheap=False``: ``graph.lint()``, every per-rank value's shape against its global
node's ShardSpec). A check that fails raises ``InternalCompilerError`` naming the pass, the
check, the node, its source line and what is wrong: a bug in autopar, never the user's.

A check reads one kind of graph: ``torch`` (the torch-level graph: ``state.gm`` before
``split``, each stage's after it), ``global`` (each stage's joint program, global shapes, and its
gradient-sync program) or ``local`` (their per-rank programs, ``program.local``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from autopar.errors import InternalCompilerError
from autopar.ir import Program, ShardSpec, fmt_placements, info, kept_for_effect, redistribute, source_line, spec_of, tensor_args


class Broken(Exception):
    """A check's finding: the node and what is wrong with it (``verify`` turns it into an
    ``InternalCompilerError`` that names the pass)."""

    def __init__(self, node: fx.Node | None, what: str):
        self.node, self.what = node, what
        super().__init__(what)


@dataclass(frozen=True)
class Check:
    name: str
    says: str  # what holds, in one line (``autopar dump --passes``)
    on: str  # "torch" | "global" | "local": the graphs it reads
    run: Callable[[fx.Graph, "Program | None", object], None]  # (graph, its Program, ctx); raises Broken
    cheap: bool = True  # False: debug mode only (it costs more than a linear walk)


# ---- the checks ---------------------------------------------------------------------------

def _is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and _ns(n) == "_c10d_functional" and not _is_wait(n)


def _is_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and _ns(n) == "_c10d_functional" and "wait_tensor" in str(n.target)


def _ns(n: fx.Node) -> str:
    return getattr(n.target, "namespace", "")


def check_no_dangling(graph: fx.Graph, program, ctx) -> None:
    """A node nothing reads, that is no placeholder, output or effect, is dangling; a ``getitem``
    is a multi-output op's projection: unread, it costs nothing, but an op none of whose
    projections is read is dangling."""
    for n in graph.nodes:
        if n.op in ("placeholder", "output", "get_attr") or n.target is operator.getitem:
            continue
        if n.users and not all(u.target is operator.getitem and not u.users for u in n.users):
            continue
        if not kept_for_effect(n):
            raise Broken(n, "is read by no node, is no output and has no side effect (a dangling node: a "
                            "pass left behind what it replaced)")


def check_topological(graph: fx.Graph, program, ctx) -> None:
    """Cheap part of lint: every input defined before its use, in this graph, exactly one output last."""
    seen: set[fx.Node] = set()
    last = None
    for n in graph.nodes:
        for a in n.all_input_nodes:
            if a not in seen:
                raise Broken(n, f"reads {a.name}, which is not defined before it in this graph")
        seen.add(n)
        last = n
    if last is None or last.op != "output":
        raise Broken(last, "the graph does not end with its output node")


def check_lint(graph: fx.Graph, program, ctx) -> None:
    try:
        graph.lint()
    except Exception as e:  # torch's lint raises RuntimeError / AssertionError with its own message
        raise Broken(None, f"graph.lint(): {e}") from None


def check_roles(graph: fx.Graph, program, ctx) -> None:
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(phs) != len(program.inputs):
        raise Broken(phs[0] if phs else None,
                     f"the graph has {len(phs)} placeholders but the program names {len(program.inputs)} inputs")
    out = _output(graph)
    if len(out.args[0]) != len(program.outputs):
        raise Broken(out, f"the graph has {len(out.args[0])} outputs but the program names {len(program.outputs)}")


def _output(graph: fx.Graph) -> fx.Node:
    return next(iter(reversed(graph.nodes)))  # torch 2.11's reversed node list is iterable, not an iterator


def check_specs(graph: fx.Graph, program, ctx) -> None:
    for n in graph.nodes:
        if n.op == "output":
            continue
        rec = n.meta.get("autopar")
        if rec is None or not rec.has_spec:
            raise Broken(n, "has no ShardSpec (info(n).spec was never set)")
        spec, val = rec.spec, n.meta.get("val")
        if isinstance(spec, ShardSpec) and isinstance(val, torch.Tensor) and tuple(val.shape) != spec.shape:
            raise Broken(n, f"its ShardSpec's global shape {list(spec.shape)} is not its value's {list(val.shape)}")


def check_wants(graph: fx.Graph, program, ctx) -> None:
    for n in graph.nodes:
        if n.op == "call_function" and n.target not in (operator.getitem, redistribute) and info(n).wants is None:
            raise Broken(n, "has no info(n).wants: the placements its inputs need were never decided")


def check_placements(graph: fx.Graph, program, ctx) -> None:
    for n in graph.nodes:
        if n.op not in ("call_function", "output"):
            continue
        rec = n.meta.get("autopar")
        wants = rec.wants if rec is not None else None
        if wants is None:
            continue
        # (the output's wants are one per output, None where an output is not a value: a frozen
        # parameter's gradient; an op's are one per tensor argument)
        args = list(n.args[0]) if n.op == "output" else tensor_args(n)
        for a, want in zip(args, wants):
            have = spec_of(a) if isinstance(a, fx.Node) else None
            if want is not None and isinstance(have, ShardSpec) and tuple(have.placements) != tuple(want):
                raise Broken(n, f"wants {fmt_placements(want)} for {a.name}, which is "
                                f"{fmt_placements(have.placements)} (no redistribute between them)")


def check_waited(graph: fx.Graph, program, ctx) -> None:
    for n in graph.nodes:
        if _is_collective(n):
            waits = sum(_is_wait(u) for u in n.users)
            if waits != 1:
                raise Broken(n, f"collective {n.target} is waited {waits} times (wait_tensor users), not once")


def check_explained(graph: fx.Graph, program, ctx) -> None:
    for n in graph.nodes:
        if _is_collective(n) and info(n).comm is None:
            raise Broken(n, f"collective {n.target} has no CommRecord (why is it there?)")


def check_local_shapes(graph: fx.Graph, program, ctx) -> None:
    """Every value has its LOCAL shape: placeholders, outputs, and the value each global node
    became (the last per-rank node traced for it, ``meta["custom"]["autopar_origin"]``) have the
    shape of that global value's ShardSpec on this rank. A global shape left behind (a view or an
    expand that kept its global size) fails here, naming the node and the user's line."""
    axis_sizes = ctx.axis_sizes
    globals_ = {n.name: n for n in program.graph.nodes}
    g_ph = [n for n in program.graph.nodes if n.op == "placeholder"]
    l_ph = [n for n in graph.nodes if n.op == "placeholder"]
    pairs = list(zip(l_ph, g_ph)) if len(g_ph) == len(l_ph) else []
    last: dict[str, fx.Node] = {}  # a global node's value is the last per-rank node traced for it
    for n in graph.nodes:
        custom = n.meta.get("custom")
        name = custom.get("autopar_origin", "") if custom else ""
        if n.op == "call_function" and name in globals_:
            last[name] = n
    for name, n in last.items():
        origin = globals_[name]
        if isinstance(spec_of(origin), ShardSpec) and n.target is not operator.getitem:
            pairs.append((n, origin))
    out, g_out = _output(graph), _output(program.graph)
    if len(out.args[0]) == len(g_out.args[0]):
        pairs += [(o, g) for o, g in zip(out.args[0], g_out.args[0])
                  if isinstance(o, fx.Node) and isinstance(g, fx.Node)]
    for n, origin in pairs:
        _local_value(n, n.meta.get("val"), spec_of(origin), axis_sizes, origin)


def _local_value(n: fx.Node, val, spec, axis_sizes, origin: fx.Node) -> None:
    if isinstance(spec, (tuple, list)) and isinstance(val, (tuple, list)):
        for v, s in zip(val, spec):
            _local_value(n, v, s, axis_sizes, origin)
        return
    if not isinstance(spec, ShardSpec) or not isinstance(val, torch.Tensor):
        return
    want = spec.local_shape(axis_sizes)
    if tuple(val.shape) != tuple(want):
        shape = "the GLOBAL shape" if tuple(val.shape) == spec.shape else "shape"
        raise Broken(n, f"per-rank value {n.name} has {shape} {list(val.shape)}, but {origin.name} is {spec} and "
                        f"a rank holds {list(want)} of it (at {source_line(origin) or 'unknown line'})")


CHECKS: dict[str, Check] = {c.name: c for c in [
    Check("torch-graph", "the torch-level graph: every input defined before its use, one output, last",
          "torch", check_topological),
    Check("torch-lint", "the torch-level graph passes graph.lint()", "torch", check_lint, cheap=False),
    Check("roles", "every placeholder and output of the joint program has a role", "global", check_roles),
    Check("graph", "the joint program: every input defined before its use, one output, last", "global",
          check_topological),
    Check("lint", "the joint program passes graph.lint()", "global", check_lint, cheap=False),
    # (always on: a linear walk; ir.drop_unread removes what traces leave, at propagate's start and
    # after localize, and every pass erases what it replaces or leaves unread itself)
    Check("no-dangling", "no dangling node in the joint program: each is read, an output, or kept for its "
          "effect", "global", check_no_dangling),
    Check("specs", "every node has a ShardSpec (None for non-tensors) whose global shape is its value's",
          "global", check_specs),
    Check("wants", "every op (but getitem and redistribute) has the placements its "
          "inputs need (info(n).wants)",
          "global", check_wants),
    Check("placements", "placements agree with wants: every input of every op and of the output has the "
          "placements its consumer wants", "global", check_placements),
    Check("local-graph", "the per-rank program: every input defined before its use, one output, last", "local",
          check_topological),
    Check("local-lint", "the per-rank program passes graph.lint()", "local", check_lint, cheap=False),
    Check("local-no-dangling", "no dangling node in the per-rank program", "local", check_no_dangling),
    Check("waited", "every collective is waited exactly once (one wait_tensor user)", "local", check_waited),
    Check("explained", "every collective has a CommRecord (kind, axis, bytes, reason, source line)", "local",
          check_explained),
    Check("local-shapes", "every per-rank value has the LOCAL shape its global node's ShardSpec gives one rank",
          "local", check_local_shapes, cheap=False),
]}


# what each kind of program keeps true, as passes declare it: the torch-level graph, the joint
# program at global shapes (before and after propagate placed it), the per-rank program
# (no dangling-node check on the torch-level graph: dynamo keeps what the user's code computes and
# never reads, e.g. transformers' masking_utils ``head_arange``; autograd's joint graph drops it)
TORCH = ("torch-graph", "torch-lint")
JOINT = ("roles", "graph", "lint", "no-dangling")
PLACED = JOINT + ("specs", "wants")
LOCAL = ("local-graph", "local-lint", "local-no-dangling", "waited", "explained", "local-shapes")


# ---- the verifier ---------------------------------------------------------------------------

def graphs(stage_program: Program | None, sync: Program | None, on: str):
    """The (graph, program) pairs of one stage that a check ``on`` kind of graph reads."""
    for prog in (stage_program, sync):
        if prog is None:
            continue
        if on == "global":
            yield prog.graph, prog
        elif on == "local" and prog.local is not None:
            yield prog.local.graph, prog


def verify_program(program: Program, ctx, after: str, names, debug: bool, sync: Program | None = None) -> None:
    """Run the checks ``names`` (a pass's guarantees) on one stage's programs: the cheap ones
    always, every one in debug mode."""
    for name in names:
        check = CHECKS[name]
        if check.on == "torch" or not (check.cheap or debug):
            continue
        for graph, prog in graphs(program, sync, check.on):
            _run(check, graph, prog, ctx, after)


def verify(state, after: str, names, debug: bool) -> None:
    """After pass ``after``: its guarantees ``names`` on every graph of ``state`` they are about."""
    torch_checks = [CHECKS[n] for n in names if CHECKS[n].on == "torch" and (CHECKS[n].cheap or debug)]
    if torch_checks:
        gms = [st.gm for st in state.stages] if state.stages else [state.gm]
        for gm in gms:
            for check in torch_checks:
                _run(check, gm.graph, None, None, after)
    for st in state.stages:
        if st.program is not None:
            verify_program(st.program, st.ctx, after, names, debug, sync=st.sync)


def _run(check: Check, graph: fx.Graph, program, ctx, after: str) -> None:
    try:
        check.run(graph, program, ctx)
    except Broken as b:
        raise broken(after, check, b.node, b.what) from None


def broken(after: str, check: Check, node: fx.Node | None, what: str) -> InternalCompilerError:
    """The error for a check that failed after pass ``after``."""
    where = None
    if node is not None:
        where = source_line(node) or f"node {node.name} has no source line (a node autopar made)"
    named = f"node {node.name}: " if node is not None else ""
    return InternalCompilerError(
        f"internal compiler error: after pass '{after}', its guarantee '{check.name}' ({check.says}) does not "
        f"hold: {named}{what}", where=where,
        fix="this is a bug in autopar, not in your model or plan: please report it with this message, the plan "
            "and mesh, and the output of `autopar dump MODEL --mesh ... --plan ... --after PASS` for the pass "
            "named above (or the model's code); compiling with debug=True runs every check and may name an "
            "earlier cause")
