"""The verifier (passes/checks.py): every pass declares what it requires and guarantees; the
guarantees are checked after the pass on every compile (the cheap checks) and in debug mode
(all of them); a pass that breaks one is named in an InternalCompilerError; every check can fail."""

from __future__ import annotations

import dataclasses
import itertools
import operator

import pytest
import torch
from torch import fx
from torch.distributed.tensor import Replicate

import autopar
import autopar.passes as P
from autopar.errors import InternalCompilerError
from autopar.ir import NodeInfo, Program, ShardSpec, info
from autopar.models.llama import Llama, LlamaConfig, cross_entropy
from autopar.passes.checks import CHECKS, Broken

X = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
WAIT = torch.ops._c10d_functional.wait_tensor.default


def _build(mesh, plan, **kw):
    from autopar.compiler import build

    torch.manual_seed(0)
    return build(Llama(LlamaConfig(n_layers=1)), mesh, example_inputs=(X, X), loss_fn=cross_entropy, plan=plan, **kw)


def _break(monkeypatch, name: str, damage) -> None:
    """Replace pass ``name`` by itself followed by ``damage(program)`` (a per-stage pass)."""
    i = P.NAMES.index(name)
    p = P.PASSES[i]

    def broken(program, ctx, fn=p.stage_fn):
        program = fn(program, ctx)
        damage(program)
        return program

    passes = list(P.PASSES)
    passes[i] = dataclasses.replace(p, run=P.per_stage(name, broken), stage_fn=broken)
    monkeypatch.setattr(P, "PASSES", passes)


def _mm(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.target == torch.ops.aten.mm.default)


def test_verifier_runs_after_every_pass_without_debug(fake, monkeypatch):
    """Not only in debug mode: after each pass of the training compile, and after each per-stage
    pass of the eval forward program (run_stage_passes: generation's programs too)."""
    calls, stage_calls = [], []
    verify, verify_program = P.verify, P.verify_program

    def counted(state, after, names, debug):
        calls.append((after, names, debug))
        return verify(state, after, names, debug)

    def counted_program(program, ctx, after, names, debug, sync=None):
        stage_calls.append((after, names, debug))
        return verify_program(program, ctx, after, names, debug, sync=sync)

    monkeypatch.setattr(P, "verify", counted)
    monkeypatch.setattr(P, "verify_program", counted_program)
    with fake(dp=2) as mesh:
        pm = autopar.compile(Llama(LlamaConfig(n_layers=1)), mesh, example_inputs=(X, X), loss_fn=cross_entropy,
                             plan={"dp": "ddp"})
        pm(X)  # builds the eval forward program
    assert [c[0] for c in calls] == P.NAMES
    assert all(names == p.guarantees and debug is False for (_, names, debug), p in zip(calls, P.PASSES))
    eval_passes = [p.name for p in P.PASSES if p.stage_fn is not None and p.name != "recompute"]
    assert [c[0] for c in stage_calls] == [f"eval {n}" for n in eval_passes]
    assert pm.ctx.timings["verify"] > 0  # its cost is in the compile's timings (pm.report())


def test_declarations_chain_for_every_skip():
    """What each pass requires is what the pass run before it guarantees, whichever switchable
    passes are skipped; the runner refuses a chain that does not (InternalCompilerError)."""
    switchable = [p.name for p in P.PASSES if not p.required]
    for k in range(len(switchable) + 1):
        for skip in itertools.combinations(switchable, k):
            held: tuple = ()
            for p in P.PASSES:
                if p.name not in skip:
                    assert set(p.requires) <= set(held), (p.name, skip)
                    held = p.guarantees
    assert all(p.guarantees for p in P.PASSES)
    localize = P.PASSES[P.NAMES.index("localize")]
    with pytest.raises(InternalCompilerError, match="'localize' requires \\['placements'\\]"):
        P._requires(localize, P.PASSES[P.NAMES.index("state")].guarantees)


def _drop_a_wait(program):
    graph = program.local.graph
    wait = next(n for n in graph.nodes if n.target is WAIT)
    wait.replace_all_uses_with(wait.args[0])
    graph.erase_node(wait)


def _no_spec(program):
    info(_mm(program.graph)).spec = NodeInfo().spec


def _dangling(program):
    graph = program.local.graph
    mm = _mm(graph)
    with graph.inserting_after(mm):
        graph.call_function(torch.ops.aten.neg.default, (mm,))


