"""The command line (`autopar dump | plan | explain`) and the cost model behind it.

Planning runs in this process on a fake process group with the model on meta tensors; the
per-rank figures it prints are checked against a compile of the same model with real weights
(identical collectives, identical predicted memory). Predicted memory against measured memory
on real gloo runs is asserted in test_parity / test_state (every plan there, within 5%).
"""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET

import pytest
import torch

import autopar
from autopar.analysis import cost
from autopar.models import zoo
from autopar.tools.cli import main as cli
from autopar.models.llama import Llama, LlamaConfig, cross_entropy

MESH = ["--mesh", "dp=2,tp=2", "--plan", "dp=fsdp,tp=megatron", "-q"]


def run(capsys, *argv):
    rc = cli(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_dump_text_shows_placements_collectives_and_phases(capsys):
    rc, out, _ = run(capsys, "dump", "llama-tiny", *MESH)
    assert rc == 0
    assert "== forward" in out and "== backward" in out
    assert "ALL_GATHER on 'dp' (2 ranks)" in out and "REDUCE_SCATTER on 'dp'" in out and "ALL_REDUCE on 'tp'" in out
    assert "why: " in out and "models/llama.py:" in out  # reason and the user's source line
    assert "(S(0), S(0))" in out or "(S(1), S(0))" in out  # placements of stored parameters
    assert "param layers.0.self_attn.q_proj.weight" in out


def test_dump_json_dot_svg(capsys, tmp_path):
    rc, out, _ = run(capsys, "dump", "llama-tiny", *MESH, "--format", "json")
    assert rc == 0
    d = json.loads(out)
    comm = [n for n in d["nodes"] if "collective" in n]
    assert len(comm) == sum(d["summary"]["comm_calls"].values())
    assert {n["phase"] for n in d["nodes"]} >= {"forward", "backward", "input", "output"}
    assert all(n["collective"]["source"] or n["collective"]["reason"] for n in comm)
    rc, out, _ = run(capsys, "dump", "llama-tiny", *MESH, "--format", "dot")
    assert rc == 0 and out.startswith("digraph") and "cluster_backward" in out
    svg = tmp_path / "g.svg"
    rc, _, _ = run(capsys, "dump", "llama-tiny", *MESH, "--format", "svg", "-o", str(svg))
    assert rc == 0
    root = ET.parse(svg).getroot()  # well-formed
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "all_gather on 'dp'" in texts and "reduce_scatter on 'dp'" in texts and "backward" in texts


def test_plan_table_matches_the_compiled_program(capsys):
    rc, out, _ = run(capsys, "plan", "llama-tiny", *MESH, "--device", "h100", "--json")
    assert rc == 0
    s = json.loads(out)[0]
    # the same figures as the Python API on the same (fake) mesh, real weights
    from conftest import fake_mesh

    with fake_mesh(dp=2, tp=2) as mesh:
        loaded = zoo.load("llama-tiny", meta=False)
        pm = autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                             plan={"dp": "fsdp", "tp": "megatron"})
        assert s["comm_bytes"] == pytest.approx(pm.predicted_bytes())
        mem = cost.predict_memory(pm)
    for k in ("parameters", "gradients", "optimizer_state", "program_peak", "step_peak"):
        assert s["memory"][k] == mem[k], k
    t = s["time"]
    assert s["flops"] > 0 and t["compute_s"] > 0 and t["comm_s"] > 0
    # the step is at least the compute (one stream) and at most compute + communication in series
    assert t["compute_s"] + t["optimizer_s"] <= t["step_s"] <= t["compute_s"] + t["comm_s"] + t["optimizer_s"] + 1e-12
    assert t["exposed_comm_s"] <= t["comm_s"]
    rc, out, _ = run(capsys, "plan", "llama-tiny", *MESH, "--rank", "0,3")
    assert rc == 0 and "rank 0 (0, 0)" in out and "rank 3 (1, 1)" in out and "assumptions: h100" in out
    # --inductor: the same program costed as Inductor runs it: the same FLOPs, bytes and
    # persistent state, less time in elementwise ops and a lower peak (the intermediates inside
    # its fused kernels are never allocated: autopar/analysis/inductor_model.py)
    rc, out, _ = run(capsys, "plan", "llama-tiny", *MESH, "--device", "h100", "--json", "--inductor")
    f = json.loads(out)[0]
    assert rc == 0 and f["inductor"] and not s["inductor"] and f["flops"] == s["flops"]
    assert f["comm_bytes"] == s["comm_bytes"] and f["memory"]["parameters"] == s["memory"]["parameters"]
    assert f["memory"]["step_peak"] < s["memory"]["step_peak"]
    assert f["time"]["compute_s"] < s["time"]["compute_s"]


