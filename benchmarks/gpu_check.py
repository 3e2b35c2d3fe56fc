"""One run on the GPU machine (issue 39, item 1): does autopar run there as it is, and how fast.

    python3 benchmarks/gpu_check.py --out $OUT [--commit HASH] [--budget-s 420]
    .venv/bin/python benchmarks/gpu_check.py --out /tmp/gpucheck --smoke     (CPU: the same code, tiny shapes)

Sections, in this order, each in its own process (a CUDA error, a hang or a crash in one ends only
that one; its traceback or the tail of its log is recorded and the next one runs):

- ``env`` (this process): device, torch / CUDA / Triton versions, driver, date, git commit;
- ``correctness``: autopar's flash attention (forward, backward; causal or not; head dim 64 / 128;
  grouped-query heads) and linear + GELU / SiLU in bf16 against an fp32 reference, beside the same
  error of PyTorch's bf16 SDPA / ``F.linear``: max |error| over max |reference|, per output and gradient;
- ``step-*``: the whole training step of the 0.5B Llama (vocab 32000, dim 2048, 8 layers, 16/8
  heads, ffn 5632; batch 8 x 2048; bf16; AdamW, torch's default or ``--optimizer adamw-fused``
  on every side; one rank): eager PyTorch under autocast,
  torch.compile, autopar with kernels off / on / auto and with ``inductor=True``. Each: the first
  step's time (compiles), the median of the next ones (each alone, ending on its loss: its host
  prologue runs on an idle GPU), the same steps issued back to back with the loss not read (as a
  loop that logs every N steps runs them: the prologue hidden behind the last step's kernels), MFU, the allocator's peak over the timed
  steps, every step's loss (same init and batches everywhere), and for autopar the cost model's
  predicted step time (its program costed op by op and Inductor-fused) and step peak on the
  device's row (autopar/analysis/devices.py);
- ``kernel-table``: ``autopar bench --kernels`` (autopar/tools/kernelbench.py) into ``$OUT``:
  kernels-DATE.json / .md, the device in its meta;
- ``calibrate``: ``autopar calibrate --device cuda``'s row for this GPU (matmul rate, HBM
  bandwidth, a block's elementwise ops run eagerly, launch gap and torch's AdamW step measured;
  links from the datasheet row), written to
  calibrated-row.json: the autopar step sections predict with it too, beside the datasheet row.
  Then grouped-query SDPA (``enable_gqa``) against repeated K/V heads at the step's attention
  shape, and the kernels each ran.
- ``planner-forks``: whether ``autopar plan``'s forked children can run autograd on this machine
  (autograd's engine starts a thread per GPU at a process's first backward, and refuses a backward
  in a child forked after; autopar/forked.py ``settle_autograd``): a model whose depths are all
  traced (tests/foreign_models.py:alternating) planned with the fork forced, as it is and with the
  GPUs hidden (``CUDA_VISIBLE_DEVICES=``), each run's ``extrapolated.forked`` (``[4]``: the child
  did depth 4; ``[]``: it failed and this process redid it) and the child's error;
- ``candidates`` (last: it compiles every configuration): every launch configuration the kernels'
  tuner may pick (kernels/attention_launches.py FWD / DKDV / DQ, kernels/matmul.py CANDIDATES),
  each forced on one bf16 shape of the kernel table's (B4 H32/8 S1024; 4096^3 with the
  backward's transposed operands), against the fp32 reference: the tuner picks by speed alone,
  and Triton's interpreter on CPU (tests/test_kernels.py) cannot see a compiler's error on this
  chip. A configuration this chip cannot compile is listed with its error.

A time budget (``--budget-s``) is enforced here: each section's process gets at most its own cap
and what is left of the budget, and none starts with less than ``MIN_START_S`` left. summary.md
and summary.json are rewritten after every section, so what has run is on disk whatever happens.

MFU = model FLOPs / step time / the row's dense bf16 peak (989 TFLOP/s for H100 and H200 SXM).
Model FLOPs per step = 6 * N * T + 6 * L * S * dim * T: N the parameters that multiply (all but
the embedding table; the LM head counts), T the tokens of the step, and attention's two matmuls
(12 * L * S * dim per token forward + backward) halved for the causal mask, as FlashAttention and
``autopar bench --kernels`` count it (PaLM's appendix B counts it whole: ``mfu_palm`` in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_START_S = 20.0  # no section starts with less than this left of the budget
SMOKE_CAP_SCALE = 3  # --smoke on a CPU: Inductor's C++ compiles take longer than a GPU machine's whole section

# (section, cap in seconds on an H100), in the order they run: what the issue needs most first
# (candidates last: it compiles every launch configuration, 44-150 s on the H200; run it with --only
# candidates after changing them)
SECTIONS = [("correctness", 150), ("kernel-table", 240), ("calibrate", 60), ("step-eager", 60),
            ("step-autopar-off", 90),
            ("step-autopar-auto", 100), ("step-compile", 120), ("step-autopar-inductor", 150),
            ("step-autopar-on", 100), ("kernel-profile", 120), ("planner-forks", 60), ("candidates", 200)]

# step variant: (system, autopar kernels, autopar inductor)
VARIANTS = {"eager": ("eager", None, False), "compile": ("torch.compile", None, False),
            "autopar-off": ("autopar", "off", False), "autopar-on": ("autopar", "on", False),
            "autopar-auto": ("autopar", "auto", False), "autopar-inductor": ("autopar", "off", True)}

MODEL_05B = dict(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=5632)


@dataclass
class Config:
    """Shapes and repetitions: the issue's on a GPU, tiny ones for ``--smoke``."""
    smoke: bool
    model: dict = field(default_factory=lambda: dict(MODEL_05B))
    batch: int = 8
    seq: int = 2048
    reps: int = 5  # timed steps after the first step and kernelbench's 2 warm-up steps
    # attention: (B, H, Hkv, S, D, causal); linear + act: (rows, N, K)
    attention: list = field(default_factory=lambda: [(2, 16, 8, 1024, 128, True), (2, 16, 8, 1024, 128, False),
                                                     (2, 16, 16, 1000, 64, True), (2, 16, 4, 1000, 64, False)])
    linear: list = field(default_factory=lambda: [(8192, 5632, 2048)])
    kernel_seqs: list = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    # the steps' optimizer, the same on every side: torch's default AdamW (foreach on a GPU) or
    # fused=True ("adamw-fused": one kernel per group, what torchtitan's trainer uses)
    optimizer: str = "adamw"