def _wrong_wants(program):
    mm = _mm(program.graph)
    info(mm).wants = [tuple(Replicate() for _ in w) for w in info(mm).wants]


@pytest.mark.parametrize("name, damage, check, line", [
    ("localize", _drop_a_wait, "waited", None),
    ("propagate", _no_spec, "specs", "models/llama.py:"),
    ("overlap", _dangling, "local-no-dangling", "has no source line"),
    ("collectives", _wrong_wants, "placements", "models/llama.py:"),
])
def test_a_broken_pass_is_named(fake, monkeypatch, name, damage, check, line):
    _break(monkeypatch, name, damage)
    with fake(dp=2, tp=2) as mesh, pytest.raises(InternalCompilerError) as e:
        _build(mesh, {"dp": "fsdp", "tp": "megatron"}, debug=not CHECKS[check].cheap)
    msg = str(e.value)
    assert f"after pass '{name}', its guarantee '{check}'" in msg and "node " in msg, msg
    assert "bug in autopar" in msg and "please report" in msg
    if line:
        assert line in msg, msg


def _unread_copy(program):
    """What a rewrite that forgets to erase what it replaced leaves in the joint program: an op
    nothing reads, placed like the value it reads (a ShardSpec and wants: only no-dangling finds it)."""
    graph = program.graph
    mm = _mm(graph)
    with graph.inserting_after(mm):
        extra = graph.call_function(torch.ops.aten.neg.default, (mm,))
    extra.meta["val"] = mm.meta["val"]
    info(extra).spec = info(mm).spec
    info(extra).wants = [info(mm).spec.placements]


@pytest.mark.parametrize("name, damage, check", [
    ("propagate", _unread_copy, "no-dangling"),
    ("localize", _dangling, "local-no-dangling"),
])
def test_a_pass_leaving_an_unread_node_fails_without_debug(fake, monkeypatch, name, damage, check):
    """The dangling-node checks are always on (a walk, like the other cheap checks): a pass that
    leaves a node nothing reads fails the ordinary compile (debug=False), after that pass, naming
    the node; the same compile without the damage passes."""
    assert CHECKS[check].cheap
    plan = {"dp": "fsdp", "tp": "megatron"}
    with fake(dp=2, tp=2) as mesh:
        _build(mesh, plan, debug=False)
        _break(monkeypatch, name, damage)
        with pytest.raises(InternalCompilerError, match=f"after pass '{name}', its guarantee '{check}' .*node neg"):
            _build(mesh, plan, debug=False)


def test_the_full_checker_runs_in_debug_mode(fake, monkeypatch):
    """A per-rank value left at its global shape passes the cheap verifier (local-shapes costs
    more than a walk) and is caught, after the pass that did it, with debug=True."""
    def global_shape(program):
        origins = {n.name: n for n in program.graph.nodes}
        for n in program.local.graph.nodes:
            if n.target == torch.ops.aten.mm.default:
                spec = info(origins[n.meta["custom"]["autopar_origin"]]).spec
                if spec.local_shape((2, 2)) != spec.shape:  # (the dp=2, tp=2 mesh)
                    n.meta["val"] = n.meta["val"].new_empty(spec.shape)
                    return

    _break(monkeypatch, "overlap", global_shape)
    with fake(dp=2, tp=2) as mesh:
        _build(mesh, {"dp": "fsdp", "tp": "megatron"})
        with pytest.raises(InternalCompilerError, match="after pass 'overlap', its guarantee 'local-shapes'.*GLOBAL"):
            _build(mesh, {"dp": "fsdp", "tp": "megatron"}, debug=True)


def _fails(name, graph, program, ctx, match):
    with pytest.raises(Broken, match=match):
        CHECKS[name].run(graph, program, ctx)


def _hand_graph():
    """x -> relu -> neg -> output, for the checks on any graph."""
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    b = g.call_function(torch.neg, (a,))
    g.output(b)
    return g, a, b


