"""Renderers of an ``Analysis`` (autopar/tools/explain.py): the ``dump`` text / JSON / DOT / SVG
views of the per-rank program, the ``plan`` table and the ``explain`` text."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field

import torch
from autopar.ir import info, spec_of


@dataclass
class Analysis:
    model: str
    axes: dict[str, int]
    plan: dict
    rank: int
    coord: tuple
    options: dict
    pm: object
    memory: dict
    time: object
    device: object
    links: dict
    seconds: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    n_params: int = 0
    extrapolated: dict | None = None  # the summary carried from depths 3-5 to the model's (tools/extrapolate.py)


def _b(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n}"


def _t(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if s < 10 else f"{s:,.1f} s"


def _origins(pm):
    return {n.name: n for n in pm.program.graph.nodes}


def _origin(n, origins):
    return origins.get((n.meta.get("custom") or {}).get("autopar_origin", ""))


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") if node is not None else None
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    for prefix in ("L['self'].model.", "L['self'].", "L__self___model_", "model."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    return path.replace("_modules['", "").replace("']", "").replace("['", ".")


def _target(n) -> str:
    t = n.target
    s = str(t)
    return s.replace("aten.", "").replace(".default", "").replace("_c10d_functional.", "c10d.")


def _local(n) -> str:
    from autopar.ir import fmt_dtype

    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return f"{fmt_dtype(v.dtype)}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(f"{fmt_dtype(t.dtype)}{list(t.shape)}" for t in v if isinstance(t, torch.Tensor)) + ")"
    return ""


def _global(n, origin, axis_sizes) -> str:
    """The value's placements, where this per-rank node is the one producing its global value."""
    from autopar.ir import ShardSpec, fmt_placements

    spec = spec_of(origin) if origin is not None else None
    v = n.meta.get("val")
    if isinstance(spec, ShardSpec) and isinstance(v, torch.Tensor) and tuple(v.shape) == spec.local_shape(axis_sizes):
        return f"{fmt_placements(spec.placements)} of {list(spec.shape)}"
    if isinstance(spec, (tuple, list)) and isinstance(v, (tuple, list)) and len(spec) == len(v):  # multi-output op
        parts = [f"{fmt_placements(sp.placements)} of {list(sp.shape)}" for sp, t in zip(spec, v)
                 if isinstance(sp, ShardSpec) and isinstance(t, torch.Tensor)
                 and tuple(t.shape) == sp.local_shape(axis_sizes)]
        return " | ".join(parts) if len(parts) == len(spec) else ""
    return ""


def _comm_dict(rec) -> dict:
    return {"kind": rec.kind, "axis": rec.axis, "group_size": rec.group_size, "payload_bytes": rec.payload_bytes,
            "wire_bytes": rec.wire_bytes, "reason": rec.reason, "source": rec.source, "producer": rec.producer}


def _comm_lines(name: str, c: dict, local: str) -> list[str]:
    out = [f"  >> {name} = {c['kind'].upper()} on '{c['axis']}' ({c['group_size']} ranks): "
           f"{c['payload_bytes']:,} B in, {c['wire_bytes']:,.0f} B sent   {local}", f"       why: {c['reason']}"]
    if c["producer"] and c["producer"] != c["source"]:
        out.append(f"       value from: {c['producer']}")
    return out


def _stage_views(a: Analysis):
    """A pipelined program: one Analysis per stage (each stage's program read like a
    ParallelModule's), in stage order; otherwise [a]."""
    if not a.pm.pipelined:
        return [a]
    from dataclasses import replace

    from autopar.runtime.pipeline import StageView

    return [replace(a, pm=StageView(a.pm, sp)) for _, sp in sorted(a.pm.stages.items())]