@pytest.mark.parametrize("model,plan,axes,opts", [
    ("llama-tiny", {"dp": "zero3"}, {"dp": 4}, {"precision": "bf16"}),
    ("llama-tiny", {"dp": "fsdp", "tp": "megatron"}, {"dp": 2, "tp": 2}, {"recompute": "selective"}),
    ("hf-llama-tiny", {"dp": "ddp", "tp": "megatron"}, {"dp": 2, "tp": 2}, {}),
])
def test_meta_planning_is_the_real_program(fake, model, plan, axes, opts):
    """A model on meta tensors compiles to the same per-rank program as with real weights:
    same collectives (kind, axis, bytes, phase), same predicted memory and FLOPs (two fixes in
    the front end make it so: cross-entropy's backward and the attention kernel on meta)."""
    got = []
    for meta in (False, True):
        loaded = zoo.load(model, meta=meta)
        with fake(**axes) as mesh:
            pm = autopar.compile(loaded.model, mesh, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                                 plan=plan, capture_eval=False, **opts)
            recs = [(r.kind, r.axis, r.payload_bytes, r.phase) for r in pm.collectives()]
            mem = {k: v for k, v in cost.predict_memory(pm).items() if k not in ("alive_at_peak", "peak_node")}
            got.append((recs, mem, cost.predict_time(pm, cost.DEVICES["h100"]).flops))
    assert got[0] == got[1]
    assert any(r[3] == "backward" for r in got[1][0])  # the backward is there (cross-entropy on meta)