def config(smoke: bool) -> Config:
    if not smoke:
        return Config(False)
    return Config(True, model=dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
                  batch=2, seq=16, reps=1, attention=[(1, 4, 2, 37, 64, True), (1, 2, 1, 33, 128, False)],
                  linear=[(51, 70, 40)], kernel_seqs=[64])


# ------------------------------------------------------------------------------------------ budget
class Budget:
    """Seconds left of the run; a section's timeout is its cap or what is left, whichever is less,
    and nothing starts with less than ``min_start`` left."""

    def __init__(self, total_s: float, min_start: float = MIN_START_S, clock=time.monotonic):
        self.total_s, self.min_start, self.clock = total_s, min_start, clock
        self.start = clock()

    def left(self) -> float:
        return self.total_s - (self.clock() - self.start)

    def timeout_for(self, cap: float) -> float | None:
        left = self.left()
        return None if left < self.min_start else min(cap, left)


def run_section(cmd: list[str], timeout: float, log_path: str, result_path: str) -> dict:
    """Run one section's process (its own process group, killed whole at the timeout); what it
    wrote to ``result_path`` (even partial), its status, and the tail of its log where it left none."""
    t0 = time.monotonic()
    if os.path.exists(result_path):  # an earlier run's, in the same folder
        os.remove(result_path)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its process group: what it started goes too
            except ProcessLookupError:  # it ended meanwhile
                pass
            proc.wait()
            rc = None
    out = {"seconds": round(time.monotonic() - t0, 1), "timeout_s": round(timeout, 1), "rc": rc,
           "log": os.path.relpath(log_path, os.path.dirname(os.path.dirname(log_path)))}
    if os.path.exists(result_path):
        with open(result_path) as f:
            out.update(json.load(f))
    if rc is None:
        out["status"] = "timed out"
    elif out.get("status", "running") == "running":
        out["status"] = "crashed"
    if out["status"] != "ok" and not out.get("error"):
        with open(log_path) as f:
            tail = "".join(f.readlines()[-40:]) or "(nothing logged)"
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exit status {rc}"
        out["error"] = f"{why}, during: {out.get('stage', 'start-up')}\nlast lines of its log:\n{tail}"
    return out


# ------------------------------------------------------------------------------------- environment
def _git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def _nvidia_smi() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def device_row(device_name: str | None) -> str:
    """The cost model's row for this device (autopar's ``row_for``: h200, h100, a100 by name, any
    other GPU costed as h100, said in the summary; cpu without one)."""
    from autopar.analysis.devices import row_for

    return row_for(device_name)


def environment(commit: str | None) -> dict:
    import torch

    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
           "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "commit": commit or _git_commit(), "command": " ".join(sys.argv)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError as e:
        env["triton"] = f"not importable: {e}"
    try:
        import autopar.kernels.ops
        import autopar.passes

        env["autopar"] = os.path.dirname(autopar.passes.__file__)
    except Exception as e:  # recorded; every section then fails on its own import and says why
        env["autopar"] = f"not importable: {type(e).__name__}: {e}"
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if env["device"]:
        props = torch.cuda.get_device_properties(0)
        env.update(capability=f"{props.major}.{props.minor}", device_memory=props.total_memory,
                   cudnn=torch.backends.cudnn.version(), nvidia_smi=_nvidia_smi())
    env["cost_model_row"] = device_row(env["device"])
    return env


# ---------------------------------------------------------------------------- correctness (child)
def _err(x, ref) -> float:
    """max |x - ref| relative to max |ref| (at least 1), as benchmarks/kernels_report.py measures."""
    return (x.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1.0)


def _sdpa(q, k, v, causal: bool):
    import torch.nn.functional as F

    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:  # a torch without enable_gqa: repeat the KV heads
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              is_causal=causal)


def _against_fp32(row: dict, inputs, dout, reference, sides: dict) -> dict:
    """Each side's output and input gradients (``dout`` backward) on the bf16 ``inputs``, against
    ``reference`` run in fp32 on the same values: row[SIDE_out], row[SIDE_dq] / _dk / _dv (for
    linear: dx / dw / db)."""
    import torch

    full = [t.float().requires_grad_() for t in inputs]
    ref = reference(*full)
    ref_grads = torch.autograd.grad(ref, full, dout.float())
    for name, fn in sides.items():
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, dout)
        for part, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
            row[f"{name}_{part}"] = _err(x, r)
    return row


def attention_errors(case, device: str) -> dict:
    """One attention case in bf16: autopar's kernel and PyTorch's SDPA against the fp32 reference
    (kernels/ops.py ``attention_reference``, through autograd)."""
    import torch

    import autopar.kernels.ops as ops

    b, h, hkv, s, d, causal = case
    g = torch.Generator(device).manual_seed(0)
    q, k, v, do = (torch.randn(b, n, s, d, generator=g, device=device).to(torch.bfloat16)
                   for n in (h, hkv, hkv, h))
    row = {"kernel": "attention", "case": f"B{b} H{h}/{hkv} S{s} D{d}{' causal' if causal else ''}"}
    scale = d ** -0.5
    return _against_fp32(row, (q, k, v), do, lambda *qkv: ops.attention_reference(*qkv, None, causal, scale)[0],
                         {"autopar": lambda *qkv: torch.ops.autopar.flash_attention(*qkv, None, causal, scale)[0],
                          "torch": lambda *qkv: _sdpa(*qkv, causal)})