def node_rows(a: Analysis) -> list[dict]:
    """One row per node of the per-rank training program (JSON-ready). A pipeline stage's nodes
    carry the part that runs them (F: forward, I: input gradient, W: weight gradient) as phase."""
    from autopar.ir import phase_of, source_line

    pm = a.pm
    part_of = pm.part_of() if hasattr(pm, "part_of") else None
    origins = _origins(pm)
    sizes = tuple(a.axes.values())
    roles = iter(pm.program.inputs)
    rows = []
    for n in pm.program.local.graph.nodes:
        o = _origin(n, origins)
        row = {"name": n.name, "op": n.op, "target": _target(n) if n.op in ("call_function", "output") else n.op,
               "local": _local(n), "placements": _global(n, o, sizes),
               "phase": (({"F": "forward (F)", "I": "input gradient (I)", "W": "weight gradient (W)"}
                          .get(part_of.get(n.name), "unused") if part_of is not None else phase_of(n))
                         if n.op == "call_function" else ("input" if n.op == "placeholder" else "output")),
               "module": _module_path(o), "source": source_line(n) or (source_line(o) if o is not None else ""),
               "args": [x.name for x in n.all_input_nodes]}
        if n.op == "placeholder":
            kind, what = next(roles)
            row["role"] = f"{kind} {what}"
        rec = info(n).comm
        if rec is not None:
            row["collective"] = _comm_dict(rec)
        rows.append(row)
    if part_of is not None:  # the parts run apart: list F, then I, then W
        order = {"input": 0, "forward (F)": 1, "input gradient (I)": 2, "weight gradient (W)": 3, "unused": 4,
                 "output": 5}
        rows.sort(key=lambda r: order.get(r["phase"], 4))
    return rows


# --------------------------------------------------------------------------- dump formats
def dump_text(a: Analysis) -> str:
    if a.pm.pipelined:
        return _dump_pipeline_text(a)
    pm = a.pm
    lines = [f"# per-rank program: {a.model} on mesh {a.axes}, rank {a.rank} (coordinate {a.coord})",
             f"# plan {a.plan}; {', '.join(f'{k} {v}' for k, v in a.options.items() if k != 'inputs')}",
             "# value: per-rank dtype[shape]; placements (one per mesh axis) of the global value it holds;",
             "# >> a collective: kind, mesh axis, bytes handed to it, bytes sent (ring), why, and the source line",
             ""]
    rows = node_rows(a)
    inputs = [r for r in rows if r["op"] == "placeholder"]
    lines.append(f"inputs ({len(inputs)}):")
    for r in inputs:
        lines.append(f"  {r['name']:28s} {r['role']:44s} {r['local']:22s} {r['placements']}")
    phase, header = None, None
    for r in rows:
        if r["op"] == "placeholder":
            continue
        if r["op"] == "output":
            lines += ["", f"outputs: {', '.join(r['args'][:8])}{' ...' if len(r['args']) > 8 else ''}"]
            continue
        if r["phase"] != phase:
            phase = r["phase"]
            lines += ["", f"== {phase} " + "=" * 70]
            header = None
        h = (r["module"], r["source"])
        if h != header and (r["module"] or r["source"]):
            header = h
            lines.append(f"  [{r['module'] or '-'}]  {r['source']}")
        c = r.get("collective")
        if c:
            lines += _comm_lines(r["name"], c, r["local"])
            continue
        args = ", ".join(r["args"][:4]) + (", ..." if len(r["args"]) > 4 else "")
        lines.append(f"     {r['name']:26s} = {r['target']}({args})".ljust(80) + f" {r['local']:20s} {r['placements']}")
    if pm.sync_program is not None:
        lines += ["", f"== gradient sync program (runs once per step, after the {pm.ctx.accumulate} micro-batches "
                      "above, on the summed gradients) " + "=" * 10]
        for n in pm.sync_program.local.graph.nodes:
            rec = info(n).comm
            if rec is not None:
                lines += _comm_lines(n.name, _comm_dict(rec), _local(n))
    recs = pm.collectives()
    lines += ["", f"{len(recs)} collectives per step ({pm.ctx.accumulate} x the program above"
              + (" + the sync program" if pm.sync_program is not None else "") + "), "
              f"{sum(r.wire_bytes for r in recs):,.0f} B sent by this rank"]
    return "\n".join(lines) + "\n"