def test_every_check_can_fail(fake):
    """Each check passes on a real compile's graphs and fails on a hand-broken one."""
    with fake(dp=2, tp=2) as mesh:
        state = _build(mesh, {"dp": "fsdp", "tp": "megatron"}, debug=True)
    st = state.stages[0]
    prog, ctx = st.program, st.ctx
    local = prog.local.graph
    graph_of = {"torch": st.gm.graph, "global": prog.graph, "local": local}
    for c in CHECKS.values():
        c.run(graph_of[c.on], prog, ctx)
    tried = set()
    # any graph: out of order, unlinted, dangling
    for kind in ("torch-", "", "local-"):
        g, a, b = _hand_graph()
        CHECKS[kind + "graph"].run(g, None, None)
        a.prepend(b)  # neg now reads relu before relu is defined
        _fails(kind + "graph", g, None, None, "not defined before it")
        _fails(kind + "lint", g, None, None, "lint")
        tried |= {kind + "graph", kind + "lint"}
        if kind == "torch-":  # (dynamo's graph keeps what the user's code computes and never reads)
            continue
        g, a, b = _hand_graph()
        CHECKS[kind + "no-dangling"].run(g, None, None)
        extra = g.call_function(torch.sigmoid, (a,))
        _fails(kind + "no-dangling", g, None, None, "dangling")
        info(extra).keep = True  # overlap's keep-alive alias: meant to be read by none
        CHECKS[kind + "no-dangling"].run(g, None, None)
        g.erase_node(extra)
        split = g.call_function(torch.ops.aten.split.Tensor, (a, 1))
        g.call_function(operator.getitem, (split, 0))  # an op none of whose outputs is read
        _fails(kind + "no-dangling", g, None, None, "dangling")
        tried.add(kind + "no-dangling")
    _fails("roles", prog.graph, dataclasses.replace(prog, inputs=prog.inputs[:-1]), ctx, "placeholders")
    mm = _mm(prog.graph)
    rec = info(mm)
    spec, wants = rec.spec, rec.wants
    rec.spec = NodeInfo().spec
    _fails("specs", prog.graph, prog, ctx, "has no ShardSpec")
    rec.spec = ShardSpec(spec.placements, spec.shape[:-1] + (spec.shape[-1] + 1,), spec.dtype)
    _fails("specs", prog.graph, prog, ctx, "global shape")
    rec.spec = spec
    rec.wants = None
    _fails("wants", prog.graph, prog, ctx, "no info\\(n\\).wants")
    rec.wants = [tuple(Replicate() for _ in w) for w in wants]
    _fails("placements", prog.graph, prog, ctx, "wants \\(R, R\\)")
    rec.wants = wants
    tried |= {"roles", "specs", "wants", "placements"}
    # the per-rank graph: an unexplained collective, one waited twice, one never, a global shape
    coll = next(n for n in local.nodes if info(n).comm is not None)
    comm, info(coll).comm = info(coll).comm, None
    _fails("explained", local, prog, ctx, "no CommRecord")
    info(coll).comm = comm
    wait = next(u for u in coll.users if u.target is WAIT)
    with local.inserting_after(wait):
        twice = local.call_function(WAIT, (coll,))
    _fails("waited", local, prog, ctx, "waited 2 times")
    local.erase_node(twice)
    origins = {n.name: n for n in prog.graph.nodes}
    lmm = next(n for n in local.nodes if n.target == torch.ops.aten.mm.default
               and info(origins[n.meta["custom"]["autopar_origin"]]).spec.local_shape(ctx.axis_sizes)
               != info(origins[n.meta["custom"]["autopar_origin"]]).spec.shape)
    val = lmm.meta["val"]
    lmm.meta["val"] = val.new_empty(info(origins[lmm.meta["custom"]["autopar_origin"]]).spec.shape)
    _fails("local-shapes", local, prog, ctx, "GLOBAL shape")
    lmm.meta["val"] = val
    wait.replace_all_uses_with(coll)
    local.erase_node(wait)
    _fails("waited", local, prog, ctx, "waited 0 times")
    tried |= {"explained", "waited", "local-shapes"}
    assert tried == set(CHECKS), set(CHECKS) - tried


def test_a_program_without_local_shapes_checks_only_what_it_has():
    """verify_program reads the per-rank graph only once there is one (before localize: none)."""
    g, _, _ = _hand_graph()
    prog = Program(graph=g, inputs=[("input", 0)], outputs=[("output", 0)])
    P.verify_program(prog, None, "test", ("graph", "no-dangling", "local-graph", "waited"), debug=True)
    with pytest.raises(InternalCompilerError, match="after pass 'test', its guarantee 'roles'"):
        P.verify_program(dataclasses.replace(prog, inputs=[]), None, "test", ("roles",), debug=False)