def linear_errors(shape, act: str, device: str) -> dict:
    """linear + ``act`` with a bias in bf16: autopar's fused kernel and ``act(F.linear(...))``
    against the latter in fp32."""
    import torch
    import torch.nn.functional as F

    m, n, k = shape
    g = torch.Generator(device).manual_seed(1)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g, device=device).to(torch.bfloat16)

    def torch_side(x, w, b):
        return getattr(F, act)(F.linear(x, w, b))
    return _against_fp32({"kernel": f"linear+{act}", "case": f"[{m}, {k}] x [{n}, {k}]^T + b"}, (x, w, bias), dy,
                         torch_side, {"autopar": lambda x, w, b: torch.ops.autopar.linear_act(x, w, b, act)[0],
                                      "torch": torch_side})


def correctness(cfg: Config, out: dict, stage) -> None:
    import torch

    import autopar.kernels.ops  # noqa: F401  (registers torch.ops.autopar.*)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_float32_matmul_precision("highest")  # the reference in true fp32 (no TF32)
    out["device"] = device
    out["rows"] = rows = []
    for case in cfg.attention:
        stage(f"attention {case}")
        rows.append(attention_errors(case, device))
    for shape in cfg.linear:
        for act in ("gelu", "silu"):
            stage(f"linear + {act} {shape}")
            rows.append(linear_errors(shape, act, device))
    # flagged: an error above twice PyTorch's own bf16 error (plus 1e-3 for the tiniest ones)
    out["worse_than_torch"] = [f"{r['kernel']} {r['case']} {p}" for r in rows for p in ("out", "dq", "dk", "dv")
                               if r[f"autopar_{p}"] > 2 * r[f"torch_{p}"] + 1e-3]


def candidates(cfg: Config, out: dict, stage) -> None:
    """Each device launch configuration forced (kernels/tune.py ``force``) against the fp32
    reference, beside PyTorch's own bf16 error on the same values; the backward's dK/dV and dQ
    candidates in pairs, as tests/test_kernels.py checks them on CPU."""
    import contextlib
    import itertools

    import torch

    import autopar.kernels.ops  # noqa: F401  (registers torch.ops.autopar.*)
    from autopar.kernels import attention, matmul, tune

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_float32_matmul_precision("highest")
    out["rows"] = rows = []
    b, h, hkv, s = (1, 4, 2, 40) if cfg.smoke else (4, 32, 8, 1024)

    def record(row, fn):
        try:
            with contextlib.ExitStack() as stack:
                for kernel, c in row.pop("forced").items():
                    stack.enter_context(tune.force(kernel, c))
                fn(row)
        except Exception as e:  # noqa: BLE001 - a configuration this chip cannot run: recorded
            lines = [ln for ln in str(e).splitlines() if ln.strip()]  # (a compile error's cause is its last line)
            row["error"] = f"{type(e).__name__}: " + (" ... ".join(dict.fromkeys([lines[0], lines[-1]]))[:400]
                                                     if lines else "")
        rows.append(row)

    for d in (64, 128):
        for causal in (True, False):
            case = (b, h, hkv, s, d, causal)
            for c in attention.FWD[d]:
                stage(f"attention forward {c} D{d}{' causal' if causal else ''}")
                label = f"B{b} H{h}/{hkv} S{s} D{d}{' causal' if causal else ''}"
                record({"kernel": "attention_fwd", "config": str(c), "case": label,
                        "forced": {"attention_fwd": c}},
                       lambda row: row.update(_fwd_errors(case, device)))
            for ckv, cq in itertools.zip_longest(attention.DKDV[d], attention.DQ[d]):  # (the shorter's first fills in)
                ckv, cq = ckv or attention.DKDV[d][0], cq or attention.DQ[d][0]
                stage(f"attention backward {ckv} / {cq} D{d}{' causal' if causal else ''}")
                record({"kernel": "attention_bwd", "config": f"{ckv} / {cq}", "case": case,
                        "forced": {"attention_bwd_dkdv": ckv, "attention_bwd_dq": cq}},
                       lambda row: row.update(attention_errors(case, device)))
    shape = (64, 70, 40) if cfg.smoke else (4096, 4096, 4096)
    for c in matmul.CANDIDATES:
        stage(f"linear + gelu {c}")
        record({"kernel": "linear+gelu", "config": str(c), "case": "x".join(map(str, shape)), "forced": {"matmul": c}},
               lambda row: row.update(linear_errors(shape, "gelu", device)))
    # wrong: an error above twice PyTorch's own (+1e-3), as the correctness section flags them
    out["wrong"] = [f"{r['kernel']} {r['config']} {r['case']} {p}" for r in rows if "error" not in r
                    for p in ("out", "dq", "dk", "dv") if f"autopar_{p}" in r
                    and r[f"autopar_{p}"] > 2 * r[f"torch_{p}"] + 1e-3]
    out["failed"] = [f"{r['kernel']} {r['config']}: {r['error']}" for r in rows if "error" in r]


def _fwd_errors(case, device: str) -> dict:
    """The forward alone (out), autopar's and SDPA's, against the fp32 reference."""
    import torch

    import autopar.kernels.ops as ops

    b, h, hkv, s, d, causal = case
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=g, device=device).to(torch.bfloat16) for n in (h, hkv, hkv))
    with torch.no_grad():
        ref = ops.attention_reference(q.float(), k.float(), v.float(), None, causal, d ** -0.5)[0]
        mine = torch.ops.autopar.flash_attention(q, k, v, None, causal, d ** -0.5)[0]
        theirs = _sdpa(q, k, v, causal)
    return {"autopar_out": _err(mine, ref), "torch_out": _err(theirs, ref)}


# ----------------------------------------------------------------------------- kernel table (child)
def kernel_table(cfg: Config, out: dict, out_dir: str, stage) -> None:
    from autopar.tools import kernelbench

    stage(f"autopar bench --kernels, sequences {cfg.kernel_seqs}")
    before = set(os.listdir(out_dir))
    args = argparse.Namespace(smoke=cfg.smoke, kernel_seqs=cfg.kernel_seqs, out=out_dir)
    out["rc"] = kernelbench.main(args)
    out["files"] = sorted(set(os.listdir(out_dir)) - before)