def _pipeline_header(a: Analysis) -> list[str]:
    pm = a.pm
    me = pm.pp_rank
    lines = [f"# pipeline: {pm.schedule.name}, {len(pm.specs)} stages on {pm.pp_size} '{pm.pp_axis}' ranks, "
             f"{pm.microbatches} micro-batches; inside each stage: {pm.plan.describe()}",
             f"# this rank holds stage(s) {sorted(pm.local)} (pipeline rank {me}); every stage is shown, as the rank "
             "at this rank's other coordinates that holds it runs it", "", "stages:"]
    for r, spec in zip(pm.describe_stages(), pm.specs):
        ins = ", ".join(f"stage {src[1]} output {src[2]}" if src[0] == "stage" else f"input #{src[1]}"
                        for src in spec.inputs)
        lines.append(f"  stage {r['stage']} on pipeline rank {r['rank']}: {r['first']} .. {r['last']} "
                     f"({_b(r['parameters'])} of parameters); reads {ins}")
    lines += ["", f"this rank's actions ({len(pm.schedule.actions[me])}): " + " ".join(
        f"{k}{s}.{m}" for k, s, m in pm.schedule.actions[me])]
    return lines


def _dump_pipeline_text(a: Analysis) -> str:
    pm = a.pm
    lines = [f"# per-rank programs: {a.model} on mesh {a.axes}, rank {a.rank} (coordinate {a.coord})",
             f"# plan {a.plan}; {', '.join(f'{k} {v}' for k, v in a.options.items() if k != 'inputs')}"]
    lines += _pipeline_header(a)
    for view in _stage_views(a):
        sp = view.pm.stage
        lines += ["", "#" * 100, f"# stage {sp.spec.index} (pipeline rank {pm.schedule.rank_of(sp.spec.index)}): "
                  f"{sp.spec.modules[0]} .. {sp.spec.modules[1]}; saves {_b(sp.saved_bytes)} per micro-batch "
                  "for its backward", "#" * 100]
        body = dump_text(view).splitlines()
        lines += [x for x in body[2:]]  # (the view's own title lines repeat the header)
    recs = pm.collectives()
    sends = [r for r in recs if r.kind == "send"]
    lines += ["", f"point to point per step on this rank: {len(sends)} sends, {sum(r.wire_bytes for r in sends):,.0f} B "
              f"(activations forward, their gradients backward); {len(recs)} transfers and collectives in all, "
              f"{sum(r.wire_bytes for r in recs):,.0f} B sent by this rank"]
    return "\n".join(lines) + "\n"


def dump_json(a: Analysis) -> str:
    if a.pm.pipelined:
        pm = a.pm
        return json.dumps({"model": a.model, "mesh": a.axes, "plan": a.plan, "rank": a.rank,
                           "coordinate": list(a.coord), "options": a.options,
                           "pipeline": {"schedule": pm.schedule.name, "microbatches": pm.microbatches,
                                        "actions": pm.schedule.actions[pm.pp_rank], "stages": pm.describe_stages()},
                           "stages": [{"stage": v.pm.stage.spec.index, "nodes": node_rows(v)}
                                      for v in _stage_views(a)],
                           "summary": summary(a)}, indent=1, default=str)
    return json.dumps({"model": a.model, "mesh": a.axes, "plan": a.plan, "rank": a.rank, "coordinate": list(a.coord),
                       "options": a.options, "nodes": node_rows(a), "summary": summary(a)}, indent=1, default=str)


_LAYOUT_OPS = {"c10d", "permute", "clone", "view", "_unsafe_view", "reshape", "split", "<built-in function getitem>",
               "cat", "alias", "t", "movedim", "transpose", "contiguous", "_to_copy"}
_KIND_COLOR = {"all_reduce": "#d62728", "all_gather": "#ff7f0e", "reduce_scatter": "#9467bd", "all_to_all": "#8c564b"}


def _is_matmul(target: str) -> bool:
    return any(k in target for k in ("mm", "addmm", "bmm", "attention", "einsum", "linear"))


