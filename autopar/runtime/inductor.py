"""Compiled per-rank programs (``autopar.compile(..., inductor=True)``): each program's compute
compiled by Inductor (its C++ backend on CPU), its collectives, waits and every other opaque call
kept as Python calls in the same places, so the schedule the overlap pass made survives.

A per-rank program is cut, in its own node order, into runs of nodes Inductor may compile
(``segments``) and the nodes between them, which stay calls of the stitched program:

- the ``_c10d_functional`` collectives and ``wait_tensor`` (run by the guarded runtime,
  autopar/runtime/guarded.py: issued through the process group, waited in bounded slices);
- a gradient bucket's ``cat`` (reduced in place, its buffer kept from step to step: guarded.py);
- random ops and custom ops (``autopar::dropout_mask`` draws its mask from the step and the
  micro-batch the runtime sets: compiled, it would not see them; Inductor's own RNG is not
  torch's stream either), mutating ops and anything that is not an ATen op.

Because the cuts follow the node order, every collective is issued after the same compute as in
the uncompiled program and waited before the same compute: the overlap is the program's. A run
of views alone (no arithmetic) is not worth a call and stays uncompiled.

Each segment becomes a GraphModule with canonical node names, decomposed with Inductor's table
and compiled by ``compile_fx_inner`` on fake inputs of the local shapes and strides the program
recorded (``meta["val"]``). Segments with the same code and the same input shapes, strides and
dtypes (the repeated transformer block's) share one compiled function (``_COMPILED``), so the
compile time grows with the number of distinct segments, not with depth; Inductor's on-disk FX
graph cache makes a second process's compile of the same segment a cache read.

The stitched program keeps the boxed calling convention (autopar/runtime/executor.py): a
segment's arguments are packed into a list that the compiled function clears on entry, so the
stitched code drops each value after its last use, inside a segment too (a backward segment
frees the saved activations it has read).
"""

from __future__ import annotations

import operator
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import fx

from autopar import torch_compat as tc
from autopar.analysis.inductor_model import VIEWS as _VIEWS, boundary as _interface, opaque, segments as _segments

# which nodes stay Python calls (``opaque``) and how a program is cut into segments (``_segments``)
# are decided in autopar/analysis/inductor_model.py, so the cost model's Inductor memory and time
# follow exactly the segments compiled here
__all__ = ["InductorStats", "compile_program", "opaque"]

aten = torch.ops.aten


@dataclass
class InductorStats:
    """What compiling the programs did: ``segments`` compiled (calls of compiled code per run of
    the programs), ``distinct`` of them compiled by Inductor (the rest shared a compiled
    function), ``eager`` nodes left as Python calls (collectives, waits, random and custom ops,
    views between them), ``seconds`` spent compiling, and why segments were left uncompiled
    (``skipped``: reason -> count; a segment Inductor fails on runs op by op, with a warning)."""

    programs: int = 0
    segments: int = 0
    distinct: int = 0
    eager: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        skipped = "".join(f", {n} segment(s) left eager: {why}" for why, n in self.skipped.items())
        return (f"inductor: {self.segments} compiled segments in {self.programs} program(s) ({self.distinct} distinct, "
                f"the rest shared), {self.eager} nodes left as Python calls, {self.seconds:.1f}s compiling{skipped}")


_COMPILED: dict[tuple, object] = {}  # (segment code, input metadata) -> compiled function


def _is_tensor(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)


def _segment_module(run, inputs, outputs) -> fx.GraphModule:
    """The run as its own GraphModule, nodes named by position (identical blocks, identical code)."""
    g = fx.Graph()
    env = {}
    for i, a in enumerate(inputs):
        env[a] = g.placeholder(f"a{i}")
        env[a].meta["val"] = a.meta["val"]
    for i, n in enumerate(run):
        env[n] = g.node_copy(n, lambda a: env[a])
        env[n].name = f"n{i}"
        env[n].meta = {"val": n.meta.get("val")}
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def _inductor_api() -> tuple:
    """torch's private names this module compiles with (a TorchVersionError if this torch lacks one)."""
    return tc.compile_fx_inner, tc.select_decomp_table, tc.TracingContext, tc.tracing, tc.FakeTensorMode