def kernel_profile(cfg: Config, out: dict, out_dir: str, stage) -> None:
    """Where a short-sequence forward call's time goes, each side (autopar/tools/kernelbench.py
    ``host_profile``): wall, host and device milliseconds per call; the profiler's table in
    host-profile.txt."""
    from autopar.tools import kernelbench

    stage("torch.profiler: forward calls back to back, S1024")
    out["rows"] = kernelbench.host_profile(out_dir, smoke=cfg.smoke)


# ------------------------------------------------------------------------------- whole step (child)
def model_flops(model: dict, batch: int, seq: int, multiplying_params: int) -> dict:
    tokens = batch * seq
    dense = 6 * multiplying_params * tokens
    attention = 12 * model["n_layers"] * seq * model["dim"] * tokens
    return {"flops": dense + attention // 2, "flops_palm": dense + attention, "tokens": tokens}


def _build(cfg: Config, device: str):
    """The same model (seeded init on the device) and the same batches in every process."""
    import torch

    from autopar.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(LlamaConfig(**cfg.model, max_seq_len=cfg.seq))
    g = torch.Generator(device).manual_seed(1)
    batches = [tuple(torch.randint(0, cfg.model["vocab_size"], (cfg.batch, cfg.seq), generator=g, device=device)
                     for _ in range(2)) for _ in range(3)]
    return model, batches


def adamw(params, optimizer: str):
    """torch's AdamW as ``optimizer`` names it (cost.OPTIMIZER_ACCESSES): "adamw" (torch's default
    implementation) or "adamw-fused" (``fused=True``)."""
    import torch

    return torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if optimizer == "adamw-fused" else {}))


def _autopar_step(model, batches, kernels: str, inductor: bool, out: dict, row, stage, calibrated=None,
                  optimizer: str = "adamw"):
    import autopar
    from autopar.analysis import cost
    from autopar.kernels import choice
    from autopar.models.llama import cross_entropy

    t0 = time.perf_counter()
    pm = autopar.compile(model, autopar.mesh(dp=1), example_inputs=batches[0], loss_fn=cross_entropy,
                         plan={"dp": "ddp"}, precision="bf16", kernels=kernels, inductor=inductor,
                         capture_eval=False, progress=lambda s: stage(f"autopar.compile: {s}"))
    out["compile_s"] = time.perf_counter() - t0
    out["lowered"] = dict(pm.ctx.lowered)
    out["kernel_choices"] = choice.summary(pm.ctx.kernel_choices)  # kernels="auto": both sides' times
    stage("cost model")
    dev = cost.get_device(row)
    memory = cost.predict_memory(pm, optimizer)
    op_by_op = cost.predict_time(pm, dev, optimizer, fused=False)
    out["predicted"] = {"device_row": row, "step_peak": memory["step_peak"],
                        "program_peak": memory["program_peak"],
                        "step_s_op_by_op": op_by_op.step_s, "optimizer_s": op_by_op.optimizer_s,
                        "unknown_flops": op_by_op.unknown_flops[:5],  # ops costed by their bytes alone
                        "step_s_inductor": cost.predict_time(pm, dev, optimizer, fused=True).step_s}
    out["predicted"]["step_s_as_run"] = out["predicted"]["step_s_inductor" if inductor else "step_s_op_by_op"]
    if calibrated is not None:  # the same program costed with this GPU's measured row (the calibrate section)
        out["predicted"]["calibrated"] = {"device_row": calibrated.name, "step_s_as_run": cost.predict_time(
            pm, calibrated, optimizer, fused=inductor).step_s}
    opt = adamw(pm.parameters(), optimizer)

    def step(x, y):
        loss = pm.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _torch_step(model, device: str, compiled: bool, optimizer: str = "adamw"):
    import torch

    from autopar.models.llama import cross_entropy

    fwd = torch.compile(model) if compiled else model
    opt = adamw(model.parameters(), optimizer)

    def step(x, y):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


CALIBRATED_ROW = "calibrated-row.json"  # the calibrate section's row (out_dir): the steps' second prediction


def calibrate_device(cfg: Config, out: dict, out_dir: str, stage) -> None:
    """``autopar calibrate --device cuda``'s row for this GPU (measured matmul rate, HBM bandwidth,
    launch gap; links from the datasheet row), kept for the step sections, which predict with it
    beside the datasheet row. Without a GPU (--smoke on a CPU): the CPU's row, no gloo."""
    import torch

    from autopar.tools import calibrate

    stage("measuring")
    row = calibrate.calibrate_gpu() if torch.cuda.is_available() else calibrate.calibrate("cpu-calibrated", comm=False)
    out["row"] = row
    with open(os.path.join(out_dir, CALIBRATED_ROW), "w") as f:
        json.dump(row, f, indent=1)
    stage("grouped-query SDPA against repeated K/V heads")
    out["gqa_sdpa"] = gqa_sdpa(cfg)