def dump_dot(a: Analysis) -> str:
    rows = node_rows(a)
    out = ["digraph autopar {", '  rankdir=TB; node [shape=box, fontname="Helvetica", fontsize=10];',
           f'  label="{a.model} on {a.axes}, rank {a.rank}: {a.plan}"; labelloc=t;']
    for phase in ("input", "forward", "backward", "output"):
        out.append(f'  subgraph cluster_{phase} {{ label="{phase}"; style=dashed;')
        for r in rows:
            if r["phase"] != phase:
                continue
            c = r.get("collective")
            if c:
                label = f"{c['kind']} on {c['axis']}\\n{c['wire_bytes']:,.0f} B sent\\n{r['local']}"
                style = f'style=filled, fillcolor="{_KIND_COLOR.get(c["kind"], "#d62728")}", fontcolor=white'
            else:
                label = f"{r['name']}\\n{r['target'] if r['op'] != 'placeholder' else r.get('role', '')}\\n{r['local']}"
                if r["placements"]:
                    label += f"\\n{r['placements']}"
                fill = "#c6dbef" if _is_matmul(r["target"]) else ("#e5f5e0" if r["op"] == "placeholder" else "white")
                style = f'style=filled, fillcolor="{fill}"'
            tip = (c["reason"] if c else r["source"]).replace('"', "'")
            out.append(f'    "{r["name"]}" [label="{label}", {style}, tooltip="{tip}"];')
        out.append("  }")
    for r in rows:
        for src in r["args"]:
            out.append(f'  "{src}" -> "{r["name"]}";')
    out.append("}")
    return "\n".join(out) + "\n"


