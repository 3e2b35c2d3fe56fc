"""``autopar dump --passes`` (the pass list) and ``autopar dump --after PASS`` (the program as the
pass list leaves it after PASS): every stage's graph, one line per node, with what the passes
so far have attached to it: global shapes before localize, per-rank shapes after; placements;
collectives with kind, mesh axis, bytes and reason; the user's source line."""

from __future__ import annotations

import torch
from torch import fx

from autopar.ir import CompileState, ShardSpec, fmt_dtype, fmt_placements, info, source_line, spec_of
from autopar.kernels.choice import summary


def passes_text() -> str:
    from autopar.passes import PASSES
    from autopar.passes.checks import CHECKS

    lines = ["autopar's passes, in the order they run (switchable: may be named in skip_passes), each with the",
             "checks it requires on what it reads and guarantees on what it leaves; the guarantees are verified",
             "after the pass on every compile (* : only with debug=True, the full checker):", ""]
    for i, p in enumerate(PASSES, 1):
        lines.append(f"{i:2d}. {p.name:12s} {'(switchable) ' if not p.required else ''}{p.doc}")
        lines.append(f"    {'':12s} requires:   {', '.join(p.requires) or '(nothing: it starts from the model)'}")
        lines.append(f"    {'':12s} guarantees: {', '.join(c + ('' if CHECKS[c].cheap else '*') for c in p.guarantees)}")
    lines += ["", "the checks (passes/checks.py):"]
    width = max(len(c) for c in CHECKS) + 1
    lines += [f"  {c.name + ('' if c.cheap else '*'):{width}s} [{c.on}] {c.says}" for c in CHECKS.values()]
    return "\n".join(lines) + "\n"


def state_text(state: CompileState) -> str:
    o = state.options
    lines = [f"after pass '{state.done[-1]}' (passes run: {' -> '.join(state.done)})",
             f"mesh {dict(zip(state.mesh.mesh_dim_names, state.mesh.shape))}, plan {o.plan}", ""]
    lines += [f"masks: {m}" for m in state.masks]
    lines += [f"kernels='auto': {line}" for line in summary(state.kernel_choices)]
    if state.lowered:
        lines.append(f"lowered into kernel ops: {dict(state.lowered)}")
    if not state.stages:
        lines.append(f"torch-level graph of model + loss ({_count(state.gm.graph)} ops):")
        lines += _torch_lines(state.gm.graph)
        return "\n".join(lines) + "\n"
    for st in state.stages:
        head = f"stage {st.index}" + (f" ({st.spec.modules[0]} .. {st.spec.modules[1]})" if st.spec else "")
        sizes = st.ctx.axis_sizes
        head += f": {len(st.param_names)} parameters, mesh {dict(zip(st.ctx.axis_names, sizes))}"
        lines.append(head)
        if st.program is None:
            lines.append(f"  torch-level graph ({_count(st.gm.graph)} ops):")
            lines += ["  " + ln for ln in _torch_lines(st.gm.graph)]
        elif st.program.local is None:
            lines.append(f"  joint graph, GLOBAL shapes ({_count(st.program.graph)} ops):")
            lines += ["  " + ln for ln in _aten_lines(st.program.graph, st.program.inputs)]
        else:
            lines.append(f"  per-rank program, LOCAL shapes ({_count(st.program.local.graph)} ops):")
            lines += ["  " + ln for ln in _aten_lines(st.program.local.graph, st.program.inputs)]
        if st.sync is not None:
            lines.append(f"  gradient sync program, once per step ({_count(st.sync.local.graph)} ops):")
            lines += ["  " + ln for ln in _aten_lines(st.sync.local.graph, st.sync.inputs)]
        for name, part in st.parts.items():
            lines.append(f"  part {name}: {part.nodes} ops, reads {len(part.args)} values, hands on {len(part.outs)}")
        lines.append("")
    return "\n".join(lines) + "\n"


def _count(graph: fx.Graph) -> int:
    return sum(n.op not in ("placeholder", "output") for n in graph.nodes)


def _target(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) or str(t)


def _val(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{fmt_dtype(v.dtype)}{list(v.shape)}"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_val(x) for x in v) + ")"
    return ""


def _args(n: fx.Node) -> str:
    return ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in n.args if not isinstance(a, (list, tuple)))


def _torch_lines(graph: fx.Graph) -> list[str]:
    out = []
    for n in graph.nodes:
        if n.op == "output":
            continue
        v = _val(n.meta.get("example_value", n.meta.get("val")))
        src = source_line(n)
        out.append(f"  {n.name} = {_target(n)}({_args(n)})  {v}" + (f"   # {src}" if src else ""))
    return out


def _aten_lines(graph: fx.Graph, roles) -> list[str]:
    out = []
    role = iter(roles)
    for n in graph.nodes:
        if n.op == "output":
            continue
        v = _val(n.meta.get("val"))
        if n.op == "placeholder":
            kind, what = next(role, ("input", "?"))
            spec = spec_of(n)
            place = fmt_placements(spec.placements) if isinstance(spec, ShardSpec) else ""
            out.append(f"  {n.name}: {kind} {what}  {v}{place}")
            continue
        spec = spec_of(n)
        place = fmt_placements(spec.placements) if isinstance(spec, ShardSpec) else ""
        line = f"  {n.name} = {_target(n)}({_args(n)})  {v}{place}"
        rec = info(n)  # (a global graph's redistribute node: its predicted records; a per-rank collective: its own)
        recs = rec.predicted + ((rec.comm,) if rec.comm is not None else ())
        for r in recs:
            line += f"  [{r.kind} on {r.axis}, {r.payload_bytes:,} B: {r.reason}]"
        src = source_line(n)
        out.append(line + (f"   # {src}" if src else ""))
    return out