def gqa_sdpa(cfg: Config) -> dict:
    """The masks pass's grouped-query rewrite on this device: SDPA forward + backward at the step's
    attention shape with ``enable_gqa=True`` (K/V at their own head count, what autopar's program
    calls since 2026-11-27) against the model's own code (K/V heads repeated, then SDPA), each
    timed by kernelbench's CUDA events, calls back to back."""
    import torch
    import torch.nn.functional as F

    from autopar.tools.kernelbench import _time

    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    m = cfg.model
    b, h, hkv, s, d = cfg.batch, m["n_heads"], m["n_kv_heads"], cfg.seq, m["dim"] // m["n_heads"]
    g = torch.Generator(dev).manual_seed(0)
    q = torch.randn(b, h, s, d, device=dev, dtype=dt, generator=g).requires_grad_()
    k, v = (torch.randn(b, hkv, s, d, device=dev, dtype=dt, generator=g).requires_grad_() for _ in range(2))
    dout = torch.randn(b, h, s, d, device=dev, dtype=dt, generator=g)

    def grouped():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)

    def repeated():
        r = h // hkv
        F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1),
                                       is_causal=True).backward(dout)
    times = {}
    for _ in range(2):  # alternating sides
        for name, fn in (("grouped", grouped), ("repeated", repeated)):
            times.setdefault(name, []).append(_time(fn, 3 if cfg.smoke else 20, cuda))
    res = {"shape": f"B{b} H{h}/{hkv} S{s} D{d} causal {dt}",
           **{f"{n}_ms": min(t) * 1e3 for n, t in times.items()}}
    res["grouped_over_repeated"] = res["grouped_ms"] / res["repeated_ms"]
    if cuda:  # which backend each side gets (the profiler's kernel names)
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("grouped", grouped), ("repeated", repeated)):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            res[f"{name}_kernels"] = sorted({e.key for e in prof.key_averages() if "attention" in e.key.lower()
                                             or "fmha" in e.key.lower() or "flash" in e.key.lower()
                                             or "sdpa" in e.key.lower()})[:6]
    return res


def _calibrated(out_dir: str):
    from autopar.analysis.devices import Device

    path = os.path.join(out_dir, CALIBRATED_ROW)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return Device(**json.load(f))


def train_step(cfg: Config, variant: str, out: dict, stage, out_dir: str = "") -> None:
    """One variant: build, (compile,) the first step, then kernelbench's timing (2 warm-up steps,
    ``cfg.reps`` timed ones, the median) with the allocator's peak reset after the first step."""
    import torch

    from autopar.analysis.devices import get_device
    from autopar.tools.kernelbench import _time

    system, kernels, inductor = VARIANTS[variant]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    row = device_row(torch.cuda.get_device_name() if cuda else None)
    out.update(system=system, kernels=kernels, inductor=inductor, device=device, batch=cfg.batch, seq=cfg.seq,
               optimizer=cfg.optimizer)
    stage("building the model")
    model, batches = _build(cfg, device)
    n = sum(p.numel() for p in model.parameters())
    out.update(parameters=n, **model_flops(cfg.model, cfg.batch, cfg.seq, n - model.embed_tokens.weight.numel()))
    step = (_autopar_step(model, batches, kernels, inductor, out, row, stage, _calibrated(out_dir), cfg.optimizer)
            if system == "autopar"
            else _torch_step(model, device, system == "torch.compile", cfg.optimizer))
    out["losses"] = losses = []

    def one():
        x, y = batches[len(losses) % len(batches)]
        losses.append(step(x, y).item())

    stage("first step" + (" (torch.compile compiles)" if system == "torch.compile" else ""))
    t0 = time.perf_counter()
    one()
    out["first_step_s"] = time.perf_counter() - t0
    stage(f"timed steps (2 warm-up, {cfg.reps} timed)")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    out["step_s"] = _time(one, cfg.reps, cuda, back_to_back=False)  # each step alone (it syncs on its loss)
    out["allocator_peak"] = torch.cuda.max_memory_allocated() if cuda else None
    n = [0]  # (after the peak: the per-step figures above are the issue's)

    def quiet():  # the loss not read: steps issued back to back, as a loop that logs every N steps runs them
        x, y = batches[n[0] % len(batches)]
        n[0] += 1
        step(x, y)
    stage(f"steps back to back ({cfg.reps} a round)")
    out["step_s_back_to_back"] = _time(quiet, cfg.reps, cuda, back_to_back=True)
    if cuda:
        stage("one step under torch.profiler (device time by kind of kernel)")
        out["kernel_ms"] = kernel_kinds(one)
    if system == "autopar" and kernels != "off":
        from autopar.kernels import tune

        out["launch_configurations"] = tune.chosen()  # the kernels' block sizes per shape, chosen by timing
    peak = get_device(row).flops["bf16"]
    per_s = 1 / out["step_s"]
    out.update(peak_flops=peak, mfu=out["flops"] * per_s / peak, mfu_palm=out["flops_palm"] * per_s / peak,
               tokens_per_s=out["tokens"] * per_s)
    pred = out.get("predicted")
    if pred and cuda:
        pred["step_s_ratio"] = out["step_s"] / pred["step_s_as_run"]
        if "calibrated" in pred:
            pred["calibrated"]["step_s_ratio"] = out["step_s"] / pred["calibrated"]["step_s_as_run"]
        pred["peak_ratio"] = out["allocator_peak"] / pred["step_peak"]


KERNEL_KINDS = (("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
                ("attention", ("fmha", "flash", "sdpa", "attention")),
                ("optimizer", ("multi_tensor", "adam")),
                ("Triton (generated)", ("triton",)))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KERNEL_KINDS if any(x in low for x in keys)), "ATen elementwise / other")


def kernel_kinds(fn) -> dict:
    """Device ms of one ``fn()`` by kind of kernel (``KERNEL_KINDS``, by the kernel's name), and
    the wall time it took: where a step's time goes, side by side for every system."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kinds = {"wall": (time.perf_counter() - t0) * 1e3}
    top = []
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA:
            t = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)) / 1e3
            k = kernel_kind(e.key)
            kinds[k] = kinds.get(k, 0.0) + t
            top.append({"kernel": e.key[:120], "kind": k, "ms": t, "calls": e.count})
    kinds["top"] = sorted(top, key=lambda r: -r["ms"])[:15]  # (not a kind: the summary skips it)
    return kinds


def planner_forks(out: dict, stage) -> None:
    """``autopar plan`` on a model whose every depth is traced, the fork forced: as it is, and with
    the GPUs hidden from the process; what each run's forked child did."""
    import tempfile

    spec = os.path.join(ROOT, "tests", "foreign_models.py") + ":alternating"
    for label, extra in (("as is", {}), ("CUDA_VISIBLE_DEVICES=", {"CUDA_VISIBLE_DEVICES": ""})):
        stage(f"autopar plan {spec} ({label})")
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "AUTOPAR_PLAN_FORK": "always", "AUTOPAR_CACHE_DIR": cache, **extra}
            t0 = time.perf_counter()
            run = subprocess.run([sys.executable, "-m", "autopar.tools.cli", "plan", spec, "--mesh", "dp=2",
                                  "--plan", "dp=fsdp", "--json"], capture_output=True, text=True, env=env,
                                 cwd=ROOT, timeout=120)
        row = {"env": label, "rc": run.returncode, "seconds": round(time.perf_counter() - t0, 1)}
        if run.returncode == 0:  # (the report's own record of the fork: autopar/tools/extrapolate.py)
            ext = json.loads(run.stdout)[0]["extrapolated"]
            row.update(forked=ext["forked"], child_failed=ext.get("fork_failed"))
        else:
            row["stderr"] = run.stderr[-2000:]
        out.setdefault("rows", []).append(row)