def test_factory_spec_and_explain(capsys, tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        from autopar.models.llama import Llama, LlamaConfig, cross_entropy

        def small():
            x = torch.randint(0, 256, (4, 16))
            return Llama(LlamaConfig()), (x, x), cross_entropy
    """))
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run(capsys, "explain", "mymodels:small", "--mesh", "dp=4", "--plan", "dp=zero2", "-q")
    assert rc == 0
    assert "why each parameter is placed" in out and "<- dp: * (zero2)" in out
    assert "why each collective is there" in out and "reduce_scatter" in out
    assert "alive at the program's memory peak" in out


def test_cli_errors(capsys, tmp_path):
    rc, _, err = run(capsys, "plan", "llama-tinny", "-q")
    assert rc == 2 and "unknown model 'llama-tinny'" in err and "did you mean llama-tiny" in err
    rc, _, err = run(capsys, "plan", "llama-tiny", "--mesh", "dp=two", "-q")
    assert rc == 2 and "mesh axis 'dp' needs a positive integer size" in err
    rc, _, err = run(capsys, "plan", "llama-tiny", "--mesh", "dp=2", "--plan", "dp=zero4", "-q")
    assert rc == 2 and "unknown strategy 'zero4'" in err
    rc, _, err = run(capsys, "plan", "llama-tiny", "--mesh", "dp=2", "--plan", "tp=megatron", "-q")
    assert rc == 2 and "mesh axis 'tp'" in err
    rc, _, err = run(capsys, "plan", "nosuchmodule_xyz:make", "-q")
    assert rc == 2 and "cannot import 'nosuchmodule_xyz'" in err
    rc, _, err = run(capsys, "plan", "llama-tiny", "--rank", "9", "-q")
    assert rc == 2 and "rank 9 is outside the mesh" in err
    rc, _, err = run(capsys, "plan", "llama-tiny", "--device", "tpu", "-q")
    assert rc == 2 and "unknown device 'tpu'" in err
    rc, _, err = run(capsys, "plan", "llama-tiny", "--mesh", "tp=3", "--plan", "tp=megatron", "-q")
    assert rc == 2 and "not divisible" in err and "embed_tokens.weight" in err  # a plan this model cannot take
    (tmp_path / "untraceable.py").write_text(textwrap.dedent("""
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x):
                y = self.lin(x)
                return y if y.sum().item() > 0 else -y   # data-dependent Python control flow

        def make():
            x = torch.randn(4, 8)
            return M(), (x, x), torch.nn.functional.mse_loss
    """))
    rc, _, err = run(capsys, "plan", f"{tmp_path / 'untraceable.py'}:make", "-q")
    assert rc == 1 and "CaptureError" in err and "could not trace" in err  # compile failed: exit code 1
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    rc, _, err = run(capsys, "plan", "llama-tiny", "--plan", str(bad), "-q")
    assert rc == 2 and "not valid JSON" in err
    for cmd in ("dump", "plan", "explain", "calibrate", "bench", "demo"):
        rc, out, _ = run(capsys, cmd, "--help")
        assert rc == 0 and "usage: autopar" in out, cmd
    rc, out, _ = run(capsys, "dump", "--list-models")
    assert rc == 0 and "llama3-70b" in out and "hf-llama3-8b" in out and "moe-tiny" in out


def test_calibrating_a_gpu_keeps_the_datasheet_links(monkeypatch, capsys):
    """``autopar calibrate --device cuda``'s row (its ops timed on this CPU here): measured compute,
    bandwidth and launch gap, efficiency 1, the device's memory; NVLink and the NIC from the row of
    the GPU's name, and the source says so. Without a GPU the command refuses."""
    from types import SimpleNamespace

    from autopar.tools import calibrate

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=140 * 2**30))
    row = calibrate.calibrate_gpu(n=64, mib=1, device="cpu", opt_elems=2**16, tokens=256, dim=256)
    dev = cost.Device(**row)
    h200 = cost.DEVICES["h200"]
    assert dev.name == "h200-calibrated" and dev.efficiency == 1.0 and dev.mem_bytes == 140 * 2**30
    assert (dev.intra_bw, dev.inter_bw, dev.ranks_per_node) == (h200.intra_bw, h200.inter_bw, h200.ranks_per_node)
    assert all(v > 0 for v in dev.flops.values()) and dev.mem_bw > 0 and dev.op_overhead > 0 and dev.cores == 0
    assert dev.optimizer_bw > 0 and dev.eager_bw > 0 and "eager elementwise ops at" in dev.describe()
    assert "on NVIDIA H200" in dev.source and "links from the h200 row" in dev.source
    if not torch.cuda.is_available():
        rc, _, err = run(capsys, "calibrate", "--device", "cuda")
        assert rc == 2 and "torch sees no GPU here" in err


def test_cost_model_arithmetic():
    """alpha-beta per axis (intra-node when the axis and the faster axes fit in a node) and the
    ring formulas; the roofline takes the larger of compute and memory time."""
    dev = cost.DEVICES["h100"]
    links = cost.axis_links(("dp", "tp"), (16, 8), dev)
    assert links["tp"] == (dev.intra_alpha, dev.intra_bw) and links["dp"] == (dev.inter_alpha, dev.inter_bw)
    rec = autopar.ir.CommRecord("all_reduce", "tp", 8, 2**30, "", "")
    assert cost.comm_seconds(rec, links) == pytest.approx(14 * dev.intra_alpha + 2 * 7 / 8 * 2**30 / dev.intra_bw)