def _compile(seg: fx.GraphModule, inputs: list[fx.Node], device, stats: InductorStats):
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    compile_fx_inner, select_decomp_table, TracingContext, tracing, FakeTensorMode = _inductor_api()  # noqa: N806
    vals = [a.meta["val"] for a in inputs]
    key = (seg.code, tuple((tuple(v.shape), tuple(v.stride()), v.dtype) for v in vals), str(device))
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit
    # static shapes; a shape env and a tracing context so that Inductor's FX graph cache is used
    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    fakes = [mode.from_tensor(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)) for v in vals]
    with mode, tracing(TracingContext(mode)):
        decomposed = make_fx(seg, decomposition_table=select_decomp_table(), tracing_mode="fake")(*fakes)
        fn = compile_fx_inner(decomposed, fakes)
    stats.distinct += 1
    _COMPILED[key] = fn
    return fn


def _pack(*args):
    """A compiled segment's arguments as the list it takes over (boxed: it clears the list)."""
    return list(args)


class _Segment:
    """A compiled segment as a call of the stitched program (fx names it by ``__name__``)."""

    def __init__(self, fn, index: int):
        self.fn = fn
        self.__name__ = f"segment_{index}"
        self.__module__ = __name__

    def __call__(self, args: list):
        return self.fn(args)


def compile_program(gm: fx.GraphModule, device, stats: InductorStats) -> fx.GraphModule:
    """``gm`` with its compute compiled: a new GraphModule whose nodes are the compiled segments'
    calls and the nodes left as Python calls, in ``gm``'s order; ``gm`` is left as it was."""
    t0 = time.perf_counter()
    _inductor_api()  # (before the loop below, which runs a segment uncompiled where compiling it fails)
    runs = []
    for run in _segments(gm):
        inputs, outputs = _interface(run)
        if all(n.target in _VIEWS for n in run) or not outputs:
            continue
        bad = [a for a in inputs + outputs if not _is_tensor(a)]
        if bad:
            why = "a value crossing its boundary is not a tensor"
            stats.skipped[why] = stats.skipped.get(why, 0) + 1
            continue
        try:
            fn = _compile(_segment_module(run, inputs, outputs), inputs, device, stats)
        except Exception as e:  # noqa: BLE001 - Inductor could not compile it: it runs op by op, said so
            why = f"Inductor failed on it ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
            stats.skipped[why] = stats.skipped.get(why, 0) + 1
            warnings.warn(f"autopar inductor=True: a segment of {len(run)} ops ({run[0].target} ... {run[-1].target}) "
                          f"runs uncompiled: {why}", stacklevel=2)
            continue
        runs.append((run, inputs, outputs, fn))
    first = {r[0][0]: r for r in runs}
    compiled = {n for r in runs for n in r[0]}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out_node = None
    for n in gm.graph.nodes:
        if n in first:
            run, inputs, outputs, fn = first[n]
            seg = _Segment(fn, stats.segments)
            stats.segments += 1
            pack = g.call_function(_pack, tuple(env[a] for a in inputs))
            call = g.call_function(seg, (pack,))
            for i, o in enumerate(outputs):
                env[o] = g.call_function(operator.getitem, (call, i))
                env[o].meta = dict(o.meta)
            continue
        if n in compiled:
            continue
        if n.op == "output":
            out_node = n
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op == "call_function":
            stats.eager += 1
    g.output(fx.map_arg(out_node.args[0], lambda a: env[a]), type_expr=getattr(out_node, "type", None))
    out = fx.GraphModule(gm, g)
    stats.programs += 1
    stats.seconds += time.perf_counter() - t0
    return out