class Record:
    """A section's record, rewritten at every stage (sections/SECTION.json): a section killed at its
    timeout leaves what it had measured and the stage it was in."""

    def __init__(self, path: str):
        self.path, self.t0 = path, time.perf_counter()
        self.data = {"status": "running", "stage": "started", "result": {}}

    def stage(self, name: str) -> None:
        self.data["stage"] = name
        print(f"[{time.perf_counter() - self.t0:6.1f} s] {name}", flush=True)
        self.save()

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(self.path + ".tmp", self.path)


def child(section: str, cfg: Config, out_dir: str) -> int:
    """Run ``section`` in this process; its record goes to sections/SECTION.json whatever happens
    (the parts done before a failure, and its traceback)."""
    rec = Record(os.path.join(out_dir, "sections", f"{section}.json"))
    out = rec.data["result"]
    try:
        if section == "correctness":
            correctness(cfg, out, rec.stage)
        elif section == "candidates":
            candidates(cfg, out, rec.stage)
        elif section == "kernel-table":
            kernel_table(cfg, out, out_dir, rec.stage)
        elif section == "kernel-profile":
            kernel_profile(cfg, out, out_dir, rec.stage)
        elif section == "calibrate":
            calibrate_device(cfg, out, out_dir, rec.stage)
        elif section == "planner-forks":
            planner_forks(out, rec.stage)
        else:
            train_step(cfg, section.removeprefix("step-"), out, rec.stage, out_dir)
        rec.data["status"] = "ok"
    except BaseException:  # noqa: B036 - recorded, then the process ends with an error status
        rec.data.update(status="failed", error=traceback.format_exc())
        print(rec.data["error"], flush=True)
    rec.stage("done")
    return 0 if rec.data["status"] == "ok" else 1


# ---------------------------------------------------------------------------------------- summary
def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:,.1f}"


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}" if b >= 2**28 else f"{b / 2**20:.2f} MiB"