def test_fused_elementwise_chains_by_hand():
    """compile(inductor=True) as the cost model sees it: x*2+1 then relu is one kernel that reads
    x and writes relu's output (the matmul's input, a buffer); the multiply after the matmul reads
    and writes its own bytes (the program's output). Eager, every elementwise op reads and writes.
    Views move nothing: free on a GPU and when compiled, a dispatch each when run eagerly on a CPU."""
    from dataclasses import replace

    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return torch.mm(torch.relu(x * 2 + 1), w).view(-1) * 3

    gm = make_fx(f, tracing_mode="fake")(torch.randn(64, 128), torch.randn(128, 32))
    dev = replace(cost.DEVICES["h100"], op_overhead=0.0)
    fusion = cost.fusion_of(gm)

    def elementwise_bytes(fu):
        return sum(cost.compute_seconds(n, dev, 0, 1.0, fu) for n in gm.graph.nodes
                   if n.op == "call_function" and n.target is not torch.ops.aten.mm.default) * dev.mem_bw

    x, y = 64 * 128 * 4, 64 * 32 * 4
    assert elementwise_bytes(fusion) == pytest.approx(x + x + y + y)
    assert elementwise_bytes(None) == pytest.approx(3 * (x + x) + y + y)
    inner = {n.target for n in gm.graph.nodes if n in fusion.generated and not fusion.kernels.get(n)}
    assert inner == {torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor}  # computed inside relu's kernel
    view = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default)
    cpu = cost.DEVICES["cpu"]
    assert cost.compute_seconds(view, cost.DEVICES["h100"], 0) == 0.0
    assert cost.compute_seconds(view, cpu, 0) == cpu.op_overhead
    assert cost.compute_seconds(view, cpu, 0, 1.0, fusion) == 0.0
    eager, fused = (cost.simulate(gm, dev, {}, fused=b) for b in (False, True))
    assert fused.compute_s < eager.compute_s and fused.flops == eager.flops
    # a row with a measured eager rate: the program's own ops at that rate, Inductor's kernels at mem_bw
    slow = replace(dev, eager_bw=dev.mem_bw / 2)
    assert elementwise_bytes(None) * 2 == pytest.approx(sum(
        cost.compute_seconds(n, slow, 0) for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not torch.ops.aten.mm.default) * dev.mem_bw)
    assert cost.simulate(gm, slow, {}, fused=True).compute_s == pytest.approx(fused.compute_s)


def test_optimizer_rates():
    """torch's default AdamW at the row's measured optimizer rate; a fused one on a GPU at mem_bw
    (one streaming kernel per group); a CPU row keeps its measured rate for both."""
    from dataclasses import replace

    gpu = replace(cost.DEVICES["h200"], optimizer_bw=3.4e12, mem_bw=4.2e12)
    n = 10**9
    assert cost.optimizer_seconds(n, "adamw", gpu) == pytest.approx(n * 80 / 3.4e12)
    assert cost.optimizer_seconds(n, "adamw-fused", gpu) == pytest.approx(n * 28 / 4.2e12)
    cpu = cost.DEVICES["cpu"]
    assert cost.optimizer_seconds(n, "adamw-fused", cpu) == pytest.approx(n * 28 / cpu.optimizer_bw)