def dump_svg(a: Analysis) -> str:
    """A self-contained SVG (no graphviz needed): the per-rank program in execution order, one
    box per source line (ops merged), forward and backward side by side, collectives as coloured
    bars with kind, axis, bytes and reason, and a live-memory bar (liveness) beside every box."""
    from html import escape

    from autopar.analysis.cost import program_memory

    rows = [r for r in node_rows(a) if r["op"] == "call_function"]
    prog = a.pm.program
    gm = prog.local
    # live bytes after each node, from the same liveness analysis as the memory prediction
    live = program_memory(gm, prog.inputs, prog.outputs).curve
    peak = max(live.values() or [1])
    groups: dict[str, list[list[dict]]] = {"forward": [], "backward": []}
    for r in rows:
        col = groups[r["phase"] if r["phase"] in groups else "forward"]
        key = ("comm", r["name"]) if "collective" in r else ("op", r["module"], r["source"])
        if col and col[-1][0].get("_key") == key and key[0] == "op":
            col[-1].append(r)
        elif (col and col[-1][0]["_key"][0] == "comm" and not r["module"] and "collective" not in r
              and r["target"].split(".")[0] in _LAYOUT_OPS):
            col[-1].append(r)  # the wait and the layout fix-up after a collective belong to it
        else:
            r["_key"] = key
            col.append([r])
    width_col, row_h, gap, top, memw = 640, 30, 4, 70, 90
    height = top + max(len(g) for g in groups.values()) * (row_h + gap) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * (width_col + memw) + 60}" height="{height}" '
           f'font-family="Helvetica, Arial, sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="20" y="22" font-size="15" font-weight="bold">{escape(a.model)} on mesh {escape(str(a.axes))}, '
           f'rank {a.rank}: plan {escape(str(a.plan))}</text>',
           f'<text x="20" y="40" fill="#555">one box per source line (ops merged, per-rank shapes); coloured bars are '
           f'collectives; grey bar left of each box: bytes alive (peak {escape(_b(peak))})</text>']
    legend_x = 20
    for kind, color in _KIND_COLOR.items():
        out.append(f'<rect x="{legend_x}" y="48" width="12" height="12" fill="{color}"/>'
                   f'<text x="{legend_x + 16}" y="58">{kind}</text>')
        legend_x += 110
    for ci, phase in enumerate(("forward", "backward")):
        x0 = 20 + ci * (width_col + memw + 20)
        out.append(f'<text x="{x0 + memw}" y="{top - 4}" font-weight="bold">{phase}</text>')
        for i, grp in enumerate(groups[phase]):
            y = top + i * (row_h + gap)
            r0 = grp[0]
            lb = max(live.get(r["name"], 0) for r in grp)
            out.append(f'<rect x="{x0 + memw - 6 - (memw - 10) * lb / peak:.1f}" y="{y + 8}" '
                       f'width="{(memw - 10) * lb / peak:.1f}" height="{row_h - 16}" fill="#bbbbbb">'
                       f'<title>{escape(_b(lb))} alive</title></rect>')
            c = r0.get("collective")
            if c:
                color = _KIND_COLOR.get(c["kind"], "#d62728")
                text = (f"{c['kind']} on '{c['axis']}' ({c['group_size']} ranks): {c['wire_bytes']:,.0f} B sent "
                        f"{r0['local']}  {c['reason']}")
                tip = f"{c['reason']}\nneeded at {c['source']}\nvalue from {c['producer']}"
                out.append(f'<g><title>{escape(tip)}</title><rect x="{x0 + memw}" y="{y}" width="{width_col}" '
                           f'height="{row_h}" rx="4" fill="{color}"/><text x="{x0 + memw + 6}" y="{y + 19}" '
                           f'fill="white">{escape(text[:110])}</text></g>')
                continue
            ops = [r["target"] for r in grp]
            heavy = any(_is_matmul(t) for t in ops)
            fill = "#c6dbef" if heavy else "#f2f2f2"
            src = r0["source"].split("  ", 1)
            title = (f"[{r0['module']}] " if r0["module"] else "") + (src[-1] if src else "")
            shown = [t for t in ops if t not in ("view", "t", "_unsafe_view", "alias", "detach", "transpose.int")]
            opstxt = ", ".join(dict.fromkeys(shown or ops))
            last = grp[-1]
            tip = "\n".join(f"{r['name']} = {r['target']}  {r['local']}  {r['placements']}" for r in grp)
            out.append(f'<g><title>{escape(r0["source"])}\n{escape(tip)}</title>'
                       f'<rect x="{x0 + memw}" y="{y}" width="{width_col}" height="{row_h}" rx="4" fill="{fill}" '
                       f'stroke="#888"/><text x="{x0 + memw + 6}" y="{y + 12}">{escape(title[:100])}</text>'
                       f'<text x="{x0 + memw + 6}" y="{y + 25}" fill="#444">{escape(opstxt[:60])} -> '
                       f'{escape(last["local"])} {escape(last["placements"])}</text></g>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- plan / explain
def summary(a: Analysis) -> dict:
    from autopar.ir import bytes_by_collective

    if a.extrapolated is not None:
        return copy.deepcopy(a.extrapolated)
    recs = a.pm.collectives()
    calls: dict[str, int] = {}
    for r in recs:
        calls[f"{r.kind}@{r.axis}"] = calls.get(f"{r.kind}@{r.axis}", 0) + 1
    m = a.memory
    t = a.time
    return {
        "parameters": a.n_params, "memory": {k: v for k, v in m.items() if k != "alive_at_peak"},
        "comm_bytes": bytes_by_collective(recs), "comm_calls": calls,
        # None when some op's FLOPs are unknown (listed, with why): flops_counted is then a lower bound
        "flops": None if t.unknown_flops else t.flops, "flops_counted": t.flops, "flops_unknown": t.unknown_flops,
        "time": {"step_s": t.step_s, "compute_s": t.compute_s, "comm_s": t.comm_s,
                 "exposed_comm_s": t.exposed_comm_s,
                 "optimizer_s": t.optimizer_s, "by_phase": t.by_phase, "comm_by_axis": t.comm_by_axis,
                 "exposed_by_axis": t.exposed_by_axis,
                 "bubble": t.bubble, "stage_seconds": t.stage_seconds},
        "device": a.device.name, "seconds": a.seconds,
        "inductor": bool(a.options.get("inductor")),  # the programs costed as compile(inductor=True) runs them
    }


def plan_table(results: list[Analysis]) -> str:
    a0 = results[0]
    sums = [summary(a) for a in results]
    dev = a0.device
    lines = [f"{a0.model}: {a0.n_params / 1e6:,.1f}M parameters, inputs {', '.join(a0.options['inputs'])}",
             f"mesh {a0.axes} ({math.prod(a0.axes.values())} ranks), plan {a0.plan}",
             "options: " + ", ".join(f"{k} {v}" for k, v in a0.options.items() if k != "inputs"),
             "", "assumptions: " + dev.describe(),
             "links per mesh axis: " + ", ".join(f"{ax} {'intra' if (al, bw) == (dev.intra_alpha, dev.intra_bw) else 'inter'}"
                                                 f"-node ({bw / 1e9:g} GB/s, {al * 1e6:g} us)"
                                                 for ax, (al, bw) in a0.links.items() if ax != "world"), ""]
    head = ["per rank"] + [f"rank {a.rank} {tuple(a.coord)}" for a in results]
    body: list[list[str]] = []

    def row(label, vals):
        body.append([label] + vals)

    mem = [s["memory"] for s in sums]
    row("parameters (as stored)", [_b(m["parameters"]) for m in mem])
    row("gradients (fp32, as stored)", [_b(m["gradients"]) for m in mem])
    row(f"optimizer state ({a0.options['optimizer']})", [_b(m["optimizer_state"]) for m in mem])
    pipes = [a.pm for a in results if a.pm.pipelined]
    if pipes:
        row("pipeline stages held", [f"{sorted(pm.local)} of {len(pm.specs)} ({pm.schedule.name}, "
                                     f"M={pm.microbatches})" for pm in pipes])
        row("activations in flight (schedule)", [f"{_b(m['in_flight_bytes'])} ({m['in_flight_microbatches']} "
                                                 "micro-batch sets)" for m in mem])
        row("  + largest transient (liveness)", [_b(m["transient_bytes"]) for m in mem])
    row("program peak (liveness)", [_b(m["program_peak"]) for m in mem])
    row("  parameter copies", [_b(m["peak_param_copies"]) for m in mem])
    row("  gradients in flight", [_b(m["peak_grads_in_flight"]) for m in mem])
    row("  activations", [_b(m["peak_activations"]) for m in mem])
    row("step peak (params + opt + program)", [_b(m["step_peak"]) for m in mem])
    fits = [("fits" if m["step_peak"] <= dev.mem_bytes else "DOES NOT FIT") + f" in {_b(dev.mem_bytes)}" for m in mem]
    row(f"  vs {dev.name} memory", fits)
    keys = sorted({k for s in sums for k in s["comm_bytes"]})
    for k in keys:
        row(f"sent: {k}", [f"{_b(s['comm_bytes'].get(k, 0))} ({s['comm_calls'].get(k, 0)} calls)" for s in sums])
    row("sent: total per step", [_b(sum(s["comm_bytes"].values())) for s in sums])
    row("FLOPs per step", [f"{s['flops']:.3e}" if s["flops"] is not None else
                           f"unknown (>= {s['flops_counted']:.3e}; {len(s['flops_unknown'])} op(s) not counted)"
                           for s in sums])
    row("predicted step time", [_t(s["time"]["step_s"]) if s["flops"] is not None else
                                f">= {_t(s['time']['step_s'])} (FLOPs unknown)" for s in sums])
    if pipes:
        row("  compute (F / I / W)", [f"{_t(s['time']['compute_s'])} ({_t(s['time']['by_phase'].get('F', 0))} / "
                                      f"{_t(s['time']['by_phase'].get('I', 0))} / "
                                      f"{_t(s['time']['by_phase'].get('W', 0))})" for s in sums])
        row("  pipeline bubble (simulated)", [f"{s['time']['bubble']:.1%}" for s in sums])
    else:
        row("  compute (fwd / bwd)", [f"{_t(s['time']['compute_s'])} ({_t(s['time']['by_phase'].get('forward', 0))} / "
                                      f"{_t(s['time']['by_phase'].get('backward', 0))})" for s in sums])
    row(f"  optimizer step ({a0.options['optimizer']})", [_t(s["time"]["optimizer_s"]) for s in sums])
    row("  communication (exposed)", [f"{_t(s['time']['comm_s'])} ({_t(s['time']['exposed_comm_s'])})" for s in sums])
    for ax in [ax for ax in a0.axes if any(ax in s["time"]["comm_by_axis"] for s in sums)]:
        row(f"    on {ax} (exposed)", [f"{_t(s['time']['comm_by_axis'].get(ax, 0))} "
                                      f"({_t(s['time']['exposed_by_axis'].get(ax, 0))})" for s in sums])
    tokens = math.prod(results[0].pm.example_shapes[0][0][:2]) if results[0].pm.example_shapes else 0
    world = math.prod(a0.axes.values())
    for s in sums:
        s["mfu"] = (None if s["flops"] is None
                    else s["flops"] / max(s["time"]["step_s"], 1e-12) / dev.flops[a0.options["precision"]])
    row("  model FLOP/s utilisation", [f"{s['mfu'] * 100:.1f}%" if s["mfu"] is not None else "unknown" for s in sums])
    if tokens:
        row("  tokens/s (whole mesh)", [("" if s["flops"] is not None else "<= ")
                                        + f"{tokens / max(s['time']['step_s'], 1e-12):,.0f}" for s in sums])
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    lines += ["", f"analysis time (rank {a0.rank}): " + ", ".join(
        f"{k} {v:.1f}s" for k, v in a0.seconds.items() if k in ("build", "compile", "cost_model", "total"))
        + (_extrapolated(ex) if (ex := sums[0].get("extrapolated")) else "")
        + (f"; {world} ranks: each stage's ranks run the same program on their own shards (SPMD), stages "
           "exchange activations point to point" if pipes else
           f"; {world} ranks, every rank runs the same program on its own shards (SPMD)")]
    for n in a0.notes:
        lines.append("note: " + n.replace("autopar: ", ""))
    unknown = list(dict.fromkeys(u for s in sums for u in s["flops_unknown"]))
    if unknown:
        lines.append(f"note: the FLOPs of {len(unknown)} op(s) could not be counted (timed by their bytes only, "
                     "so FLOPs and step time above are lower bounds):")
        lines += [f"  {u}" for u in unknown[:8]] + ([f"  ... and {len(unknown) - 8} more"] if len(unknown) > 8 else [])
    kept = a0.pm.ctx.kept_gathered if not pipes else []
    if kept:
        lines.append(f"note: reshard_after_forward keeps {len(kept)} gathered parameter(s), "
                     f"{_b(sum(b for _, b in kept))} per rank, alive from their forward use to their backward "
                     "use instead of gathering them again: " + ", ".join(n for n, _ in kept[:6])
                     + (" ..." if len(kept) > 6 else "") + " (in the program peak above)")
    for axis, names in (a0.pm.ctx.placed.unplaced.items() if not pipes else ()):
        lines.append(f"note: no rule matches {len(names)} parameter(s) on '{axis}'; plan['rest'] replicated them: "
                     + ", ".join(names[:6]) + (" ..." if len(names) > 6 else "") + " (autopar explain: sizes)")
    for axis, names in (a0.pm.ctx.placed.unsharded.items() if not pipes else ()):
        lines.append(f"note: {len(names)} parameter(s) have no dim divisible by '{axis}' and are stored whole: "
                     + ", ".join(names[:6]) + (" ..." if len(names) > 6 else ""))
    return "\n".join(lines) + "\n"


def _general_reason(reason: str) -> tuple[str, str]:
    """Split a collective's reason into its kind (for grouping) and its specifics (a parameter or
    node name): "ZeRO-3: gather parameter X for ..." -> ("ZeRO-3: gather parameter <p> for ...", "X")."""
    import re

    m = re.search(r"parameter ([\w.]+)", reason)
    if m:
        return reason.replace(m.group(1), "<p>"), m.group(1)
    m = re.search(r"gradient of ([\w.]+)", reason)
    if m:
        return reason.replace(m.group(1), "<p>"), m.group(1)
    m = re.search(r" for (\S+) \((\w+)\)$", reason)
    if m:
        return reason[: m.start()] + f" for {m.group(1)}", m.group(2)
    return reason, ""


def explain_text(a: Analysis) -> str:
    from autopar.ir import fmt_placements
    from autopar.plan import placement_reasons, replicated_lines

    pm = a.pm
    lines = [plan_table([a]), "why each parameter is placed as it is (storage placement; rule per axis):"]
    placed = pm.ctx.placed
    params = dict(pm.module.named_parameters())
    for name, p in params.items():
        why = "; ".join(f"{ax}: {glob or '-'} ({src})" for ax, glob, src in placement_reasons(pm.ctx.plan, name))
        comp = placed.compute[name]
        stored = placed.placements[name]
        extra = f", computes as {fmt_placements(comp)}" if comp != stored else ""
        lines.append(f"  {name:44s} {str(list(p.shape)):>16s} stored {fmt_placements(stored)}{extra}   <- {why}")
    replicated = replicated_lines(placed, params)
    if replicated:
        lines += ["", "what tensor parallelism does not divide (the rule behind each replicated parameter):"] + replicated
    recs = pm.collectives()
    groups: dict[tuple, list] = {}
    for r in recs:
        general, detail = _general_reason(r.reason)
        groups.setdefault((r.phase, r.kind, r.axis, general, r.source), []).append(detail)
        groups[(r.phase, r.kind, r.axis, general, r.source)][-1] = (r, detail)
    lines += ["", f"why each collective is there ({len(recs)} per step, grouped by reason and source line):"]
    for (phase, kind, axis, reason, source), rs in sorted(groups.items(),
                                                           key=lambda kv: -sum(r.wire_bytes for r, _ in kv[1])):
        lines.append(f"  {len(rs):4d} x {kind:14s} on {axis:4s} {phase:8s} "
                     f"{_b(sum(r.wire_bytes for r, _ in rs)):>12s} sent   {reason}")
        details = list(dict.fromkeys(d for _, d in rs if d))
        if details:
            lines.append(f"{'':34s}for {', '.join(details[:4])}" + (f" and {len(details) - 4} more" if len(details) > 4 else ""))
        if source:
            lines.append(f"{'':34s}needed at {source}")
    m = a.memory
    lines += ["", f"what is alive at the program's memory peak ({_b(m['program_peak'])}, at node {m['peak_node']}), "
                  "largest first:"]
    gm = pm.program.local
    by_name = {n.name: n for n in gm.graph.nodes}
    from autopar.ir import source_line

    for nbytes, name, cat in m["alive_at_peak"][:15]:
        n = by_name.get(name)
        src = source_line(n) if n is not None else ""
        lines.append(f"  {_b(nbytes):>12s}  {cat:16s} {name:28s} {_local(n) if n is not None else '':20s} {src}")
    rest = m["alive_at_peak"][15:]
    if rest:
        lines.append(f"  {_b(sum(b for b, _, _ in rest)):>12s}  in {len(rest)} smaller values")
    lines += ["", "how the figures are made: parameters/gradients/optimizer state = the local shard of every parameter "
              "(x1 fp32 gradient, x2 fp32 for AdamW); program peak = liveness over the per-rank program above "
              "(views share storage, each value freed after its last use); bytes = ring formulas on each "
              "collective's real per-rank size; time = roofline per op + alpha-beta per collective, "
              "communication overlapped only where the program's order allows."]
    return "\n".join(lines) + "\n"


def _extrapolated(ex: dict) -> str:
    """The analysis line's account of a plan extrapolated in depth (autopar/tools/extrapolate.py)."""
    p = ex.get("period", 1)
    cut = ", ".join(str(d * p) for d in ex["depths"])
    how = ("every block's increment checked equal" if p == 1 else
           f"in units of {p} blocks, as its blocks repeat every {p}: every unit's increment checked equal, "
           "every depth traced (no splicing)")
    return (f"; figures extrapolated from the model compiled with {ex['blocks']} cut to {cut} blocks to its "
            f"{ex['layers'] * p} ({how}; --full-depth compiles every block"
            + (f"; {'depth ' + str(ex['depths'][0] * p) + ' after its ' + ex['forked_after'] + ' pass and ' if ex.get('forked_after') else ''}depth(s) "
               f"{', '.join(str(d * p) for d in ex['forked'])} compiled in a forked process beside this one, the "
               "times above their sum" if ex.get("forked") else "") + _localized(ex) + ")")


def _localized(ex: dict) -> str:
    """How the extrapolation's depths got their per-rank programs (autopar/local_splice.py): the
    depths spliced from the first's, and each one traced in full with why."""
    loc = ex.get("localized") or {}
    spliced = [d for d, lines in loc.items() if lines and all(x == "spliced" for x in lines)]
    why = [f"depth {d}'s per-rank program traced in full, {'; '.join(x.removeprefix('traced: ') for x in lines if x not in ('spliced', 'recorded'))}"
           for d, lines in loc.items() if any(x not in ("spliced", "recorded") for x in lines)]
    head = (f"; depth(s) {', '.join(map(str, spliced))}'s per-rank programs spliced from depth {ex['depths'][0]}'s"
            if spliced else "")
    return head + "".join(f"; {w}" for w in why)