def _correctness_lines(res: dict) -> list[str]:
    lines = ["| kernel | case | out: autopar / torch | dq (dx) | dk (dw) | dv (db) |", "|---|---|---|---|---|---|"]
    for r in res.get("rows", []):
        lines.append(f"| {r['kernel']} | {r['case']} | " + " | ".join(
            f"{r[f'autopar_{p}']:.1e} / {r[f'torch_{p}']:.1e}" for p in ("out", "dq", "dk", "dv")) + " |")
    worse = res.get("worse_than_torch")
    if worse is not None:
        lines.append("")
        lines.append("autopar's error above twice PyTorch's (+1e-3): " + (", ".join(worse) if worse else "none"))
    return lines


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _step_lines(record: dict) -> list[str]:
    steps = {name: s for name, s in record["sections"].items() if name.startswith("step-")}
    eager = steps.get("step-eager", {}).get("result", {}).get("losses") or []
    lines = ["| system | status | compile + first step s | median step ms | back to back ms | tokens/s | MFU | "
             "allocator peak GiB | predicted step ms as run (op by op / Inductor) | measured / predicted | "
             "predicted peak GiB | measured / predicted | losses, first 3 | max diff vs eager |", "|---" * 14 + "|"]
    for name, s in steps.items():
        r = s.get("result", {})
        p = r.get("predicted") or {}
        losses = r.get("losses") or []
        diff = max((abs(a - b) for a, b in zip(losses[:3], eager[:3])), default=None)
        pred_t = "-" if not p else \
            f"{_ms(p['step_s_as_run'])} ({_ms(p['step_s_op_by_op'])} / {_ms(p['step_s_inductor'])})"
        first = _fmt(r.get("first_step_s"), ".1f")
        cells = [name.removeprefix("step-"), s["status"],
                 f"{r['compile_s']:.1f} + {first}" if "compile_s" in r else first, _ms(r.get("step_s")),
                 _ms(r.get("step_s_back_to_back")), _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get("mfu"), ".1%"), _gib(r.get("allocator_peak")),
                 pred_t, _fmt(p.get("step_s_ratio"), ".2f"), _gib(p.get("step_peak")),
                 _fmt(p.get("peak_ratio"), ".3f"),
                 ", ".join(f"{x:.4f}" for x in losses[:3]) or "-", _fmt(diff, ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    calibrated = [(n, s["result"]["predicted"]["calibrated"]) for n, s in steps.items()
                  if "calibrated" in (s.get("result", {}).get("predicted") or {})]
    if calibrated:
        lines += ["", "Predicted with the calibrate section's measured row instead (" + calibrated[0][1]["device_row"]
                  + "): " + "; ".join(f"{n.removeprefix('step-')} {_ms(c['step_s_as_run'])} ms (measured / predicted "
                                      f"{_fmt(c.get('step_s_ratio'), '.2f')})" for n, c in calibrated) + "."]
    unknown = sorted({u for s in steps.values() for u in (s.get("result", {}).get("predicted") or {}).get(
        "unknown_flops", [])})
    if unknown:
        lines += ["", "Ops the cost model could not count the FLOPs of (costed by their bytes alone): "
                  + "; ".join(unknown) + "."]
    lowered = {n.removeprefix("step-"): s["result"]["lowered"] for n, s in steps.items()
               if "lowered" in s.get("result", {})}
    if lowered:
        lines += ["", "Rewritten into autopar's kernels (the lower pass, per rule): " + "; ".join(
            f"{n} {d or 'nothing'}" for n, d in lowered.items()) + "."]
    kinds = {n.removeprefix("step-"): s["result"]["kernel_ms"] for n, s in steps.items()
             if s.get("result", {}).get("kernel_ms")}
    if kinds:
        cols = [k for k, _ in KERNEL_KINDS] + ["ATen elementwise / other"]
        lines += ["", "One step under torch.profiler, device ms by kind of kernel (by the kernel's name; wall: the "
                  "profiled step's own time):", "", "| system | " + " | ".join(cols) + " | all kernels | wall |",
                  "|---" * (len(cols) + 3) + "|"]
        for n, k in kinds.items():
            lines.append(f"| {n} | " + " | ".join(f"{k.get(c, 0.0):.1f}" for c in cols)
                         + f" | {sum(v for c, v in k.items() if c not in ('wall', 'top')):.1f} | {k['wall']:.1f} |")
    for name, s in steps.items():
        for c in s.get("result", {}).get("kernel_choices") or []:
            lines.append(f"- {name.removeprefix('step-')}: kernels='auto' decided {c}")
        for t in s.get("result", {}).get("launch_configurations") or []:
            lines.append(f"- {name.removeprefix('step-')}: {t['kernel']} {t['key']}: {t['chosen']}")
    return lines


def summary_md(record: dict) -> str:
    env, meta = record["env"], record["meta"]
    where = env.get("device") or "CPU"
    smoke = " (SMOKE: tiny shapes, nothing here is a GPU figure)" if meta["smoke"] else ""
    lines = [f"# gpu_check: {where}, {env.get('date', '?')}{smoke}", "",
             f"commit {env.get('commit')}; torch {env.get('torch')} (CUDA {env.get('cuda')}), "
             f"Triton {env.get('triton')}, Python {env.get('python')}; cost model row "
             f"`{env.get('cost_model_row')}`; autopar.passes from {env.get('autopar')}"
             + (f"; nvidia-smi: {env['nvidia_smi']}" if env.get("nvidia_smi") else ""),
             f"command: `{env.get('command')}`; {meta.get('seconds', 0):.0f} s of a {meta['budget_s']:.0f} s "
             "budget",
             "", "| section | status | seconds (timeout) | log |", "|---|---|---|---|"]
    if "error" in env:
        lines.insert(2, "environment: FAILED (below)")
    for name, s in record["sections"].items():
        lines.append(f"| {name} | {s['status']} | {s.get('seconds', '-')} ({s.get('timeout_s', '-')}) | "
                     f"{s.get('log', '-')} |")
    corr = record["sections"].get("correctness", {}).get("result")
    if corr:
        lines += ["", "## Kernels against fp32 (bf16 inputs; max |error| / max |fp32 reference|, autopar / "
                  "PyTorch)", ""] + _correctness_lines(corr)
    cand = record["sections"].get("candidates", {}).get("result", {})
    if cand.get("rows"):
        lines += ["", "## Every launch configuration the tuner may pick, forced (max |error| / max |fp32|, "
                  "autopar / PyTorch)", "", "| kernel | configuration | case | out | dq (dx) | dk (dw) | dv (db) |",
                  "|---|---|---|---|---|---|---|"]
        for r in cand["rows"]:
            cells = ["error: " + r["error"]] if "error" in r else [
                f"{r[f'autopar_{p}']:.1e} / {r[f'torch_{p}']:.1e}" if f"autopar_{p}" in r else "-"
                for p in ("out", "dq", "dk", "dv")]
            lines.append(f"| {r['kernel']} | {r['config']} | {r['case']} | " + " | ".join(cells) + " |")
        lines += ["", "wrong (above twice PyTorch's error + 1e-3): " + (", ".join(cand.get("wrong", [])) or "none"),
                  "", "could not run: " + (", ".join(cand.get("failed", [])) or "none")]
    table = record["sections"].get("kernel-table", {}).get("result", {})
    for name in table.get("files", []):
        if name.endswith(".md"):
            with open(os.path.join(meta["out"], name)) as f:
                lines += ["", f"## Kernel speed (`autopar bench --kernels`, {name})", "", f.read().strip()]
    prof = record["sections"].get("kernel-profile", {}).get("result", {}).get("rows")
    if prof:
        lines += ["", "## One forward call, back to back (torch.profiler; host-profile.txt)", "",
                  "| side | shape | wall ms per call | host ms (the op's outermost event) | device ms (kernels) | "
                  "host issue ms per call: as timed / no_grad / kernel module alone |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['side']} | {r['shape']} | {r['wall_ms_per_call']:.3f} | "
                  f"{_fmt(r['host_ms_per_call'], '.3f')} | "
                  f"{r['device_ms_per_call']:.3f} | {_fmt(r.get('issue_ms_per_call'), '.3f')} / "
                  f"{_fmt(r.get('issue_ms_no_grad'), '.3f')} / {_fmt(r.get('issue_ms_kernel_module'), '.3f')} |"
                  for r in prof]
        for r in prof:
            if r.get("kernels"):
                lines += ["", f"{r['side']}, {r['shape']}, device ms per call by kernel: " + ", ".join(
                    f"{k['name']} {k['ms']:.3f}" for k in r["kernels"])]
    forks = record["sections"].get("planner-forks", {}).get("result", {}).get("rows")
    if forks:
        lines += ["", "## `autopar plan`'s forked children (tests/foreign_models.py:alternating, fork forced)", "",
                  "| environment | exit | seconds | forked | the child's failure |", "|---|---|---|---|---|"]
        lines += [f"| {r['env']} | {r['rc']} | {r['seconds']} | {r.get('forked', '-')} | "
                  f"{(r.get('child_failed') or '-')[:160]} |" for r in forks]
    cal = record["sections"].get("calibrate", {}).get("result", {}).get("row")
    if cal:
        from autopar.analysis.devices import Device

        lines += ["", "## This GPU, measured (`autopar calibrate --device cuda`)", "", Device(**cal).describe()]
    gqa = record["sections"].get("calibrate", {}).get("result", {}).get("gqa_sdpa")
    if gqa:
        lines += ["", f"Grouped-query SDPA, forward + backward, {gqa['shape']}: enable_gqa=True "
                  f"{gqa['grouped_ms']:.3f} ms against K/V heads repeated then SDPA {gqa['repeated_ms']:.3f} ms "
                  f"({gqa['grouped_over_repeated']:.2f}x); kernels: grouped {gqa.get('grouped_kernels', '-')}, "
                  f"repeated {gqa.get('repeated_kernels', '-')}."]
    if any(n.startswith("step-") for n in record["sections"]):
        m = meta["model"]
        lines += ["", f"## Whole step: Llama {m}, batch {meta['batch']} x {meta['seq']}, bf16, "
                  + ("AdamW(fused=True)" if meta.get("optimizer") == "adamw-fused" else "AdamW (torch's default)")
                  + ", one rank",
                  "", "eager and torch.compile under autocast(bf16) from fp32 parameters; autopar "
                  "precision='bf16' (fp32 master parameters), plan dp=1 ddp. Median of the timed steps; "
                  "MFU = (6 N T + 6 L S dim T) / step time / dense bf16 peak (N: parameters but the embedding "
                  "table; attention halved for the causal mask). Allocator peak: torch.cuda.max_memory_allocated "
                  "over the timed steps; predicted peak: the cost model's step peak (parameters + AdamW state + "
                  "the program's liveness peak).", ""]
        lines += _step_lines(record)
        row = env.get("cost_model_row", "h100")
        lines += ["", "The cost model's figures without a GPU (meta tensors, the model compiled at depths 3-5 and "
                  f"extrapolated): `autopar plan llama-tiny --set {','.join(f'{k}={v}' for k, v in m.items())} "
                  f"--mesh dp=1 --batch {meta['batch']} --seq {meta['seq']} --precision bf16 --device {row} "
                  "[--inductor] [--kernels on]`."]
    failed = {n: s for n, s in record["sections"].items() if s.get("error")}
    if "error" in env:
        failed = {"env": env, **failed}
    if failed:
        lines += ["", "## Failed or not run"]
        for name, s in failed.items():
            lines += ["", f"### {name} ({s.get('status', 'failed')})", "", "```", s["error"].rstrip()[-4000:],
                      "```"]
    return "\n".join(lines) + "\n"


def write_summary(out_dir: str, record: dict) -> None:
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(summary_md(record))


# ------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for summary.md / .json, kernels-DATE.*, logs")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton's interpreter, a tiny Llama)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for the whole run (default 420; --smoke: 900, and each section's cap x3)")
    ap.add_argument("--commit", default=None,
                    help="the checkout's commit (default: git's; the GPU machine's copy has no .git)")
    ap.add_argument("--only", nargs="+", default=None, choices=[n for n, _ in SECTIONS],
                    help="run these sections only (in the usual order)")
    ap.add_argument("--kernel-seqs", type=int, nargs="+", default=None,
                    help="kernel-table sequence lengths (default autopar bench --kernels': 512 ... 8192)")
    ap.add_argument("--optimizer", choices=("adamw", "adamw-fused"), default="adamw",
                    help="the steps' optimizer on every side: torch's default AdamW (default) or AdamW(fused=True)")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a section's own process
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = config(args.smoke)
    if args.kernel_seqs:
        cfg.kernel_seqs = args.kernel_seqs
    cfg.optimizer = args.optimizer
    out_dir = os.path.abspath(args.out)
    if args.section:
        return child(args.section, cfg, out_dir)
    for sub in ("sections", "logs"):
        os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
    # kernels="auto"'s measurements (kernels/choice.py), filled by the kernel table and the steps: kept with the run
    os.environ.setdefault("AUTOPAR_CACHE_DIR", os.path.join(out_dir, "cache"))
    if args.budget_s is None:
        args.budget_s = 900.0 if args.smoke else 420.0
    budget = Budget(args.budget_s)
    record = {"meta": {"budget_s": args.budget_s, "smoke": args.smoke, "out": out_dir, "model": cfg.model,
                       "batch": cfg.batch, "seq": cfg.seq, "optimizer": cfg.optimizer, "seconds": 0.0}, "env": {}, "sections": {}}
    try:
        record["env"] = environment(args.commit)
    except Exception:
        record["env"] = {"error": traceback.format_exc(), "commit": args.commit}
    write_summary(out_dir, record)
    for name, cap in SECTIONS:
        if args.only and name not in args.only:
            continue
        timeout = budget.timeout_for(cap * (SMOKE_CAP_SCALE if args.smoke else 1))
        if timeout is None:
            left = max(0.0, budget.left())
            record["sections"][name] = {"status": "skipped",
                                        "error": f"not started: {left:.0f} s left of the {args.budget_s:.0f} s budget"}
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--out", out_dir] + \
                  (["--smoke"] if args.smoke else []) + \
                  (["--kernel-seqs", *map(str, args.kernel_seqs)] if args.kernel_seqs else []) + \
                  ["--optimizer", args.optimizer]
            record["sections"][name] = run_section(cmd, timeout, os.path.join(out_dir, "logs", f"{name}.log"),
                                                   os.path.join(out_dir, "sections", f"{name}.json"))
        record["meta"]["seconds"] = args.budget_s - budget.left()
        s = record["sections"][name]
        print(f"[{record['meta']['seconds']:5.0f} s] {name}: {s['status']}"
              + (f" ({s['seconds']} s)" if "seconds" in s else ""), flush=True)
        write_summary(out_dir, record)
    print(f"wrote {os.path.join(out_dir, 'summary.md')} and summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