def test_liveness_matches_a_hand_count(fake):
    """On a two-layer MLP the activation peak is what one would count by hand."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(256, 64, bias=False))
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    with fake(dp=1) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=(x, y), loss_fn=torch.nn.functional.mse_loss,
                             plan={"dp": "ddp"}, capture_eval=False)
        m = cost.predict_memory(pm)
    # peak while threshold_backward runs: the second layer's weight gradient (64x256, an output),
    # relu's output saved for the backward, the gradient flowing into relu and relu's input
    # gradient (3 x 32x256), the input x kept for the first weight gradient (32x64), the loss
    assert m["program_peak"] == 4 * (64 * 256 + 3 * 32 * 256 + 32 * 64 + 1)
    assert m["peak_node"] == "threshold_backward"
    assert m["parameters"] == 2 * 64 * 256 * 4 and m["optimizer_state"] == 2 * m["parameters"]


def test_moe_compiles_and_plans(fake):
    with fake(dp=2) as mesh:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(n_experts=4))
        x = torch.randint(0, 256, (4, 16))
        pm = autopar.compile(model, mesh, example_inputs=(x, x), loss_fn=cross_entropy, plan={"dp": "fsdp"},
                             capture_eval=False)
        kinds = {r.kind for r in pm.collectives()}
    assert kinds == {"all_gather", "reduce_scatter", "all_reduce"}


def test_an_oversubscribed_cpu_runs_collectives_on_the_compute_stream(fake):
    """More ranks than cores (4 gloo ranks on 2 cores): a collective is CPU work on the cores the
    ranks compute on, so nothing hides it, and each ring step costs the loaded latency; with a core
    per rank the same program overlaps its gradient all-reduces with the backward. A pipeline's
    ranks hand their cores over in the bubbles, but the node's cores bound the whole."""
    from dataclasses import replace

    from autopar.testing import build_model

    base = replace(cost.DEVICES["cpu"], loaded_alpha=1e-3, intra_alpha=50e-6)
    roomy, tight, one = (replace(base, cores=c) for c in (4, 2, 1))
    model, batches, loss_fn = build_model("llama")
    with fake(dp=4) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"dp": "ddp"},
                             capture_eval=False)
    e_roomy, e_tight = cost.predict_time(pm, roomy), cost.predict_time(pm, tight)
    assert not cost.oversubscribed(roomy, 4) and cost.oversubscribed(tight, 4)
    assert e_roomy.exposed_comm_s < e_roomy.comm_s
    assert e_tight.exposed_comm_s == pytest.approx(e_tight.comm_s)
    steps = sum(2 * (r.group_size - 1) if r.kind == "all_reduce" else r.group_size - 1 for r in pm.collectives())
    assert e_tight.comm_s == pytest.approx(sum(r.wire_bytes for r in pm.collectives()) / base.intra_bw + steps * 1e-3)
    assert e_tight.step_s > e_roomy.step_s

    model, batches, loss_fn = build_model("llama6")
    with fake(pp=4) as mesh:
        pm = autopar.compile(model, mesh, example_inputs=batches[0], loss_fn=loss_fn, plan={"pp": "1f1b"},
                             capture_eval=False, pipeline_stages="all")
    e2, e1 = cost.predict_time(pm, tight), cost.predict_time(pm, one)
    work = sum(sum(v) for v in e2.stage_seconds.values()) * pm.microbatches  # every action at one core
    assert e2.step_s >= work / 2 and e1.step_s >= work
    assert e1.step_s > e2.step_s


def test_console_commands_leave_at_once_with_everything_written(tmp_path):
    """As the console script, ``plan`` / ``dump`` leave by os._exit with the cyclic collector off
    (autopar/tools/cli.py): what they print and write must all be there, exit codes kept, and a
    reader that goes away early (``| head``) must not turn into a traceback. The trace cache is
    written behind the command, by a detached child (autopar/disk_cache.py ``write_behind``): done
    when ``wait_for_writers`` returns, and read by the next run."""
    import os
    import subprocess
    import sys

    from autopar import disk_cache

    cmd = [sys.executable, "-m", "autopar.tools.cli"]
    env = dict(os.environ, AUTOPAR_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run(cmd + ["plan", "llama-tiny", "--mesh", "dp=2", "--plan", "dp=fsdp", "--json", "-q",
                                "-o", str(tmp_path / "plan.json")], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "plan.json").read_text())[0]["parameters"] > 0
    assert disk_cache.wait_for_writers(str(tmp_path / "cache"))
    assert list((tmp_path / "cache").glob("traces-*/strategies/*.bin"))
    again = subprocess.run(cmd + ["plan", "llama-tiny", "--mesh", "dp=2", "--plan", "dp=fsdp", "-q"],
                           capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0 and "read from autopar's trace cache" in again.stdout, again.stdout[-2000:]
    out = subprocess.run(cmd + ["plan", "llama-tiny", "--mesh", "dp=two", "-q"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "needs a positive integer size" in out.stderr
    head = subprocess.run(" ".join(cmd + ["dump", "llama-tiny", "--mesh", "dp=2", "-q"]) + " | head -1", shell=True,
                          capture_output=True, text=True, timeout=300)
    assert head.stdout.startswith("# per-rank program") and "Traceback" not in head.stderr, head.stderr[-2000:]
